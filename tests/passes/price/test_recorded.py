"""Pricing from the shapes torch.export recorded: every node priced as a run on fake tensors
prices it, and the outputs recorded at two batch sizes are those fake runs give."""

from __future__ import annotations

import functools

import pytest
from models import ZOO, Case

from fxpipe.ir import CostTable
from fxpipe.passes.ops import is_check
from fxpipe.passes.price import estimate as cost_model
from fxpipe.passes.price.estimate import estimate_costs
from fxpipe.passes.price.recorded import recorded_outputs, recorded_shapes
from fxpipe.trace.example_checks import _FakeRun
from fxpipe.trace.tracing import Traced, trace

pytestmark = pytest.mark.usefixtures("one_thread")

EXPORTED = [c for c in ZOO.values() if c.tracer == "export"] + [ZOO["resnet"], ZOO["unet"]]


@functools.cache
def exported(name: str) -> Traced:
    case = ZOO[name]
    args, kwargs = case.example(case.batch)
    return trace(case.build(), args, kwargs, tracer="export")


def _fake_run_roofline(t: Traced, micro_batches: int) -> CostTable:
    """Roofline costs from a run on fake tensors, whatever export recorded."""
    return cost_model._run(
        t.graph_module, t.example_values, "roofline", None, None, 1, None, None, micro_batches
    )


@pytest.mark.parametrize("case", EXPORTED, ids=lambda c: c.name)
def test_recorded_shapes_price_every_node_as_a_fake_run_does(case: Case) -> None:
    """An export graph is priced from the shapes on its nodes, running nothing; every field
    of every node equals what a run on fake tensors gives."""
    t = exported(case.name)
    assert recorded_shapes(t.graph_module, t.example_values) is not None
    fast = estimate_costs(t.graph_module, t.example_values, mode="roofline", micro_batches=3)
    slow = _fake_run_roofline(t, 3)
    assert list(fast.nodes) == list(slow.nodes)
    checks = {n.name for n in t.graph_module.graph.nodes if is_check(n)}
    for name, a in fast.nodes.items():
        b = slow.nodes[name]
        if name in checks:  # an assertion computes nothing: the cost table prices it 0
            assert a.cost == 0.0, name
        else:
            assert a.cost == pytest.approx(b.cost, rel=1e-9, abs=1e-15), name
        assert (a.output_bytes, a.param_bytes, a.is_tensor) == (
            b.output_bytes,
            b.param_bytes,
            b.is_tensor,
        ), name
        assert (a.requires_grad, a.saved_bytes) == (b.requires_grad, b.saved_bytes), name


@pytest.mark.parametrize("case", EXPORTED, ids=lambda c: c.name)
def test_recorded_outputs_at_two_batch_sizes_match_fake_runs(case: Case) -> None:
    t = exported(case.name)
    runs = recorded_outputs(t.graph_module, t.example_values, case.batch)
    assert runs is not None
    for run, size in zip(runs, (case.batch, case.batch + 1)):
        fake = _FakeRun(t.graph_module).outputs(t.example_values, size)
        assert [v if not tensor else tuple(v) for tensor, v in run] == [
            tuple(v) if isinstance(v, tuple) else v for v in fake
        ]
