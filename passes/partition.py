"""Splits a cost graph into K balanced, convex stages; plans only, mutates nothing.

The search works on *units* (:mod:`fxpipe.passes.units`), so that non-tensor values and
zero-cost naming nodes never become stage borders:

1. When the unit DAG has few enough ideals, the split is the exact optimum over every
   convex split (:mod:`fxpipe.passes.ideals`).
2. Otherwise several topological orders (fx order, breadth-first by depth, depth-first
   finishing each branch, seeded random ones) are each split exactly
   (:mod:`fxpipe.passes.dp`) and refined; the best bottleneck wins. Its borders are then
   re-placed exactly within windows around them (:mod:`fxpipe.passes.windows`).
3. Among splits whose bottleneck is within ``slack`` of the best, the one that sends the
   fewest bytes is kept, unless the best-bottleneck split sends no more. ``traffic`` says
   how the stage modules will move values: ``"direct"`` (the default codegen) sends a
   value once to every later stage that reads it; ``"relay"`` passes it through every
   border between its producer and its last reader. The exact searches (whole DAG,
   windows) minimise that traffic; the split of the best order minimises relay bytes (an
   upper bound of the direct traffic); the order path keeps whichever of the two sends
   less.
4. ``speed`` and ``memory`` (:mod:`fxpipe.passes.fit`): stage j's time is its cost over
   the speed of its device, and every search above compares times. Under memory budgets
   the split found first is kept when every device holds its stages; otherwise the same
   searches run again with each stage's memory limit inside them (a stage over its limit
   is never a candidate) as :mod:`fxpipe.passes.budgeted` says.

Placeholders go to stage 0, ``get_attr`` nodes to the first stage that reads them, and
the output node to the last stage.
"""

from __future__ import annotations

import heapq
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import networkx as nx
import numpy as np

from fxpipe.errors import PlanError
from fxpipe.ir import Traffic
from fxpipe.passes.budgeted import Found, fit_budgets
from fxpipe.passes.dp import min_bytes_split, min_max_split
from fxpipe.passes.fit import StageFit, order_split
from fxpipe.passes.ideals import enumerate_ideals, ideal_split, ideal_stages
from fxpipe.passes.memory import FIRST_READER, MODEL_INPUT, Entering, MemoryModel
from fxpipe.passes.nx_graph import carries_value
from fxpipe.passes.units import Units, build_units
from fxpipe.passes.windows import coarsen_near_borders

__all__ = [
    "Partition",
    "partition_graph",
    "sent_bytes",
    "node_stages",
    "candidate_orders",
    "refine",
]

#: Largest ideal count the exact search takes on inside the partitioner.
EXACT_LIMIT = 1500
#: Split-refine-reorder rounds per candidate order when the exact search is out of reach.
REFINE_ROUNDS = 3
#: Largest ideal count of the coarse DAG on which the order search's borders are re-placed
#: exactly (:mod:`fxpipe.passes.windows`); smaller than EXACT_LIMIT to keep that step cheap.
WINDOW_LIMIT = 600
#: Seeded random topological orders tried besides the structured ones, on graphs of at most
#: RANDOM_ORDERS_MAX_UNITS units (on larger ones the windows already close the gaps they
#: closed: the same bottleneck on 5,000-node graphs, in less time).
RANDOM_ORDERS = 8
RANDOM_ORDERS_MAX_UNITS = 1000
#: Most rounds of re-placing borders within windows around the last split's borders.
WINDOW_ROUNDS = 4

Window = tuple[Units, np.ndarray, np.ndarray]  # coarse units, fine -> coarse, its ideals


@dataclass(frozen=True)
class Partition:
    """A stage for every node of the cost graph, and how it was found."""

    stage_of: dict[str, int]
    bottleneck: float
    #: "ideals" (exact over convex splits), "order:<name>" (exact on that order) or
    #: "order:<name>+windows" (then exact within the windows around its borders).
    method: str
    #: Bytes the stages send each other under ``traffic``.
    border_bytes: float
    #: "direct" (a value goes to each stage that reads it; a model output leaves from the
    #: stage that makes it) or "relay" (through every stage in between; outputs leave from
    #: the last stage), as the codegen will move values.
    traffic: Traffic = "direct"
    info: dict[str, Any] = field(default_factory=dict)


