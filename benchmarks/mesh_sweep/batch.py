"""Each model of the mesh sweep, its global batch at each step and its loss, made alike in
every rank and in the driver."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

from benchmarks.harness.models.hf_text import HfBuild
from benchmarks.harness.models.registry import registry
from benchmarks.harness.models.spec import Args, Kwargs
from benchmarks.harness.oracle import split_rows
from benchmarks.harness.prepare import map_tensors, to_double, zero_dropout
from benchmarks.mesh_sweep.configs import Config

__all__ = ["LR", "DTYPES", "Prepared", "prepared", "widened", "resized", "batch_size",
           "projection_loss", "projection_terms", "micro_batches", "replica_part"]  # fmt: skip

LR = 0.01
DTYPES = {"float64": torch.float64, "float32": torch.float32}


@dataclass
class Prepared:
    """A model ready for one configuration: the model, each step's global batch (with its
    sequence length: None for the example's) and the example batch's rows."""

    model: nn.Module
    batches: list[tuple[Args, Kwargs]]
    lengths: list[int | None]
    example_rows: int


def prepared(name: str, config: Config, dtype: torch.dtype = torch.float64) -> Prepared:
    """The model of ``name`` built in float64 with no dropout, in train mode, then cast to
    ``dtype``; each step's global batch (floating inputs in ``dtype``): at ``config``'s
    lengths for a text model (else one step at the example), of ``config.dp x config.rows``
    rows, or with ``rows`` None the example's, :func:`widened` to ``dp x m``."""
    spec = registry()[name]
    torch.manual_seed(0)
    # the driver checks model after model: each gets its own default dtype, as a rank does
    torch.set_default_dtype(torch.float64 if spec.default_double else torch.float32)
    model, args, kwargs = spec.build()
    model = model.double().train()
    zero_dropout(model)
    model = model.to(dtype)
    build = spec.build
    lengths: list[int | None] = [None]
    inputs = [(args, kwargs)]
    if config.lengths and isinstance(build, HfBuild) and build.text:
        lengths = list(config.lengths)
        inputs = [build.inputs(n) for n in lengths]
    rows = config.dp * (config.rows or config.n_microbatches)
    batches = []
    for a, k in inputs:
        a, k = to_double(a), to_double(k)
        a, k = resized(a, k, rows) if config.rows else widened(a, k, rows)
        batches.append(map_tensors((a, k), lambda x: x.to(dtype) if x.is_floating_point() else x))
    return Prepared(model, batches, lengths, batch_size(args, kwargs))


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


def resized(args: Args, kwargs: Kwargs, rows: int) -> tuple[Args, Kwargs]:
    """The batch at exactly ``rows`` rows: its first ``rows``, or :func:`widened` to them."""
    args, kwargs = widened(args, kwargs, rows)
    cut = tree_map(lambda x: x[:rows] if isinstance(x, torch.Tensor) and x.dim() else x,
                   (args, kwargs))  # fmt: skip
    return cut[0], cut[1]


def batch_size(args: Args, kwargs: Kwargs) -> int:
    return next(x.size(0) for x in tree_flatten((args, kwargs))[0] if isinstance(x, torch.Tensor))


def _weights(i: int, x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Leaf ``i``'s loss weights: per sample (from its global index) when the leaf's first
    dimension is the micro-batch's, else one fixed draw for the whole leaf; drawn in float64
    and rounded to the leaf's dtype, so that a run in another dtype weighs as float64's."""
    gen = torch.Generator()
    if x.dim() and x.size(0) == index.numel():
        rows = []
        for s in index.tolist():
            gen.manual_seed(1_000_003 * i + int(s))
            rows.append(torch.randn(x.shape[1:], generator=gen, dtype=torch.float64))
        return torch.stack(rows).to(x.dtype)
    gen.manual_seed(10**9 + i)
    return torch.randn(x.shape, generator=gen, dtype=torch.float64).to(x.dtype)


def projection_loss(output: Any, index: torch.Tensor) -> torch.Tensor:
    """A fixed random projection of every floating-point leaf of ``output`` (sum-reduced);
    ``index`` holds the global batch positions of the micro-batch's samples."""
    leaves = [x for x in tree_flatten(output)[0] if isinstance(x, torch.Tensor)]
    terms = [
        (x * _weights(i, x, index)).sum() for i, x in enumerate(leaves) if x.is_floating_point()
    ]
    return sum(terms, torch.zeros((), dtype=torch.float64))


def projection_terms(output: Any, index: torch.Tensor) -> torch.Tensor:
    """:func:`projection_loss`'s terms (each output element times its weight), flat, in
    float64."""
    leaves = [x for x in tree_flatten(output)[0] if isinstance(x, torch.Tensor)]
    terms = [(x.detach() * _weights(i, x, index)).double().flatten()
             for i, x in enumerate(leaves) if x.is_floating_point()]  # fmt: skip
    return torch.cat(terms) if terms else torch.zeros(0, dtype=torch.float64)


def replica_part(args: Args, kwargs: Kwargs, dp: int, replica: int) -> list[Any]:
    """Replica ``replica``'s slice of the global batch as ``[args, kwargs, index]``."""
    index = torch.arange(batch_size(args, kwargs))
    return list(split_rows((args, kwargs, index), dp)[replica])


def micro_batches(args: Args, kwargs: Kwargs, m: int, dp: int) -> list[list[Any]]:
    """Per replica, its ``m`` micro-batches as ``(args, kwargs, index)``."""
    return [split_rows(replica_part(args, kwargs, dp, r), m) for r in range(dp)]
