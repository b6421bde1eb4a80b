"""A PipelinePlan from a partition: stage records, boundary edges, memory estimates, module spans.

Training memory of a stage (GPipe, activations re-materialised when checkpointing):

- parameters x ``bytes_per_param_copy`` (weights, gradients and two Adam moments: 4x);
- checkpointed micro-batches keep only their stage inputs; the micro-batches that are not
  checkpointed keep every activation the stage saves for backward; the one being
  recomputed adds its activations once more.
"""

from __future__ import annotations

from collections.abc import Container, Sequence
from dataclasses import replace

import networkx as nx
import torch
import torch.fx as fx

from fxpipe.errors import MemoryPlanError
from fxpipe.ir import BoundaryEdge, CheckpointMode, Checkpoints, CostTable, PipelinePlan, StagePlan
from fxpipe.passes.ops import held_parameters, module_path
from fxpipe.passes.partition.cost_graph import batched_nodes, replicated_attrs
from fxpipe.passes.partition.memory import (
    ESTIMATE,
    PARAM_COPIES,
    memory_terms,
    param_copies,
    whole_coef,
)
from fxpipe.passes.partition.search import Partition

__all__ = [
    "build_plan",
    "stage_memory",
    "stage_modes",
    "stage_parameters",
    "training_overflow",
    "PARAM_COPIES",
]


def build_plan(
    gm: fx.GraphModule,
    costs: CostTable,
    g: nx.DiGraph,
    partition: Partition,
    devices: Sequence[torch.device],
    *,
    chunks: int,
    checkpoint: Checkpoints = "except_last",
    capacity: Sequence[int | None] | None = None,
    speeds: Sequence[float] | None = None,
    training: bool = True,
) -> PipelinePlan:
    """The plan of ``partition``; raises MemoryPlanError when a stage cannot fit its device
    (``capacity[j]`` bytes; ``None`` means unknown and is not checked). ``speeds[j]``: the
    relative speed of ``devices[j]``; a stage's cost is its nodes' cost divided by it.
    ``checkpoint``: one mode for every stage or one per stage. ``training``: estimate
    training memory (else inference: weights once, one micro-batch)."""
    k = len(devices)
    modes = stage_modes(checkpoint, k)
    speed = [1.0] * k if speeds is None else [float(v) for v in speeds]
    stage_of = partition.stage_of
    names = [n.name for n in gm.graph.nodes]
    batched = batched_nodes(gm)
    shared = replicated_attrs(gm)
    edges = _edges(gm, costs, stage_of, relay=partition.traffic == "relay")
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    returned = {a.name for a in output.all_input_nodes}
    stages = []
    for j in range(k):
        nodes = tuple(n for n in names if stage_of[n] == j)
        inputs = tuple(e.value for e in edges if j in e.consumers)
        sent = {e.value for e in edges if e.producer == j}
        outputs = tuple(n for n in nodes if n in sent or n in returned)
        stage = StagePlan(
            index=j,
            device=devices[j],
            nodes=nodes,
            cost=_stage_cost(costs, nodes, speed[j]),
            param_bytes=_param_bytes(gm, nodes, shared),
            memory_bytes=0,
            inputs=inputs,
            outputs=outputs,
            span=_span(gm, nodes),
        )
        memory = stage_memory(
            stage, costs, chunks=chunks, checkpoint=modes[j], last=j == k - 1,
            training=training, batched=batched,
        )  # fmt: skip
        stages.append(_with_memory(stage, memory))
    if capacity is not None:
        _check_fits(stages, capacity, chunks, training, checkpoint)
    node_cost = {n: costs.nodes[n].cost for n in names}
    total = sum(node_cost.values())
    if speeds is None:
        lower = max(total / k, max(node_cost.values(), default=0.0))
    else:  # all devices busy the whole time; the largest node on the fastest device
        lower = max(total / sum(speed), max(node_cost.values(), default=0.0) / max(speed))
    info = {"method": partition.method, "border_bytes": partition.border_bytes, **partition.info}
    return PipelinePlan(
        graph_module=gm,
        devices=tuple(devices),
        stage_of=dict(stage_of),
        node_cost=node_cost,
        stages=tuple(stages),
        edges=tuple(edges),
        bottleneck=max(s.cost for s in stages),
        lower_bound=lower,
        costs=costs,
        chunks=chunks,
        capacities=tuple(capacity) if capacity is not None else (None,) * k,
        info=info,
        speeds=() if speeds is None else tuple(speed),
        training=training,
        checkpoints=modes,
    )


def stage_modes(checkpoint: Checkpoints, k: int) -> tuple[CheckpointMode, ...]:
    """One checkpoint mode per stage of ``k``: the one mode repeated, or the ``k`` given."""
    if isinstance(checkpoint, str):
        return (checkpoint,) * k
    if len(checkpoint) != k:
        raise AssertionError(f"{len(checkpoint)} checkpoint modes for {k} stages")
    return tuple(checkpoint)


def _stage_cost(costs: CostTable, nodes: tuple[str, ...], speed: float) -> float:
    cost = sum(costs.nodes[n].cost for n in nodes)
    return cost if speed == 1.0 else cost / speed


