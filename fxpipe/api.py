"""``fxpipe.plan`` and ``fxpipe.pipeline``: the one place the passes meet the runtime."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from itertools import chain
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch.utils._pytree import tree_map

from fxpipe.devices.budgets import (
    MaxMemory,
    Speed,
    parse_max_memory,
    parse_speed,
    stage_budgets,
    stage_speeds,
)
from fxpipe.devices.speeds import device_kind, kind_speeds
from fxpipe.devices.targets import device_capacity, normalize_devices
from fxpipe.errors import ChunksWarning, ConfigError, DeviceError
from fxpipe.ir import (
    LEAST_RECOMPUTATION_FIRST,
    Checkpoints,
    CostMode,
    CostTable,
    PipelinePlan,
    PricingMode,
    StageProgram,
    TracerName,
)
from fxpipe.model_state import preserved
from fxpipe.options import (
    CheckpointChoice,
    ChunksChoice,
    CompileChoice,
    PlanOptions,
    RunOptions,
)
from fxpipe.passes.configure.choose import choose_configuration, chunk_counts
from fxpipe.passes.partition.cost_graph import replicate_shared_weights, to_networkx
from fxpipe.passes.partition.memory import memory_model
from fxpipe.passes.partition.search import Partition, partition_graph
from fxpipe.passes.price.estimate import ValueDependentError, borrowed_costs, estimate_costs
from fxpipe.passes.price.roofline import step_roofline_for
from fxpipe.passes.split.codegen import split_stages
from fxpipe.passes.split.follow import follow_borders
from fxpipe.passes.split.plan import build_plan, training_overflow
from fxpipe.pipeline import Pipeline
from fxpipe.progress import phase, pricing_progress
from fxpipe.trace.batch_checks import check_micro_batches
from fxpipe.trace.constants import fill_meta_constants, place_constants
from fxpipe.trace.example_checks import (
    check_outputs_follow_batch,
    example_args,
    example_batch,
    with_reductions,
)
from fxpipe.trace.tracing import Traced, fake_runnable, trace
from fxpipe.weights.materialise import all_meta, check_meta_pricing, holds_meta, meta_view, on_meta

__all__ = ["plan", "pipeline", "compile_model", "Compiled"]


@dataclass(frozen=True)
class Compiled:
    """Everything the compiler made for one model: traced graph, plan and stage program."""

    traced: Traced
    plan: PipelinePlan
    program: StageProgram

    def pipeline(
        self, model: nn.Module, run: RunOptions, options: PlanOptions | None = None
    ) -> Pipeline:
        """The runnable Pipeline of ``model`` (the model this was compiled from); chunks
        default to the ones the plan assumed (``Pipeline`` resolves them). With
        ``options`` (those it was planned with), a call in another mode or with other
        arguments traces the model again and splits it along this plan's borders."""
        follow = None
        if options is not None:
            follow = functools.partial(_follow, model, self, options)
        plan = self.plan
        checkpoint: Checkpoints
        if run.checkpoint == "auto":  # the plan's choice, per stage
            modes = plan.checkpoint_modes
            checkpoint = modes[0] if len(set(modes)) == 1 else modes
            run = dataclasses.replace(run, checkpoint=checkpoint)
        else:
            checkpoint = run.checkpoint
        chunks = min(run.chunks, plan.costs.batch_size) if run.chunks else plan.chunks
        overflow = (  # planned for inference: what training would need, where it would not fit
            {} if plan.training else training_overflow(plan, chunks=chunks, checkpoint=checkpoint)
        )
        return Pipeline(model, self.traced, plan, self.program, run, follow, overflow)


