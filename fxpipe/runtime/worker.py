"""One worker thread per device, the tasks they run, and the thread-local state tasks carry.

Python launches kernels one at a time, so a single thread driving every device would let one
device starve the others; each distinct device gets its own thread instead. Grad mode and
autocast are thread-local in PyTorch, so a :class:`Task` captures them in the thread that
creates it and re-enters them in the worker.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from queue import Queue
from typing import Any, TypeAlias

import torch

from fxpipe.runtime.stream import (
    AbstractStream,
    CPUStream,
    normalize_device,
    use_device,
    use_stream,
)

__all__ = [
    "ThreadState",
    "capture_thread_state",
    "Task",
    "Result",
    "InQueue",
    "OutQueue",
    "spawn_workers",
]

#: ``(True, value)`` when a task returned, ``(False, exc_info)`` when it raised, where
#: ``exc_info`` is ``(type, exception, traceback)``.
Result: TypeAlias = tuple[bool, Any]
InQueue: TypeAlias = "Queue[Task | None]"
OutQueue: TypeAlias = "Queue[Result]"

#: Device types whose autocast state travels with a task.
_AUTOCAST_TYPES = ("cpu", "cuda")


@dataclass(frozen=True)
class ThreadState:
    """The thread-local switches a computation depends on: grad mode and autocast."""

    grad_enabled: bool
    #: ``(device_type, dtype)`` of every device type autocast is enabled for.
    autocast: tuple[tuple[str, torch.dtype], ...]
    autocast_cache: bool

    @contextmanager
    def enter(self) -> Iterator[None]:
        """Run the block with this state, whatever the current thread's state is."""
        enabled = dict(self.autocast)
        with ExitStack() as stack:
            stack.enter_context(torch.set_grad_enabled(self.grad_enabled))
            for device_type in _AUTOCAST_TYPES:
                if device_type in enabled:
                    stack.enter_context(
                        torch.autocast(
                            device_type,
                            dtype=enabled[device_type],
                            cache_enabled=self.autocast_cache,
                        )
                    )
                elif torch.is_autocast_enabled(device_type):
                    stack.enter_context(torch.autocast(device_type, enabled=False))
            yield


def capture_thread_state() -> ThreadState:
    """The grad mode and autocast state of the calling thread."""
    enabled = tuple(
        (t, torch.get_autocast_dtype(t)) for t in _AUTOCAST_TYPES if torch.is_autocast_enabled(t)
    )
    return ThreadState(torch.is_grad_enabled(), enabled, torch.is_autocast_cache_enabled())


class Task:
    """A computation to run in a worker thread, with the creating thread's state and stream."""

    def __init__(
        self,
        compute: Callable[[], Any],
        *,
        stream: AbstractStream = CPUStream,
    ) -> None:
        self.compute = compute
        self.stream = stream
        self.state = capture_thread_state()

    def run(self) -> Result:
        """Run the computation; never raises: failures come back as ``(False, exc_info)``."""
        try:
            with use_stream(self.stream), self.state.enter():
                return True, self.compute()
        except BaseException:
            exc_info = sys.exc_info()
            return False, exc_info


def _worker(device: torch.device, in_queue: InQueue, out_queue: OutQueue) -> None:
    with use_device(device):
        while True:
            task = in_queue.get()
            if task is None:
                break
            out_queue.put(task.run())


def _start(device: torch.device) -> tuple[InQueue, OutQueue, threading.Thread]:
    in_queue: InQueue = Queue()
    out_queue: OutQueue = Queue()
    thread = threading.Thread(
        target=_worker,
        args=(device, in_queue, out_queue),
        name=f"fxpipe-worker-{device}",
        daemon=True,
    )
    thread.start()
    return in_queue, out_queue, thread


@contextmanager
def spawn_workers(
    devices: Sequence[torch.device | str | int],
) -> Iterator[tuple[list[InQueue], list[OutQueue]]]:
    """Start one thread per distinct device; yield in/out queues aligned with ``devices``.

    Equal devices (``cpu`` and ``cpu:0``; ``cuda`` and the current CUDA index) share one
    thread and one pair of queues, which run tasks in submission order. On exit, also on an
    exception or KeyboardInterrupt, every thread gets a stop sentinel and is joined (a task
    in progress finishes first), so no thread outlives the block.
    """
    workers: dict[torch.device, tuple[InQueue, OutQueue, threading.Thread]] = {}
    try:
        normalized = [normalize_device(d) for d in devices]
        for device in normalized:
            if device not in workers:
                workers[device] = _start(device)
        yield [workers[d][0] for d in normalized], [workers[d][1] for d in normalized]
    finally:
        for in_queue, _, _ in workers.values():
            in_queue.put(None)
        for _, _, thread in workers.values():
            thread.join()
