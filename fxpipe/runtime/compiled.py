"""Stages through ``torch.compile``: each stage's forward compiled when first called, its
compilations counted and timed, and run eagerly (one warning) where compiling fails.

With ``dynamic=None`` (the default) dim 0 of every tensor a stage takes, the rows of its
micro-batch, is marked dynamic before each call (``maybe_mark_dynamic``: torch keeps it
static where the graph needs a fixed size), so the last, shorter micro-batch and other
batch sizes reuse the first graph instead of compiling static and then dynamic. Other
sizes (a sequence length) become symbolic the second time they change, torch's automatic
dynamic shapes.
"""

from __future__ import annotations

import inspect
import logging
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from fxpipe.errors import CompileWarning, StageError
from fxpipe.options import CompileOptions

__all__ = ["StageCompilation", "compile_stages"]

logger = logging.getLogger("fxpipe")

#: Graphs one stage may compile before torch runs it eagerly: the grad modes and input
#: ``requires_grad`` flags of a checkpointed stage (its gradient-free forward, its
#: recompute, its last micro-batch), times micro-batches of one row (torch specialises a
#: size of 1), leave torch's default of 8 too few.
RECOMPILE_LIMIT = 32
#: Whether this torch's ``torch.compile`` takes ``recompile_limit``.
_TAKES_LIMIT = "recompile_limit" in inspect.signature(torch.compile).parameters


@dataclass
class StageCompilation:
    """What compiling one stage's forward came to, so far."""

    #: How the stage is named in messages (``stage 1 (blocks.2 to head, on cpu)``).
    stage: str
    #: Graphs the backend compiled: one per set of sizes, grad mode or training mode that
    #: torch's guards tell apart (a recompilation is one more).
    graphs: int = 0
    #: Seconds spent in the backend compiling them (a backward graph is compiled when it
    #: first runs, and counted in the step that runs it, not here).
    seconds: float = 0.0
    #: Why the stage runs eagerly (None: it runs compiled).
    eager_because: str | None = None

    @property
    def compiled(self) -> bool:
        """Whether the stage runs through its compiled forward."""
        return self.eager_because is None


def compile_stages(
    modules: Sequence[fx.GraphModule], labels: Sequence[str], options: CompileOptions
) -> tuple[StageCompilation, ...]:
    """Make every stage's forward its compiled form (in place: the GraphModule keeps its
    graph, parameters and buffers, so checkpointing, recording and state dicts see the
    same module); the records fill in as the stages are first called."""
    records = []
    for module, label in zip(modules, labels, strict=True):
        record = StageCompilation(label)
        module.forward = _CompiledForward(module, record, options)
        records.append(record)
    return tuple(records)


class _CompiledForward:
    """A stage's forward: the compiled one while it compiles; the eager one (for good, with
    one warning) once compiling it failed where running it eagerly works. An error the
    eager forward raises too is the stage's own and is raised as eager raises it."""

    def __init__(
        self, module: fx.GraphModule, record: StageCompilation, options: CompileOptions
    ) -> None:
        self.module = module
        self.eager: Callable[..., Any] = type(module).forward.__get__(module)
        self.record = record
        #: dim 0 of the stage's tensor arguments (the micro-batch's rows) symbolic at once
        self.batch_dynamic = options.dynamic is None
        limit: dict[str, Any] = {"recompile_limit": RECOMPILE_LIMIT} if _TAKES_LIMIT else {}
        self.compiled: Callable[..., Any] = torch.compile(
            self.eager,
            backend=_counted(_backend(options), record),
            dynamic=options.dynamic,
            fullgraph=options.fullgraph,
            **limit,
        )

    def __call__(self, *args: Any) -> Any:
        if not self.record.compiled:
            return self.eager(*args)
        if self.batch_dynamic:
            for a in args:
                if isinstance(a, torch.Tensor) and a.ndim:
                    torch._dynamo.maybe_mark_dynamic(a, 0)
        versions = _versions(self.module, args)
        try:
            return self.compiled(*args)
        except Exception as error:
            if _versions(self.module, args) != versions:  # part of it ran: not run again
                raise StageError(
                    f"{self.record.stage} failed while running compiled, after it had "
                    f"changed a buffer or an input in place, so it is not rerun eagerly "
                    f"({_reason(error)}); remedy: leave "
                    "fullgraph=True (a stage that does not compile whole then runs eagerly) "
                    "or pass compile=False"
                ) from error
            out = self.eager(*args)  # raises the stage's own error where there is one
            self._give_up(error)
            return out

    def _give_up(self, error: Exception) -> None:
        reason = _reason(error)
        self.record.eager_because = reason
        warnings.warn(
            f"{self.record.stage} could not be compiled and runs eagerly ({reason}); its "
            "results are the same, only not faster. Pass compile={'fullgraph': False} to let "
            "torch run what it cannot compile between compiled parts",
            CompileWarning,
            stacklevel=2,
        )


def _backend(options: CompileOptions) -> Callable[..., Any]:
    """The backend ``torch.compile(backend=..., mode=..., options=...)`` would use."""
    settings = dict(options.options) if options.options else None
    if options.backend == "inductor":
        return torch._TorchCompileInductorWrapper(  # type: ignore[no-untyped-call]
            options.mode, settings, options.dynamic
        )
    return torch._TorchCompileWrapper(  # type: ignore[no-untyped-call]
        options.backend, options.mode, settings, options.dynamic
    )


def _counted(backend: Callable[..., Any], record: StageCompilation) -> Callable[..., Any]:
    """``backend``, counting and timing every graph it compiles into ``record``."""

    def compile_graph(gm: fx.GraphModule, example_inputs: list[Any]) -> Any:
        start = time.perf_counter()
        try:
            return backend(gm, example_inputs)
        finally:
            seconds = time.perf_counter() - start
            record.graphs += 1
            record.seconds += seconds
            logger.info("%s: compiled graph %d in %.2f s", record.stage, record.graphs, seconds)

    return compile_graph


def _versions(module: fx.GraphModule, args: tuple[Any, ...]) -> list[int]:
    """The version counters of the stage's buffers and tensor arguments (an in-place write
    bumps them)."""
    tensors = [*module.buffers(), *(a for a in args if isinstance(a, torch.Tensor))]
    return [t._version for t in tensors]


def _reason(error: BaseException) -> str:
    """``Type: first line`` of what made compiling fail (the backend's own error, not the
    wrapper torch puts around it)."""
    inner = getattr(error, "inner_exception", None)
    if isinstance(inner, BaseException):
        error = inner
    lines = [line for line in str(error).splitlines() if line.strip()]
    return f"{type(error).__name__}: {lines[0].strip()}" if lines else type(error).__name__
