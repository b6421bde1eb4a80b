"""The search on topological orders: candidate orders, exact splits, refinement, windows."""

from __future__ import annotations

import heapq
from collections.abc import Callable
from typing import Any

import networkx as nx
import numpy as np

from fxpipe.ir import Traffic
from fxpipe.passes.partition.chain_dp import min_bytes_split, min_max_split
from fxpipe.passes.partition.exact import fewest_bytes_on_ideals
from fxpipe.passes.partition.fit import StageFit, order_split
from fxpipe.passes.partition.ideals import ideal_split, ideal_stages
from fxpipe.passes.partition.memory import FIRST_READER, MODEL_INPUT, Entering
from fxpipe.passes.partition.objective import Pick, bottleneck_of, sent_bytes
from fxpipe.passes.partition.units import Units
from fxpipe.passes.partition.windows import coarsen_near_borders, coarsen_values

__all__ = [
    "search_on_orders",
    "windows_until_stable",
    "candidate_orders",
    "refine",
    "order_stages",
    "first_cut",
]

#: Split-refine-reorder rounds per candidate order when the exact search is out of reach.
REFINE_ROUNDS = 3
#: Seeded random topological orders tried besides the structured ones, on graphs of at most
#: RANDOM_ORDERS_MAX_UNITS units (on larger ones the windows already close the gaps they
#: closed: the same bottleneck on 5,000-node graphs, in less time).
RANDOM_ORDERS = 8
RANDOM_ORDERS_MAX_UNITS = 1000
#: Most rounds of re-placing borders within windows around the last split's borders.
WINDOW_ROUNDS = 4

Window = tuple[Units, np.ndarray, np.ndarray]  # coarse units, fine -> coarse, its ideals


def search_on_orders(
    g: nx.DiGraph,
    units: Units,
    values: list[Entering],
    k: int,
    traffic: Traffic,
    window_limit: int,
    fit: StageFit,
) -> tuple[float, Pick]:
    """The best order's split, its borders then re-placed exactly within windows; the pick
    takes the fewest bytes under a cap from the windows' splits or the orders' (every
    order's on graphs of at most ``RANDOM_ORDERS_MAX_UNITS`` units, else the best one's)."""
    tried = _orders_tried(units, k, fit)
    best, name, order, first, borders = min(tried, key=lambda r: r[0])
    window = None
    if window_limit > 0 and np.isfinite(best):
        minmax = order_stages(units, order, borders)
        window, best = windows_until_stable(units, values, minmax, best, k, window_limit, fit)
    small = units.num_units <= RANDOM_ORDERS_MAX_UNITS

    def pick(cap: float) -> tuple[np.ndarray, str]:
        candidates = []  # (unit stages, method), windows first: they win ties
        if window is not None:
            coarse, of_unit, ideals = window
            coarse_values = coarsen_values(values, of_unit)
            chosen = fewest_bytes_on_ideals(
                coarse, coarse_values, ideals, k, cap, traffic,
                fit.coarsen(of_unit, coarse_values),
            )  # fmt: skip
            candidates.append((chosen[of_unit], f"order:{name}+windows"))
        for value, other, other_order, other_first, other_borders in tried:
            if not value <= cap or not (small or other_order is order):
                continue
            stages = order_stages(units, other_order, other_borders)
            candidates.append((stages, f"order:{other}"))
            moved, cut = _order_fewest_bytes(
                units, other_order, other_first, _cut_bytes(other_order, values), k, cap, fit
            )
            if np.isfinite(moved):
                candidates.append((order_stages(units, other_order, cut), f"order:{other}"))
        return min(
            candidates,
            key=lambda c: (
                sent_bytes(values, c[0], k, traffic),
                _sum_of_squares(units, c[0], k, fit.speeds),
            ),
        )

    return best, pick


def _order_best(
    units: Units, order: list[int], first: int, k: int, fit: StageFit
) -> tuple[float, list[int]]:
    """The smallest bottleneck of one order's splits that ``fit`` allows, and its borders."""
    w = units.weight[order]
    if not fit.bounded:
        return min_max_split(w, k, first_cut=first, speeds=fit.speeds)
    return order_split(
        w, k, first_cut=first, speeds=fit.speeds, memory=fit.on_order(order), limits=fit.limits
    )


