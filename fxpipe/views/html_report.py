"""One self-contained HTML file about a plan (and optionally a recorded run): summary table,
stage graph, balance chart, boundary values and timeline, with every image inline."""

from __future__ import annotations

import base64
import html
import re
from pathlib import Path
from typing import TYPE_CHECKING

from fxpipe.errors import FxPipeError
from fxpipe.views.report import boundary_in, boundary_out, format_bytes, format_cost

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from fxpipe.ir import PipelinePlan, StagePlan
    from fxpipe.views.timeline import Timeline

__all__ = ["write_report", "render_report"]

_STYLE = """
body { font-family: -apple-system, "Segoe UI", Helvetica, Arial, sans-serif; margin: 2em auto;
       max-width: 1250px; color: #222; padding: 0 1em; }
h1 { font-size: 1.5em; margin-bottom: 0.2em; } h2 { font-size: 1.15em; margin-top: 1.8em;
     border-bottom: 1px solid #ddd; padding-bottom: 0.2em; }
.sub { color: #666; margin-top: 0; }
pre { background: #f6f8fa; padding: 0.8em; overflow-x: auto; font-size: 12px; line-height: 1.35; }
table { border-collapse: collapse; font-size: 13px; }
th, td { padding: 3px 10px; border-bottom: 1px solid #e4e4e4; text-align: right; }
th { background: #f0f3f7; } td.l, th.l { text-align: left; }
tr.hot td { background: #fdf0e6; }
.figure { overflow-x: auto; } .figure svg, .figure img { max-width: 100%; height: auto; }
.note { color: #8a5a00; background: #fff8e6; padding: 0.5em 0.8em;
        border-left: 3px solid #e0b44c; }
"""


def write_report(
    plan: PipelinePlan,
    path: str | Path,
    *,
    timeline: Timeline | None = None,
    title: str = "fxpipe plan",
) -> Path:
    """Write the report to ``path`` (its folder must exist); returns the path."""
    from fxpipe.views.viz import output_path

    target, _ = output_path(path, ("html", "htm"))
    target.write_text(render_report(plan, timeline=timeline, title=title), encoding="utf-8")
    return target


def render_report(
    plan: PipelinePlan, *, timeline: Timeline | None = None, title: str = "fxpipe plan"
) -> str:
    """The report as HTML text."""
    parts = [
        f"<h1>{html.escape(title)}</h1>",
        f'<p class="sub">{plan.num_stages} stages on {html.escape(_devices(plan))}, '
        f"chunks={plan.chunks}, cost model: {html.escape(plan.costs.mode)}</p>",
        _section("summary", "Summary", f"<pre>{html.escape(plan.summary())}</pre>"),
        _section("stages", "Stages", _stage_table(plan)),
        _section("graph", "Stage graph", _graph(plan)),
        _section("balance", "Balance", _balance(plan)),
        _section("edges", "Boundary values", _edge_table(plan)),
    ]
    if timeline is not None:
        parts.append(_section("timeline", "Timeline of one training step", _timeline(timeline)))
    body = "\n".join(parts)
    return (
        '<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        f"<title>{html.escape(title)}</title>\n<style>{_STYLE}</style>\n</head>\n"
        f"<body>\n{body}\n</body>\n</html>\n"
    )


def _devices(plan: PipelinePlan) -> str:
    names = [str(d) for d in plan.devices]
    return ", ".join(names) if len(set(names)) > 1 else f"{names[0]} x {len(names)}"


def _section(ident: str, heading: str, content: str) -> str:
    return f'<section id="{ident}">\n<h2>{html.escape(heading)}</h2>\n{content}\n</section>'


def _note(text: str) -> str:
    return f'<p class="note">{html.escape(text)}</p>'


_STAGE_HEAD = (
    "stage",
    "device",
    "nodes",
    "first module",
    "last module",
    "params",
    "cost",
    "share",
    "memory",
    "in",
    "out",
)
_STAGE_LEFT = {1, 3, 4}


def _stage_cells(plan: PipelinePlan, s: StagePlan) -> list[str]:
    first, last = s.span
    return [
        str(s.index),
        str(s.device),
        str(len(s.nodes)),
        first,
        last,
        format_bytes(s.param_bytes),
        format_cost(s.cost, plan.costs.unit),
        f"{100 * s.cost / (plan.total_cost or 1.0):.1f}%",
        format_bytes(s.memory_bytes),
        format_bytes(boundary_in(plan, s.index)),
        format_bytes(boundary_out(plan, s.index)),
    ]


def _stage_table(plan: PipelinePlan) -> str:
    rows = []
    for s in plan.stages:
        cells = "".join(_td(c, k in _STAGE_LEFT) for k, c in enumerate(_stage_cells(plan, s)))
        hot = ' class="hot"' if s.cost >= plan.bottleneck and plan.num_stages > 1 else ""
        rows.append(f"<tr{hot}>{cells}</tr>")
    th = "".join(
        f"<th{' class=l' if k in _STAGE_LEFT else ''}>{h}</th>" for k, h in enumerate(_STAGE_HEAD)
    )
    return f"<table><thead><tr>{th}</tr></thead><tbody>\n" + "\n".join(rows) + "</tbody></table>"


def _td(text: str, left: bool) -> str:
    return f"<td{' class=l' if left else ''}>{html.escape(text)}</td>"


def _edge_table(plan: PipelinePlan) -> str:
    if not plan.edges:
        return "<p>No value crosses a stage border (one stage).</p>"
    rows = [
        "<tr>"
        + _td(e.value, True)
        + _td(str(e.producer), False)
        + _td(", ".join(map(str, e.consumers)), True)
        + _td(f"{e.bytes:,}", False)
        + _td(format_bytes(e.bytes), False)
        + "</tr>"
        for e in plan.edges
    ]
    head = (
        "<tr><th class=l>value</th><th>from stage</th><th class=l>to stages</th>"
        "<th>bytes per batch</th><th></th></tr>"
    )
    return f"<table><thead>{head}</thead><tbody>\n" + "\n".join(rows) + "</tbody></table>"


def _graph(plan: PipelinePlan) -> str:
    from fxpipe.views.viz import MissingDependencyError, render_dot

    dot = plan.to_dot()
    try:
        svg = render_dot(dot, "svg").decode("utf-8")
    except MissingDependencyError:
        return (
            _note(
                "Graphviz 'dot' is not installed, so the stage graph is not drawn here "
                "(Debian/Ubuntu: apt-get install graphviz). Its DOT text:"
            )
            + f"<details><summary>DOT</summary><pre>{html.escape(dot)}</pre></details>"
        )
    svg = svg[svg.find("<svg") :]
    svg = re.sub(r"<!--.*?-->", "", svg, flags=re.DOTALL)
    return f'<div class="figure">{svg}</div>'


def _png(fig: Figure, alt: str) -> str:
    from fxpipe.views.viz import figure_bytes

    data = base64.b64encode(figure_bytes(fig, "png")).decode("ascii")
    img = f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{data}">'
    return f'<div class="figure">{img}</div>'


def _balance(plan: PipelinePlan) -> str:
    from fxpipe.views.viz import balance_figure

    try:
        return _png(balance_figure(plan), "stage cost and memory per stage")
    except FxPipeError as e:
        return _note(str(e))


def _timeline(timeline: Timeline) -> str:
    from fxpipe.views.viz import timeline_figure

    text = f"<pre>{html.escape(timeline.summary())}</pre>"
    try:
        return _png(timeline_figure(timeline), "Gantt chart of the recorded step") + text
    except FxPipeError as e:
        return _note(str(e)) + text