def plan(
    model: nn.Module,
    example_input: Any,
    devices: Sequence[str | int | torch.device],
    *,
    cost: CostMode | Callable[[fx.Node], float] = "auto",
    tracer: TracerName = "auto",
    example_kwargs: Mapping[str, Any] | None = None,
    chunks: ChunksChoice = None,
    checkpoint: CheckpointChoice = "except_last",
    slack: float = 0.0,
    max_memory: MaxMemory = None,
    speed: Speed = None,
) -> PipelinePlan:
    """Trace ``model``, price its nodes and split them into one stage per device; compile only.

    Nothing runs on ``devices`` (they need not be present, and a model on ``meta`` can be
    planned) and the model is not modified. ``print(plan)`` shows one row per stage;
    ``plan.draw(path)`` pictures it.

    Args:
        model: the ``nn.Module`` to split; its ``forward`` must be traceable by torch.fx or
            torch.export (no Python control flow on tensor values).
        example_input: one batch, as the model is called: a tensor (the only argument) or
            a tuple of positional arguments; a list is refused (wrap it: ``([a, b],)``),
            and so is a dict (a collated batch goes in ``example_kwargs``, with ``()`` here).
            Dim 0 of every tensor is the batch; non-tensor arguments are fixed at these
            values.
        devices: one entry per stage, in pipeline order: ``"cuda:1"``, ``1`` (a CUDA
            index), ``"cpu"`` or a ``torch.device``; repeats are allowed (``["cpu"] * 4``).
        cost: how each node is priced: ``"roofline"`` estimates its forward and backward
            seconds from its FLOPs and bytes on a reference device (runs nothing),
            ``"time"`` profiles it, ``"flops"`` counts analytic FLOPs on fake tensors,
            ``"params"`` weighs its parameter bytes, ``"auto"`` (default) lets fxpipe pick
            for the devices; or a callable ``(torch.fx.Node) -> float``.
        tracer: ``"fx"`` (torch.fx.symbolic_trace), ``"export"`` (torch.export,
            non-strict; fixes train/eval mode and the non-batch shapes) or ``"auto"``
            (default: fx, then export where fx fails).
        example_kwargs: keyword arguments of the example call (``{"mask": m}``).
        chunks: micro-batches per batch that the memory estimates and the predicted bubble
            assume (default: 4 x stages, at most the batch size); ``"auto"``: the count
            with the least predicted step that fits (``plan.configurations()`` lists what
            was weighed).
        checkpoint: the checkpoint mode the training memory estimates assume: one for
            every stage (``"always"``, ``"except_last"``, ``"never"``), one per stage (a
            list), or ``"auto"``: per stage, the least recomputation that fits.
        slack: how far (a fraction: 0.01 = 1%) the bottleneck may grow above the best where
            that sends fewer bytes between stages; 0 (default) keeps the best bottleneck,
            with the fewest bytes among the splits that reach it.
        max_memory: the memory each device's stages may use together, in
            Accelerate's spelling: one amount for every device (``"20GiB"``), one per
            entry of ``devices``, or a mapping device -> amount (``{0: "20GiB", "cpu":
            "60GiB"}``; an int key is a CUDA index). Amounts are bytes (an int) or strings
            with units ``KB``/``MB``/``GB``/``TB`` (powers of 10) or ``KiB``/``MiB``/
            ``GiB``/``TiB`` (powers of 2). The split is searched among those that fit.
            The estimate follows how the model is when planned: in training mode, a
            training step (weights, gradients, Adam state, the activations in flight for
            ``chunks`` and ``checkpoint``); after ``model.eval()`` or under
            ``torch.no_grad()``, inference (the weights once and one micro-batch's
            activations per stage).
            Default: the capacity of each device that is present; nothing is checked for
            one that is not (a ``meta`` device, a GPU absent from this machine).
        speed: the relative throughput of each device, in the same forms (``[1, 3]``: the
            second device is three times as fast): a stage's cost is its nodes' cost
            divided by its device's speed, so the split balances time, and
            ``StagePlan.cost`` is that time. Default: all 1.

    Returns:
        The frozen :class:`fxpipe.PipelinePlan`.

    Raises:
        FxPipeError: for every refusal (``TraceError``, ``PlanError``, ``ConfigError``,
            ``DeviceError``, ``InputError``), naming the value at fault and the remedy.
    """
    options = PlanOptions(
        cost=cost,
        tracer=tracer,
        chunks=chunks,
        checkpoint=checkpoint,  # type: ignore[arg-type]
        slack=slack,
        max_memory=max_memory,
        speed=speed,
    )
    compiled = compile_model(
        model, example_input, devices, options, example_kwargs=example_kwargs, present=False
    )
    return compiled.plan