def partition_graph(
    g: nx.DiGraph,
    num_stages: int,
    *,
    slack: float = 0.0,
    exact_limit: int = EXACT_LIMIT,
    window_limit: int = WINDOW_LIMIT,
    traffic: Traffic = "direct",
    speed: Sequence[float] | None = None,
    memory: MemoryModel | None = None,
) -> Partition:
    """Split ``g`` (from :func:`fxpipe.passes.nx_graph.to_networkx`) into ``num_stages``.

    ``exact_limit`` caps the ideals of the whole-DAG exact search (0: order search only);
    ``window_limit`` those of the coarse DAG around the order search's borders (0: none).
    ``speed[j]``: the relative speed of stage j's device; a stage's time is its cost over
    it and the bottleneck is the largest time (None: all 1, times are costs). ``memory``:
    the budgets every device's stages must fit (MemoryPlanError, with the least memory any
    split needs, when none does)."""
    started = time.perf_counter()
    units = build_units(g)
    _check_enough_units(g, units, num_stages)
    values = _values(g, units, traffic)
    ideals = enumerate_ideals(units.dag, exact_limit) if exact_limit > 0 else None
    search = _Search(g, units, values, ideals, num_stages, slack, traffic, window_limit)
    fit = StageFit(speeds=_speeds(speed, num_stages))
    found = search.split(fit)
    if found is None:  # pragma: no cover - every split qualifies without memory limits
        raise PlanError(f"no split of the graph into {num_stages} stages was found")
    how = None
    if memory is not None:
        found, how = fit_budgets(search, found, fit, memory)
    unit_stage, method, moved, bottleneck = found
    stage_of = node_stages(g, units, unit_stage, num_stages)
    info: dict[str, Any] = {
        "units": units.num_units,
        "ideals": None if ideals is None else len(ideals),
        "seconds": time.perf_counter() - started,
    }
    if how is not None:
        info["memory"] = how
    return Partition(stage_of, bottleneck, method, moved, traffic, info)


def _speeds(speed: Sequence[float] | None, k: int) -> np.ndarray | None:
    """The speeds as an array, None when all are 1 (times are costs, bit for bit)."""
    if speed is None:
        return None
    speeds = np.asarray(speed, dtype=np.float64)
    if speeds.shape != (k,) or not (np.isfinite(speeds).all() and (speeds > 0).all()):
        raise PlanError(f"speed={list(speed)} must be {k} positive numbers, one per stage")
    return None if (speeds == 1.0).all() else speeds


