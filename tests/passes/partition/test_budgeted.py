"""Splits under memory budgets against the exact optimum (brute force over every split, or
over every chain of ideals), what too small a budget is told, and a model planned under one."""

from __future__ import annotations

import itertools
import random
import re
import sys
import warnings
from typing import Any

import networkx as nx
import pytest
import torch
from dags import all_valid_splits, brute_time, check_valid, compute_nodes, random_dag
from torch import nn

import fxpipe
from fxpipe.errors import MemoryEstimateWarning, MemoryPlanError
from fxpipe.passes.partition.cost_graph import to_networkx
from fxpipe.passes.partition.ideals import enumerate_ideals, ideal_stages
from fxpipe.passes.partition.memory import MemoryModel, memory_model
from fxpipe.passes.partition.search import partition_graph
from fxpipe.passes.partition.units import build_units

pytestmark = pytest.mark.usefixtures("one_thread")

INF = float("inf")
GPUS = [f"cuda:{j}" for j in range(4)]


# ---------------------------------------------------------------------------- budgets, brute force


def _dag_with_memory(
    rng: random.Random, n: int, density: float, *, chain: bool = False
) -> tuple[nx.DiGraph, dict[str, int], tuple[tuple[int, tuple[str, ...]], ...]]:
    """A random DAG with get_attr nodes (a tensor read by up to three nodes), saved bytes on
    most nodes and parameters held by one node, by two (tied) or by a get_attr node too."""
    g = random_dag(rng, n, density, chain=chain)
    names = compute_nodes(g)
    for a in range(rng.randint(0, 2)):
        name = f"attr{a}"
        g.add_node(name, op="get_attr", index=-1 - a, weight=0.0, bytes=rng.randint(1, 64),
                   is_tensor=True, param_bytes=0, saved_bytes=0)  # fmt: skip
        for reader in rng.sample(names, min(len(names), rng.randint(1, 3))):
            g.add_edge(name, reader, bytes=g.nodes[name]["bytes"], is_tensor=True)
    saved = {v: rng.randint(0, 300) for v in g.nodes if rng.random() < 0.8}
    params = [(rng.randint(0, 400), (v,)) for v in names if rng.random() < 0.6]
    attrs = [v for v, op in g.nodes(data="op") if op == "get_attr"]
    for _ in range(rng.randint(0, 2)):
        params.append((rng.randint(50, 400), tuple(rng.sample(names + attrs, 2))))
    return g, saved, tuple((size, tuple(sorted(set(h)))) for size, h in params)


def _coefficients(chunks: int, checkpoint: str, training: bool) -> tuple[float, float]:
    if not training:  # nothing stashed: one micro-batch's activations and input
        return 1 / chunks, 1 / chunks
    count = {"always": chunks, "except_last": chunks - 1, "never": 0}[checkpoint]
    return (chunks - count + (1 if count else 0)) / chunks, count / chunks


def _brute_memory(
    g: nx.DiGraph, st: dict[str, int], model: MemoryModel, traffic: str = "direct"
) -> list[float]:
    """Each stage's memory, from the nodes, as the plan defines it."""
    k = len(model.budgets)
    stage = dict(st)
    for n, op in g.nodes(data="op"):
        if op in ("placeholder", "output"):
            stage[n] = 0 if op == "placeholder" else k - 1
    for n, op in g.nodes(data="op"):
        if op == "get_attr":
            stage[n] = min(stage[v] for v in g.successors(n))
    params, saved, received = [0.0] * k, [0.0] * k, [0.0] * k
    for size, holders in model.params:
        for j in {stage[h] for h in holders}:
            params[j] += size
    for n, size in model.saved.items():
        saved[stage[n]] += size
    for n in g.nodes:
        readers = {
            stage[v] for v in g.successors(n) if traffic == "relay" or g.nodes[v]["op"] != "output"
        }
        for j in readers - {stage[n]}:
            received[j] += g.nodes[n]["bytes"]
    keep, inputs = _coefficients(model.chunks, model.checkpoint, model.training)
    copies = 4 if model.training else 1  # weight, gradient, two Adam moments; or the weight
    return [copies * p + keep * s + inputs * r for p, s, r in zip(params, saved, received)]


