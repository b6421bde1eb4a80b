"""Pipeline x tensor parallel: the plan of the whole graph over a mesh's ``"tp"`` dimension
(every rank makes the same one), restricted to each of this rank's stages, whose local
programs torch's tensor parallelism then cuts.

The plan keeps every cut value inside its stage, so the ranks of one ``"tp"`` group hold the
same stage and send and receive whole activations, each over its own ``"pp"`` group (the
ranks of one ``"tp"`` coordinate): each ``"tp"`` coordinate runs one copy of the pipeline, the
stages' collectives joining the copies. With ``dp`` > 1 each pipeline replica is cut alike,
and its stages are then wrapped over ``"dp"`` (``mesh.py``: ``fully_shard`` or torch's
``replicate`` of the cut Parameters)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

import torch.fx as fx
from torch import nn

from fxpipe.compiler import Compiled
from fxpipe.distributed.planning.agreement import MeasuredCost
from fxpipe.ir import PipelinePlan
from fxpipe.passes.tensor.given import GivenPlan
from fxpipe.passes.tensor.local import local_program
from fxpipe.passes.tensor.parallelize import parallelize_program
from fxpipe.passes.tensor.plan import cut_regions, tensor_plan
from fxpipe.passes.tensor.records import TensorPlan
from fxpipe.passes.tensor.sequence import SequenceChoice

__all__ = ["plan_tensor_parallel", "rank_costs", "stage_plan", "parallelize_stages", "cut_dims"]

#: Seconds per unit of cost, for the cost units whose nodes' costs are times or work.
_SECONDS_PER = {"s": 1.0, "flop": None}


def rank_costs(
    compiled: Compiled,
    tp: int,
    given: GivenPlan | None = None,
    sequence_parallel: SequenceChoice = "auto",
) -> tuple[MeasuredCost | None, tuple[frozenset[str], ...]]:
    """Each node's cost on one of ``tp`` ranks, in seconds, as ``fd.suggest_layout`` prices
    it (:func:`fxpipe.distributed.planning.tensor_costs.tensor_costs`: a node the plan cuts costs
    ``1 / tp``, one it leaves whole all of it, and each collective its bytes over
    NVLink): the cost the stages are balanced by when tensor parallelism cuts them (None
    for costs in other units, parameter bytes or a cost function, which stay as they are);
    and the regions the plan of the whole graph cuts (:func:`cut_regions`), which the
    stages' borders are to keep whole."""
    from fxpipe.distributed.planning.layout import DEFAULT_DEVICE_FLOPS
    from fxpipe.distributed.planning.tensor_costs import DEFAULT_TP_BANDWIDTH, tensor_costs

    costs = compiled.plan.costs
    gm, values = compiled.plan.graph_module, compiled.traced.example_values
    seconds = _SECONDS_PER.get(costs.unit) or 1.0 / DEFAULT_DEVICE_FLOPS
    table, plan = tensor_costs(
        gm, values, costs, tp, bandwidth=DEFAULT_TP_BANDWIDTH, seconds=seconds, given=given,
        sequence_parallel=sequence_parallel,
    )  # fmt: skip
    regions = cut_regions(gm, plan)
    if costs.unit not in _SECONDS_PER:
        return None, regions
    return MeasuredCost({name: c.cost * seconds for name, c in table.nodes.items()}), regions


def plan_tensor_parallel(
    plan: PipelinePlan,
    values: Sequence[Any],
    tp: int,
    given: GivenPlan | None = None,
    sequence_parallel: SequenceChoice = "auto",
) -> TensorPlan:
    """The tensor-parallel plan of the pipeline's whole graph over ``tp`` ranks, no cut
    value crossing a stage border (``values``: one per placeholder, one micro-batch's);
    only the cuts ``given`` names, where the user gave a plan; values cut along the
    sequence as ``sequence_parallel`` says (gathered whole at a stage's output)."""
    return tensor_plan(
        plan.graph_module, tp, values, stage_of=plan.stage_of, given=given,
        sequence_parallel=sequence_parallel,
    )  # fmt: skip


def stage_plan(plan: TensorPlan, gm: fx.GraphModule) -> TensorPlan:
    """``plan`` for one stage's GraphModule: the cuts of its own nodes (not of its inputs,
    which are named after the values another stage computed: a row-wise product's output
    sent on is whole, but the product's style is its own stage's)."""
    names = {n.name for n in gm.graph.nodes if n.op != "placeholder"}

    def mine(table: Mapping[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in table.items() if k in names}

    reads = {v: tuple(r for r in rs if r in names) for v, rs in plan.partial_reads.items()}

    return replace(
        plan,
        layouts=mine(plan.layouts),
        node_styles=mine(plan.node_styles),
        node_weights=mine(plan.node_weights),
        replicated=mine(plan.replicated),
        sequence=mine(plan.sequence),
        sequence_gathers=mine(plan.sequence_gathers),
        unflattened=mine(plan.unflattened),
        partial_reads={v: rs for v, rs in reads.items() if rs},
        partial_modules=mine(plan.partial_modules),
    )


def cut_dims(plan: TensorPlan) -> dict[str, tuple[int, int]]:
    """Parameter name -> (the dimension the plan cuts it along, the ranks it is cut over),
    for every Parameter it cuts."""
    return {name: (p.shard.dim, plan.tp) for name, p in plan.params.items() if p.shard is not None}


def parallelize_stages(
    modules: Mapping[int, fx.GraphModule], plan: TensorPlan, tp_mesh: Any
) -> tuple[dict[int, fx.GraphModule], dict[int, nn.Parameter]]:
    """Each stage's local program, cut over ``tp_mesh``; and the id of every Parameter of
    the model they cut -> the DTensor Parameter in its place (for the rank's ownership)."""
    programs: dict[int, fx.GraphModule] = {}
    placed: dict[int, nn.Parameter] = {}
    for j, gm in modules.items():
        local = local_program(gm, stage_plan(plan, gm))
        for old, new in parallelize_program(local, tp_mesh).items():
            if old in placed:  # a weight two of this rank's stages read: one DTensor
                _hold(local, new, placed[old])
            else:
                placed[old] = new
        programs[j] = local
    return programs, placed


def _hold(local: nn.Module, new: nn.Parameter, kept: nn.Parameter) -> None:
    """Every module of ``local`` holding ``new`` holds ``kept`` instead (cut alike)."""
    if new.placements != kept.placements:  # type: ignore[attr-defined]
        raise AssertionError("one weight cut two ways by two stages of a rank")
    for m in local.modules():
        for name, p in list(m.named_parameters(recurse=False)):
            if p is new:
                m.register_parameter(name, kept)
