"""Table 1 of the partition benchmark: fxpipe's splits of the zoo against the exact optimum,
the lower bound and the equal-node, parameter and FLOP baselines, with the bytes they send."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import networkx as nx
import numpy as np
from torch import nn

from benchmarks.harness.models.zoo import benchmark_models
from benchmarks.harness.splits import first_cut, is_valid, min_max_only, stage_costs, traffic
from fxpipe.errors import PlanError
from fxpipe.passes.partition.chain_dp import min_max_split
from fxpipe.passes.partition.cost_graph import to_networkx
from fxpipe.passes.partition.ideals import enumerate_ideals, ideal_split
from fxpipe.passes.partition.search import Partition, partition_graph
from fxpipe.passes.partition.units import Units, build_units
from fxpipe.passes.price.estimate import estimate_costs
from fxpipe.trace.tracing import trace

STAGES = (2, 4, 8)
SLACK = 0.05
#: The reference ideal DP is dense in ideal pairs: near this limit it needs many GB of memory.
EXACT_IDEALS = 20_000
KIB = 1024.0


def unit_weights(g: nx.DiGraph, units: Units, attr: str) -> np.ndarray:
    """Per-unit sums of a node attribute; ``get_attr`` values go to their first reader."""
    w = np.zeros(units.num_units)
    for n, data in g.nodes(data=True):
        if n in units.unit_of:
            w[units.unit_of[n]] += data[attr]
        elif data["op"] == "get_attr":
            using = [units.unit_of[v] for v in g.successors(n) if v in units.unit_of]
            if using:
                w[min(using)] += data[attr]
    return w


def stage_totals(g: nx.DiGraph, part: Partition, k: int) -> np.ndarray:
    costs = np.zeros(k)
    for n, stage in part.stage_of.items():
        costs[stage] += g.nodes[n]["weight"]
    return costs


def gpipe_speedup(costs: np.ndarray, micro_batches: int) -> float:
    """One device over GPipe on len(costs) devices; stage j costs costs[j] per mini-batch."""
    per_micro = costs / micro_batches
    makespan = per_micro.sum() + (micro_batches - 1) * per_micro.max()
    return float(costs.sum() / makespan)


def baseline_bottleneck(units: Units, weight: np.ndarray, k: int) -> float:
    """Exact min-max split of ``weight`` over the unit order, evaluated on the time costs."""
    _, borders = min_max_split(weight, k, first_cut=first_cut(units))
    return max(stage_costs(units.weight, borders))


def profile(
    model: nn.Module, args: Sequence[Any], kwargs: dict[str, Any], tracer: str, repeats: int
) -> tuple[nx.DiGraph, nx.DiGraph, float]:
    traced = trace(model, args, kwargs, tracer=tracer)
    gm, values = traced.graph_module, traced.example_values
    started = time.perf_counter()
    timed = estimate_costs(gm, values, mode="time", repeats=repeats)
    seconds = time.perf_counter() - started
    flops = estimate_costs(gm, values, mode="flops")
    return to_networkx(gm, timed), to_networkx(gm, flops), seconds


# ---------------------------------------------------------------------------- table 1


def zoo_rows(
    repeats: int, size: str, batch: int | None = None, names: list[str] | None = None
) -> list[dict[str, Any]]:
    rows = []
    for name, kind, tracer, build in benchmark_models(size, batch, names):
        model, args, kwargs = build()
        model.eval()
        g, g_flops, seconds = profile(model, args, kwargs, tracer, repeats)
        units = build_units(g)
        flops_w = unit_weights(g_flops, units, "weight")
        params_w = unit_weights(g, units, "param_bytes")
        count_w = np.array([float(len(m)) for m in units.members])
        ideals = enumerate_ideals(units.dag, EXACT_IDEALS)
        total = float(units.weight.sum())
        for k in STAGES:
            try:
                part = partition_graph(g, k, slack=0.0)
            except PlanError:
                continue  # fewer units than stages
            loose = partition_graph(g, k, slack=SLACK)
            ordered = partition_graph(g, k, slack=0.0, exact_limit=0)
            if ideals is not None:
                exact, _ = ideal_split(
                    ideals, units.weight, k, required_first=sorted(units.pinned_first)
                )
                exact_method = "ideals"
            else:
                exact, _ = min_max_split(units.weight, k, first_cut=first_cut(units))
                exact_method = "fixed-order"
            best = part.bottleneck
            lb0 = max(total / k, float(units.weight.max()))
            act_mm, param_mm = traffic(g, min_max_only(g, units, ideals, k))
            act0, param0 = traffic(g, part.stage_of)
            act5, param5 = traffic(g, loose.stage_of)
            rows.append(
                {
                    "model": name,
                    "size": size,
                    "kind": kind,
                    "K": k,
                    "nodes": g.number_of_nodes(),
                    "units": units.num_units,
                    "ideals": None if ideals is None else len(ideals),
                    "method": part.method,
                    "profile_s": seconds,
                    "total_ms": 1e3 * total,
                    "bottleneck_ms": 1e3 * best,
                    "exact_ms": 1e3 * exact,
                    "exact_method": exact_method,
                    "vs_exact": best / exact,
                    "orders_vs_exact": ordered.bottleneck / exact,
                    "orders_method": ordered.method,
                    "lb0_ms": 1e3 * lb0,
                    "vs_lb0": best / lb0,
                    "equal_nodes_ratio": baseline_bottleneck(units, count_w, k) / best,
                    "params_ratio": baseline_bottleneck(units, params_w, k) / best,
                    "flops_ratio": baseline_bottleneck(units, flops_w, k) / best,
                    "act_minmax_kib": act_mm / KIB,
                    "act_kib": act0 / KIB,
                    "act_slack_kib": act5 / KIB,
                    "param_kib": [param_mm / KIB, param0 / KIB, param5 / KIB],
                    "bytes_ratio_minmax": act_mm / max(act5, 1.0),
                    "bytes_ratio": act0 / max(act5, 1.0),
                    "slack_bottleneck_ratio": loose.bottleneck / best,
                    "slack_method": loose.method,
                    "gpipe_speedup": gpipe_speedup(stage_totals(g, part, k), 4 * k),
                    "valid": is_valid(g, part, k) and is_valid(g, loose, k),
                }
            )
    return rows


def _exact_cell(r: dict[str, Any]) -> str:
    mark = "" if r["exact_method"] == "ideals" else " fo"
    return f"{r['vs_exact']:.3f}{mark}"


ZOO_COLUMNS: list[tuple[str, Callable]] = [
    ("model", lambda r: r["model"]),
    ("kind", lambda r: r["kind"]),
    ("K", lambda r: str(r["K"])),
    ("units", lambda r: str(r["units"])),
    ("ideals", lambda r: "-" if r["ideals"] is None else str(r["ideals"])),
    ("method", lambda r: r["method"]),
    ("fxpipe ms", lambda r: f"{r['bottleneck_ms']:.3f}"),
    ("/exact", _exact_cell),
    ("orders/exact", lambda r: f"{r['orders_vs_exact']:.3f}"),
    ("/LB0", lambda r: f"{r['vs_lb0']:.3f}"),
    ("equal/fx", lambda r: f"{r['equal_nodes_ratio']:.2f}"),
    ("params/fx", lambda r: f"{r['params_ratio']:.2f}"),
    ("flops/fx", lambda r: f"{r['flops_ratio']:.2f}"),
    ("act KiB mm", lambda r: f"{r['act_minmax_kib']:.0f}"),
    ("@0", lambda r: f"{r['act_kib']:.0f}"),
    (f"@{SLACK:.0%}", lambda r: f"{r['act_slack_kib']:.0f}"),
    (f"mm/{SLACK:.0%}", lambda r: f"{r['bytes_ratio_minmax']:.2f}"),
    (f"0/{SLACK:.0%}", lambda r: f"{r['bytes_ratio']:.2f}"),
    ("param KiB", lambda r: "/".join(f"{x:.0f}" for x in r["param_kib"])),
    (f"bn@{SLACK:.0%}", lambda r: f"{r['slack_bottleneck_ratio']:.3f}"),
    ("GPipe x", lambda r: f"{r['gpipe_speedup']:.2f}"),
    ("ok", lambda r: "yes" if r["valid"] else "NO"),
]
