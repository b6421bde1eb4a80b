"""Pictures of a plan and a run: the stage graph (Graphviz), the balance chart and the Gantt
chart (matplotlib), written to files or returned as bytes for the HTML report."""

from __future__ import annotations

import io
import shutil
import subprocess
from collections.abc import Sequence
from os import PathLike
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from fxpipe.errors import ConfigError, FxPipeError
from fxpipe.views.report import format_bytes, format_cost, plan_to_dot

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

    from fxpipe.ir import Checkpoints, PipelinePlan

__all__ = [
    "MissingDependencyError",
    "GRAPH_FORMATS",
    "CHART_FORMATS",
    "output_path",
    "draw_plan",
    "render_dot",
    "balance_figure",
    "timeline_figure",
    "save_figure",
    "figure_bytes",
    "PHASE_COLORS",
]

#: What ``plan.draw(path)`` writes, by suffix: Graphviz output formats, and DOT text.
GRAPH_FORMATS = ("svg", "png", "pdf", "dot")
#: What matplotlib charts are written as, by suffix.
CHART_FORMATS = ("png", "svg", "pdf")
#: Colour of each phase in the Gantt chart (colour-blind safe).
PHASE_COLORS = {
    "forward": "#4C72B0",
    "recompute": "#DD8452",
    "backward": "#55A868",
    "copy": "#8C8C8C",
}
_BLUE, _ORANGE, _RED = "#8fb3d9", "#e8964f", "#c0392b"


class MissingDependencyError(FxPipeError, RuntimeError):
    """An optional program or package a drawing needs is not installed."""


def output_path(path: str | PathLike[str], formats: Sequence[str]) -> tuple[Path, str]:
    """``path`` and its format (the suffix); ConfigError for another suffix or a folder
    that does not exist."""
    p = Path(path)
    fmt = p.suffix.lower().lstrip(".")
    if fmt not in formats:
        wanted = ", ".join("." + f for f in formats)
        raise ConfigError(f"cannot write {str(path)!r}: the suffix must be one of {wanted}")
    folder = p.parent if str(p.parent) else Path(".")
    if not folder.is_dir():
        raise ConfigError(
            f"cannot write {str(path)!r}: the folder {str(folder)!r} does not exist; create it"
        )
    return p, fmt


# ------------------------------------------------------------------------------ Graphviz


def render_dot(dot: str, fmt: str) -> bytes:
    """Run Graphviz ``dot`` on ``dot`` text; the ``fmt`` (svg, png, pdf) output bytes."""
    program = shutil.which("dot")
    if program is None:
        raise MissingDependencyError(
            "drawing the stage graph needs the Graphviz 'dot' program, which is not on PATH; "
            "install Graphviz (Debian/Ubuntu: apt-get install graphviz; macOS: brew install "
            "graphviz; conda: conda install graphviz), or write DOT text with plan.to_dot()"
        )
    done = subprocess.run(
        [program, f"-T{fmt}"], input=dot.encode(), capture_output=True, timeout=300, check=False
    )
    if done.returncode != 0:
        raise FxPipeError(f"Graphviz dot failed ({done.returncode}): {done.stderr.decode()[:500]}")
    return done.stdout


def draw_plan(
    plan: PipelinePlan, path: str | PathLike[str], kind: str = "graph", level: str = "stage"
) -> Path:
    """Write the stage graph (``kind="graph"``: .svg/.png/.pdf through Graphviz, or .dot text)
    or the balance chart (``kind="balance"``: .png/.svg/.pdf through matplotlib)."""
    if kind == "balance":
        target, fmt = output_path(path, CHART_FORMATS)
        save_figure(balance_figure(plan), target)
        return target
    if kind != "graph":
        raise ConfigError(f"kind={kind!r} is not 'graph' or 'balance'; pick one of them")
    target, fmt = output_path(path, GRAPH_FORMATS)
    dot = plan_to_dot(plan, level=level)
    target.write_bytes(dot.encode() if fmt == "dot" else render_dot(dot, fmt))
    return target


