"""Times what the executor runs (forward, recompute, backward and copy of each cell), on demand.

The executor tells its recorder (a :class:`RunRecorder`) about every run, cell and
cross-device transfer, and a checkpointed cell times its recompute and backward with a
:data:`SpanFactory`. By default both are no-ops (:data:`NO_RECORDER`, :func:`no_span`): a
cell runs as without this module, at the price of one method call per cell, per transfer
and per checkpointed recompute and backward. With a :class:`Recorder` attached
(``Pipeline.attach_recorder``):

- the forward of cell ``(i, j)`` is timed in its worker thread;
- a cell that is not checkpointed runs inside :class:`Timed`, an autograd Function that
  calls the stage with grad enabled and, in backward, backpropagates through it in one
  nested call: that call is the cell's backward, timed from start to end;
- a checkpointed cell hands the recorder to its ``Checkpointing``, whose ``Recompute`` and
  ``Checkpoint`` backward time themselves;
- a transfer is timed on the copy stream in forward; identity Functions on both sides of it
  time the gradient's way back.

On CPU a span reads ``time.perf_counter``; on a CUDA device it records two CUDA events on
the stream the work is queued on, turned into the same clock when the recording closes
(against an event recorded on each device when it opened).
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from fxpipe.runtime.phony import get_phony
from fxpipe.runtime.spans import SpanFactory, no_span
from fxpipe.runtime.stream import AbstractStream, is_cuda

if TYPE_CHECKING:
    from fxpipe.runtime.checkpoint import Checkpointing

__all__ = [
    "RunRecorder",
    "NullRecorder",
    "NO_RECORDER",
    "Recorder",
    "Span",
    "SpanFactory",
    "no_span",
    "Timed",
    "PHASES",
]

#: The phases a span can have, in the order a cell goes through them.
PHASES = ("forward", "copy", "recompute", "backward")


class RunRecorder(Protocol):
    """What the executor calls on every run, cell and transfer (:data:`NO_RECORDER` or a
    :class:`Recorder`); each hook returns the work to do, which it may wrap."""

    def begin_run(self) -> None:
        """Called once at the start of every ``Executor.run``."""

    def cell(
        self,
        ij: tuple[int, int],
        device: torch.device,
        module: Callable[..., Any],
        args: tuple[Any, ...],
        checkpointing: Checkpointing | None,
        grad: bool,
    ) -> Callable[[], Any]:
        """The task of cell ``(i, j)``: ``checkpointing.checkpoint`` when the cell is
        checkpointed, else ``module(*args)``."""
        ...

    def transfer(
        self,
        copy: Callable[[tuple[torch.Tensor, ...]], tuple[torch.Tensor, ...]],
        tensors: tuple[torch.Tensor, ...],
        ij: tuple[int, int],
        route: tuple[torch.device, torch.device],
        stream: AbstractStream | None,
    ) -> tuple[torch.Tensor, ...]:
        """``copy(tensors)``, the transfer of cell ``(i, j)``'s inputs along ``route``
        (source, destination) on the destination's copy ``stream``."""
        ...


class NullRecorder:
    """The :class:`RunRecorder` that records nothing: every hook runs the work as it is."""

    def begin_run(self) -> None:
        """Nothing to count."""

    def cell(
        self,
        ij: tuple[int, int],
        device: torch.device,
        module: Callable[..., Any],
        args: tuple[Any, ...],
        checkpointing: Checkpointing | None,
        grad: bool,
    ) -> Callable[[], Any]:
        """``checkpointing.checkpoint``, or ``module(*args)`` as a call to make later."""
        if checkpointing is not None:
            return checkpointing.checkpoint
        return functools.partial(module, *args)

    def transfer(
        self,
        copy: Callable[[tuple[torch.Tensor, ...]], tuple[torch.Tensor, ...]],
        tensors: tuple[torch.Tensor, ...],
        ij: tuple[int, int],
        route: tuple[torch.device, torch.device],
        stream: AbstractStream | None,
    ) -> tuple[torch.Tensor, ...]:
        """``copy(tensors)``, untimed."""
        return copy(tensors)


#: The recorder an executor has while nobody records it (shared: it holds no state).
NO_RECORDER = NullRecorder()


@dataclass(frozen=True)
class Span:
    """One timed piece of work; times in seconds on the ``time.perf_counter`` clock."""

    phase: str
    #: Micro-batch and stage of the cell (for a copy: the stage the value travels to).
    i: int
    j: int
    device: torch.device
    start: float
    end: float
    #: Which ``Executor.run`` call of the recording (0, 1, ...).
    run: int = 0
    #: For a copy: the device the values (or, in backward, the gradients) leave.
    source: torch.device | None = None
    #: For a copy: whether it carries gradients (backward) rather than values (forward).
    grad: bool = False


class _Pending:
    """A span whose end points are CUDA events, resolved when the recording closes."""

    def __init__(self, fields: dict[str, Any], begin: Any, end: Any, clock: torch.device) -> None:
        self.fields, self.begin, self.end, self.clock = fields, begin, end, clock


