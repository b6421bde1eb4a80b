"""Faults at run time: an exception raised inside any stage, in forward, in backward or while
a checkpointed stage is recomputed, reaches the caller with its own type and traceback within
a second, leaves no worker thread behind, and the next step equals eager again. The error
names where it happened: the stage, the micro-batch and its rows (a note on the exception, or
a StageRunError caused by torch's own RuntimeError)."""

from __future__ import annotations

import copy
import gc
import os
import threading
import time
import traceback
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch import nn

import fxpipe
from fxpipe.errors import StageRunError
from fxpipe.runtime.checkpoint import is_recomputing

STAGES = 4
MODES = ("always", "never")
#: Where the next fault fires: ``(stage, when)``; when is "forward", "backward",
#: "recompute" or "interrupt".
FAULT: dict[str, Any] = {"at": None}


class InjectedError(Exception):
    """The exception the probes raise (a type of the user's own, not one of fxpipe's)."""


def probe(x: torch.Tensor, stage: int) -> torch.Tensor:
    """Identity that raises while a forward fault is armed for ``stage``."""
    if FAULT["at"] == (stage, "forward"):
        raise InjectedError(f"forward fault in stage {stage}")
    if FAULT["at"] == (stage, "interrupt"):
        raise KeyboardInterrupt
    if FAULT["at"] == (stage, "recompute") and is_recomputing():
        raise InjectedError(f"recompute fault in stage {stage}")
    return _BackwardProbe.apply(x, stage)  # type: ignore[no-any-return]


torch.fx.wrap("probe")


class _BackwardProbe(torch.autograd.Function):
    """Identity whose backward raises while a backward fault is armed for its stage."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, stage: int) -> torch.Tensor:
        ctx.stage = stage
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        if FAULT["at"] == (ctx.stage, "backward"):
            raise InjectedError(f"backward fault in stage {ctx.stage}")
        return grad, None


class Probed(nn.Module):
    """Four equal blocks, each ending in a probe that names its block."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(STAGES))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for k, block in enumerate(self.blocks):
            x = probe(torch.tanh(block(x)), k)
        return x


@dataclass
class Setup:
    pipe: fxpipe.Pipeline
    twin: nn.Module
    #: Threads alive before the pipeline first ran (other pipelines collected).
    baseline: int


@pytest.fixture(scope="module", params=MODES)
def setup(request: pytest.FixtureRequest) -> Iterator[Setup]:
    gc.collect()  # pipelines of earlier tests stop their worker threads when collected
    torch.manual_seed(0)
    model = Probed().double()
    twin = copy.deepcopy(model)
    x = torch.randn(8, 8, dtype=torch.float64)
    pipe = fxpipe.pipeline(
        model, x, ["cpu"] * STAGES, chunks=4, checkpoint=request.param, cost="flops"
    )
    # Counted once the pipeline is built: planning starts no worker, but the first plan in
    # a process may start a library's own thread for good (tqdm's monitor, which torch.fx's
    # interpreter starts when tqdm is installed).
    baseline = threading.active_count()
    # One CPU device runs stages in the calling thread; faults are tested on the worker
    # threads that several devices use, where losing or leaking a thread can happen.
    pipe.use_threads = True
    yield Setup(pipe, twin, baseline)
    FAULT["at"] = None


def test_each_probe_lands_in_its_own_stage(setup: Setup) -> None:
    pipe = setup.pipe
    probes = sorted(n for n in pipe.plan.stage_of if n.startswith("probe"))
    assert [pipe.plan.stage_of[n] for n in probes] == list(range(STAGES))


def _step(pipe: fxpipe.Pipeline, x: torch.Tensor) -> None:
    pipe(x).square().sum().backward()
    pipe.zero_grad(set_to_none=True)


