"""The compiler's steps joined: a model and its example traced, checked, priced, partitioned
and split into a plan and stage programs (:func:`compile_model`); every option the plan
needs is read once, here."""

from __future__ import annotations

import dataclasses
import inspect
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from fxpipe.devices.speeds import device_kind, kind_speeds
from fxpipe.devices.stages import StageDevices, stage_devices
from fxpipe.errors import ChunksWarning, ConfigError, DeviceError, PlanError
from fxpipe.ir import (
    LEAST_RECOMPUTATION_FIRST,
    Checkpoints,
    CostTable,
    PipelinePlan,
    PricingMode,
    StageProgram,
    TracerName,
)
from fxpipe.model_state import preserved
from fxpipe.options import PlanOptions, checkpoint_of_stages
from fxpipe.passes.configure.choose import choose_configuration, chunk_counts
from fxpipe.passes.partition.cost_graph import replicate_shared_weights, to_networkx
from fxpipe.passes.partition.memory import memory_model
from fxpipe.passes.partition.search import Partition, partition_graph
from fxpipe.passes.price.estimate import estimate_costs
from fxpipe.passes.price.roofline import step_roofline_for
from fxpipe.passes.split.codegen import split_stages
from fxpipe.passes.split.plan import build_plan
from fxpipe.passes.tensor.values import node_values
from fxpipe.progress import phase, pricing_progress
from fxpipe.trace.example_checks import (
    check_outputs_follow_batch,
    example_args,
    example_batch,
    with_reductions,
)
from fxpipe.trace.tracing import Traced, fake_runnable, trace
from fxpipe.weights.materialise import (
    all_meta,
    check_meta_pricing,
    cpu_view,
    holds_meta,
    meta_view,
    on_cpu,
    on_cpu_and_meta,
    on_meta,
)

__all__ = [
    "Compiled",
    "compile_model",
    "traced_once",
    "traced_example",
    "check_meta_stages",
    "with_no_grad",
]


@dataclass(frozen=True)
class Compiled:
    """Everything the compiler made for one model: traced graph, plan and stage program."""

    traced: Traced
    plan: PipelinePlan
    program: StageProgram


def compile_model(
    model: nn.Module,
    example_input: Any,
    devices: Sequence[Any],
    options: PlanOptions,
    *,
    example_kwargs: Mapping[str, Any] | None = None,
    present: bool = True,
) -> Compiled:
    """Trace, price, partition and split; the steps of :func:`fxpipe.pipeline` before any
    device work. ``present``: the devices must exist here (False for a plan only)."""
    with traced_once(
        model, example_input, devices, options, example_kwargs=example_kwargs, present=present
    ) as plan:
        return plan(options)


@contextmanager
def traced_once(
    model: nn.Module,
    example_input: Any,
    devices: Sequence[Any],
    options: PlanOptions,
    *,
    example_kwargs: Mapping[str, Any] | None = None,
    present: bool = True,
) -> Iterator[Callable[[PlanOptions], Compiled]]:
    """Yields ``plan(o)``, which prices, partitions and splits ``model`` under options ``o``
    (the plan of :func:`compile_model`), the model traced on its example at the first call
    and that graph kept for the ``with`` block. ``o`` may differ from ``options`` in how
    the graph is planned (its cost, the nodes kept together), not in how it was traced
    (tracer, reductions, chunks=1, shared weights), so several plans of one model pay for
    one trace; a trace that fails raises from the call that made it."""
    stages = stage_devices(
        devices, max_memory=options.max_memory, speed=options.speed, present=present
    )
    if options.checkpoint != "auto":  # one mode per stage, where a list gives them
        checkpoint_of_stages(options.checkpoint, len(stages))
    traced_as = _tracing(options)
    with ExitStack() as stack:
        found: list[tuple[Traced, int]] = []

        def plan(planning: PlanOptions) -> Compiled:
            if _tracing(planning) != traced_as:
                raise ValueError(
                    f"a plan under {_tracing(planning)} of a graph traced under {traced_as}; "
                    "trace the model again for these options"
                )
            if not found:
                traced, batch = stack.enter_context(
                    traced_example(
                        model,
                        example_input,
                        example_kwargs,
                        tracer=options.tracer,
                        pricing=options.pricing(),
                        reductions=options.reductions,
                        whole=options.chunks == 1,
                        run_on=stages.targets,
                    )
                )
                if options.replicate_weights:
                    replicate_shared_weights(traced.graph_module)
                found.append((traced, batch))
            traced, batch = found[0]
            return _compile_traced(model, traced, batch, stages, planning)

        yield plan


