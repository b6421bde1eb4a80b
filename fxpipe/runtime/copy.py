"""Copy tensors between devices on copy streams, and order streams, as autograd Functions.

``Copy`` moves tensors from the stream of one device to the stream of another; ``Wait``
makes one stream wait for another. Both mirror themselves in backward: gradients travel
back on the same streams and the waits are reversed. With the CPU placeholder stream they
are identities, so the same path runs on CPU.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from fxpipe.runtime.stream import (
    AbstractStream,
    current_stream,
    get_device,
    record_stream,
    use_stream,
    wait_stream,
)

__all__ = ["Copy", "Wait", "copy", "wait"]

Tensors = tuple[torch.Tensor, ...]


def _mark_constants(ctx: Any, inputs: Tensors, outputs: Tensors) -> None:
    """Outputs whose input did not require grad must not start requiring it here."""
    constants = [y for x, y in zip(inputs, outputs, strict=True) if not x.requires_grad]
    if constants:
        ctx.mark_non_differentiable(*constants)


def _async(device: torch.device) -> bool:
    # A non-blocking copy into host memory may still be in flight when the CPU reads it.
    return device.type == "cuda"


class Copy(torch.autograd.Function):
    """Move tensors from ``prev_stream``'s device to ``next_stream``'s device."""

    @staticmethod
    def forward(
        ctx: Any, prev_stream: AbstractStream, next_stream: AbstractStream, *inputs: torch.Tensor
    ) -> Tensors:
        ctx.prev_stream, ctx.next_stream = prev_stream, next_stream
        device = get_device(next_stream)
        # Outputs are used on the destination's compute stream, not on the copy stream.
        compute_stream = current_stream(device)
        outputs = []
        with use_stream(prev_stream), use_stream(next_stream):
            for x in inputs:
                y = x.to(device, non_blocking=_async(device))
                record_stream(x, prev_stream)
                record_stream(y, compute_stream)
                outputs.append(y)
        result = tuple(outputs)
        _mark_constants(ctx, inputs, result)
        return result

    @staticmethod
    def backward(ctx: Any, *grad_outputs: torch.Tensor) -> tuple[Any, ...]:  # pragma: no cover
        prev_stream: AbstractStream = ctx.prev_stream
        next_stream: AbstractStream = ctx.next_stream
        device = get_device(prev_stream)
        compute_stream = current_stream(device)
        grads: list[torch.Tensor | None] = []
        with use_stream(prev_stream), use_stream(next_stream):
            for needed, g in zip(ctx.needs_input_grad[2:], grad_outputs, strict=True):
                if not needed or g is None:
                    grads.append(None)
                    continue
                y = g.to(device, non_blocking=_async(device))
                record_stream(g, next_stream)
                record_stream(y, compute_stream)
                grads.append(y)
        return (None, None, *grads)


class Wait(torch.autograd.Function):
    """Make ``next_stream`` wait for ``prev_stream``; in backward the other way round."""

    @staticmethod
    def forward(
        ctx: Any, prev_stream: AbstractStream, next_stream: AbstractStream, *inputs: torch.Tensor
    ) -> Tensors:
        ctx.prev_stream, ctx.next_stream = prev_stream, next_stream
        wait_stream(next_stream, prev_stream)
        result = tuple(x.detach() for x in inputs)
        _mark_constants(ctx, inputs, result)
        return result

    @staticmethod
    def backward(ctx: Any, *grad_outputs: torch.Tensor) -> tuple[Any, ...]:  # pragma: no cover
        wait_stream(ctx.prev_stream, ctx.next_stream)
        return (None, None, *grad_outputs)


_copy: Callable[..., Tensors] = Copy.apply
_wait: Callable[..., Tensors] = Wait.apply


def copy(tensors: Tensors, prev_stream: AbstractStream, next_stream: AbstractStream) -> Tensors:
    """``tensors`` moved to ``next_stream``'s device through :class:`Copy`."""
    if not tensors:
        return tensors
    return _copy(prev_stream, next_stream, *tensors)


def wait(tensors: Tensors, prev_stream: AbstractStream, next_stream: AbstractStream) -> Tensors:
    """``tensors``, after which ``next_stream`` waits for ``prev_stream`` (:class:`Wait`)."""
    if not tensors:
        return tensors
    return _wait(prev_stream, next_stream, *tensors)
