"""One giant at every budget: fxpipe's floor, its splits, the brute force's and Accelerate's."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from benchmarks.giant.accelerate_maps import Accelerate
from benchmarks.giant.brute_force import BlockSplits, brute_force, check_brute_force
from benchmarks.giant.graph import Graph
from benchmarks.giant.search import run_fxpipe, smallest_budget
from benchmarks.giant.settings import CHUNKS, GIB, TRAINING_TOLERANCE


def makespan(stage_costs: Sequence[float], chunks: int) -> float:
    """GPipe's predicted step: sum(c)/M + (M - 1) max(c)/M."""
    return sum(stage_costs) / chunks + (chunks - 1) * max(stage_costs) / chunks


def rows_for(graph: Graph, accel: Accelerate, ratios: Sequence[float]) -> dict[str, Any]:
    splits = brute_force(graph)
    bf_floor = splits.floor(False)
    print(
        f"  brute force: {len(splits.index):,} block-boundary splits in {splits.seconds:.2f} s, "
        f"the least memory {bf_floor / GIB:.3f} GiB",
        flush=True,
    )
    started = time.perf_counter()
    fx_budget = smallest_budget(
        lambda b: run_fxpipe(graph, b, training=False).plan is not None, bf_floor, step=1.03
    )
    at_floor = run_fxpipe(graph, fx_budget, training=False).plan
    assert at_floor is not None
    fx_least = max(s.memory_bytes for s in at_floor.stages)
    floor = min(float(fx_least), bf_floor)
    print(
        f"  fxpipe: smallest budget {fx_budget / GIB:.3f} GiB (its split needs "
        f"{fx_least / GIB:.3f}); floor {floor / GIB:.3f} GiB; "
        f"{time.perf_counter() - started:.0f} s",
        flush=True,
    )
    started = time.perf_counter()
    train_floor = smallest_budget(
        lambda b: run_fxpipe(graph, b, training=True).plan is not None,
        splits.floor(True),
        step=1.03,
        tolerance=TRAINING_TOLERANCE,
    )
    print(
        f"  fxpipe's training floor {train_floor / GIB:.2f} GiB "
        f"({time.perf_counter() - started:.0f} s)",
        flush=True,
    )
    started = time.perf_counter()
    rows = []
    picks = {int(np.argmin(splits.memory[False])), int(np.argmin(splits.memory[True]))}
    for ratio in ratios:
        budget = int(math.ceil(ratio * floor))
        rows.append(row_at(graph, accel, splits, ratio, budget, picks))
    rng = np.random.default_rng(0)
    picks.update(int(i) for i in rng.choice(len(splits.index), size=6, replace=False))
    checked = check_brute_force(graph, splits, sorted(picks))
    print(f"  budgets: {time.perf_counter() - started:.0f} s", flush=True)

    def accel_fits(kind: str, activations: bool) -> Callable[[float], bool]:
        def fits(b: float) -> bool:
            m = accel.maps(graph, int(math.ceil(b)))[kind]
            return m.fits_activations if activations else m.fits

        return fits

    started = time.perf_counter()
    smallest = {
        "fxpipe": fx_budget / floor,
        "block_boundary_brute_force": bf_floor / floor,
        **{
            f"accelerate_{kind}{'_with_activations' if act else ''}": smallest_budget(
                accel_fits(kind, act), floor, step=1.1
            )
            / floor
            for kind in ("sequential", "balanced")
            for act in (False, True)
        },
    }
    print(f"  Accelerate's smallest budgets: {time.perf_counter() - started:.0f} s", flush=True)
    found = [s for s in graph.searches if s.fits]
    refused = [s for s in graph.searches if not s.fits]
    return {
        "model": graph.name,
        "nodes": len(graph.gm.graph.nodes),
        "units": graph.units.num_units,
        "param_gib": sum(size for size, _ in graph.estimate.params) / GIB,
        "trace_and_price_s": graph.front_s,
        "lb0": graph.lb0,
        "memory_bound_gib": graph.memory_bound(training=False) / GIB,
        "training_memory_bound_gib": graph.memory_bound(training=True) / GIB,
        "floor_gib": floor / GIB,
        "fx_least_gib": fx_least / GIB,
        "brute_force_floor_gib": bf_floor / GIB,
        "brute_force_splits": len(splits.index),
        "brute_force_s": splits.seconds,
        "brute_force_checked_against_build_plan": checked,
        "training_floor_ratio": train_floor / floor,
        "training_floor_gib": train_floor / GIB,
        "brute_force_training_floor_gib": splits.floor(True) / GIB,
        "smallest_fitting_ratio": smallest,
        "max_search_found_s": max((s.seconds for s in found), default=None),
        "max_search_found_cpu_s": max((s.cpu_s for s in found), default=None),
        "max_search_found_inference_s": max(
            (s.seconds for s in found if not s.training), default=None
        ),
        "max_search_refused_s": max((s.seconds for s in refused), default=None),
        "max_search_refused_before_diagnosis_s": max(
            (s.seconds - s.diagnosis_s for s in refused), default=None
        ),
        "searches": [vars(s) for s in graph.searches],
        "rows": rows,
    }


