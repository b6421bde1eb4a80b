"""The compiler's service to a running pipeline: the model traced again for a call in
another mode or of another structure, split along the first trace's borders, as the
runtime's :class:`fxpipe.runtime.variants.Retrace` asks for it."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map

from fxpipe.compiler.steps import Compiled, traced_example, with_no_grad
from fxpipe.devices.targets import model_device
from fxpipe.ir import PipelinePlan, PricingMode, StageProgram, TracerName
from fxpipe.model_state import preserved
from fxpipe.options import PlanOptions
from fxpipe.passes.partition.cost_graph import to_networkx
from fxpipe.passes.partition.search import Partition
from fxpipe.passes.price.estimate import ValueDependentError, borrowed_costs, estimate_costs
from fxpipe.passes.split.codegen import split_stages
from fxpipe.passes.split.follow import follow_borders
from fxpipe.passes.split.plan import build_plan
from fxpipe.progress import phase
from fxpipe.trace.batch_checks import check_micro_batches
from fxpipe.trace.constants import fill_meta_constants, place_constants
from fxpipe.trace.tracing import Traced, fake_runnable
from fxpipe.weights.materialise import placed_view

__all__ = ["Retracer"]


@dataclass(frozen=True)
class Retracer:
    """Traces ``model`` again for the runtime (:meth:`trace_call`), split along ``leader``'s
    borders, with the options ``leader`` was planned with."""

    model: nn.Module
    leader: Compiled
    options: PlanOptions

    def trace_call(
        self, args: tuple[Any, ...], kwargs: Mapping[str, Any]
    ) -> tuple[Traced, PipelinePlan, StageProgram]:
        """The model traced as it is now (its modules' training modes) for a call of this
        structure, split along the leader's borders (:mod:`fxpipe.passes.split.follow`): a
        pipeline's new variant. Traced on the model itself, with an empty example of the
        leader's batch size, where all its tensors live on one device (so that code that
        branches on the device, and tensors it makes in forward, are as on that device);
        else on ``meta`` views of both (its tensors live on several devices, which one trace
        cannot mix), where a tensor made in forward takes its values from the first trace
        (:mod:`fxpipe.trace.constants`). Priced by the roofline from the shapes torch.export
        recorded (the borders are the leader's: the costs only describe the stages), which
        runs nothing; a graph that cannot be priced without running it (a node whose output
        depends on tensor values, in an fx graph) takes the leader's prices of the nodes of
        the same name."""
        model, leader, options = self.model, self.leader, self.options
        plan = leader.plan
        batch = plan.costs.batch_size
        place = model_device(model)
        view, traced_on = placed_view(model, place)
        example = _empty_example((args, dict(kwargs)), batch, traced_on)
        pricing: PricingMode = "roofline"
        with preserved(model), view:
            front = traced_example(
                model, *example, tracer=_tracer(leader.traced.tracer), pricing=pricing,
                reductions=options.reductions, whole=plan.chunks == 1,
            )  # fmt: skip
            with front as (traced, _), preserved(model), fake_runnable(model):
                with phase("price", f"{len(traced.graph_module.graph.nodes)} nodes, again"):
                    try:
                        costs = estimate_costs(
                            traced.graph_module,
                            traced.example_values,
                            mode=pricing,
                            device=plan.devices[0],
                            micro_batches=plan.chunks,
                        )
                    except ValueDependentError:  # on meta: the leader's prices, node by name
                        costs = borrowed_costs(traced.graph_module, plan.costs)
                with phase("split", "along the first trace's borders"):
                    fill_meta_constants(traced.graph_module, [leader.traced.graph_module], model)
                    g = to_networkx(traced.graph_module, costs)
                    stage_of = follow_borders(plan, traced.graph_module, g)
                    followed = build_plan(
                        traced.graph_module,
                        costs,
                        g,
                        Partition(stage_of, 0.0, "follow", 0.0, options.traffic),
                        plan.devices,
                        chunks=plan.chunks,
                        checkpoint=plan.checkpoint_modes,
                        speeds=plan.speeds or None,
                        training=model.training and torch.is_grad_enabled(),
                    )
                    program = split_stages(followed, traced.output_spec, traffic=options.traffic)
                    program = with_no_grad(program, traced, model)
                    place_constants(program.modules, plan.devices, model)
                check_micro_batches(traced, plan.chunks, model)
        return traced, followed, program


def _empty_example(
    call: Any, batch: int, device: torch.device
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The call's arguments as empty tensors on ``device``, every batched tensor resized to
    ``batch`` rows (torch.export would fix a batch of one into the graph)."""

    def resized(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        shape = (batch, *t.shape[1:]) if t.ndim else ()
        empty = torch.zeros(shape, dtype=t.dtype, device=device)
        return empty.requires_grad_(t.requires_grad)

    args, kwargs = tree_map(resized, call)
    return tuple(args), dict(kwargs)


def _tracer(name: str) -> TracerName:
    """The tracer that made a graph, as an option (``Traced.tracer`` is "fx" or "export")."""
    return "export" if name == "export" else "fx"
