"""Device constants in traced graphs follow the stage's device (passes/split/placement.py)."""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx
from models import ZOO
from torch import nn

from fxpipe.compiler import compile_model
from fxpipe.options import PlanOptions
from fxpipe.passes.split.placement import place_graph

META = torch.device("meta")


def _devices_in(graph: fx.Graph) -> set[torch.device]:
    found: set[torch.device] = set()

    def visit(value: object) -> None:
        if isinstance(value, torch.device):
            found.add(value)
        elif isinstance(value, (tuple, list)):
            for v in value:
                visit(v)
        elif isinstance(value, dict):
            for v in value.values():
                visit(v)

    for node in graph.nodes:
        visit(node.args)
        visit(node.kwargs)
    return found


class Positions(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(x.shape[1], device="cpu", dtype=x.dtype)
        ones = torch.ones(x.shape[1], device=torch.device("cpu"))
        return x.to("cpu") * pos + ones


def test_every_device_constant_is_replaced() -> None:
    gm = fx.symbolic_trace(Positions())
    place_graph(gm.graph, META)
    kinds = {n.target: (n.args, dict(n.kwargs)) for n in gm.graph.nodes if n.op != "placeholder"}
    assert kinds[torch.arange][1]["device"] == META
    assert kinds[torch.ones][1]["device"] == META
    assert kinds["to"][0][1] == META
    gm.recompile()
    out = gm(torch.randn(2, 5, device="meta"))
    assert out.device == META and out.shape == (2, 5)


@pytest.mark.slow
def test_export_stages_make_their_tensors_on_their_device() -> None:
    """torch.export records the example's device in factory calls (the Llama's position
    table, its causal mask); each stage module gets its own device instead. Stages planned
    for the meta device are only inspected here; tests/test_cuda.py runs them on a GPU."""
    case = ZOO["llama"]
    model = case.build()
    args, kwargs = case.example(case.batch)
    compiled = compile_model(
        model,
        args,
        ["cpu", "cpu"],
        PlanOptions(cost="flops", tracer="export"),
        example_kwargs=kwargs,
    )
    traced = _devices_in(compiled.plan.graph_module.graph)
    assert traced == {torch.device("cpu")}, "the traced graph keeps the example's device"
    for stage in compiled.program.modules:
        assert _devices_in(stage.graph) <= {torch.device("cpu")}
    moved = compile_model(
        model,
        args,
        ["cpu", "meta"],
        PlanOptions(cost="flops", tracer="export"),
        example_kwargs=kwargs,
    )
    assert any(_devices_in(m.graph) == {META} for m in moved.program.modules)