# ------------------------------------------------------------------------------ matplotlib


def _figure(width: float, height: float) -> Figure:
    try:
        from matplotlib.figure import Figure
    except ImportError as e:
        raise MissingDependencyError(
            "charts need matplotlib, which is not installed; pip install matplotlib "
            "(or pip install 'fxpipe[viz]')"
        ) from e
    return Figure(figsize=(width, height), dpi=100, layout="constrained")


def save_figure(fig: Figure, path: Path) -> None:
    fig.savefig(path, dpi=110)


def figure_bytes(fig: Figure, fmt: str = "png") -> bytes:
    """The figure encoded as ``fmt``."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format=fmt, dpi=110)
    return buffer.getvalue()


def _cost_scale(unit: str, largest: float) -> tuple[float, str]:
    """Divide costs by the factor for an axis labelled in the returned unit."""
    if unit == "s":
        return (1.0, "s") if largest >= 1 else (1e-3, "ms")
    steps = {"flop": ("FLOP", 1000.0), "B": ("B", 1024.0)}
    if unit not in steps:
        return 1.0, "cost"
    name, base = steps[unit]
    factor, prefixes = 1.0, ["", "k", "M", "G", "T"] if unit == "flop" else ["", "Ki", "Mi", "Gi"]
    prefix = prefixes[0]
    for p in prefixes[1:]:
        if largest / factor < base:
            break
        factor, prefix = factor * base, p
    return factor, prefix + name


def _stage_labels(plan: PipelinePlan) -> list[str]:
    labels = []
    for s in plan.stages:
        first, last = s.span
        tail = last if len(last) <= 18 else "..." + last[-15:]
        speed = f" ({plan.speeds[s.index]:g}x)" if plan.speeds else ""
        labels.append(f"stage {s.index}\n{s.device}{speed}\nto {tail}")
    return labels


def balance_figure(plan: PipelinePlan) -> Figure:
    """Two panels: stage cost against the lower bound, and memory against capacity."""
    k = plan.num_stages
    fig = _figure(max(8.0, 1.6 * k + 4.0), 4.2)
    cost_ax, mem_ax = fig.subplots(1, 2, width_ratios=[3, 2])
    _cost_panel(cost_ax, plan)
    _memory_panel(mem_ax, plan)
    fig.suptitle(
        f"Stage balance: {k} stages, chunks={plan.chunks}; bottleneck = "
        f"{plan.bottleneck / max(plan.lower_bound, 1e-30):.3f} x lower bound",
        fontsize=12,
    )
    return fig


def _cost_panel(ax: Axes, plan: PipelinePlan) -> None:
    costs = [s.cost for s in plan.stages]
    factor, unit = _cost_scale(plan.costs.unit, max(costs, default=0.0))
    xs = list(range(plan.num_stages))
    colors = [_ORANGE if c >= plan.bottleneck else _BLUE for c in costs]
    bars = ax.bar(xs, [c / factor for c in costs], color=colors, edgecolor="#333333", width=0.6)
    total = sum(costs) or 1.0
    labels = [f"{format_cost(c, plan.costs.unit)}\n{100 * c / total:.1f}%" for c in costs]
    bound = f"total / {plan.num_stages}, largest node"
    what = "estimated cost, forward + backward"
    if plan.speeds:  # each bar: the stage's time on its own device, in speed-1 units
        bound = "total / summed speed, largest node / top speed"
        what = "time on its own device (cost / its speed), forward + backward"
    ax.bar_label(bars, labels=labels, fontsize=8, label_type="center")
    ax.axhline(
        plan.lower_bound / factor,
        color=_RED,
        linestyle="--",
        linewidth=1.3,
        label=f"lower bound {format_cost(plan.lower_bound, plan.costs.unit)} (max of {bound})",
    )
    ax.legend(loc="upper left", fontsize=8, frameon=False)
    ax.set_xticks(xs, _stage_labels(plan), fontsize=8)
    ax.set_ylabel(f"{what} ({unit})")
    ax.set_ylim(0, max(max(costs, default=0.0), plan.lower_bound) / factor * 1.25 or 1.0)
    ax.set_title(
        f"Cost per stage ({plan.costs.mode} cost model); orange = bottleneck", fontsize=10
    )
    ax.grid(axis="y", alpha=0.3)


def _memory_panel(ax: Axes, plan: PipelinePlan) -> None:
    from matplotlib.ticker import LogLocator, NullFormatter

    memory = [max(s.memory_bytes, 1) for s in plan.stages]
    xs = list(range(plan.num_stages))
    bars = ax.bar(xs, memory, color="#9fc89a", edgecolor="#333333", width=0.6)
    ax.bar_label(bars, labels=[format_bytes(m) for m in memory], fontsize=8, padding=2)
    ax.set_yscale("log")
    capacity = plan.capacities
    _capacity_lines(ax, plan, capacity)
    ax.set_ylim(min(memory) / 4, max([*memory, *(c for c in capacity if c)]) * 8)
    ax.yaxis.set_major_locator(LogLocator(base=1024, subs=(1.0, 32.0)))
    ax.yaxis.set_major_formatter(_byte_formatter())
    ax.yaxis.set_minor_formatter(NullFormatter())
    ax.set_xticks(xs, [f"stage {j}" for j in xs], fontsize=8)
    ax.set_ylabel("estimated training memory (log scale)")
    ax.set_title("Memory per stage; red = device capacity", fontsize=10)
    ax.grid(axis="y", alpha=0.3, which="major")


def _capacity_lines(ax: Axes, plan: PipelinePlan, capacity: Sequence[int | None]) -> None:
    """A red line at each device's capacity over its stages, labelled once per device."""
    for device, stages in _by_device(plan).items():
        cap = capacity[stages[0]]
        if not cap:
            continue
        for j in stages:
            ax.hlines(cap, j - 0.4, j + 0.4, color=_RED, linewidth=2)
        together = format_bytes(sum(plan.stages[j].memory_bytes for j in stages))
        shared = f", shared by {len(stages)} stages ({together} together)"
        label = f"{device}: {format_bytes(cap)}" + (shared if len(stages) > 1 else "")
        ax.annotate(
            label,
            (sum(stages) / len(stages), cap),
            xytext=(0, 6),
            textcoords="offset points",
            ha="center",
            color=_RED,
            fontsize=8,
        )


