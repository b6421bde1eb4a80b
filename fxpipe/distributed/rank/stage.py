"""A stage as torch's schedules run it: the stage GraphModule wrapped to take the model's
arguments (the first stage) or torch's buffers in eager's layouts (the others) and to hand
out what torch sends (:class:`StageModule`), and the ``PipelineStage`` around it whose checks
run at the start of each step, whose buffers are re-made for a step of other sizes and whose
weight part of a split backward is fxpipe's (:class:`Stage`)."""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch.distributed.pipelining import PipelineStage

from fxpipe.distributed.rank.shapes import Metas
from fxpipe.distributed.rank.split_backward import (
    disjoint_param_groups,
    stage_graph,
    weight_gradients,
    weight_side,
)
from fxpipe.distributed.rank.strides import Strides, give_back, hand_out, received, sent
from fxpipe.distributed.rank.tied_guard import TiedGuard
from fxpipe.errors import ConfigError
from fxpipe.trace.batch_checks import BatchStatistics
from fxpipe.trace.binding import InputBinder

__all__ = ["Stage", "StageModule", "taken_metas"]


class StageModule(nn.Module):
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
    (:mod:`fxpipe.distributed.rank.split_backward` calls it)."""

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


def taken_metas(metas: Metas, take: tuple[int, ...] | None) -> Metas:
    """A stage's input and output metas as torch's stage has them: the last stage's outputs
    are the model output's tensor leaves (``take``)."""
    inputs, outputs = metas
    return inputs, outputs if take is None else tuple(outputs[i] for i in take)


class Stage(PipelineStage):
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
    stage_module: StageModule
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

    def check_loaded(self) -> None:
        """ConfigError while this stage holds tensors made from ``meta`` and never loaded
        (before a step or a ``generate()``, and before any communication)."""
        if self.unloaded:
            keys = sorted(self.unloaded)
            shown = ", ".join(repr(k) for k in keys[:3]) + (", ..." if len(keys) > 3 else "")
            raise ConfigError(
                f"the model was built on 'meta' and this rank's stages hold {len(keys)} "
                f"tensor(s) that were never loaded ({shown}): their memory is uninitialised; "
                "call load_stage_state_dict(full_state_dict) or load_checkpoint(path) on every "
                "rank before the first step or generate()"
            )

    def check_step(self) -> None:
        """Called on every stage at the start of a step, before any communication: a rank
        whose stages hold uninitialised memory, or a tied copy updated without a sum, stops
        there."""
        self.check_loaded()
        self.tied.step_started()
        if self.statistics is not None:
            self.statistics.warn_once(self.n_microbatches)

    def backward_maybe_with_nosync(
        self, backward_type: str, bwd_kwargs: dict[str, Any], *args: Any, **kwargs: Any
    ) -> Any:
        """torch's, but for the weight part of a split backward, which
        :mod:`fxpipe.distributed.rank.split_backward` computes (torch's counts some gradients
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
