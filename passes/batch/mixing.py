"""Refuses what mixes the batch's samples back into per-sample values: a value computed from a
reduction over the batch (``x - x.mean(0)``) or scaled by the batch size; a grouped product
reading the offsets of the rows it groups is not one (:mod:`fxpipe.passes.batch.grouping`)."""

from __future__ import annotations

import torch.fx as fx

from fxpipe.errors import PlanError
from fxpipe.passes.batch.grouping import RowGrouping, row_grouping
from fxpipe.passes.batch.losses import where
from fxpipe.passes.batch.roles import SHAPE_ONLY_OPS, BatchRoles
from fxpipe.passes.ops import op_name

__all__ = ["check_no_batch_mixing"]


def check_no_batch_mixing(gm: fx.GraphModule, roles: BatchRoles) -> RowGrouping:
    """PlanError where a per-sample value is computed from a reduction over the batch
    (``x - x.mean(0)``, ``h + x[0]``) or scaled by the batch size (``x / x.shape[0]``):
    each micro-batch would use its own, so the result would differ from the model's. A
    grouped product reading the offsets of the rows it groups is not such a value
    (:mod:`fxpipe.passes.batch.grouping`). Returns what the grouping analysis found: the ops
    along the batch's rows that mix it (a router's capacity over the whole batch), which
    micro-batches each compute on their own rows."""
    grouping = row_grouping(gm, roles)
    for node in gm.graph.nodes:
        if node.op in ("output", "placeholder", "get_attr") or roles.of(node) != "batched":
            continue
        if op_name(node) in SHAPE_ONLY_OPS or not roles.seen[node.name][0][0]:
            continue
        for arg in node.all_input_nodes:
            if node.name in grouping.grouped and arg.name in grouping.grouping:
                continue  # the offsets of the rows it groups: each row by its own key
            if roles.of(arg) == "reduced":
                raise PlanError(
                    f"{where(node)} computes per-sample values from {arg.name!r} "
                    f"({where(arg)}), which depends on the whole batch: each micro-batch "
                    "would use its own; compute it outside the model, or pass chunks=1 to "
                    "run whole batches"
                )
        if op_name(node) in _SCALING and _scaled_by_batch(node, roles):
            raise PlanError(
                f"{where(node)} scales per-sample values by the batch size: each "
                "micro-batch would use its own size; compute it outside the model, or pass "
                "chunks=1 to run whole batches"
            )
    return grouping


_SCALING = frozenset({"mul", "div", "true_divide", "truediv", "floordiv", "floor_divide"})


def _scaled_by_batch(node: fx.Node, roles: BatchRoles) -> bool:
    return any(
        not roles.seen[a.name][0][0] and roles.grows(a)
        for a in node.all_input_nodes
        if roles.of(a) == "batched"
    )
