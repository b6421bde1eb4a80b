"""The networkx view of a priced graph: attributes, data edges, and ordering of in-place ops."""

from __future__ import annotations

import functools
import operator
from typing import Any

import networkx as nx
import pytest
import torch
import torch.fx as fx
from models import ZOO, Case
from torch import nn

from fxpipe.ir import CostTable
from fxpipe.passes.partition.cost_graph import readers, replicated_attrs, to_networkx
from fxpipe.passes.partition.search import partition_graph
from fxpipe.passes.partition.units import build_units
from fxpipe.passes.price.estimate import estimate_costs
from fxpipe.trace.tracing import trace

ALL = list(ZOO.values())


pytestmark = pytest.mark.usefixtures("one_thread")


@functools.cache
def priced(name: str) -> tuple[Any, CostTable]:
    case = ZOO[name]
    args, kwargs = case.example(case.batch)
    t = trace(case.build().eval(), args, kwargs, tracer=case.tracer)
    return t, estimate_costs(t.graph_module, t.example_values, mode="flops")


def priced_model(model: nn.Module, *args: torch.Tensor) -> tuple[fx.GraphModule, CostTable]:
    t = trace(model, args, tracer="fx")
    return t.graph_module, estimate_costs(t.graph_module, t.example_values, mode="flops")


def data_edges(gm: fx.GraphModule) -> set[tuple[str, str]]:
    return {(a.name, n.name) for n in gm.graph.nodes for a in n.all_input_nodes}


@pytest.mark.parametrize("case", ALL, ids=lambda c: c.name)
def test_nodes_and_data_edges_carry_costs_and_bytes(case: Case) -> None:
    t, costs = priced(case.name)
    gm = t.graph_module
    code = gm.code
    g = to_networkx(gm, costs)
    assert gm.code == code
    assert isinstance(g, nx.DiGraph) and nx.is_directed_acyclic_graph(g)
    nodes = list(gm.graph.nodes)
    assert set(g.nodes) == {n.name for n in nodes} and len(g) == len(nodes)
    for index, node in enumerate(nodes):
        attrs, c = g.nodes[node.name], costs.nodes[node.name]
        assert attrs["op"] == node.op
        assert attrs["index"] == index
        assert attrs["weight"] == c.cost
        assert attrs["bytes"] == c.output_bytes
        assert attrs["is_tensor"] == c.is_tensor
        assert attrs["param_bytes"] == c.param_bytes
    data = data_edges(gm)
    assert data <= set(g.edges)
    position = {n.name: i for i, n in enumerate(nodes)}
    for u, v, attrs in g.edges(data=True):
        assert position[u] < position[v]  # every edge follows the fx order
        if (u, v) in data:
            assert attrs["bytes"] == costs.nodes[u].output_bytes
            if costs.nodes[u].is_tensor is False:
                assert attrs["is_tensor"] is False
        else:  # an ordering edge: nothing travels on it
            assert attrs["bytes"] == 0


class InPlaceMethod(nn.Module):
    """``a.relu_()`` whose result is unused, between a reader of ``a`` and a later one."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.out = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.lin(x)
        before = a * 2
        a.relu_()
        after = self.out(a)
        return before + after


class InPlaceModule(nn.Module):
    """``nn.ReLU(inplace=True)`` on a value that is also read before and after it."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.act = nn.ReLU(inplace=True)
        self.out = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.lin(x)
        before = a * 2
        r = self.act(a)
        after = self.out(a)
        return before + after + r


@pytest.mark.parametrize("model_type", [InPlaceMethod, InPlaceModule])
def test_in_place_op_is_tied_to_its_input_and_ordered_with_other_readers(
    model_type: type[nn.Module],
) -> None:
    model = model_type()
    x = torch.randn(4, 8)
    gm, costs = priced_model(model, x)
    with torch.no_grad():  # the traced graph keeps eager's in-place semantics
        assert torch.equal(gm(x)[0], model(x))
    g = to_networkx(gm, costs)
    by_target = {n.target: n.name for n in gm.graph.nodes}
    inplace = by_target["relu_"] if model_type is InPlaceMethod else by_target["act"]
    a, before, after = by_target["lin"], "mul", by_target["out"]
    assert g.edges[a, inplace]["is_tensor"] is False  # no border between value and mutation
    assert g.edges[a, before]["is_tensor"] is True
    assert g.edges[a, after]["is_tensor"] is True
    assert g.has_edge(before, inplace) and g.edges[before, inplace]["bytes"] == 0
    assert g.has_edge(inplace, after)
    assert not g.has_edge(inplace, before) and not g.has_edge(after, inplace)
    assert nx.is_directed_acyclic_graph(g)


