"""One compiled model at run time: its resolved configuration, the variants of it that run
(one per set of training modes and call structure), the recorder watching them and the
worker threads every variant's executor shares."""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from fxpipe.errors import ChunksWarning, ConfigError, InputError, MemoryEstimateWarning
from fxpipe.ir import Checkpoints, PipelinePlan, StageProgram, ValueRef
from fxpipe.runtime.batchnorm import convert_deferred_batch_norm
from fxpipe.runtime.compiled import StageCompilation, compile_stages
from fxpipe.runtime.config import RunConfig
from fxpipe.runtime.executor import Executor
from fxpipe.runtime.microbatch import gather, scatter
from fxpipe.runtime.placement import place_parameters
from fxpipe.runtime.recording import NO_RECORDER, RunRecorder
from fxpipe.runtime.variants import Retrace, Variant, Variants, check_placement, modes_of
from fxpipe.trace.batch_checks import BatchStatistics, check_micro_batches
from fxpipe.trace.tracing import Traced
from fxpipe.weights.state import module_ids

__all__ = ["Session"]


class Session:
    """Runs ``model``'s stages as ``config`` says. The first variant is the compiled one;
    a call none fits asks ``retrace`` (the compiler's) for a new one, which this session
    then owns (``retrace`` None: such a call is refused). Every tensor a stage holds moves
    to its stage's device when the session is made (:mod:`fxpipe.runtime.placement`)."""

    def __init__(
        self,
        model: nn.Module,
        traced: Traced,
        plan: PipelinePlan,
        program: StageProgram,
        config: RunConfig,
        retrace: Retrace | None = None,
    ) -> None:
        self.model, self.config = model, config
        self.checkpoint: Checkpoints = config.checkpoint
        self.recorder: RunRecorder = NO_RECORDER
        self._overflow = dict(config.training_overflow)
        self._warned_chunks = False
        self.materialised = place_parameters(model, program, config.devices)
        self._modules_at_build = module_ids(model)
        self._workers: Executor | None = None
        first = self._variant(modes_of(model), traced, plan, program)
        self.materialised.settle()  # the checks' fake runs initialise nothing
        if config.deferred_batch_norm:
            first.statistics.warned = True  # asked for: the docs say what it changes
        self._workers = first.executor
        self.variants = Variants(model, first, retrace, self._variant)

    def _variant(
        self, modes: tuple[bool, ...], traced: Traced, plan: PipelinePlan, program: StageProgram
    ) -> Variant:
        """The stages of one trace of the model, ready to run (checked against the
        micro-batches and the devices the first trace placed the tensors on)."""
        config = self.config
        check_micro_batches(traced, config.chunks, self.model)
        check_placement(self.model, program, config.devices)
        if config.deferred_batch_norm:
            for module in program.modules:
                convert_deferred_batch_norm(module)
        labels = [_stage_label(plan, j) for j in range(plan.num_stages)]
        compilation: tuple[StageCompilation, ...] = ()
        if config.compile is not None:
            compilation = compile_stages(program.modules, labels, config.compile)
        executor = Executor(program, config.devices, self.checkpoint, labels=labels)
        executor.recorder = self.recorder
        statistics = BatchStatistics.of(traced)
        if self._workers is not None:  # one worker thread per device for every variant
            executor.workers = self._workers.workers
            executor.use_threads = self._workers.use_threads
            statistics.warned = self.variants.first.statistics.warned
        return Variant(modes, traced, plan, program, executor, statistics, compilation)

    def _executors(self) -> list[Executor]:
        return [variant.executor for variant in self.variants.all]

    def set_checkpoint(self, modes: Checkpoints) -> None:
        """Checkpoint ``modes`` (resolved: :func:`fxpipe.options.checkpoint_of_stages`) for
        every variant, from the next call."""
        self.checkpoint = modes
        for executor in self._executors():
            executor.checkpoint = modes

    @property
    def use_threads(self) -> bool:
        """Whether stages run in one worker thread per device."""
        return self.variants.first.executor.use_threads

    @use_threads.setter
    def use_threads(self, value: bool) -> None:
        for executor in self._executors():
            executor.use_threads = value

    def set_recorder(self, recorder: RunRecorder) -> None:
        """Tell ``recorder`` about every run of every variant (NO_RECORDER: nobody)."""
        if recorder is not NO_RECORDER and self.recorder is not NO_RECORDER:
            raise ConfigError("this pipeline is already being recorded; nest no fxpipe.record()")
        self.recorder = recorder
        for executor in self._executors():
            executor.recorder = recorder

    def train(self, mode: bool) -> None:
        """Every variant's stages in training mode ``mode`` (False: eval)."""
        for variant in self.variants.all:
            for stage in variant.program.modules:
                stage.train(mode)

    @property
    def compilation(self) -> tuple[StageCompilation, ...]:
        """Each variant's stages' compilation records, the first variant's first."""
        return tuple(c for v in self.variants.all for c in v.compilation)

    def check_loaded(self) -> None:
        """UninitialisedError while a tensor made from ``meta`` is still unloaded (before a
        call or a ``generate()``: nothing runs on uninitialised memory)."""
        if self.materialised.active:
            self.materialised.check()

    def run(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """``model(*args, **kwargs)`` as micro-batches through the variant that fits the call
        and the model's modes (made now where none does), in the model's structure."""
        if module_ids(self.model) != self._modules_at_build:
            raise ConfigError(
                "the model's modules changed after pipeline() built its stages (a submodule, "
                "parameter or buffer was replaced, added or removed); call fxpipe.pipeline() "
                "again on the model, or change values in place (param.data.copy_(...))"
            )
        self.check_loaded()
        variant = self.variants.pick(args, kwargs)
        values = variant.traced.binder.bind(args, kwargs)
        device = self.config.output_device or _first_device(values)
        batches = scatter(values, self.config.chunks)
        self._warn_chunks(len(batches))
        variant.statistics.warn_once(len(batches))
        training = self.model.training
        if self._overflow and training and torch.is_grad_enabled():
            self._warn_training()
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
        chunks = self.config.chunks
        if micro_batches >= chunks or self._warned_chunks:
            return
        self._warned_chunks = True
        warnings.warn(
            f"a batch of {micro_batches} samples runs as {micro_batches} micro-batches of "
            f"one sample, fewer than chunks={chunks}: a micro-batch is never empty; "
            "the bubble is larger than the plan predicts (pass larger batches or a smaller "
            "chunks). Said once per pipeline.",
            ChunksWarning,
            stacklevel=4,
        )

    def _warn_training(self) -> None:
        """Once: the plan was checked for inference, and training would not fit."""
        over = "; ".join(
            f"{d} needs ~{n / 2**30:.2f} GiB of {cap / 2**30:.2f} GiB"
            for d, (n, cap) in self._overflow.items()
        )
        self._overflow = {}
        warnings.warn(
            "this pipeline was planned for inference (the model was in eval mode or grad was "
            "disabled when it was built) and is now training, which its split would not fit "
            f"({over}, training estimate); build it with the model in train mode to plan "
            "for training",
            MemoryEstimateWarning,
            stacklevel=4,
        )


def _stage_label(plan: PipelinePlan, j: int) -> str:
    """``stage 1 (blocks.2 to head, on cpu)``: a stage as its modules name it."""
    first, last = plan.stages[j].span
    span = first if first == last else f"{first} to {last}"
    return f"stage {j} ({span + ', ' if span else ''}on {plan.stages[j].device})"


def _first_device(values: tuple[Any, ...]) -> torch.device:
    leaves, _ = tree_flatten(values)
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            return leaf.device
    raise InputError("the call has no tensor argument; pass the batched tensor inputs")
