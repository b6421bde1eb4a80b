"""Frozen records passed between fxpipe's passes and its runtime.

Terms used across the package:

- *value*: the output of one fx node, named by the node's name.
- *stage j*: a contiguous (convex) set of nodes that runs on ``devices[j]``.
- *boundary value*: a value produced in one stage and read by a later one.
- index letters: ``i`` micro-batch, ``j`` stage, ``k`` clock tick.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from os import PathLike
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypeAlias, get_args

import torch
from torch.utils._pytree import TreeSpec

if TYPE_CHECKING:
    from torch.fx import GraphModule

__all__ = [
    "NodeCost",
    "CostTable",
    "StagePlan",
    "BoundaryEdge",
    "PipelinePlan",
    "ValueRef",
    "StageProgram",
    "Finalize",
    "Join",
    "RECOMPUTE",
    "CheckpointMode",
    "Checkpoints",
    "Configuration",
    "ConfigurationTable",
    "CostMode",
    "PricingMode",
    "TracerName",
    "Traffic",
    "CHECKPOINT_MODES",
    "LEAST_RECOMPUTATION_FIRST",
    "SECONDS_PRICING",
    "COST_MODES",
    "PRICING_MODES",
    "TRACERS",
    "TRAFFIC",
]

#: Which micro-batches a stage checkpoints in training (recomputing their forward in
#: backward instead of keeping activations): all, all but the last, or none.
CheckpointMode: TypeAlias = Literal["always", "except_last", "never"]
#: One mode for every stage, or one per stage (in stage order).
Checkpoints: TypeAlias = CheckpointMode | tuple[CheckpointMode, ...]
#: How nodes are priced: "roofline" estimates seconds from FLOPs and bytes on a reference
#: device, "time" profiles forward and backward, "flops" counts analytic FLOPs on fake
#: tensors, "params" weighs parameter bytes; "auto" lets fxpipe pick for the devices.
PricingMode: TypeAlias = Literal["roofline", "time", "flops", "params"]
CostMode: TypeAlias = Literal["auto", PricingMode]
#: Which tracer captures the model: "fx" (torch.fx.symbolic_trace), "export"
#: (torch.export, non-strict), or "auto" (fx, then export when fx fails).
TracerName: TypeAlias = Literal["auto", "fx", "export"]
#: How boundary values travel: "direct" from the producer to every stage that reads them,
#: "relay" through every stage in between (for engines that only connect neighbours).
Traffic: TypeAlias = Literal["direct", "relay"]

#: The choices of each option, in one place (``fxpipe.options`` checks against them).
CHECKPOINT_MODES: tuple[CheckpointMode, ...] = get_args(CheckpointMode)
#: The checkpoint modes, least recomputation first.
LEAST_RECOMPUTATION_FIRST: tuple[CheckpointMode, ...] = CHECKPOINT_MODES[::-1]
COST_MODES: tuple[CostMode, ...] = get_args(CostMode)
PRICING_MODES: tuple[PricingMode, ...] = get_args(PricingMode)
#: The pricing modes whose costs are seconds (a step time can be predicted from them).
SECONDS_PRICING: tuple[PricingMode, ...] = PRICING_MODES[:2]
TRACERS: tuple[TracerName, ...] = get_args(TracerName)
TRAFFIC: tuple[Traffic, ...] = get_args(Traffic)

#: How the micro-batches' values of one output of a stage program are joined: "cat" along
#: dim 0 (a per-sample value), "sum" (a partial sum over the micro-batch's samples, or a
#: count of them, which add up to the batch's), or "same" (a value that does not depend on
#: the batch, such as a dtype read off a batch: every micro-batch gives it alike).
Join: TypeAlias = Literal["cat", "sum", "same"]

#: fx node meta key of a node copy that recomputes an input-derived value beside its
#: reader (``fxpipe.trace.recompute``); no stage border may separate it from its reader.
RECOMPUTE = "fxpipe_recompute"


@dataclass(frozen=True, slots=True)
class NodeCost:
    """What one fx node costs, as priced by the cost model."""

    #: Relative compute cost of forward + backward (seconds for "time", FLOP-equivalents
    #: for "flops", bytes for "params"); only ratios between nodes matter to the partitioner.
    cost: float
    #: Bytes of the node's output (0 for values that are not tensors).
    output_bytes: int
    #: Bytes of the parameters the node owns (call_module) or fetches (get_attr).
    param_bytes: int
    #: Whether the node's output is a single tensor; other values never cross a boundary.
    is_tensor: bool
    #: Whether the output carries a gradient in training (its bytes travel twice).
    requires_grad: bool = False
    #: Bytes the node keeps alive for backward, per example batch (0 for views).
    saved_bytes: int = 0


@dataclass(frozen=True, slots=True)
class CostTable:
    """Per-node costs of one graph under one cost mode."""

    #: "time", "flops", "params" or "custom".
    mode: str
    #: Unit of :attr:`NodeCost.cost` ("s", "flop", "B" or "custom").
    unit: str
    #: Node name -> cost, for every node of the graph.
    nodes: Mapping[str, NodeCost]
    #: Example batch size the costs were measured at.
    batch_size: int


@dataclass(frozen=True, slots=True)
class StagePlan:
    """One stage of a plan: where it runs, what it holds and what crosses its borders."""

    index: int
    device: torch.device
    #: Node names in the stage, in the graph's order.
    nodes: tuple[str, ...]
    #: Sum of the node costs divided by the speed of the stage's device (``speed=``, or
    #: measured per kind of device; 1 by default): the stage's time on its own device, in
    #: the unit of the costs.
    cost: float
    #: Bytes of the parameters the stage holds.
    param_bytes: int
    #: Estimated memory: in training (``PipelinePlan.training``), parameters, gradients,
    #: optimizer state and the activations of the micro-batches in flight; in inference,
    #: the parameters and one micro-batch's activations.
    memory_bytes: int
    #: Boundary values the stage reads from earlier stages (or model inputs it reads
    #: though stage 0 holds them), in graph order.
    inputs: tuple[str, ...]
    #: Values the stage produces that a later stage or the model output reads.
    outputs: tuple[str, ...]
    #: The first and last module paths the stage covers (node names where it has none;
    #: ``("-", "-")`` for a stage without nodes): how messages and charts name it.
    span: tuple[str, str] = ("-", "-")

    @property
    def num_nodes(self) -> int:
        """How many graph nodes the stage runs."""
        return len(self.nodes)


@dataclass(frozen=True, slots=True)
class BoundaryEdge:
    """A value that crosses from its producer stage to one or more later stages."""

    value: str
    producer: int
    consumers: tuple[int, ...]
    #: Bytes of the value for the example batch (sent once per consumer stage).
    bytes: int


#: How a plan is shown: the function of :mod:`fxpipe.views` each of ``summary``, ``to_dot``,
#: ``draw``, ``configurations`` (and a ConfigurationTable's ``table``) calls, found by name
#: when first asked for, so that the records every step shares import none of the steps and
#: need nothing imported before them.
_PLAN_VIEWS = {
    "summary": "plan_summary",
    "to_dot": "plan_to_dot",
    "draw": "draw_plan",
    "configurations": "plan_configurations",
    "table": "configuration_table",
}


def _shown_by(name: str) -> Callable[..., Any]:
    view: Callable[..., Any] = getattr(importlib.import_module("fxpipe.views"), _PLAN_VIEWS[name])
    return view


@dataclass(frozen=True, slots=True)
class Configuration:
    """One configuration of a run the planner weighed: its micro-batches, each stage's
    checkpoint mode, and what the cost model predicts for one step."""

    chunks: int
    #: The checkpoint mode of each stage.
    checkpoint: tuple[CheckpointMode, ...]
    #: Predicted seconds of one step (forward and backward in training); None where no
    #: split fits the memory budgets.
    step: float | None
    #: The parts of ``step``: the stages' work, their recomputation, the time devices
    #: wait (the bubble, and stages that share a device waiting their turn), the
    #: runtime's fixed costs per micro-batch and stage.
    compute: float = 0.0
    recompute: float = 0.0
    idle: float = 0.0
    overhead: float = 0.0
    #: Estimated bytes per device (``(device, bytes)``, in stage order) of the split found.
    memory: tuple[tuple[str, int], ...] = ()
    #: Why it was not kept: the device it does not fit, ... (empty: it fits).
    refused: str = ""
    #: How its checkpoint modes were found: one mode for every stage ("global") or the
    #: least recomputation per stage that fits, on the split of a global mode ("per stage").
    kind: str = "global"

    @property
    def fits(self) -> bool:
        """Whether a split fits the memory budgets in this configuration."""
        return self.step is not None

    @property
    def mode(self) -> Checkpoints:
        """The checkpoint modes as the options spell them: one mode where all stages agree."""
        modes = set(self.checkpoint)
        return self.checkpoint[0] if len(modes) == 1 else self.checkpoint


@dataclass(frozen=True)
class ConfigurationTable:
    """The configurations one plan was chosen from, fastest predicted first."""

    rows: tuple[Configuration, ...]
    #: The index in ``rows`` of the configuration the plan uses.
    chosen: int
    #: What was searched (``"chunks='auto', checkpoint='auto'"``).
    searched: str = ""

    @property
    def choice(self) -> Configuration:
        """The configuration the plan uses."""
        return self.rows[self.chosen]

    def __str__(self) -> str:
        return str(_shown_by("table")(self))


@dataclass(frozen=True)
class PipelinePlan:
    """Where every node of a traced graph runs; compile-time data, nothing runs on devices."""

    #: The traced GraphModule the plan refers to (not modified by planning).
    graph_module: GraphModule
    devices: tuple[torch.device, ...]
    #: Node name -> stage index, for every node of ``graph_module.graph``.
    stage_of: Mapping[str, int]
    #: Node name -> cost used by the partitioner.
    node_cost: Mapping[str, float]
    stages: tuple[StagePlan, ...]
    edges: tuple[BoundaryEdge, ...]
    #: Largest stage cost (a time, when the devices have speeds).
    bottleneck: float
    #: max(total / K, largest node): no split can beat it (with speeds: the total over
    #: the summed speeds, and the largest node on the fastest device).
    lower_bound: float
    #: The cost table the plan was made from.
    costs: CostTable
    #: Micro-batches the memory estimates assume.
    chunks: int = 1
    #: Bytes of memory of each entry of ``devices`` the plan was made for (None: unknown,
    #: not checked); kept so that the plan reads the same on every machine.
    capacities: tuple[int | None, ...] = ()
    #: Free-form facts about how the plan was found (search time, order used, ...).
    info: Mapping[str, Any] = field(default_factory=dict)
    #: Relative speed of each entry of ``devices`` the plan was made for (empty: all 1);
    #: each stage's cost is its nodes' cost divided by its device's speed.
    speeds: tuple[float, ...] = ()
    #: Whether ``memory_bytes`` estimate a training step (weights, gradients, Adam state,
    #: stashed activations) or an inference call (the model was in eval mode, or grad was
    #: disabled, when it was planned).
    training: bool = True
    #: The checkpoint mode of each stage the memory estimates assume (empty: not recorded).
    checkpoints: tuple[CheckpointMode, ...] = ()
    #: The configurations weighed when it was planned with ``chunks="auto"`` or
    #: ``checkpoint="auto"`` (None: the configuration was given).
    weighed: ConfigurationTable | None = None

    @property
    def num_stages(self) -> int:
        """How many stages the plan has (one per entry of ``devices``)."""
        return len(self.stages)

    @property
    def checkpoint_modes(self) -> tuple[CheckpointMode, ...]:
        """Each stage's checkpoint mode (``"except_last"``, the default, where the plan
        recorded none)."""
        default: CheckpointMode = "except_last"
        return self.checkpoints or (default,) * len(self.stages)

    @property
    def total_cost(self) -> float:
        """Sum of the stage costs, in the unit of ``costs.unit``."""
        return sum(s.cost for s in self.stages)

    def gpipe_prediction(self, chunks: int) -> tuple[float, float]:
        """(bubble fraction, predicted speedup over one device) for ``chunks`` micro-batches,
        from the GPipe makespan sum(c_j)/M + (M - 1) max(c_j)/M, no communication term."""
        m = max(chunks, 1)
        costs = [s.cost for s in self.stages]
        total = sum(costs)
        if total <= 0:
            return 0.0, 1.0
        makespan = total / m + (m - 1) * max(costs) / m
        busy = total / len(costs)
        bubble = 1.0 - busy / makespan
        return bubble, total / makespan

    def configurations(self) -> ConfigurationTable:
        """The configurations (micro-batches, checkpointing per stage) the planner weighed,
        each with its predicted step time and memory, the chosen one marked; for a plan
        whose configuration was given, that one alone. ``print`` it to read it."""
        return _shown_by("configurations")(self)  # type: ignore[no-any-return]

    def summary(self) -> str:
        """A table a person reads: one row per stage, totals and predictions below."""
        return str(_shown_by("summary")(self))

    def to_dot(self, level: str = "stage") -> str:
        """Graphviz text of the stages ("stage") or of every node clustered by stage ("node")."""
        return str(_shown_by("to_dot")(self, level=level))

    def draw(
        self, path: str | PathLike[str], *, kind: str = "graph", level: str = "stage"
    ) -> Path:
        """Write a picture of the plan; returns its ``pathlib.Path``.

        ``kind="graph"``: the stage graph (``level="stage"``) or the node graph
        (``level="node"``) as .svg/.png/.pdf through Graphviz ``dot``, or .dot text.
        ``kind="balance"``: stage cost against the lower bound and memory against capacity,
        as .png/.svg/.pdf through matplotlib (the ``viz`` extra).
        """
        return Path(_shown_by("draw")(self, path, kind=kind, level=level))

    def draw_balance(self, path: str | PathLike[str]) -> Path:
        """``draw(path, kind="balance")``."""
        return self.draw(path, kind="balance")

    def __str__(self) -> str:
        return self.summary()


@dataclass(frozen=True, slots=True)
class ValueRef:
    """A reference, in a flat output list, to the value of the node with this name."""

    name: str


@dataclass(frozen=True)
class StageProgram:
    """What the runtime runs: one GraphModule per stage and the values that flow between them.

    Stage ``j`` is called as ``modules[j](*[env[n] for n in inputs[j]])`` and returns a tuple
    whose items are the values named ``outputs[j]``. ``env`` starts with the model inputs
    (``graph_inputs``, one value per placeholder; a value may be a pytree of tensors).
    The model output is ``tree_unflatten([env[r.name] if ValueRef else r ...], output_spec)``.
    """

    modules: tuple[GraphModule, ...]
    inputs: tuple[tuple[str, ...], ...]
    outputs: tuple[tuple[str, ...], ...]
    graph_inputs: tuple[str, ...]
    output_leaves: tuple[Any, ...]
    output_spec: TreeSpec
    #: How boundary values travel between the stages (see :data:`Traffic`).
    traffic: Traffic = "direct"
    #: Boundary values not cut with the batch (a weight read in one stage and used in
    #: later ones, such as a tied embedding): the same whole value in every micro-batch,
    #: so the runtime moves each to a device once per call and every micro-batch reads that
    #: copy (its gradient comes back once, summed).
    whole: frozenset[str] = frozenset()
    #: Values the stages return that never carry a gradient though they are floating point
    #: (a histogram of the batch: ``histc``), which a stage run without grad (checkpointed)
    #: cannot tell from the others; found on the whole graph by the compiler.
    no_grad: frozenset[str] = frozenset()

    @property
    def num_stages(self) -> int:
        return len(self.modules)


@dataclass(frozen=True)
class Finalize:
    """What turns the joined outputs of a stage program into the model's outputs, where the
    model reduces over its batch (a loss computed inside it): run once per call, after the
    micro-batches' values are joined.

    ``graph_module`` is called as ``graph_module(*joined, *[values[i] for i in inputs],
    device)``: first one value per output of the stage program, joined as ``joins`` says,
    then the model inputs it reads (``inputs``: positions among the graph's placeholders),
    then the device the outputs go to. It returns the model's flat output leaves.
    """

    graph_module: GraphModule
    #: How each output of the stage program is joined over micro-batches.
    joins: tuple[Join, ...]
    #: Placeholder positions (of the traced graph) of the model inputs it reads.
    inputs: tuple[int, ...]
    #: How the model names each of its output leaves (``loss``, ``logits``, ``[0]``).
    names: tuple[str, ...]
    #: The output leaves it computes (positions among the model's flat outputs), each a
    #: reduction over the batch or a value that does not depend on it.
    reduced: tuple[int, ...] = ()
