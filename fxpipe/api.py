"""``fxpipe.plan`` and ``fxpipe.pipeline``: the front door. Each option is checked once into
its record (:mod:`fxpipe.options`); the compiler (:mod:`fxpipe.compiler`) makes the plan, the
stage programs and the resolved run configuration; the runtime's session
(:mod:`fxpipe.runtime.session`) runs them, and :class:`fxpipe.Pipeline` is what users hold.
The options both functions take are documented once (:data:`_OPTIONS`)."""

from __future__ import annotations

import textwrap
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from fxpipe.compiler import Compiled, Retracer, check_meta_stages, compile_model, resolve_run
from fxpipe.devices.budgets import MaxMemory, Speed
from fxpipe.errors import ConfigError
from fxpipe.ir import CostMode, PipelinePlan, TracerName
from fxpipe.options import (
    CheckpointChoice,
    ChunksChoice,
    CompileChoice,
    PlanOptions,
    RunOptions,
)
from fxpipe.pipeline import Pipeline
from fxpipe.runtime.session import Session

__all__ = ["plan", "pipeline", "pipeline_of"]


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
    options = _plan_options(cost, tracer, chunks, checkpoint, slack, max_memory, speed)
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
    run = RunOptions.of(
        chunks=chunks, checkpoint=checkpoint, deferred_batch_norm=deferred_batch_norm,
        output_device=output_device, compile=compile,
    )  # fmt: skip
    options = _plan_options(cost, tracer, chunks, checkpoint, slack, max_memory, speed)
    compiled = compile_model(model, example_input, devices, options, example_kwargs=example_kwargs)
    check_meta_stages(model, compiled.plan.devices)
    if deferred_batch_norm and compiled.traced.tracer != "fx":
        raise ConfigError(
            "deferred_batch_norm=True needs a model traced with torch.fx (this one needed "
            "torch.export, which fixes BatchNorm into the graph); pass deferred_batch_norm=False"
        )
    return pipeline_of(model, compiled, run, options)


def pipeline_of(
    model: nn.Module, compiled: Compiled, run: RunOptions, options: PlanOptions | None = None
) -> Pipeline:
    """The Pipeline that runs ``compiled`` (compiled from ``model``) as ``run`` says, its
    options resolved against the plan (:func:`fxpipe.compiler.resolve_run`). With
    ``options`` (those it was planned with), a call in another mode or with other arguments
    traces the model again and splits it along the plan's borders; without, it is refused.
    One compilation may run under several ``run`` records (the tests do)."""
    retrace = None if options is None else Retracer(model, compiled, options)
    config = resolve_run(compiled.plan, run)
    session = Session(model, compiled.traced, compiled.plan, compiled.program, config, retrace)
    return Pipeline(model, compiled.plan, session)


def _plan_options(
    cost: Any, tracer: Any, chunks: Any, checkpoint: Any, slack: Any, max_memory: Any, speed: Any
) -> PlanOptions:
    """The planning options both functions take, as one checked record."""
    return PlanOptions(
        cost=cost, tracer=tracer, chunks=chunks, checkpoint=checkpoint, slack=slack,
        max_memory=max_memory, speed=speed,
    )  # fmt: skip


