"""One rank's part of a distributed pipeline: its torch stages and schedule, its parameters,
the gradients of parameters shared with other ranks, and its state-dict shard."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from os import PathLike
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.microbatch import split_args_kwargs_into_chunks
from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class
from torch.utils._pytree import tree_unflatten

from fxpipe.distributed.mesh import SPLIT_BACKWARD, Layout
from fxpipe.distributed.ownership import Ownership, is_dtensor, merge_state_dicts
from fxpipe.distributed.shapes import Metas, meta_like, tensors
from fxpipe.distributed.split_backward import (
    disjoint_param_groups,
    stage_graph,
    weight_gradients,
    weight_side,
)
from fxpipe.distributed.step_shapes import StepShapes
from fxpipe.distributed.strides import Strides, give_back, hand_out, received, sent
from fxpipe.distributed.tied_guard import TiedGuard
from fxpipe.errors import CheckpointError, ConfigError
from fxpipe.ir import PipelinePlan, StageProgram, ValueRef
from fxpipe.runtime.variants import modes_of
from fxpipe.trace.batch_checks import BatchStatistics
from fxpipe.trace.binding import InputBinder

__all__ = ["DistributedPipeline"]


class DistributedPipeline:
    """This rank's part of a pipeline, made by :func:`fxpipe.distributed.pipeline_schedule`.

    - ``schedule``: the torch schedule; ``schedule.step(x, target=y, losses=losses)`` on
      the ranks with ``is_first`` / ``is_last``, ``schedule.step()`` elsewhere.
    - ``plan``: the fxpipe plan every rank computed; ``stage_indices``: this rank's stages;
      ``stage_modules``: their GraphModules; ``stages``: their torch ``PipelineStage``.
    - ``parameters()`` for this rank's optimizer; ``sync_tied_gradients()`` before its step.
    - ``state_dict()`` / ``load_stage_state_dict()``: this rank's shard under the model's keys.
    """

    def __init__(
        self,
        model: nn.Module,
        plan: PipelinePlan,
        program: StageProgram,
        binder: InputBinder,
        metas: list[Metas],
        ranks: tuple[int, ...],
        group: dist.ProcessGroup | None,
        device: torch.device,
        *,
        kind: str,
        n_microbatches: int,
        loss_fn: Callable[..., torch.Tensor] | None,
        scale_grads: bool,
        layout: Layout | None = None,
        statistics: BatchStatistics | None = None,
        step_shapes: StepShapes | None = None,
        whole: frozenset[int] = frozenset(),
        idle: tuple[bool, ...] | None = None,
        layouts: tuple[tuple[Strides, ...], ...] | None = None,
    ) -> None:
        self.plan, self.group, self.device = plan, group, device
        self._modes = modes_of(model)  # the training modes it was traced in
        self.layout = layout or Layout(group)
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        self.num_stages = plan.num_stages
        self.stage_indices = tuple(j for j, r in enumerate(ranks) if r == self.rank)
        self.stage_modules = tuple(program.modules[j] for j in self.stage_indices)
        self.is_first = 0 in self.stage_indices
        self.is_last = self.num_stages - 1 in self.stage_indices
        self._leaves, self._spec = program.output_leaves, program.output_spec
        self._model = model
        self._own = Ownership(model, program, ranks, self.rank, whole)
        self._own.place(device, [model, plan.graph_module, *program.modules])
        kept = [t for k, _, t in self._own.replicated if k in self._own.whole_keys]
        self._whole = {id(t) for t in kept if t is not None}  # left whole by FSDP (placed)
        # stages holding a trained Parameter their outputs do not depend on (None: unknown)
        self._idle = idle or (True,) * plan.num_stages
        self._tied = TiedGuard(self._own)
        copies = kind in SPLIT_BACKWARD
        self._statistics, self._n_microbatches = statistics, n_microbatches
        self._step_shapes = step_shapes
        self._layouts = layouts
        slots = _parameter_slots(self.stage_modules)
        self.stages = tuple(
            self._stage(program, binder if j == 0 else None, metas[j], j, copies)
            for j in self.stage_indices
        )
        if self.layout.sharded:  # fully_shard put DTensor Parameters in the stage modules
            sharded = {id(old): getattr(module, name) for module, name, old in slots}
            self._own.adopt(sharded, [model, plan.graph_module, *program.modules])
        # scale_grads divides each micro-batch loss's gradient (see _MeanLoss), not the
        # gradients at the end of the step as torch does (scale_grads=False to torch)
        scale = n_microbatches if scale_grads else 1
        loss = None if loss_fn is None else _StructuredLoss(loss_fn, self.unflatten_output, scale)
        cls = _sized_steps(get_schedule_class(kind))
        single = issubclass(cls, PipelineScheduleSingle)
        self.schedule = cls(
            self.stages[0] if single else list(self.stages),
            n_microbatches=n_microbatches,
            loss_fn=loss,
            scale_grads=False,
        )
        self.schedule.before_step = self._before_step

    def _stage(
        self, program: StageProgram, binder: InputBinder | None, metas: Metas, j: int, copies: bool
    ) -> _Stage:
        take = None
        if j == self.num_stages - 1:
            names = program.outputs[j]
            take = tuple(names.index(x.name) for x in self._leaves if isinstance(x, ValueRef))
        inputs, outputs = _taken(metas, take)
        layouts = None if self._layouts is None else self._layouts[j]
        module = _StageModule(program.modules[j], binder, take, copies, layouts)
        module.no_views = self.layout.sharded
        whole = [p for p in module.parameters() if id(p) in self._whole]
        stage = _Stage(
            self.layout.wrap(module, self.device, whole, find_unused=self._idle[j]),
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
        checks (:meth:`_Stage.check_step`); then this step's sizes, which the first rank
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
            stage.resize(*_taken(metas[j], stage.taken), found.layouts[j])
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
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_optimizer_state_dict,
        )

        flat = StateDictOptions(flatten_optimizer_state_dict=True)  # one entry per key
        return get_optimizer_state_dict(self._model, optimizer, options=flat)

    def load_optimizer_state_dict(
        self, optimizer: torch.optim.Optimizer, state: dict[str, Any]
    ) -> None:
        """Put ``state`` (from :meth:`optimizer_state_dict`, of this or another layout, filled
        by ``torch.distributed.checkpoint.load``) into ``optimizer``."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_optimizer_state_dict,
        )

        flat = StateDictOptions(flatten_optimizer_state_dict=True)
        set_optimizer_state_dict(self._model, optimizer, state, options=flat)

    def save_checkpoint(
        self, path: str | PathLike[str], optimizer: torch.optim.Optimizer | None = None
    ) -> None:
        """Write one checkpoint for the whole job with ``torch.distributed.checkpoint.save``:
        ``{"model": state_dict(), "optim": optimizer_state_dict(optimizer)}`` under the
        model's keys, each tensor once. A collective: call it on every rank."""
        from torch.distributed.checkpoint.state_dict_saver import save

        save(self._checkpoint_state(optimizer), checkpoint_id=str(path))

    def load_checkpoint(
        self, path: str | PathLike[str], optimizer: torch.optim.Optimizer | None = None
    ) -> None:
        """Read a checkpoint :meth:`save_checkpoint` wrote (at any layout, or by
        ``torch.distributed.checkpoint.save`` from the unpipelined model's ``{"model":
        state_dict}``) into this rank's stages, and ``optimizer``'s state when given.

        Before any communication, each rank checks that the checkpoint holds every key it
        needs with its shape: ``CheckpointError`` naming them otherwise. A collective."""
        from torch.distributed.checkpoint.state_dict_loader import load

        state = self._checkpoint_state(optimizer)
        _check_checkpoint(path, state, self.stage_indices)
        load(state, checkpoint_id=str(path))
        self._own.uninitialised.clear()
        self._tied.summed()  # the copies now hold the same values
        if optimizer is not None:
            self.load_optimizer_state_dict(optimizer, state["optim"])

    def _checkpoint_state(self, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
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
        shard = {k: _full(t).cpu() for k, t in self.state_dict().items()}
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
        Under FSDP, a Parameter two stages of one rank read is left whole (unsharded) on
        each replica; this also averages its gradient over ``"dp"``, as FSDP averages the
        others. Without such a parameter this does nothing (and communicates nothing). A
        step after an update of such a copy with no sum in between is refused
        (ConfigError) on every rank holding one, before anything is sent; several steps per
        sum (gradient accumulation) are fine.
        """
        entries = self._own.replicated
        if not entries:
            return
        self._tied.summed()
        comm = self.device if dist.get_backend(self.group) == "nccl" else torch.device("cpu")
        whole_keys = self._own.whole_keys
        grads = []
        for key, shape, t in entries:
            g = None if t is None else t.grad
            if g is None:  # under FSDP, this replica's shard of it (unless left whole)
                local = tuple(shape) if key in whole_keys else self._local_shape(shape)
                grads.append(torch.zeros(local, device=comm))
            else:
                grads.append(_local(g).to(comm))
        # held by several ranks: summed over the pipeline ranks (the same list on each)
        shared = [i for i, (key, _, _) in enumerate(entries) if key in self._own.shared_keys]
        _all_reduce(grads, shared, self.group)
        if self.layout.dp_group is not None:  # left whole by FSDP: averaged, as FSDP does
            whole = [i for i, (k, _, t) in enumerate(entries) if k in whole_keys and t is not None]
            _all_reduce(grads, whole, self.layout.dp_group, divide=self.layout.dp_size)
        for (_, _, t), total in zip(entries, grads, strict=True):
            if t is not None:
                if t.grad is None:
                    t.grad = _like_param(t, total)
                else:
                    _local(t.grad).copy_(total)

    def _local_shape(self, shape: torch.Size) -> tuple[int, ...]:
        """This rank's part of a parameter of ``shape``: all of it, or its FSDP shard."""
        if not self.layout.sharded:
            return tuple(shape)
        from torch.distributed.tensor import Shard
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        local, _ = compute_local_shape_and_global_offset(shape, self.layout.dp_mesh, [Shard(0)])
        return tuple(local)

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


def _check_checkpoint(
    path: str | PathLike[str], state: Mapping[str, Any], stages: tuple[int, ...]
) -> None:
    """CheckpointError unless the checkpoint at ``path`` has every tensor of ``state`` (as
    torch.distributed.checkpoint flattens it) with the same shape; reads its metadata only."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict
    from torch.distributed.checkpoint.filesystem import FileSystemReader

    where = Path(path)
    if not (where / ".metadata").is_file():
        raise CheckpointError(
            f"{str(path)!r} is not a torch.distributed.checkpoint folder (no .metadata "
            "file); pass the folder save_checkpoint or torch.distributed.checkpoint.save "
            "wrote"
        )
    stored = FileSystemReader(str(where)).read_metadata().state_dict_metadata
    flat, _ = flatten_state_dict(dict(state))
    missing, shapes = [], []
    for key, value in flat.items():
        if not isinstance(value, torch.Tensor):
            continue
        meta = stored.get(key)
        size = getattr(meta, "size", None)
        if meta is None:
            missing.append(key)
        elif size is not None and tuple(size) != tuple(value.shape):
            shapes.append(f"{key}: {tuple(size)} in the checkpoint, {tuple(value.shape)} here")
    if missing or shapes:
        raise CheckpointError(
            f"the checkpoint {str(path)!r} does not match stage(s) {list(stages)}: "
            + (f"it lacks {missing[:5]} ({len(missing)} in all)" if missing else "")
            + ("; " if missing and shapes else "")
            + (f"shapes differ: {shapes[:5]}" if shapes else "")
            + "; load a checkpoint of this model (and pass optimizer only when the "
            "checkpoint has its state)"
        )


class _StageModule(nn.Module):
    """A stage GraphModule as torch's stages call it: stage 0 takes the model's own
    arguments; other stages take the previous stage's outputs (and ignore the keyword
    arguments torch passes every stage of the first rank); the last stage returns the
    model output's tensor leaves (a bare tensor when there is one)."""

    def __init__(
        self,
        gm: fx.GraphModule,
        binder: InputBinder | None,
        take: tuple[int, ...] | None,
        copies: bool,
        layouts: tuple[Strides | None, ...] | None = None,
    ) -> None:
        super().__init__()
        self.stage = gm
        self._binder, self._take = binder, take
        # Zero-bubble schedules detach every stage's outputs in place after the input part of
        # backward, and the weight part may still need them (saved by a later node of the
        # stage, or by the loss): hand out copies (views on the last stage, which torch
        # leaves attached). They also send input gradients as autograd computes them, which
        # may be strided: make those contiguous.
        self._copies = copies
        # The strides each input had where the earlier stage made it (see strides.py).
        self._layouts = layouts
        # Under FSDP, outputs that are views are copied: FSDP's pre-backward hook on an
        # output would be lost to an in-place write through a view of it.
        self.no_views = False

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self._binder is not None:
            args = self._binder.bind(args, kwargs)
        else:  # torch's contiguous buffers, in the layouts eager made them in
            layouts = self._layouts or (None,) * len(args)
            args = tuple(
                received(a, s, contiguous_grad=self._copies) for a, s in zip(args, layouts)
            )
        out = self.stage(*args)
        # zero bubble, after the first stage: each output joined to an input (see _copy)
        anchor = _anchor_of(args) if self._copies and self._binder is None else None
        if self._take is None:
            # torch sends what it is given, and gloo and NCCL send contiguous tensors only
            # (clone keeps a transposed output's strides); each output is copied once at
            # most, and its gradient comes back in the output's own layout (strides.py)
            if self._copies:
                return tuple(_copy(t, anchor, "contiguous") for t in out)
            return tuple(sent(self._own(t)) for t in out)
        picked = tuple(out[i] for i in self._take)
        if self._copies:  # a view is enough on the last stage, but not one FSDP sees
            how = "clone" if self.no_views else "view"
            picked = tuple(_copy(t, anchor, how) for t in picked)
        else:
            picked = tuple(self._own(t) for t in picked)
        return picked[0] if len(picked) == 1 else picked

    def set_layouts(self, layouts: tuple[Strides | None, ...]) -> None:
        """The strides of this micro-batch size's inputs (see strides.py)."""
        self._layouts = layouts

    def _own(self, t: torch.Tensor) -> torch.Tensor:
        """``t``, copied when it is a view and FSDP sees the outputs (``no_views``)."""
        return t.clone() if self.no_views and t._is_view() else t


