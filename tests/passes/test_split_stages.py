"""Stage codegen: explicit stage inputs and outputs, exact numerics, shared Parameter objects."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
import torch.fx as fx
from models import ZOO, Case
from torch import nn

from fxpipe.ir import PipelinePlan, StageProgram, ValueRef
from fxpipe.passes.partition.cost_graph import to_networkx
from fxpipe.passes.partition.search import partition_graph
from fxpipe.passes.price.estimate import estimate_costs
from fxpipe.passes.split.codegen import run_stages, split_stages
from fxpipe.passes.split.plan import build_plan
from fxpipe.trace.tracing import Traced, trace

ALL = list(ZOO.values())
MODES = ["direct", "relay"]
CPU = torch.device("cpu")


pytestmark = pytest.mark.usefixtures("one_thread")


@functools.cache
def traced(name: str) -> tuple[nn.Module, Traced, Any, Any]:
    case = ZOO[name]
    model = case.build().eval()
    args, kwargs = case.example(case.batch)
    t = trace(model, args, kwargs, tracer=case.tracer)
    costs = estimate_costs(t.graph_module, t.example_values, mode="flops")
    return model, t, costs, to_networkx(t.graph_module, costs)


@functools.cache
def planned(name: str, k: int) -> PipelinePlan:
    _, t, costs, g = traced(name)
    part = partition_graph(g, k)
    return build_plan(t.graph_module, costs, g, part, [CPU] * k, chunks=4)


@functools.cache
def program(name: str, k: int, mode: str) -> StageProgram:
    return split_stages(planned(name, k), traced(name)[1].output_spec, traffic=mode)


def stage_counts(case: Case) -> list[int]:
    counts = list(range(1, min(4, case.max_stages) + 1))
    return counts + ([case.max_stages] if case.max_stages > 4 else [])


ZOO_PARAMS = [
    pytest.param(case, k, id=f"{case.name}-{k}") for case in ALL for k in stage_counts(case)
]


def placeholder_names(gm: fx.GraphModule) -> list[str]:
    return [str(n.target) for n in gm.graph.nodes if n.op == "placeholder"]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case, k", ZOO_PARAMS)
def test_stage_structure(case: Case, k: int, mode: str) -> None:
    _, t, _, _ = traced(case.name)
    plan = planned(case.name, k)
    code = t.graph_module.code
    prog = program(case.name, k, mode)
    assert t.graph_module.code == code  # the traced graph is not modified
    assert prog.num_stages == k and prog.traffic == mode
    assert prog.graph_inputs == tuple(placeholder_names(t.graph_module))
    assert len(prog.inputs) == len(prog.outputs) == k
    naming = {n.name for n in t.graph_module.graph.nodes if n.op in ("placeholder", "output")}
    for j, module in enumerate(prog.modules):
        assert isinstance(module, fx.GraphModule)
        assert placeholder_names(module) == list(prog.inputs[j])
        out = [n for n in module.graph.nodes if n.op == "output"]
        assert len(out) == 1 and isinstance(out[0].args[0], tuple)
        assert len(out[0].args[0]) == len(prog.outputs[j])
        computed = [n.name for n in module.graph.nodes if n.op not in ("placeholder", "output")]
        assert computed == [n for n in plan.stages[j].nodes if n not in naming]
    available = set(prog.graph_inputs)
    for j in range(k):
        if mode == "relay":  # stage j reads only the model inputs (j = 0) or stage j - 1
            allowed = set(prog.graph_inputs) if j == 0 else set(prog.outputs[j - 1])
            assert set(prog.inputs[j]) <= allowed, j
        assert set(prog.inputs[j]) <= available, j  # everything read was made before
        available |= set(prog.outputs[j])
    refs = [r.name for r in prog.output_leaves if isinstance(r, ValueRef)]
    graph_output = [n for n in t.graph_module.graph.nodes if n.op == "output"][0]
    assert len(prog.output_leaves) == len(graph_output.args[0])
    if mode == "relay":
        assert set(refs) <= set(prog.outputs[-1])
    else:
        assert set(refs) <= available


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case, k", ZOO_PARAMS)
def test_run_stages_equals_the_traced_graph(case: Case, k: int, mode: str) -> None:
    model, t, _, _ = traced(case.name)
    prog = program(case.name, k, mode)
    with torch.no_grad():
        want = t.graph_module(*t.example_values)
        got = run_stages(prog, t.example_values)
        assert len(got) == len(want)
        for a, b in zip(got, want, strict=True):
            assert torch.equal(a, b)
        if mode == "relay":
            return
        # another input through the same stages: still the eager model
        args, kwargs = case.example(3)
        got3 = run_stages(prog, t.binder.bind(args, kwargs))
        eager = torch.utils._pytree.tree_flatten(model(*args, **kwargs))[0]
        for a, b in zip(got3, eager, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def fetch(root: nn.Module, target: str) -> Any:
    value: Any = root
    for part in target.split("."):
        value = getattr(value, part)
    return value


def held(module: nn.Module) -> dict[int, nn.Parameter]:
    return {id(p): p for p in module.parameters()}


def boundary_params(prog: StageProgram, gm: fx.GraphModule, j: int) -> set[int]:
    """Parameters stage ``j`` receives as boundary values from an earlier stage."""
    by_name = {n.name: n for n in gm.graph.nodes}
    out = set()
    for name in prog.inputs[j]:
        node = by_name[name]
        if node.op == "get_attr":
            out.add(id(fetch(gm, str(node.target))))
    return out


@pytest.mark.parametrize(
    "case",
    [pytest.param(c, id=c.name) for c in ALL],
)
def test_stages_share_the_users_parameters_once(case: Case) -> None:
    model, t, _, _ = traced(case.name)
    mine = held(model)
    for k in stage_counts(case)[1:]:
        for mode in MODES:
            prog = program(case.name, k, mode)
            stages = [held(m) for m in prog.modules]
            for params in stages:  # the user's own objects, never copies
                assert all(mine.get(i) is p for i, p in params.items())
            union = set().union(*stages)
            assert union == set(held(t.graph_module))
            owner: dict[int, int] = {}
            for j, params in enumerate(stages):
                received = boundary_params(prog, t.graph_module, j)
                for i in set(params) - received:
                    assert i not in owner, f"stages {owner[i]} and {j} both hold a parameter"
                    owner[i] = j
                assert not set(params) & received


def _tied_node(gm: fx.GraphModule, weight: torch.Tensor) -> fx.Node:
    nodes = [
        n for n in gm.graph.nodes if n.op == "get_attr" and fetch(gm, str(n.target)) is weight
    ]
    assert len(nodes) == 1
    return nodes[0]


@pytest.mark.parametrize("mode", MODES)
def test_tied_weight_is_made_once_and_passed_on(mode: str) -> None:
    model, t, _, _ = traced("transformer")
    gm = t.graph_module
    node = _tied_node(gm, model.tok.weight)
    crossed = 0
    for k in (2, 3, 4, 8):
        plan = planned("transformer", k)
        prog = program("transformer", k, mode)
        readers = sorted({plan.stage_of[u.name] for u in node.users})
        producer = plan.stage_of[node.name]
        assert producer == readers[0]  # it lives with the first stage that uses it
        owners = [j for j, m in enumerate(prog.modules) if id(model.tok.weight) in held(m)]
        assert owners == [producer]
        if len(readers) == 1:
            continue
        crossed += 1
        assert [j for j in range(k) if node.name in prog.outputs[j]][:1] == [producer]
        for r in readers[1:]:
            assert node.name in prog.inputs[r]
        if mode == "direct":
            assert [j for j in range(k) if node.name in prog.outputs[j]] == [producer]
    assert crossed  # the two readers were in different stages for some k


@pytest.mark.parametrize("case, k", [p for p in ZOO_PARAMS if p.values[1] > 1])
def test_direct_mode_sends_model_inputs_to_every_stage_reading_them(case: Case, k: int) -> None:
    _, t, _, _ = traced(case.name)
    plan = planned(case.name, k)
    prog = program(case.name, k, "direct")
    for node in t.graph_module.graph.nodes:
        if node.op != "placeholder":
            continue
        readers = {plan.stage_of[u.name] for u in node.users if u.op != "output"}
        for j in range(k):
            assert (node.name in prog.inputs[j]) == (j in readers), (node.name, j)
        assert all(node.name not in out for out in prog.outputs)


class TableInEveryLayer(nn.Module):
    """A table made with autocast off (as transformers 4.x makes its rotary tables) and read
    by every layer: torch.export records the region as a higher-order op whose body is a
    submodule, and the tracer recomputes the table beside each reader, so every copy of the
    op names that one body with a ``get_attr``."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast(device_type=x.device.type, enabled=False):  # 8: x's width
            table = torch.arange(8, dtype=x.dtype, device=x.device).cos()
        for layer in self.layers:
            x = layer(x) * table
        return x