#: What each option means, for both functions (``chunks`` and ``checkpoint`` mean what a plan
#: assumes to :func:`plan`, what runs to :func:`pipeline`: ``_PLAN_ONLY``, ``_RUN_ONLY``).
_OPTIONS: dict[str, str] = {
    "model": (
        "the ``nn.Module`` to split; its ``forward`` must be traceable by torch.fx or "
        "torch.export (no Python control flow on tensor values)."
    ),
    "example_input": (
        "one batch, as the model is called: a tensor (the only argument) or a tuple of "
        "positional arguments; a list is refused (wrap it: ``([a, b],)``), and so is a "
        "dict (a collated batch goes in ``example_kwargs``, with ``()`` here). Dim 0 of "
        "every tensor is the batch; non-tensor arguments are fixed at these values."
    ),
    "devices": (
        'one entry per stage, in pipeline order: ``"cuda:1"``, ``1`` (a CUDA index), '
        '``"cpu"`` or a ``torch.device``; repeats are allowed (``["cpu"] * 4``).'
    ),
    "cost": (
        'how each node is priced: ``"roofline"`` estimates its forward and backward '
        "seconds from its FLOPs and bytes on a reference device (runs nothing), "
        '``"time"`` profiles it, ``"flops"`` counts analytic FLOPs on fake tensors, '
        '``"params"`` weighs its parameter bytes, ``"auto"`` (default) lets fxpipe pick '
        "for the devices; or a callable ``(torch.fx.Node) -> float``."
    ),
    "tracer": (
        '``"fx"`` (torch.fx.symbolic_trace), ``"export"`` (torch.export, non-strict; '
        'fixes train/eval mode and the non-batch shapes) or ``"auto"`` (default: fx, '
        "then export where fx fails)."
    ),
    "example_kwargs": ('keyword arguments of the example call (``{"mask": m}``).'),
    "slack": (
        "how far (a fraction: 0.01 = 1%) the bottleneck may grow above the best where "
        "that sends fewer bytes between stages; 0 (default) keeps the best bottleneck, "
        "with the fewest bytes among the splits that reach it."
    ),
    "max_memory": (
        "the memory each device's stages may use together, in Accelerate's spelling: "
        'one amount for every device (``"20GiB"``), one per entry of ``devices``, or a '
        'mapping device -> amount (``{0: "20GiB", "cpu": "60GiB"}``; an int key is a '
        "CUDA index). Amounts are bytes (an int) or strings with units "
        "``KB``/``MB``/``GB``/``TB`` (powers of 10) or ``KiB``/``MiB``/ ``GiB``/``TiB`` "
        "(powers of 2). The split is searched among those that fit. The estimate "
        "follows how the model is when planned: in training mode, a training step "
        "(weights, gradients, Adam state, the activations in flight for ``chunks`` and "
        "``checkpoint``); after ``model.eval()`` or under ``torch.no_grad()``, "
        "inference (the weights once and one micro-batch's activations per stage). "
        "Default: the capacity of each device that is present; nothing is checked for "
        "one that is not (a ``meta`` device, a GPU absent from this machine)."
    ),
    "speed": (
        "the relative throughput of each device, in the same forms (``[1, 3]``: the "
        "second device is three times as fast): a stage's cost is its nodes' cost "
        "divided by its device's speed, so the split balances time, and "
        "``StagePlan.cost`` is that time. Default: all 1."
    ),
}
_PLAN_ONLY: dict[str, str] = {
    "chunks": (
        "micro-batches per batch that the memory estimates and the predicted bubble "
        'assume (default: 4 x stages, at most the batch size); ``"auto"``: the count '
        "with the least predicted step that fits (``plan.configurations()`` lists what "
        "was weighed)."
    ),
    "checkpoint": (
        "the checkpoint mode the training memory estimates assume: one for every stage "
        '(``"always"``, ``"except_last"``, ``"never"``), one per stage (a list), or '
        '``"auto"``: per stage, the least recomputation that fits.'
    ),
}
_RUN_ONLY: dict[str, str] = {
    "chunks": (
        "micro-batches per batch (default: 4 x stages, at most the batch size); batches "
        'that do not divide evenly, or are smaller, still work. ``"auto"``: the count '
        "(1, 2, 4, ... 32, the default) whose configuration has the least predicted "
        "step time and fits ``max_memory`` (``plan.configurations()``)."
    ),
    "checkpoint": (
        "which micro-batches each stage recomputes in backward instead of keeping their "
        'activations: ``"always"``, ``"except_last"`` (default: all but the last) or '
        '``"never"``; or one of them per stage (a list, in stage order); or ``"auto"``: '
        "per stage, the least recomputation that fits ``max_memory`` (the predicted "
        "step decides). Nothing is checkpointed in eval mode or under "
        "``torch.no_grad()``."
    ),
    "deferred_batch_norm": (
        "BatchNorm in training normalises each micro-batch with its own statistics; "
        "``True`` updates the running statistics once per batch, from the whole batch, "
        "as the model alone would (fx-traced models only). Training outputs still use "
        "per-micro-batch statistics."
    ),
    "output_device": ("where outputs are gathered (default: the first tensor argument's device)."),
    "compile": (
        "run each stage's forward through ``torch.compile``: ``True``, or a dict of its "
        'settings (``backend``, default ``"inductor"``; ``mode``; ``dynamic``; '
        "``fullgraph``, default True here; ``options``). A stage compiles when first "
        "called, once more when a size changes (the last, shorter micro-batch, another "
        "batch size or sequence length: those sizes become symbolic, torch's automatic "
        "dynamic shapes), and once per grad mode and training mode; then no more. "
        "``pipe.compilation`` counts and times it. A stage that does not compile runs "
        "eagerly, with a ``CompileWarning`` naming it and the reason."
    ),
}