def _by_device(plan: PipelinePlan) -> dict[str, list[int]]:
    groups: dict[str, list[int]] = {}
    for s in plan.stages:
        groups.setdefault(str(s.device), []).append(s.index)
    return groups


def _byte_formatter() -> Any:
    from matplotlib.ticker import FuncFormatter

    return FuncFormatter(lambda v, _pos: format_bytes(v).replace(".0 ", " "))


# ------------------------------------------------------------------------------ Gantt chart


class Timeline(Protocol):
    """What the chart reads of a recorded run (:class:`fxpipe.Timeline`, which calls it)."""

    devices: tuple[str, ...]
    chunks: int
    checkpoint: Checkpoints

    @property
    def tasks(self) -> Sequence[Any]: ...

    @property
    def makespan(self) -> float: ...

    def headline(self) -> str: ...


def timeline_figure(timeline: Timeline, title: str | None = None) -> Figure:
    """One row per stage (its device named), a box per task coloured by phase with its
    micro-batch number (inside, or above or below a box too narrow for it), idle time
    shaded, time in ms; the title's second line says what the idle share is of."""
    k = len(timeline.devices)
    fig = _figure(12.0, 1.6 + 0.75 * k)
    ax = fig.subplots()
    span_ms = max(timeline.makespan * 1e3, 1e-6)
    for j in range(k):
        ax.barh(j, span_ms, left=0, height=0.84, color="#f1f1f1", edgecolor="none", zorder=0)
    labels = _BoxLabels(ax, px_per_ms=_AXES_WIDTH_PX / span_ms)
    for t in sorted(timeline.tasks, key=lambda t: (t.j, t.start)):
        _task_box(ax, t)
        if t.phase != "copy":
            labels.place(t)
    ax.set_yticks(range(k), [f"stage {j}\n{d}" for j, d in enumerate(timeline.devices)])
    ax.set_ylim(k - 0.5, -0.5)
    ax.set_xlim(0, span_ms * 1.01)
    ax.set_xlabel("time since the first task started (ms)")
    ax.grid(axis="x", alpha=0.3)
    ax.legend(
        handles=_legend(timeline),
        loc="upper left",
        bbox_to_anchor=(1.005, 1.0),
        fontsize=8,
        frameon=False,
    )
    ax.set_title(f"{title or _timeline_title(timeline)}\n{timeline.headline()}", fontsize=10)
    return fig