@pytest.mark.parametrize("mode", MODES)
def test_a_submodule_read_in_two_stages_is_named_in_each_not_sent(mode: str) -> None:
    model = TableInEveryLayer().eval()
    x = torch.randn(4, 8)
    t = trace(model, (x,), tracer="export")
    gm = t.graph_module
    attrs = [n for n in gm.graph.nodes if n.op == "get_attr"]
    (body,) = [n for n in attrs if isinstance(fetch(gm, str(n.target)), nn.Module)]
    costs = estimate_costs(gm, t.example_values, mode="flops")
    g = to_networkx(gm, costs)
    part = partition_graph(g, 2, traffic=mode)
    plan = build_plan(gm, costs, g, part, [CPU] * 2, chunks=2)
    assert {plan.stage_of[u.name] for u in body.users} == {0, 1}  # read in both stages
    assert body.name not in {e.value for e in plan.edges}
    assert all(body.name not in s.inputs + s.outputs for s in plan.stages)
    prog = split_stages(plan, t.output_spec, traffic=mode)
    for j, stage in enumerate(prog.modules):
        assert body.name not in prog.inputs[j] + prog.outputs[j]
        own = [n for n in stage.graph.nodes if n.op == "get_attr" and n.target == body.target]
        assert len(own) == 1, f"stage {j} does not name the body itself"
        assert fetch(stage, str(body.target)) is fetch(gm, str(body.target))  # not copied
    (got,) = run_stages(prog, t.example_values)
    assert isinstance(got, torch.Tensor)
    torch.testing.assert_close(got, model(x), rtol=1e-6, atol=1e-6)