def _order_fewest_bytes(
    units: Units,
    order: list[int],
    first: int,
    cut: np.ndarray,
    k: int,
    cap: float,
    fit: StageFit,
) -> tuple[float, list[int]]:
    """The fewest bytes of one order's splits under ``cap`` that ``fit`` allows."""
    w = units.weight[order]
    if not fit.bounded:
        return min_bytes_split(w, cut, k, cap, first_cut=first, speeds=fit.speeds)
    return order_split(
        w, k, first_cut=first, speeds=fit.speeds, memory=fit.on_order(order),
        limits=fit.limits, objective="bytes", cut_bytes=cut, cap=cap,
    )  # fmt: skip


def windows_until_stable(
    units: Units,
    values: list[Entering],
    split: np.ndarray,
    best: float,
    k: int,
    limit: int,
    fit: StageFit,
) -> tuple[Window | None, float]:
    """Re-place the borders of ``split`` exactly within windows around them, then again
    around the borders found, while the bottleneck drops (at most ``WINDOW_ROUNDS`` times):
    the last windows, which hold the best split found, and its bottleneck."""
    window = None
    for _ in range(WINDOW_ROUNDS):
        found = coarsen_near_borders(units, split, k, limit)
        if found is None:
            break
        window = found
        coarse, of_unit, ideals = found
        coarse_fit = fit.coarsen(of_unit, coarsen_values(values, of_unit))
        value, rows = ideal_split(
            ideals,
            coarse.weight,
            k,
            required_first=sorted(coarse.pinned_first),
            speeds=fit.speeds,
            allowed=coarse_fit.allowed_on(ideals),
        )
        if not value < best * (1.0 - 1e-9):
            break
        best, split = value, ideal_stages(ideals, rows)[of_unit]
    return window, best


def _orders_tried(
    units: Units, k: int, fit: StageFit
) -> list[tuple[float, str, list[int], int, list[int]]]:
    """Every candidate order, and each re-ordering by a round of refinement: (bottleneck of
    its exact split, order name, order, first allowed border, the split's borders)."""
    results = []
    fits = fit.fits if fit.bounded else None
    for name, order in candidate_orders(units).items():
        for _ in range(REFINE_ROUNDS):
            first = first_cut(units, order)
            best, borders = _order_best(units, order, first, k, fit)
            results.append((best, name, order, first, borders))
            if not np.isfinite(best):
                break
            stage = order_stages(units, order, borders)
            refined = refine(units, stage, k, speeds=fit.speeds, fits=fits)
            if bottleneck_of(units.weight, refined, k, fit.speeds) >= best:
                break
            position = {u: p for p, u in enumerate(order)}
            order = sorted(range(units.num_units), key=lambda u: (refined[u], position[u]))
    return results


def order_stages(units: Units, order: list[int], borders: list[int]) -> np.ndarray:
    """The stage of every unit when ``order`` is cut before each position of ``borders``."""
    position_stage = np.searchsorted(np.array(borders), np.arange(len(order)), side="right")
    unit_stage = np.empty(units.num_units, dtype=np.int64)
    unit_stage[np.array(order)] = position_stage
    return unit_stage


def refine(
    units: Units,
    unit_stage: np.ndarray,
    k: int,
    max_moves: int = 200,
    *,
    speeds: np.ndarray | None = None,
    fits: Callable[[np.ndarray], bool] | None = None,
) -> np.ndarray:
    """Move single units out of the bottleneck stage into a neighbour while that lowers the
    bottleneck and keeps every edge going forward (a unit may go back a stage when all its
    predecessors are already there, forward when all its successors are). Stage j's time
    is its cost over ``speeds[j]``; with ``fits``, a move is made only when the split after
    it passes (the best such move)."""
    stage = unit_stage.copy()
    cost = np.bincount(stage, weights=units.weight, minlength=k)
    count = np.bincount(stage, minlength=k)
    speed = np.ones(k) if speeds is None else speeds
    dag, w = units.dag, units.weight
    for _ in range(max_moves):
        b = int((cost / speed).argmax())
        top = cost[b] / speed[b]
        moves: list[tuple[float, int, int]] = []
        for u in np.flatnonzero(stage == b):
            for to in (b - 1, b + 1):
                if not 0 <= to < k or count[b] <= 1 or (u in units.pinned_first and to > 0):
                    continue
                if to < b and any(stage[p] > to for p in dag.predecessors(u)):
                    continue
                if to > b and any(stage[q] < to for q in dag.successors(u)):
                    continue
                peak = max((cost[b] - w[u]) / speed[b], (cost[to] + w[u]) / speed[to])
                if peak < top - 1e-12:
                    moves.append((peak, int(u), to))
        moves.sort(key=lambda m: m[0])  # stable: the first of equal peaks, as found
        best = next((m for m in moves if fits is None or fits(_moved(stage, m))), None)
        if best is None:
            break
        _, moved, to = best
        cost[b] -= w[moved]
        cost[to] += w[moved]
        count[b] -= 1
        count[to] += 1
        stage[moved] = to
    return stage


