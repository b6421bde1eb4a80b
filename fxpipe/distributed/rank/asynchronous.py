"""``schedule="Async1F1B"``: the asynchronous pipeline (FTPipe's, PipeDream's order), this
rank's stage of it. No flush between steps: the micro-batches of every ``step`` call form
one stream, and each stage updates its own weights with the optimizer given to
:meth:`AsyncSchedule.attach` as soon as ``step_every`` backwards are in, while the others go
on.

The rule (each stage decides its own order; every stage sees the same stream, so update
``k`` of every stage covers the same micro-batches):

- stage ``s`` of ``K`` runs the forwards in stream order; after each, while more than
  ``K - 1 - s`` micro-batches are in flight on it, it runs the backward of the oldest;
- after a backward, ``step_every`` backwards since its last update make an update: a
  weight several stages hold (a tied embedding) gets its copies' gradients summed, under a
  mesh each gradient is averaged over the ``"dp"`` replicas, then the stage's own gradient
  norm is clipped (``max_grad_norm``), the optimizer steps, the gradients are zeroed and
  the learning-rate scheduler steps;
- :meth:`AsyncSchedule.flush` runs the backwards still in flight, then updates with what
  they left (a partial update): call it before evaluating or saving, and at the end.

A micro-batch's forward on stage ``s`` after ``v`` updates, whose backward comes after ``v +
d`` (``d``: its staleness, 0 on the last stage), runs with ``staleness``: ``"stash"``, the
weights of version ``v`` in both (a copy kept while ``d > 0``); ``"predict"``, in both the
weights the stage's optimizer reaches from version ``v`` in ``d`` more steps that see no
loss gradient (:func:`fxpipe.distributed.rank.versions.predicted`); ``"none"``, version
``v`` forward and a backward that recomputes the forward with the weights of its own time
(the same dropout draws). Gradients computed at a copy go to the Parameters. Each rank's
dropout draws come from its own generator in the order of its forwards.

Each micro-batch's values are sent point to point, preceded by a header with its sizes, so
batches of other sizes (a sequence length) can follow one another without a collective.
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining.microbatch import split_args_kwargs_into_chunks
from torch.func import functional_call

from fxpipe.distributed.options import ASYNC
from fxpipe.distributed.parallel.mesh import comm_device
from fxpipe.distributed.planning.staleness import Staleness, staleness_of
from fxpipe.distributed.rank.gradients import all_reduce_flat
from fxpipe.distributed.rank.losses import StructuredLoss
from fxpipe.distributed.rank.versions import Key, Versions
from fxpipe.errors import ConfigError, InputError
from fxpipe.runtime.checkpoint import RNGState, restore_rng, save_rng
from fxpipe.trace.batch_checks import BatchStatistics
from fxpipe.trace.tracing import Traced

__all__ = ["AsyncSchedule", "batch_statistics"]


@dataclass
class _Flight:
    """One micro-batch between its forward and its backward on this stage."""

    index: int
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    key: Key | None
    #: Its outputs with their graph; None where the backward recomputes them.
    outputs: tuple[torch.Tensor, ...] | None
    #: The generator's state before its forward (for the recomputation), and the layouts.
    rng: RNGState | None = None
    layouts: Any = None
    #: The shapes and dtypes of the floating outputs whose gradients come back.
    grads: list[tuple[torch.Size, torch.dtype]] = field(default_factory=list)


class AsyncSchedule:
    """This rank's stage of an asynchronous pipeline (see the module docstring); made by
    :func:`fxpipe.distributed.pipeline_schedule` as ``pipe.schedule``."""

    def __init__(self, pipe: Any, loss: StructuredLoss | None) -> None:
        """The one stage of ``pipe`` (the rank's :class:`DistributedPipeline`, which makes
        this), ``loss``: each micro-batch's (the last stage's)."""
        options = pipe.options
        if loss is None:  # alike on every rank
            raise ConfigError(
                "schedule='Async1F1B' trains: its last stage computes each micro-batch's "
                "loss; pass loss_fn= to pipeline_schedule"
            )
        self.pipe, self._loss = pipe, loss
        self.stage = pipe.stages[0]
        self.j, self.num_stages = pipe.stage_indices[0], pipe.num_stages
        self.n_microbatches = options.n_microbatches
        self.step_every = options.step_every or options.n_microbatches
        self.staleness = options.staleness
        self._module = self.stage.stage_module
        named = dict(self._module.named_parameters())
        self._versions = Versions(named, options.staleness)
        self._warmup = self.num_stages - 1 - self.j
        self._comm = comm_device(pipe.group, pipe.device)
        group, ranks = pipe.group, pipe._ranks
        peer = (lambda r: r) if group is None else (lambda r: dist.get_global_rank(group, r))
        self._prev = peer(ranks[self.j - 1]) if self.j > 0 else None
        self._next = peer(ranks[self.j + 1]) if self.j < self.num_stages - 1 else None
        self._flight: deque[_Flight] = deque()
        self._sends: list[tuple[Any, torch.Tensor]] = []
        self._optimizer: torch.optim.Optimizer | None = None
        self._scheduler: Any = None
        self._max_norm: float | None = None
        self._since = self._unflushed = 0
        #: Micro-batches this stage has run forward, and the updates it has made.
        self.forwards = 0
        self.updates = 0

    # ------------------------------------------------------------------ the user's side

    def attach(
        self,
        optimizer: torch.optim.Optimizer,
        lr_scheduler: Any = None,
        *,
        max_grad_norm: float | None = None,
    ) -> None:
        """The optimizer over this rank's Parameters (``pipe.parameters()``) that this stage
        steps at each update, the learning-rate scheduler stepped after it (once per
        update of this stage) and the gradient norm each update clips this stage's
        gradients to. Call it on every rank before the first step."""
        own = {id(p) for p in self.pipe.parameters()}
        given = {id(p) for g in optimizer.param_groups for p in g["params"]}
        if given != own:
            missing = [n for n, p in self.pipe.named_parameters() if id(p) not in given]
            raise ConfigError(
                f"the optimizer given to attach() holds {len(given - own)} tensor(s) this "
                f"rank's stage does not own and misses {len(missing)} it does "
                f"({missing[:3]}); make it over pipe.parameters() on each rank"
            )
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise ConfigError(f"max_grad_norm={max_grad_norm!r} must be a number > 0 or None")
        self._optimizer, self._scheduler, self._max_norm = optimizer, lr_scheduler, max_grad_norm

    @property
    def in_flight(self) -> int:
        """Micro-batches whose forward ran on this stage and whose backward has not."""
        return len(self._flight)

    @property
    def unflushed(self) -> int:
        """Micro-batches that entered the stream since the last flush: alike on every rank
        (the first stage holds some of them in flight whenever it is not 0)."""
        return self._unflushed

    def plan(self) -> Staleness:
        """Every stage's micro-batches in flight, staleness in updates, weight versions kept
        and their bytes (this rank's Parameter bytes stand for each stage's)."""
        stages = self.pipe.plan.stages
        return staleness_of(self.staleness, self.step_every, tuple(s.param_bytes for s in stages))

    def summary(self) -> str:
        """:meth:`plan`'s table, and what this rank has run."""
        return (
            f"{self.plan().summary()}\nrank of stage {self.j}: {self.forwards} forwards, "
            f"{self.updates} updates, {self.in_flight} in flight, the most weight versions "
            f"held {self._versions.most_held}"
        )

    def step(
        self, *args: Any, target: Any = None, losses: list[Any] | None = None, **kwargs: Any
    ) -> None:
        """``n_microbatches`` more micro-batches into the stream: the first rank passes the
        batch, the last ``target`` and ``losses`` (emptied, then each of this call's
        micro-batch losses, as its forward computed it: torch's schedules do the same);
        other ranks pass nothing. Returns once this stage has run
        their forwards and the backwards the rule allows; the rest run in later steps or in
        :meth:`flush`."""
        if self._optimizer is None:
            raise ConfigError(
                "schedule='Async1F1B' steps each stage's optimizer itself; call "
                "pipe.schedule.attach(optimizer) on every rank before the first step, with "
                "an optimizer over pipe.parameters()"
            )
        pipe = self.pipe
        pipe._check_modes()
        if losses is not None and self._next is None:
            losses.clear()
        self.stage.check_step()
        n = self.n_microbatches
        chunks: list[tuple[tuple[Any, ...], dict[str, Any]]] = [((), {})] * n
        if self.j == 0:
            key = self._checked(args, kwargs)
            split_args, split_kwargs = split_args_kwargs_into_chunks(args, kwargs, n)
            chunks = list(zip(split_args, split_kwargs, strict=True))
        targets: list[Any] = [None] * n
        if self._next is None:
            targets = [t[0] for t in split_args_kwargs_into_chunks((target,), {}, n)[0]]
        for (mb_args, mb_kwargs), mb_target in zip(chunks, targets, strict=True):
            if self.j == 0:
                self._send_header(key)
            else:
                key = self._receive_header()
                mb_args, mb_kwargs = self._receive_inputs(key), {}
            self._forward(mb_args, mb_kwargs, key, mb_target, losses)
            while len(self._flight) > self._warmup:
                self._backward(self._flight.popleft())
        self._sends = [(w, t) for w, t in self._sends if not w.is_completed()]

    def flush(self) -> None:
        """Run every backward still in flight on this stage, then an update with what is left
        (where any backward ran since the last): nothing is in flight after it. Call it on
        every rank before evaluating, saving, or changing the optimizer, and at the end."""
        while self._flight:
            self._backward(self._flight.popleft())
        if self._since:
            self._update()
        for work, _ in self._sends:
            work.wait()
        self._sends.clear()
        self._unflushed = 0

    # ------------------------------------------------------------------ forward, backward

    def _forward(
        self,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        key: tuple[int, ...],
        target: Any,
        losses: list[Any] | None,
    ) -> None:
        assert self._optimizer is not None
        stale = (self._since + len(self._flight)) // self.step_every
        version = self._versions.take(self.updates, stale, self._optimizer)
        recompute = self.staleness == "none" and stale > 0
        layouts = self._layouts(key)
        flight = _Flight(self.forwards, args, kwargs, version, None, layouts=layouts)
        if recompute:
            flight.rng = save_rng(self.pipe.device)
        with torch.no_grad() if recompute else contextlib.nullcontext():
            out = self._run(flight)
        self.forwards += 1
        self._unflushed += 1
        if self._next is None:  # the last stage: its loss, and its backward next
            assert self._loss is not None
            loss = self._loss(out, target)
            if losses is not None:
                losses.append(loss.detach())
            flight.outputs = (loss,)
        else:
            flight.outputs = None if recompute else out
            for t in out:
                self._send(t.detach(), self._next)
            flight.grads = [(t.shape, t.dtype) for t in out if t.is_floating_point()]
        self._flight.append(flight)

    def _run(self, flight: _Flight) -> Any:
        """The stage's forward of ``flight`` with its version's weights."""
        if flight.layouts is not None:
            self._module.set_layouts(flight.layouts)
        weights = self._versions.weights(flight.key)
        if weights is None:
            return self._module(*flight.args, **flight.kwargs)
        return functional_call(self._module, weights, flight.args, flight.kwargs)

    def _backward(self, flight: _Flight) -> None:
        roots: list[torch.Tensor]
        grads: list[torch.Tensor | None]
        if self._next is None:
            roots, grads = list(flight.outputs or ()), [None]
        else:
            received = [self._receive(s, dtype, self._next) for s, dtype in flight.grads]
            outputs = flight.outputs
            if outputs is None:  # "none": recomputed with the weights of now
                assert flight.rng is not None
                with restore_rng(self.pipe.device, flight.rng):
                    outputs = self._run(flight)
            floating = [t for t in outputs if t.is_floating_point()]
            pairs = [(t, g) for t, g in zip(floating, received, strict=True) if t.requires_grad]
            roots, grads = [t for t, _ in pairs], [g for _, g in pairs]
        if roots:
            torch.autograd.backward(roots, grads)
        self._versions.carry(flight.key)
        if self._prev is not None:
            for a in flight.args:
                if isinstance(a, torch.Tensor) and a.is_floating_point():
                    grad = a.grad if a.grad is not None else torch.zeros_like(a)
                    self._send(grad, self._prev)
        self._since += 1
        if self._since == self.step_every:
            self._update()

    def _update(self) -> None:
        """This stage's update (see the module docstring)."""
        optimizer, pipe = self._optimizer, self.pipe
        assert optimizer is not None
        if pipe.replicated_keys:
            pipe.sync_tied_gradients()
        params = pipe.parameters()
        if pipe.layout.dp_group is not None:
            _average(params, pipe.layout.dp_group)
        if self._max_norm is not None:
            nn.utils.clip_grad_norm_(params, self._max_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if self._scheduler is not None:
            self._scheduler.step()
        self._since, self.updates = 0, self.updates + 1

    # ------------------------------------------------------------------ sizes and sends

    def _checked(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[int, ...]:
        """The first rank: this call's sizes as a flat key; a refused call is told to the
        next ranks (which raise too, at their next step) before it is raised here."""
        shapes = self.pipe._step_shapes
        assert shapes is not None
        try:
            key = shapes.check(args, kwargs)
        except Exception:
            self._send(torch.ones(1 + self._width(), dtype=torch.int64), self._next)
            raise
        return tuple(size for shape in key for size in shape)

    def _width(self) -> int:
        shapes = self.pipe._step_shapes
        assert shapes is not None
        return sum(len(shape) for shape in shapes.key)

    def _send_header(self, key: tuple[int, ...]) -> None:
        if self._next is not None:
            self._send(torch.tensor([0, *key], dtype=torch.int64), self._next)

    def _receive_header(self) -> tuple[int, ...]:
        header = self._receive(torch.Size([1 + self._width()]), torch.int64, self._prev)
        if self._next is not None:
            self._send(header, self._next)
        if header[0]:
            raise InputError(
                f"stage {self.j}: the first rank refused this step's batch (its error says "
                "why); nothing of it ran, the micro-batches in flight stay in flight"
            )
        return tuple(header[1:].tolist())

    def _metas(self, key: tuple[int, ...]) -> Any:
        shapes = self.pipe._step_shapes
        assert shapes is not None
        return shapes.shapes(shapes._unflat(list(key)))

    def _layouts(self, key: tuple[int, ...]) -> Any:
        return self._metas(key).layouts[self.j] if self.j else None

    def _receive_inputs(self, key: tuple[int, ...]) -> tuple[torch.Tensor, ...]:
        inputs = self._metas(key).metas[self.j][0]
        out = []
        for meta in inputs:
            t = self._receive(meta.shape, meta.dtype, self._prev)
            out.append(t.requires_grad_() if t.is_floating_point() else t)
        return tuple(out)

    def _send(self, t: torch.Tensor, dst: int | None) -> None:
        assert dst is not None
        t = t.detach().contiguous().to(self._comm)
        self._sends.append((dist.isend(t, dst, group=self.pipe.group), t))

    def _receive(self, shape: torch.Size, dtype: torch.dtype, src: int | None) -> torch.Tensor:
        assert src is not None
        buf = torch.empty(shape, dtype=dtype, device=self._comm)
        dist.recv(buf, src, group=self.pipe.group)
        return buf.to(self.pipe.device)


def batch_statistics(traced: Traced, schedule: str) -> BatchStatistics:
    """The model's batch-statistics layers; ConfigError under the asynchronous schedule,
    whose stages run several weight versions (BatchNorm's running statistics would mix
    them, and a recomputed forward would update them twice)."""
    found = BatchStatistics.of(traced, option="n_microbatches")
    if schedule == ASYNC and found.layers:
        names = [name for name, _ in found.layers]
        raise ConfigError(
            f"schedule='Async1F1B' does not run a model with batch statistics ({names[:3]}): "
            "their running statistics would mix weight versions and count a recomputed "
            "forward twice; replace them (GroupNorm, LayerNorm), freeze them (eval mode "
            "before pipeline_schedule) or use a synchronous schedule such as '1f1b'"
        )
    return found


def _average(params: Sequence[torch.Tensor], group: Any) -> None:
    """Each gradient averaged over ``group`` (one all-reduce, as the tied sums' one)."""
    grads = []
    for p in params:
        if p.grad is None:  # as on a replica whose micro-batches gave it a gradient
            p.grad = torch.zeros_like(p)
        grads.append(p.grad)
    size = dist.get_world_size(group)
    reduced = list(grads)
    all_reduce_flat(reduced, list(range(len(reduced))), group, divide=size)
    for g, total in zip(grads, reduced, strict=True):
        g.copy_(total)
