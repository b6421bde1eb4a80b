"""``fxpipe.record``: exactly the expected tasks, in a valid order, with unchanged gradients."""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

import pytest
import torch
from models import ZOO

import fxpipe
from fxpipe.errors import ConfigError
from fxpipe.runtime.recording import Recorder
from fxpipe.timeline import TaskRecord, Timeline

K, CHUNKS, BATCH = 3, 4, 8


pytestmark = pytest.mark.usefixtures("one_thread")


RECOMPUTED = {"always": CHUNKS, "except_last": CHUNKS - 1, "never": 0}


def _pipe(checkpoint: str, model: torch.nn.Module | None = None) -> fxpipe.Pipeline:
    case = ZOO["mlp_residual"]
    (x,), _ = case.example(BATCH)
    return fxpipe.pipeline(
        model or case.build(), x, ["cpu"] * K, chunks=CHUNKS, checkpoint=checkpoint, cost="flops"
    )


def _step(pipe: fxpipe.Pipeline) -> tuple[Timeline, torch.Tensor]:
    (x,), _ = ZOO["mlp_residual"].example(BATCH)
    with fxpipe.record(pipe) as tl:
        out = pipe(x)
        out.pow(2).sum().backward()
    return tl, out


def _by_cell(tasks: list[TaskRecord], phase: str) -> dict[tuple[int, int], TaskRecord]:
    cells = [t for t in tasks if t.phase == phase]
    found = {(t.i, t.j): t for t in cells}
    assert len(found) == len(cells), f"a {phase} cell was recorded twice"
    return found


@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
def test_training_step_records_every_task_in_order(checkpoint: str) -> None:
    tl, _ = _step(_pipe(checkpoint))
    counts = Counter(t.phase for t in tl.tasks)
    assert counts == Counter(
        forward=K * CHUNKS, backward=K * CHUNKS, recompute=K * RECOMPUTED[checkpoint]
    )  # all stages on the CPU: no copy
    every = {(i, j) for i in range(CHUNKS) for j in range(K)}
    fwd, bwd, rec = (_by_cell(tl.tasks, p) for p in ("forward", "backward", "recompute"))
    assert set(fwd) == set(bwd) == every
    assert set(rec) == {(i, j) for i, j in every if i < RECOMPUTED[checkpoint]}
    for (i, j), t in fwd.items():
        assert t.start <= t.end and t.device == "cpu"
        if j > 0:
            assert t.start >= fwd[(i, j - 1)].end  # forward (i, j) after (i, j - 1)
    for (i, j), t in bwd.items():
        assert t.start >= max(f.end for f in fwd.values())
        if j < K - 1:
            assert t.start >= bwd[(i, j + 1)].end  # backward (i, j) after (i, j + 1)
        if i < CHUNKS - 1:
            assert t.start >= bwd[(i + 1, j)].end  # reverse micro-batch order per stage
        if (i, j) in rec:
            assert fwd[(i, j)].end <= rec[(i, j)].start <= rec[(i, j)].end <= t.start


def test_recording_keeps_outputs_and_gradients() -> None:
    """The same step with and without recording: same outputs, same gradients."""
    case = ZOO["mlp_residual"]
    (x,), _ = case.example(BATCH)
    plain_model = case.build()
    plain = _pipe("except_last", plain_model)(x)
    plain.pow(2).sum().backward()
    model = case.build()
    _, out = _step(_pipe("except_last", model))
    assert torch.equal(out, plain)
    for p, q in zip(model.parameters(), plain_model.parameters(), strict=True):
        assert p.grad is not None and q.grad is not None
        assert torch.allclose(p.grad, q.grad, rtol=1e-6, atol=1e-7)


def test_recording_is_off_outside_the_block_and_after_an_error() -> None:
    pipe = _pipe("except_last")
    assert pipe._executor.recorder is None
    with pytest.raises(RuntimeError, match="boom"), fxpipe.record(pipe):
        assert pipe._executor.recorder is not None
        raise RuntimeError("boom")
    assert pipe._executor.recorder is None
    (x,), _ = ZOO["mlp_residual"].example(BATCH)
    with fxpipe.record(pipe) as tl:
        out = pipe(x)
    out.sum().backward()  # after the block: not recorded
    assert {t.phase for t in tl.tasks} == {"forward"}


