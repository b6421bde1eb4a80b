"""The eager oracle: the model run eagerly on the whole batch or on fxpipe's micro-batches,
backward through a fixed random projection of its outputs, and what that left behind."""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn
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


def micro_batches(args: Args, kwargs: Kwargs, chunks: int) -> list[tuple[Args, Kwargs]]:
    """Every tensor split on dim 0 into min(chunks, batch) parts, as fxpipe's scatter does."""
    size = next(x.size(0) for x in tree_flatten((args, kwargs))[0] if isinstance(x, torch.Tensor))
    return split_rows((args, kwargs), min(chunks, size))


def join(outputs: list[Any]) -> Any:
    """Micro-batch outputs concatenated on dim 0 (other leaves from the first)."""
    flat = [tree_flatten(out) for out in outputs]
    columns = zip(*(leaves for leaves, _ in flat))
    joined = [torch.cat(c) if isinstance(c[0], torch.Tensor) else c[0] for c in columns]
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


def run_eager(model: nn.Module, args: Args, kwargs: Kwargs, chunks: int | None) -> Any:
    """``model`` on the whole batch, or (``chunks``) on its micro-batches, outputs joined."""
    if chunks is None:
        return model(*fresh(args), **fresh(kwargs))
    parts = micro_batches(fresh(args), fresh(kwargs), chunks)
    return join([model(*a, **k) for a, k in parts])


def eager_side(
    model: nn.Module, inputs: tuple[Args, Kwargs], train: bool, chunks: int | None
) -> Side:
    """Eager on a deep copy of ``model`` in ``train`` mode, on the whole batch or (``chunks``)
    on its micro-batches: outputs, then gradients and buffers after backward."""
    oracle = copy.deepcopy(model).train(train)
    output = run_eager(oracle, *inputs, chunks)
    return backward(oracle, output, loss_weights(output))
