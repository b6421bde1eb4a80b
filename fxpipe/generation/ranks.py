"""``generate()`` one process per stage (:meth:`fxpipe.distributed.DistributedPipeline.generate`):
the lanes and ``generate``'s loops of :mod:`~fxpipe.generation.driver` in the last stage's
process (*home*, where the logits are), the other stages in their own processes, each
holding its own layers' cache.

A lane's step goes from home to the first stage's process as its inputs (the new tokens, the
mask, the positions: a few numbers per row) and travels point to point (``wire.py``) stage
to stage: each process receives what its stage and the later ones read, runs its stage with
its own rows of its layers' cache and hands on what the later stages read; home runs the
last stage and the lane picks its next tokens there (no logits travel). Beam search's
reordering of a lane's rows travels with its next step. An encoder-decoder's encoder step
goes the same way (the prompts out, the encoder's output back), and its decoder's first step
takes that output to the stages whose cross-attention layers cache what they read of it.
While one lane is in the first stages, home runs another's last stage, so with as many lanes
as stages every process works.
Each process sends from a thread of its own (a send waits for the next process to take it,
and this one goes on to the next lane's step), over the pipeline's group, home's sends to the
first stage under a tag of their own. When the call ends home sends a STOP round the ring,
then gives every process the result (or the error) to return (or raise).
"""

from __future__ import annotations

import dataclasses
import queue
import threading
from collections.abc import Sequence
from types import TracebackType
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fxpipe.errors import StageError
from fxpipe.generation.cache import StageCaches
from fxpipe.generation.driver import Generator
from fxpipe.generation.forms import KINDS
from fxpipe.generation.ring import on_device
from fxpipe.generation.step import StepVariant
from fxpipe.generation.wire import (
    ERROR,
    STEP,
    STOP,
    Inbox,
    Message,
    Packet,
    encode,
    error_message,
    error_text,
    in_order,
    named,
    send_message,
    send_packet,
)
from fxpipe.ir import PipelinePlan, StageProgram, ValueRef
from fxpipe.runtime.recording import RunRecorder

__all__ = ["RankGenerator"]

_META = torch.device("meta")
#: The name the rows' reordering travels under, beside a step's values.
_REORDER = "__reorder__"
#: Message tags: from home to the first stage, and from a stage to the next.
_OUT, _HOP = 1, 2
#: Seconds home's worker waits, after a lane's last stage, for that lane (or another) to
#: send its next step before it runs the next lane's last stage: a lane picking its tokens
#: beside a stage computing shares this process with it, and the first stages wait for
#: those tokens (4 prompts in two lanes, 2 processes: a few milliseconds a step).
_HAND_BACK_S = 0.005