def _copied(t: torch.Tensor, how: str) -> torch.Tensor:
    """``t`` as the last stage hands it out: a copy, or a view."""
    return t.clone() if how == "clone" else t.view_as(t)


class _Anchor(torch.autograd.Function):
    """``t`` handed out (``"contiguous"``: to be sent, by :func:`strides.hand_out`; else by
    :func:`_copied`; one subclass per way, made by :func:`_anchor`),
    joined in the autograd graph to ``anchor`` (a stage input); its gradient passes to
    ``t`` alone, in ``t``'s layout when the copy was made contiguous to be sent. Tensor
    arguments only, so that its backward's results line up with its node's inputs
    (:mod:`fxpipe.distributed.split_backward` calls it)."""

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return give_back(ctx, grad), None


def _anchor(how: str) -> type[_Anchor]:
    """The :class:`_Anchor` that hands ``t`` out as ``how`` says."""

    def forward(ctx: Any, t: torch.Tensor, anchor: torch.Tensor) -> torch.Tensor:
        if how == "contiguous":
            return hand_out(ctx, t, copy=True)
        return _copied(t, how)

    return type(f"_Anchor_{how}", (_Anchor,), {"forward": staticmethod(forward)})


_ANCHORS = {how: _anchor(how) for how in ("view", "clone", "contiguous")}


