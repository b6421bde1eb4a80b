"""One rank's part of a distributed pipeline, :class:`DistributedPipeline`: its torch stages
(``stage.py``) and schedule, its parameters and state-dict shard, the gradients of parameters
shared with other ranks (``gradients.py``) and its checkpoints (``checkpoint.py``)."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from os import PathLike
from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx
from torch import nn
from torch.distributed.pipelining.microbatch import split_args_kwargs_into_chunks
from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class
from torch.utils._pytree import tree_unflatten

from fxpipe.distributed.options import ASYNC, SPLIT_BACKWARD, ScheduleOptions
from fxpipe.distributed.parallel.mesh import Layout
from fxpipe.distributed.parallel.ownership import Ownership, full_tensor, merge_state_dicts
from fxpipe.distributed.planning.auto import ScheduleChoice
from fxpipe.distributed.planning.tensor_parallel import cut_dims, parallelize_stages
from fxpipe.distributed.rank.asynchronous import AsyncSchedule
from fxpipe.distributed.rank.checkpoint import (
    load_state,
    optimizer_state,
    save_state,
    set_optimizer_state,
)
from fxpipe.distributed.rank.generate import Generates
from fxpipe.distributed.rank.gradients import sum_tied_gradients
from fxpipe.distributed.rank.losses import StructuredLoss
from fxpipe.distributed.rank.shapes import Metas, StageShapes, meta_like, tensors
from fxpipe.distributed.rank.stage import Stage, StageModule, taken_metas
from fxpipe.distributed.rank.step_shapes import StepShapes
from fxpipe.distributed.rank.strides import Strides
from fxpipe.distributed.rank.tied_guard import TiedGuard
from fxpipe.errors import ConfigError
from fxpipe.ir import PipelinePlan, StageProgram, ValueRef
from fxpipe.options import CompileOptions
from fxpipe.passes.tensor.records import TensorPlan
from fxpipe.runtime.compiled import StageCompilation, compile_stages
from fxpipe.runtime.variants import modes_of
from fxpipe.trace.batch_checks import BatchStatistics
from fxpipe.trace.binding import InputBinder

__all__ = ["DistributedPipeline"]


class DistributedPipeline(Generates):
    """This rank's part of a pipeline, made by :func:`fxpipe.distributed.pipeline_schedule`.

    - ``schedule``: the torch schedule; ``schedule.step(x, target=y, losses=losses)`` on
      the ranks with ``is_first`` / ``is_last``, ``schedule.step()`` elsewhere.
    - ``plan``: the fxpipe plan every rank computed; ``stage_indices``: this rank's stages;
      ``stage_modules``: their GraphModules; ``stages``: their torch ``PipelineStage``.
    - ``parameters()`` for this rank's optimizer; ``sync_tied_gradients()`` before its step.
    - ``state_dict()`` / ``load_stage_state_dict()``: this rank's shard under the model's keys.
    - ``schedule_choice``: with ``n_microbatches`` or ``schedule`` ``"auto"``, what was chosen
      and the layouts it was chosen from (``.summary()``); None when both were given.
    - ``tensor_plan``: with ``tensor_parallel="auto"``, the plan each stage is cut by
      (``.summary()``); None without tensor parallelism.
    """

    schedule_choice: ScheduleChoice | None = None

    def __init__(
        self,
        model: nn.Module,
        plan: PipelinePlan,
        program: StageProgram,
        binder: InputBinder,
        shapes: StageShapes,
        ranks: tuple[int, ...],
        layout: Layout,
        device: torch.device,
        options: ScheduleOptions,
        *,
        loss_fn: Callable[..., torch.Tensor] | None,
        statistics: BatchStatistics | None = None,
        step_shapes: StepShapes | None = None,
        whole: frozenset[int] = frozenset(),
        tensor_plan: TensorPlan | None = None,
    ) -> None:
        """This rank's stages of ``program`` (``ranks``: each stage's pipeline rank, in
        ``layout``'s ``"pp"`` group), on ``device``, with the boundary values of one
        micro-batch in ``shapes`` (the first stage's inputs: the model's positional
        arguments), as ``options`` says; ``whole``: the Parameters FSDP leaves whole;
        ``tensor_plan``: each stage cut over ``layout.tp_mesh`` as it says (its cut
        Parameters then DTensors, in the model too)."""
        group = layout.pp_group
        self.plan, self.group, self.device, self.options = plan, group, device, options
        self.tensor_plan = tensor_plan
        self._modes = modes_of(model)  # the training modes it was traced in
        self.layout = layout
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        self.num_stages = plan.num_stages
        self.stage_indices = tuple(j for j, r in enumerate(ranks) if r == self.rank)
        self.is_first = 0 in self.stage_indices
        self.is_last = self.num_stages - 1 in self.stage_indices
        self._leaves, self._spec = program.output_leaves, program.output_spec
        self._model, self._program, self._ranks = model, program, ranks
        self._own = Ownership(model, program, ranks, self.rank, whole)
        roots = [model, plan.graph_module, *program.modules]
        self._own.place(device, roots)
        self._programs = self._stage_programs(program, roots, tensor_plan)
        self.stage_modules = tuple(self._programs[j] for j in self.stage_indices)
        labels = [f"stage {j} (rank {self.rank}, on {device})" for j in self.stage_indices]
        #: With ``compile=``: what compiling each of this rank's stages came to.
        compiled = CompileOptions.of(options.compile)  # the record's (already checked)
        self.compilation: tuple[StageCompilation, ...] = (
            () if compiled is None else compile_stages(self.stage_modules, labels, compiled)
        )
        kept = [t for k, _, t in self._own.replicated if k in self._own.whole_keys]
        self._whole = {id(t) for t in kept if t is not None}  # left whole by FSDP (placed)
        # stages holding a trained Parameter their outputs do not depend on (none: unknown)
        self._idle = shapes.idle or (True,) * plan.num_stages
        self._tied = TiedGuard(self._own)
        copies = options.schedule in SPLIT_BACKWARD
        n_microbatches = options.n_microbatches
        self._statistics, self._n_microbatches = statistics, n_microbatches
        self._step_shapes = step_shapes
        self._layouts: tuple[tuple[Strides, ...], ...] | None = shapes.layouts
        slots = _parameter_slots(self.stage_modules)
        self.stages = tuple(
            self._stage(program, binder if j == 0 else None, shapes.metas[j], j, copies)
            for j in self.stage_indices
        )
        if self.layout.replaces_parameters:  # fully_shard or replicate put DTensor Parameters
            sharded = {id(old): getattr(module, name) for module, name, old in slots}
            self._own.adopt(sharded, [model, plan.graph_module, *program.modules])
        # scale_grads divides each micro-batch loss's gradient (see losses.MeanLoss), not the
        # gradients at the end of the step as torch does (scale_grads=False to torch)
        scale = n_microbatches if options.scale_grads else 1
        loss = None if loss_fn is None else StructuredLoss(loss_fn, self.unflatten_output, scale)
        if options.schedule == ASYNC:  # fxpipe's own, no torch schedule class
            self.schedule: Any = AsyncSchedule(self, loss)
            return
        cls = _sized_steps(get_schedule_class(options.schedule))
        single = issubclass(cls, PipelineScheduleSingle)
        self.schedule = cls(
            self.stages[0] if single else list(self.stages),
            n_microbatches=n_microbatches,
            loss_fn=loss,
            scale_grads=False,
        )
        self.schedule.before_step = self._before_step

    def _stage_programs(
        self, program: StageProgram, roots: list[nn.Module], tensor_plan: TensorPlan | None
    ) -> dict[int, fx.GraphModule]:
        """Stage index -> the GraphModule this rank runs for it: the planned one, or with
        ``tensor_plan`` its local program cut over ``"tp"`` (the model's cut Parameters, in
        every module under ``roots``, replaced by the DTensors in their place; a tied
        weight's gradient then summed over the pipeline piece by piece)."""
        programs = {j: program.modules[j] for j in self.stage_indices}
        if tensor_plan is None:
            return programs
        programs, placed = parallelize_stages(programs, tensor_plan, self.layout.tp_mesh)
        self._own.adopt(placed, [*roots, *programs.values()])
        self._own.cut_shapes(cut_dims(tensor_plan))
        return programs

    def _stage(
        self, program: StageProgram, binder: InputBinder | None, metas: Metas, j: int, copies: bool
    ) -> Stage:
        take = None
        if j == self.num_stages - 1:
            names = program.outputs[j]
            take = tuple(names.index(x.name) for x in self._leaves if isinstance(x, ValueRef))
        inputs, outputs = taken_metas(metas, take)
        layouts = None if self._layouts is None else self._layouts[j]
        module = StageModule(self._programs[j], binder, take, copies, layouts)
        module.no_views = self.layout.replaces_parameters
        whole = [p for p in module.parameters() if id(p) in self._whole]
        wrapped: nn.Module = module  # the asynchronous schedule averages replicas itself
        if self.options.schedule != ASYNC:
            wrapped = self.layout.wrap(module, self.device, whole, find_unused=self._idle[j])
        stage = Stage(
            wrapped,
            j,
            self.num_stages,
            self.device,
            input_args=inputs,
            output_args=outputs,
            group=self.group,
        )
        stage.unloaded = self._own.uninitialised  # emptied in place by the loads
        stage.tied = self._tied
        stage.statistics, stage.n_microbatches = self._statistics, self._n_microbatches
        stage.stage_module, stage.taken = module, take
        if j == 0:
            stage.binder = binder
        return stage

    def _before_step(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """At the start of every ``schedule.step``, before anything is sent: this rank's own
        checks (:meth:`Stage.check_step`); then this step's sizes, which the first rank
        sends every rank of the pipeline (one broadcast), and, where they differ from the
        last step's, this rank's stages' buffers re-made for them (errors about the sizes
        are raised alike on every rank of the pipeline)."""
        self._check_modes()
        for stage in self.stages:
            stage.check_step()
        shapes = self._step_shapes
        if shapes is None:
            return
        key = shapes.agree(args, kwargs, first=self.is_first)
        if key == shapes.key:
            return
        found = shapes.shapes(key)
        metas = list(found.metas)
        if self.is_first:  # torch's first stage takes the positional arguments
            mb_args, _ = split_args_kwargs_into_chunks(args, kwargs, self._n_microbatches)
            metas[0] = (tuple(meta_like(t) for t in tensors(mb_args[0])), metas[0][1])
        for stage in self.stages:
            j = stage.stage_index
            stage.resize(*taken_metas(metas[j], stage.taken), found.layouts[j])
        self._layouts, shapes.key = found.layouts, key

    def _check_modes(self) -> None:
        """ConfigError where the model's modules are not in the training modes they were
        traced in: the stages run the graph traced then (torch.export fixes dropout,
        BatchNorm statistics and every ``self.training`` branch; torch.fx the branches), so
        a step in another mode would silently run the traced one."""
        now = modes_of(self._model)
        if now == self._modes:
            return
        changed = [
            name or type(self._model).__name__
            for (name, module), was in zip(self._model.named_modules(), self._modes, strict=True)
            if module.training != was
        ]
        traced = "training" if self._modes[0] else "eval"
        raise ConfigError(
            f"the model was traced in {traced} mode, and {len(changed)} of its modules "
            f"({', '.join(map(repr, changed[:3]))}{', ...' if len(changed) > 3 else ''}) are "
            "in another mode now; this rank's stages run the graph traced then, which would "
            "not follow (torch.export fixes dropout, BatchNorm statistics and self.training "
            "branches): put the model back in that mode, or build another pipeline_schedule "
            "with the model in this one (model.eval() first, for evaluation)"
        )

    def parameters(self) -> list[nn.Parameter]:
        """This rank's own Parameters (each once, tied ones included), for its optimizer."""
        return [p for _, p in self._own.named_parameters()]

    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """``(model key, Parameter)`` for this rank's own Parameters, each once."""
        return self._own.named_parameters()

    def state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's shard under the model's own keys (persistent entries only)."""
        own = self._own
        return {k: t.detach() for k, t in own.tensors.items() if k in own.persistent}

    def optimizer_state_dict(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """The state of ``optimizer`` (over :meth:`parameters`) under the model's own keys,
        one entry per parameter and setting (``flatten_optimizer_state_dict``), as
        ``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict`` makes it:
        with :meth:`state_dict`, what ``torch.distributed.checkpoint.save`` writes once for
        the whole job. An optimizer that has not stepped gets zero state first, so that the
        dict can be loaded into (``torch.distributed.checkpoint.load`` fills it in place)."""
        return optimizer_state(self._model, optimizer)

    def load_optimizer_state_dict(
        self, optimizer: torch.optim.Optimizer, state: dict[str, Any]
    ) -> None:
        """Put ``state`` (from :meth:`optimizer_state_dict`, of this or another layout, filled
        by ``torch.distributed.checkpoint.load``) into ``optimizer``."""
        set_optimizer_state(self._model, optimizer, state)

    def save_checkpoint(
        self, path: str | PathLike[str], optimizer: torch.optim.Optimizer | None = None
    ) -> None:
        """Write one checkpoint for the whole job with ``torch.distributed.checkpoint.save``:
        ``{"model": state_dict(), "optim": optimizer_state_dict(optimizer)}`` under the
        model's keys, each tensor once. A collective: call it on every rank."""
        save_state(self._checkpoint_state(optimizer), path)

    def load_checkpoint(
        self, path: str | PathLike[str], optimizer: torch.optim.Optimizer | None = None
    ) -> None:
        """Read a checkpoint :meth:`save_checkpoint` wrote (at any layout, or by
        ``torch.distributed.checkpoint.save`` from the unpipelined model's ``{"model":
        state_dict}``) into this rank's stages, and ``optimizer``'s state when given.

        Before any communication, each rank checks that the checkpoint holds every key it
        needs with its shape: ``CheckpointError`` naming them otherwise. A collective."""
        state = self._checkpoint_state(optimizer)
        load_state(state, path, self.stage_indices)
        self._own.uninitialised.clear()
        self._tied.summed()  # the copies now hold the same values
        if optimizer is not None:
            self.load_optimizer_state_dict(optimizer, state["optim"])

    def _checkpoint_state(self, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
        if isinstance(self.schedule, AsyncSchedule) and self.schedule.unflushed:
            raise ConfigError(
                f"{self.schedule.unflushed} micro-batch(es) entered the asynchronous "
                "pipeline since its last flush, and some are still in flight: their "
                "gradients and weight versions would be in no checkpoint; call "
                "pipe.schedule.flush() on every rank first"
            )
        state: dict[str, Any] = {"model": self.state_dict()}
        if optimizer is not None:
            state["optim"] = self.optimizer_state_dict(optimizer)
        return state

    def load_stage_state_dict(self, full_state_dict: Mapping[str, torch.Tensor]) -> None:
        """Copy this rank's entries from a full (unpipelined) state dict into its stages.

        Non-persistent buffers are copied too when the dict has them; one materialised from
        the ``meta`` device must be in it (it would hold garbage otherwise).
        """
        missing = self._own.load(full_state_dict)
        self._tied.summed()  # the copies now hold the same values
        if missing:
            raise ConfigError(
                f"the state dict lacks {missing[:5]} ({len(missing)} in all) that stage(s) "
                f"{list(self.stage_indices)} hold; pass the model's full state_dict (plus its "
                "non-persistent buffers when the model was built on the 'meta' device)"
            )

    def gather_state_dict(self, dst: int = 0) -> dict[str, torch.Tensor] | None:
        """The merged state dict (CPU tensors) on group rank ``dst``, None on the others.

        A collective: call it on every rank.
        """
        shard = {k: full_tensor(t).cpu() for k, t in self.state_dict().items()}
        shards: list[Any] | None = [None] * self.world_size if self.rank == dst else None
        root = dst if self.group is None else dist.get_global_rank(self.group, dst)
        dist.gather_object(shard, shards, dst=root, group=self.group)
        return None if shards is None else merge_state_dicts(shards)

    @property
    def replicated_keys(self) -> tuple[str, ...]:
        """Keys of the Parameters whose copies live on several ranks (normally none)."""
        return tuple(key for key, _, _ in self._own.replicated)

    def sync_tied_gradients(self) -> None:
        """Sum the gradients of Parameters held on several ranks; a collective on every rank.

        Call it after ``schedule.step`` and before the optimizer step. A tied parameter
        (embedding = LM head) or a module called at several depths is held by every rank
        whose stages read it (the plan never sends it with the micro-batches); each copy
        gets the gradient of its own uses, and this sums them, once per step, so that every
        copy has the whole gradient and every rank's optimizer makes the same update.
        Under FSDP (or torch's ``replicate``, DDP's replicas under tensor parallelism), a
        Parameter two stages of one rank read is left whole (unsharded) on each replica;
        this also averages its gradient over ``"dp"``, as FSDP averages the others.
        Without such a parameter this does nothing (and communicates nothing). A step after
        an update of such a copy with no sum in between is refused (ConfigError) on every
        rank holding one, before anything is sent; several steps per sum (gradient
        accumulation) are fine.
        """
        if not self._own.replicated:
            return
        self._tied.summed()
        sum_tied_gradients(self._own, self.layout, self.device)

    def unflatten_output(self, output: Any) -> Any:
        """The last stage's flat output (as ``schedule.step`` merges it) in the model's
        own structure (tensor, tuple, dict, dataclass)."""
        flat = iter(output if isinstance(output, tuple) else (output,))
        leaves = [next(flat) if isinstance(x, ValueRef) else x for x in self._leaves]
        return tree_unflatten(leaves, self._spec)

    def step(
        self, *args: Any, target: Any = None, losses: list[Any] | None = None, **kwargs: Any
    ) -> Any:
        """``schedule.step(...)``, returning the merged output in the model's structure on
        the last stage's rank (None elsewhere)."""
        out = self.schedule.step(*args, target=target, losses=losses, **kwargs)
        return None if out is None else self.unflatten_output(out)


def _sized_steps(cls: type[Any]) -> type[Any]:
    """``cls`` whose ``step`` first calls ``self.before_step(args, kwargs)`` with the model's
    own arguments (the keywords of ``cls.step`` itself left out): ``eval`` calls ``step``
    too. ``isinstance`` of torch's class still holds."""
    own = {
        p.name for p in inspect.signature(cls.step).parameters.values() if p.kind is p.KEYWORD_ONLY
    }

    def step(self: Any, *args: Any, **kwargs: Any) -> Any:
        hook = getattr(self, "before_step", None)
        if hook is not None:
            hook(args, {k: v for k, v in kwargs.items() if k not in own})
        return cls.step(self, *args, **kwargs)

    doc = f"torch's {cls.__name__}, each step's sizes agreed by every rank first (fxpipe)."
    return type(cls.__name__, (cls,), {"step": step, "__doc__": doc, "__module__": __name__})


def _parameter_slots(modules: Any) -> list[tuple[nn.Module, str, torch.Tensor]]:
    """``(module, name, Parameter)`` for every Parameter entry of the modules' trees."""
    seen: set[int] = set()
    slots = []
    for root in modules:
        for module in root.modules():
            if id(module) not in seen:
                seen.add(id(module))
                slots += [(module, n, p) for n, p in module._parameters.items() if p is not None]
    return slots
