"""A loss as a distributed pipeline's last stage computes it: ``loss_fn`` called on the
model's own output structure, its gradient divided by the number of micro-batches where
``scale_grads`` says so."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["StructuredLoss", "MeanLoss"]


class StructuredLoss:
    """``loss_fn`` called on the model's own output structure rather than torch's flat one;
    with ``scale`` > 1, its gradient divided by ``scale`` (:class:`MeanLoss`)."""

    def __init__(
        self, loss_fn: Callable[..., torch.Tensor], rebuild: Callable[[Any], Any], scale: int = 1
    ) -> None:
        self.loss_fn, self.rebuild, self.scale = loss_fn, rebuild, scale

    def __call__(self, output: Any, target: Any, **kwargs: Any) -> torch.Tensor:
        loss = self.loss_fn(self.rebuild(output), target, **kwargs)
        if self.scale == 1:
            return loss
        out: torch.Tensor = MeanLoss.apply(loss, self.scale)  # type: ignore[no-untyped-call]
        return out


class MeanLoss(torch.autograd.Function):
    """A micro-batch's loss, its value as it is, its gradient divided by the number of
    micro-batches (``scale_grads=True``): each step adds the mean of its micro-batches'
    gradients to the Parameters'. torch divides the Parameters' whole gradients at the
    end of each step instead, which also divides what earlier steps accumulated in them
    (gradient accumulation over steps then gives the earlier steps too little weight), and
    divides a Parameter two stages of a rank share once per stage."""

    @staticmethod
    def forward(ctx: Any, loss: torch.Tensor, scale: int) -> torch.Tensor:
        ctx.scale = scale
        return loss.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad / ctx.scale, None
