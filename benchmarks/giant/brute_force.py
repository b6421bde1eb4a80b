"""Every split of a giant into 4 runs cut at decoder-block boundaries, priced from interval
tables built apart from fxpipe's search, and checked against ``build_plan``."""

from __future__ import annotations

import itertools
import math
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from benchmarks.giant.graph import Graph, coefficients, plan_of
from benchmarks.giant.search import check_memory
from benchmarks.giant.settings import STAGES
from fxpipe.passes.ops import COMPUTE_OPS, is_check, module_path
from fxpipe.passes.partition.memory import param_copies, whole_coef
from fxpipe.passes.partition.search import Partition, node_stages


@dataclass(frozen=True)
class BlockSplits:
    """Every split into 4 contiguous runs of the unit order cut at block boundaries."""

    #: Candidate cut positions in the unit order, with 0 first and the unit count last.
    bounds: np.ndarray
    #: (splits, 5) indices into ``bounds``: 0, three cuts, len(bounds) - 1.
    index: np.ndarray
    bottleneck: np.ndarray
    #: Largest stage memory of each split, inference (False) and training (True).
    memory: dict[bool, np.ndarray]
    seconds: float

    def floor(self, training: bool) -> float:
        return float(self.memory[training].min())

    def best(self, budget: float, *, training: bool = False) -> int | None:
        """The split with the smallest bottleneck that fits ``budget``; None if none does."""
        fits = self.memory[training] <= budget
        if not fits.any():
            return None
        candidates = np.flatnonzero(fits)
        return int(candidates[np.argmin(self.bottleneck[candidates])])

    def unit_stage(self, i: int, num_units: int) -> np.ndarray:
        cuts = self.bounds[self.index[i]]
        out = np.empty(num_units, dtype=np.int64)
        for j in range(STAGES):
            out[cuts[j] : cuts[j + 1]] = j
        return out


def block_bounds(graph: Graph) -> np.ndarray:
    """0, the first unit of each decoder block, the unit after the last block, the unit
    count: where a block-boundary split may cut the unit order."""
    pattern = re.compile(re.escape(graph.giant.blocks) + r"\.(\d+)(\.|$)")
    first: dict[int, int] = {}
    last: dict[int, int] = {}
    by_name = {n.name: n for n in graph.gm.graph.nodes}
    for u, members in enumerate(graph.units.members):
        for name in members:
            if is_check(by_name[name]):  # an assertion sits with what it checks
                continue
            match = pattern.match(module_path(by_name[name]))
            if match:
                b = int(match.group(1))
                first.setdefault(b, u)
                last[b] = u
    blocks = sorted(first)
    if blocks != list(range(len(blocks))):
        raise AssertionError(f"{graph.name}: blocks {blocks} are not 0..N-1")
    for b in blocks[1:]:
        if first[b] <= last[b - 1]:
            raise AssertionError(f"{graph.name}: block {b} starts inside block {b - 1}")
    count = graph.units.num_units
    cuts = [first[b] for b in blocks] + [last[blocks[-1]] + 1]
    if not (0 < cuts[0] and cuts[-1] < count):
        raise AssertionError(f"{graph.name}: nothing before the first block or after the last")
    if graph.units.pinned_first and max(graph.units.pinned_first) >= cuts[0]:
        raise AssertionError(f"{graph.name}: units pinned to stage 0 inside the blocks")
    return np.array([0, *cuts, count], dtype=np.int64)


def node_positions(graph: Graph) -> dict[str, int]:
    """Each node's place in the unit order, as fxpipe assigns stages on a contiguous split:
    a compute node at its unit; a ``get_attr`` at its first reader (the last unit when only
    the output reads it); a placeholder at 0 (the first stage); the output at the end."""
    unit_of = graph.units.unit_of
    end = graph.units.num_units - 1
    out: dict[str, int] = {}
    for node in graph.gm.graph.nodes:
        if node.op in COMPUTE_OPS:
            out[node.name] = unit_of[node.name]
        elif node.op == "get_attr":
            readers = [unit_of[u.name] for u in node.users if u.name in unit_of]
            out[node.name] = min(readers) if readers else (end if node.users else 0)
        elif node.op == "placeholder":
            out[node.name] = 0
        else:
            out[node.name] = end
    return out