def _edges(
    gm: fx.GraphModule, costs: CostTable, stage_of: dict[str, int], *, relay: bool
) -> list[BoundaryEdge]:
    """Values sent between stages; model outputs go through the last stage only in relay
    mode (direct: the stage that makes an output returns it). A ``get_attr`` of a
    non-tensor object (a higher-order op's body) is named by each stage that reads it and
    is never sent (:func:`fxpipe.passes.partition.cost_graph.replicated_attrs`)."""
    out = []
    shared = replicated_attrs(gm)
    for node in gm.graph.nodes:
        if node.name in shared:
            continue
        j = stage_of[node.name]
        users = [u for u in node.users if relay or u.op != "output"]
        readers = sorted({stage_of[u.name] for u in users} - {j})
        if node.op == "output" or not readers:
            continue
        if any(r < j for r in readers):
            raise AssertionError(f"value {node.name} of stage {j} is read by an earlier stage")
        out.append(BoundaryEdge(node.name, j, tuple(readers), costs.nodes[node.name].output_bytes))
    return out


def _param_bytes(gm: fx.GraphModule, nodes: tuple[str, ...], shared: frozenset[str]) -> int:
    """Bytes of the parameters the stage holds (:func:`stage_parameters`)."""
    return sum(p.numel() * p.element_size() for p in stage_parameters(gm, nodes, shared))


def stage_parameters(
    gm: fx.GraphModule, nodes: Sequence[str], shared: Container[str]
) -> list[torch.nn.Parameter]:
    """The parameters a stage of ``nodes`` holds, each once: its nodes', and those of the
    replicated attributes (``shared``) its nodes read, which each reading stage holds."""
    seen: set[int] = set()
    out = []
    by_name = {n.name: n for n in gm.graph.nodes}
    read = {a.name for n in nodes for a in by_name[n].all_input_nodes if a.name in shared}
    for name in [*nodes, *sorted(read - set(nodes))]:
        for p in held_parameters(gm, by_name[name]):
            if id(p) not in seen:
                seen.add(id(p))
                out.append(p)
    return out


def stage_memory(
    stage: StagePlan,
    costs: CostTable,
    *,
    chunks: int,
    checkpoint: str,
    last: bool,
    training: bool = True,
    batched: Container[str] | None = None,
) -> int:
    """Estimated bytes a stage holds at its peak in one training step (or, with
    ``training=False``, one inference call: weights once, one micro-batch in flight).
    ``batched``: the names of the values cut with the batch (None: all of them)."""
    saved = sum(costs.nodes[n].saved_bytes for n in stage.nodes)
    # a value not cut with the batch (a weight sent on) arrives whole, once per step
    whole = [v for v in stage.inputs if batched is not None and v not in batched]
    inputs = sum(costs.nodes[v].output_bytes for v in stage.inputs if v not in whole)
    fixed = whole_coef(training) * sum(costs.nodes[v].output_bytes for v in whole)
    saved_coef, input_coef = memory_terms(chunks, checkpoint, last=last, training=training)
    activations = saved_coef * saved + input_coef * inputs + fixed
    return int(param_copies(training) * stage.param_bytes + activations)


def training_overflow(
    plan: PipelinePlan, *, chunks: int, checkpoint: Checkpoints
) -> dict[str, tuple[int, int]]:
    """Device -> (bytes its stages need in training, its capacity), for each device the
    plan's stages would not fit in training (empty when they fit or nothing is known)."""
    k = plan.num_stages
    batched = batched_nodes(plan.graph_module)
    modes = stage_modes(checkpoint, k)
    memory = [
        stage_memory(
            s, plan.costs, chunks=chunks, checkpoint=modes[s.index], last=s.index == k - 1,
            batched=batched,
        )
        for s in plan.stages
    ]  # fmt: skip
    return _overflow(plan.stages, memory, plan.capacities or (None,) * k)


def _overflow(
    stages: Sequence[StagePlan], memory: Sequence[int], capacity: Sequence[int | None]
) -> dict[str, tuple[int, int]]:
    """Device -> (the summed ``memory`` of its stages, its capacity), for each device whose
    stages need more than it has (stages that share a device share its memory)."""
    need: dict[str, int] = {}
    have: dict[str, int] = {}
    for s, used in zip(stages, memory, strict=True):
        limit = capacity[s.index]
        if limit is not None:
            key = str(s.device)
            need[key] = need.get(key, 0) + used
            have[key] = limit
    return {d: (n, have[d]) for d, n in need.items() if n > have[d]}


def _with_memory(stage: StagePlan, memory: int) -> StagePlan:
    return replace(stage, memory_bytes=memory)


def _check_fits(
    stages: list[StagePlan],
    capacity: Sequence[int | None],
    chunks: int,
    training: bool,
    checkpoint: Checkpoints,
) -> None:
    """Stages that share a device share its memory: check each device's total."""
    over = _overflow(stages, [s.memory_bytes for s in stages], capacity)
    if not over:
        return
    rows = "\n".join(
        f"  {d}: needs ~{n / 2**30:.2f} GiB for stages "
        f"{[s.index for s in stages if str(s.device) == d]} of {cap / 2**30:.2f} GiB"
        for d, (n, cap) in over.items()
    )
    if training:
        remedy = "add devices, use checkpoint='always', more chunks, or a smaller batch"
    else:
        remedy = "add devices, more chunks, or a smaller batch"
    raise MemoryPlanError(
        f"the plan does not fit in device memory with chunks={chunks}, "
        f"checkpoint={checkpoint!r} ({ESTIMATE[training]}):"
        f"\n{rows}\nremedy: {remedy}"
    )


def _span(gm: fx.GraphModule, names: tuple[str, ...]) -> tuple[str, str]:
    """The first and last module paths ``names`` cover (node names where they have none)."""
    nodes = {n.name: n for n in gm.graph.nodes}
    work = [nodes[n] for n in names if nodes[n].op not in ("placeholder", "output")]
    paths = [p for p in (module_path(n) for n in work) if p]
    if paths:
        return paths[0], paths[-1]
    if work:
        return work[0].name, work[-1].name
    return "-", "-"