def _timeline_title(timeline: Timeline) -> str:
    n = len(set(timeline.devices))
    return (
        f"Pipeline timeline: {len(timeline.devices)} stages on {n} device{'s' if n > 1 else ''}, "
        f"chunks={timeline.chunks}, checkpoint={timeline.checkpoint!r}"
    )


#: Width of the chart's axes in pixels, roughly (figure 12 in at 100 dpi, less the legend).
_AXES_WIDTH_PX = 12.0 * 100 * 0.82


def _task_box(ax: Axes, t: Any) -> None:
    left, width = t.start * 1e3, max((t.end - t.start) * 1e3, 1e-6)
    copy = t.phase == "copy"
    y, height = (t.j + 0.3, 0.2) if copy else (t.j, 0.62)
    ax.barh(
        y,
        width,
        left=left,
        height=height,
        color=PHASE_COLORS.get(t.phase, "#777777"),
        edgecolor="white",
        linewidth=0.4,
        zorder=2,
        hatch="///" if copy else None,
    )


class _BoxLabels:
    """Writes each box's micro-batch number: inside when it fits, else in a smaller font just
    above or below the box, in a lane of its row that no earlier label covers there."""

    #: Pixels a digit takes at the inside (7 pt) and outside (6 pt) font sizes, and a margin.
    INSIDE_DIGIT, OUTSIDE_DIGIT, MARGIN = 6.0, 5.0, 3.0

    def __init__(self, ax: Axes, px_per_ms: float) -> None:
        self.ax = ax
        self.px_per_ms = px_per_ms
        #: (row, lane) -> right edge, in ms, of the last label written there.
        self.reach: dict[tuple[int, int], float] = {}

    def place(self, t: Any) -> None:
        left, width = t.start * 1e3, (t.end - t.start) * 1e3
        text, centre = str(t.i), left + width / 2
        if width * self.px_per_ms >= self.INSIDE_DIGIT * len(text) + self.MARGIN:
            self._write(centre, t.j, text, fontsize=7, color="white", va="center")
            return
        half = (self.OUTSIDE_DIGIT * len(text) + self.MARGIN) / 2 / self.px_per_ms
        for lane, offset, va in ((0, -0.33, "bottom"), (1, 0.33, "top")):
            if self.reach.get((t.j, lane), float("-inf")) <= centre - half:
                self.reach[(t.j, lane)] = centre + half
                color = PHASE_COLORS.get(t.phase, "#333333")
                self._write(centre, t.j + offset, text, fontsize=6, color=color, va=va)
                return

    def _write(self, x: float, y: float, text: str, **style: Any) -> None:
        self.ax.text(x, y, text, ha="center", zorder=3, clip_on=True, **style)


def _legend(timeline: Timeline) -> list[Any]:
    from matplotlib.patches import Patch

    phases = [p for p in PHASE_COLORS if any(t.phase == p for t in timeline.tasks)]
    handles = [Patch(color=PHASE_COLORS[p], label=p) for p in phases]
    handles.append(Patch(color="#f1f1f1", label="idle (bubble)"))
    handles.append(Patch(color="white", label="number = micro-batch"))
    handles.append(Patch(color="white", label="(above or below a narrow box)"))
    return handles
