"""What ``pipeline_schedule`` communicates while it builds: the node costs group rank 0
measured, broadcast to every rank (``cost="time"``), and the one all-gather that checks that
every rank planned alike."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx

from fxpipe.compiler import Compiled
from fxpipe.distributed.parallel.mesh import comm_device
from fxpipe.errors import FxPipeError
from fxpipe.ir import PRICING_MODES, PipelinePlan, StageProgram

__all__ = ["MeasuredCost", "measured_costs", "check_agreement"]


def measured_costs(
    profile: Callable[[], Compiled], group: dist.ProcessGroup | None, device: torch.device
) -> MeasuredCost:
    """``cost="time"`` across processes: group rank 0 profiles every node once (``profile``)
    and broadcasts the table; every rank, rank 0 too, then plans with that one table as a
    callable cost, so the plans agree by construction. When rank 0 fails, every rank
    raises (rank 0 its own error), instead of the others waiting for it."""
    box: list[Any] = [None]
    failure: Exception | None = None
    if dist.get_rank(group) == 0:
        try:
            box[0] = dict(profile().plan.node_cost)
        except Exception as e:
            failure, box[0] = e, f"{type(e).__name__}: {e}"
    src = 0 if group is None else dist.get_global_rank(group, 0)
    dist.broadcast_object_list(box, src=src, group=group, device=comm_device(group, device))
    if failure is not None:
        raise failure
    if not isinstance(box[0], dict):
        raise FxPipeError(
            f"group rank 0 could not profile the model for cost='time': {box[0]}; fix the "
            "error rank 0 reports, or pass cost='flops'"
        )
    return MeasuredCost(box[0])


class MeasuredCost:
    """``(node) -> float``: the cost group rank 0 measured for the node of that name. A name
    rank 0 did not price costs 0: that rank traced another graph, which the agreement
    check then reports on every rank."""

    def __init__(self, table: dict[str, float]) -> None:
        self.table = table

    def __call__(self, node: fx.Node) -> float:
        return float(self.table.get(node.name, 0.0))


def check_agreement(
    plan: PipelinePlan,
    program: StageProgram,
    config: Any,
    group: dist.ProcessGroup | None,
    device: torch.device,
) -> None:
    """All-gather digests of the plan and of the options; FxPipeError on every rank when a
    rank differs from rank 0."""
    split = repr((sorted(plan.stage_of.items()), program.inputs, program.outputs))
    comm = comm_device(group, device)
    mine = torch.tensor([_digest(split), _digest(repr(config))], dtype=torch.int64, device=comm)
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(everyone, mine, group=group)
    for index, what in enumerate(("plan (stage of every node)", "options or example shapes")):
        odd = [r for r, d in enumerate(everyone) if int(d[index]) != int(everyone[0][index])]
        if odd:
            raise FxPipeError(
                f"rank(s) {odd} computed a different {what} than rank 0; call "
                "pipeline_schedule on every rank with the same model (same construction and "
                "seed), the same example and the same options, with a cost that is the same "
                f"on every rank (one of {PRICING_MODES} or a deterministic callable)"
            )


def _digest(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little", signed=True)
