"""fxpipe.distributed.strides: boundary values keep eager's layout across a send."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from models import LocalConvBlock  # noqa: E402

from fxpipe.distributed.strides import (  # noqa: E402
    contiguous_strides,
    in_layout,
    layout_of,
    received,
    sent,
)


def _odd_view() -> torch.Tensor:
    """A (1, 4, 4, 16) view with LocalConvBlock's one-sample strides, (16, 4, 1, 16)."""
    base = torch.randn(1, 16, 16, dtype=torch.float64).transpose(1, 2)
    return base.view(1, 4, 4, 16)


@pytest.mark.parametrize("shape", [(3,), (2, 3, 4), (1, 5, 1), (0, 2), ()])
def test_contiguous_strides_are_torchs(shape: tuple[int, ...]) -> None:
    assert contiguous_strides(shape) == torch.empty(shape).stride()


def test_layout_of_keeps_a_dense_layout_and_makes_an_expanded_one_dense() -> None:
    t = torch.randn(4, 6).t()
    assert layout_of(t) == t.stride() == (1, 6)
    assert layout_of(_odd_view()) == (16, 4, 1, 16)
    wide = torch.randn(3, 1).expand(3, 5)  # stride 0: no tensor can be copied into it
    copy = in_layout(wide, layout_of(wide))
    assert 0 not in copy.stride() and torch.equal(copy, wide)


def test_in_layout_copies_only_when_the_strides_differ() -> None:
    t = torch.randn(2, 3)
    assert in_layout(t, (3, 1)) is t
    moved = in_layout(t, (1, 2))
    assert moved.stride() == (1, 2) and torch.equal(moved, t)


@pytest.mark.parametrize("copy", [False, True])
@pytest.mark.parametrize("make", [_odd_view, lambda: torch.randn(3, 5).t()])
def test_sent_is_contiguous_and_its_gradient_comes_back_in_the_values_layout(
    copy: bool, make: Callable[[], torch.Tensor]
) -> None:
    value = make().requires_grad_()
    t = value * 2  # the stage's output, with the value's strides
    seen: list[tuple[int, ...]] = []
    t.register_hook(lambda g: seen.append(tuple(g.stride())))
    out = sent(t, copy=copy)
    assert out.is_contiguous() and torch.equal(out, t)
    assert not copy or out.data_ptr() != t.data_ptr()
    grad = torch.randn(out.shape, dtype=out.dtype)  # torch's buffer: contiguous
    out.backward(grad)
    assert seen == [tuple(t.stride())]
    torch.testing.assert_close(value.grad, 2 * grad)


def test_sent_leaves_a_contiguous_value_alone() -> None:
    t = torch.randn(2, 3, requires_grad=True) * 1
    assert sent(t) is t


def test_received_has_the_senders_layout_and_a_contiguous_gradient() -> None:
    buffer = torch.randn(1, 4, 4, 16, dtype=torch.float64, requires_grad=True)
    x = received(buffer, (16, 4, 1, 16), contiguous_grad=False)
    assert x.stride() == (16, 4, 1, 16) and torch.equal(x, buffer)
    x.permute(0, 3, 1, 2).sum(dim=1).backward(torch.randn(1, 4, 4, dtype=torch.float64))
    assert buffer.grad is not None and buffer.grad.is_contiguous()
    plain = torch.randn(2, 3, requires_grad=True)
    assert received(plain, (3, 1), contiguous_grad=False) is plain
    assert received(plain, None, contiguous_grad=False) is plain


def test_a_strided_outputs_gradient_sent_back_contiguous_gives_eagers_gradients() -> None:
    """The layout that torch's CPU BatchNorm backward answers wrongly for, when a block's
    output is sent and its gradient arrives contiguous: through :func:`sent`, the block's
    gradients equal those of the same block run on a contiguous copy of its input (the
    same numbers, laid out as torch lays out a new tensor)."""
    torch.manual_seed(0)
    block = LocalConvBlock(16).double()
    image = torch.randn(1, 16, 4, 4, dtype=torch.float64)
    grad = torch.randn(1, 4, 4, 16, dtype=torch.float64)
    params = list(block.parameters())
    v = block(image.permute(0, 2, 3, 1))
    assert v.stride() == (16, 4, 1, 16)  # still the layout under test
    got = torch.autograd.grad(sent(v), params, grad)
    want = torch.autograd.grad(block(image.permute(0, 2, 3, 1).contiguous()), params, grad)
    for name, a, b in zip([n for n, _ in block.named_parameters()], got, want, strict=True):
        torch.testing.assert_close(a, b, msg=lambda m, name=name: f"{name}: {m}")
