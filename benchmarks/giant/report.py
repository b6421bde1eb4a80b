"""The giant benchmark's table columns, summary lines and verdicts on its targets."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from benchmarks.giant.settings import (
    CHECKPOINT,
    CHUNKS,
    TARGET_BOTTLENECK,
    TARGET_SEARCH_S,
    TARGET_SPEEDUP,
    TOLERANCE,
)


def _yes(value: bool) -> str:
    return "yes" if value else "no"


def _num(key: str, digits: int = 3) -> Callable[[dict[str, Any]], str]:
    return lambda r: "-" if r.get(key) is None else f"{r[key]:.{digits}f}"


COLUMNS: list[tuple[str, Callable[[dict[str, Any]], str]]] = [
    ("x floor", lambda r: f"{r['ratio']:.2f}"),
    ("GiB", _num("budget_gib", 2)),
    ("fx", lambda r: _yes(r["fx_fits"])),
    ("fx/LB0", _num("fx_lb0")),
    ("bf/LB0", _num("bf_lb0")),
    ("fx/bf", _num("fx_over_bf")),
    ("seq", lambda r: _yes(r["sequential_fits"])),
    ("seq+act", lambda r: _yes(r["sequential_fits_act"])),
    ("seq/fx", _num("sequential_over_fx", 2)),
    ("bal", lambda r: _yes(r["balanced_fits"])),
    ("bal+act", lambda r: _yes(r["balanced_fits_act"])),
    ("bal/fx", _num("balanced_over_fx", 2)),
    ("step x", _num("step_ratio", 2)),
    ("search s", _num("search_s", 2)),
    ("train", lambda r: "no*" if r["train_below_bound"] else _yes(r["train_fits"])),
    ("train s", _num("train_search_s", 2)),
]


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f} s"


def summary(result: dict[str, Any]) -> tuple[list[str], dict[str, bool]]:
    """Lines to print and the PASS/FAIL of each target."""
    name = result["model"]
    rows = result["rows"]
    smallest = result["smallest_fitting_ratio"]
    lines = [
        f"smallest budget that fits, x floor: fxpipe {smallest['fxpipe']:.3f}, block-boundary "
        f"brute force {smallest['block_boundary_brute_force']:.3f}, Accelerate sequential "
        f"{smallest['accelerate_sequential']:.3f} as it counts / "
        f"{smallest['accelerate_sequential_with_activations']:.3f} with activations, balanced "
        f"{smallest['accelerate_balanced']:.3f} / "
        f"{smallest['accelerate_balanced_with_activations']:.3f}",
        f"fxpipe's training floor (chunks={CHUNKS}, checkpoint={CHECKPOINT!r}): "
        f"{result['training_floor_ratio']:.2f}x the inference floor "
        f"({result['training_floor_gib']:.2f} GiB)",
        f"lower bounds on any split's busiest stage: inference "
        f"{result['memory_bound_gib']:.2f} GiB (floor / bound "
        f"{result['floor_gib'] / result['memory_bound_gib']:.3f}), training "
        f"{result['training_memory_bound_gib']:.2f} GiB (floor / bound "
        f"{result['training_floor_gib'] / result['training_memory_bound_gib']:.3f})",
        f"searches: {len(result['searches'])}; the longest that found a split "
        f"{_seconds(result['max_search_found_s'])} (inference "
        f"{_seconds(result['max_search_found_inference_s'])}; the most processor time "
        f"{_seconds(result['max_search_found_cpu_s'])}); the longest refusal "
        f"{_seconds(result['max_search_refused_s'])}, of which the search before the "
        f"MemoryPlanError's diagnosis {_seconds(result['max_search_refused_before_diagnosis_s'])}",
    ]
    fitting = [r for r in rows if r["fx_fits"]]
    must_fit = [r for r in rows if r["ratio"] >= 1.0 or r["bf_fits"]]
    missed = [r["ratio"] for r in must_fit if not r["fx_fits"]]
    compared = [r["fx_over_bf"] for r in rows if r.get("fx_over_bf") is not None]
    speedups = [r["step_ratio"] for r in fitting]
    found_s = result["max_search_found_s"]
    refused_s = result["max_search_refused_before_diagnosis_s"]  # the search itself
    targets = {
        f"{name}: fxpipe fits at every budget >= the floor (missed: {missed or 'none'}); "
        f"its smallest budget {smallest['fxpipe']:.4f} x floor": not missed
        and smallest["fxpipe"] <= 1.0 + TOLERANCE,
        f"{name}: fxpipe bottleneck / best block-boundary split <= {TARGET_BOTTLENECK}: "
        f"max {max(compared, default=math.nan):.4f}": bool(compared)
        and max(compared) <= TARGET_BOTTLENECK,
        f"{name}: Accelerate sequential / fxpipe pipelined step (chunks={CHUNKS}) >= "
        f"{TARGET_SPEEDUP}: min {min(speedups, default=math.nan):.2f}": bool(speedups)
        and min(speedups) >= TARGET_SPEEDUP,
        f"{name}: a memory-constrained search that finds a split < {TARGET_SEARCH_S:.0f} s: "
        f"max {_seconds(found_s)}": found_s is not None and found_s < TARGET_SEARCH_S,
        f"{name}: a memory-constrained search that finds no split < {TARGET_SEARCH_S:.0f} s: "
        f"max {_seconds(refused_s)} (with the MemoryPlanError's diagnosis "
        f"{_seconds(result['max_search_refused_s'])})": refused_s is None
        or refused_s < TARGET_SEARCH_S,
    }
    return lines, targets