def pipeline(
    model: nn.Module,
    example_input: Any,
    devices: Sequence[str | int | torch.device],
    *,
    chunks: ChunksChoice = None,
    checkpoint: CheckpointChoice = "except_last",
    cost: CostMode | Callable[[fx.Node], float] = "auto",
    tracer: TracerName = "auto",
    example_kwargs: Mapping[str, Any] | None = None,
    deferred_batch_norm: bool = False,
    output_device: str | int | torch.device | None = None,
    slack: float = 0.0,
    max_memory: MaxMemory = None,
    speed: Speed = None,
    compile: CompileChoice = False,
) -> Pipeline:
    """Split ``model`` into stages over ``devices`` and return a drop-in ``nn.Module``.

    ``pipe(*args, **kwargs)`` returns what ``model(*args, **kwargs)`` returns, with the same
    gradients; the model's own Parameters move (in place) to their stage's device, so an
    optimizer made before keeps working, and ``pipe.state_dict()`` has the model's keys.
    After an error the model is as it was.

    Args:
        model: the ``nn.Module`` to split; its ``forward`` must be traceable by torch.fx or
            torch.export (no Python control flow on tensor values).
        example_input: one batch, as the model is called: a tensor (the only argument) or
            a tuple of positional arguments; a list is refused (wrap it: ``([a, b],)``),
            and so is a dict (a collated batch goes in ``example_kwargs``, with ``()`` here).
            Dim 0 of every tensor is the batch; non-tensor arguments are fixed at these
            values.
        devices: one entry per stage, in pipeline order: ``"cuda:1"``, ``1`` (a CUDA
            index), ``"cpu"`` or a ``torch.device``; repeats are allowed (``["cpu"] * 4``).
        chunks: micro-batches per batch (default: 4 x stages, at most the batch size);
            batches that do not divide evenly, or are smaller, still work. ``"auto"``:
            the count (1, 2, 4, ... 32, the default) whose configuration has the least
            predicted step time and fits ``max_memory`` (``plan.configurations()``).
        checkpoint: which micro-batches each stage recomputes in backward instead of
            keeping their activations: ``"always"``, ``"except_last"`` (default: all but
            the last) or ``"never"``; or one of them per stage (a list, in stage order);
            or ``"auto"``: per stage, the least recomputation that fits ``max_memory``
            (the predicted step decides). Nothing is checkpointed in eval mode or under
            ``torch.no_grad()``.
        cost: how each node is priced: ``"roofline"`` estimates its forward and backward
            seconds from its FLOPs and bytes on a reference device (runs nothing),
            ``"time"`` profiles it, ``"flops"`` counts analytic FLOPs on fake tensors,
            ``"params"`` weighs its parameter bytes, ``"auto"`` (default) lets fxpipe pick
            for the devices; or a callable ``(torch.fx.Node) -> float``.
        tracer: ``"fx"`` (torch.fx.symbolic_trace), ``"export"`` (torch.export,
            non-strict; fixes train/eval mode and the non-batch shapes) or ``"auto"``
            (default: fx, then export where fx fails).
        example_kwargs: keyword arguments of the example call (``{"mask": m}``).
        deferred_batch_norm: BatchNorm in training normalises each micro-batch with its
            own statistics; ``True`` updates the running statistics once per batch, from
            the whole batch, as the model alone would (fx-traced models only). Training
            outputs still use per-micro-batch statistics.
        output_device: where outputs are gathered (default: the first tensor argument's
            device).
        slack: how far (a fraction: 0.01 = 1%) the bottleneck may grow above the best where
            that sends fewer bytes between stages; 0 (default) keeps the best bottleneck,
            with the fewest bytes among the splits that reach it.
        max_memory: the memory each device's stages may use together, in
            Accelerate's spelling: one amount for every device (``"20GiB"``), one per
            entry of ``devices``, or a mapping device -> amount (``{0: "20GiB", "cpu":
            "60GiB"}``; an int key is a CUDA index). Amounts are bytes (an int) or strings
            with units ``KB``/``MB``/``GB``/``TB`` (powers of 10) or ``KiB``/``MiB``/
            ``GiB``/``TiB`` (powers of 2). The split is searched among those that fit.
            The estimate follows how the model is when planned: in training mode, a
            training step (weights, gradients, Adam state, the activations in flight for
            ``chunks`` and ``checkpoint``); after ``model.eval()`` or under
            ``torch.no_grad()``, inference (the weights once and one micro-batch's
            activations per stage).
            Default: the capacity of each device that is present; nothing is checked for
            one that is not (a ``meta`` device, a GPU absent from this machine).
        speed: the relative throughput of each device, in the same forms (``[1, 3]``: the
            second device is three times as fast): a stage's cost is its nodes' cost
            divided by its device's speed, so the split balances time, and
            ``StagePlan.cost`` is that time. Default: all 1.
        compile: run each stage's forward through ``torch.compile``: ``True``, or a dict
            of its settings (``backend``, default ``"inductor"``; ``mode``; ``dynamic``;
            ``fullgraph``, default True here; ``options``). A stage compiles when first
            called, once more when a size changes (the last, shorter micro-batch, another
            batch size or sequence length: those sizes become symbolic, torch's automatic
            dynamic shapes), and once per grad mode and training mode; then no more.
            ``pipe.compilation`` counts and times it. A stage that does not compile runs
            eagerly, with a ``CompileWarning`` naming it and the reason.

    Returns:
        The :class:`fxpipe.Pipeline`; ``pipe.plan`` is its :class:`fxpipe.PipelinePlan`.

    Raises:
        FxPipeError: for every refusal (``TraceError``, ``PlanError``, ``ConfigError``,
            ``DeviceError``, ``InputError``), naming the value at fault and the remedy.

    Warns:
        BatchStatisticsWarning: once per pipeline, at the first training call that splits a
            batch while BatchNorm layers use batch statistics (outputs then differ from the
            model's).
    """
    run = RunOptions.of(
        chunks=chunks,
        checkpoint=checkpoint,
        deferred_batch_norm=deferred_batch_norm,
        output_device=output_device,
        compile=compile,
    )
    options = PlanOptions(
        cost=cost,
        tracer=tracer,
        chunks=chunks,
        checkpoint=checkpoint,  # type: ignore[arg-type]
        slack=slack,
        max_memory=max_memory,
        speed=speed,
    )
    compiled = compile_model(model, example_input, devices, options, example_kwargs=example_kwargs)
    _check_meta_stages(model, compiled.plan.devices)
    if deferred_batch_norm and compiled.traced.tracer != "fx":
        raise ConfigError(
            "deferred_batch_norm=True needs a model traced with torch.fx (this one needed "
            "torch.export, which fixes BatchNorm into the graph); pass deferred_batch_norm=False"
        )
    return compiled.pipeline(model, run, options)


