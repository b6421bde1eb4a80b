"""One worker thread per device, the tasks they run, and the thread-local state tasks carry.

Python launches kernels one at a time, so a single thread driving every device would let one
device starve the others; each distinct device gets its own thread instead. Grad mode and
autocast are thread-local in PyTorch, so a :class:`Task` captures them in the thread that
creates it and re-enters them in the worker.
"""

from __future__ import annotations

import sys
import threading
import weakref
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
    "WorkerPool",
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


def _worker(
    device: torch.device, num_threads: int, in_queue: InQueue, out_queue: OutQueue
) -> None:
    # A new thread starts with the process's default intra-op thread count, not the one the
    # caller set: without this, every op in the worker may spin up a fresh OpenMP team.
    torch.set_num_threads(num_threads)
    with use_device(device):
        while True:
            task = in_queue.get()
            if task is None:
                break
            out_queue.put(task.run())


Workers: TypeAlias = "dict[torch.device, tuple[InQueue, OutQueue, threading.Thread]]"


def _start(device: torch.device) -> tuple[InQueue, OutQueue, threading.Thread]:
    in_queue: InQueue = Queue()
    out_queue: OutQueue = Queue()
    thread = threading.Thread(
        target=_worker,
        args=(device, torch.get_num_threads(), in_queue, out_queue),
        name=f"fxpipe-worker-{device}",
        daemon=True,
    )
    thread.start()
    return in_queue, out_queue, thread


def _stop(workers: Workers) -> None:
    """Send every thread its stop sentinel and join it (a task in progress finishes first)."""
    for in_queue, _, _ in workers.values():
        in_queue.put(None)
    for _, _, thread in workers.values():
        thread.join()
    workers.clear()


class WorkerPool:
    """Worker threads that live as long as their owner, one per distinct device.

    Starting threads on every run costs more than the run on small stages (and each new
    thread pays OpenMP's start-up again), so a pool keeps them. A run that ends in an
    exception closes the pool, so no task of a failed run can answer the next one; the
    threads stop when the pool is closed or garbage-collected.
    """

    def __init__(self) -> None:
        self._workers: Workers = {}
        self._finalizer = weakref.finalize(self, _stop, self._workers)

    def queues(
        self, devices: Sequence[torch.device | str | int]
    ) -> tuple[list[InQueue], list[OutQueue]]:
        """In/out queues aligned with ``devices``; equal devices share one thread."""
        normalized = [normalize_device(d) for d in devices]
        for device in normalized:
            alive = device in self._workers and self._workers[device][2].is_alive()
            if not alive:
                self._workers[device] = _start(device)
        return [self._workers[d][0] for d in normalized], [self._workers[d][1] for d in normalized]

    @contextmanager
    def session(
        self, devices: Sequence[torch.device | str | int]
    ) -> Iterator[tuple[list[InQueue], list[OutQueue]]]:
        """The queues for one run; if the run raises (KeyboardInterrupt included), the
        threads are stopped and joined before the exception leaves."""
        try:
            yield self.queues(devices)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        _stop(self._workers)

    @property
    def threads(self) -> list[threading.Thread]:
        return [thread for _, _, thread in self._workers.values()]