class RankGenerator(Generator):
    """This process's part of pipelined generation: stage ``stage`` of ``plan``, on
    ``device``; ``peers``: the global rank of each stage's process in ``group``."""

    def __init__(
        self,
        model: nn.Module,
        plan: PipelinePlan,
        program: StageProgram,
        *,
        group: dist.ProcessGroup | None,
        peers: Sequence[int],
        stage: int,
        device: torch.device,
        comm: torch.device,
    ) -> None:
        super().__init__(model, plan, program)
        self.group, self.peers, self.stage = group, tuple(peers), stage
        self.device, self.comm = device, comm
        self.home = plan.num_stages - 1
        self._live: dict[int, tuple[tuple[str, ...], ...]] = {}
        self._stopped = False

    # ------------------------------------------------------------------ every process

    def run(self, args: tuple[Any, ...], kwargs: dict[str, Any], recorder: RunRecorder) -> Any:
        """``generate`` over the pipeline's processes, called on each with the same
        arguments (the prompts are read at home): every process returns home's result, or
        raises its error."""
        outcome: tuple[str, Any, Any]
        if self.stage == self.home:
            self._stopped = False
            try:
                outcome = ("ok", self.generate(args, kwargs, recorder=recorder), self.last)
            except Exception as e:  # every process raises it, after the ring has stopped
                outcome = ("error", e, self.last)
            if not self._stopped:  # refused before any step: the others wait to be told
                self._stop(inline=self._inbox())
        else:
            self._serve()
            outcome = ("", None, None)
        box = [outcome]
        home = self.peers[self.home]
        dist.broadcast_object_list(box, src=home, group=self.group, device=self.comm)
        status, result, self.last = box[0]
        if status == "error":
            assert isinstance(result, BaseException)
            raise result
        return result

    #: Two lanes over one, 2 processes on 2 cores (``benchmarks/generate.py``): 0.82x with
    #: 2 rows a lane, 1.22x with 4, 1.19x with 8, 1.31x with 16, 1.47x with 32.
    lane_rows = 4

    def places(self) -> int:
        return self.plan.num_stages

    def live(self, variant: StepVariant) -> tuple[tuple[str, ...], ...]:
        """For each stage ``j``, the values (by name) handed to its process: what stage ``j``
        and the later stages read of the step's inputs and the earlier stages' outputs,
        apart from the caches (each process holds its own) and, for home, the step's
        inputs (home has them)."""
        key = id(variant)
        if key not in self._live:
            program = variant.program
            caches = set(program.graph_inputs[variant.inputs :])
            ready, live = set(program.graph_inputs), []
            for j in range(program.num_stages):
                ready |= set(program.outputs[j - 1]) if j else set()
                later = {n for k in range(j, program.num_stages) for n in program.inputs[k]}
                home = set(program.graph_inputs) if j == self.home else set()
                live.append(tuple(sorted((ready & later) - caches - home)))
            self._live[key] = tuple(live)
        return self._live[key]

    # ------------------------------------------------------------------ home

    def _cache_devices(self) -> list[torch.device]:
        """Home's layers' caches on its device; the others' held by their processes
        (``meta`` here: their shapes only)."""
        first = self._first_with_cache()
        assert first is not None
        return [self.device if j == self.home else _META for j in first.layer_stages]

    def _ring(self, threads: bool, recorder: RunRecorder) -> _HomeRing:
        return _HomeRing(self, threads, recorder)

    def _through(
        self, ring: Any, lane: int, variant: StepVariant, values: list[Any], cache: Any
    ) -> torch.Tensor:
        if cache is None:  # an encoder's step
            out: torch.Tensor = ring.step(lane, variant, values, 0, None)
        else:
            out = ring.step(lane, variant, values, cache.seen, cache.take_reordered())
        return out

    def _inbox(self) -> Inbox:
        """What comes to this process from the stage before (to the first stage: from
        home)."""
        j = self.stage
        src, tag = (self.peers[j - 1], _HOP) if j else (self.peers[-1], _OUT)
        return Inbox(src, self.group, self.comm, tag=tag)

    def _stop(self, inline: Inbox | None) -> None:
        """Send a STOP round the ring; with an ``inline`` inbox, wait there for it to come
        back."""
        send_message(Message(STOP), self.peers[0], self.group, self.comm, tag=_OUT)
        if inline is not None:
            while inline.next().command != STOP:
                pass
        self._stopped = True

    # ------------------------------------------------------------------ the other processes

    def _serve(self) -> None:
        """Run this process's stage for every step that comes until a STOP (passed on)."""
        inbox = self._inbox()
        pools: dict[int, StageCaches] = {}
        outbox: queue.SimpleQueue[Packet] = queue.SimpleQueue()
        failed: list[BaseException] = []
        sender = threading.Thread(
            target=self._send_all, args=(outbox, failed), name="fxpipe-send", daemon=True
        )
        sender.start()  # a send waits for the next process to take it: this one goes on
        while True:
            message = inbox.next()
            if message.command == STEP:
                try:  # encoded here: a value the messages cannot carry is the lane's error
                    packet = encode(self._serve_step(message, pools), self.comm)
                except Exception as e:  # to the lane, which raises it
                    packet = encode(error_message(message.lane, e), self.comm)
            else:
                packet = encode(message, self.comm)
            if failed:  # the sender could not send: this process raises (the others time out)
                raise failed[0]
            outbox.put(packet)
            if message.command == STOP:
                sender.join()
                if failed:
                    raise failed[0]
                return

    def _send_all(self, outbox: queue.SimpleQueue[Packet], failed: list[BaseException]) -> None:
        """Send each message of ``outbox`` to the next stage's process, the STOP last; what
        a send raised goes to ``failed``."""
        try:
            while True:
                packet = outbox.get()
                send_packet(packet, self.peers[self.stage + 1], self.group, tag=_HOP)
                if packet.command == STOP:
                    return
        except BaseException as e:
            failed.append(e)

    def _serve_step(self, message: Message, pools: dict[int, StageCaches]) -> Message:
        """This stage's part of one lane's step: what the next process takes."""
        j = self.stage
        variant = self.variant(KINDS[message.kind], 1 if message.one_row else 2)
        program, live = variant.program, self.live(variant)
        env = named(message, (*live[j], _REORDER))
        reorder = env.pop(_REORDER)
        tensors = self._lane_rows(pools, message, variant) if variant.kind != "encode" else []
        local = [t for t in tensors if not t.is_meta]
        if message.seen == 0:  # a new group on this lane
            for t in local:
                t.zero_()
        if reorder is not None:
            for t in local:
                t.copy_(t.index_select(0, reorder.to(t.device)))
        env.update(zip(program.graph_inputs[variant.inputs :], tensors, strict=True))
        args = tuple(on_device(env[name], self.device) for name in program.inputs[j])
        with torch.no_grad():
            env.update(zip(program.outputs[j], program.modules[j](*args), strict=True))
        values = in_order(env, live[j + 1])
        if j + 1 < self.home:  # the later processes before home reorder their rows too
            values = (*values, reorder)
        return dataclasses.replace(message, values=values)

    def _lane_rows(
        self, pools: dict[int, StageCaches], message: Message, variant: StepVariant
    ) -> list[torch.Tensor]:
        """The lane's rows of every layer's cache: this stage's real, the others on meta."""
        pool = pools.get(message.lane)
        if (
            pool is None or pool.rows < message.rows or pool.length != message.length
            or pool.source != message.source
        ):  # fmt: skip
            devices = [self.device if s == self.stage else _META for s in variant.layer_stages]
            pool = StageCaches(
                self.layout(), devices, message.rows, message.length, message.source
            )
            pools[message.lane] = pool
        return pool.rows_of(0, message.rows)


