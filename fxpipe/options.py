"""The options of a plan and of a run: one frozen record each, every option checked once.

The public functions (``fxpipe.plan``, ``fxpipe.pipeline``, ``fxpipe.distributed.
pipeline_schedule``) keep their keyword signatures and build these records; everything
below them takes the records, so a new option is added in one place and checked in one
place. The choices themselves are the ``Literal`` types of :mod:`fxpipe.ir`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any, Literal, TypeAlias

import torch
import torch.fx as fx

from fxpipe.devices.budgets import MaxMemory, Speed, parse_max_memory, parse_speed
from fxpipe.devices.targets import parse_device
from fxpipe.errors import ConfigError
from fxpipe.ir import (
    CHECKPOINT_MODES,
    COST_MODES,
    SECONDS_PRICING,
    TRACERS,
    TRAFFIC,
    CheckpointMode,
    Checkpoints,
    CostMode,
    PricingMode,
    TracerName,
    Traffic,
)

__all__ = [
    "PlanOptions",
    "RunOptions",
    "CompileOptions",
    "CompileChoice",
    "CostChoice",
    "ChunksChoice",
    "CheckpointChoice",
    "default_chunks",
    "check_checkpoint",
    "checkpoint_of_stages",
]

#: A cost mode, or a callable pricing one fx node.
CostChoice = CostMode | Callable[[fx.Node], float]
#: Micro-batches per batch: a count, ``"auto"`` (chosen with the split), None (the default).
ChunksChoice: TypeAlias = int | Literal["auto"] | None
#: One checkpoint mode for every stage, one per stage, or ``"auto"`` (chosen per stage).
CheckpointChoice: TypeAlias = CheckpointMode | Literal["auto"] | Sequence[CheckpointMode]
#: What the options keep of a CheckpointChoice (a sequence as a tuple).
CheckpointOption: TypeAlias = Checkpoints | Literal["auto"]


@dataclass(frozen=True)
class PlanOptions:
    """How a model is planned: pricing, tracing and the search. Checked when made."""

    #: How nodes are priced (see :data:`fxpipe.ir.CostMode`) or a callable.
    cost: CostChoice = "auto"
    tracer: TracerName = "auto"
    #: Micro-batches per batch that memory estimates and the bubble assume (None: default;
    #: "auto": the count with the least predicted step that fits).
    chunks: ChunksChoice = None
    #: Which micro-batches each stage checkpoints in the run the memory estimates are for:
    #: one mode, one per stage, or "auto" (the least recomputation that fits, per stage).
    checkpoint: CheckpointOption = "except_last"
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
    #: Groups of node names of the traced graph no stage border may split (the regions a
    #: tensor-parallel plan cuts, which a border would leave whole); none by default.
    together: tuple[frozenset[str], ...] = ()

    def __post_init__(self) -> None:
        check_cost(self.cost)
        check_choice("tracer", self.tracer, TRACERS)
        check_chunks(self.chunks, auto=True)
        object.__setattr__(self, "checkpoint", check_checkpoint(self.checkpoint, auto=True))
        check_slack(self.slack)
        check_choice("traffic", self.traffic, TRAFFIC)
        object.__setattr__(self, "max_memory", parse_max_memory(self.max_memory))
        object.__setattr__(self, "speed", parse_speed(self.speed))
        if not isinstance(self.replicate_weights, bool):
            raise ConfigError(f"replicate_weights={self.replicate_weights!r} must be a bool")
        if not isinstance(self.reductions, bool):
            raise ConfigError(f"reductions={self.reductions!r} must be a bool")
        if not isinstance(self.together, tuple) or not all(
            isinstance(g, frozenset) and all(isinstance(n, str) for n in g) for g in self.together
        ):
            raise ConfigError(
                f"together={self.together!r} must be a tuple of frozensets of node names"
            )
        if self.automatic and (callable(self.cost) or self.pricing() not in SECONDS_PRICING):
            raise ConfigError(
                f"chunks={self.chunks!r}, checkpoint={self.checkpoint!r} choose the run by its "
                f"predicted step time, which cost={self.cost!r} does not give (it is not in "
                "seconds); use cost='auto' (the roofline) or 'time', or give chunks and "
                "checkpoint"
            )

    @property
    def automatic(self) -> bool:
        """Whether the run's configuration is chosen with the split (``"auto"``)."""
        return self.chunks == "auto" or self.checkpoint == "auto"

    def pricing(self) -> PricingMode | Callable[[fx.Node], float]:
        """The cost mode the pricing pass runs: ``"auto"`` is the analytic roofline, the same
        plan on every run, rank and machine load."""
        return "roofline" if self.cost == "auto" else self.cost

    def micro_batches(self, stages: int, batch: int) -> int:
        """How many micro-batches the example batch of ``batch`` samples runs as: ``chunks``
        (at most one per sample), or the default for ``stages`` stages (also the first
        guess of ``"auto"``)."""
        if isinstance(self.chunks, int):
            return min(self.chunks, batch)
        return default_chunks(stages, batch)


