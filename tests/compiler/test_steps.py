"""The compiler's steps: several plans of one model from one trace (traced_once), each the
plan compile_model makes tracing the model again."""

from __future__ import annotations

import pytest
from models import ZOO

from fxpipe.compiler import compile_model, steps, traced_once
from fxpipe.options import PlanOptions


def test_plans_of_one_trace_are_those_of_a_trace_each(monkeypatch: pytest.MonkeyPatch) -> None:
    """Flops, then params, then flops with two nodes kept together (what the distributed
    build asks of one model: its plan, then the plan of the stages cut over tp): one trace,
    and each plan the one compile_model makes from a trace of its own."""
    case = ZOO["transformer"]
    model = case.build()
    args, kwargs = case.example(4)
    traces = []
    real = steps.traced_example

    def counted(*a, **k):  # type: ignore[no-untyped-def]
        traces.append(1)
        return real(*a, **k)

    monkeypatch.setattr(steps, "traced_example", counted)
    first = PlanOptions(cost="flops", chunks=2)
    nodes = [n.name for n in compile_model(model, args, ["cpu"] * 3, first,
                                           example_kwargs=kwargs).traced.graph_module.graph.nodes
             if n.op == "call_module"]  # fmt: skip
    pair = frozenset(nodes[len(nodes) // 3 : len(nodes) // 3 + 2])
    asked = [first, PlanOptions(cost="params", chunks=2),
             PlanOptions(cost="flops", chunks=2, together=(pair,))]  # fmt: skip
    traces.clear()
    with traced_once(model, args, ["cpu"] * 3, first, example_kwargs=kwargs) as plan:
        shared = [plan(o).plan for o in asked]
        with pytest.raises(ValueError, match="trace the model again"):
            plan(PlanOptions(cost="flops", chunks=1))  # a whole batch: another trace
    assert len(traces) == 1
    apart = [compile_model(model, args, ["cpu"] * 3, o, example_kwargs=kwargs).plan for o in asked]
    for a, b in zip(shared, apart, strict=True):
        assert dict(a.stage_of) == dict(b.stage_of)
        assert a.bottleneck == pytest.approx(b.bottleneck)
    # the options made different plans, so the test could tell one from another
    assert len({tuple(sorted(p.stage_of.items())) for p in shared}) >= 2
    assert len({shared[2].stage_of[n] for n in pair}) == 1
