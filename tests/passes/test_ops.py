"""Regions that run under a changed interpreter state (torch.vmap levels in an export graph)
stay in one stage, are priced without repeating their state changes, and pipeline exactly."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.fx as fx
from helpers import sweep
from oracle import relative_error
from torch import nn

import fxpipe
from fxpipe.passes.ops import state_change, stateful_regions
from fxpipe.trace.tracing import trace

pytestmark = pytest.mark.usefixtures("one_thread")


class VmapInside(nn.Module):
    """A per-sample ``torch.vmap`` between layers (as Hugging Face mask builders do), then
    blocks under autocast and no_grad, which export wraps into single nodes."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.a = nn.Linear(width, width)
        self.b = nn.Linear(width, width)
        self.c = nn.Linear(width, width)
        self.d = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x).relu()
        pair = torch.vmap(lambda r: torch.vmap(lambda s: s * r.sum())(r))(h)
        h = self.b(h + pair)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=False):
            h = self.c(h).tanh()
        with torch.no_grad():
            scale = h.abs().mean(-1, keepdim=True) + 1
        return self.d(h / scale)


def _traced() -> fx.GraphModule:
    model = VmapInside()
    return trace(model, (torch.randn(6, 8),), {}, tracer="export").graph_module


def test_regions_span_from_the_outer_open_to_its_close() -> None:
    graph = _traced().graph
    regions = stateful_regions(graph)
    assert len(regions) == 1  # the inner vmap nests inside the outer one
    (region,) = regions
    kinds = [state_change(n) for n in region]
    assert kinds[0] == "open" and kinds[-1] == "close"
    assert kinds.count("open") == kinds.count("close") == 2
    order = list(graph.nodes)
    first, last = order.index(region[0]), order.index(region[-1])
    assert region == order[first : last + 1]  # every node in between, users or not


def test_regions_of_a_graph_without_state_changes_are_empty() -> None:
    gm = fx.symbolic_trace(nn.Sequential(nn.Linear(3, 3), nn.ReLU()))
    assert stateful_regions(gm.graph) == []


@pytest.mark.parametrize("stages", sweep([2, 3, 4, 5]))
@pytest.mark.parametrize("cost", ["time", "flops"])
def test_vmap_region_pipelines_like_eager(stages: int, cost: str) -> None:
    model = VmapInside().double()
    reference = copy.deepcopy(model)
    x = torch.randn(6, 8, dtype=torch.float64)
    pipe = fxpipe.pipeline(model, x, ["cpu"] * stages, tracer="export", cost=cost, chunks=3)

    region = stateful_regions(pipe.plan.graph_module.graph)[0]
    assert len({pipe.plan.stage_of[n.name] for n in region}) == 1

    want, got = reference(x), pipe(x)
    assert relative_error(got, want) < 1e-12
    want.square().sum().backward()
    got.square().sum().backward()
    grads = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        assert relative_error(p.grad, grads[name].grad) < 1e-12, name
