"""What a pipeline runs with, resolved by the compiler: nothing left to decide."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from fxpipe.ir import Checkpoints
from fxpipe.options import CompileOptions

__all__ = ["RunConfig"]


@dataclass(frozen=True)
class RunConfig:
    """How a built pipeline runs (:func:`fxpipe.compiler.resolve_run` makes it): the
    values that run, never ``"auto"`` or ``None`` for a default."""

    #: The device of each stage, in pipeline order.
    devices: tuple[torch.device, ...]
    #: Micro-batches the example batch runs as (at most one per sample).
    chunks: int
    #: Which micro-batches each stage recomputes in backward: one mode, or one per stage.
    checkpoint: Checkpoints
    #: Each stage's forward through ``torch.compile`` (None: run eagerly).
    compile: CompileOptions | None = None
    #: BatchNorm's running statistics updated once per batch, from the whole batch.
    deferred_batch_norm: bool = False
    #: Where outputs are gathered (None: the first tensor argument's device, per call).
    output_device: torch.device | None = None
    #: For a plan made for inference: each device its split would not fit in training, with
    #: the bytes needed and the capacity (warned about at the first training call).
    training_overflow: Mapping[str, tuple[int, int]] = field(default_factory=dict)