class AliasBeforeMutation(nn.Module):
    """``v`` is a view of ``a`` read by ``l2`` before ``a.relu_()`` changes ``a`` in place."""

    def __init__(self) -> None:
        super().__init__()
        self.l1, self.l2, self.l3 = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.l1(x)
        v = a.view(-1, 4)
        y = self.l2(v)
        a.relu_()
        return y + self.l3(a)


def test_a_view_read_before_an_in_place_op_sees_the_old_values() -> None:
    model = AliasBeforeMutation().eval()
    x = torch.randn(3, 4)
    t = trace(model, (x,), tracer="fx")
    weights = {"l1": 1.0, "l2": 10.0, "l3": 10.0}  # l2 alone in a middle stage is cheapest
    costs = estimate_costs(
        t.graph_module,
        t.example_values,
        mode=lambda n: weights.get(str(n.target), 0.0) if n.op == "call_module" else 0.0,
    )
    g = to_networkx(t.graph_module, costs)
    plan = build_plan(t.graph_module, costs, g, partition_graph(g, 3), [CPU] * 3, chunks=1)
    with torch.no_grad():
        want = model(x)
        assert torch.equal(t.graph_module(x)[0], want)
        for mode in MODES:
            got = run_stages(split_stages(plan, t.output_spec, traffic=mode), (x,))
            assert torch.equal(got[0], want), mode


@pytest.mark.parametrize("traffic", MODES)
@pytest.mark.parametrize("case, k", ZOO_PARAMS)
def test_planned_border_bytes_are_what_the_stages_receive(
    case: Case, k: int, traffic: str
) -> None:
    """The bytes the partitioner minimises are the bytes of the values stages 1..K-1 take
    as inputs in the generated program (each value once per receiving stage; in relay mode
    once per stage it passes through), so no edge that carries nothing (an ordering edge
    after an in-place write) counts, and none that carries something is missed."""
    _, t, costs, g = traced(case.name)
    part = partition_graph(g, k, traffic=traffic)
    plan = build_plan(t.graph_module, costs, g, part, [CPU] * k, chunks=4)
    prog = split_stages(plan, t.output_spec, traffic=traffic)
    received = sum(costs.nodes[v].output_bytes for inputs in prog.inputs[1:] for v in inputs)
    assert part.border_bytes == received
