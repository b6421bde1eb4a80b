"""``fxpipe.Pipeline``: the drop-in ``nn.Module`` that runs a compiled model's stages.

The user's model stays the single owner of every Parameter and buffer: they move in place
to their stage's device, ``parameters()`` yields them, and ``state_dict()`` has exactly
the model's keys. The stage GraphModules reference the same objects.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from fxpipe.devices.targets import same_device
from fxpipe.errors import (
    ChunksWarning,
    ConfigError,
    InputError,
    MemoryEstimateWarning,
    PlanError,
)
from fxpipe.interop.trainers import DropIn
from fxpipe.ir import CheckpointMode, Checkpoints, PipelinePlan, StageProgram, ValueRef
from fxpipe.options import RunOptions, check_checkpoint
from fxpipe.runtime.batchnorm import convert_deferred_batch_norm
from fxpipe.runtime.compiled import StageCompilation, compile_stages
from fxpipe.runtime.executor import Executor
from fxpipe.runtime.microbatch import gather, scatter
from fxpipe.runtime.recording import NO_RECORDER, RunRecorder
from fxpipe.runtime.variants import Follow, Variant, Variants, check_placement, modes_of
from fxpipe.trace.batch_checks import BatchStatistics, check_micro_batches
from fxpipe.trace.tracing import Traced
from fxpipe.weights.materialise import Materialised

__all__ = ["Pipeline"]


class Pipeline(DropIn):
    """A model split into stages over devices, run as a GPipe pipeline of micro-batches.

    Made by :func:`fxpipe.pipeline`. ``pipe(*args, **kwargs)`` returns what the model
    returns, with the same gradients; ``parameters()``, ``state_dict()`` and
    ``load_state_dict()`` are the model's own. Attributes: ``plan`` (the PipelinePlan),
    ``stages`` (stage GraphModules in order), ``devices``, ``chunks``, ``checkpoint`` and
    ``output_device``; ``module`` is the user's model. :meth:`attach_recorder` lets a
    recorder (``fxpipe.record``) see every task the pipeline runs.
    """

    def __init__(
        self,
        model: nn.Module,
        traced: Traced,
        plan: PipelinePlan,
        program: StageProgram,
        run: RunOptions,
        follow: Follow | None = None,
        overflow: Mapping[str, tuple[int, int]] | None = None,
    ) -> None:
        """``follow``: traces the model again for a call of another mode or structure (none:
        such a call is refused); ``overflow``: for a plan made for inference, each device
        its split would not fit in training, with the bytes needed and the capacity (warned
        about at the first training call)."""
        super().__init__()
        # what the example batch runs as: chunks (the plan's by default), at most its size
        chunks = min(run.chunks, plan.costs.batch_size) if run.chunks else plan.chunks
        self.module = model
        self.plan = plan
        self.devices = tuple(plan.devices)
        self.chunks = chunks
        self.output_device = run.output_device
        self._checkpoint: Checkpoints = _stage_modes(run.checkpoint, plan.num_stages)
        self._run_options = run
        self._recorder: RunRecorder = NO_RECORDER
        self._use_threads: bool | None = None
        self._warned_chunks = False
        self._materialised = _place_parameters(model, program, self.devices)
        first = self._variant(modes_of(model), traced, plan, program)
        if run.deferred_batch_norm:
            first.statistics.warned = True  # asked for: the docs say what it changes
        self._variants = Variants(model, first, follow, self._variant)
        self._modules_at_build = _module_ids(model)
        self.training = model.training
        self._training_overflow = dict(overflow or {})
        self._stand_in_for(model)  # forward's signature, to(), config...: fxpipe.interop.trainers

    def _variant(
        self,
        modes: tuple[bool, ...],
        traced: Traced,
        plan: PipelinePlan,
        program: StageProgram,
    ) -> Variant:
        """The stages of one trace of the model, ready to run (checked against the
        micro-batches and the devices the first trace placed the tensors on)."""
        check_micro_batches(traced, self.chunks, self.module)
        check_placement(self.module, program, self.devices)
        if self._run_options.deferred_batch_norm:
            for module in program.modules:
                convert_deferred_batch_norm(module)
        labels = [_stage_label(plan, j) for j in range(plan.num_stages)]
        compiled = self._run_options.compile
        compilation = () if compiled is None else compile_stages(program.modules, labels, compiled)
        executor = Executor(program, self.devices, self.checkpoint, labels=labels)
        executor.recorder = self._recorder
        if self._use_threads is not None:
            executor.use_threads = self._use_threads
        variants: Variants | None = getattr(self, "_variants", None)
        if variants is not None:  # one worker thread per device for every variant
            executor.workers = variants.first.executor.workers
        statistics = BatchStatistics.of(traced)
        if variants is not None:
            statistics.warned = variants.first.statistics.warned
        return Variant(modes, traced, plan, program, executor, statistics, compilation)

    @property
    def _traced(self) -> Traced:
        return self._variants.first.traced

    @property
    def _program(self) -> StageProgram:
        return self._variants.first.program

    @property
    def _executor(self) -> Executor:
        return self._variants.first.executor

    @property
    def variants(self) -> tuple[Variant, ...]:
        """Every form of the model this pipeline has traced and runs: the first (whose plan
        is :attr:`plan`), and one for each other set of training modes or call structure it
        was called with (:mod:`fxpipe.runtime.variants`)."""
        return tuple(self._variants.all)

    @property
    def compilation(self) -> tuple[StageCompilation, ...]:
        """With ``compile=``: what compiling each stage came to (graphs compiled, seconds,
        or why it runs eagerly), the first variant's stages first, then each other
        variant's (empty without ``compile=``)."""
        return tuple(c for v in self._variants.all for c in v.compilation)

    @property
    def stages(self) -> tuple[torch.fx.GraphModule, ...]:
        """The stage GraphModules, in pipeline order (``stages[j]`` runs on ``devices[j]``)."""
        return self._program.modules

    @property
    def checkpoint(self) -> Checkpoints:
        """Which micro-batches each stage recomputes in backward (``"always"``,
        ``"except_last"`` or ``"never"``; a tuple of one per stage where they differ);
        settable to a mode or one per stage, it applies from the next call."""
        return self._checkpoint

    @checkpoint.setter
    def checkpoint(self, mode: CheckpointMode | Sequence[CheckpointMode]) -> None:
        modes = _stage_modes(check_checkpoint(mode), self.plan.num_stages)
        self._checkpoint = modes
        for variant in self._variants.all:
            variant.executor.checkpoint = modes

    @property
    def use_threads(self) -> bool:
        """Whether stages run in one worker thread per device. On by default when the stages
        span several devices; with one device they run in the calling thread (nothing to
        overlap) unless this is set to ``True``."""
        return self._executor.use_threads

    @use_threads.setter
    def use_threads(self, value: bool) -> None:
        self._use_threads = value
        for variant in self._variants.all:
            variant.executor.use_threads = value

    @contextmanager
    def attach_recorder(self, recorder: RunRecorder) -> Iterator[None]:
        """Within a ``with`` block, tell ``recorder`` about every run, cell and transfer.

        ``with pipe.attach_recorder(recorder):`` hands ``recorder`` (a
        ``fxpipe.runtime.recording.RunRecorder``, such as the timing ``Recorder`` that
        :func:`fxpipe.record` attaches) every call the pipeline runs inside the block; it
        is detached when the block ends, also when the block raises. Outside a block the
        pipeline runs with a recorder that records nothing.

        Raises:
            ConfigError: another recorder is attached; one recording at a time.
        """
        if self._recorder is not NO_RECORDER:
            raise ConfigError("this pipeline is already being recorded; nest no fxpipe.record()")
        self._set_recorder(recorder)
        try:
            yield
        finally:
            self._set_recorder(NO_RECORDER)

    def _set_recorder(self, recorder: RunRecorder) -> None:
        self._recorder = recorder
        for variant in self._variants.all:
            variant.executor.recorder = recorder

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run ``model(*args, **kwargs)`` as micro-batches through the stages; the output has
        the model's structure, on ``output_device`` (default: the first tensor's device).

        The model runs in the mode its modules are in (``pipe.train()``/``pipe.eval()``, or
        the model's own): a call in a mode, or with arguments, the pipeline has not run yet
        traces the model again for it first, split along the same borders
        (:attr:`variants`). Arguments are checked against what the trace fixed (the same
        non-tensor values, one batch size on dim 0, sizes the model's code fixes): a
        mismatch is an ``InputError``. Torch's RuntimeError inside a stage (a shape error,
        say) becomes a ``StageRunError`` naming the stage, the micro-batch and its rows of
        the batch; other exceptions keep their type and get that as a note.
        """
        self._check_unchanged()
        if self._materialised.active:  # built on meta: every tensor must be loaded
            self._materialised.check()
        variant = self._variants.pick(args, kwargs)
        values = variant.traced.binder.bind(args, kwargs)
        device = self.output_device or _first_device(values)
        batches = scatter(values, self.chunks)
        self._warn_chunks(len(batches))
        variant.statistics.warn_once(len(batches))
        if self._training_overflow and self.training and torch.is_grad_enabled():
            self._warn_training()
        training = self.module.training
        for stage in variant.program.modules:  # checkpointing follows the model's mode
            stage.training = training
        results = variant.executor.run(batches, variant.wanted)
        program = variant.program
        flat = [
            [env[x.name] if isinstance(x, ValueRef) else x for x in program.output_leaves]
            for env in results
        ]
        finalize = variant.traced.finalize
        if finalize is None:
            return tree_unflatten(gather(flat, device), program.output_spec)
        joined = gather(flat, device, finalize.joins)
        read = [values[i] for i in finalize.inputs]
        leaves = finalize.graph_module(*joined, *read, device)
        return tree_unflatten(list(leaves), program.output_spec)

    def _warn_chunks(self, micro_batches: int) -> None:
        """Once: a batch smaller than ``chunks`` runs fewer micro-batches (one per sample)."""
        if micro_batches >= self.chunks or self._warned_chunks:
            return
        self._warned_chunks = True
        warnings.warn(
            f"a batch of {micro_batches} samples runs as {micro_batches} micro-batches of "
            f"one sample, fewer than chunks={self.chunks}: a micro-batch is never empty; "
            "the bubble is larger than the plan predicts (pass larger batches or a smaller "
            "chunks). Said once per pipeline.",
            ChunksWarning,
            stacklevel=3,
        )

    def _warn_training(self) -> None:
        """Once: the plan was checked for inference, and training would not fit."""
        over = "; ".join(
            f"{d} needs ~{n / 2**30:.2f} GiB of {cap / 2**30:.2f} GiB"
            for d, (n, cap) in self._training_overflow.items()
        )
        self._training_overflow = {}
        warnings.warn(
            "this pipeline was planned for inference (the model was in eval mode or grad was "
            "disabled when it was built) and is now training, which its split would not fit "
            f"({over}, training estimate); build it with the model in train mode to plan "
            "for training",
            MemoryEstimateWarning,
            stacklevel=3,
        )

    def train(self, mode: bool = True) -> Pipeline:
        """Set training mode (``mode=False``: eval) on the pipeline, its stages and the model;
        the next call runs the model in that mode."""
        super().train(mode)
        for variant in self._variants.all:
            for stage in variant.program.modules:
                stage.train(mode)
        return self

    @property
    def materialised(self) -> Materialised:
        """For a model built on ``meta``: which of its tensors were made on their stage's
        device, which are still unloaded, and the non-persistent buffers a load may fill
        (``fxpipe.load_checkpoint`` marks what it loads here)."""
        return self._materialised

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        """The model's own state dict (same keys as ``model.state_dict()``, the same values).

        A tensor the model holds under several names (an embedding tied to the LM head)
        is the model's own under the first and a copy under the others, as a file holds
        it: ``safetensors`` refuses a dict whose entries share memory, and trainers that
        take any ``nn.Module`` (``transformers.Trainer``) save this dict with it. With
        ``keep_vars=True`` every entry is the model's own tensor."""
        state = self.module.state_dict(*args, **kwargs)
        if kwargs.get("keep_vars") or (len(args) > 2 and args[2]):
            return state
        prefix = kwargs.get("prefix", args[1] if len(args) > 1 else "")
        return _unshared(state, str(prefix))

    def load_state_dict(
        self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False
    ) -> Any:
        """Load the model's own checkpoint; values are copied onto each stage's device.

        A model built on ``meta`` also takes its non-persistent buffers here (state_dict()
        leaves them out, and they hold no values until loaded)."""
        if assign:
            raise ConfigError(
                "load_state_dict(assign=True) would replace the Parameters the stages hold; "
                "use assign=False"
            )
        return self._materialised.load_state_dict(self.module, state_dict, strict)

    def extra_repr(self) -> str:
        """What ``repr(pipe)`` shows beside the model: stages, devices, chunks, checkpoint."""
        devices = ", ".join(str(d) for d in self.devices)
        return (
            f"stages={len(self.devices)}, devices=[{devices}], chunks={self.chunks}, "
            f"checkpoint={self.checkpoint!r}"
        )

    def _check_unchanged(self) -> None:
        if _module_ids(self.module) != self._modules_at_build:
            raise ConfigError(
                "the model's modules changed after pipeline() built its stages (a submodule, "
                "parameter or buffer was replaced, added or removed); call fxpipe.pipeline() "
                "again on the model, or change values in place (param.data.copy_(...))"
            )


def _unshared(state: Any, prefix: str) -> Any:
    """``state`` with the entries under ``prefix`` whose memory an earlier entry holds
    replaced by copies (in place; ``state`` is returned)."""
    seen: set[tuple[int, int, tuple[int, ...], tuple[int, ...]]] = set()
    for key in [k for k in state if str(k).startswith(prefix)]:
        value = state[key]
        if not isinstance(value, torch.Tensor) or value.is_meta or value.numel() == 0:
            continue
        where = (
            value.untyped_storage().data_ptr(),
            int(value.storage_offset()),
            tuple(value.shape),
            tuple(value.stride()),
        )
        if where in seen:
            state[key] = value.clone()
        seen.add(where)
    return state


def _stage_label(plan: PipelinePlan, j: int) -> str:
    """``stage 1 (blocks.2 to head, on cpu)``: a stage as its modules name it."""
    first, last = plan.stages[j].span
    span = first if first == last else f"{first} to {last}"
    return f"stage {j} ({span + ', ' if span else ''}on {plan.stages[j].device})"


def _module_ids(model: nn.Module) -> list[int]:
    """The identity of every module of the model and of each one's parameters and buffers,
    in module order (cheap enough to compare on every call)."""
    return [
        id(x)
        for m in model.modules()
        for x in (m, *m._modules.values(), *m._parameters.values(), *m._buffers.values())
    ]


def _first_device(values: tuple[Any, ...]) -> torch.device:
    leaves, _ = tree_flatten(values)
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            return leaf.device
    raise InputError("the call has no tensor argument; pass the batched tensor inputs")


def _stage_modes(checkpoint: Any, stages: int) -> Checkpoints:
    """``checkpoint`` (a mode, or one per stage) as the pipeline keeps it: one mode where
    every stage has the same; ConfigError for a count of modes that is not ``stages``."""
    if isinstance(checkpoint, str):
        return checkpoint  # type: ignore[return-value]
    modes = tuple(checkpoint)
    if len(modes) != stages:
        raise ConfigError(
            f"checkpoint={list(modes)!r} has {len(modes)} modes for {stages} stages; give one "
            "mode per stage, or one mode for all"
        )
    return modes[0] if len(set(modes)) == 1 else modes


def _place_parameters(
    model: nn.Module, program: StageProgram, devices: tuple[torch.device, ...]
) -> Materialised:
    """Move every parameter and buffer a stage holds to that stage's device, in place
    (``.data`` is replaced, the objects stay); one on ``meta`` is made there, uninitialised
    (:mod:`fxpipe.weights.materialise`); all or nothing."""
    _check_one_device_each(model, program, devices)
    moved: list[tuple[torch.Tensor, torch.Tensor]] = []
    made = Materialised(model)
    try:
        for module, device in zip(program.modules, devices):
            for tensor in _held_tensors(module):
                if tensor.is_meta and device.type != "meta":
                    made.make(tensor, device)
                elif not same_device(tensor.device, device):
                    moved.append((tensor, tensor.data))
                    tensor.data = tensor.data.to(device)
        made.finish(devices)
    except BaseException:
        for tensor, old in reversed(moved):
            tensor.data = old
        made.undo()
        raise
    return made


def _check_one_device_each(
    model: nn.Module, program: StageProgram, devices: tuple[torch.device, ...]
) -> None:
    """A Parameter or buffer two stages on different devices hold cannot live on both; the
    planner passes such a tensor on from one stage, so this is a planning fault, refused
    before anything moves."""
    home: dict[int, int] = {}
    for j, module in enumerate(program.modules):
        for tensor in _held_tensors(module):
            i = home.setdefault(id(tensor), j)
            if i != j and not same_device(devices[i], devices[j]):
                names = [n for n, t in _named_tensors(model) if t is tensor] or ["a tensor"]
                raise PlanError(
                    f"{names[0]} is held by stage {i} (on {devices[i]}) and stage {j} (on "
                    f"{devices[j]}), so it cannot be placed; this is an fxpipe planning fault: "
                    "report it with the model, and meanwhile pass tracer='export' or put the "
                    "two stages on one device"
                )


def _named_tensors(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    yield from model.named_parameters(remove_duplicate=False)
    yield from model.named_buffers(remove_duplicate=False)


def _held_tensors(module: nn.Module) -> Iterator[torch.Tensor]:
    seen: set[int] = set()
    for t in [*module.parameters(), *module.buffers()]:
        if id(t) not in seen:
            seen.add(id(t))
            yield t