def _device_need(memory: list[float], devices: tuple[str, ...]) -> dict[str, float]:
    need: dict[str, float] = {}
    for m, d in zip(memory, devices):
        need[d] = need.get(d, 0.0) + m
    return need


def _fits(memory: list[float], model: MemoryModel) -> bool:
    budget = dict(zip(model.devices, model.budgets))
    return all(
        b is None or need <= b + 1e-6
        for d, need in _device_need(memory, model.devices).items()
        for b in [budget[d]]
    )


def _budget_cases(count: int, seed: int) -> list[Any]:
    rng = random.Random(seed)
    out = []
    for i in range(count):
        n = rng.randint(3, 8)
        k = rng.randint(2, min(4, n))
        density = rng.choice([0.15, 0.35, 0.6])
        traffic = rng.choice(["direct", "relay"])
        out.append(pytest.param(n, k, density, traffic, seed * 1000 + i, id=f"n{n}-k{k}-{i}"))
    return out


@pytest.mark.parametrize("n, k, density, traffic, seed", _budget_cases(40, 11))
def test_budgets_on_distinct_devices_are_exact(
    n: int, k: int, density: float, traffic: str, seed: int
) -> None:
    """Per device budgets, speeds: the exact search (ideals) is the brute-force optimum
    under the budgets, and the order search (exact per order) never beats it; both fit;
    too small a budget says what the least-memory split needs. One case in three prices
    inference memory."""
    rng = random.Random(seed)
    g, saved, params = _dag_with_memory(rng, n, density)
    speeds = [rng.choice([1.0, 2.0]) for _ in range(k)]
    chunks, checkpoint = rng.choice([(4, "except_last"), (2, "always"), (3, "never")])
    training = seed % 3 != 0
    devices = tuple(f"d{j}" for j in range(k))
    probe = MemoryModel((None,) * k, devices, chunks, checkpoint, 8, saved, params, training)
    valid = all_valid_splits(g, k)
    memory = [_brute_memory(g, s, probe, traffic) for s in valid]
    scale = [rng.choice([0.7, 1.0, 1.5]) for _ in range(k)]
    ratios = sorted({max(m / c for m, c in zip(mem, scale)) for mem in memory})
    level = ratios[rng.randrange(len(ratios))] * (1 + 1e-9)  # some split fits just so
    model = MemoryModel(
        tuple(int(level * c) + 1 for c in scale), devices, chunks, checkpoint, 8, saved, params,
        training,
    )  # fmt: skip
    fitting = [s for s, m in zip(valid, memory) if _fits(m, model)]
    assert fitting
    best = min(brute_time(g, s, speeds) for s in fitting)
    for exact_limit in (1500, 0):
        part = partition_graph(
            g, k, speed=speeds, memory=model, traffic=traffic, exact_limit=exact_limit
        )  # type: ignore[arg-type]
        check_valid(g, part.stage_of, k)
        assert _fits(_brute_memory(g, part.stage_of, model, traffic), model)
        assert part.bottleneck == pytest.approx(brute_time(g, part.stage_of, speeds))
        if exact_limit:
            assert part.method == "ideals"
            assert part.bottleneck == pytest.approx(best, rel=1e-9)
        else:
            assert part.bottleneck >= best * (1 - 1e-9)
    least = min(max(m) for m in memory)  # every budget below: nothing fits
    tight = MemoryModel(
        (int(least * 0.99),) * k, devices, chunks, checkpoint, 8, saved, params, training
    )
    if least * 0.99 < 1:
        return
    with pytest.raises(MemoryPlanError) as info:
        partition_graph(g, k, memory=tight, traffic=traffic)  # type: ignore[arg-type]
    needs = [float(x) for x in re.findall(r"needs ~([0-9.e+-]+) GiB", str(info.value))]
    assert max(needs) * 2**30 == pytest.approx(least, rel=0.01)