class _Trip:
    """One lane's step on its way round the ring: its values at home, its logits."""

    def __init__(self, lane: int, variant: StepVariant, env: dict[str, Any]) -> None:
        self.lane, self.variant, self.env = lane, variant, env
        self.done = threading.Event()
        self.result: torch.Tensor | None = None
        self.error: BaseException | None = None


class _HomeRing:
    """Home's end of the ring: a step's inputs sent to the first stage, what comes back run
    through the last stage; with ``threads``, a worker receives and runs the last stage
    while the lanes send, so lanes' steps overlap (one lane: all in its own thread)."""

    def __init__(self, owner: RankGenerator, threads: bool, recorder: RunRecorder) -> None:
        self.owner, self.threads, self.recorder = owner, threads, recorder
        self._waiting: dict[int, _Trip] = {}
        self._sending = threading.Lock()
        self._sent = threading.Event()
        self._broken: BaseException | None = None
        self._worker: threading.Thread | None = None
        self._inbox: Inbox | None = None

    def __enter__(self) -> _HomeRing:
        self._inbox = self.owner._inbox()
        if self.threads:
            self._worker = threading.Thread(target=self._work, name="fxpipe-home", daemon=True)
            self._worker.start()
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self.owner._stop(inline=None if self.threads else self._inbox)
        if self._worker is not None:
            self._worker.join()
            self._worker = None

    def step(
        self,
        lane: int,
        variant: StepVariant,
        values: Sequence[Any],
        seen: int,
        reorder: torch.Tensor | None,
    ) -> torch.Tensor:
        """The logits of one step of ``lane`` (``seen``: positions written before it)."""
        owner, program = self.owner, variant.program
        trip = _Trip(lane, variant, dict(zip(program.graph_inputs, values, strict=True)))
        rows, length, source = variant.sizes(list(values))
        message = Message(
            STEP, lane, KINDS.index(variant.kind), int(variant.one_row), rows, length, seen,
            source, (*in_order(trip.env, owner.live(variant)[0]), reorder),
        )  # fmt: skip
        if self._broken is not None:
            raise self._broken
        self._waiting[lane] = trip
        with self._sending:
            send_message(message, owner.peers[0], owner.group, owner.comm, tag=_OUT)
        self._sent.set()
        if not self.threads:
            self._take(self._receive())
        trip.done.wait()
        if trip.error is not None:
            raise trip.error
        assert trip.result is not None
        return trip.result

    def _receive(self) -> Message:
        assert self._inbox is not None
        return self._inbox.next()

    def _take(self, message: Message) -> bool:
        """Run the last stage of the step that came back and hand its logits to its lane
        (or the error that came instead); False for the STOP."""
        if message.command == STOP:
            return False
        trip = self._waiting.pop(message.lane)
        try:
            if message.command == ERROR:
                raise StageError(f"generation step of lane {trip.lane}: {error_text(message)}")
            trip.result = self._last_stage(trip, message)
        except BaseException as e:  # to the lane waiting for it
            trip.error = e
        self._sent.clear()
        trip.done.set()
        if self.threads:  # the lane picks its tokens and sends its next step on its own
            self._sent.wait(_HAND_BACK_S)  # (the first stages wait for it), then the next
        return True

    def _last_stage(self, trip: _Trip, message: Message) -> torch.Tensor:
        owner, program = self.owner, trip.variant.program
        env = trip.env
        env.update(named(message, owner.live(trip.variant)[owner.home]))
        args = tuple(on_device(env[name], owner.device) for name in program.inputs[owner.home])
        with torch.no_grad():
            work = self.recorder.cell(
                (trip.lane, owner.home), owner.device, program.modules[owner.home], args, None,
                False,
            )  # fmt: skip
            env.update(zip(program.outputs[owner.home], work(), strict=True))
        (out,) = program.output_leaves
        result: torch.Tensor = env[out.name] if isinstance(out, ValueRef) else out
        return result

    def _work(self) -> None:
        """The worker: each step that comes back through the last stage, until the STOP;
        where receiving fails, every waiting lane gets the error."""
        try:
            while self._take(self._receive()):
                pass
        except BaseException as e:
            self._broken = e
            for trip in list(self._waiting.values()):
                trip.error = e
                trip.done.set()
