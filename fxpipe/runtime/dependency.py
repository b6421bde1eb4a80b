"""Fork and join: autograd edges that order the backward passes of micro-batches.

Autograd alone does not know that micro-batch ``i - 1`` should go backward through a stage
only after micro-batch ``i`` has. ``fork`` hangs a phony off a tensor of micro-batch
``i - 1``; ``join`` attaches it to a tensor of micro-batch ``i``::

    micro-batch i-1:   a ──Fork──► a'            (a' goes on; its gradient comes back later)
                             └───► phony ──┐
    micro-batch i:     b ─────────────────Join──► b'

In backward, Fork needs the gradients of both its outputs, and the phony's only arrives
once the gradient of ``b'`` has passed Join: the gradient of ``a`` waits for that of ``b``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.autograd.function import FunctionCtx

from fxpipe.runtime.phony import get_phony

__all__ = ["fork", "join", "Fork", "Join"]


class Fork(torch.autograd.Function):
    """Identity on a tensor that also returns a phony depending on it."""

    @staticmethod
    def forward(ctx: FunctionCtx, input: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ctx.set_materialize_grads(False)  # no gradient stays None, never becomes zeros
        phony = get_phony(input.device, requires_grad=False)
        return input.detach(), phony.detach()

    @staticmethod
    def backward(  # pragma: no cover - run by autograd
        ctx: FunctionCtx, grad_input: torch.Tensor | None, grad_phony: torch.Tensor | None
    ) -> torch.Tensor | None:
        return grad_input


class Join(torch.autograd.Function):
    """Identity on a tensor that also depends on a phony."""

    @staticmethod
    def forward(ctx: FunctionCtx, input: torch.Tensor, phony: torch.Tensor) -> torch.Tensor:
        ctx.set_materialize_grads(False)
        return input.detach()

    @staticmethod
    def backward(  # pragma: no cover - run by autograd
        ctx: FunctionCtx, grad_input: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, None]:
        return grad_input, None


_fork: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]] = Fork.apply
_join: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = Join.apply


def fork(input: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input, phony)`` where the phony's gradient must arrive before ``input``'s passes.

    Under ``no_grad``, or when ``input`` does not require grad, no Function is applied and
    the phony is a plain cached one.
    """
    if torch.is_grad_enabled() and input.requires_grad:
        return _fork(input)
    return input, get_phony(input.device, requires_grad=False)


def join(input: torch.Tensor, phony: torch.Tensor) -> torch.Tensor:
    """``input``, made to send a gradient to ``phony`` after its own gradient arrived."""
    if torch.is_grad_enabled() and (input.requires_grad or phony.requires_grad):
        return _join(input, phony)
    return input