def assert_equals_eager(setup: Setup) -> None:
    """The next step equals eager, and the pipeline's threads are back: one worker for the
    CPU stages (they share a device), however many steps ran or failed before."""
    pipe, twin = setup.pipe, setup.twin
    pipe.zero_grad(set_to_none=True)
    twin.zero_grad(set_to_none=True)
    x = torch.randn(8, 8, dtype=torch.float64)
    got, want = pipe(x), twin(x)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    got.square().sum().backward()
    want.square().sum().backward()
    for p, q in zip(pipe.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-12)
    assert threading.active_count() == setup.baseline + 1


def _fails(
    setup: Setup, at: tuple[int, str], error: type[BaseException], match: str | None
) -> Any:
    """Arm ``at``, run a step that must raise ``error`` within a second; return the error.

    No thread may outlive the failed step: a failure inside the pipeline's run stops its
    workers (back to the baseline); one in backward (which autograd runs in this thread)
    leaves the one idle worker the pipeline keeps between steps (the forward of that step
    succeeded), and nothing more.
    """
    FAULT["at"] = at
    try:
        started = time.perf_counter()
        with pytest.raises(error, match=match) as info:
            _step(setup.pipe, torch.randn(8, 8, dtype=torch.float64))
        elapsed = time.perf_counter() - started
    finally:
        FAULT["at"] = None
    assert elapsed < 1.0
    in_backward = at[1] in ("backward", "recompute")
    assert threading.active_count() == setup.baseline + (1 if in_backward else 0)
    return info.value


@pytest.mark.parametrize("stage", range(STAGES))
@pytest.mark.parametrize("when", ["forward", "backward", "recompute"])
def test_a_fault_surfaces_fast_with_its_type_and_the_pipeline_recovers(
    setup: Setup, stage: int, when: str
) -> None:
    if when == "recompute" and setup.pipe.checkpoint == "never":
        FAULT["at"] = (stage, when)
        try:
            _step(setup.pipe, torch.randn(8, 8, dtype=torch.float64))
        finally:
            FAULT["at"] = None  # nothing is recomputed without checkpointing: no fault fired
        assert_equals_eager(setup)
        return
    error = _fails(setup, (stage, when), InjectedError, f"{when} fault in stage {stage}")
    frames = traceback.extract_tb(error.__traceback__)
    assert frames[-1].name == ("backward" if when == "backward" else "probe")
    assert_equals_eager(setup)


@pytest.mark.parametrize("stage", range(STAGES))
def test_a_keyboard_interrupt_in_a_stage_propagates_and_leaves_the_pipeline_usable(
    setup: Setup, stage: int
) -> None:
    _fails(setup, (stage, "interrupt"), KeyboardInterrupt, None)
    assert_equals_eager(setup)


def test_a_fault_in_one_call_does_not_leak_into_gradients_of_the_next(setup: Setup) -> None:
    """A forward that fails leaves no partial gradient behind (no backward ever ran)."""
    setup.pipe.zero_grad(set_to_none=True)
    _fails(setup, (STAGES - 1, "forward"), InjectedError, "forward fault")
    assert all(p.grad is None for p in setup.pipe.parameters())
    assert_equals_eager(setup)


def test_many_steps_keep_the_thread_count_flat(setup: Setup) -> None:
    for _ in range(20):
        _step(setup.pipe, torch.randn(8, 8, dtype=torch.float64))
        assert threading.active_count() == setup.baseline + 1


def test_a_model_error_from_a_wrong_input_is_the_models_own() -> None:
    """Bad values the binder cannot see (a wrong feature size) fail inside the stage with
    the error the eager model gives, and the pipeline keeps working."""
    gc.collect()
    threads = threading.active_count()
    torch.manual_seed(0)
    model = Probed()
    pipe = fxpipe.pipeline(model, torch.randn(4, 8), ["cpu"] * 2, chunks=2, cost="flops")
    with pytest.raises(RuntimeError) as eager:
        model(torch.randn(4, 5))
    with pytest.raises(RuntimeError) as piped:
        pipe(torch.randn(4, 5))
    assert "cannot be multiplied" in str(eager.value)
    assert "cannot be multiplied" in str(piped.value)
    assert threading.active_count() == threads
    x = torch.randn(4, 8)
    torch.testing.assert_close(pipe(x), model(x))


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads /proc (Linux)")
def test_a_short_soak_keeps_threads_flat_and_memory_bounded() -> None:
    """100 training steps (the long run is benchmarks/soak.py): the thread count never
    moves after the first step, and the resident size grows by less than 20 MiB."""
    gc.collect()
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(32, 32), nn.GELU())])
    pipe = fxpipe.pipeline(model, torch.randn(16, 32), ["cpu"] * 4, chunks=4, cost="flops")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step() -> None:
        pipe(torch.randn(16, 32)).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(10):  # warm-up: the worker, the optimizer state, the allocator
        step()
    threads, rss = threading.active_count(), _rss_mib()
    for _ in range(100):
        step()
        assert threading.active_count() == threads
    assert _rss_mib() - rss < 20.0