def compile_model(
    model: nn.Module,
    example_input: Any,
    devices: Sequence[Any],
    options: PlanOptions,
    *,
    example_kwargs: Mapping[str, Any] | None = None,
    present: bool = True,
) -> Compiled:
    """Trace, price, partition and split; the steps of :func:`pipeline` before any device
    work. ``present``: the devices must exist here (False for a plan only)."""
    targets = normalize_devices(devices, require_present=present)
    if isinstance(options.checkpoint, tuple) and len(options.checkpoint) != len(targets):
        raise ConfigError(
            f"checkpoint={list(options.checkpoint)!r} has {len(options.checkpoint)} modes but "
            f"there are {len(targets)} stages (devices={[str(d) for d in targets]}); give one "
            "mode per stage, one mode for all, or 'auto'"
        )
    capacity = device_capacity(targets)
    budgets = stage_budgets(parse_max_memory(options.max_memory), targets, capacity)
    speeds = stage_speeds(parse_speed(options.speed), targets)
    with traced_example(
        model,
        example_input,
        example_kwargs,
        tracer=options.tracer,
        pricing=options.pricing(),
        reductions=options.reductions,
        whole=options.chunks == 1,
    ) as (traced, batch):
        if options.replicate_weights:
            replicate_shared_weights(traced.graph_module)
        return _compile_traced(model, traced, batch, targets, budgets, speeds, options)


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
) -> Iterator[tuple[Traced, int]]:
    """``model`` traced on the example, whose outputs are checked to follow its batch; yields
    (the traced model, the batch size). With ``reductions``, outputs that reduce over the
    batch (a loss inside the model) are computed from partial sums per micro-batch
    (:func:`fxpipe.trace.example_checks.with_reductions`); else they are refused. A
    per-sample value computed from a reduction over the batch is refused unless ``whole``
    (the batch runs as one micro-batch). A model built on ``meta`` is traced on a meta copy
    of the example (``pricing`` must not need real values); one that also holds real
    tensors is seen as shapes only for the ``with`` block."""
    if not isinstance(model, nn.Module):
        raise ConfigError(f"model is a {type(model).__name__}, not an nn.Module; pass the module")
    view: AbstractContextManager[Any] = nullcontext()
    if holds_meta(model):  # built on meta: traced and priced on a meta copy of the example
        check_meta_pricing(model, pricing)
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
    model: nn.Module,
    traced: Traced,
    batch: int,
    targets: Sequence[torch.device],
    budgets: Sequence[int | None],
    speeds: tuple[float, ...] | None,
    options: PlanOptions,
) -> Compiled:
    """Price, partition and split a traced model; with ``chunks="auto"`` or
    ``checkpoint="auto"``, for each configuration weighed (:mod:`fxpipe.passes.configure`)."""
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
    return Compiled(traced, the_plan, program)


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


