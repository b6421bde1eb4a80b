"""The mesh sweep's configurations, and each model's global batch and loss, made alike in
every rank and in the driver."""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

from benchmarks.harness.models.registry import registry
from benchmarks.harness.models.spec import Args, Kwargs
from benchmarks.harness.oracle import split_rows
from benchmarks.harness.prepare import to_double, zero_dropout

__all__ = ["PP", "DP", "WORLD", "LR", "Config", "CONFIGS", "configs_for", "prepared",
           "widened", "batch_size", "projection_loss", "micro_batches"]  # fmt: skip

PP, DP = 2, 2
WORLD = PP * DP
LR = 0.01


@dataclass(frozen=True)
class Config:
    """One way to run the mesh: torch's schedule, stages per rank, the data parallelism, and
    the micro-batches per replica (each the fewest the schedule accepts on 2 ranks)."""

    schedule: str
    stages_per_rank: int
    data_parallel: str
    n_microbatches: int

    @property
    def name(self) -> str:
        return f"{self.schedule}/{self.data_parallel}"


CONFIGS = (
    Config("gpipe", 1, "ddp", 2),
    Config("1f1b", 1, "fsdp", 2),
    Config("loopedbfs", 2, "ddp", 2),
    Config("interleaved1f1b", 2, "fsdp", 2),
    Config("zbvzerobubble", 2, "fsdp", 4),  # zero bubble: FSDP only (DDP misses W passes)
)


def configs_for(name: str, count: int) -> list[Config]:
    """``count`` of the configurations (all when ``count >= len(CONFIGS)``), starting at one
    fixed per model name, so that a sweep over many models covers each about equally."""
    if count >= len(CONFIGS):
        return list(CONFIGS)
    start = zlib.crc32(name.encode()) % len(CONFIGS)
    return [CONFIGS[(start + i) % len(CONFIGS)] for i in range(count)]


def prepared(name: str, m: int | None = None) -> tuple[nn.Module, Args, Kwargs]:
    """The model of ``name`` in float64 with no dropout, in train mode, and its global batch
    (with ``m``: :func:`widened` to ``m`` micro-batches per replica)."""
    spec = registry()[name]
    torch.manual_seed(0)
    # the driver checks model after model: each gets its own default dtype, as a rank does
    torch.set_default_dtype(torch.float64 if spec.default_double else torch.float32)
    model, args, kwargs = spec.build()
    model = model.double().train()
    zero_dropout(model)
    args, kwargs = to_double(args), to_double(kwargs)
    return (model, *widened(args, kwargs, DP * m)) if m else (model, args, kwargs)


def widened(args: Args, kwargs: Kwargs, rows: int) -> tuple[Args, Kwargs]:
    """The batch, when it has fewer than ``rows`` rows, repeated along dim 0 to ``rows``
    (every tensor, as ``split_rows`` splits every tensor): a model whose example batch
    is kept small for speed still gives each replica the micro-batches a schedule needs. The
    loss weighs each copy of a sample by its own global index, so a copy that went to
    another position would still show."""
    have = batch_size(args, kwargs)
    if have >= rows:
        return args, kwargs
    reps = math.ceil(rows / have)

    def grow(x: Any) -> Any:
        if not isinstance(x, torch.Tensor) or not x.dim():
            return x
        return x.repeat(reps, *[1] * (x.dim() - 1))[:rows]

    args, kwargs = tree_map(grow, (args, kwargs))
    return args, kwargs


def batch_size(args: Args, kwargs: Kwargs) -> int:
    return next(x.size(0) for x in tree_flatten((args, kwargs))[0] if isinstance(x, torch.Tensor))


def _weights(i: int, x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Leaf ``i``'s loss weights: per sample (from its global index) when the leaf's first
    dimension is the micro-batch's, else one fixed draw for the whole leaf."""
    gen = torch.Generator()
    if x.dim() and x.size(0) == index.numel():
        rows = []
        for s in index.tolist():
            gen.manual_seed(1_000_003 * i + int(s))
            rows.append(torch.randn(x.shape[1:], generator=gen, dtype=x.dtype))
        return torch.stack(rows)
    gen.manual_seed(10**9 + i)
    return torch.randn(x.shape, generator=gen, dtype=x.dtype)


def projection_loss(output: Any, index: torch.Tensor) -> torch.Tensor:
    """A fixed random projection of every floating-point leaf of ``output`` (sum-reduced);
    ``index`` holds the global batch positions of the micro-batch's samples."""
    leaves = [x for x in tree_flatten(output)[0] if isinstance(x, torch.Tensor)]
    terms = [
        (x * _weights(i, x, index)).sum() for i, x in enumerate(leaves) if x.is_floating_point()
    ]
    return sum(terms, torch.zeros((), dtype=torch.float64))


def micro_batches(args: Args, kwargs: Kwargs, m: int) -> list[list[Any]]:
    """Per replica, its ``m`` micro-batches as ``(args, kwargs, index)``."""
    index = torch.arange(batch_size(args, kwargs))
    return [split_rows(part, m) for part in split_rows((args, kwargs, index), DP)]