def _graph_names(root: Any) -> set[str]:
    seen, names, stack = set(), set(), [root]
    while stack:
        fn = stack.pop()
        if fn is None or id(fn) in seen:
            continue
        seen.add(id(fn))
        names.add(type(fn).__name__)
        stack.extend(f for f, _ in fn.next_functions)
    return names


def test_nothing_is_attached_when_not_recording() -> None:
    pipe = _pipe("never")
    (x,), _ = ZOO["mlp_residual"].example(BATCH)
    assert "TimedBackward" not in _graph_names(pipe(x).grad_fn)
    with fxpipe.record(pipe):
        assert "TimedBackward" in _graph_names(pipe(x).grad_fn)


def test_nested_recording_and_wrong_argument_are_refused() -> None:
    pipe = _pipe("never")
    with fxpipe.record(pipe), pytest.raises(ConfigError, match="already being recorded"):
        with fxpipe.record(pipe):
            pass
    with pytest.raises(ConfigError, match="takes the Pipeline"):
        fxpipe.record(torch.nn.Linear(2, 2))  # type: ignore[arg-type]


def test_no_grad_records_forward_only() -> None:
    pipe = _pipe("always")
    (x,), _ = ZOO["mlp_residual"].example(BATCH)
    with torch.no_grad(), fxpipe.record(pipe) as tl:
        pipe(x)
    assert Counter(t.phase for t in tl.tasks) == Counter(forward=K * CHUNKS)


def test_summary_and_measurements() -> None:
    tl, _ = _step(_pipe("except_last"))
    text = tl.summary()
    assert "measured bubble" in text and "predicted bubble" in text
    assert "share a device" in text  # three stages on one CPU
    for j in range(K):
        assert 0 < tl.busy(j) <= tl.makespan
    assert 0.0 <= tl.bubble() < 1.0
    assert tl.predicted_bubble() == pytest.approx(
        fxpipe.report.gpipe_prediction(tl.plan, CHUNKS)[0]
    )


def test_plot_and_chrome_trace(tmp_path: Any) -> None:
    pytest.importorskip("matplotlib")
    tl, _ = _step(_pipe("except_last"))
    png = tl.plot(tmp_path / "timeline.png")
    assert png.read_bytes().startswith(b"\x89PNG")
    trace = json.loads(tl.to_chrome_trace(tmp_path / "trace.json").read_text())
    assert len(trace["traceEvents"]) == len(tl.tasks)
    with pytest.raises(ConfigError, match="suffix"):
        tl.plot(tmp_path / "timeline.bmp")


def test_transfer_times_the_copy_both_ways() -> None:
    """A copy between devices, simulated on CPU: forward span, then its backward."""
    recorder = Recorder()
    x = torch.randn(4, requires_grad=True)
    cpu = torch.device("cpu")
    (moved,) = recorder.transfer(
        lambda ts: tuple(t * 1.0 for t in ts), (x,), (1, 2), (torch.device("meta"), cpu), None
    )
    moved.sum().backward()
    spans = recorder.close()
    assert [(s.phase, s.i, s.j, s.grad) for s in spans] == [
        ("copy", 1, 2, False),
        ("copy", 1, 2, True),
    ]
    assert str(spans[0].source) == "meta" and spans[1].device.type == "meta"
    assert torch.equal(x.grad, torch.ones(4))  # type: ignore[arg-type]


@pytest.mark.cuda
def test_copies_between_devices_are_recorded() -> None:
    case = ZOO["mlp_residual"]
    (x,), _ = case.example(BATCH)
    pipe = fxpipe.pipeline(case.build(), x, ["cpu", "cuda:0", "cpu"], chunks=CHUNKS)
    with fxpipe.record(pipe) as tl:
        pipe(x).sum().backward()
    copies = [t for t in tl.tasks if t.phase == "copy"]
    assert {t.grad for t in copies} == {False, True}
    assert all(t.source != t.device for t in copies)
    assert Counter(t.phase for t in tl.tasks)["forward"] == 3 * CHUNKS