def _tracing(options: PlanOptions) -> tuple[Any, ...]:
    """What of ``options`` the traced graph depends on (tracer, reductions, a whole batch,
    shared weights replicated) and the stages it is planned over."""
    whole = options.chunks == 1
    return (options.tracer, options.reductions, whole, options.replicate_weights,
            options.max_memory, options.speed)  # fmt: skip


@contextmanager
def traced_example(
    model: nn.Module,
    example_input: Any,
    example_kwargs: Mapping[str, Any] | None,
    *,
    tracer: TracerName,
    pricing: PricingMode | Callable[[fx.Node], float],
    reductions: bool = True,
    whole: bool = False,
    run_on: Sequence[torch.device] = (),
) -> Iterator[tuple[Traced, int]]:
    """``model`` traced on the example, whose outputs are checked to follow its batch; yields
    (the traced model, the batch size). With ``reductions``, outputs that reduce over the
    batch (a loss inside the model) are computed from partial sums per micro-batch
    (:func:`fxpipe.trace.example_checks.with_reductions`); else they are refused. A
    per-sample value computed from a reduction over the batch is refused unless ``whole``
    (the batch runs as one micro-batch). A model built on ``meta`` is traced on a meta copy
    of the example (``pricing`` must not need real values); one that also holds real
    tensors is seen as shapes only for the ``with`` block. Where every device of ``run_on``
    (the stages') is the CPU and the model's real tensors are there too, its ``meta``
    tensors hold uninitialised CPU storage for the ``with`` block instead, and the example
    is on the CPU: code that asks its tensors' device (transformers' grouped experts count
    tokens per expert one way on the CPU, another elsewhere) is traced as it will run."""
    if not isinstance(model, nn.Module):
        raise ConfigError(f"model is a {type(model).__name__}, not an nn.Module; pass the module")
    view: AbstractContextManager[Any] = nullcontext()
    on_the_cpu = bool(run_on) and all(d.type == "cpu" for d in run_on)
    if holds_meta(model):  # built on meta: traced and priced on a copy of the example
        check_meta_pricing(model, pricing)
        if on_the_cpu and (all_meta(model) or on_cpu_and_meta(model)):  # as the stages will run it
            example_input, example_kwargs = on_cpu((example_input, example_kwargs))
            view = cpu_view(model)
        else:
            example_input, example_kwargs = on_meta((example_input, example_kwargs))
            if not all_meta(model):  # real tensors beside meta ones: planned as shapes only
                view = meta_view(model)
    with view:
        args = example_args(example_input)
        batch = example_batch(inspect.signature(model.forward), args, example_kwargs or {})
        with phase("trace", f"{type(model).__name__} (tracer={tracer!r})"):
            traced = trace(model, args, example_kwargs, tracer=tracer)
        with phase("check", "outputs follow the batch"):
            with preserved(model), fake_runnable(model):  # fake runs may write into buffers
                traced = with_reductions(traced, batch, reductions=reductions, whole=whole)
                check_outputs_follow_batch(traced, batch)
        yield traced, batch


