"""The residual MLP the runtime and GPU benchmarks time, and its training steps."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

__all__ = ["Block", "residual_mlp", "loss_of", "plain_step", "chunked_step"]


class Block(nn.Module):
    """``x + fc2(relu(fc1(x)))``."""

    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(width, hidden)
        self.fc2 = nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.relu(self.fc1(x)))


def residual_mlp(width: int, hidden: int, depth: int) -> nn.Sequential:
    """``depth`` blocks, the same weights on every call."""
    torch.manual_seed(0)
    return nn.Sequential(*[Block(width, hidden) for _ in range(depth)])


def loss_of(y: torch.Tensor, total: int) -> torch.Tensor:
    """Sum of squares over ``total`` elements: the mean over the batch, also per chunk."""
    loss: torch.Tensor = y.pow(2).sum() / total
    return loss


def plain_step(model: nn.Module, x: torch.Tensor) -> Callable[[], None]:
    """One forward and backward of the whole batch."""

    def step() -> None:
        loss_of(model(x), x.numel()).backward()

    return step


def chunked_step(model: nn.Module, x: torch.Tensor, chunks: int) -> Callable[[], None]:
    """The same step run micro-batch by micro-batch by hand, gradients accumulated."""

    def step() -> None:
        for xi in x.tensor_split(chunks):
            loss_of(model(xi), x.numel()).backward()

    return step