def _anchor_of(inputs: tuple[Any, ...]) -> torch.Tensor | None:
    """The first stage input that needs a gradient (None: none does)."""
    return next((a for a in inputs if isinstance(a, torch.Tensor) and a.requires_grad), None)


def _copy(t: torch.Tensor, anchor: torch.Tensor | None, how: str) -> torch.Tensor:
    """A zero-bubble stage's output, handed out (:func:`_copied`) and joined to ``anchor``
    when it needs a gradient. torch's input part of backward keeps, for the weight part,
    the gradient where each Parameter's uses meet what the stage's inputs reach; an output
    that does not depend on them (a weight gathered by a routing index and sent on, as
    Mixtral's batched experts do) meets none of it, and its Parameters' gradients were
    lost, with no error. Joined, it meets them at the join. A stage after the first with
    Parameters and no input that needs a gradient is refused by ``pipeline_schedule``."""
    if anchor is None or not t.requires_grad:
        return sent(t, copy=True) if how == "contiguous" else _copied(t, how)
    out: torch.Tensor = _ANCHORS[how].apply(t, anchor)  # type: ignore[no-untyped-call]
    return out


def _taken(metas: Metas, take: tuple[int, ...] | None) -> Metas:
    """A stage's input and output metas as torch's stage has them: the last stage's outputs
    are the model output's tensor leaves (``take``)."""
    inputs, outputs = metas
    return inputs, outputs if take is None else tuple(outputs[i] for i in take)


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


