"""Phony tensors: empty, cached per (device, requires_grad), and never part of a graph."""

from __future__ import annotations

import torch

from fxpipe.runtime.phony import get_phony


def test_phony_is_empty_and_cached() -> None:
    phony = get_phony(torch.device("cpu"), requires_grad=False)
    assert phony.numel() == 0 and phony.device.type == "cpu"
    assert get_phony(torch.device("cpu", 0), requires_grad=False) is phony
    other = get_phony(torch.device("cpu"), requires_grad=True)
    assert other is not phony and other.requires_grad and not phony.requires_grad


def test_phony_returned_detached_from_a_function_stays_a_leaf() -> None:
    class Identity(torch.autograd.Function):
        @staticmethod
        def forward(ctx: object, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return x.detach(), get_phony(x.device, requires_grad=False).detach()

        @staticmethod
        def backward(ctx: object, g: torch.Tensor, _: torch.Tensor) -> torch.Tensor:
            return g

    x = torch.ones(2, requires_grad=True)
    y, phony = Identity.apply(x)
    assert phony.grad_fn is not None and phony.numel() == 0
    cached = get_phony(torch.device("cpu"), requires_grad=False)
    assert cached.grad_fn is None and not cached.requires_grad
    y.sum().backward()
    assert x.grad is not None and torch.equal(x.grad, torch.ones(2))