@dataclass(frozen=True)
class RunOptions:
    """How a built pipeline runs its micro-batches. Checked when made."""

    #: Micro-batches per batch (None: the plan's).
    chunks: int | None = None
    #: One mode, one per stage, or "auto" (the plan's choice).
    checkpoint: CheckpointOption = "except_last"
    deferred_batch_norm: bool = False
    #: Where outputs are gathered (None: the first tensor argument's device).
    output_device: torch.device | None = None
    #: Each stage's forward through ``torch.compile`` (None: run eagerly).
    compile: CompileOptions | None = None

    def __post_init__(self) -> None:
        check_chunks(self.chunks)
        object.__setattr__(self, "checkpoint", check_checkpoint(self.checkpoint, auto=True))
        if not isinstance(self.deferred_batch_norm, bool):
            raise ConfigError(
                f"deferred_batch_norm={self.deferred_batch_norm!r} must be True or False"
            )
        if self.compile is not None and not isinstance(self.compile, CompileOptions):
            raise ConfigError(f"compile={self.compile!r} must be a CompileOptions record")

    @staticmethod
    def of(
        *,
        chunks: ChunksChoice,
        checkpoint: CheckpointChoice,
        deferred_batch_norm: bool,
        output_device: str | int | torch.device | None,
        compile: CompileChoice = False,
    ) -> RunOptions:
        """The record from the public keywords (``output_device`` and ``compile`` parsed)."""
        device = None if output_device is None else parse_device(output_device)
        compiled = CompileOptions.of(compile)
        check_chunks(chunks, auto=True)
        count = None if chunks == "auto" else chunks  # "auto": the plan's choice
        modes = check_checkpoint(checkpoint, auto=True)
        return RunOptions(count, modes, deferred_batch_norm, device, compiled)


