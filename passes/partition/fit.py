"""What each stage position must obey (its device's speed, its memory limit) and the exact
split of one order under both.

:class:`StageFit` holds, for stage position j, ``speeds[j]`` (a stage's time is its units'
cost divided by it) and ``limits[j]`` (the bytes its training memory, priced by
``memory_tables.UnitMemory``, may reach; modules named here are this package's). Without
limits the fast solvers of ``chain_dp`` take the speeds. With limits, :func:`order_split`
is exact for one order in O(K N^2): memory is not monotone in a segment's start (a longer
segment may hold the producer of a value it would otherwise receive), so every start is
priced, the memory of all starts being updated as each item joins the segment's end
(``memory_tables.OrderMemory``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Literal

import numpy as np

from fxpipe.passes.partition.memory import Entering
from fxpipe.passes.partition.memory_tables import OrderMemory, UnitMemory

__all__ = ["StageFit", "order_split", "Objective"]

_INF = float("inf")

#: What :func:`order_split` minimises: the bottleneck time, the bytes cut under a time cap,
#: the largest ratio of a stage's memory to its limit, or the weighted sum of the stages'
#: memory under a time cap.
Objective = Literal["time", "bytes", "memory", "summed"]


@dataclass(frozen=True)
class StageFit:
    """Per stage position: the device's relative speed and the stage's memory limit."""

    #: Relative speed of each stage position (None: all 1).
    speeds: np.ndarray | None = None
    #: Prices a stage's memory (None: memory is not checked).
    memory: UnitMemory | None = None
    #: Bytes each stage position may hold (inf: unchecked; None: none checked).
    limits: np.ndarray | None = None

    @property
    def bounded(self) -> bool:
        """Whether some stage has a memory limit."""
        return (
            self.memory is not None
            and self.limits is not None
            and bool(np.isfinite(self.limits).any())
        )

    def times(self, weight: np.ndarray, unit_stage: np.ndarray, k: int) -> np.ndarray:
        """Time of each stage of ``unit_stage``: its cost over its speed."""
        cost = np.bincount(unit_stage, weights=weight, minlength=k)
        return cost if self.speeds is None else cost / self.speeds

    def fits(self, unit_stage: np.ndarray) -> bool:
        """Whether every stage of ``unit_stage`` is within its limit."""
        if not self.bounded or self.memory is None or self.limits is None:
            return True
        return bool((self.memory.stage_bytes(unit_stage) <= self.limits).all())

    def allowed_on(self, ideals: np.ndarray) -> Callable[[int], np.ndarray] | None:
        """``allowed(j)[I, J]``: stage ``I - J`` fits position j's limit (None: all do)."""
        if not self.bounded or self.memory is None or self.limits is None:
            return None
        table = self.memory.on_ideals(ideals)
        limits = self.limits

        def allowed(j: int) -> np.ndarray:
            if not np.isfinite(limits[j]):
                return np.ones((table.count, table.count), dtype=bool)
            return np.asarray(table.stage(j) <= limits[j])

        return allowed

    def memory_ratio_on(self, ideals: np.ndarray) -> Callable[[int], np.ndarray]:
        """``ratio(j)[I, J]``: stage ``I - J``'s memory over position j's limit (0 where
        unlimited): the stage value that the least-memory search minimises."""
        if self.memory is None or self.limits is None:
            raise ValueError("a memory ratio needs a memory model and limits")
        table = self.memory.on_ideals(ideals)
        limits = self.limits

        def ratio(j: int) -> np.ndarray:
            if not np.isfinite(limits[j]):
                return np.zeros((table.count, table.count))
            return np.asarray(table.stage(j) / limits[j])

        return ratio

    def coarsen(self, of_unit: np.ndarray, values: Iterable[Entering]) -> StageFit:
        """The same fit on coarse units (``of_unit[u]``: the coarse unit of unit u)."""
        if self.memory is None:
            return self
        return StageFit(self.speeds, self.memory.coarsen(of_unit, values), self.limits)

    def on_order(self, order: list[int]) -> OrderMemory | None:
        """The memory of every segment of ``order`` (None: memory is not checked)."""
        return self.memory.on_order(order) if self.memory is not None else None


