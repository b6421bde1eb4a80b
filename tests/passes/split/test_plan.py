"""The plan keeps the device capacities it was made for: the summary reads the same on every
machine, and a plan that cannot fit them is refused with the figures. A stage's memory holds a
weight sent on from another stage once, whatever the chunks."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from models import ZOO
from torch import nn

import fxpipe
import fxpipe.devices.stages
from fxpipe.devices.targets import device_capacity
from fxpipe.errors import MemoryPlanError

pytestmark = pytest.mark.usefixtures("one_thread")

GPUS = [f"cuda:{j}" for j in range(4)]


def _plan(devices: list[str]) -> fxpipe.PipelinePlan:
    case = ZOO["mlp_residual"]
    args, kwargs = case.example(case.batch)
    return fxpipe.plan(case.build(), args, devices, example_kwargs=kwargs, cost="flops")


@pytest.mark.slow
def test_the_plan_keeps_the_capacities_it_was_made_for() -> None:
    cpu = _plan(["cpu", "cpu"])
    assert cpu.capacities == tuple(device_capacity([torch.device("cpu")] * 2))
    assert all(c is not None and c > 0 for c in cpu.capacities)
    assert _plan(["meta", "meta"]).capacities == (None, None)


def test_the_summary_asks_no_hardware(monkeypatch: pytest.MonkeyPatch) -> None:
    plan = _plan(["cpu", "cpu"])
    before = str(plan)

    def absent(*_: object) -> int:
        raise AssertionError("the summary asked the machine for its memory")

    monkeypatch.setattr(os, "sysconf", absent)
    monkeypatch.setattr(torch.cuda, "get_device_properties", absent)
    assert str(plan) == before
    assert "%" in before  # memory shown against the capacity the plan was made for


def test_stages_that_share_a_device_share_its_capacity(monkeypatch: pytest.MonkeyPatch) -> None:
    plan = _plan(["cpu", "cpu"])
    need = sum(s.memory_bytes for s in plan.stages)
    largest = max(s.memory_bytes for s in plan.stages)
    # Each stage alone fits, both together do not: refused, with the figures.
    budget = (largest + need) // 2
    assert largest < budget < need
    monkeypatch.setattr(fxpipe.devices.stages, "device_capacity", lambda ds: [budget] * len(ds))
    with pytest.raises(MemoryPlanError, match=r"cpu: needs ~.* GiB for stages \[0, 1\]"):
        _plan(["cpu", "cpu"])


class _Casts(nn.Module):
    """Casts between wide layers: torch.export checks each ``.to`` with an assertion."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(256, 256) for _ in range(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.relu(layer(x.to(torch.float32)))
        return x


@pytest.mark.parametrize("k", [2, 3, 4])
def test_an_assertion_costs_nothing_and_stays_with_what_it_checks(k: int) -> None:
    from fxpipe.passes.ops import is_check

    plan = fxpipe.plan(_Casts(), torch.randn(64, 256), [f"cuda:{j}" for j in range(k)],
                       tracer="export", cost="flops")  # fmt: skip
    checks = [n for n in plan.graph_module.graph.nodes if is_check(n)]
    assert checks, "export records its checks of .to"
    for node in checks:
        assert plan.node_cost[node.name] == 0.0
        assert {plan.stage_of[a.name] for a in node.all_input_nodes} == {plan.stage_of[node.name]}


class TiedLM(nn.Module):
    """A large tied embedding, a few small layers: the head's stage receives the weight."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(4096, 64)
        self.layers = nn.ModuleList(nn.Linear(64, 64) for _ in range(6))
        self.head = nn.Linear(64, 4096, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        for layer in self.layers:
            h = torch.relu(layer(h))
        return self.head(h)


@pytest.mark.parametrize("training", [True, False])
def test_a_weight_sent_to_a_later_stage_is_held_once_whatever_the_chunks(training: bool) -> None:
    """The tied weight reaches the head's stage once per step, whole (the runtime copies it
    once per call): that stage holds the weight and, in training, its gradient, however
    many micro-batches run; the rest of its memory is activations, small here."""
    torch.manual_seed(0)
    model, ids = TiedLM().train(training), torch.randint(0, 4096, (8, 1))
    weight = 4096 * 64 * 4

    def head_stage(chunks: int) -> Any:
        plan = fxpipe.plan(model, ids, GPUS[:2], cost="flops", chunks=chunks)
        (edge,) = [e for e in plan.edges if e.bytes == weight]  # the weight, sent on
        (stage,) = [plan.stages[j] for j in edge.consumers]
        return stage

    for chunks in (2, 4, 8):
        stage = head_stage(chunks)
        activations = stage.memory_bytes - (4 if training else 1) * stage.param_bytes
        held = (2 if training else 1) * weight
        assert held <= activations < held + 0.2 * weight, (chunks, activations)