def _within(positions: Sequence[int], bounds: np.ndarray) -> np.ndarray:
    """``[a, b]``: whether any of ``positions`` lies in ``[bounds[a], bounds[b])``."""
    x = np.append(np.sort(np.asarray(positions, dtype=np.float64)), np.inf)
    after = x[np.searchsorted(x[:-1], bounds, side="left")]
    return np.asarray(after[:, None] < bounds[None, :])


def interval_tables(graph: Graph, bounds: np.ndarray) -> dict[str, np.ndarray]:
    """``[a, b]``: cost, parameter, kept and received bytes of the stage of units
    ``[bounds[a], bounds[b])`` of a contiguous split (the stage holds a parameter when one
    of its holders is in it, and receives a value made before it and read in it)."""
    pos = node_positions(graph)
    size = len(bounds)
    count = graph.units.num_units

    def prefix(weights: Mapping[str, float]) -> np.ndarray:
        per_unit = np.zeros(count + 1)
        for n, w in weights.items():
            per_unit[pos[n] + 1] += w
        total = np.cumsum(per_unit)[bounds]
        return np.asarray(total[None, :] - total[:, None])

    cost = prefix({n: c.cost for n, c in graph.costs.nodes.items()})
    saved = prefix({n: float(b) for n, b in graph.estimate.saved.items()})
    params = np.zeros((size, size))
    for nbytes, names in graph.estimate.params:
        params += nbytes * _within([pos[n] for n in names], bounds)
    received, whole = np.zeros((size, size)), np.zeros((size, size))
    for n, nbytes, users, cut in graph.estimate.values:
        if nbytes and users:
            made_before = (pos[n] < bounds)[:, None]
            table = received if cut else whole
            table += nbytes * (_within([pos[u] for u in users], bounds) & made_before)
    return {"cost": cost, "params": params, "saved": saved, "received": received, "whole": whole}


def brute_force(graph: Graph) -> BlockSplits:
    started = time.perf_counter()
    bounds = block_bounds(graph)
    tables = interval_tables(graph, bounds)
    last = len(bounds) - 1
    cuts = np.array(list(itertools.combinations(range(1, last), STAGES - 1)), dtype=np.int64)
    count = len(cuts)
    index = np.column_stack([np.zeros(count, np.int64), cuts, np.full(count, last)])
    starts, stops = index[:, :-1], index[:, 1:]
    bottleneck = tables["cost"][starts, stops].max(axis=1)
    memory = {}
    for training in (False, True):
        coef = coefficients(STAGES, training)
        stage = (
            param_copies(training) * tables["params"][starts, stops]
            + coef[None, :, 0] * tables["saved"][starts, stops]
            + coef[None, :, 1] * tables["received"][starts, stops]
            + whole_coef(training) * tables["whole"][starts, stops]
        )
        memory[training] = stage.max(axis=1)
    seconds = time.perf_counter() - started
    return BlockSplits(bounds, index, bottleneck, memory, seconds)


def check_brute_force(graph: Graph, splits: BlockSplits, picks: Sequence[int]) -> int:
    """The brute force's memory and bottleneck of the splits ``picks`` against the plan
    ``build_plan`` makes of each; returns how many were checked."""
    for i in picks:
        unit_stage = splits.unit_stage(i, graph.units.num_units)
        stage_of = node_stages(graph.g, graph.units, unit_stage, STAGES)
        part = Partition(stage_of, float(splits.bottleneck[i]), "block boundaries", 0.0)
        for training in (False, True):
            plan = plan_of(graph, part, training=training)
            planned = max(s.memory_bytes for s in plan.stages)
            if abs(planned - splits.memory[training][i]) > STAGES:
                raise AssertionError(
                    f"{graph.name}: split {i} needs {planned} bytes in the plan, "
                    f"{splits.memory[training][i]:.0f} in the brute force (training={training})"
                )
            if not math.isclose(plan.bottleneck, splits.bottleneck[i], rel_tol=1e-9):
                raise AssertionError(f"{graph.name}: split {i} bottleneck differs from the plan's")
            check_memory(graph, stage_of, [s.memory_bytes for s in plan.stages], training)
    return len(picks)
