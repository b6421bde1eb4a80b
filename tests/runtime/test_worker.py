"""Worker threads: one per device, always joined, carrying grad mode and autocast."""

from __future__ import annotations

import gc
import threading
import time
from typing import Any

import pytest
import torch
from helpers import spawn_workers
from threads import live_threads

from fxpipe.runtime.worker import Task, WorkerPool, capture_thread_state


def _workers() -> set[threading.Thread]:
    """Running fxpipe workers (earlier tests' pools may still be alive until collected)."""
    return {t for t in live_threads() if t.name.startswith("fxpipe-worker")}


def _run(task: Task, device: str = "cpu") -> Any:
    with spawn_workers([device]) as (in_queues, out_queues):
        in_queues[0].put(task)
        ok, value = out_queues[0].get()
    assert ok, value
    return value


def test_joined_on_exit() -> None:
    before = live_threads()
    with spawn_workers(["cpu"]):
        assert len(_workers() - before) == 1
    assert live_threads() <= before  # no thread left behind


@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_joined_on_exception(error: type[BaseException]) -> None:
    before = live_threads()
    with pytest.raises(error), spawn_workers(["cpu"]) as (in_queues, _):
        in_queues[0].put(Task(lambda: time.sleep(0.05)))
        raise error()
    assert live_threads() <= before  # no thread left behind


def test_one_worker_per_distinct_device() -> None:
    before = _workers()
    with spawn_workers(["cpu", "cpu:0", torch.device("cpu")]) as (in_queues, out_queues):
        assert len(_workers() - before) == 1
        assert in_queues[0] is in_queues[1] is in_queues[2]
        assert out_queues[0] is out_queues[2]


def test_runs_in_a_worker_thread() -> None:
    name = _run(Task(lambda: threading.current_thread().name))
    assert name != threading.current_thread().name
    assert name.startswith("fxpipe-worker")


def test_results_in_submission_order() -> None:
    with spawn_workers(["cpu"]) as (in_queues, out_queues):
        for k in range(5):
            in_queues[0].put(Task(lambda k=k: k))
        assert [out_queues[0].get() for _ in range(5)] == [(True, k) for k in range(5)]


def test_exception_payload() -> None:
    def fail() -> None:
        raise ValueError("boom")

    with spawn_workers(["cpu"]) as (in_queues, out_queues):
        in_queues[0].put(Task(fail))
        ok, (kind, exc, tb) = out_queues[0].get()
    assert not ok and kind is ValueError and str(exc) == "boom"
    assert tb.tb_next is not None


@pytest.mark.parametrize("grad", [True, False])
def test_grad_mode_propagates(grad: bool) -> None:
    with torch.set_grad_enabled(grad):
        task = Task(torch.is_grad_enabled)
    assert _run(task) is grad


def test_autocast_propagates() -> None:
    a, b = torch.randn(4, 4), torch.randn(4, 4)

    def compute() -> tuple[bool, torch.dtype]:
        return torch.is_autocast_enabled("cpu"), torch.mm(a, b).dtype

    seen: list[tuple[bool, torch.dtype]] = []
    with torch.autocast("cpu", dtype=torch.bfloat16):
        task = Task(compute)
        # Autocast is thread-local: a bare thread does not see it.
        bare = threading.Thread(target=lambda: seen.append(compute()))
        bare.start()
        bare.join()
    assert seen == [(False, torch.float32)]
    assert _run(task) == (True, torch.bfloat16)
    assert _run(Task(compute)) == (False, torch.float32)


def test_capture_thread_state() -> None:
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        state = capture_thread_state()
    assert not state.grad_enabled
    assert state.autocast == (("cpu", torch.bfloat16),)
    with state.enter():
        assert torch.is_autocast_enabled("cpu") and not torch.is_grad_enabled()
    assert not torch.is_autocast_enabled("cpu") and torch.is_grad_enabled()
    plain = capture_thread_state()
    with torch.autocast("cpu", dtype=torch.bfloat16), plain.enter():
        assert not torch.is_autocast_enabled("cpu")  # entering a state also switches off


@pytest.mark.cuda
def test_cuda_worker_runs_on_its_device() -> None:
    index = _run(Task(torch.cuda.current_device), "cuda:0")
    assert index == 0


def test_pool_reuses_its_threads_and_stops_them_when_closed() -> None:
    pool = WorkerPool()
    names = set()
    for _ in range(3):
        with pool.session(["cpu", "cpu:0"]) as (in_queues, out_queues):
            in_queues[0].put(Task(lambda: threading.current_thread().name))
            ok, name = out_queues[0].get()
            assert ok
            names.add(name)
    assert len(names) == 1 and len(pool.threads) == 1
    thread = pool.threads[0]
    pool.close()
    assert not thread.is_alive() and pool.threads == []


def test_pool_threads_use_the_callers_intra_op_thread_count() -> None:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        pool = WorkerPool()
        in_queues, out_queues = pool.queues(["cpu"])
        in_queues[0].put(Task(torch.get_num_threads))
        assert out_queues[0].get() == (True, 1)
        pool.close()
    finally:
        torch.set_num_threads(before)


def test_a_failed_session_stops_the_threads_and_the_pool_starts_afresh() -> None:
    pool = WorkerPool()
    with pytest.raises(KeyboardInterrupt), pool.session(["cpu"]):
        raise KeyboardInterrupt
    assert pool.threads == []
    with pool.session(["cpu"]) as (in_queues, out_queues):
        in_queues[0].put(Task(lambda: 7))
        assert out_queues[0].get() == (True, 7)
    pool.close()


def test_a_pool_that_is_garbage_collected_stops_its_threads() -> None:
    pool = WorkerPool()
    pool.queues(["cpu"])
    thread = pool.threads[0]
    del pool
    gc.collect()
    thread.join(timeout=5)
    assert not thread.is_alive()