class Recorder:
    """The :class:`RunRecorder` that collects :class:`Span` records from the executor's
    threads and from autograd's."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._spans: list[Span] = []
        self._pending: list[_Pending] = []
        self._anchors: dict[torch.device, tuple[Any, float]] = {}
        #: Number of the current ``Executor.run`` (-1 before the first).
        self.runs = -1
        self.open = True

    # -------------------------------------------------------------- hooks the executor calls

    def begin_run(self) -> None:
        """Called once at the start of every ``Executor.run``."""
        self.runs += 1

    def cell(
        self,
        ij: tuple[int, int],
        device: torch.device,
        module: Callable[..., Any],
        args: tuple[Any, ...],
        checkpointing: Checkpointing | None,
        grad: bool,
    ) -> Callable[[], Any]:
        """The task of cell ``(i, j)``: its forward, timed in the worker.

        A ``checkpointing`` is told how to time its recompute and backward; a cell that keeps
        its activations (``grad`` on) runs through :class:`Timed` so that its backward is
        timed too.
        """
        span = self.span_factory(ij, device)
        compute: Callable[[], Any]
        if checkpointing is not None:
            checkpointing.time_with(span)
            compute = checkpointing.checkpoint
        elif grad:
            compute = functools.partial(_timed_call, module, args, span, device)
        else:
            compute = functools.partial(module, *args)
        return functools.partial(_in_span, span("forward"), compute)

    def span_factory(self, ij: tuple[int, int], device: torch.device) -> SpanFactory:
        """``span(phase)`` for cell ``(i, j)`` of the current run."""
        return functools.partial(self._cell_span, ij, device, self.runs)

    def _cell_span(
        self, ij: tuple[int, int], device: torch.device, run: int, phase: str
    ) -> AbstractContextManager[None]:
        return self.span(phase, i=ij[0], j=ij[1], device=device, run=run)

    def transfer(
        self,
        copy: Callable[[tuple[torch.Tensor, ...]], tuple[torch.Tensor, ...]],
        tensors: tuple[torch.Tensor, ...],
        ij: tuple[int, int],
        route: tuple[torch.device, torch.device],
        stream: AbstractStream | None,
    ) -> tuple[torch.Tensor, ...]:
        """``copy(tensors)`` timed as a copy along ``route`` (source, destination); identity
        Functions on both sides time the gradients' way back."""
        source, dest = route
        fields = dict(i=ij[0], j=ij[1], run=self.runs)
        marks = _Marks(self, fields, route) if any(t.requires_grad for t in tensors) else None
        if marks is not None:
            tensors = _mark(marks, "end", tensors)
        with self.span("copy", device=dest, source=source, stream=stream, **fields):
            moved = copy(tensors)
        return _mark(marks, "start", moved) if marks is not None else moved

    # -------------------------------------------------------------- clocks

    @contextmanager
    def span(
        self,
        phase: str,
        *,
        i: int,
        j: int,
        device: torch.device,
        run: int = 0,
        source: torch.device | None = None,
        stream: AbstractStream | None = None,
    ) -> Iterator[None]:
        """Time the block as ``phase`` of cell ``(i, j)`` on ``device``."""
        if not self.open:
            yield
            return
        fields: dict[str, Any] = dict(phase=phase, i=i, j=j, device=device, run=run, source=source)
        cuda = self._cuda_stream(device, stream)
        if cuda is None:
            start = time.perf_counter()
            yield
            self._add(Span(start=start, end=time.perf_counter(), **fields))
            return
        begin, end = _event(), _event()
        begin.record(cuda)
        yield
        end.record(cuda)
        with self._lock:
            self._pending.append(_Pending(fields, begin, end, torch.device(cuda.device)))

    def _cuda_stream(self, device: torch.device, stream: AbstractStream | None) -> Any:
        """The CUDA stream a span's events go on; ``None`` times it on the host clock."""
        if stream is not None and is_cuda(stream):
            assert isinstance(stream, torch.cuda.Stream)
            clock = torch.device(stream.device)
        elif device.type == "cuda":
            stream, clock = torch.cuda.current_stream(device), device
        else:
            return None
        return stream if clock in self._anchors else None

    def start(self, devices: Sequence[torch.device]) -> None:
        """Anchor each CUDA device's events to the host clock (after a synchronize)."""
        for device in set(devices):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
                anchor = _event()
                anchor.record(torch.cuda.current_stream(device))
                anchor.synchronize()
                self._anchors[device] = (anchor, time.perf_counter())

    def close(self) -> list[Span]:
        """Stop recording; wait for the devices and return every span, by start time."""
        self.open = False
        for device in self._anchors:
            torch.cuda.synchronize(device)
        with self._lock:
            spans = self._spans + [self._resolve(p) for p in self._pending]
        return sorted(spans, key=lambda s: (s.start, s.end))

    def _resolve(self, pending: _Pending) -> Span:
        anchor, host = self._anchors[pending.clock]
        start = host + anchor.elapsed_time(pending.begin) / 1e3
        end = host + anchor.elapsed_time(pending.end) / 1e3
        return Span(start=start, end=end, **pending.fields)

    def _add(self, span: Span) -> None:
        with self._lock:
            self._spans.append(span)


