"""``fxpipe.record``: exactly the expected tasks, in a valid order, with unchanged gradients."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
import torch
from models import ZOO

import fxpipe
from fxpipe.errors import ConfigError
from fxpipe.runtime.checkpoint import Checkpointing
from fxpipe.runtime.recording import NullRecorder, Recorder
from fxpipe.views.timeline import TaskRecord, Timeline

K, CHUNKS, BATCH = 3, 4, 8


pytestmark = pytest.mark.usefixtures("one_thread")


RECOMPUTED = {"always": CHUNKS, "except_last": CHUNKS - 1, "never": 0}


def _pipe(checkpoint: Any, model: torch.nn.Module | None = None) -> fxpipe.Pipeline:
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


def test_per_stage_modes_recompute_only_their_stages() -> None:
    modes = ("never", "always", "except_last")
    tl, _ = _step(_pipe(list(modes)))
    recomputed = Counter(t.j for t in tl.tasks if t.phase == "recompute")
    assert recomputed == Counter({1: CHUNKS, 2: CHUNKS - 1})
    assert tl.checkpoint == modes and str(modes) in tl.summary()


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
    pipe = _pipe("except_last")  # the last micro-batch keeps its activations: Timed
    (x,), _ = ZOO["mlp_residual"].example(BATCH)
    assert "TimedBackward" not in _graph_names(pipe(x).grad_fn)
    with pytest.raises(RuntimeError, match="boom"), fxpipe.record(pipe):
        assert "TimedBackward" in _graph_names(pipe(x).grad_fn)
        raise RuntimeError("boom")
    assert "TimedBackward" not in _graph_names(pipe(x).grad_fn)
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


class _Counting(NullRecorder):
    """Records nothing, but counts the runs and cells it is told about."""

    def __init__(self) -> None:
        self.runs = 0
        self.cells: list[tuple[int, int]] = []

    def begin_run(self) -> None:
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
        self.cells.append(ij)
        return super().cell(ij, device, module, args, checkpointing, grad)


def test_attach_recorder_sees_every_cell_and_refuses_a_second() -> None:
    pipe = _pipe("never")
    (x,), _ = ZOO["mlp_residual"].example(BATCH)
    counting = _Counting()
    with pipe.attach_recorder(counting):
        pipe(x)
        with pytest.raises(ConfigError, match="already being recorded"), fxpipe.record(pipe):
            pass
        with pytest.raises(ConfigError, match="already being recorded"):
            with pipe.attach_recorder(NullRecorder()):
                pass
        pipe(x)  # the refusals left the first recorder attached
    pipe(x)  # detached: not seen
    assert counting.runs == 2
    assert sorted(counting.cells) == sorted(2 * [(i, j) for i in range(CHUNKS) for j in range(K)])
    with fxpipe.record(pipe) as tl:  # free again
        pipe(x)
    assert len(tl.of("forward")) == CHUNKS * K


def test_nested_recording_and_wrong_argument_are_refused() -> None:
    pipe = _pipe("never")
    with fxpipe.record(pipe), pytest.raises(ConfigError, match="already being recorded"):
        with fxpipe.record(pipe):
            pass
    with pytest.raises(ConfigError, match="takes the Pipeline"):
        fxpipe.record(torch.nn.Linear(2, 2))  # type: ignore[arg-type]


@pytest.mark.slow
def test_no_grad_records_forward_only() -> None:
    pipe = _pipe("always")
    (x,), _ = ZOO["mlp_residual"].example(BATCH)
    with torch.no_grad(), fxpipe.record(pipe) as tl:
        pipe(x)
    assert Counter(t.phase for t in tl.tasks) == Counter(forward=K * CHUNKS)


def test_summary_and_measurements() -> None:
    tl, _ = _step(_pipe("except_last"))
    text = tl.summary()
    assert "measured bubble" in text and "predicted bubble" in text and "device idle" in text
    assert "share a device" in text  # three stages on one CPU
    for j in range(K):
        assert 0 < tl.busy(j) <= tl.makespan
    # The stages take turns in one thread, so their busy times add up to at most the run:
    # each stage idles at least (K - 1) / K of it, while the one device idles little.
    assert sum(tl.busy(j) for j in range(K)) <= tl.makespan * (1 + 1e-9)
    assert tl.bubble() >= (K - 1) / K - 1e-9
    assert tl.device_idle() < tl.bubble()
    assert f"measured bubble:  {100 * tl.bubble():.1f}%" in text
    assert tl.predicted_bubble() == pytest.approx(tl.plan.gpipe_prediction(CHUNKS)[0])


@pytest.mark.slow
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


# ------------------------------------------------ the chart's title and labels, on known tasks


def _known(devices: tuple[str, ...], tasks: list[tuple[str, int, int, float, float]]) -> Timeline:
    """A Timeline of the 3-stage pipeline whose tasks are ``(phase, i, j, start, end)``."""
    tl = fxpipe.record(_pipe("never"))
    tl.devices = devices
    tl.tasks = [TaskRecord(p, i, j, devices[j], a, b) for p, i, j, a, b in tasks]
    return tl


def test_stages_sharing_one_device_idle_most_of_the_run_and_the_title_says_so() -> None:
    """One after another on one device: each stage computes a third of the run."""
    tl = _known(("cpu",) * 3, [("forward", 0, j, j * 1.0, j + 1.0) for j in range(3)])
    assert tl.bubble() == pytest.approx(2 / 3)  # the grey share of every row
    assert tl.device_idle() == pytest.approx(0.0)  # the device never waited
    predicted = round(100 * tl.predicted_bubble())
    assert tl.headline() == (
        "stages idle 67% of the run (grey) while 3 stages take turns on 1 device (cpu), "
        f"busy 100% of it; GPipe predicts {predicted}% with one device per stage"
    )
    pytest.importorskip("matplotlib")
    from fxpipe.views.viz import timeline_figure

    title = timeline_figure(tl).axes[0].get_title()
    assert title == (
        "Pipeline timeline: 3 stages on 1 device, chunks=4, checkpoint='never'\n" + tl.headline()
    )
    custom = timeline_figure(tl, title="My run").axes[0].get_title()
    assert custom == "My run\n" + tl.headline()


def test_one_device_per_stage_has_one_idle_measure() -> None:
    """Micro-batch i at stage j runs in [i + j, i + j + 1]: each stage busy 2 of 4 units."""
    devices = ("cuda:0", "cuda:1", "cuda:2")
    tasks = [("forward", i, j, i + j * 1.0, i + j + 1.0) for i in range(2) for j in range(3)]
    tl = _known(devices, tasks)
    assert tl.bubble() == pytest.approx(0.5) == tl.device_idle()
    predicted = round(100 * tl.predicted_bubble())
    assert (
        tl.headline()
        == f"stages idle 50% of the run (grey); GPipe predicts {predicted}% for chunks=4"
    )
    assert "device idle" not in tl.summary()


def _labels(tl: Timeline) -> list[tuple[str, float, float, float]]:
    """Each micro-batch number the chart writes: text, x (ms), y (row + offset), font size."""
    pytest.importorskip("matplotlib")
    from fxpipe.views.viz import timeline_figure

    ax = timeline_figure(tl).axes[0]
    return sorted((t.get_text(), *t.get_position(), t.get_fontsize()) for t in ax.texts)


def test_every_box_is_numbered_inside_or_next_to_it() -> None:
    """A 1 s run: a wide box holds its number; 1 ms boxes get theirs above (or, where the
    label above would touch the previous one, below) the box."""
    wide = [("backward", 9, 1, 0.5, 0.6)]
    apart = [("forward", i, 0, i * 0.1, i * 0.1 + 0.001) for i in range(5)]
    crowded = [("forward", i, 2, 0.5 + i * 0.002, 0.501 + i * 0.002) for i in range(5, 8)]
    labels = _labels(_known(("cpu",) * 3, wide + apart + crowded))
    assert labels[-1] == ("9", pytest.approx(550.0), 1.0, 7.0)  # inside, centred
    above = [(x, y) for text, x, y, size in labels if size == 6 and y < 0]
    assert above == [(pytest.approx(100 * i + 0.5), pytest.approx(-0.33)) for i in range(5)]
    on_row_2 = {text: y for text, _, y, _ in labels if 1.5 < y < 2.5}
    assert on_row_2 == {"5": pytest.approx(1.67), "6": pytest.approx(2.33)}  # 7: no room
