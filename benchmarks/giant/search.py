"""fxpipe's budgeted search on a priced giant, timed alone, and bisection on the budget."""

from __future__ import annotations

import gc
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from benchmarks.giant.graph import Graph, Search, plan_of
from benchmarks.giant.settings import CHECKPOINT, CHUNKS, STAGES, TOLERANCE
from fxpipe.errors import MemoryPlanError
from fxpipe.ir import PipelinePlan
from fxpipe.passes.partition import budgeted
from fxpipe.passes.partition.memory import memory_model
from fxpipe.passes.partition.search import partition_graph


@dataclass(frozen=True)
class FxRun:
    search: Search
    plan: PipelinePlan | None


#: Seconds of each MemoryPlanError diagnosis made since the list was last emptied.
DIAGNOSES: list[float] = []


def time_diagnoses() -> None:
    """Time fxpipe's diagnosis of a refusal apart from the search before it: wraps
    ``budgeted._no_fit_error`` in this process (fxpipe itself is not changed)."""
    diagnose = budgeted._no_fit_error

    def timed(*args: Any, **kwargs: Any) -> MemoryPlanError:
        started = time.perf_counter()
        try:
            return diagnose(*args, **kwargs)
        finally:
            DIAGNOSES.append(time.perf_counter() - started)

    budgeted._no_fit_error = timed


def run_fxpipe(graph: Graph, budget: float, *, training: bool) -> FxRun:
    """fxpipe's split under ``budget`` bytes per device; the search alone is timed."""
    size = int(math.ceil(budget))
    budgets = [size] * STAGES
    memory = memory_model(
        graph.gm,
        graph.costs,
        graph.devices,
        budgets,
        chunks=CHUNKS,
        checkpoint=CHECKPOINT,
        training=training,
    )
    gc.collect()  # collect what earlier calls left, outside the timed search
    DIAGNOSES.clear()
    started, cpu = time.perf_counter(), time.process_time()
    try:
        part = partition_graph(graph.g, STAGES, memory=memory)
    except MemoryPlanError:
        part = None
    seconds, cpu = time.perf_counter() - started, time.process_time() - cpu
    search = Search(size, training, part is not None, seconds, cpu, sum(DIAGNOSES))
    graph.searches.append(search)
    if part is None:
        return FxRun(search, None)
    # raises MemoryPlanError if the estimate of the plan disagrees with the search's
    plan = plan_of(graph, part, training=training, capacity=budgets)
    check_memory(graph, plan.stage_of, [s.memory_bytes for s in plan.stages], training)
    return FxRun(search, plan)


def check_memory(
    graph: Graph, stage_of: Mapping[str, int], planned: Sequence[int], training: bool
) -> None:
    """The estimate computed here equals the plan's (bytes, up to int truncation)."""
    mine = graph.estimate.stage_bytes(stage_of, STAGES, training=training)
    if np.abs(mine - np.asarray(planned, dtype=np.float64)).max() > STAGES:
        raise AssertionError(f"{graph.name}: memory {mine} here, {list(planned)} in the plan")


def smallest_budget(
    fits: Callable[[float], bool], start: float, *, step: float, tolerance: float = TOLERANCE
) -> float:
    """The smallest budget at which ``fits`` holds, to a relative ``tolerance``, bracketed
    from ``start`` by factors of ``step`` (``fits`` is taken to be monotone)."""
    hi = start
    while not fits(hi):
        hi *= step
    lo = hi / step
    while fits(lo):
        hi, lo = lo, lo / step
    while hi - lo > tolerance * hi:
        mid = (lo + hi) / 2
        if fits(mid):
            hi = mid
        else:
            lo = mid
    return hi
