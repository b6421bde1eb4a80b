"""Boundary values and their gradients in eager's memory layout on both sides of a send.

torch sends contiguous buffers only, so a value that is a strided view in eager (a
transposed sum viewed as an image) crosses a process border contiguous, and its gradient
comes back contiguous. The numbers are the same, but autograd's backward through the
sending stage then meets other strides than in eager, and some CPU kernels answer wrongly
for some strides: measured on torch 2.13 and 2.14, ``batch_norm``'s backward given a
gradient whose size-1 batch dimension has a stride other than ``C * H * W`` returns wrong
gradients, with no error (TinyViT with one-sample micro-batches: most gradients of the
first stage off by their own size). Eager itself reaches that layout only where the
gradient arrives in it; fxpipe keeps eager's layouts so that its stages run the kernels
eager runs, on the strides eager gives them:

- :func:`sent`: a stage's output as torch sends it (contiguous), whose gradient is given
  back in the output's own layout before the stage's backward goes on;
- :func:`received`: a stage's input from torch's contiguous buffer, in the layout the
  sending stage made it (from the stage-shape run), with a contiguous gradient to send.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = [
    "Strides",
    "contiguous_strides",
    "layout_of",
    "in_layout",
    "hand_out",
    "give_back",
    "sent",
    "received",
]

Strides = tuple[int, ...]


def contiguous_strides(shape: torch.Size | tuple[int, ...]) -> Strides:
    """The strides of a row-major contiguous tensor of ``shape`` (size-1 dimensions too)."""
    out, step = [], 1
    for size in reversed(shape):
        out.append(step)
        step *= max(int(size), 1)
    return tuple(reversed(out))


def layout_of(t: torch.Tensor) -> Strides:
    """The strides torch gives a dense tensor like ``t``: ``t``'s own when it is
    non-overlapping and dense, else dense strides in ``t``'s order of dimensions (an
    expanded or sliced value's copy)."""
    like = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
    return tuple(torch.empty_like(like).stride())


def in_layout(t: torch.Tensor, strides: Strides) -> torch.Tensor:
    """``t`` itself when it has ``strides``, else a copy of it with them."""
    if tuple(t.stride()) == tuple(strides):
        return t
    out = torch.empty_strided(t.shape, strides, dtype=t.dtype, device=t.device)
    return out.copy_(t)


def hand_out(ctx: Any, t: torch.Tensor, *, copy: bool) -> torch.Tensor:
    """The forward of a Function that hands ``t`` to torch to send: ``t`` contiguous (a
    copy when it is not, or with ``copy``), ``t``'s layout kept on ``ctx`` for
    :func:`give_back`."""
    ctx.strides = layout_of(t)
    if copy or not t.is_contiguous():
        return t.clone(memory_format=torch.contiguous_format)
    return t.view_as(t)


def give_back(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
    """The backward's gradient in the layout :func:`hand_out` kept (as it is where it kept
    none)."""
    strides = getattr(ctx, "strides", None)
    return grad if strides is None else in_layout(grad, strides)


class _Sent(torch.autograd.Function):
    """``t`` contiguous (a copy when it is not); its gradient in ``t``'s layout."""

    @staticmethod
    def forward(ctx: Any, t: torch.Tensor) -> torch.Tensor:
        return hand_out(ctx, t, copy=False)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return give_back(ctx, grad)


class _SentCopy(_Sent):
    """:class:`_Sent`, always a copy (zero-bubble stages detach their outputs in place)."""

    @staticmethod
    def forward(ctx: Any, t: torch.Tensor) -> torch.Tensor:
        return hand_out(ctx, t, copy=True)


def sent(t: torch.Tensor, *, copy: bool = False) -> torch.Tensor:
    """``t`` as torch sends it: contiguous (always a copy with ``copy``). When ``t`` needs a
    gradient and is not laid out as a contiguous tensor, its gradient, which arrives
    contiguous, is given back in ``t``'s layout."""
    if not t.requires_grad or tuple(t.stride()) == contiguous_strides(t.shape):
        return t.clone(memory_format=torch.contiguous_format) if copy else t.contiguous()
    out: torch.Tensor = (_SentCopy if copy else _Sent).apply(t)  # type: ignore[no-untyped-call]
    return out


class _Received(torch.autograd.Function):
    """``t`` in the given strides; its gradient contiguous (as torch sends it)."""

    @staticmethod
    def forward(ctx: Any, t: torch.Tensor, strides: Strides) -> torch.Tensor:
        out = in_layout(t, strides)
        return out.view_as(out) if out is t else out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad.contiguous(), None


def received(t: torch.Tensor, strides: Strides | None, *, contiguous_grad: bool) -> torch.Tensor:
    """A stage input from torch's buffer ``t``, in ``strides`` (the layout the sending stage
    made it in; None: as it is). With ``contiguous_grad``, its gradient is made contiguous
    also where no layout changes (zero-bubble stages send input gradients as autograd
    computes them, which may be strided)."""
    if not t.requires_grad:
        return t if strides is None else in_layout(t, strides)
    if strides is None or tuple(t.stride()) == tuple(strides):
        if not contiguous_grad:
            return t
        strides = tuple(t.stride())
    out: torch.Tensor = _Received.apply(t, strides)  # type: ignore[no-untyped-call]
    return out