# ------------------------------------- what a failing stage's error says: where


FAILURE: dict[str, Exception | None] = {"armed": None}


def boom(x: torch.Tensor) -> torch.Tensor:
    """Identity that raises the armed exception; traced as one call, so it runs per call."""
    if FAILURE["armed"] is not None:
        raise FAILURE["armed"]
    return x


torch.fx.wrap("boom")


class Fails(nn.Module):
    """Three layers with a failure point between the second and the third."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.c = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(boom(self.b(self.a(x))))


def _fail_once(pipe: fxpipe.Pipeline, x: torch.Tensor, error: Exception) -> Exception:
    """Call ``pipe(x)`` with ``boom`` armed to raise ``error``; what the call raised."""
    FAILURE["armed"] = error
    try:
        with pytest.raises(Exception) as info:
            pipe(x)
    finally:
        FAILURE["armed"] = None
    return info.value


def _stage_of_boom(pipe: fxpipe.Pipeline) -> str:
    """``stage 2 (c, on cpu)``: the stage that runs ``boom``, named by its modules."""
    j = pipe.plan.stage_of[next(n for n in pipe.plan.stage_of if n.startswith("boom"))]
    modules = [m for m in "abc" if pipe.plan.stage_of[m] == j]
    span = modules[0] if len(modules) == 1 else f"{modules[0]} to {modules[-1]}"
    return f"stage {j} ({span}, on cpu)"


def test_a_stage_that_raises_surfaces_its_exception_and_the_next_call_works() -> None:
    model = Fails()
    x = torch.randn(8, 4)
    pipe = fxpipe.pipeline(model, x, ["cpu"] * 3, chunks=4, cost="flops")
    threads = threading.active_count()
    error = _fail_once(pipe, x, KeyError("injected failure"))
    assert type(error) is KeyError and error.args == ("injected failure",)
    frames = [f.name for f in traceback.extract_tb(error.__traceback__)]
    assert frames[-1] == "boom"  # the raising frame is kept
    notes = getattr(error, "__notes__", None)
    if notes is not None:  # Python 3.11+: where it happened, added as a note
        assert notes == [
            f"fxpipe: raised by {_stage_of_boom(pipe)} on micro-batch 0 of 4 (rows 0-1 of "
            "the call's batch of 8)"
        ]
    assert threading.active_count() == threads
    torch.testing.assert_close(pipe(x), model(x))


def test_a_torch_runtime_error_in_a_stage_names_the_stage_micro_batch_and_rows() -> None:
    """A plain RuntimeError (torch's kind) becomes a StageRunError caused by it; a message
    about no size gets no hint about batch sizes written into the model."""
    model = Fails()
    x = torch.randn(10, 4)
    pipe = fxpipe.pipeline(model, x, ["cpu"] * 3, chunks=4, cost="flops")
    cause = RuntimeError("injected failure")
    error = _fail_once(pipe, x, cause)
    assert isinstance(error, StageRunError) and isinstance(error, RuntimeError)
    assert error.__cause__ is cause
    assert str(error) == (
        f"{_stage_of_boom(pipe)} failed on micro-batch 0 of 4 (rows 0-2 of the call's batch "
        "of 10): injected failure"
    )
    torch.testing.assert_close(pipe(x), model(x))
