"""Side-by-side timing: variants of one step alternated round by round, ratios as the
median of per-round ratios (a slow spell of a shared machine hits both sides of one)."""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable
from typing import Any

from torch import nn

__all__ = ["Times", "time_interleaved", "paired_ratio", "ratio_row", "quartiles"]

Times = dict[str, dict[str, list[float]]]


def time_interleaved(
    model: nn.Module,
    variants: dict[str, Callable[[], None]],
    repeats: int,
    *,
    warmup: int = 3,
    budget_s: float = 60.0,
    sync: Callable[[], None] | None = None,
) -> Times:
    """Wall and CPU seconds per step of every variant: one step of each per round, the order
    flipped every round; stops early (after at least 5 rounds) once ``budget_s`` is spent.
    ``sync`` runs before each step, outside its time: a barrier, so that the ranks of a
    pipeline start every step together (they must then stop alike: ``budget_s=math.inf``)."""
    names = list(variants)
    times: Times = {"wall": {n: [] for n in names}, "cpu": {n: [] for n in names}}
    start = time.perf_counter()
    for r in range(warmup + repeats):
        gc.collect()
        gc.disable()  # a collection inside one variant's step would bias the ratio
        try:
            for name in names if r % 2 == 0 else names[::-1]:
                model.zero_grad(set_to_none=True)
                if sync is not None:
                    sync()
                wall, cpu = time.perf_counter(), time.process_time()
                variants[name]()
                cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
                if r >= warmup:
                    times["wall"][name].append(wall)
                    times["cpu"][name].append(cpu)
        finally:
            gc.enable()
        if r >= warmup + 4 and time.perf_counter() - start > budget_s:
            break
    return times


def paired_ratio(times: dict[str, list[float]], a: str, b: str) -> float:
    """Median over rounds of ``a``'s step over ``b``'s in the same round."""
    return statistics.median(x / y for x, y in zip(times[a], times[b], strict=True))


def ratio_row(
    name: str, times: Times, variant: str, base: str, target: float | None
) -> dict[str, Any]:
    wall, cpu = times["wall"], times["cpu"]
    ratios = [a / b for a, b in zip(wall[variant], wall[base], strict=True)]
    cpu_ratios = [a / b for a, b in zip(cpu[variant], cpu[base], strict=True)]
    return {
        "row": name,
        "variant": variant,
        "baseline": base,
        "variant_ms": 1e3 * statistics.median(wall[variant]),
        "baseline_ms": 1e3 * statistics.median(wall[base]),
        "ratio": statistics.median(ratios),
        "ratio_q1_q3": quartiles(ratios),
        "ratio_of_min": min(wall[variant]) / min(wall[base]),
        "cpu_ratio": statistics.median(cpu_ratios),
        "target": target,
        "rounds": len(ratios),
    }


def quartiles(values: list[float]) -> list[float]:
    if len(values) < 4:
        return [min(values), max(values)]
    q = statistics.quantiles(values, n=4)
    return [q[0], q[2]]
