"""``fxpipe.record``: every task a pipeline ran (device, cell, phase, start and end), a
measured bubble next to the plan's prediction, and a Gantt chart of it.

    with fxpipe.record(pipe) as tl:
        loss = criterion(pipe(x), y)
        loss.backward()
    print(tl.summary())
    tl.plot("timeline.png")

Put the backward inside the block: work that runs after the block is not recorded.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from fxpipe.errors import ConfigError
from fxpipe.pipeline import Pipeline
from fxpipe.runtime.recording import PHASES, Recorder, Span
from fxpipe.views.report import format_cost

if TYPE_CHECKING:
    from fxpipe.ir import Checkpoints, PipelinePlan

__all__ = ["record", "Timeline", "TaskRecord", "PHASES"]

#: Phases that occupy a device's compute stream (copies run on copy streams).
COMPUTE_PHASES = ("forward", "recompute", "backward")


@dataclass(frozen=True)
class TaskRecord:
    """One task of a recorded run; times in seconds since the first task started."""

    #: "forward", "recompute", "backward" or "copy".
    phase: str
    #: Micro-batch and stage (for a copy: the stage the value goes to in forward).
    i: int
    j: int
    device: str
    start: float
    end: float
    #: Which forward call of the recording the task belongs to (0, 1, ...).
    run: int = 0
    #: For a copy: the device the data left, and whether it carried gradients.
    source: str | None = None
    grad: bool = False

    @property
    def duration(self) -> float:
        """Seconds the task took."""
        return self.end - self.start


def record(pipe: Pipeline) -> Timeline:
    """Record every task ``pipe`` runs inside a ``with`` block; the block yields the Timeline.

    ``with fxpipe.record(pipe) as tl:`` times each forward, recompute, backward and copy of
    each micro-batch and stage (host clock on CPU, CUDA events on GPUs); put the backward
    inside the block too. Outside a block recording costs nothing. Afterwards
    ``tl.summary()`` prints busy time per stage and the measured bubble next to GPipe's
    prediction, ``tl.plot(path)`` draws the Gantt chart and ``tl.to_chrome_trace(path)``
    writes a trace for chrome://tracing or ui.perfetto.dev.

    Args:
        pipe: the :class:`fxpipe.Pipeline` that :func:`fxpipe.pipeline` returned.

    Raises:
        ConfigError: ``pipe`` is not a Pipeline, or it is already being recorded.
    """
    return Timeline(pipe)


class Timeline:
    """The tasks one recording saw, with the plan they ran and the measured bubble.

    ``tasks`` (TaskRecords, seconds since the first task started), ``plan``, ``devices``
    (one per stage, as text), ``chunks`` (the micro-batches the recorded runs ran, which a
    batch smaller than the pipeline's ``chunks`` makes fewer) and ``checkpoint``.
    """

    def __init__(self, pipe: Pipeline) -> None:
        if not isinstance(pipe, Pipeline):
            raise ConfigError(
                f"fxpipe.record() takes the Pipeline that fxpipe.pipeline() returned, "
                f"not a {type(pipe).__name__}"
            )
        self.plan: PipelinePlan = pipe.plan
        self.devices: tuple[str, ...] = tuple(str(d) for d in pipe.devices)
        self.chunks: int = pipe.chunks
        self.checkpoint: Checkpoints = pipe.checkpoint
        self.tasks: list[TaskRecord] = []
        self._pipe = pipe
        self._recorder: Recorder | None = None
        #: Detaches the recorder from the pipeline (empty outside a block).
        self._detach = ExitStack()

    def __enter__(self) -> Timeline:
        recorder = Recorder()
        with ExitStack() as attached:
            # Refuses a second recording of the pipeline (ConfigError).
            attached.enter_context(self._pipe.attach_recorder(recorder))
            recorder.start(self._pipe.devices)
            self._detach = attached.pop_all()
        self._recorder = recorder
        return self

    def __exit__(self, *exc: object) -> None:
        self._detach.close()
        if self._recorder is not None:
            self.tasks = _records(self._recorder.close())
            self._recorder = None
            if self.tasks:  # what the runs recorded ran as (a small batch runs fewer)
                self.chunks = max(t.i for t in self.tasks) + 1

    # ------------------------------------------------------------------ measurements

    def of(self, phase: str) -> list[TaskRecord]:
        """The tasks of one phase, by start time."""
        return [t for t in self.tasks if t.phase == phase]

    @property
    def makespan(self) -> float:
        """Seconds from the first task's start to the last task's end."""
        return max((t.end for t in self.tasks), default=0.0)

    def busy(self, j: int, phases: Iterable[str] = COMPUTE_PHASES) -> float:
        """Seconds stage ``j`` computed (overlapping tasks counted once)."""
        wanted = set(phases)
        return _union([(t.start, t.end) for t in self.tasks if t.j == j and t.phase in wanted])

    def bubble(self) -> float:
        """The measured bubble: the share of the run (first task's start to last task's end)
        each stage computed nothing, averaged over the stages; the grey share of the chart's
        rows, and what :meth:`predicted_bubble` predicts with one device per stage."""
        if not self.tasks or self.makespan <= 0:
            return 0.0
        idle = [1.0 - self.busy(j) / self.makespan for j in range(len(self.devices))]
        return sum(idle) / len(idle)

    def device_idle(self) -> float:
        """The share of the run each distinct device computed nothing, averaged over the
        devices. Equal to :meth:`bubble` with one device per stage; lower where stages
        share a device and take turns on it."""
        if not self.tasks or self.makespan <= 0:
            return 0.0
        idle = []
        for device in dict.fromkeys(self.devices):
            spans = [
                (t.start, t.end)
                for t in self.tasks
                if t.phase in COMPUTE_PHASES and self.devices[t.j] == device
            ]
            idle.append(1.0 - _union(spans) / self.makespan)
        return sum(idle) / len(idle)

    @property
    def shares_devices(self) -> bool:
        """Whether two or more stages ran on one device (taking turns on it)."""
        return len(set(self.devices)) < len(self.devices)

    def predicted_bubble(self) -> float:
        """The plan's GPipe bubble for this run's chunks (one device per stage, no transfers)."""
        return self.plan.gpipe_prediction(self.chunks)[0]

    def headline(self) -> str:
        """One line on idle time that says what it is a share of; the chart's subtitle."""
        stages = f"stages idle {100 * self.bubble():.0f}% of the run (grey)"
        predicted = f"GPipe predicts {100 * self.predicted_bubble():.0f}%"
        if not self.shares_devices:
            return f"{stages}; {predicted} for chunks={self.chunks}"
        n = len(set(self.devices))
        names = ", ".join(dict.fromkeys(self.devices))
        return (
            f"{stages} while {len(self.devices)} stages take turns on {n} device"
            f"{'s' if n > 1 else ''} ({names}), busy {100 * (1 - self.device_idle()):.0f}% "
            f"of it; {predicted} with one device per stage"
        )

    # ------------------------------------------------------------------ views

    def summary(self) -> str:
        """Per stage: measured time by phase and share, next to the plan's cost and share."""
        head = (
            "stage",
            "device",
            "forward",
            "recompute",
            "backward",
            "copy",
            "busy",
            "share",
            "plan cost",
            "plan share",
        )
        rows = [self._row(j) for j in range(len(self.devices))]
        widths = [max(len(r[c]) for r in [head, *rows]) for c in range(len(head))]
        table = [
            "  ".join(
                c.rjust(w) if k != 1 else c.ljust(w) for k, (c, w) in enumerate(zip(r, widths))
            )
            for r in [head, *rows]
        ]
        table.insert(1, "  ".join("-" * w for w in widths))
        return "\n".join([self._title(), "", *table, "", *self._notes()])

    def _title(self) -> str:
        runs = len({t.run for t in self.tasks})
        counts = ", ".join(f"{len(self.of(p))} {p}" for p in PHASES if self.of(p))
        return (
            f"Timeline: {runs} run(s), chunks={self.chunks}, checkpoint={self.checkpoint!r}; "
            f"{len(self.tasks)} tasks ({counts or 'none'}) in {self.makespan * 1e3:.1f} ms"
        )

    def _row(self, j: int) -> list[str]:
        total = sum(self.busy(k) for k in range(len(self.devices))) or 1.0
        stage = self.plan.stages[j]
        ms = [self.busy(j, [p]) * 1e3 for p in PHASES if p != "copy"]
        copy = sum(t.duration for t in self.tasks if t.j == j and t.phase == "copy") * 1e3
        return [
            str(j),
            self.devices[j],
            f"{ms[0]:.2f} ms",
            f"{ms[1]:.2f} ms",
            f"{ms[2]:.2f} ms",
            f"{copy:.2f} ms",
            f"{self.busy(j) * 1e3:.2f} ms",
            f"{100 * self.busy(j) / total:.1f}%",
            format_cost(stage.cost, self.plan.costs.unit),
            f"{100 * stage.cost / (self.plan.total_cost or 1.0):.1f}%",
        ]

    def _notes(self) -> list[str]:
        notes = [
            f"measured bubble:  {100 * self.bubble():.1f}% (share of the run each stage "
            "computed nothing, grey in the chart, averaged over stages)",
            f"predicted bubble: {100 * self.predicted_bubble():.1f}% for chunks={self.chunks} "
            "(GPipe, one device per stage; recompute and transfers not counted)",
        ]
        if self.shares_devices:
            notes.append(
                f"device idle:      {100 * self.device_idle():.1f}% (share of the run each "
                "device computed nothing, averaged over devices)"
            )
            notes.append(
                "note: several stages share a device and take turns on it, so the measured "
                "bubble counts turns waited and is not comparable with the prediction"
            )
        return notes

    def plot(self, path: str | Path, *, title: str | None = None) -> Path:
        """Write the Gantt chart (.png, .svg or .pdf; needs matplotlib); returns its path.

        One row per stage, a box per task coloured by phase with its micro-batch number, idle
        time in grey. ``title`` replaces the first line of the chart's title; the second
        line, what the idle time is a share of, is always :meth:`headline`.
        """
        from fxpipe.views.viz import CHART_FORMATS, output_path, save_figure, timeline_figure

        target, _ = output_path(path, CHART_FORMATS)
        save_figure(timeline_figure(self, title=title), target)
        return target

    def to_chrome_trace(self, path: str | Path) -> Path:
        """Write the tasks as Chrome trace JSON (chrome://tracing, ui.perfetto.dev)."""
        from fxpipe.views.viz import output_path

        target, _ = output_path(path, ("json",))
        events = [
            {
                "name": f"{t.phase} {t.i}",
                "cat": t.phase,
                "ph": "X",
                "ts": t.start * 1e6,
                "dur": t.duration * 1e6,
                "pid": t.device,
                "tid": f"stage {t.j}",
                "args": {"micro_batch": t.i, "stage": t.j, "run": t.run},
            }
            for t in self.tasks
        ]
        target.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))
        return target


def _records(spans: Sequence[Span]) -> list[TaskRecord]:
    """Spans as TaskRecords, on a clock that starts at the first span."""
    origin = min((s.start for s in spans), default=0.0)
    return [
        TaskRecord(
            phase=s.phase,
            i=s.i,
            j=s.j,
            device=str(s.device),
            start=s.start - origin,
            end=s.end - origin,
            run=s.run,
            source=None if s.source is None else str(s.source),
            grad=s.grad,
        )
        for s in spans
    ]


def _union(spans: list[tuple[float, float]]) -> float:
    """Total length covered by the intervals ``spans``."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(spans):
        if end <= reach:
            continue
        total += end - max(start, reach)
        reach = end
    return total
