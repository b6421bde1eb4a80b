"""How the tests compare fxpipe's results with eager PyTorch's: the relative error, and how a
zoo model is prepared, fed and reduced to one loss for a comparison."""

from __future__ import annotations

from typing import Any

import torch
from models import Case
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """||got - want|| / ||want|| in float64 (||got - want|| when ``want`` is zero): sums taken
    in another order, as micro-batching does, differ only in the last bits."""
    scale = want.double().norm().item()
    diff = (got.double() - want.double()).norm().item()
    return diff / scale if scale > 0 else diff


def no_further_than_eager(
    got: torch.Tensor, eager: torch.Tensor, exact: torch.Tensor, factor: float = 4.0
) -> tuple[bool, float, float]:
    """The oracle in a narrow dtype: ``got`` (fxpipe's, in that dtype) is no further from
    ``exact`` (eager in float64) than ``factor`` times eager's own error in that dtype, or
    than that dtype's epsilon where eager's error is smaller (a result eager gets exactly).
    Returns (whether it holds, fxpipe's error, eager's)."""
    ours, theirs = relative_error(got, exact), relative_error(eager, exact)
    floor = torch.finfo(got.dtype).eps if got.is_floating_point() else 0.0
    return ours <= factor * max(theirs, floor), ours, theirs


def prepared(case: Case, train: bool, dtype: torch.dtype) -> nn.Module:
    """The zoo model of ``case`` in ``dtype`` and mode, its dropout at p=0 (its random draws
    follow the micro-batch order, so only its determinism under recompute is comparable)."""
    model = case.build().to(dtype)
    model.train(train)
    for m in model.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0
    return model


def example_in(case: Case, dtype: torch.dtype) -> tuple[Any, Any]:
    """The case's example batch, its floating-point tensors in ``dtype``."""
    return tree_map(
        lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t,
        case.example(case.batch),
    )


def weighted_loss(out: Any) -> torch.Tensor:
    """A loss that reaches every floating-point output, with fixed per-element weights."""
    leaves, _ = tree_flatten(out)
    total = torch.zeros((), dtype=torch.float64)
    for t in leaves:
        if isinstance(t, torch.Tensor) and t.is_floating_point():
            weights = torch.linspace(-1.0, 1.0, t.numel(), dtype=t.dtype).reshape(t.shape)
            total = total + (t * weights).sum()
    return total
