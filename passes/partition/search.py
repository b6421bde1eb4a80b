"""Splits a cost graph into K balanced, convex stages; plans only, mutates nothing.

The search works on *units* (``units``; the modules named here are this package's), so
that non-tensor values and zero-cost naming nodes never become stage borders:

1. When the unit DAG has few enough ideals, the split is the exact optimum over every
   convex split (``exact``, on the ideal lattice of ``ideals``).
2. Otherwise several topological orders (fx order, breadth-first by depth, depth-first
   finishing each branch, seeded random ones) are each split exactly (``chain_dp``) and
   refined; the best bottleneck wins. Its borders are then re-placed exactly within
   windows around them (``windows``). Both steps are ``orders``.
3. Among splits whose bottleneck is within ``slack`` of the best, the one that sends the
   fewest bytes (``objective``) is kept, unless the best-bottleneck split sends no more.
   ``traffic`` says how the stage modules will move values: ``"direct"`` (the default
   codegen) sends a value once to every later stage that reads it;
   ``"relay"`` passes it through every border between its producer and its last reader.
   The exact searches (whole DAG, windows) minimise that traffic; the split of the best
   order minimises relay bytes (an upper bound of the direct traffic); the order path
   keeps whichever of the two sends less.
4. ``speed`` and ``memory`` (``fit``): stage j's time is its cost over the speed of its
   device, and every search above compares times. Under memory budgets
   the split found first is kept when every device holds its stages; otherwise the same
   searches run again with each stage's memory limit inside them (a stage over its limit
   is never a candidate) as ``budgeted`` says.

Placeholders go to stage 0, ``get_attr`` nodes to the first stage that reads them, and
the output node to the last stage. This module is the entry point and the driver that runs
either search under any :class:`fxpipe.passes.partition.fit.StageFit`.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

import networkx as nx
import numpy as np

from fxpipe.errors import PlanError
from fxpipe.ir import Traffic
from fxpipe.passes.partition.budgeted import Found, fit_budgets
from fxpipe.passes.partition.cost_graph import carries_value
from fxpipe.passes.partition.exact import fewest_bytes_on_ideals, search_on_ideals
from fxpipe.passes.partition.fit import StageFit, order_split
from fxpipe.passes.partition.ideals import enumerate_ideals, ideal_split, ideal_stages
from fxpipe.passes.partition.memory import FIRST_READER, MODEL_INPUT, Entering, MemoryModel
from fxpipe.passes.partition.objective import bottleneck_of, sent_bytes
from fxpipe.passes.partition.orders import (
    WINDOW_ROUNDS,
    candidate_orders,
    first_cut,
    order_stages,
    search_on_orders,
    windows_until_stable,
)
from fxpipe.passes.partition.units import Units, build_units
from fxpipe.passes.partition.windows import coarsen_near_borders, coarsen_values

__all__ = [
    "Partition",
    "partition_graph",
    "node_stages",
]

#: Largest ideal count the exact search takes on inside the partitioner.
EXACT_LIMIT = 1500
#: Largest ideal count of the coarse DAG on which the order search's borders are re-placed
#: exactly (:mod:`fxpipe.passes.partition.windows`); smaller than EXACT_LIMIT to keep that
#: step cheap.
WINDOW_LIMIT = 600


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
    together: Sequence[Collection[str]] = (),
) -> Partition:
    """Split ``g`` (from :func:`fxpipe.passes.partition.cost_graph.to_networkx`) into
    ``num_stages``.

    ``exact_limit`` caps the ideals of the whole-DAG exact search (0: order search only);
    ``window_limit`` those of the coarse DAG around the order search's borders (0: none).
    ``speed[j]``: the relative speed of stage j's device; a stage's time is its cost over
    it and the bottleneck is the largest time (None: all 1, times are costs). ``memory``:
    the budgets every device's stages must fit (MemoryPlanError, with the least memory any
    split needs, when none does). ``together``: groups of nodes no border may split (the
    regions tensor parallelism cuts), each kept in one stage."""
    started = time.perf_counter()
    units = build_units(g, together)
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
            best, pick = search_on_ideals(units, values, self.ideals, k, traffic, fit)
        else:
            best, pick = search_on_orders(
                self.g, units, values, k, traffic, self.window_limit, fit
            )
        if not np.isfinite(best):
            return None
        unit_stage, method = pick(_cap(best, self.slack))
        moved = sent_bytes(values, unit_stage, k, traffic)
        bottleneck = bottleneck_of(units.weight, unit_stage, k, fit.speeds)
        if self.slack > 0:  # the slack must buy fewer bytes: else keep the best bottleneck
            tight_stage, tight_method = pick(_cap(best, 0.0))
            tight_moved = sent_bytes(values, tight_stage, k, traffic)
            tighter = bottleneck_of(units.weight, tight_stage, k, fit.speeds)
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
                first_cut=first_cut(units, order),
                memory=fit.on_order(order),
                limits=fit.limits,
                objective="memory",
            )
            if np.isfinite(value) and (best is None or value < best[0]):
                best = (value, order_stages(units, order, borders))
        if best is None:
            return None
        value, split = best
        for _ in range(WINDOW_ROUNDS if self.window_limit > 0 else 0):
            window = coarsen_near_borders(units, split, k, self.window_limit)
            if window is None:
                break
            coarse, of_unit, ideals = window
            coarse_fit = fit.coarsen(of_unit, coarsen_values(self.values, of_unit))
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
                first_cut=first_cut(units, order),
                speeds=fit.speeds,
                memory=fit.on_order(order),
                limits=fit.limits,
                objective="summed",
                cap=cap,
                weights=weights,
            )
            if np.isfinite(value) and (best is None or value < best[0]):
                best = (value, order_stages(units, order, borders))
        return best

    def improve(self, unit_stage: np.ndarray, fit: StageFit) -> Found:
        """``unit_stage`` (which ``fit`` allows), its borders re-placed exactly within
        windows around them for a smaller bottleneck under ``fit``."""
        units, k = self.units, self.k
        start = bottleneck_of(units.weight, unit_stage, k, fit.speeds)
        if self.window_limit <= 0:
            return self.found(unit_stage, "least memory", fit)
        window, best = windows_until_stable(
            units, self.values, unit_stage, start, k, self.window_limit, fit
        )
        if window is None or not best < start:
            return self.found(unit_stage, "least memory", fit)
        coarse, of_unit, ideals = window
        coarse_values = coarsen_values(self.values, of_unit)
        chosen = fewest_bytes_on_ideals(
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
        bottleneck = bottleneck_of(self.units.weight, unit_stage, self.k, fit.speeds)
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


def _cap(best: float, slack: float) -> float:
    return best * (1.0 + max(slack, 0.0)) + 1e-9 * max(abs(best), 1.0)


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