def candidate_orders(units: Units) -> dict[str, list[int]]:
    """Topological orders of the unit DAG worth splitting, pinned units first in each."""
    dag = units.dag
    num = dag.number_of_nodes()
    succs = [list(dag.successors(u)) for u in range(num)]
    preds = [list(dag.predecessors(u)) for u in range(num)]
    depth = [0] * num
    for u in range(num):  # unit ids are a topological order
        depth[u] = max((depth[p] + 1 for p in preds[u]), default=0)
    first = [0 if u in units.pinned_first else 1 for u in range(num)]
    orders = {
        "fx": _priority_order(succs, preds, [(first[u], u) for u in range(num)]),
        "breadth": _priority_order(succs, preds, [(first[u], depth[u], u) for u in range(num)]),
        "depth": _depth_first_order(dag, dict(enumerate(first))),
    }
    if num <= RANDOM_ORDERS_MAX_UNITS:
        for seed in range(RANDOM_ORDERS):
            keys = np.random.default_rng(seed).random(num)
            orders[f"random{seed}"] = _priority_order(
                succs, preds, [(first[u], float(keys[u])) for u in range(num)]
            )
    return orders


def _priority_order(succs: list[list[int]], preds: list[list[int]], keys: list[Any]) -> list[int]:
    """The topological order that always takes the ready unit with the smallest key."""
    waiting = [len(p) for p in preds]
    ready = [(keys[u], u) for u in range(len(keys)) if not waiting[u]]
    heapq.heapify(ready)
    order = []
    while ready:
        _, u = heapq.heappop(ready)
        order.append(u)
        for v in succs[u]:
            waiting[v] -= 1
            if not waiting[v]:
                heapq.heappush(ready, (keys[v], v))
    return order


def _depth_first_order(dag: nx.DiGraph, first: dict[int, int]) -> list[int]:
    """Kahn's algorithm with a stack: finish the branch just entered before starting another."""
    remaining = {u: dag.in_degree(u) for u in dag}
    ready = sorted((u for u, d in remaining.items() if d == 0), key=lambda u: (-first[u], -u))
    order = []
    while ready:
        u = ready.pop()
        order.append(u)
        unlocked = []
        for v in dag.successors(u):
            remaining[v] -= 1
            if remaining[v] == 0:
                unlocked.append(v)
        ready.extend(sorted(unlocked, reverse=True))
    return order


def first_cut(units: Units, order: list[int]) -> int:
    """The first position of ``order`` a border may stand at: after every pinned unit."""
    position = {u: p for p, u in enumerate(order)}
    return max((position[u] for u in units.pinned_first), default=-1) + 1


def _cut_bytes(order: list[int], values: list[Entering]) -> np.ndarray:
    """Bytes crossing a border before each position of ``order`` (relay counting)."""
    num = len(order)
    position = np.empty(num, dtype=np.int64)
    position[np.array(order)] = np.arange(num)
    diff = np.zeros(num + 2)
    for v in values:
        if v.producer == MODEL_INPUT:
            start = -1
        elif v.producer == FIRST_READER:
            start = min(int(position[r]) for r in v.readers)
        else:
            start = int(position[v.producer])
        last = num if v.to_output else max(int(position[r]) for r in v.readers)
        diff[start + 1] += v.bytes
        diff[last + 1] -= v.bytes
    return np.cumsum(diff)[: num + 1]


def _sum_of_squares(
    units: Units, unit_stage: np.ndarray, k: int, speeds: np.ndarray | None = None
) -> float:
    costs = np.bincount(unit_stage, weights=units.weight, minlength=k)
    if speeds is not None:
        costs = costs / speeds
    return float((costs**2).sum())


def _moved(unit_stage: np.ndarray, move: tuple[float, int, int]) -> np.ndarray:
    """``unit_stage`` with one unit moved: ``move`` is (peak, unit, its new stage)."""
    out = unit_stage.copy()
    out[move[1]] = move[2]
    return out
