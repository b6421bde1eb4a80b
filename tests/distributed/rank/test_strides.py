"""fxpipe.distributed.rank.strides: boundary values keep eager's layout across a send, alone and
on two ranks against eager PyTorch."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from models import LocalConvBlock, LocalConvTokens
from torch import nn

import fxpipe.distributed as fd
from fxpipe.distributed.rank.strides import (
    contiguous_strides,
    in_layout,
    layout_of,
    received,
    sent,
)
from tests.distributed.ranks import N_MB, close, gen, launch, preload, results, step, sum_sq

preload(__name__)


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


def _local_conv_tokens() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """LocalConvTokens (same weights each call), a batch of ``N_MB`` images, a target."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = LocalConvTokens()
    x = torch.randn(N_MB, 3, 8, 8, generator=gen())
    return model, x, torch.randn(N_MB, 5, generator=gen())


def _strided_boundaries(
    rank: int, world: int, *, schedules: list[tuple[str, int]]
) -> list[dict[str, Any]]:
    """For each (schedule, stages per rank): one step of LocalConvTokens in one-sample
    micro-batches; the loss, the gradients, and whether a stage receives a value whose
    layout is not a contiguous tensor's."""
    out = []
    for schedule, spr in schedules:
        model, x, target = _local_conv_tokens()
        pipe = fd.pipeline_schedule(
            model, x, schedule=schedule, n_microbatches=N_MB, loss_fn=sum_sq, stages_per_rank=spr,
            scale_grads=False,
        )  # fmt: skip
        losses = step(pipe, (x,), {}, target)
        # a permuted layout: strides not in decreasing order
        inputs = [s for j, layouts in enumerate(pipe._layouts or ()) if j > 0 for s in layouts]
        strided = any(list(s) != sorted(s, reverse=True) for s in inputs)
        out.append(
            {
                "loss": float(sum(losses)) if losses else None,
                "grads": {k: p.grad.clone() for k, p in pipe.named_parameters()},
                "strided": strided,
            }
        )
    return out


@pytest.mark.slow
def test_a_strided_boundary_value_gets_its_gradient_in_its_own_layout(tmp_path: Path) -> None:
    """Each LocalConvTokens block hands the next a strided view; with one-sample micro-
    batches torch sent it, and sent its gradient back, contiguous, and the sending stage's
    BatchNorm backward gave wrong gradients on that layout (TinyViT: gradients of the
    first stage off by their own size, loss equal). Against eager run one micro-batch at a
    time (BatchNorm in training mode normalises each), for a whole backward and a split one
    (zero bubble hands out copies)."""
    schedules = [("gpipe", 1), ("zbvzerobubble", 2)]
    runs = launch(_strided_boundaries, 2, tmp_path, schedules=schedules)
    model, x, target = _local_conv_tokens()
    loss = sum(sum_sq(model(x[i : i + 1]), target[i : i + 1]) for i in range(N_MB))
    loss.backward()
    for (schedule, _), *per_rank in zip(schedules, *results(runs), strict=True):
        assert any(r["strided"] for r in per_rank), schedule  # the case is still exercised
        assert sum(r["loss"] for r in per_rank if r["loss"] is not None) == pytest.approx(
            loss.item(), rel=1e-5
        )
        got = {k: g for r in per_rank for k, g in r["grads"].items()}
        assert set(got) == {k for k, _ in model.named_parameters()}
        for key, p in model.named_parameters():
            close(got[key], p.grad, f"{schedule}: grad of {key}")