@dataclass(frozen=True)
class _Search:
    """The searches of one graph, ready to run under any :class:`StageFit`."""

    g: nx.DiGraph
    units: Units
    values: list[Entering]
    ideals: np.ndarray | None
    k: int
    slack: float
    traffic: Traffic
    window_limit: int

    def split(self, fit: StageFit) -> Found | None:
        """The best split under ``fit`` and its fewest-bytes pick within the slack:
        (unit stages, method, bytes sent, bottleneck); None when no split fits."""
        units, values, k, traffic = self.units, self.values, self.k, self.traffic
        if self.ideals is not None:
            best, pick = _search_on_ideals(units, values, self.ideals, k, traffic, fit)
        else:
            best, pick = _search_on_orders(
                self.g, units, values, k, traffic, self.window_limit, fit
            )
        if not np.isfinite(best):
            return None
        unit_stage, method = pick(_cap(best, self.slack))
        moved = sent_bytes(values, unit_stage, k, traffic)
        bottleneck = _bottleneck(units.weight, unit_stage, k, fit.speeds)
        if self.slack > 0:  # the slack must buy fewer bytes: else keep the best bottleneck
            tight_stage, tight_method = pick(_cap(best, 0.0))
            tight_moved = sent_bytes(values, tight_stage, k, traffic)
            tighter = _bottleneck(units.weight, tight_stage, k, fit.speeds)
            if tight_moved <= moved and tighter < bottleneck:
                unit_stage, method, moved, bottleneck = (
                    tight_stage, tight_method, tight_moved, tighter
                )  # fmt: skip
        return unit_stage, method, moved, bottleneck

    def least_memory(self, fit: StageFit, *, quick: bool = False) -> np.ndarray | None:
        """The split whose largest ratio of a stage's memory to its limit is smallest
        (exact over every convex split on the ideals, else over each candidate order and
        windows around the best; ``quick``: the structured orders only)."""
        units, k = self.units, self.k
        if self.ideals is not None:
            value, rows = ideal_split(
                self.ideals,
                units.weight,
                k,
                required_first=sorted(units.pinned_first),
                stage_value=fit.memory_ratio_on(self.ideals),
            )
            return ideal_stages(self.ideals, rows) if np.isfinite(value) else None
        best: tuple[float, np.ndarray] | None = None
        for name, order in candidate_orders(units).items():
            if quick and name.startswith("random"):
                continue
            value, borders = order_split(
                units.weight[order],
                k,
                first_cut=_first_cut(units, order),
                memory=fit.on_order(order),
                limits=fit.limits,
                objective="memory",
            )
            if np.isfinite(value) and (best is None or value < best[0]):
                best = (value, _order_stages(units, order, borders))
        if best is None:
            return None
        value, split = best
        for _ in range(WINDOW_ROUNDS if self.window_limit > 0 else 0):
            window = coarsen_near_borders(units, split, k, self.window_limit)
            if window is None:
                break
            coarse, of_unit, ideals = window
            coarse_fit = fit.coarsen(of_unit, _coarse_values(self.values, of_unit))
            lower, rows = ideal_split(
                ideals,
                coarse.weight,
                k,
                required_first=sorted(coarse.pinned_first),
                stage_value=coarse_fit.memory_ratio_on(ideals),
            )
            if not lower < value * (1.0 - 1e-9):
                break
            value, split = lower, ideal_stages(ideals, rows)[of_unit]
        return split

    def least_sum(
        self, fit: StageFit, weights: np.ndarray, cap: float
    ) -> tuple[float, np.ndarray] | None:
        """The split, among those ``fit`` allows whose every stage takes at most ``cap``,
        with the smallest sum of ``weights[j]`` x stage j's memory: (that sum, the split);
        None when none qualifies (exact on the ideals, else over the structured orders)."""
        units, k = self.units, self.k
        memory = fit.memory
        assert memory is not None
        if self.ideals is not None:
            table = memory.on_ideals(self.ideals)
            value, rows = ideal_split(
                self.ideals,
                units.weight,
                k,
                required_first=sorted(units.pinned_first),
                cap=cap,
                speeds=fit.speeds,
                allowed=fit.allowed_on(self.ideals),
                stage_sum=lambda j: weights[j] * table.stage(j),
            )
            return (value, ideal_stages(self.ideals, rows)) if np.isfinite(value) else None
        best: tuple[float, np.ndarray] | None = None
        for name, order in candidate_orders(units).items():
            if name.startswith("random"):
                continue
            value, borders = order_split(
                units.weight[order],
                k,
                first_cut=_first_cut(units, order),
                speeds=fit.speeds,
                memory=fit.on_order(order),
                limits=fit.limits,
                objective="summed",
                cap=cap,
                weights=weights,
            )
            if np.isfinite(value) and (best is None or value < best[0]):
                best = (value, _order_stages(units, order, borders))
        return best

    def improve(self, unit_stage: np.ndarray, fit: StageFit) -> Found:
        """``unit_stage`` (which ``fit`` allows), its borders re-placed exactly within
        windows around them for a smaller bottleneck under ``fit``."""
        units, k = self.units, self.k
        start = _bottleneck(units.weight, unit_stage, k, fit.speeds)
        if self.window_limit <= 0:
            return self.found(unit_stage, "least memory", fit)
        window, best = _windows_until_stable(
            units, self.values, unit_stage, start, k, self.window_limit, fit
        )
        if window is None or not best < start:
            return self.found(unit_stage, "least memory", fit)
        coarse, of_unit, ideals = window
        coarse_values = _coarse_values(self.values, of_unit)
        chosen = _fewest_bytes_on_ideals(
            coarse, coarse_values, ideals, k, _cap(best, 0.0), self.traffic,
            fit.coarsen(of_unit, coarse_values),
        )  # fmt: skip
        return self.found(chosen[of_unit], "least memory+windows", fit)

    @property
    def exact(self) -> bool:
        """Whether the searches are exact over every convex split (on the ideals)."""
        return self.ideals is not None

    def found(self, unit_stage: np.ndarray, method: str, fit: StageFit) -> Found:
        """``unit_stage`` described as :meth:`split` describes its splits."""
        moved = sent_bytes(self.values, unit_stage, self.k, self.traffic)
        bottleneck = _bottleneck(self.units.weight, unit_stage, self.k, fit.speeds)
        return unit_stage, method, moved, bottleneck

    def entering(self) -> list[Entering]:
        """The values units receive, as the memory pricing reads them."""
        return self.values

    def with_stages(self, k: int) -> _Search | None:
        """The same search into ``k`` stages; None when the graph has too few cuts."""
        try:
            _check_enough_units(self.g, self.units, k)
        except PlanError:
            return None
        return _Search(
            self.g, self.units, self.values, self.ideals, k, self.slack, self.traffic,
            self.window_limit,
        )  # fmt: skip


