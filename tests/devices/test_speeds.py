"""Device speeds in a plan: a declared speed gives a faster device more of the model, and
stages on two kinds of device are each priced on their own kind's roofline."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fxpipe

pytestmark = pytest.mark.usefixtures("one_thread")


def _each_module_costs_one(node: torch.fx.Node) -> float:
    return 1.0 if node.op == "call_module" else 0.0


@pytest.mark.slow
def test_a_three_times_faster_device_gets_three_quarters_of_a_uniform_chain() -> None:
    model = nn.Sequential(*[nn.Linear(32, 32) for _ in range(40)])
    plan = fxpipe.plan(
        model, torch.randn(8, 32), ["cpu", "cpu"], speed=[1, 3], cost=_each_module_costs_one
    )
    first, second = (sum(plan.node_cost[n] for n in s.nodes) for s in plan.stages)
    assert second / (first + second) == pytest.approx(0.75, abs=0.03)
    assert plan.speeds == (1.0, 3.0)
    # StagePlan.cost is the time on the stage's own device, and they balance
    assert plan.stages[1].cost == pytest.approx(second / 3)
    assert plan.stages[0].cost == pytest.approx(plan.stages[1].cost, rel=0.1)
    assert plan.bottleneck == max(s.cost for s in plan.stages)
    assert plan.lower_bound == pytest.approx((first + second) / 4)
    assert "3x" in str(plan) and "speeds:" in str(plan)
    same = fxpipe.plan(model, torch.randn(8, 32), ["cpu", "cpu"], cost=_each_module_costs_one)
    assert same.speeds == () and "speeds:" not in str(same)


def test_a_gpu_and_the_cpu_are_priced_each_on_its_own_roofline() -> None:
    """Stages on two kinds of device: the model is priced on each, the CPU's speed is the
    ratio of the totals, and the time on each stage's own device balances."""
    torch.manual_seed(0)
    model, x = nn.Sequential(*[nn.Linear(256, 256) for _ in range(24)]), torch.randn(64, 256)
    on_gpu = fxpipe.plan(model, x, ["cuda:0", "cuda:1"])
    on_cpu = fxpipe.plan(model, x, ["cpu", "cpu"])
    assert on_gpu.speeds == () and on_cpu.speeds == ()  # one kind: nothing to scale
    ratio = sum(on_gpu.node_cost.values()) / sum(on_cpu.node_cost.values())
    assert ratio < 0.5  # the reference GPU is faster on every matrix product
    mixed = fxpipe.plan(model, x, ["cuda:0", "cpu"])
    assert mixed.speeds == pytest.approx((1.0, ratio))
    gpu_nodes, cpu_nodes = (len(s.nodes) for s in mixed.stages)
    assert cpu_nodes < gpu_nodes
    # the CPU stage's time: its nodes priced on the CPU's own roofline
    cpu_time = sum(on_cpu.node_cost[n] for n in mixed.stages[1].nodes)
    assert mixed.stages[1].cost == pytest.approx(cpu_time, rel=0.02)
    assert mixed.bottleneck <= 1.1 * mixed.lower_bound
    assert "speeds:" in str(mixed)
    declared = fxpipe.plan(model, x, ["cuda:0", "cpu"], speed=[1, 1])  # declared wins
    assert declared.speeds == (1.0, 1.0)