@pytest.mark.parametrize("n, k, density, traffic, seed", _budget_cases(15, 12))
def test_the_order_search_under_budgets_is_exact_on_chains(
    n: int, k: int, density: float, traffic: str, seed: int
) -> None:
    rng = random.Random(seed)
    g, saved, params = _dag_with_memory(rng, n, density, chain=True)
    devices = tuple(f"d{j}" for j in range(k))
    probe = MemoryModel((None,) * k, devices, 4, "except_last", 8, saved, params)
    valid = all_valid_splits(g, k)
    memory = [_brute_memory(g, s, probe, traffic) for s in valid]
    level = sorted({max(m) for m in memory})[len(memory) // 3 if len(memory) > 3 else 0]
    model = MemoryModel((int(level) + 1,) * k, devices, 4, "except_last", 8, saved, params)
    best = min(brute_time(g, s, [1.0] * k) for s, m in zip(valid, memory) if _fits(m, model))
    for windows in (0, 600):
        part = partition_graph(
            g, k, memory=model, traffic=traffic, exact_limit=0, window_limit=windows
        )  # type: ignore[arg-type]
        assert _fits(_brute_memory(g, part.stage_of, model, traffic), model)
        assert part.bottleneck == best


@pytest.mark.parametrize("n, k, density, traffic, seed", _budget_cases(25, 13))
def test_shared_devices_are_sound(n: int, k: int, density: float, traffic: str, seed: int) -> None:
    """Stages on one device share its budget: whatever is found fits the totals, never
    below the optimum, and it is the optimum when only one device holds several stages."""
    rng = random.Random(seed)
    g, saved, params = _dag_with_memory(rng, n, density)
    devices = tuple(rng.choice(["a", "b"]) for _ in range(k))
    probe = MemoryModel((None,) * k, devices, 4, "except_last", 8, saved, params)
    valid = all_valid_splits(g, k)
    memory = [_brute_memory(g, s, probe, traffic) for s in valid]
    needs = sorted({max(_device_need(m, devices).values()) for m in memory})
    level = needs[rng.randrange(len(needs))]
    model = MemoryModel((int(level) + 1,) * k, devices, 4, "except_last", 8, saved, params)
    best = min(brute_time(g, s, [1.0] * k) for s, m in zip(valid, memory) if _fits(m, model))
    try:
        part = partition_graph(g, k, memory=model, traffic=traffic)  # type: ignore[arg-type]
    except MemoryPlanError as e:
        shared = sum(devices.count(d) > 1 for d in set(devices))
        assert "shares" in str(e) and shared == 2  # a division not tried would fit
        return
    assert _fits(_brute_memory(g, part.stage_of, model, traffic), model)
    assert part.bottleneck >= best
    if sum(devices.count(d) > 1 for d in set(devices)) == 1:
        assert part.bottleneck == pytest.approx(best, rel=1e-9)


# ---------------------------------------------------------------------------- a model


class Tapered(nn.Module):
    """Wide layers first, narrow ones last, one skip: memory and cost far apart."""

    def __init__(self) -> None:
        super().__init__()
        widths = [96, 96, 80, 64, 48, 40, 32, 32, 24, 24, 16, 16]
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(widths, widths[1:]))
        self.skip = nn.Linear(96, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x
        for layer in self.layers:
            h = torch.relu(layer(h))
        return h + self.skip(x)


def _each_module_costs_one(node: torch.fx.Node) -> float:
    return 1.0 if node.op == "call_module" else 0.0


def _mlp(widths: list[int]) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(a, b) for a, b in zip(widths, widths[1:])])


