"""The eager oracle: the model run eagerly on the whole batch or on fxpipe's micro-batches,
backward through a fixed random projection of its outputs, and what that left behind."""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from benchmarks.harness.compare import Side
from benchmarks.harness.models.spec import Args, Kwargs, Spec, generator
from benchmarks.harness.prepare import fresh, map_tensors

__all__ = ["mixes_samples", "split_rows", "micro_batches", "join", "loss_weights", "backward",
           "run_eager", "eager_side"]  # fmt: skip


def _batch_statistics(module: nn.Module, train: bool) -> bool:
    """Does ``module`` normalise with statistics of the batch it is given?"""
    if isinstance(module, nn.modules.batchnorm._BatchNorm):
        return train or module.running_mean is None
    name = type(module).__name__
    return train and ("BatchNorm" in name or name.startswith("EvoNorm2dB"))


def mixes_samples(spec: Spec, model: nn.Module, train: bool) -> bool:
    """Does ``model`` mix the samples of a batch in this mode (BatchNorm in train mode, batch
    statistics, capacity-limited routing)? Then only eager on the same micro-batches as
    fxpipe's is an oracle, since GPipe normalises each micro-batch on its own."""
    if spec.mixes == "always" or (train and spec.mixes == "train"):
        return True
    return any(_batch_statistics(m, train) for m in model.modules())


def split_rows(tree: Any, parts: int) -> list[Any]:
    """Every tensor of ``tree`` split on dim 0 into ``parts`` (``tensor_split``), as fxpipe's
    scatter and torch's pipelining split a batch."""
    leaves, spec = tree_flatten(tree)
    cut = [x.tensor_split(parts) if isinstance(x, torch.Tensor) else None for x in leaves]
    return [
        tree_unflatten([x if c is None else c[i] for x, c in zip(leaves, cut)], spec)
        for i in range(parts)
    ]


def _rows(args: Args, kwargs: Kwargs) -> int:
    """The batch size: dim 0 of the first tensor argument with one."""
    leaves = tree_flatten((args, kwargs))[0]
    return next(x.size(0) for x in leaves if isinstance(x, torch.Tensor) and x.dim())


def micro_batches(args: Args, kwargs: Kwargs, chunks: int) -> list[tuple[Args, Kwargs]]:
    """Every tensor split on dim 0 into min(chunks, batch) parts, as fxpipe's scatter does."""
    return split_rows((args, kwargs), min(chunks, _rows(args, kwargs)))


def join(outputs: list[Any], weights: list[float] | None = None) -> Any:
    """Micro-batch outputs concatenated on dim 0; a 0-dim floating leaf (a loss, a mean over
    the batch) is their mean weighted by ``weights`` (one per micro-batch: the rows or labels
    it counts; default alike); other leaves from the first."""
    flat = [tree_flatten(out) for out in outputs]
    share = [w / sum(weights) for w in weights] if weights else [1 / len(outputs)] * len(outputs)
    joined = []
    for column in zip(*(leaves for leaves, _ in flat)):
        first = column[0]
        if not isinstance(first, torch.Tensor):
            joined.append(first)
        elif first.dim() == 0 and first.is_floating_point():
            joined.append(sum((x * w for x, w in zip(column, share)), torch.zeros_like(first)))
        else:
            joined.append(torch.cat(column))
    return tree_unflatten(joined, flat[0][1])


def loss_weights(output: Any) -> list[torch.Tensor | None]:
    """Fixed random weights for every floating-point leaf of ``output``."""
    gen = generator(7)
    return [
        torch.randn(x.shape, generator=gen, dtype=x.dtype)
        if isinstance(x, torch.Tensor) and x.is_floating_point()
        else None
        for x in tree_flatten(output)[0]
    ]


def backward(model: nn.Module, output: Any, weights: list[torch.Tensor | None]) -> Side:
    """Backward of sum(output * weights) over the floating leaves; the model's gradients and
    persistent buffers after it."""
    leaves = tree_flatten(output)[0]
    terms = [(x * w).sum() for x, w in zip(leaves, weights) if w is not None]
    loss = sum(terms, torch.zeros((), dtype=torch.float64))
    if loss.requires_grad:
        loss.backward()
    grads = {
        n: None if p.grad is None else p.grad.detach().clone() for n, p in model.named_parameters()
    }
    # persistent buffers only: the state a checkpoint keeps (running statistics); caches a
    # forward rebuilds (ConViT's rel_indices) are not part of the contract
    kept = set(model.state_dict())
    buffers = {n: b.detach().clone() for n, b in model.named_buffers() if n in kept}
    return Side(_detach(output), grads, buffers)


def _detach(tree: Any) -> Any:
    return map_tensors(tree, lambda x: x.detach())


def run_eager(
    model: nn.Module, args: Args, kwargs: Kwargs, chunks: int | None, counts: Tensor | None = None
) -> Any:
    """``model`` on the whole batch, or (``chunks``) on its micro-batches, outputs joined (a
    0-dim leaf weighted by the ``counts`` of each micro-batch's rows, else by its rows)."""
    if chunks is None:
        return model(*fresh(args), **fresh(kwargs))
    parts = micro_batches(fresh(args), fresh(kwargs), chunks)
    if counts is None:
        counts = torch.ones(_rows(args, kwargs))
    weights = [float(c.sum()) for c in counts.tensor_split(len(parts))]
    return join([model(*a, **k) for a, k in parts], weights)


def eager_side(
    model: nn.Module,
    inputs: tuple[Args, Kwargs],
    train: bool,
    chunks: int | None,
    counts: Tensor | None = None,
    grads: bool = True,
) -> Side:
    """Eager on a deep copy of ``model`` in ``train`` mode, on the whole batch or (``chunks``)
    on its micro-batches (a 0-dim output weighted by ``counts``): outputs, then gradients and
    buffers after backward; with ``grads`` False, outputs only, under ``torch.no_grad()``."""
    oracle = copy.deepcopy(model).train(train)
    if not grads:
        with torch.no_grad():
            return Side(run_eager(oracle, *inputs, chunks, counts), {}, {})
    output = run_eager(oracle, *inputs, chunks, counts)
    return backward(oracle, output, loss_weights(output))
