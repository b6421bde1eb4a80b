"""The follower split: another trace of the same model cut along a plan's borders, so that
each weight stays in the stage that holds it, values only flow forward, and groups no
border may split stay whole."""

from __future__ import annotations

from operator import attrgetter
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fxpipe.passes.partition.cost_graph import to_networkx
from fxpipe.passes.partition.search import partition_graph
from fxpipe.passes.partition.units import build_units
from fxpipe.passes.price.estimate import estimate_costs
from fxpipe.passes.split.follow import follow_borders
from fxpipe.passes.split.plan import build_plan
from fxpipe.trace.tracing import trace

CPU = torch.device("cpu")


class Deep(nn.Module):
    """Six blocks, each with dropout and a training-only branch: its eval graph has other
    nodes (and node names) than its training graph."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(16, 16) for _ in range(6))
        self.head = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        for block in self.blocks:
            h = block(x)
            if self.training:
                h = h * 1.5
            x = x + F.dropout(torch.tanh(h), 0.2, self.training)
        out = self.head(x)
        if labels is not None:  # the other argument structure: a loss at the end
            return F.cross_entropy(out, labels, reduction="sum")
        return out


def _graph(model: nn.Module, tracer: str, labels: bool = False) -> tuple[Any, Any]:
    x = torch.randn(8, 16)
    kwargs = {"labels": torch.randint(0, 3, (8,))} if labels else {}
    t = trace(model, (x,), kwargs, tracer=tracer)
    costs = estimate_costs(t.graph_module, t.example_values, mode="flops")
    return t.graph_module, (costs, to_networkx(t.graph_module, costs))


@pytest.mark.parametrize("tracer", ["fx", "export"])
@pytest.mark.parametrize("other", ["eval", "labels"])
def test_a_followed_split_keeps_every_weight_in_its_stage(tracer: str, other: str) -> None:
    torch.manual_seed(0)
    model = Deep()
    lead_gm, (costs, g) = _graph(model, tracer)
    leader = build_plan(lead_gm, costs, g, partition_graph(g, 3), [CPU] * 3, chunks=2)
    if other == "eval":
        model.eval()
    gm, (_, g2) = _graph(model, tracer, labels=other == "labels")
    stage_of = follow_borders(leader, gm, g2)

    assert set(stage_of) == {n.name for n in gm.graph.nodes}
    home = {
        id(attrgetter(str(n.target))(lead_gm)): leader.stage_of[n.name]
        for n in lead_gm.graph.nodes
        if n.op == "get_attr"
    }
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            assert stage_of[node.name] == home[id(attrgetter(str(node.target))(gm))], node.name
        for arg in node.all_input_nodes:  # values flow forward only
            if node.op != "output":
                assert stage_of[arg.name] <= stage_of[node.name] or arg.op == "get_attr"
    units = build_units(g2)
    for members in units.members:
        assert len({stage_of[n] for n in members}) == 1
    compute = ("call_function", "call_method", "call_module")
    assert {stage_of[n.name] for n in gm.graph.nodes if n.op in compute} == {0, 1, 2}