def _check_enough_units(g: nx.DiGraph, units: Units, num_stages: int) -> None:
    if num_stages < 1:
        raise PlanError(f"num_stages={num_stages} must be at least 1")
    if units.num_units == 0:
        raise PlanError(
            "the traced graph computes nothing from its inputs (no call_function, call_method "
            "or call_module node), so there is nothing to split into stages; the model must "
            "compute its outputs from its tensor inputs"
        )
    cuts = units.num_units - max(len(units.pinned_first), 1)  # pinned units open stage 0
    if cuts >= num_stages - 1:
        return
    compute = sum(1 for _, op in g.nodes(data="op") if op != "placeholder")
    most = cuts + 1
    stages, devices = (
        ("stage", "one device") if most == 1 else ("stages", f"at most {most} devices")
    )
    raise PlanError(
        f"the graph can be cut into at most {most} {stages} ({units.num_units} indivisible "
        f"group{'' if units.num_units == 1 else 's'} of {compute} nodes; values that are not "
        "tensors never cross a stage border) "
        f"but {num_stages} stages were asked; pass {devices}, or trace finer-grained modules"
    )


def _values(g: nx.DiGraph, units: Units, traffic: Traffic) -> list[Entering]:
    """Every value read outside the unit that makes it; the model output counts as a reader
    in the last stage only in relay traffic (direct: the maker returns it to the caller)."""
    out = []
    nodes = g.nodes
    for n, succ in g.adjacency():
        data = nodes[n]
        reading = [v for v, edge in succ.items() if carries_value(edge)]
        reader_units = [units.unit_of[v] for v in reading if v in units.unit_of]
        to_output = traffic == "relay" and any(g.nodes[v]["op"] == "output" for v in reading)
        if data["op"] == "placeholder":
            producer = MODEL_INPUT
        elif data["op"] == "get_attr":
            producer = FIRST_READER
        elif n in units.unit_of:
            producer = units.unit_of[n]
        else:
            continue
        others = sorted({r for r in reader_units if r != producer})
        lone_attr = producer == FIRST_READER and len(others) < 2
        if (others or to_output) and not lone_attr:
            batched = bool(data.get("batched", True))
            out.append(Entering(int(data["bytes"]), producer, tuple(others), to_output, batched))
    return out


#: The split that sends the fewest bytes with every stage <= a cap: (unit stages, method).
Pick = Callable[[float], tuple[np.ndarray, str]]


def _search_on_ideals(
    units: Units,
    values: list[Entering],
    ideals: np.ndarray,
    k: int,
    traffic: Traffic,
    fit: StageFit,
) -> tuple[float, Pick]:
    """The exact best bottleneck over every convex split that ``fit`` allows, and the
    fewest-bytes pick."""
    allowed = fit.allowed_on(ideals)
    best, _ = ideal_split(
        ideals,
        units.weight,
        k,
        required_first=sorted(units.pinned_first),
        speeds=fit.speeds,
        allowed=allowed,
    )

    def pick(cap: float) -> tuple[np.ndarray, str]:
        chosen = _fewest_bytes_on_ideals(units, values, ideals, k, cap, traffic, fit, allowed)
        return chosen, "ideals"

    return best, pick


