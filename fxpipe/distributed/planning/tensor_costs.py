"""What tensor parallelism over ``tp`` ranks does to a priced model, for ranking
``(pp, dp, tp)`` layouts: each node's cost, saved activations and parameters divided by
``tp`` where the plan cuts them, and the collectives the plan adds priced into the nodes
that wait for them.

The plan is :func:`fxpipe.passes.tensor.plan.tensor_plan` of the whole graph (what
``fd.pipeline_schedule(tensor_parallel="auto")`` runs, planned per pipeline). A node whose
output the plan cuts (a column-wise product, attention on its share of the heads, the
element-wise work between) computes ``1 / tp`` of it on each rank and keeps ``1 / tp`` of
its activations; a parameter the plan cuts is ``1 / tp`` on each rank, with its gradients
and optimizer state; everything else is whole on every rank, computed ``tp`` times. Each
row-wise product waits for a ring all-reduce of its output, ``2 (tp - 1) / tp`` of its bytes
over ``tp_bandwidth``, in the forward, and the column-wise products that feed it for one
of their input's gradient in the backward (Megatron-LM's f and g; the same size in a
transformer block, counted as the row-wise output's); a vocabulary-parallel embedding waits
for the all-reduce of its lookups (forward only), an LM head cut by vocabulary for the
all-gather of its logits, ``(tp - 1) / tp`` of their bytes, and the all-reduce of its input's
gradient. Under sequence parallelism (``plan.sequence``) the norms, adds and dropouts
between a row-wise product and the next column-wise ones compute ``1 / tp`` of the tokens and
keep ``1 / tp`` of their activations; a row-wise product then waits for a reduce-scatter
forward and an all-gather backward, and each value gathered from the region for an
all-gather forward and a reduce-scatter backward (together the all-reduces they replace).
The collectives are not overlapped with compute, as torch's tensor-parallel styles run them.
"""

from __future__ import annotations

from dataclasses import replace
from operator import attrgetter

import torch
import torch.fx as fx

from fxpipe.ir import CostTable, NodeCost
from fxpipe.passes.tensor.given import GivenPlan
from fxpipe.passes.tensor.plan import tensor_plan
from fxpipe.passes.tensor.records import TensorPlan
from fxpipe.passes.tensor.sequence import SequenceChoice

__all__ = ["DEFAULT_TP_BANDWIDTH", "tensor_costs"]

#: Bytes/s one GPU moves to its node's others: an A100's NVLink, 600 GB/s both ways in all
#: (300 GB/s each way), as in the DGX A100 nodes the layout defaults describe.
DEFAULT_TP_BANDWIDTH = 300e9


def tensor_costs(
    gm: fx.GraphModule,
    example_values: tuple[object, ...],
    costs: CostTable,
    tp: int,
    *,
    bandwidth: float,
    seconds: float,
    given: GivenPlan | None = None,
    sequence_parallel: SequenceChoice = "auto",
) -> tuple[CostTable, TensorPlan]:
    """``costs`` as one of ``tp`` ranks runs ``gm`` under its tensor-parallel plan (the one
    fxpipe finds, or the cuts ``given`` names), and the plan. ``seconds``: seconds per unit
    of cost (a collective's seconds are added in the table's unit)."""
    plan = tensor_plan(gm, tp, example_values, given=given, sequence_parallel=sequence_parallel)
    if tp == 1:
        return costs, plan
    ring = 2 * (tp - 1) / tp
    nodes = {n.name: n for n in gm.graph.nodes}
    held = _param_bytes(gm, plan, nodes)
    table: dict[str, NodeCost] = {}
    for name, c in costs.nodes.items():
        cut = name in plan.layouts or name in plan.node_styles or name in plan.sequence
        cost = c.cost / tp if cut else c.cost
        style = plan.node_styles.get(name)
        waited = 0.0  # bytes of collectives this node waits for, forward and backward
        if name in plan.sequence_gathers:  # all-gathered, its gradient reduce-scattered
            waited += ring * c.output_bytes
        if style == "rowwise":  # and the region it starts gathered too, where it is read whole
            waited += (1 if name in plan.sequence else 2) * ring * c.output_bytes
        elif style == "vocab":
            waited += ring * c.output_bytes
        elif style == "gathered":
            inputs = nodes[name].all_input_nodes
            grad = costs.nodes[inputs[0].name].output_bytes if inputs else 0
            waited = (tp - 1) / tp * c.output_bytes + ring * grad
        table[name] = replace(
            c,
            cost=cost + waited / bandwidth / seconds,
            param_bytes=held.get(name, c.param_bytes),
            saved_bytes=c.saved_bytes // tp if cut else c.saved_bytes,
        )
    return replace(costs, nodes=table), plan


def _param_bytes(
    gm: fx.GraphModule, plan: TensorPlan, nodes: dict[str, fx.Node]
) -> dict[str, int]:
    """Node name -> bytes of the parameters it owns (a module) or fetches on one rank, for
    the nodes that hold a parameter the plan cuts."""
    out: dict[str, int] = {}
    for name, node in nodes.items():
        if node.op == "get_attr":
            names = [str(node.target)]
        elif node.op == "call_module":
            prefix = str(node.target)
            module = gm.get_submodule(prefix)
            names = [f"{prefix}.{p}" for p, _ in module.named_parameters(recurse=False)]
        else:
            continue
        if not any(plan.params.get(p) is not None and plan.params[p].shard for p in names):
            continue
        total = 0
        for p in names:
            value = attrgetter(p)(gm)
            if not isinstance(value, torch.Tensor):
                continue
            size = value.numel() * value.element_size()
            shard = plan.params.get(p)
            total += size // plan.tp if shard is not None and shard.shard is not None else size
        out[name] = total
    return out