def row_at(
    graph: Graph,
    accel: Accelerate,
    splits: BlockSplits,
    ratio: float,
    budget: int,
    picks: set[int],
) -> dict[str, Any]:
    """One budget: fxpipe (inference and training), the brute force, Accelerate's maps."""
    fx = run_fxpipe(graph, budget, training=False)
    below = budget < graph.memory_bound(training=True)  # no split can fit: no search
    train = None if below else run_fxpipe(graph, budget, training=True)
    best = splits.best(budget)
    row: dict[str, Any] = {
        "ratio": ratio,
        "budget_gib": budget / GIB,
        "fx_fits": fx.plan is not None,
        "search_s": fx.search.seconds,
        "train_fits": train is not None and train.plan is not None,
        "train_below_bound": below,
        "train_search_s": None if train is None else train.search.seconds,
        "bf_fits": best is not None,
    }
    if fx.plan is not None:
        costs = [s.cost for s in fx.plan.stages]
        row["fx_bottleneck"] = fx.plan.bottleneck
        row["fx_lb0"] = fx.plan.bottleneck / graph.lb0
        row["fx_memory_gib"] = [s.memory_bytes / GIB for s in fx.plan.stages]
        row["fx_how"] = fx.plan.info.get("memory")
        row["step_ratio"] = graph.total / makespan(costs, CHUNKS)
        _, speedup = fx.plan.gpipe_prediction(CHUNKS)
        if not math.isclose(speedup, row["step_ratio"], rel_tol=1e-9):
            raise AssertionError(f"{graph.name}: makespan {row['step_ratio']} != {speedup}")
    if best is not None:
        picks.add(best)
        row["bf_bottleneck"] = float(splits.bottleneck[best])
        row["bf_lb0"] = row["bf_bottleneck"] / graph.lb0
        row["bf_memory_gib"] = float(splits.memory[False][best]) / GIB
        if fx.plan is not None:
            row["fx_over_bf"] = fx.plan.bottleneck / row["bf_bottleneck"]
    for kind, m in accel.maps(graph, budget).items():
        row[f"{kind}_fits"] = m.fits
        row[f"{kind}_fits_act"] = m.fits_activations
        row[f"{kind}_devices"] = m.devices_used
        if m.memory is not None:
            row[f"{kind}_memory_gib"] = [x / GIB for x in m.memory]
        if m.bottleneck is not None:
            row[f"{kind}_lb0"] = m.bottleneck / graph.lb0
            if fx.plan is not None:
                row[f"{kind}_over_fx"] = m.bottleneck / fx.plan.bottleneck
    return row
