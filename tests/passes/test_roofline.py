"""The default cost: analytic roofline seconds, the same on every run, and equal whether
read from the shapes torch.export recorded or from a run on fake tensors."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable

import pytest
import torch
from models import ZOO, Case
from torch import nn

import fxpipe
from fxpipe.ir import CostTable
from fxpipe.passes.ops import is_check
from fxpipe.passes.price import estimate as cost_model
from fxpipe.passes.price.estimate import estimate_costs
from fxpipe.passes.price.recorded import recorded_outputs, recorded_shapes
from fxpipe.passes.price.roofline import ROOFLINES, Roofline, Work
from fxpipe.passes.shape_only import same_shape_output
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


@pytest.mark.slow
def test_roofline_pricing_reads_no_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    """Nothing is timed, so the costs cannot depend on the machine's load."""
    t = exported("llama")
    mlp = ZOO["mlp_residual"]
    args, _ = mlp.example(mlp.batch)
    fx_traced = trace(mlp.build(), args, tracer="fx")

    def no_clock() -> float:
        raise AssertionError("the roofline read the clock")

    for name in ("perf_counter", "time", "monotonic", "process_time"):
        monkeypatch.setattr(time, name, no_clock)
    for traced in (t, fx_traced):
        table = estimate_costs(traced.graph_module, traced.example_values, mode="roofline")
        assert table.unit == "s" and sum(c.cost for c in table.nodes.values()) > 0


@pytest.mark.slow
def test_costs_do_not_depend_on_torch_threads() -> None:
    case = ZOO["transformer"]
    args, kwargs = case.example(case.batch)
    t = trace(case.build(), args, kwargs, tracer="fx")
    first = estimate_costs(t.graph_module, t.example_values, mode="roofline", micro_batches=4)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        second = estimate_costs(t.graph_module, t.example_values, mode="roofline", micro_batches=4)
    finally:
        torch.set_num_threads(threads)
    assert first == second


def _linear_cost(grad_input: bool, micro_batches: int) -> float:
    layer = nn.Sequential(nn.Linear(256, 512))  # one call_module node
    x = torch.randn(64, 256, requires_grad=grad_input)
    t = trace(layer, (x,), tracer="fx")
    table = estimate_costs(
        t.graph_module, t.example_values, mode="roofline", micro_batches=micro_batches
    )
    node = next(n for n in t.graph_module.graph.nodes if n.op == "call_module")
    return table.nodes[node.name].cost


def test_a_linear_costs_its_products_weights_and_gradients() -> None:
    """nn.Linear(256, 512) on 64 rows, by hand: 2 * 64 * 256 * 512 FLOP forward, one more
    product for the weight's gradient, another for the input's when it requires grad;
    its weights read forward and backward and its gradients written on each micro-batch,
    added to ``.grad`` from the second on; two kernels per micro-batch."""
    cpu = ROOFLINES["cpu"]
    forward = 2 * 64 * 256 * 512
    weights = (256 * 512 + 512) * 4
    activations = (64 * 256 + 64 * 512) * 4

    def expected(products: int, m: int, grad_input: bool) -> float:
        compute = products * forward / cpu.matmul
        moved = activations + 64 * 512 * 4 + (2 * 64 * 256 * 4 if grad_input else 0)
        memory = moved / cpu.bandwidth_for(moved / m)
        resident = cpu.bandwidth_for(weights, cpu.resident_bytes)
        memory += m * 3 * weights / resident
        busy = max(compute, memory) + (1 - cpu.overlap) * min(compute, memory)
        added = weights * cpu.accumulate * (m - 1) / resident
        return m * 2 * cpu.overhead + busy + added

    for m in (1, 4):
        assert _linear_cost(False, m) == pytest.approx(expected(2, m, False), rel=1e-9)
        assert _linear_cost(True, m) == pytest.approx(expected(3, m, True), rel=1e-9)


def test_more_micro_batches_cost_a_weight_heavy_node_more_than_an_element_wise_one() -> None:
    heavy = Work(flops={"matmul": 1e9}, bytes=1e6, fixed_bytes=3e8, grad_bytes=1e8, kernels=2)
    light = Work(flops={"vector": 1e6}, bytes=4e8, kernels=2)
    cpu: Roofline = ROOFLINES["cpu"]
    grow_heavy = cpu.seconds(heavy, 8) / cpu.seconds(heavy, 1)
    grow_light = cpu.seconds(light, 8) / cpu.seconds(light, 1)
    assert grow_heavy > 2 and grow_light < 1.1