def _fewest_bytes_on_ideals(
    units: Units,
    values: list[Entering],
    ideals: np.ndarray,
    k: int,
    cap: float,
    traffic: Traffic,
    fit: StageFit,
    allowed: Callable[[int], np.ndarray] | None = None,
) -> np.ndarray:
    """The unit stages of the split that sends the fewest bytes with every stage <= cap
    (``allowed``: the memory masks of ``fit`` on these ideals, when already made)."""
    if traffic == "relay":
        priced = _bytes_leaving(ideals, values)
    else:
        priced = _bytes_entering(ideals, values)
    total = float(units.weight.sum())
    if fit.speeds is not None:
        total /= float(fit.speeds.min())  # the times sum to at most this
    _, rows = ideal_split(
        ideals,
        units.weight,
        k,
        required_first=sorted(units.pinned_first),
        border_bytes=priced,
        cap=cap,
        balance=_tie_break(total),
        speeds=fit.speeds,
        allowed=allowed if allowed is not None else fit.allowed_on(ideals),
    )
    stages: np.ndarray = ideal_stages(ideals, rows)
    return stages


def _coarse_values(values: list[Entering], of_unit: np.ndarray) -> list[Entering]:
    """``values`` seen on coarse units (``of_unit[u]``: the coarse unit of fine unit u): what
    :func:`_values` returns for them, without walking the graph again."""
    out = []
    for v in values:
        producer = v.producer if v.producer < 0 else int(of_unit[v.producer])
        others = sorted({int(of_unit[r]) for r in v.readers} - {producer})
        lone_attr = producer == FIRST_READER and len(others) < 2
        if (others or v.to_output) and not lone_attr:
            out.append(Entering(v.bytes, producer, tuple(others), v.to_output, v.batched))
    return out


def _made_in(ideals: np.ndarray, v: Entering) -> np.ndarray:
    """Which ideals hold the stage that makes ``v``."""
    if v.producer == MODEL_INPUT:
        return np.ones(len(ideals), dtype=bool)
    if v.producer == FIRST_READER:
        return np.asarray(ideals[:, list(v.readers)].any(axis=1))
    return np.asarray(ideals[:, v.producer])


def _bytes_leaving(ideals: np.ndarray, values: list[Entering]) -> np.ndarray:
    """Relay traffic: ``out[J]``, the bytes of values made in ideal J and read outside it."""
    leaving = np.zeros(len(ideals))
    for v in values:
        made = _made_in(ideals, v)
        read_outside = ~ideals[:, list(v.readers)].all(axis=1) if v.readers else False
        leaving += v.bytes * (made & (read_outside | v.to_output))
    return leaving


def _bytes_entering(ideals: np.ndarray, values: list[Entering]) -> np.ndarray:
    """Direct traffic: ``out[I, J]``, the bytes stage ``I - J`` receives, i.e. of the values
    made in J with a reader in ``I - J`` (each once, however many readers it has there).

    With ``c(I)`` the number of v's readers in ideal I (the output counts as a reader in the
    full ideal only), v enters ``I - J`` exactly when ``c(I) > c(J)``, which is the sum over
    ``c < m`` of ``[c(J) = c] [c(I) > c]`` for m readers: rank-one terms, so the whole table
    is one matrix product over (value, c) columns."""
    count = len(ideals)
    last = np.zeros(count, dtype=np.int64)
    last[-1] = 1  # rows are ordered by size: the last one is the full ideal
    grouped: dict[tuple[int, tuple[int, ...], bool], float] = defaultdict(float)
    for v in values:
        grouped[(v.producer, v.readers, v.to_output)] += v.bytes
    receives, sends = [], []
    for (producer, units_reading, to_output), size in grouped.items():
        made = _made_in(ideals, Entering(0, producer, units_reading, to_output))
        inside = ideals[:, list(units_reading)].sum(axis=1) + (last if to_output else 0)
        for c in range(len(units_reading) + to_output):
            receives.append(inside > c)
            sends.append(size * (made & (inside == c)))
    if not receives:
        return np.zeros((count, count))
    return np.asarray(np.stack(receives, axis=1).astype(np.float64) @ np.stack(sends, axis=1).T)