def _compile_traced(
    model: nn.Module, traced: Traced, batch: int, stages: StageDevices, options: PlanOptions
) -> Compiled:
    """Price, partition and split a traced model; with ``chunks="auto"`` or
    ``checkpoint="auto"``, for each configuration weighed (:mod:`fxpipe.passes.configure`)."""
    targets, budgets, speeds = stages.targets, stages.budgets, stages.speeds
    pricing = options.pricing()
    micro_batches = options.micro_batches(len(targets), batch)
    if isinstance(options.chunks, int) and options.chunks > batch:
        warnings.warn(
            f"chunks={options.chunks} is more than the example batch's {batch} samples: it "
            f"runs as {batch} micro-batches of one sample (a micro-batch is never empty); "
            f"the plan, its predicted bubble and pipe.chunks say {batch}",
            ChunksWarning,
            stacklevel=4,
        )
    training = model.training and torch.is_grad_enabled()  # else: memory for inference
    gm, k = traced.graph_module, len(targets)
    priced: dict[int, tuple[CostTable, tuple[float, ...] | None]] = {}
    timed: dict[int, CostTable | None] = {}
    found: dict[tuple[int, Any], Partition] = {}

    def timing(chunks: int) -> CostTable | None:
        """The roofline's prices of a whole step at ``chunks`` (None: the plan's own)."""
        if pricing != "roofline":
            return None
        if chunks not in timed:
            rates = step_roofline_for(targets[0].type)
            with phase("price", f"a step at chunks={chunks}"), fake_runnable(model):
                timed[chunks] = estimate_costs(
                    gm, traced.example_values, mode=pricing, device=targets[0],
                    micro_batches=chunks, roofline=rates,
                )  # fmt: skip
        return timed[chunks]

    def planner(
        chunks: int, checkpoint: Checkpoints, keep: Mapping[str, int] | None
    ) -> PipelinePlan:
        if chunks not in priced:
            priced[chunks] = _price(model, traced, targets, pricing, chunks, speeds)
        costs, speed = priced[chunks]
        with phase("partition", f"{k} stages, chunks={chunks}, checkpoint={checkpoint!r}"):
            g = to_networkx(gm, costs)
            memory = memory_model(gm, costs, targets, budgets, chunks=chunks,
                                  checkpoint=checkpoint, training=training)  # fmt: skip
            if keep is not None:  # the split of an earlier configuration, modes changed
                parts = next(p for p in found.values() if p.stage_of == keep)
            else:
                key = (chunks, None if memory is None else checkpoint)
                if key not in found:
                    found[key] = partition_graph(
                        g, k, slack=options.slack, traffic=options.traffic, speed=speed,
                        memory=memory, together=options.together,
                    )  # fmt: skip
                parts = found[key]
        return build_plan(
            gm, costs, g, parts, targets, chunks=chunks, checkpoint=checkpoint,
            capacity=budgets, speeds=speed, training=training,
        )  # fmt: skip

    if options.automatic:
        counts = [micro_batches]
        if options.chunks == "auto":
            counts = chunk_counts(batch, k, micro_batches)
        modes: list[Checkpoints] = ["never"]  # inference recomputes nothing
        if options.checkpoint != "auto":
            modes = [options.checkpoint]
        elif training:
            modes = list(LEAST_RECOMPUTATION_FIRST)
        searched = f"chunks={options.chunks!r}, checkpoint={options.checkpoint!r}"
        with phase("configure", searched):
            the_plan = choose_configuration(
                planner, counts, modes, timing=timing, stages=k,
                per_stage=options.checkpoint == "auto",
                searched=searched,
            )  # fmt: skip
    else:
        checkpoint: Checkpoints = options.checkpoint  # type: ignore[assignment]
        the_plan = planner(micro_batches, checkpoint, None)
    with phase("split", "stage modules"):
        program = split_stages(the_plan, traced.output_spec, traffic=options.traffic)
    return Compiled(traced, the_plan, with_no_grad(program, traced, model))


def with_no_grad(program: StageProgram, traced: Traced, model: nn.Module) -> StageProgram:
    """``program`` told which of the values its stages return never carry a gradient,
    from one run of the whole graph on fake tensors (every Parameter and floating input
    taken as requiring one; :func:`fxpipe.passes.tensor.values.node_values`); as it is where
    the graph does not run on them."""
    sent = {name for names in program.outputs for name in names}
    try:
        with fake_runnable(model):
            grads = node_values(traced.graph_module, traced.example_values).grads
    except PlanError:
        return program
    return dataclasses.replace(program, no_grad=frozenset(sent - grads))


def _price(
    model: nn.Module,
    traced: Traced,
    targets: Sequence[torch.device],
    pricing: PricingMode | Callable[[fx.Node], float],
    micro_batches: int,
    speeds: tuple[float, ...] | None,
) -> tuple[CostTable, tuple[float, ...] | None]:
    """The cost table (priced on the first stage's device), and the devices' speeds: the
    declared ones, else measured per kind of device when the stages span several."""
    nodes = len(traced.graph_module.graph.nodes)

    def priced_on(device: torch.device, what: str) -> CostTable:
        with phase("price", what), fake_runnable(model):
            return estimate_costs(
                traced.graph_module,
                traced.example_values,
                mode=pricing,
                device=device,
                micro_batches=micro_batches,
                progress=pricing_progress(),
            )

    costs = priced_on(targets[0], f"{nodes} nodes, cost={pricing!r}")
    if speeds is None and pricing in ("time", "roofline"):  # unequal kinds: priced on each
        speeds = kind_speeds(
            targets,
            lambda d: _total(priced_on(d, f"{nodes} nodes again, on {device_kind(d)}")),
            _total(costs),
        )
    return costs, speeds


def _total(costs: CostTable) -> float:
    return sum(c.cost for c in costs.nodes.values())


def check_meta_stages(model: nn.Module, devices: Sequence[torch.device]) -> None:
    """Tensors with data cannot move onto ``meta`` stages (a model on meta may run there)."""
    if not any(d.type == "meta" for d in devices):
        return
    tensors = [*model.named_parameters(), *model.named_buffers()]
    real = next(((n, t.device) for n, t in tensors if not t.is_meta), None)
    if real is not None:
        raise DeviceError(
            f"devices {[str(d) for d in devices]} include 'meta', which holds no data, but "
            f"the model's {real[0]!r} is on {real[1]}; run the stages on cpu or cuda "
            "(fxpipe.plan accepts meta devices)"
        )
