"""Shared values made only from inputs and buffers are recomputed beside each reader."""

from __future__ import annotations

import pytest
import torch
from oracle import relative_error
from torch import nn

import fxpipe
from fxpipe.ir import RECOMPUTE
from fxpipe.trace.tracing import trace

pytestmark = pytest.mark.usefixtures("one_thread")
T, D = 12, 8


class MaskedLayers(nn.Module):
    """Builds a B x T x T pair mask from a B x T padding mask and reads it in every layer;
    ``mode`` swaps the shared value for one that must not be recomputed."""

    def __init__(self, mode: str = "mask", layers: int = 4) -> None:
        super().__init__()
        self.mode = mode
        self.layers = nn.ModuleList(nn.Linear(D, D) for _ in range(layers))
        self.scale = nn.Parameter(torch.ones(T, T))

    def forward(self, x: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        if self.mode == "mask":  # expands B x T into B x T x T: recomputed
            shared = pad[:, :, None] * pad[:, None, :] - 1.0
        elif self.mode == "pooled":  # shrinks B x T x D into B x T x 1: sent, not recomputed
            shared = x.mean(2, keepdim=True)
        elif self.mode == "parameter":  # reads a parameter: its gradient must stay one
            shared = pad[:, :, None] * self.scale
        else:  # random: two copies would draw differently
            shared = (torch.rand_like(pad) > 2.0).to(pad.dtype)[:, :, None] * pad[:, None, :]
        for layer in self.layers:
            mixed = shared * x if self.mode == "pooled" else shared @ x
            x = torch.relu(layer(x)) + mixed * 0.01
        return x


def _example(batch: int = 6) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(batch, T, D, generator=gen, dtype=torch.float64)
    pad = (torch.rand(batch, T, generator=gen) > 0.2).double()
    return x, pad


def _copies(model: nn.Module) -> int:
    t = trace(model, _example(), tracer="fx")
    return sum(1 for n in t.graph_module.graph.nodes if n.meta.get(RECOMPUTE))


def test_expanding_mask_is_recomputed_per_reader_and_never_sent() -> None:
    model = MaskedLayers().double()
    assert _copies(model) > 0
    x, pad = _example()
    pipe = fxpipe.pipeline(model, (x, pad), ["cpu"] * 4, chunks=3, cost="flops")
    sent = {e.value for e in pipe.plan.edges}
    recomputed = {n.name for n in pipe.plan.graph_module.graph.nodes if n.meta.get(RECOMPUTE)}
    assert recomputed and not sent & recomputed
    # every stage with a layer gets the small padding mask instead of the B x T x T mask
    assert sum("pad" in s.inputs for s in pipe.plan.stages) >= 3
    xs, pads = x.clone().requires_grad_(), pad
    out = pipe(xs, pads)
    out.square().sum().backward()
    xe = x.clone().requires_grad_()
    expected = model(xe, pad)
    expected.square().sum().backward()
    assert relative_error(out, expected) < 1e-12
    assert relative_error(xs.grad, xe.grad) < 1e-12


@pytest.mark.parametrize("mode", ["pooled", "parameter", "random"])
def test_values_that_must_not_be_recomputed_are_left_shared(mode: str) -> None:
    assert _copies(MaskedLayers(mode).double()) == 0


def test_a_value_written_in_place_is_never_recomputed() -> None:
    class Writes(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(D, D), nn.Linear(D, D)

        def forward(self, x: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
            mask = pad[:, :, None] * pad[:, None, :]
            h = self.a(x) + (mask @ x)
            mask.mul_(2.0)  # the second reader must see the doubled mask
            return self.b(h) + (mask @ x)

    model = Writes().double()
    assert _copies(model) == 0
    x, pad = _example()
    pipe = fxpipe.pipeline(model, (x, pad), ["cpu"] * 2, chunks=2, cost="flops")
    assert relative_error(pipe(x, pad), model(x, pad.clone())) < 1e-12