def _all_reduce(
    grads: list[torch.Tensor], chosen: list[int], group: dist.ProcessGroup | None, divide: int = 1
) -> None:
    """``grads[i]`` for each ``i`` of ``chosen`` summed over ``group`` (one collective, in
    float64, so that every dtype comes back as exact as it can be) and divided by
    ``divide``, in place in the list. Every rank of ``group`` passes the same ``chosen``."""
    if not chosen:
        return
    flat = torch.cat([grads[i].reshape(-1).to(torch.float64) for i in chosen])
    dist.all_reduce(flat, group=group)
    if divide != 1:
        flat /= divide
    done = 0
    for i in chosen:
        n = grads[i].numel()
        grads[i] = flat.narrow(0, done, n).view(grads[i].shape)
        done += n


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (FSDP), or ``t`` itself."""
    return t.to_local() if is_dtensor(t) else t  # type: ignore[attr-defined]


def _full(t: torch.Tensor) -> torch.Tensor:
    """The whole of a DTensor (a collective over its mesh), or ``t`` itself."""
    return t.full_tensor() if is_dtensor(t) else t  # type: ignore[attr-defined]


def _like_param(param: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """``local`` (this rank's part) as a gradient of ``param``: a DTensor like it under FSDP."""
    local = local.to(_local(param).device, param.dtype)
    if not is_dtensor(param):
        return local
    from torch.distributed.tensor import DTensor

    spec = param  # a DTensor: same mesh, placements and global shape
    return DTensor.from_local(
        local,
        spec.device_mesh,  # type: ignore[attr-defined]
        spec.placements,  # type: ignore[attr-defined]
        shape=spec.shape,
        stride=spec.stride(),
        run_check=False,
    )


class _Stage(PipelineStage):
    """A PipelineStage whose checks run at the start of each step, before anything is sent
    (:meth:`check_step`: unloaded ``meta`` tensors and tied copies updated without a sum
    refused, batch statistics warned about once), whose buffers are re-made for a step of
    other sizes (:meth:`resize`), and whose weight part of a split backward is fxpipe's."""

    #: Keys of this rank's tensors materialised from ``meta`` and not loaded yet.
    unloaded: set[str]
    #: The rank's record of updates to tied copies between steps.
    tied: TiedGuard
    #: The model's batch-statistics layers, warned about once per pipeline at the first
    #: step that normalises micro-batches with their own statistics; the micro-batch count.
    statistics: BatchStatistics | None = None
    n_microbatches: int = 1
    #: The first stage's: the binder of the model's arguments.
    binder: InputBinder | None = None
    #: The stage module (unwrapped), and the outputs the last stage hands torch.
    stage_module: _StageModule
    taken: tuple[int, ...] | None = None

    def forward_one_chunk(
        self, fwd_chunk_id: int, args: Any, kwargs: Any = None, *more: Any, **options: Any
    ) -> Any:
        """torch's, after refusing micro-batch inputs that differ from the example's in
        structure or non-tensor values, or sizes the graph fixes (here, not inside the stage
        module, whose errors torch rewraps as RuntimeError); the schedule's step has checked
        its first micro-batch alike on every rank before anything was sent."""
        if self.binder is not None:
            self.binder.bind(args, kwargs or {})
        return super().forward_one_chunk(fwd_chunk_id, args, kwargs, *more, **options)

    def resize(
        self,
        inputs: tuple[torch.Tensor, ...],
        outputs: tuple[torch.Tensor, ...],
        layouts: tuple[Strides, ...],
    ) -> None:
        """Re-make torch's buffers for micro-batches whose boundary values have the shapes
        of ``inputs`` and ``outputs`` (``meta`` tensors), from torch's static metadata, as
        torch makes them at the first step (nothing is sent); the stage module's inputs get
        ``layouts``. Before the first step, the metadata alone: torch makes the buffers."""
        user = getattr(self, "_user_meta", None)
        if user is None or not hasattr(self, "_prepare_forward_infra"):
            raise ConfigError(
                f"this torch ({torch.__version__}) keeps a pipeline stage's shapes where "
                "fxpipe cannot change them, and this step's sizes differ from the "
                "example's; pad every batch to the example's sizes, or use torch 2.13 or "
                "later, whose stages fxpipe re-sizes"
            )
        from torch.distributed.pipelining._utils import extract_tensor_metas

        self._user_meta = type(user)(
            inputs=extract_tensor_metas(inputs), outputs=extract_tensor_metas(outputs)
        )
        self.stage_module.set_layouts(layouts)
        mode = getattr(self, "_inference_mode", None)
        if mode is None:  # no step yet: torch sets the buffers up from _user_meta
            return
        if getattr(mode, "value", None) != "static":
            raise ConfigError(
                f"stage {self.stage_index}'s shapes were inferred by torch at run time "
                f"({mode}), which fxpipe does not re-run; pad every batch to the example's "
                "sizes"
            )
        self._prepare_forward_infra(self.n_microbatches, None, None, self.has_backward)
        if self.grad_recv_info:
            self._prepare_backward_infra(self.n_microbatches)

    def check_step(self) -> None:
        """Called on every stage at the start of a step, before any communication: a rank
        whose stages hold uninitialised memory, or a tied copy updated without a sum, stops
        there."""
        if self.unloaded:
            keys = sorted(self.unloaded)
            shown = ", ".join(repr(k) for k in keys[:3]) + (", ..." if len(keys) > 3 else "")
            raise ConfigError(
                f"the model was built on 'meta' and this rank's stages hold {len(keys)} "
                f"tensor(s) that were never loaded ({shown}): their memory is uninitialised; "
                "call load_stage_state_dict(full_state_dict) or load_checkpoint(path) on every "
                "rank before the first step"
            )
        self.tied.step_started()
        if self.statistics is not None:
            self.statistics.warn_once(self.n_microbatches)

    def backward_maybe_with_nosync(
        self, backward_type: str, bwd_kwargs: dict[str, Any], *args: Any, **kwargs: Any
    ) -> Any:
        """torch's, but for the weight part of a split backward, which
        :mod:`fxpipe.distributed.split_backward` computes (torch's counts some gradients
        twice, or runs the activations' backward again and crashes): after the input part,
        the Parameter groups are made disjoint and each gets its weight side; the weight
        part runs under torch's data-parallel settings, with torch's own given no group."""
        if backward_type == "weight" and bwd_kwargs.get("param_groups"):
            groups = bwd_kwargs["param_groups"]
            none = {**bwd_kwargs, "param_groups": []}
            result = super().backward_maybe_with_nosync(backward_type, none, *args, **kwargs)
            weight_gradients(self.submod.parameters(), groups)
            return result
        if backward_type != "input":
            return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, *args, **kwargs)
        outputs, inputs = bwd_kwargs["stage_output"], bwd_kwargs["input_values"]
        graph = stage_graph(outputs, inputs)  # before torch detaches the outputs
        grads, groups = super().backward_maybe_with_nosync(
            backward_type, bwd_kwargs, *args, **kwargs
        )
        return grads, weight_side(disjoint_param_groups(groups or []), graph)


