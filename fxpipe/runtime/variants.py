"""The forms of one model a pipeline runs: one per set of training modes and call structure,
each traced when first called for and split along the first one's borders.

A traced graph holds what the model did when it was traced: torch.export fixes every
``self.training`` branch and dropout's ``train`` flag, torch.fx every Python branch on
``self.training``, and both fix which arguments were passed (``labels`` or not) and the
values of the non-tensor ones. So a pipeline keeps one :class:`Variant` per (the training
flag of every module of the model, the call's structure), and picks the one that fits each
call. A call that none fits gets a new one: the model is traced again as it is now, for that
call, and the trace is split along the first variant's borders
(:mod:`fxpipe.passes.split.follow`), so every Parameter stays on the device it already lives on;
a tensor the model makes in forward, which that trace (on ``meta``) keeps without values, takes
them from the same constant of the first trace (:mod:`fxpipe.trace.constants`).
Where the new graph is the same as one already made (an fx graph whose dropout is a module,
which follows ``eval()`` by itself), that variant's stages are reused.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn

from fxpipe.devices.targets import same_device
from fxpipe.errors import ConfigError, InputError, PlanError
from fxpipe.ir import PipelinePlan, StageProgram, ValueRef
from fxpipe.runtime.compiled import StageCompilation
from fxpipe.runtime.executor import Executor
from fxpipe.trace.batch_checks import BatchStatistics
from fxpipe.trace.tracing import Traced

__all__ = ["Variant", "Variants", "Retrace", "modes_of", "check_placement", "MAX_VARIANTS"]

#: At most this many variants per pipeline: a non-tensor argument that changes on every
#: call would otherwise trace the model again on every call.
MAX_VARIANTS = 8


class Retrace(Protocol):
    """What the runtime asks of the compiler when a call fits no variant: the model traced as
    it is now for that call and split along the first variant's borders
    (:class:`fxpipe.compiler.retrace.Retracer` answers it)."""

    def trace_call(
        self, args: tuple[Any, ...], kwargs: Mapping[str, Any]
    ) -> tuple[Traced, PipelinePlan, StageProgram]:
        """(the trace, its plan, its stage program) for this call."""
        ...


def modes_of(model: nn.Module) -> tuple[bool, ...]:
    """The training flag of every module of ``model``, in module order."""
    return tuple(m.training for m in model.modules())


@dataclass
class Variant:
    """One traced form of the model and the stages that run it."""

    #: The training flags of the model's modules it was traced with.
    modes: tuple[bool, ...]
    traced: Traced
    plan: PipelinePlan
    program: StageProgram
    executor: Executor
    statistics: BatchStatistics
    #: With ``compile=``: each stage's compilation record (:mod:`fxpipe.runtime.compiled`).
    compilation: tuple[StageCompilation, ...] = ()
    #: The values the stages return that the output is made of.
    wanted: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.wanted = [x.name for x in self.program.output_leaves if isinstance(x, ValueRef)]

    def same_graphs(self, traced: Traced) -> bool:
        """Whether ``traced`` computes what this variant's trace does (the same code over
        the same attributes, the same call structure)."""
        mine = self.traced
        finals = [t.finalize.graph_module.code if t.finalize else "" for t in (mine, traced)]
        return (
            mine.graph_module.code == traced.graph_module.code
            and finals[0] == finals[1]
            and mine.binder.same_call(traced.binder)
            and _attributes(mine) == _attributes(traced)
        )


def _attributes(traced: Traced) -> list[int]:
    """The identity of every module and tensor a traced graph names."""
    gm = traced.graph_module
    out = []
    for node in gm.graph.nodes:
        if node.op in ("get_attr", "call_module"):
            value: Any = gm
            for part in str(node.target).split("."):
                value = getattr(value, part, None)
            out.append(id(value))
    return out


class Variants:
    """The variants of one pipeline; :meth:`pick` finds (or makes) the one for a call."""

    def __init__(
        self,
        model: nn.Module,
        first: Variant,
        retrace: Retrace | None,
        make: Callable[[tuple[bool, ...], Traced, PipelinePlan, StageProgram], Variant],
    ) -> None:
        self.model = model
        self.all: list[Variant] = [first]
        self._retrace = retrace
        self._make = make

    @property
    def first(self) -> Variant:
        """The variant the pipeline was built with (its plan is ``pipe.plan``)."""
        return self.all[0]

    def pick(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Variant:
        """The variant for this call with the model's modules as they are now; a new one
        (traced and split now) where none fits."""
        modes = modes_of(self.model)
        fitting = [v for v in self.all if v.traced.binder.fits(args, kwargs)]
        for variant in fitting:
            if variant.modes == modes:
                return variant
        if self._retrace is None:  # no new traces: the first one's checks say what differs
            self.first.traced.binder.bind(args, kwargs)
            return self.first
        if len(self.all) >= MAX_VARIANTS:
            raise ConfigError(self._too_many(args, kwargs))
        try:
            traced, plan, program = self._retrace.trace_call(tuple(args), dict(kwargs))
        except Exception as failure:
            if not fitting:  # the call differs from every trace: say how
                self._refuse(args, kwargs, failure)
            raise
        for variant in self.all:
            if variant.same_graphs(traced):
                shared = Variant(
                    modes, variant.traced, variant.plan, variant.program, variant.executor,
                    variant.statistics,
                )  # fmt: skip
                self.all.append(shared)
                return shared
        made = self._make(modes, traced, plan, program)
        self.all.append(made)
        return made

    def _refuse(self, args: Sequence[Any], kwargs: Mapping[str, Any], failure: Exception) -> None:
        """The first trace's InputError for a call whose structure it was not traced for,
        which tracing the model for this call failed on too (a tuple where a tensor was
        passed, say): the mismatch is the likelier mistake, the failure its cause."""
        try:
            self.first.traced.binder.bind(args, kwargs)
        except InputError as mismatch:
            first = (str(failure).strip().splitlines() or [type(failure).__name__])[0]
            raise InputError(
                f"{mismatch} (traced again for this call, the model failed: {first})"
            ) from failure

    def _too_many(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> str:
        try:
            self.first.traced.binder.bind(args, kwargs)
            differs = "the training mode of some of the model's modules"
        except Exception as e:
            differs = str(e).split(";")[0]
        return (
            f"this pipeline has traced the model {MAX_VARIANTS} times, once per set of "
            "training modes and of argument structure it was called with, and this call "
            f"differs again ({differs}); a non-tensor argument that changes on every call "
            "is fixed at trace time: pass it as a tensor, or keep it the same"
        )


def check_placement(
    model: nn.Module, program: StageProgram, devices: Sequence[torch.device]
) -> None:
    """PlanError unless every Parameter and buffer a stage of ``program`` reads already
    lives on that stage's device (a new variant must not move what the first placed)."""
    names = {id(t): n for n, t in model.named_parameters(remove_duplicate=False)}
    names.update({id(t): n for n, t in model.named_buffers(remove_duplicate=False)})
    for j, (module, device) in enumerate(zip(program.modules, devices, strict=True)):
        held = [*module.named_parameters(), *module.named_buffers()]
        for attr, tensor in held:
            if not same_device(tensor.device, device):
                if id(tensor) not in names and tensor.is_meta:
                    raise PlanError(
                        f"the model traced again for this call (another training mode or "
                        f"other arguments) made a constant tensor ({attr!r}, stage {j}) while "
                        "it was traced on 'meta' (its weights live on several devices), "
                        "where that constant has no values (a tensor the model's code makes "
                        "in forward, which the trace keeps as a constant), and the first "
                        "trace made none like it to take them from; build a pipeline "
                        "with the model in this mode and with these arguments (for "
                        "evaluation: model.eval() before fxpipe.pipeline)"
                    )
                name = names.get(id(tensor), "a tensor")
                raise PlanError(
                    f"the model traced again for this call (another training mode or "
                    f"other arguments) reads {name!r} in stage {j} (on {device}), but it "
                    f"lives on {tensor.device}, where the first trace put it; build the "
                    "pipeline with the model in this mode and with these arguments, or put "
                    "the stages on one device"
                )