#: The modes ``torch.compile`` takes (None: its default).
COMPILE_MODES = (None, "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


@dataclass(frozen=True)
class CompileOptions:
    """How each stage's forward goes through ``torch.compile``. Checked when made.

    The fields are ``torch.compile``'s own, except ``fullgraph``, which defaults to True
    here: a stage graph is flat torch ops, so a graph break means a module torch cannot
    compile, and a whole-graph compile fails before anything of the stage has run, so the
    stage can then run eagerly instead (with one warning) without having changed a buffer
    twice. With ``dynamic=None`` a stage's micro-batch rows are symbolic from its first
    compile (the last, shorter micro-batch and other batch sizes reuse the graph); other
    sizes (a sequence length) become symbolic the second time they change, torch's
    automatic dynamic shapes (:mod:`fxpipe.runtime.compiled`).
    """

    backend: str | Callable[..., Any] = "inductor"
    mode: str | None = None
    dynamic: bool | None = None
    fullgraph: bool = True
    #: The backend's options (``torch.compile(options=...)``; inductor's config keys).
    options: Mapping[str, Any] | None = None

    def __post_init__(self) -> None:
        if not (callable(self.backend) or isinstance(self.backend, str)):
            raise ConfigError(
                f"compile backend={self.backend!r} must be a backend name "
                "(torch._dynamo.list_backends()) or a callable backend"
            )
        if self.mode not in COMPILE_MODES:
            raise ConfigError(f"compile mode={self.mode!r} is not one of {COMPILE_MODES}")
        if self.mode is not None and self.options:
            raise ConfigError(
                f"compile mode={self.mode!r} and options={dict(self.options)!r} were both "
                "given; torch.compile takes one of them: pass the mode's settings in options"
            )
        if self.dynamic not in (None, True, False):
            raise ConfigError(f"compile dynamic={self.dynamic!r} must be None, True or False")
        if not isinstance(self.fullgraph, bool):
            raise ConfigError(f"compile fullgraph={self.fullgraph!r} must be a bool")
        if self.options is not None and not isinstance(self.options, Mapping):
            raise ConfigError(f"compile options={self.options!r} must be a dict")

    @staticmethod
    def of(value: CompileChoice) -> CompileOptions | None:
        """The record for ``compile=``: False (or None) for none, True for the defaults,
        a dict of this record's fields, or a record."""
        if value is None or value is False:
            return None
        if value is True:
            return CompileOptions()
        if isinstance(value, CompileOptions):
            return value
        if isinstance(value, Mapping):
            names = [f.name for f in fields(CompileOptions)]
            unknown = sorted(str(k) for k in value if k not in names)
            if unknown:
                raise ConfigError(
                    f"compile={dict(value)!r} has keys {unknown} that torch.compile settings "
                    f"here do not have; use {names}"
                )
            return CompileOptions(**value)
        raise ConfigError(
            f"compile={value!r} must be True, False or a dict of torch.compile settings "
            "(backend, mode, dynamic, fullgraph, options)"
        )


#: What ``compile=`` takes.
CompileChoice = bool | Mapping[str, Any] | CompileOptions | None


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


def check_chunks(chunks: Any, *, auto: bool = False) -> None:
    """ConfigError unless ``chunks`` is None, a whole number >= 1 or (with ``auto``)
    ``"auto"``."""
    if auto and chunks == "auto":
        return
    bad = isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1
    if chunks is not None and bad:
        also = ", 'auto'" if auto else ""
        raise ConfigError(
            f"chunks={chunks!r} must be a whole number >= 1 (or None for a default{also})"
        )


def check_checkpoint(checkpoint: Any, *, auto: bool = False) -> Any:
    """``checkpoint`` as the options keep it: a mode, a tuple of one mode per stage, or
    (with ``auto``) ``"auto"``; ConfigError for anything else."""
    choices = (*CHECKPOINT_MODES, "auto") if auto else CHECKPOINT_MODES
    if isinstance(checkpoint, str):
        check_choice("checkpoint", checkpoint, choices)
        return checkpoint
    if isinstance(checkpoint, Sequence) and checkpoint:
        modes = tuple(checkpoint)
        for j, mode in enumerate(modes):
            if not isinstance(mode, str) or mode not in CHECKPOINT_MODES:
                raise ConfigError(
                    f"checkpoint[{j}]={mode!r} is not one of {CHECKPOINT_MODES}; a list gives "
                    "one of them per stage"
                )
        return modes
    raise ConfigError(
        f"checkpoint={checkpoint!r} is not one of {choices} or a non-empty list of "
        f"{CHECKPOINT_MODES}, one per stage; pick one of them"
    )


def checkpoint_of_stages(checkpoint: Any, stages: int) -> Checkpoints:
    """``checkpoint`` (a mode, or one per stage; checked) as a run keeps it: one mode where
    every stage has the same, else one per stage; ConfigError for a count of modes that is
    not ``stages``. The one place a per-stage list is counted and collapsed."""
    modes = check_checkpoint(checkpoint)
    if isinstance(modes, str):
        return modes  # type: ignore[return-value]
    if len(modes) != stages:
        raise ConfigError(
            f"checkpoint={list(modes)!r} has {len(modes)} modes but there are {stages} "
            "stages; give one mode per stage, or one mode for all"
        )
    return modes[0] if len(set(modes)) == 1 else modes  # type: ignore[no-any-return]


def check_slack(slack: Any) -> None:
    """ConfigError unless ``slack`` is a finite number >= 0."""
    number = isinstance(slack, int | float) and not isinstance(slack, bool)
    if not number or not math.isfinite(slack) or slack < 0:
        raise ConfigError(
            f"slack={slack!r} must be a number >= 0 (a fraction of the bottleneck: 0.05 = 5%)"
        )