def _check_meta_stages(model: nn.Module, devices: Sequence[torch.device]) -> None:
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


def _follow(
    model: nn.Module,
    leader: Compiled,
    options: PlanOptions,
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any],
) -> tuple[Traced, PipelinePlan, StageProgram]:
    """``model`` traced as it is now (its modules' training modes) for a call of this
    structure, split along ``leader``'s borders (:mod:`fxpipe.passes.split.follow`): a pipeline's
    new variant. Traced on the model as it is, with an empty example of the leader's batch
    size, where all its tensors live on one device (so that code that branches on the
    device, and tensors it makes in forward, are as on that device); else on ``meta`` views
    of both (its tensors live on several devices, which one trace cannot mix), where a
    tensor made in forward takes its values from the first trace
    (:mod:`fxpipe.trace.constants`). Priced by the roofline from the shapes torch.export
    recorded (the borders are the leader's: the costs only describe the stages), which runs
    nothing; a graph that cannot be priced without running it (a node whose output depends
    on tensor values, in an fx graph) takes the leader's prices of the nodes of the same
    name."""
    plan = leader.plan
    batch = plan.costs.batch_size
    place = _one_device(model)
    example = _empty_example((args, dict(kwargs)), batch, place or torch.device("meta"))
    pricing: PricingMode = "roofline"
    view: AbstractContextManager[Any] = (
        nullcontext() if place is not None else meta_view(model, live=True)
    )
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
                place_constants(program.modules, plan.devices, model)
            check_micro_batches(traced, plan.chunks, model)
    return traced, followed, program


def _one_device(model: nn.Module) -> torch.device | None:
    """The device every parameter and buffer of ``model`` lives on; None where they live on
    several, or on ``meta``."""
    found = {t.device for t in chain(model.parameters(), model.buffers())}
    if len(found) != 1:
        return None
    (device,) = found
    return None if device.type == "meta" else device


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