def _recorder(seen: list[tuple[int, int]]) -> Callable[[int, int], None]:
    return lambda done, total: seen.append((done, total))


@pytest.mark.slow
def test_progress_reports_every_node_once_in_order() -> None:
    for traced in (exported("llama"), trace(ZOO["resnet"].build(), ZOO["resnet"].example(4)[0])):
        seen: list[tuple[int, int]] = []
        gm = traced.graph_module
        estimate_costs(gm, traced.example_values, mode="roofline", progress=_recorder(seen))
        total = len(gm.graph.nodes)
        assert seen[-1] == (total, total)
        assert all(n == total for _, n in seen)
        assert [d for d, _ in seen] == sorted({d for d, _ in seen})


@pytest.mark.slow
def test_the_default_cost_is_the_roofline_in_seconds() -> None:
    case = ZOO["transformer"]
    args, kwargs = case.example(case.batch)
    plan = fxpipe.plan(case.build(), args, ["cpu"] * 3, example_kwargs=kwargs)
    assert (plan.costs.mode, plan.costs.unit) == ("roofline", "s")
    assert "estimated by a roofline" in plan.summary().splitlines()[0]
    assert "one x86 CPU core" in plan.summary().splitlines()[0]
    again = fxpipe.plan(case.build(), args, ["cpu"] * 3, example_kwargs=kwargs)
    assert again.stage_of == plan.stage_of and again.node_cost == plan.node_cost


@pytest.mark.slow
def test_meta_and_cuda_stages_are_priced_for_a_gpu() -> None:
    case = ZOO["mlp_residual"]
    args, _ = case.example(case.batch)
    model = case.build()
    on_meta = fxpipe.plan(model, args, ["meta"] * 2)
    on_cuda = fxpipe.plan(model, args, ["cuda:0"] * 2)  # planned only: nothing runs there
    on_cpu = fxpipe.plan(model, args, ["cpu"] * 2)
    assert on_meta.node_cost == on_cuda.node_cost != on_cpu.node_cost
    assert "data-centre GPU" in on_meta.summary().splitlines()[0]


def test_micro_batches_follow_chunks() -> None:
    """The plan prices the micro-batches it is made for: per-kernel and per-weight costs
    are paid once per micro-batch, so more chunks cost more."""
    case = ZOO["mlp_residual"]
    args, _ = case.example(case.batch)
    model = case.build()
    one = fxpipe.plan(model, args, ["cpu"] * 2, chunks=1)
    four = fxpipe.plan(model, args, ["cpu"] * 2, chunks=4)
    assert four.total_cost > one.total_cost


FX_CASES = [c for c in ZOO.values() if c.tracer != "export"]


@pytest.mark.parametrize("case", FX_CASES, ids=lambda c: c.name)
def test_leaving_same_shape_modules_unrun_changes_no_cost(
    case: Case, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Fake runs skip BatchNorm, LayerNorm, activations (their output is shaped like their
    input); every mode prices every node exactly as when they run."""
    model = case.build().train()
    args, kwargs = case.example(case.batch)
    t = trace(model, args, kwargs, tracer="fx")
    for mode in ("flops", "roofline", "params"):
        fast = estimate_costs(t.graph_module, t.example_values, mode=mode)
        with monkeypatch.context() as patch:
            patch.setattr(cost_model, "same_shape_output", lambda *_: None)
            slow = estimate_costs(t.graph_module, t.example_values, mode=mode)
        assert fast == slow, mode


def test_a_batch_norm_that_would_raise_is_run() -> None:
    norm = nn.BatchNorm1d(4).train()
    one = torch.randn(1, 4)
    with pytest.raises(ValueError, match="more than 1 value per channel"):
        norm(one)
    assert same_shape_output(norm, (one,), {}) is None
    two = same_shape_output(norm, (torch.randn(2, 4),), {})
    assert two is not None and two.shape == (2, 4) and two.requires_grad