def _tapered_plan(model_mode: str = "train", **keywords: Any) -> fxpipe.PipelinePlan:
    torch.manual_seed(0)
    model = Tapered().train(model_mode == "train")
    with torch.set_grad_enabled(model_mode != "no_grad"):
        return fxpipe.plan(
            model, torch.randn(16, 96), GPUS, cost=_each_module_costs_one, chunks=4, **keywords
        )


def _brute_over_ideals(
    plan: fxpipe.PipelinePlan, budget: int, *, training: bool = True
) -> tuple[float, float]:
    """(smallest bottleneck of the splits whose every stage fits ``budget``, smallest
    largest stage memory of any split), over every chain of ideals of the unit DAG."""
    g = to_networkx(plan.graph_module, plan.costs)
    units = build_units(g)
    ideals = enumerate_ideals(units.dag, 10_000)
    assert ideals is not None
    devices = [torch.device("cuda", j) for j in range(4)]
    model = memory_model(plan.graph_module, plan.costs, devices, [budget] * 4, chunks=4,
                         checkpoint="except_last", training=training)  # fmt: skip
    assert model is not None
    subset = (ideals[:, None, :] <= ideals[None, :, :]).all(axis=2)
    best, least = INF, INF
    for rows in itertools.combinations(range(1, len(ideals) - 1), 3):
        if not all(subset[a, b] and a != b for a, b in zip(rows, rows[1:])):
            continue
        unit_stage = ideal_stages(ideals, list(rows))
        st = {n: int(unit_stage[u]) for n, u in units.unit_of.items()}
        if len(set(st.values())) < 4:
            continue
        memory = _brute_memory(g, st, model)
        least = min(least, max(memory))
        if max(memory) <= budget:
            cost = [0.0] * 4
            for n, u in units.unit_of.items():
                cost[int(unit_stage[u])] += g.nodes[n]["weight"]
            best = min(best, max(cost))
    return best, least


@pytest.mark.slow
def test_a_model_two_and_a_half_times_a_device_fits_four_budgeted_devices() -> None:
    free = _tapered_plan()
    total = sum(s.memory_bytes for s in free.stages)
    budget = int(total / 2.5)
    assert max(s.memory_bytes for s in free.stages) > budget  # the best split does not fit
    plan = _tapered_plan(max_memory=budget)
    assert plan.capacities == (budget,) * 4
    assert all(s.memory_bytes <= budget for s in plan.stages)
    assert plan.stage_of != free.stage_of and plan.bottleneck > free.bottleneck
    best, _ = _brute_over_ideals(plan, budget)
    assert plan.bottleneck == best
    assert plan.info["memory"] == "searched with each stage's memory limit"
    # a budget the best split fits leaves the plan as it was
    roomy = _tapered_plan(max_memory=max(s.memory_bytes for s in free.stages))
    assert roomy.stage_of == free.stage_of and roomy.bottleneck == free.bottleneck


@pytest.mark.slow
def test_too_small_a_budget_says_what_the_least_memory_split_needs() -> None:
    free = _tapered_plan()
    _, least = _brute_over_ideals(free, 1)
    budget = int(least * 0.97)
    with pytest.raises(MemoryPlanError) as info:
        _tapered_plan(max_memory=budget)
    text = str(info.value)
    needs = [float(x) for x in re.findall(r"cuda:\d: needs ~([0-9.e+-]+) GiB", text)]
    assert len(needs) == 4 and max(needs) * 2**30 == pytest.approx(least, rel=0.01)
    assert "chunks=4, checkpoint='except_last'" in text and "remedy: " in text


@pytest.mark.slow
def test_the_remedies_that_get_there_are_named() -> None:
    """24 equal layers over 4 devices need a quarter of the memory each; at a budget of
    about a fifth, five devices would do, and so would a smaller batch."""
    model, x = _mlp([64] * 25), torch.randn(32, 64)
    free = fxpipe.plan(model, x, GPUS, cost="flops", chunks=4)
    budget = int(sum(s.memory_bytes for s in free.stages) / 4.5)
    with pytest.raises(MemoryPlanError) as info:
        fxpipe.plan(model, x, GPUS, cost="flops", chunks=4, max_memory=budget)
    text = str(info.value)
    assert re.search(r"remedy: any one of: .*\b5 devices of", text), text


