"""The configuration of a run chosen with its split: micro-batches and checkpointing per stage.

For each micro-batch count of :func:`chunk_counts` and each global checkpoint mode, the
planner (the caller's: price at that count, search the split under the memory budgets,
build the plan) gives a plan or a ``MemoryPlanError``; each plan's step is predicted
(:mod:`fxpipe.passes.configure.step_time`). Then, on the split of every global mode that
fits, each device picks the checkpoint modes of its stages that recompute least and still
fit its budget (:func:`least_recompute`): the first stages of a pipeline seldom need to
recompute when the last ones do. The fastest prediction that fits is kept; every one is
kept in the plan's table (:meth:`fxpipe.PipelinePlan.configurations`).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace

from fxpipe.errors import MemoryPlanError
from fxpipe.ir import (
    CHECKPOINT_MODES,
    LEAST_RECOMPUTATION_FIRST,
    CheckpointMode,
    Checkpoints,
    Configuration,
    ConfigurationTable,
    CostTable,
    PipelinePlan,
)
from fxpipe.passes.configure.step_time import (
    FORWARD_SHARE,
    overheads_for,
    predict_plan,
    stage_times,
)
from fxpipe.passes.partition.cost_graph import batched_nodes
from fxpipe.passes.partition.memory import checkpointed
from fxpipe.passes.split.plan import stage_memory

__all__ = [
    "Planner",
    "chunk_counts",
    "choose_configuration",
    "least_recompute",
    "mode_memory",
    "MAX_CHUNKS",
]

#: ``planner(chunks, checkpoint, stage_of)``: the plan of that configuration, its split
#: searched (``stage_of`` None) or kept (a node -> stage mapping); ``MemoryPlanError``
#: when it does not fit.
Planner = Callable[[int, Checkpoints, Mapping[str, int] | None], PipelinePlan]

#: The most micro-batches ``chunks="auto"`` tries.
MAX_CHUNKS = 32
#: Combinations of per-stage modes tried on one device at most (3 ** 6); beyond, stages
#: are relaxed one at a time.
MAX_COMBINATIONS = 729
_LEAST_FIRST = LEAST_RECOMPUTATION_FIRST


def chunk_counts(batch: int, stages: int, default: int) -> list[int]:
    """The micro-batch counts ``chunks="auto"`` weighs: powers of two up to
    :data:`MAX_CHUNKS`, the default (4 per stage), each at most the batch size."""
    counts = {1, default, *(2**e for e in range(MAX_CHUNKS.bit_length()))}
    return sorted({min(c, batch) for c in counts if c <= max(MAX_CHUNKS, default)})


def choose_configuration(
    planner: Planner,
    counts: Sequence[int],
    modes: Sequence[Checkpoints],
    *,
    timing: Callable[[int], CostTable | None] = lambda chunks: None,
    stages: int,
    per_stage: bool,
    searched: str,
) -> PipelinePlan:
    """The plan of the fastest predicted configuration that fits, among ``counts`` x
    ``modes`` (and, with ``per_stage``, the per-stage modes found on each split), with the
    table it was chosen from in ``weighed`` (``stages``: how many the plans have;
    ``timing(chunks)``: the node costs that time a step at that count, None for the plans'
    own); the ``MemoryPlanError`` of the configuration that needs the least memory when
    none fits."""
    rows: list[Configuration] = []
    plans: list[PipelinePlan | None] = []
    least: MemoryPlanError | None = None
    for chunks, mode in itertools.product(counts, modes):
        try:
            plan = planner(chunks, mode, None)
        except MemoryPlanError as e:
            least = e  # the last count and mode recompute most: the least memory
            rows.append(_refused(chunks, mode, stages, e))
            plans.append(None)
            continue
        rows.append(predict_plan(plan, timing(chunks)))
        plans.append(plan)
        if per_stage and plan.training:
            relaxed = least_recompute(plan, timing(chunks))
            if (chunks, relaxed) not in {(r.chunks, r.checkpoint) for r in rows}:
                try:  # fits by the same estimate; a refusal only leaves the row out
                    better = planner(chunks, relaxed, plan.stage_of)
                except MemoryPlanError:
                    continue
                rows.append(predict_plan(better, timing(chunks), kind="per stage"))
                plans.append(better)
    fitting = [i for i, r in enumerate(rows) if r.step is not None]
    if not fitting:
        assert least is not None
        raise least
    order = sorted(range(len(rows)), key=lambda i: _rank(rows[i]))
    best = order[0]
    table = ConfigurationTable(tuple(rows[i] for i in order), 0, searched)
    chosen = plans[best]
    assert chosen is not None
    return replace(chosen, weighed=table)


def _rank(row: Configuration) -> tuple[float, float, int]:
    """Fastest first; among equal predictions less recomputation, then fewer chunks; the
    configurations that do not fit last."""
    if row.step is None:
        return (float("inf"), 0.0, row.chunks)
    return (round(row.step, 12), row.recompute, row.chunks)


def _refused(chunks: int, mode: Checkpoints, k: int, error: MemoryPlanError) -> Configuration:
    modes = mode if isinstance(mode, tuple) else (mode,) * k
    first = str(error).split(":\n", 1)[-1].splitlines()
    reason = next((line.strip() for line in first if "needs" in line), str(error)[:120])
    return Configuration(chunks, modes, None, refused=reason)


def mode_memory(plan: PipelinePlan) -> dict[tuple[int, CheckpointMode], int]:
    """``(stage, mode) -> bytes``: each stage's estimated memory on ``plan``'s split under
    each checkpoint mode (at the plan's chunks, in its training or inference estimate)."""
    k, batched = plan.num_stages, batched_nodes(plan.graph_module)
    return {
        (j, mode): stage_memory(s, plan.costs, chunks=plan.chunks, checkpoint=mode,
                                last=j == k - 1, training=plan.training, batched=batched)
        for j, s in enumerate(plan.stages)
        for mode in CHECKPOINT_MODES
    }  # fmt: skip


def least_recompute(
    plan: PipelinePlan, costs: CostTable | None = None
) -> tuple[CheckpointMode, ...]:
    """Per stage, the checkpoint modes on ``plan``'s split that recompute least (predicted
    seconds, from ``costs`` or the plan's own, the runtime's cost per checkpointed cell
    included) while each device's stages fit its capacity; the plan's own modes where
    nothing better fits."""
    k = plan.num_stages
    stage_cost = stage_times(plan, costs).cost
    current = plan.checkpoint_modes
    overheads = overheads_for(plan.devices[0].type)
    m = plan.chunks
    memory = mode_memory(plan)

    def seconds(j: int, mode: CheckpointMode) -> float:
        again = stage_cost[j] * FORWARD_SHARE / max(m, 1) + overheads.checkpointed
        return checkpointed(m, mode, last=j == k - 1) * again

    chosen = list(current)
    groups: dict[str, list[int]] = {}
    for j, s in enumerate(plan.stages):
        groups.setdefault(str(s.device), []).append(j)
    for js in groups.values():
        limit = plan.capacities[js[0]] if plan.capacities else None
        table = {(j, mode): (memory[j, mode], seconds(j, mode)) for j in js
                 for mode in CHECKPOINT_MODES}  # fmt: skip
        chosen_here = _best_on_device(js, table, limit, [current[j] for j in js])
        for j, mode in zip(js, chosen_here, strict=True):
            chosen[j] = mode
    return tuple(chosen)


def _best_on_device(
    js: Sequence[int],
    table: Mapping[tuple[int, CheckpointMode], tuple[int, float]],
    limit: int | None,
    current: Sequence[CheckpointMode],
) -> list[CheckpointMode]:
    """The modes of one device's stages ``js`` with the least recomputation whose memory
    adds up to at most ``limit``: every combination where there are few, else stage by
    stage from ``current``, the stage whose relaxation saves the most seconds first."""

    def fits(modes: Sequence[CheckpointMode]) -> bool:
        return limit is None or sum(table[j, x][0] for j, x in zip(js, modes)) <= limit

    def cost(modes: Sequence[CheckpointMode]) -> tuple[float, int]:
        pairs = list(zip(js, modes))
        return (sum(table[p][1] for p in pairs), sum(table[p][0] for p in pairs))

    if len(CHECKPOINT_MODES) ** len(js) <= MAX_COMBINATIONS:
        options = [list(c) for c in itertools.product(_LEAST_FIRST, repeat=len(js)) if fits(c)]
        return min(options, key=cost) if options else list(current)
    modes = list(current)
    while True:
        moves = []
        for pos in range(len(js)):
            at = _LEAST_FIRST.index(modes[pos])
            for lighter in _LEAST_FIRST[:at]:
                trial = [*modes[:pos], lighter, *modes[pos + 1 :]]
                if fits(trial):
                    moves.append((cost(trial), trial))
        if not moves:
            return modes
        step = min(moves, key=lambda move: move[0])
        if step[0] >= cost(modes):
            return modes
        modes = step[1]