def test_unused_in_place_result_still_orders_later_readers_in_the_zoo() -> None:
    t, costs = priced("bn_dropout_buffers")
    gm = t.graph_module
    g = to_networkx(gm, costs)
    position = {n: i for i, n in enumerate(gm.graph.nodes)}
    mutations = [n for n in gm.graph.nodes if n.op == "call_method" and n.target == "relu_"]
    assert len(mutations) == 4 and all(not n.users for n in mutations)
    for node in mutations:
        target = node.args[0]
        assert g.edges[target.name, node.name]["is_tensor"] is False
        for reader in target.users:
            if reader is node or reader.op == "output":
                continue
            if g.edges[target.name, reader.name]["is_tensor"] is False:
                continue  # a view of the value (an eval-mode dropout): kept with the write
            if position[reader] < position[node]:
                assert g.has_edge(reader.name, node.name), reader.name
            else:
                assert g.has_edge(node.name, reader.name), reader.name
    resnet, resnet_costs = priced("resnet")
    rg = to_networkx(resnet.graph_module, resnet_costs)
    relus = [
        n
        for n in resnet.graph_module.graph.nodes
        if n.op == "call_module" and str(n.target).endswith("relu")
    ]
    assert relus  # nn.ReLU(inplace=True) modules
    for node in relus:
        assert rg.edges[node.args[0].name, node.name]["is_tensor"] is False


class InPlaceWithOperand(nn.Module):
    """``a.add_(b)`` where ``b`` reads ``a`` first: ``b`` is a real input of the mutation."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.lin(x)
        b = a * 2
        a.add_(b)
        return a + 1


def test_ordering_edges_keep_the_bytes_of_data_edges() -> None:
    gm, costs = priced_model(InPlaceWithOperand(), torch.randn(4, 8))
    g = to_networkx(gm, costs)
    assert g.edges["mul", "add_"]["bytes"] == costs.nodes["mul"].output_bytes > 0


class MaskAnd(nn.Module):
    """``causal & padding`` (``operator.and_``, named like an in-place method) read twice."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("causal", torch.ones(6, 6, dtype=torch.bool).tril())
        self.lin = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        t = pad.shape[1]
        causal = self.causal.narrow(0, 0, t).narrow(1, 0, t)  # views of the buffer
        keep = causal & (pad != 0)[:, None, :]
        also = causal | (pad == 0)[:, None, :]
        h = self.lin(x).masked_fill(~keep, 0.0)
        return self.lin(h).masked_fill(also, 1.0)


def test_operator_and_or_are_not_in_place_and_add_no_ordering_edge() -> None:
    model = MaskAnd()
    x, pad = torch.randn(2, 6, 6), (torch.arange(6) < 4).float().expand(2, 6)
    gm, costs = priced_model(model, x, pad)
    g = to_networkx(gm, costs)
    assert not [e for e in g.edges(data=True) if e[2].get("order")]
    assert set(g.edges) == data_edges(gm)
    logical = [n for n in gm.graph.nodes if n.target in (operator.and_, operator.or_)]
    assert len(logical) == 2
    for node in logical:  # a border may fall between the mask and its sources
        assert all(g.edges[a.name, node.name]["is_tensor"] for a in node.all_input_nodes)


def test_readers_leave_out_ordering_edges() -> None:
    gm, costs = priced_model(InPlaceModule(), torch.randn(4, 8))
    g = to_networkx(gm, costs)
    ordered = [(a, b) for a, b, d in g.edges(data=True) if d.get("order")]
    assert ordered  # mul -> act, act -> out
    users = {n.name: {u.name for u in n.users} for n in gm.graph.nodes}
    for name in g.nodes:
        assert set(readers(g, name)) == users[name], name


class TableInEveryLayer(nn.Module):
    """A table made with autocast off and read by every layer: torch.export records the
    region as a higher-order op whose body is a submodule; the tracer recomputes the table
    beside each layer, so four copies of the op read one ``get_attr`` of that body."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast(device_type=x.device.type, enabled=False):  # 8: x's width
            table = torch.arange(8, dtype=x.dtype, device=x.device).cos()
        for layer in self.layers:
            x = layer(x) * table
        return x


def test_a_shared_higher_order_op_body_is_replicated_and_ties_no_layers_together() -> None:
    t = trace(TableInEveryLayer(), (torch.randn(4, 8),), tracer="export")
    gm = t.graph_module
    g = to_networkx(gm, estimate_costs(gm, t.example_values, mode="flops"))
    (body,) = [n for n, shared in g.nodes(data="replicated") if shared]
    assert g.nodes[body]["op"] == "get_attr" and g.nodes[body]["bytes"] == 0
    assert replicated_attrs(gm) == {body}
    calls = list(g.successors(body))
    assert len(calls) == 4  # one copy of the op per layer
    assert all(g.edges[body, v]["bytes"] == 0 for v in calls)
    units = build_units(g)
    assert len({units.unit_of[v] for v in calls}) == 4  # each with its own layer
    stage_of = partition_graph(g, 4).stage_of
    assert sorted(stage_of[v] for v in calls) == [0, 1, 2, 3]