def order_split(
    w: np.ndarray,
    num_stages: int,
    *,
    first_cut: int = 1,
    speeds: np.ndarray | None = None,
    memory: OrderMemory | None = None,
    limits: np.ndarray | None = None,
    objective: Objective = "time",
    cut_bytes: np.ndarray | None = None,
    cap: float | None = None,
    weights: np.ndarray | None = None,
) -> tuple[float, list[int]]:
    """The exact best split of one order into ``num_stages`` non-empty stages whose memory
    (``memory``, swept from its start) is within ``limits``, as (value, borders).

    ``objective``: ``"time"``, the smallest bottleneck, stage j's time being its cost over
    ``speeds[j]``; ``"bytes"``, the fewest ``cut_bytes`` summed over the borders among the
    splits whose every stage takes at most ``cap``; ``"memory"``, the smallest largest ratio
    of a stage's memory to its limit (limits are not enforced); ``"summed"``, the smallest
    sum of ``weights[j]`` x stage j's memory among the splits whose every stage takes at
    most ``cap``. Borders go at positions ``>= first_cut``; the value is inf when no split
    qualifies."""
    n, k = len(w), num_stages
    prefix = np.concatenate([[0.0], np.cumsum(w)])
    first_cut = max(first_cut, 1) if k > 1 else 1  # one stage has no border to place
    if n - first_cut < k - 1 or n == 0:
        return _INF, []
    speed = np.ones(k) if speeds is None else np.asarray(speeds, dtype=np.float64)
    limit = np.full(k, _INF) if limits is None else np.asarray(limits, dtype=np.float64)
    enforce = objective != "memory" and memory is not None
    if objective == "summed" and (memory is None or weights is None or cap is None):
        raise ValueError("objective='summed' needs memory, weights and a cap")
    if objective == "bytes" and cut_bytes is None:
        raise ValueError("objective='bytes' needs cut_bytes")
    if objective in ("bytes", "summed"):
        if cap is None:
            raise ValueError(f"objective={objective!r} needs a cap")
        # Stage costs are differences of prefix sums; forgive their rounding, not more.
        cap = cap + 8 * np.finfo(np.float64).eps * max(float(prefix[n]), abs(cap), 1e-300)
    additive = []
    if memory is not None:
        memory.reset()
        additive = [memory.additive(j) for j in range(k)]
    best = np.full((k, n + 1), _INF)
    arg = np.zeros((k, n + 1), dtype=np.int64)
    for t in range(1, n + 1):
        if memory is not None:
            memory.advance(t)
        for j in range(k):
            lo = 0 if j == 0 else first_cut + j - 1
            if (j == 0 and t < first_cut) or t <= lo or (j == k - 1 and t != n):
                continue
            if t > n - (k - 1 - j):
                continue  # too few items left for the later stages
            start = lo
            if enforce and np.isfinite(limit[j]) and j > 0:
                floor = additive[j][t] - limit[j] * (1 + 1e-9) - 1.0
                start = max(start, int(np.searchsorted(additive[j], floor, side="left")))
            if objective in ("bytes", "summed") and j > 0 and cap is not None:
                floor = prefix[t] - cap * speed[j]
                start = max(start, int(np.searchsorted(prefix, floor, side="left")))
            stop = 1 if j == 0 else t
            if start >= stop:
                continue
            value = _candidates(
                best, prefix, t, j, start, stop, speed, limit, memory, enforce, objective,
                cut_bytes, cap, weights,
            )  # fmt: skip
            i = int(np.argmin(value))
            best[j, t] = value[i]
            arg[j, t] = start + i
    if not np.isfinite(best[k - 1, n]):
        return _INF, []
    borders, t = [], n
    for j in range(k - 1, 0, -1):
        t = int(arg[j, t])
        borders.append(t)
    return float(best[k - 1, n]), borders[::-1]


def _candidates(
    best: np.ndarray,
    prefix: np.ndarray,
    t: int,
    j: int,
    start: int,
    stop: int,
    speed: np.ndarray,
    limit: np.ndarray,
    memory: OrderMemory | None,
    enforce: bool,
    objective: Objective,
    cut_bytes: np.ndarray | None,
    cap: float | None,
    weights: np.ndarray | None,
) -> np.ndarray:
    """The objective of each split whose stage j is ``[s, t)``, s = start .. stop - 1."""
    time = (prefix[t] - prefix[start:stop]) / speed[j]
    summed = objective == "summed"
    priced = memory is not None and (objective == "memory" or summed or np.isfinite(limit[j]))
    used = memory.stage(start, j, stop) if memory is not None and priced else None
    earlier = best[j - 1, start:stop] if j > 0 else np.zeros(stop - start)
    if objective == "time":
        value = np.maximum(earlier, time)
    elif objective == "bytes":
        assert cut_bytes is not None and cap is not None
        value = earlier + (cut_bytes[start:stop] if j > 0 else 0.0)
        value = np.where(time <= cap, value, _INF)
    elif summed:
        assert used is not None and weights is not None and cap is not None
        value = np.where(time <= cap, earlier + weights[j] * used, _INF)
    else:
        ratio = used / limit[j] if used is not None else np.zeros(stop - start)
        value = np.maximum(earlier, ratio)
    if enforce and used is not None:
        value = np.where(used <= limit[j], value, _INF)
    return np.asarray(value)
