"""Memory budgets and device speeds: the options' forms and refusals, speeds in every search
against brute force, the search's memory against the plan's, and splits under budgets
against the exact optimum (brute force over every split, or every chain of ideals)."""

from __future__ import annotations

import itertools
import random
import re
import sys
import warnings
from typing import Any

import networkx as nx
import numpy as np
import pytest
import torch
from dags import all_valid_splits, check_valid, compute_nodes, random_dag
from models import ZOO
from torch import nn

import fxpipe
from fxpipe.devices.budgets import parse_amount, parse_max_memory, parse_speed
from fxpipe.errors import ConfigError, MemoryEstimateWarning, MemoryPlanError
from fxpipe.options import PlanOptions
from fxpipe.passes.partition.chain_dp import min_bytes_split, min_max_split
from fxpipe.passes.partition.cost_graph import to_networkx
from fxpipe.passes.partition.fit import order_split
from fxpipe.passes.partition.ideals import enumerate_ideals, ideal_stages
from fxpipe.passes.partition.memory import MemoryModel, memory_model
from fxpipe.passes.partition.memory_tables import unit_memory
from fxpipe.passes.partition.orders import candidate_orders
from fxpipe.passes.partition.search import (
    Partition,
    _values,
    partition_graph,
)
from fxpipe.passes.partition.units import build_units
from fxpipe.passes.price.estimate import estimate_costs
from fxpipe.passes.split.plan import build_plan
from fxpipe.trace.tracing import trace

pytestmark = pytest.mark.usefixtures("one_thread")

INF = float("inf")
GPUS = [f"cuda:{j}" for j in range(4)]


# ---------------------------------------------------------------------------- the options


@pytest.mark.parametrize(
    "text, size",
    [
        ("20GiB", 20 * 2**30),
        ("20GB", 20 * 10**9),
        ("20 gib", 20 * 2**30),
        ("1.5MiB", 3 * 2**19),
        ("512 kb", 512_000),
        ("3KiB", 3072),
        ("2TB", 2 * 10**12),
        ("1tib", 2**40),
        ("4096", 4096),
        ("100 B", 100),
        (123, 123),
    ],
)
def test_amounts_in_accelerate_spelling(text: Any, size: int) -> None:
    assert parse_amount(text) == size


@pytest.mark.parametrize(
    "bad", ["20 gigs", "-3GiB", "0GB", "GiB", "", "1e9", -1, 0, 2.5, True, None, [1]]
)
def test_bad_amounts_are_refused_with_the_value_named(bad: Any) -> None:
    with pytest.raises(ConfigError, match=re.escape(repr(bad))):
        parse_amount(bad)


CUDA4 = [torch.device("cuda", j) for j in range(4)]


def test_one_amount_a_sequence_or_a_mapping() -> None:
    every = parse_max_memory("1GiB")
    assert every is not None and every.per_entry(CUDA4) == (2.0**30,) * 4
    listed = parse_max_memory(["1GB", 2, "3 KiB", None])
    assert listed is not None and listed.per_entry(CUDA4) == (1e9, 2.0, 3072.0, None)
    mapped = parse_max_memory({0: "1GiB", "cuda:2": "2GiB", torch.device("cuda", 3): 7})
    assert mapped is not None
    assert mapped.per_entry(CUDA4) == (2.0**30, None, 2.0 * 2**30, 7.0)
    mixed = [torch.device("cuda", 0), torch.device("cpu"), torch.device("cpu")]
    shared = parse_max_memory({0: "20GiB", "cpu": "60GiB"})
    assert shared is not None
    assert shared.per_entry(mixed) == (20.0 * 2**30, 60.0 * 2**30, 60.0 * 2**30)
    speeds = parse_speed({"cuda:0": 1, 1: 3.5, 2: 2, 3: 1})
    assert speeds is not None and speeds.per_entry(CUDA4) == (1.0, 3.5, 2.0, 1.0)