def _search_on_orders(
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
        minmax = _order_stages(units, order, borders)
        window, best = _windows_until_stable(units, values, minmax, best, k, window_limit, fit)
    small = units.num_units <= RANDOM_ORDERS_MAX_UNITS

    def pick(cap: float) -> tuple[np.ndarray, str]:
        candidates = []  # (unit stages, method), windows first: they win ties
        if window is not None:
            coarse, of_unit, ideals = window
            coarse_values = _coarse_values(values, of_unit)
            chosen = _fewest_bytes_on_ideals(
                coarse, coarse_values, ideals, k, cap, traffic,
                fit.coarsen(of_unit, coarse_values),
            )  # fmt: skip
            candidates.append((chosen[of_unit], f"order:{name}+windows"))
        for value, other, other_order, other_first, other_borders in tried:
            if not value <= cap or not (small or other_order is order):
                continue
            stages = _order_stages(units, other_order, other_borders)
            candidates.append((stages, f"order:{other}"))
            moved, cut = _order_fewest_bytes(
                units, other_order, other_first, _cut_bytes(other_order, values), k, cap, fit
            )
            if np.isfinite(moved):
                candidates.append((_order_stages(units, other_order, cut), f"order:{other}"))
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


def _windows_until_stable(
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
        coarse_fit = fit.coarsen(of_unit, _coarse_values(values, of_unit))
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
            first = _first_cut(units, order)
            best, borders = _order_best(units, order, first, k, fit)
            results.append((best, name, order, first, borders))
            if not np.isfinite(best):
                break
            stage = _order_stages(units, order, borders)
            refined = refine(units, stage, k, speeds=fit.speeds, fits=fits)
            if _bottleneck(units.weight, refined, k, fit.speeds) >= best:
                break
            position = {u: p for p, u in enumerate(order)}
            order = sorted(range(units.num_units), key=lambda u: (refined[u], position[u]))
    return results


def _order_stages(units: Units, order: list[int], borders: list[int]) -> np.ndarray:
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


def _first_cut(units: Units, order: list[int]) -> int:
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


def sent_bytes(values: list[Entering], unit_stage: np.ndarray, k: int, traffic: Traffic) -> float:
    """Bytes the stages of ``unit_stage`` send each other under ``traffic``."""
    total = 0.0
    for v in values:
        reading = {int(unit_stage[r]) for r in v.readers}
        if v.to_output:
            reading.add(k - 1)
        if v.producer == MODEL_INPUT:
            source = 0
        elif v.producer == FIRST_READER:
            source = min(reading)
        else:
            source = int(unit_stage[v.producer])
        if traffic == "relay":
            total += v.bytes * (max(reading) - source)
        else:
            total += v.bytes * len(reading - {source})
    return total


def _tie_break(total: float) -> float:
    """The per-stage ``cost**2`` weight that ranks splits sending the same bytes by their
    evenness and never outweighs one byte: the squares sum to at most ``total**2``."""
    return 0.25 / total**2 if total > 0 else 0.0


def _sum_of_squares(
    units: Units, unit_stage: np.ndarray, k: int, speeds: np.ndarray | None = None
) -> float:
    costs = np.bincount(unit_stage, weights=units.weight, minlength=k)
    if speeds is not None:
        costs = costs / speeds
    return float((costs**2).sum())


def _cap(best: float, slack: float) -> float:
    return best * (1.0 + max(slack, 0.0)) + 1e-9 * max(abs(best), 1.0)


def _bottleneck(
    weight: np.ndarray, unit_stage: np.ndarray, k: int, speeds: np.ndarray | None = None
) -> float:
    costs = np.bincount(unit_stage, weights=weight, minlength=k)
    return float((costs if speeds is None else costs / speeds).max())


def _moved(unit_stage: np.ndarray, move: tuple[float, int, int]) -> np.ndarray:
    """``unit_stage`` with one unit moved: ``move`` is (peak, unit, its new stage)."""
    out = unit_stage.copy()
    out[move[1]] = move[2]
    return out


def node_stages(g: nx.DiGraph, units: Units, unit_stage: np.ndarray, k: int) -> dict[str, int]:
    """Stage of every node of ``g`` from the stage of every unit."""
    stage_of: dict[str, int] = {}
    for n, op in g.nodes(data="op"):
        if n in units.unit_of:
            stage_of[n] = int(unit_stage[units.unit_of[n]])
        elif op == "placeholder":
            stage_of[n] = 0
        elif op == "output":
            stage_of[n] = k - 1
    for n, op in g.nodes(data="op"):
        if op == "get_attr":
            readers = [stage_of[v] for v in g.successors(n) if v in stage_of]
            stage_of[n] = min(readers, default=0)
    return stage_of
