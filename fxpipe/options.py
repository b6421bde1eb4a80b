"""The options of a plan and of a run: one frozen record each, every option checked once.

The public functions (``fxpipe.plan``, ``fxpipe.pipeline``, ``fxpipe.distributed.
pipeline_schedule``) keep their keyword signatures and build these records; everything
below them takes the records, so a new option is added in one place and checked in one
place. The choices themselves are the ``Literal`` types of :mod:`fxpipe.ir`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from fxpipe.devices.budgets import MaxMemory, Speed, parse_max_memory, parse_speed
from fxpipe.devices.targets import parse_device
from fxpipe.errors import ConfigError
from fxpipe.ir import (
    CHECKPOINT_MODES,
    COST_MODES,
    TRACERS,
    TRAFFIC,
    CheckpointMode,
    CostMode,
    PricingMode,
    TracerName,
    Traffic,
)

__all__ = ["PlanOptions", "RunOptions", "CostChoice", "default_chunks"]

#: A cost mode, or a callable pricing one fx node.
CostChoice = CostMode | Callable[[fx.Node], float]


@dataclass(frozen=True)
class PlanOptions:
    """How a model is planned: pricing, tracing and the search. Checked when made."""

    #: How nodes are priced (see :data:`fxpipe.ir.CostMode`) or a callable.
    cost: CostChoice = "auto"
    tracer: TracerName = "auto"
    #: Micro-batches per batch that memory estimates and the bubble assume (None: default).
    chunks: int | None = None
    #: Which micro-batches are checkpointed in the run the memory estimates are for.
    checkpoint: CheckpointMode = "except_last"
    #: Fraction the bottleneck may grow where that sends fewer bytes between stages.
    slack: float = 0.0
    #: How boundary values travel: straight to every reader, or relayed stage by stage.
    traffic: Traffic = "direct"
    #: Bytes each device's stages may use (:mod:`fxpipe.devices.budgets`; None: present devices'
    #: capacities). Kept in its checked form, :class:`fxpipe.devices.budgets.DeviceValues`.
    max_memory: MaxMemory = None
    #: Relative throughput of each device (:mod:`fxpipe.devices.budgets`; None: all equal).
    speed: Speed = None
    #: Every stage reading a shared weight (a tied embedding and head) holds it, rather
    #: than receiving it from the first with every micro-batch: for runtimes that sum the
    #: copies' gradients once per step (one process per stage).
    replicate_weights: bool = False
    #: Compute outputs that reduce over the batch (a loss inside the model) from partial
    #: sums per micro-batch (:mod:`fxpipe.passes.batch.reductions`); False refuses them, for
    #: runtimes that hand each micro-batch's output to a loss function of their own.
    reductions: bool = True

    def __post_init__(self) -> None:
        check_cost(self.cost)
        check_choice("tracer", self.tracer, TRACERS)
        check_chunks(self.chunks)
        check_choice("checkpoint", self.checkpoint, CHECKPOINT_MODES)
        check_slack(self.slack)
        check_choice("traffic", self.traffic, TRAFFIC)
        object.__setattr__(self, "max_memory", parse_max_memory(self.max_memory))
        object.__setattr__(self, "speed", parse_speed(self.speed))
        if not isinstance(self.replicate_weights, bool):
            raise ConfigError(f"replicate_weights={self.replicate_weights!r} must be a bool")
        if not isinstance(self.reductions, bool):
            raise ConfigError(f"reductions={self.reductions!r} must be a bool")

    def pricing(self) -> PricingMode | Callable[[fx.Node], float]:
        """The cost mode the pricing pass runs: ``"auto"`` is the analytic roofline, the same
        plan on every run, rank and machine load."""
        return "roofline" if self.cost == "auto" else self.cost

    def micro_batches(self, stages: int, batch: int) -> int:
        """How many micro-batches the example batch of ``batch`` samples runs as: ``chunks``
        (at most one per sample), or the default for ``stages`` stages."""
        return min(self.chunks, batch) if self.chunks else default_chunks(stages, batch)


@dataclass(frozen=True)
class RunOptions:
    """How a built pipeline runs its micro-batches. Checked when made."""

    #: Micro-batches per batch (None: the plan's).
    chunks: int | None = None
    checkpoint: CheckpointMode = "except_last"
    deferred_batch_norm: bool = False
    #: Where outputs are gathered (None: the first tensor argument's device).
    output_device: torch.device | None = None

    def __post_init__(self) -> None:
        check_chunks(self.chunks)
        check_choice("checkpoint", self.checkpoint, CHECKPOINT_MODES)
        if not isinstance(self.deferred_batch_norm, bool):
            raise ConfigError(
                f"deferred_batch_norm={self.deferred_batch_norm!r} must be True or False"
            )

    @staticmethod
    def of(
        *,
        chunks: int | None,
        checkpoint: CheckpointMode,
        deferred_batch_norm: bool,
        output_device: str | int | torch.device | None,
    ) -> RunOptions:
        """The record from the public keywords (``output_device`` parsed)."""
        device = None if output_device is None else parse_device(output_device)
        return RunOptions(chunks, checkpoint, deferred_batch_norm, device)


def default_chunks(stages: int, batch: int) -> int:
    """Four micro-batches per stage (a bubble of about 20%), at most one per sample."""
    return max(1, min(4 * stages, batch))


def check_choice(name: str, value: object, choices: tuple[str, ...]) -> None:
    """ConfigError unless ``value`` is one of ``choices``."""
    if not isinstance(value, str) or value not in choices:
        raise ConfigError(f"{name}={value!r} is not one of {choices}; pick one of them")


def check_cost(cost: object) -> None:
    """ConfigError unless ``cost`` is a cost mode or a callable."""
    if callable(cost):
        return
    if not isinstance(cost, str) or cost not in COST_MODES:
        raise ConfigError(
            f"cost={cost!r} is not one of {COST_MODES} or a callable (node) -> float; "
            "pick one of them"
        )


def check_chunks(chunks: Any) -> None:
    """ConfigError unless ``chunks`` is None or a whole number >= 1."""
    bad = isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1
    if chunks is not None and bad:
        raise ConfigError(f"chunks={chunks!r} must be a whole number >= 1 (or None for a default)")


def check_slack(slack: Any) -> None:
    """ConfigError unless ``slack`` is a finite number >= 0."""
    number = isinstance(slack, int | float) and not isinstance(slack, bool)
    if not number or not math.isfinite(slack) or slack < 0:
        raise ConfigError(
            f"slack={slack!r} must be a number >= 0 (a fraction of the bottleneck: 0.05 = 5%)"
        )