def _event() -> Any:
    return torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]


def _in_span(span: AbstractContextManager[None], compute: Callable[[], Any]) -> Any:
    with span:
        return compute()


# ------------------------------------------------------------------ backward of a stage call

#: Stands for a tensor leaf of a stage's arguments or outputs.
_TENSOR = object()


class _Call:
    """One stage call of a :class:`Timed` cell: its structure and what backward needs."""

    def __init__(self, function: Callable[..., Any], args: tuple[Any, ...], span: SpanFactory):
        self.function = function
        self.span = span
        leaves, self.in_spec = tree_flatten(args)
        self.in_leaves = [_TENSOR if isinstance(x, torch.Tensor) else x for x in leaves]
        self.tensors = tuple(x for x in leaves if isinstance(x, torch.Tensor))
        self.out_leaves: list[Any] = []
        self.out_spec: Any = None
        self.inputs: tuple[torch.Tensor, ...] = ()
        self.outputs: tuple[torch.Tensor, ...] = ()

    def run(self, tensors: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """Call the stage with ``tensors`` as its tensor leaves; return its output tensors."""
        it = iter(tensors)
        args = tree_unflatten(
            [next(it) if x is _TENSOR else x for x in self.in_leaves], self.in_spec
        )
        leaves, self.out_spec = tree_flatten(self.function(*args))
        self.out_leaves = [_TENSOR if isinstance(x, torch.Tensor) else x for x in leaves]
        return tuple(x for x in leaves if isinstance(x, torch.Tensor))

    def rebuild(self, tensors: Sequence[torch.Tensor]) -> Any:
        """The stage's outputs with ``tensors`` in place of its output tensors."""
        it = iter(tensors)
        return tree_unflatten(
            [next(it) if x is _TENSOR else x for x in self.out_leaves], self.out_spec
        )


def _timed_call(
    function: Callable[..., Any], args: tuple[Any, ...], span: SpanFactory, device: torch.device
) -> Any:
    """``function(*args)`` through :class:`Timed`, so that its backward is one timed span."""
    call = _Call(function, args, span)
    # A phony that requires grad keeps Timed in the graph when no input requires grad.
    phony = get_phony(device, requires_grad=True)
    outputs = _timed(phony, call, *call.tensors)
    return call.rebuild(outputs)


class Timed(torch.autograd.Function):
    """Call a stage with grad enabled; its backward is one nested, timed backward call."""

    @staticmethod
    def forward(ctx: Any, phony: torch.Tensor, call: _Call, *tensors: torch.Tensor) -> Any:
        ctx.call = call
        call.inputs = tuple(x.detach().requires_grad_(x.requires_grad) for x in tensors)
        with torch.enable_grad():
            call.outputs = call.run(call.inputs)
        detached = tuple(y.detach() for y in call.outputs)
        constants = [d for d, y in zip(detached, call.outputs) if not y.requires_grad]
        if constants:
            ctx.mark_non_differentiable(*constants)
        return detached

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:  # pragma: no cover
        call: _Call = ctx.call
        with call.span("backward"):
            pairs = [(y, g) for y, g in zip(call.outputs, grads) if y.requires_grad]
            if pairs:
                torch.autograd.backward([y for y, _ in pairs], [g for _, g in pairs])
        result = [x.grad if x.requires_grad else None for x in call.inputs]
        call.inputs = call.outputs = ()
        return (None, None, *result)


# ------------------------------------------------------------------ backward of a transfer


class _Marks:
    """The two ends of one transfer's backward, timed on the host clock."""

    def __init__(
        self, recorder: Recorder, fields: dict[str, Any], route: tuple[torch.device, ...]
    ) -> None:
        self.recorder, self.fields, self.route = recorder, fields, route
        self.begin: float | None = None

    def hit(self, which: str) -> None:
        now = time.perf_counter()
        if which == "start":
            self.begin = now
            return
        if self.begin is not None and self.recorder.open:
            source, dest = self.route  # the gradients go the other way
            span = Span(
                "copy",
                device=source,
                source=dest,
                grad=True,
                start=self.begin,
                end=now,
                **self.fields,
            )
            self.recorder._add(span)


class _Mark(torch.autograd.Function):
    """Identity; its backward tells ``marks`` that the gradient passed this point."""

    @staticmethod
    def forward(ctx: Any, marks: _Marks, which: str, *tensors: torch.Tensor) -> Any:
        ctx.marks, ctx.which = marks, which
        out = tuple(t.detach() for t in tensors)
        ctx.mark_non_differentiable(*(o for o, t in zip(out, tensors) if not t.requires_grad))
        return out

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:  # pragma: no cover
        ctx.marks.hit(ctx.which)
        return (None, None, *grads)


_timed: Callable[..., tuple[torch.Tensor, ...]] = Timed.apply
_apply_mark: Callable[..., tuple[torch.Tensor, ...]] = _Mark.apply


def _mark(marks: _Marks, which: str, tensors: tuple[torch.Tensor, ...]) -> Any:
    return tuple(_apply_mark(marks, which, *tensors))