BAD_OPTIONS: dict[str, tuple[dict[str, Any], list[str], str]] = {
    "unit": ({"max_memory": "20 gigs"}, GPUS, r"'20 gigs'.*'20GiB'"),
    "negative": ({"max_memory": -5}, GPUS, r"-5 is not a positive number of bytes"),
    "key not a device": ({"max_memory": {"gpu0": "1GB"}}, GPUS, r"'gpu0'.*not a device"),
    "key not among devices": (
        {"max_memory": {5: "1GB"}},
        GPUS,
        r"'cuda:5', which is not among devices \['cuda:0'.*key it by one of those",
    ),
    "length": ({"max_memory": ["1GB"] * 3}, GPUS, r"3 entries for 4 devices.*one per device"),
    "one device, two budgets": (
        {"max_memory": ["1GB", "2GB"]},
        ["cpu", "cpu"],
        r"devices\[0\] and devices\[1\] \(both cpu\) different budgets",
    ),
    "form": ({"max_memory": object()}, GPUS, r"max_memory=<object.*is not a value"),
    "speed zero": ({"speed": [1, 0, 1, 1]}, GPUS, r"speed value 0 is not a positive number"),
    "speed bool": ({"speed": True}, GPUS, r"speed=True is not a value"),
    "speed string": ({"speed": "fast"}, GPUS, r"speed value 'fast'"),
    "speed nan": ({"speed": float("nan")}, GPUS, r"speed value nan"),
    "speed length": ({"speed": [1, 2]}, GPUS, r"speed=\[1, 2\] has 2 entries for 4 devices"),
    "speed missing device": (
        {"speed": {0: 1.0}},
        GPUS,
        r"gives no speed for \['cuda:1', 'cuda:2', 'cuda:3'\]",
    ),
}


@pytest.mark.parametrize("case", list(BAD_OPTIONS), ids=list(BAD_OPTIONS))
def test_bad_budgets_and_speeds_are_refused(case: str) -> None:
    keywords, devices, message = BAD_OPTIONS[case]
    with pytest.raises(ConfigError, match=message):
        fxpipe.plan(nn.Linear(4, 4), torch.randn(2, 4), devices, **keywords)


def test_the_record_checks_the_forms_and_stays_frozen() -> None:
    with pytest.raises(ConfigError, match="'20 gigs'"):
        PlanOptions(max_memory="20 gigs")
    with pytest.raises(ConfigError, match="speed value -1"):
        PlanOptions(speed=-1)
    budgets = ["1GiB", "2GiB"]
    options = PlanOptions(max_memory=budgets, speed={"cpu": 2})
    budgets.append("3GiB")  # the record keeps what it checked
    held = parse_max_memory(options.max_memory)
    assert held is not None and held.entries == (2.0**30, 2.0 * 2**30)
    assert hash(options) == hash(PlanOptions(max_memory=["1GiB", "2GiB"], speed={"cpu": 2}))


def _mlp(widths: list[int]) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(a, b) for a, b in zip(widths, widths[1:])])


def test_the_plan_keeps_the_budgets_it_was_made_for() -> None:
    model, x = _mlp([16] * 7), torch.randn(8, 16)
    plan = fxpipe.plan(model, x, GPUS, cost="flops", max_memory={0: "1GiB", "cuda:3": 5 * 2**20})
    assert plan.capacities == (2**30, None, None, 5 * 2**20)  # absent GPUs: unchecked
    assert fxpipe.plan(model, x, GPUS, cost="flops").capacities == (None,) * 4
    assert fxpipe.plan(model, x, ["meta"] * 2, max_memory="1MB").capacities == (10**6,) * 2
    text = str(plan)
    assert "1.0 GiB (stage 0" in text and "5.0 MiB (stage 3" in text


# ---------------------------------------------------------------------------- speeds


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


def _brute_time(g: nx.DiGraph, st: dict[str, int], speeds: list[float]) -> float:
    cost = [0.0] * len(speeds)
    for name in compute_nodes(g):
        cost[st[name]] += g.nodes[name]["weight"]
    return max(c / v for c, v in zip(cost, speeds))


def _small_cases(count: int, seed: int) -> list[Any]:
    rng = random.Random(seed)
    out = []
    for i in range(count):
        n = rng.randint(2, 8)
        k = rng.randint(2, min(4, n))
        density = rng.choice([0.15, 0.35, 0.6])
        out.append(pytest.param(n, k, density, seed * 1000 + i, id=f"n{n}-k{k}-{i}"))
    return out