def test_a_model_in_eval_mode_or_without_grad_is_planned_for_inference() -> None:
    """Inference needs the weights once and one micro-batch in flight: a budget that holds
    the inference split of the model fits it in eval mode and under no_grad, and is refused
    for training with the estimate named; the brute-force optimum under it is found."""
    inference = _tapered_plan(model_mode="eval")
    assert not inference.training and "inference estimate" in inference.summary()
    training = _tapered_plan()
    assert training.training and "training estimate" in training.summary()
    for a, b in zip(inference.stages, training.stages):
        if a.nodes == b.nodes:  # same stage: a quarter of the weight bytes at most
            assert a.memory_bytes < b.memory_bytes
    _, least_training = _brute_over_ideals(training, 1)
    _, least_inference = _brute_over_ideals(inference, 1, training=False)
    assert least_inference < least_training / 2
    budget = int(least_inference * 1.2)
    for mode in ("eval", "no_grad"):
        plan = _tapered_plan(max_memory=budget, model_mode=mode)
        assert all(s.memory_bytes <= budget for s in plan.stages)
        best, _ = _brute_over_ideals(plan, budget, training=False)
        assert plan.bottleneck == best
    with pytest.raises(MemoryPlanError, match="training estimate") as info:
        _tapered_plan(max_memory=budget)
    assert "checkpoint='always'" in str(info.value)
    with pytest.raises(MemoryPlanError, match="inference estimate") as info:
        _tapered_plan(max_memory=int(least_inference * 0.95), model_mode="eval")
    assert "checkpoint='always'" not in str(info.value)


def test_a_shared_cpu_budget_holds_every_stage_and_the_pipeline_runs() -> None:
    torch.manual_seed(0)
    model = Tapered()
    x = torch.randn(16, 96)
    free = fxpipe.plan(model, x, ["cpu"] * 3, cost=_each_module_costs_one, chunks=4)
    need = sum(s.memory_bytes for s in free.stages)
    pipe = fxpipe.pipeline(
        model, x, ["cpu"] * 3, cost=_each_module_costs_one, chunks=4, max_memory={"cpu": need}
    )
    assert sum(s.memory_bytes for s in pipe.plan.stages) <= need
    assert pipe.plan.capacities == (need,) * 3
    torch.testing.assert_close(pipe(x), model(x))
    with pytest.raises(MemoryPlanError, match=r"cpu: needs ~.* GiB for stages \[0, 1, 2\]"):
        fxpipe.plan(model, x, ["cpu"] * 3, cost=_each_module_costs_one, max_memory=need // 4)


def test_training_a_pipeline_planned_for_inference_warns_once_when_it_would_not_fit() -> None:
    torch.manual_seed(0)
    model, x = Tapered().eval(), torch.randn(16, 96)
    need = fxpipe.plan(model, x, ["cpu"] * 2, cost=_each_module_costs_one, chunks=4)
    budget = sum(s.memory_bytes for s in need.stages) + 1  # the inference split, just
    pipe = fxpipe.pipeline(
        model, x, ["cpu"] * 2, cost=_each_module_costs_one, chunks=4, max_memory=budget
    )
    assert not pipe.plan.training
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        torch.testing.assert_close(pipe(x), model(x))  # inference, as planned: no warning
    pipe.train()
    with pytest.warns(MemoryEstimateWarning, match=r"planned for inference.*cpu needs ~"):
        pipe(x).sum().backward()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pipe(x)  # once per pipeline
    roomy = fxpipe.pipeline(model.eval(), x, ["cpu"] * 2, cost=_each_module_costs_one,
                            max_memory="1GiB")  # fmt: skip
    roomy.train()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        roomy(x)  # training fits too: nothing to say


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))
