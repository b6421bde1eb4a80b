"""Fork/join: the backward of a forked tensor waits for the joined tensor's backward."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

from fxpipe.runtime.dependency import fork, join


class Log(torch.autograd.Function):
    """Identity that records ``tag`` in ``log`` when its backward runs."""

    @staticmethod
    def forward(ctx: Any, log: list[str], tag: str, x: torch.Tensor) -> torch.Tensor:
        ctx.log, ctx.tag = log, tag
        return x.detach()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, None, torch.Tensor]:
        ctx.log.append(ctx.tag)
        return None, None, grad


def _backward_order(use_dependency: bool) -> list[str]:
    """Backward order of two independent lanes ``a`` and ``b``.

    Autograd runs the ready node with the highest sequence number first, and sequence
    numbers count per thread. Lane ``b`` is built in a fresh thread (low numbers), lane
    ``a`` in this thread after other work (high numbers), so without a dependency ``a``
    goes backward first.
    """
    log: list[str] = []
    for _ in range(20):
        torch.ones(1, requires_grad=True) * 2
    a = Log.apply(log, "a", torch.ones(2, requires_grad=True))
    phony = torch.empty(0)
    if use_dependency:
        a, phony = fork(a)
    lane_b: list[torch.Tensor] = []

    def build_b() -> None:
        b = torch.ones(2, requires_grad=True) * 1
        if use_dependency:
            b = join(b, phony)
        lane_b.append(Log.apply(log, "b", b))

    thread = threading.Thread(target=build_b)
    thread.start()
    thread.join()
    (a.sum() + lane_b[0].sum()).backward()
    return log


def test_join_orders_backward() -> None:
    assert _backward_order(use_dependency=False) == ["a", "b"]  # the setup discriminates
    assert _backward_order(use_dependency=True) == ["b", "a"]


def test_gradients_pass_through_unchanged() -> None:
    x = torch.randn(3, requires_grad=True)
    y = torch.randn(3, requires_grad=True)
    x2, phony = fork(x * 2)
    y2 = join(y * 3, phony)
    assert phony.numel() == 0
    (x2.sum() + y2.sum()).backward()
    assert x.grad is not None and torch.equal(x.grad, torch.full((3,), 2.0))
    assert y.grad is not None and torch.equal(y.grad, torch.full((3,), 3.0))


def test_no_function_under_no_grad() -> None:
    x = torch.randn(3, requires_grad=True)
    with torch.no_grad():
        x2, phony = fork(x)
        y = join(torch.randn(3), phony)
    assert x2 is x and phony.grad_fn is None and y.grad_fn is None


def test_no_function_without_requires_grad() -> None:
    x = torch.randn(3)
    x2, phony = fork(x)
    assert x2 is x and not phony.requires_grad
    assert join(x, phony) is x


@pytest.mark.parametrize("input_requires_grad", [True, False])
def test_join_makes_the_result_require_grad(input_requires_grad: bool) -> None:
    _, phony = fork(torch.randn(2, requires_grad=True))
    y = join(torch.randn(2, requires_grad=input_requires_grad), phony)
    assert y.requires_grad and y.grad_fn is not None