@pytest.mark.parametrize("n, k, density, seed", _small_cases(30, 7))
def test_speeds_against_brute_force(n: int, k: int, density: float, seed: int) -> None:
    rng = random.Random(seed)
    g = random_dag(rng, n, density)
    speeds = [rng.choice([0.5, 1.0, 2.0, 3.0]) for _ in range(k)]
    valid = all_valid_splits(g, k)
    best = min(_brute_time(g, s, speeds) for s in valid)
    exact = partition_graph(g, k, speed=speeds)
    assert exact.method == "ideals"
    check_valid(g, exact.stage_of, k)
    assert exact.bottleneck == pytest.approx(_brute_time(g, exact.stage_of, speeds))
    assert exact.bottleneck == pytest.approx(best, rel=1e-9)
    orders = partition_graph(g, k, speed=speeds, exact_limit=0)
    check_valid(g, orders.stage_of, k)
    assert orders.bottleneck == pytest.approx(_brute_time(g, orders.stage_of, speeds))
    assert orders.bottleneck >= best * (1 - 1e-9)
    chain = random_dag(rng, n, density, chain=True)
    best_chain = min(_brute_time(chain, s, speeds) for s in all_valid_splits(chain, k))
    on_chain = partition_graph(chain, k, speed=speeds, exact_limit=0, window_limit=0)
    assert on_chain.bottleneck == pytest.approx(best_chain, rel=1e-9)


@pytest.mark.slow
def test_speeds_of_one_change_nothing() -> None:
    rng = random.Random(3)
    for _ in range(10):
        g = random_dag(rng, 30, 0.1)
        for exact_limit in (1500, 0):
            plain = partition_graph(g, 4, exact_limit=exact_limit, slack=0.1)
            ones = partition_graph(g, 4, exact_limit=exact_limit, slack=0.1, speed=[1.0] * 4)
            assert (plain.stage_of, plain.bottleneck) == (ones.stage_of, ones.bottleneck)


def _borders(n: int, k: int, first_cut: int) -> list[tuple[int, ...]]:
    return list(itertools.combinations(range(max(first_cut, 1), n), k - 1))


def _times(w: np.ndarray, borders: tuple[int, ...], speeds: np.ndarray) -> list[float]:
    edges = [0, *borders, len(w)]
    return [float(w[a:b].sum()) / v for a, b, v in zip(edges, edges[1:], speeds)]


@pytest.mark.parametrize("seed", range(5))
def test_order_solvers_with_speeds_against_brute_force(seed: int) -> None:
    rng = np.random.default_rng(seed)
    for _ in range(40):
        n, k = int(rng.integers(1, 11)), int(rng.integers(1, 5))
        first_cut = int(rng.integers(0, 3))
        w = rng.integers(0, 9, n).astype(np.float64)
        cut = rng.integers(0, 50, n + 1).astype(np.float64)
        speeds = rng.choice([0.5, 1.0, 2.0, 4.0], k)
        splits = _borders(n, k, first_cut)
        best = min((max(_times(w, b, speeds)) for b in splits), default=INF)
        value, borders = min_max_split(w, k, first_cut=first_cut, speeds=speeds)
        assert value == pytest.approx(best)
        same, _ = order_split(w, k, first_cut=first_cut, speeds=speeds)
        assert same == pytest.approx(best)
        ones = min_max_split(w, k, first_cut=first_cut, speeds=np.ones(k))
        assert ones == min_max_split(w, k, first_cut=first_cut)  # bit for bit
        if np.isfinite(best):
            assert max(_times(w, tuple(borders), speeds)) == pytest.approx(best)
            cap = best * 1.3
            fewest = min(
                float(sum(cut[c] for c in b)) for b in splits if max(_times(w, b, speeds)) <= cap
            )
            moved, _ = min_bytes_split(w, cut, k, cap, first_cut=first_cut, speeds=speeds)
            assert moved == fewest
            moved, _ = order_split(
                w, k, first_cut=first_cut, speeds=speeds, objective="bytes", cut_bytes=cut,
                cap=cap,
            )  # fmt: skip
            assert moved == fewest


# ---------------------------------------------------------------------------- memory pricing


def _zoo_graph(name: str, traffic: str) -> tuple[Any, Any, nx.DiGraph]:
    case = ZOO[name]
    args, kwargs = case.example(case.batch)
    t = trace(case.build().train(), args, kwargs, tracer=case.tracer)
    costs = estimate_costs(t.graph_module, t.example_values, mode="flops")
    return t, costs, to_networkx(t.graph_module, costs)