def _docstring(head: str, names: Sequence[str], own: Mapping[str, str], tail: str) -> str:
    """A function's docstring: ``head``, its arguments in the order of ``names`` (their
    text from ``own``, else from :data:`_OPTIONS`), then ``tail``."""
    lines = [head, "", "Args:"]
    for name in names:
        text = own.get(name, _OPTIONS.get(name, ""))
        lines.append(
            textwrap.fill(
                f"{name}: {text}", width=92, initial_indent="    ",
                subsequent_indent="        ", break_on_hyphens=False,
            )
        )  # fmt: skip
    return "\n".join([*lines, "", tail])


plan.__doc__ = _docstring(
    """Trace ``model``, price its nodes and split them into one stage per device; compile only.

Nothing runs on ``devices`` (they need not be present, and a model on ``meta`` can be
planned) and the model is not modified. ``print(plan)`` shows one row per stage;
``plan.draw(path)`` pictures it.""",
    ["model", "example_input", "devices", "cost", "tracer", "example_kwargs", "chunks",
     "checkpoint", "slack", "max_memory", "speed"],
    _PLAN_ONLY,
    """Returns:
    The frozen :class:`fxpipe.PipelinePlan`.

Raises:
    FxPipeError: for every refusal (``TraceError``, ``PlanError``, ``ConfigError``,
        ``DeviceError``, ``InputError``), naming the value at fault and the remedy.""",
)  # fmt: skip
pipeline.__doc__ = _docstring(
    """Split ``model`` into stages over ``devices`` and return a drop-in ``nn.Module``.

``pipe(*args, **kwargs)`` returns what ``model(*args, **kwargs)`` returns, with the same
gradients; the model's own Parameters move (in place) to their stage's device, so an
optimizer made before keeps working, and ``pipe.state_dict()`` has the model's keys.
After an error the model is as it was.""",
    ["model", "example_input", "devices", "chunks", "checkpoint", "cost", "tracer",
     "example_kwargs", "deferred_batch_norm", "output_device", "slack", "max_memory", "speed",
     "compile"],
    _RUN_ONLY,
    """Returns:
    The :class:`fxpipe.Pipeline`; ``pipe.plan`` is its :class:`fxpipe.PipelinePlan`.

Raises:
    FxPipeError: for every refusal (``TraceError``, ``PlanError``, ``ConfigError``,
        ``DeviceError``, ``InputError``), naming the value at fault and the remedy.

Warns:
    BatchStatisticsWarning: once per pipeline, at the first training call that splits a
        batch while BatchNorm layers use batch statistics, or ops mix the batch's rows
        (outputs then differ from the model's).""",
)  # fmt: skip
