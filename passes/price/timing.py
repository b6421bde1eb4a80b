"""Times one node forward and backward on a device, as a training step runs it.

Inputs are fresh copies (a node may write into them); only those that require grad in
training get a gradient, so backward computes what a training step computes and nothing
autograd would refuse (the running statistics ``F.batch_norm`` updates, integer counts).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map

__all__ = ["step_seconds", "grad_inputs", "backward", "sync", "zeros_like"]


def step_seconds(
    run: Callable[[Any, Any], Any],
    args: Any,
    kwargs: Any,
    params: list[torch.Tensor] | None,
    device: torch.device,
    repeats: int,
) -> float:
    """Median seconds of forward + backward (forward only when ``params`` is None) on
    fresh copies of the inputs, after one warm-up."""
    samples = []
    for _ in range(max(1, repeats) + 1):
        leaves, a, k = grad_inputs(args, kwargs)
        sync(device)
        start = time.perf_counter()
        result = run(a, k)
        if params is not None:
            backward(result, leaves + params)
        sync(device)
        samples.append(time.perf_counter() - start)
    return statistics.median(samples[1:])


def grad_inputs(args: Any, kwargs: Any) -> tuple[list[torch.Tensor], Any, Any]:
    """Fresh copies of the inputs, safe to modify in place; those that require grad in
    training are new leaves that require grad (the others get none: backward computes
    no gradient for them, as in training)."""
    leaves: list[torch.Tensor] = []

    def fresh(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        if not t.requires_grad:
            return t.detach().clone()
        leaf = t.detach().requires_grad_(True)
        leaves.append(leaf)
        return leaf.clone()

    return leaves, tree_map(fresh, args), tree_map(fresh, kwargs)


def backward(result: Any, wrt: list[torch.Tensor]) -> None:
    outs = [t for t in _tensors(result) if t.requires_grad]
    if outs and wrt:
        grads = [torch.ones_like(t) for t in outs]
        torch.autograd.grad(outs, wrt, grads, allow_unused=True)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def zeros_like(value: Any, device: torch.device) -> Any:
    if not isinstance(value, torch.Tensor):
        return value
    zeros = torch.zeros(value.shape, dtype=value.dtype, device=device)
    return zeros.requires_grad_(value.requires_grad)


def _tensors(value: Any) -> list[torch.Tensor]:
    leaves, _ = tree_flatten(value)
    return [x for x in leaves if isinstance(x, torch.Tensor)]
