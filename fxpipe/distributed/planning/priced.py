"""A model traced and priced once for layout planning (:class:`Priced`), and its plan of
``k`` stages with what each stage costs, holds and receives (:class:`Split`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from operator import attrgetter
from typing import Any

import networkx as nx
import torch
from torch import nn

from fxpipe.compiler import traced_example
from fxpipe.errors import PlanError
from fxpipe.ir import CheckpointMode, CostTable, PipelinePlan, PricingMode, TracerName
from fxpipe.model_state import preserved
from fxpipe.passes.partition.cost_graph import (
    replicate_shared_weights,
    replicated_attrs,
    to_networkx,
)
from fxpipe.passes.partition.search import partition_graph
from fxpipe.passes.price.estimate import estimate_costs
from fxpipe.passes.price.roofline import step_roofline_for
from fxpipe.passes.split.plan import build_plan, stage_parameters
from fxpipe.trace.tracing import Traced, fake_runnable

__all__ = ["Priced", "Split", "priced_model", "stage_split"]


@dataclass(frozen=True)
class Priced:
    """The model traced and priced once, for the whole global batch."""

    traced: Traced
    costs: CostTable
    graph: nx.DiGraph
    batch: int
    #: Seconds per unit of cost (1 / device_flops for FLOP, 1 for seconds).
    seconds: float
    #: Node name -> cost paid once per micro-batch whatever its size (roofline only).
    fixed: Mapping[str, float]
    #: How it was priced, and the tracer asked for.
    mode: PricingMode
    tracer: TracerName


@dataclass(frozen=True)
class Split:
    """One stage count: the plan, and what each stage costs, holds and receives."""

    plan: PipelinePlan
    #: Per stage: cost proportional to the rows, and cost per micro-batch, in seconds.
    scaled_s: tuple[float, ...]
    fixed_s: tuple[float, ...]
    #: Per stage: bytes entering it (relayed values, gradients back included), whole batch.
    received: tuple[int, ...]
    #: Per stage: the ids of the Parameters it holds (a tied weight: in every reading stage).
    params: tuple[frozenset[int], ...]
    #: Bytes of each of those Parameters, by id.
    sizes: Mapping[int, int]
    #: The slack the split was made with.
    slack: float
    #: Share of the stages' cost that a split backward's weight part computes: a third of
    #: the cost of every node that reads a Parameter (a product's weight gradient is one of
    #: its three products), over the whole cost.
    weight_share: float
    #: Per stage: the values entering it (relayed ones included), each counted twice where
    #: a gradient goes back: the messages a border before it carries per micro-batch.
    messages: tuple[int, ...]


def priced_model(
    model: nn.Module,
    example_input: Any,
    example_kwargs: Mapping[str, Any] | None,
    mode: PricingMode,
    tracer: TracerName,
    device: torch.device,
    device_flops: float,
) -> Priced:
    """Trace and price once (a model on ``meta`` on a meta copy of the example, as
    :func:`fxpipe.compiler.compile_model` does)."""
    front = traced_example(  # pipeline_schedule checks what micro-batches would change
        model, example_input, example_kwargs, tracer=tracer, pricing=mode, reductions=False,
        whole=True,
    )  # fmt: skip
    with front as (traced, batch):
        replicate_shared_weights(traced.graph_module)  # as pipeline_schedule plans them
        with preserved(model), fake_runnable(model):
            costs = _costs(traced, mode, device, 1)
            fixed: dict[str, float] = {}
            if mode == "roofline":  # a second pricing tells the per-micro-batch part apart
                twice = _costs(traced, mode, device, 2)
                fixed = {n: max(twice.nodes[n].cost - c.cost, 0.0) for n, c in costs.nodes.items()}
    seconds = 1.0 / device_flops if mode == "flops" else 1.0
    graph = to_networkx(traced.graph_module, costs)
    return Priced(traced, costs, graph, batch, seconds, fixed, mode, tracer)


def _costs(
    traced: Traced, mode: PricingMode, device: torch.device, micro_batches: int
) -> CostTable:
    return estimate_costs(
        traced.graph_module,
        traced.example_values,
        mode=mode,
        device=device,
        micro_batches=micro_batches,
        # a whole step's roofline, as chunks="auto" prices counts with: its per-kernel cost
        # is what a node costs in a stage, and small micro-batches get no cache's speed
        roofline=step_roofline_for(device.type) if mode == "roofline" else None,
    )


def stage_split(priced: Priced, k: int, checkpoint: CheckpointMode, slack: float) -> Split | None:
    """The plan of ``k`` stages (None when the graph cannot be cut into that many)."""
    try:
        part = partition_graph(priced.graph, k, slack=slack, traffic="relay")
    except PlanError:
        return None
    gm, costs = priced.traced.graph_module, priced.costs
    plan = build_plan(gm, costs, priced.graph, part, [torch.device("meta")] * k, chunks=1,
                      checkpoint=checkpoint)  # fmt: skip
    fixed = [sum(priced.fixed.get(n, 0.0) for n in s.nodes) * priced.seconds for s in plan.stages]
    scaled = [s.cost * priced.seconds - f for s, f in zip(plan.stages, fixed, strict=True)]
    received, messages = [0] * k, [0] * k
    for e in plan.edges:
        ways = 2 if costs.nodes[e.value].requires_grad else 1
        for j in range(e.producer + 1, max(e.consumers) + 1):
            received[j] += e.bytes * ways
            messages[j] += ways
    shared = replicated_attrs(gm)
    held = [stage_parameters(gm, s.nodes, shared) for s in plan.stages]
    params = tuple(frozenset(map(id, ps)) for ps in held)
    sizes = {id(p): p.numel() * p.element_size() for ps in held for p in ps}
    share = _weight_share(gm, costs)
    return Split(plan, tuple(scaled), tuple(fixed), tuple(received), params, sizes, slack, share,
                 tuple(messages))  # fmt: skip


def _weight_share(gm: torch.fx.GraphModule, costs: CostTable) -> float:
    """A third of the cost of the nodes that multiply by a weight matrix (a module holding
    a Parameter of two or more dimensions, or such a Parameter fetched among their inputs:
    products, convolutions, embeddings; a norm's scale and a bias have element-wise
    gradients), over the cost of all nodes."""

    def matrix(n: torch.fx.Node) -> bool:
        if n.op == "call_module":
            held = gm.get_submodule(str(n.target)).parameters(recurse=False)
            return any(p.dim() >= 2 for p in held)
        if n.op == "get_attr":
            value = attrgetter(str(n.target))(gm)
            return isinstance(value, torch.Tensor) and value.requires_grad and value.dim() >= 2
        return False

    total = weights = 0.0
    for n in gm.graph.nodes:
        cost = costs.nodes[n.name].cost if n.name in costs.nodes else 0.0
        total += cost
        fetched = (a for a in n.all_input_nodes if a.op == "get_attr")
        if n.op != "get_attr" and (matrix(n) or any(map(matrix, fetched))):
            weights += cost / 3.0
    return weights / total if total > 0 else 1.0 / 3.0