@pytest.mark.parametrize("traffic", ["direct", "relay"])
@pytest.mark.parametrize("name", ["transformer", "shared_module", "unet", "mlp_residual"])
def test_the_search_prices_memory_as_the_plan_does(name: str, traffic: str) -> None:
    """Tied weights, a module called twice, long skips: per split, per ideal pair and per
    segment of an order, the search's memory is the plan's (training and inference)."""
    t, costs, g = _zoo_graph(name, traffic)
    units = build_units(g)
    rng = np.random.default_rng(0)
    for k, chunks, checkpoint, training in (
        (2, 4, "except_last", True),
        (3, 3, "always", True),
        (4, 2, "never", True),
        (3, 4, "except_last", False),
    ):
        devices = [torch.device("cuda", j) for j in range(k)]
        model = memory_model(
            t.graph_module, costs, devices, [1] * k, chunks=chunks, checkpoint=checkpoint,
            training=training,
        )  # fmt: skip
        assert model is not None
        priced = unit_memory(model, g, units.unit_of, units.num_units, _values(g, units, traffic))
        order = candidate_orders(units)["depth"]
        for _ in range(4):  # random splits of one order
            borders = sorted(rng.choice(np.arange(1, units.num_units), k - 1, replace=False))
            unit_stage = np.searchsorted(borders, np.arange(units.num_units), side="right")
            unit_stage = unit_stage[np.argsort(order)]  # position -> unit
            stage_of = {n: int(unit_stage[u]) for n, u in units.unit_of.items()}
            for n, op in g.nodes(data="op"):
                if op == "placeholder":
                    stage_of[n] = 0
                elif op == "output":
                    stage_of[n] = k - 1
            for n, op in g.nodes(data="op"):
                if op == "get_attr":
                    stage_of[n] = min((stage_of[v] for v in g.successors(n)), default=0)
            split = Partition(stage_of, 0.0, "test", 0.0, traffic)  # type: ignore[arg-type]
            plan = build_plan(
                t.graph_module, costs, g, split, devices, chunks=chunks, checkpoint=checkpoint,
                training=training,
            )  # fmt: skip
            want = np.array([s.memory_bytes for s in plan.stages], dtype=np.float64)
            assert np.abs(priced.stage_bytes(unit_stage) - want).max() <= 1.0
            # the same split read off the order sweep, stage by stage
            swept = priced.on_order(order)
            swept.reset()
            edges = [0, *[int(b) for b in borders], units.num_units]
            got = []
            for t_end in range(1, units.num_units + 1):
                swept.advance(t_end)
                if t_end in edges[1:]:
                    j = edges.index(t_end) - 1
                    got.append(float(swept.stage(edges[j], j, edges[j] + 1)[0]))
            assert np.abs(np.array(got) - want).max() <= 1.0
        ideals = enumerate_ideals(units.dag, 3000)
        if ideals is not None:  # stages I - J of the lattice, against the split J | I - J | V - I
            table = priced.on_ideals(ideals)
            entering = _values(g, units, traffic)
            for _ in range(10):
                i = int(rng.integers(1, len(ideals)))
                below = [r for r in range(i) if (ideals[r] <= ideals[i]).all()]
                j_row = int(rng.choice(below))
                parts = [ideals[j_row], ideals[i] & ~ideals[j_row], ~ideals[i]]
                kept = [p for p in parts if p.any()]
                unit_stage = np.zeros(units.num_units, dtype=np.int64)
                for stage, members in enumerate(kept):
                    unit_stage[members] = stage
                m = len(kept)
                split_model = MemoryModel(
                    (1,) * m, tuple(map(str, range(m))), chunks, checkpoint, 1, model.saved,
                    model.params, training,
                )  # fmt: skip
                split = unit_memory(split_model, g, units.unit_of, units.num_units, entering)
                position = 1 if parts[0].any() else 0
                expect = split.stage_bytes(unit_stage)[position]
                assert table.stage(position if position < m - 1 else k - 1)[
                    i, j_row
                ] == pytest.approx(expect, rel=1e-9, abs=1.0)


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
    best = min(_brute_time(g, s, speeds) for s in fitting)
    for exact_limit in (1500, 0):
        part = partition_graph(
            g, k, speed=speeds, memory=model, traffic=traffic, exact_limit=exact_limit
        )  # type: ignore[arg-type]
        check_valid(g, part.stage_of, k)
        assert _fits(_brute_memory(g, part.stage_of, model, traffic), model)
        assert part.bottleneck == pytest.approx(_brute_time(g, part.stage_of, speeds))
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
    best = min(_brute_time(g, s, [1.0] * k) for s, m in zip(valid, memory) if _fits(m, model))
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
    best = min(_brute_time(g, s, [1.0] * k) for s, m in zip(valid, memory) if _fits(m, model))
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
