"""The ring that runs generation steps through the stages: one worker thread per stage, each
taking the next lane's step as soon as the stage before hands it on, so that while lane ``j``
is at the last stage (and then back in its own loop choosing its next tokens) the other lanes
keep the earlier stages busy.

A lane is a thread of its own running ``generate``'s loop over its rows; its every forward is
one :meth:`Ring.step`, which blocks that lane only. With one lane the steps run in the
calling thread, stage after stage (no hand-over to pay). Each stage's run is a cell
``(lane, stage)`` of the recorder, so :func:`fxpipe.record` shows the lanes moving through.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

import torch

from fxpipe.devices.targets import same_device
from fxpipe.ir import StageProgram, ValueRef
from fxpipe.runtime.recording import NO_RECORDER, RunRecorder

__all__ = ["Ring", "on_device"]


@dataclass
class _Trip:
    """One lane's step on its way through the stages."""

    lane: int
    program: StageProgram
    env: dict[str, Any]
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None


class Ring:
    """Runs steps of stage programs whose stage ``j`` runs on ``devices[j]``; with
    ``threads``, one worker per stage (use as a context manager: the workers stop at exit)."""

    def __init__(
        self,
        devices: Sequence[torch.device],
        *,
        threads: bool,
        recorder: RunRecorder = NO_RECORDER,
    ) -> None:
        self.devices = tuple(devices)
        self.threads = threads
        self.recorder = recorder
        self._queues: list[queue.SimpleQueue[_Trip | None]] = []
        self._workers: list[threading.Thread] = []

    def __enter__(self) -> Ring:
        if self.threads:
            self._queues = [queue.SimpleQueue() for _ in self.devices]
            for j in range(len(self.devices)):
                worker = threading.Thread(
                    target=self._serve, args=(j,), name=f"fxpipe-ring-{j}", daemon=True
                )
                worker.start()
                self._workers.append(worker)
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        for q in self._queues:
            q.put(None)
        for worker in self._workers:
            worker.join()
        self._queues.clear()
        self._workers.clear()

    def step(self, lane: int, program: StageProgram, values: Sequence[Any]) -> Any:
        """The program's output for ``values`` (one per graph input), the stages run in turn
        (in their workers, with ``threads``); raises what a stage raised."""
        trip = _Trip(lane, program, dict(zip(program.graph_inputs, values, strict=True)))
        if not self.threads:
            for j in range(program.num_stages):
                self._run(trip, j)
        else:
            self._queues[0].put(trip)
            trip.done.wait()
            if trip.error is not None:
                raise trip.error
        (out,) = program.output_leaves
        return trip.env[out.name] if isinstance(out, ValueRef) else out

    def _serve(self, j: int) -> None:
        """Worker of stage ``j``: run each trip's stage ``j``, hand it on."""
        inbox = self._queues[j]
        last = j == len(self.devices) - 1
        while (trip := inbox.get()) is not None:
            if trip.error is None:
                try:
                    self._run(trip, j)
                except BaseException as e:  # handed to the lane that waits for it
                    trip.error = e
            if last or trip.error is not None:
                trip.done.set()
            else:
                self._queues[j + 1].put(trip)

    def _run(self, trip: _Trip, j: int) -> None:
        """Stage ``j`` of ``trip``: its inputs moved to its device, its outputs kept."""
        program, device = trip.program, self.devices[j]
        args = tuple(on_device(trip.env[name], device) for name in program.inputs[j])
        with torch.no_grad():
            work = self.recorder.cell(
                (trip.lane, j), device, program.modules[j], args, None, False
            )
            out = work()
        trip.env.update(zip(program.outputs[j], out, strict=True))


def on_device(value: Any, device: torch.device) -> Any:
    """``value`` on ``device`` (a tensor elsewhere is copied; anything else as it is)."""
    if isinstance(value, torch.Tensor) and not same_device(value.device, device):
        return value.to(device)
    return value