class _StructuredLoss:
    """``loss_fn`` called on the model's own output structure rather than torch's flat one;
    with ``scale`` > 1, its gradient divided by ``scale`` (:class:`_MeanLoss`)."""

    def __init__(
        self, loss_fn: Callable[..., torch.Tensor], rebuild: Callable[[Any], Any], scale: int = 1
    ) -> None:
        self.loss_fn, self.rebuild, self.scale = loss_fn, rebuild, scale

    def __call__(self, output: Any, target: Any, **kwargs: Any) -> torch.Tensor:
        loss = self.loss_fn(self.rebuild(output), target, **kwargs)
        if self.scale == 1:
            return loss
        out: torch.Tensor = _MeanLoss.apply(loss, self.scale)  # type: ignore[no-untyped-call]
        return out


class _MeanLoss(torch.autograd.Function):
    """A micro-batch's loss, its value as it is, its gradient divided by the number of
    micro-batches (``scale_grads=True``): each step adds the mean of its micro-batches'
    gradients to the Parameters'. torch divides the Parameters' whole gradients at the
    end of each step instead, which also divides what earlier steps accumulated in them
    (gradient accumulation over steps then gives the earlier steps too little weight), and
    divides a Parameter two stages of a rank share once per stage."""

    @staticmethod
    def forward(ctx: Any, loss: torch.Tensor, scale: int) -> torch.Tensor:
        ctx.scale = scale
        return loss.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad / ctx.scale, None
