"""Text views of a plan: the per-stage summary table and Graphviz DOT of stages or nodes."""

from __future__ import annotations

from collections.abc import Sequence
from operator import attrgetter
from typing import TYPE_CHECKING

import torch

from fxpipe.errors import ConfigError
from fxpipe.passes.ops import module_path
from fxpipe.passes.partition.cost_graph import batched_nodes, replicated_attrs
from fxpipe.views.configurations import configuration_notes

if TYPE_CHECKING:
    import torch.fx as fx

    from fxpipe.ir import PipelinePlan, StagePlan

__all__ = [
    "plan_summary",
    "plan_to_dot",
    "format_bytes",
    "format_cost",
    "boundary_in",
    "boundary_out",
    "dot_quote",
]

#: Widest a module path may be in the summary; longer ones lose their middle.
PATH_WIDTH = 32


def format_bytes(n: float) -> str:
    """``1536`` -> ``'1.5 KiB'``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover


def format_cost(value: float, unit: str) -> str:
    """A cost in its unit: seconds as ms, FLOP with an SI prefix, bytes in KiB/MiB."""
    if unit == "s":
        if abs(value) >= 1:
            return f"{value:.3g} s"
        if abs(value) >= 1e-3 or value == 0:
            return f"{value * 1e3:.3g} ms"
        return f"{value * 1e6:.3g} us"
    if unit == "flop":
        for scale, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
            if abs(value) >= scale:
                return f"{value / scale:.3g} {prefix}FLOP"
        return f"{value:.3g} FLOP"
    if unit == "B":
        return format_bytes(value)
    return f"{value:.3g}"


def _percent(part: float, whole: float) -> str:
    if whole <= 0:
        return "?"
    share = 100 * part / whole
    return "<0.1%" if 0 < share < 0.1 else f"{share:.1f}%"


def _shorten(text: str, width: int = PATH_WIDTH) -> str:
    """Cut the middle out of ``text`` so it fits ``width``; both ends say the most."""
    if len(text) <= width:
        return text
    head = (width - 3) // 2
    return text[:head] + "..." + text[len(text) - (width - 3 - head) :]


def boundary_in(plan: PipelinePlan, j: int) -> int:
    """Bytes of the boundary values stage ``j`` receives, per example batch."""
    return sum(e.bytes for e in plan.edges if j in e.consumers)


def boundary_out(plan: PipelinePlan, j: int) -> int:
    """Bytes stage ``j`` sends, per example batch (a value sent to two stages counts twice)."""
    return sum(e.bytes * len(e.consumers) for e in plan.edges if e.producer == j)


# ------------------------------------------------------------------------------ summary

_HEAD = (
    "stage",
    "device",
    "nodes",
    "first module",
    "last module",
    "params",
    "cost",
    "share",
    "memory",
    "of device",
    "in",
    "out",
)
_LEFT = {"device", "first module", "last module"}


def _stage_row(plan: PipelinePlan, s: StagePlan, capacity: int | None) -> list[str]:
    first, last = s.span
    return [
        str(s.index),
        str(s.device),
        str(len(s.nodes)),
        _shorten(first),
        _shorten(last),
        format_bytes(s.param_bytes),
        format_cost(s.cost, plan.costs.unit),
        _percent(s.cost, plan.total_cost),
        format_bytes(s.memory_bytes),
        _percent(s.memory_bytes, capacity) if capacity else "?",
        format_bytes(boundary_in(plan, s.index)),
        format_bytes(boundary_out(plan, s.index)),
    ]


def _total_row(plan: PipelinePlan) -> list[str]:
    sent = sum(e.bytes * len(e.consumers) for e in plan.edges)
    return [
        "total",
        "",
        str(sum(len(s.nodes) for s in plan.stages)),
        "",
        "",
        format_bytes(sum(s.param_bytes for s in plan.stages)),
        format_cost(plan.total_cost, plan.costs.unit),
        "100%",
        format_bytes(sum(s.memory_bytes for s in plan.stages)),
        "",
        format_bytes(sent),
        format_bytes(sent),
    ]


def _table(rows: Sequence[Sequence[str]], head: Sequence[str]) -> list[str]:
    """Aligned text: text columns to the left, numbers to the right, a rule under the head."""
    widths = [max(len(r[c]) for r in [head, *rows]) for c in range(len(head))]

    def line(cells: Sequence[str]) -> str:
        parts = [
            cell.ljust(w) if name in _LEFT else cell.rjust(w)
            for cell, w, name in zip(cells, widths, head)
        ]
        return "  ".join(parts).rstrip()

    rule = "  ".join("-" * w for w in widths)
    body = [line(r) for r in rows]
    return [line(head), rule, *body[:-1], rule, body[-1]]


def plan_summary(plan: PipelinePlan) -> str:
    """One row per stage, a total row, then balance, traffic, prediction and memory notes."""
    capacity = plan.capacities
    rows = [_stage_row(plan, s, capacity[s.index]) for s in plan.stages]
    rows.append(_total_row(plan))
    head: Sequence[str] = _HEAD
    if plan.speeds:  # a column after the device: the cost is the time at that speed
        head = [*_HEAD[:2], "speed", *_HEAD[2:]]
        speeds = [f"{v:g}x" for v in plan.speeds]
        rows = [[*r[:2], speed, *r[2:]] for r, speed in zip(rows, [*speeds, ""])]
    return "\n".join([_title(plan), "", *_table(rows, head), "", *_footer(plan, capacity)])


def _title(plan: PipelinePlan) -> str:
    costs = plan.costs
    what = {
        "time": "profiled forward + backward time",
        "flops": "forward + backward FLOP",
        "params": "parameter bytes",
    }.get(costs.mode, "a user cost function")
    batch, how = f"{costs.batch_size} samples", ""
    if costs.mode == "roofline":  # the default: seconds a reference device would take
        from fxpipe.passes.price.roofline import roofline_for

        what, batch = "forward + backward time", f"{batch} in {plan.chunks} micro-batches"
        how = f" on {roofline_for(plan.devices[0].type).reference}, estimated by a roofline"
    return (
        f"PipelinePlan: {plan.num_stages} stages, {len(plan.stage_of)} nodes; "
        f"cost = {what} of the example batch ({batch}){how}"
    )


def _footer(plan: PipelinePlan, capacity: Sequence[int | None]) -> list[str]:
    unit, k = plan.costs.unit, plan.num_stages
    worst = max(plan.stages, key=lambda s: s.cost)
    ratio = plan.bottleneck / max(plan.lower_bound, 1e-30)
    bubble, speedup = plan.gpipe_prediction(plan.chunks)
    batched = batched_nodes(plan.graph_module)  # the rest (a weight) goes whole, once
    cut = sum(e.bytes * len(e.consumers) for e in plan.edges if e.value in batched)
    whole = sum(e.bytes * len(e.consumers) for e in plan.edges if e.value not in batched)
    per_micro = cut / max(plan.chunks, 1)
    sent = cut + whole
    once = f", {format_bytes(whole)} of it once per batch (whole values)" if whole else ""
    search = plan.info.get("method", "?")
    seconds = plan.info.get("seconds")
    took = f" in {float(seconds):.2f} s" if isinstance(seconds, (int, float)) else ""
    bound = f"max of total/{k}, largest node"
    speeds = []
    if plan.speeds:
        bound = "max of total/summed speed, largest node/top speed"
        speeds = [
            "speeds:      a stage's cost is its nodes' cost over its device's speed: its time "
            "there, in units of the speed-1 device"
        ]
    return [
        f"bottleneck:  stage {worst.index}, {format_cost(plan.bottleneck, unit)} = {ratio:.3f} x "
        f"the lower bound {format_cost(plan.lower_bound, unit)} ({bound})",
        *speeds,
        f"pipeline:    chunks={plan.chunks}: predicted bubble {100 * bubble:.1f}%, "
        f"speedup {speedup:.2f}x over one device (GPipe, transfers not counted)",
        *configuration_notes(plan),
        f"boundaries:  {len(plan.edges)} values, {format_bytes(sent)} per batch "
        f"({format_bytes(per_micro)} per micro-batch{once}); in and out are per batch",
        *_replicated_note(plan),
        *_memory_notes(plan, capacity),
        f"search:      {search}{took}",
    ]


def _replicated_note(plan: PipelinePlan) -> list[str]:
    """Weights each reading stage holds itself (one process per stage): none crosses a
    border; their gradients are summed once per step."""
    nodes = {n.name: n for n in plan.graph_module.graph.nodes}
    held = []
    for name in sorted(replicated_attrs(plan.graph_module)):
        node = nodes[name]
        if not isinstance(attrgetter(str(node.target))(plan.graph_module), torch.Tensor):
            continue
        stages = sorted({plan.stage_of[u.name] for u in node.users if u.op != "output"})
        if len(stages) > 1:
            held.append(f"{node.target} (stages {', '.join(map(str, stages))})")
    if not held:
        return []
    return [
        f"replicated:  {'; '.join(held)}: held by each stage that reads it, never sent; "
        "its gradients are summed once per step (sync_tied_gradients)"
    ]


def _memory_notes(plan: PipelinePlan, capacity: Sequence[int | None]) -> list[str]:
    what = (
        "training estimate: weights, gradients, Adam state, activations in flight"
        if plan.training
        else "inference estimate (planned in eval mode): weights, one micro-batch in flight"
    )
    notes = [f"memory:      {what}"]
    groups: dict[str, list[int]] = {}
    for s in plan.stages:
        groups.setdefault(str(s.device), []).append(s.index)
    for device, stages in groups.items():
        cap = capacity[stages[0]]
        need = sum(plan.stages[j].memory_bytes for j in stages)
        who = f"stage {stages[0]}" if len(stages) == 1 else f"stages {_ranges(stages)} share it"
        have = format_bytes(cap) if cap else "unknown"
        use = f", {format_bytes(need)} = {_percent(need, cap)}" if cap else ""
        notes.append(f"             {device}: {have} ({who}{use})")
    return notes


def _ranges(indices: Sequence[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``'0-2, 5'``."""
    parts: list[str] = []
    start = prev = indices[0]
    for j in [*indices[1:], None]:
        if j is not None and j == prev + 1:
            prev = j
            continue
        parts.append(str(start) if start == prev else f"{start}-{prev}")
        if j is not None:
            start = prev = j
    return ", ".join(parts)


# ------------------------------------------------------------------------------ DOT


def dot_quote(text: str) -> str:
    """``text`` as a double-quoted DOT string; line breaks become centred DOT line breaks."""
    escaped = text.replace("\\", "\\\\").replace('"', '\\"')
    return '"' + escaped.replace("\r", "").replace("\n", "\\n") + '"'


def plan_to_dot(plan: PipelinePlan, level: str = "stage") -> str:
    """Graphviz text: a node per stage and an edge per boundary value labelled with its
    bytes (``level="stage"``), or every fx node clustered by stage (``level="node"``)."""
    if level == "stage":
        return _stage_dot(plan)
    if level == "node":
        return _node_dot(plan)
    raise ConfigError(f"level={level!r} is not 'stage' or 'node'; pick one of them")


_GRAPH_STYLE = [
    '  graph [fontname="Helvetica", fontsize=11, nodesep=0.35, ranksep=0.6];',
    '  node [shape=box, style="rounded,filled", fontname="Helvetica", fontsize=11];',
    '  edge [fontname="Helvetica", fontsize=9, color="#555555"];',
]


def _stage_label(plan: PipelinePlan, s: StagePlan) -> str:
    first, last = (_shorten(p, 40) for p in s.span)
    span = first if first == last else f"{first}\n.. {last}"
    return (
        f"stage {s.index} ({s.device})\n{span}\n"
        f"{len(s.nodes)} nodes, cost {format_cost(s.cost, plan.costs.unit)} "
        f"({_percent(s.cost, plan.total_cost)})\n"
        f"params {format_bytes(s.param_bytes)}, memory {format_bytes(s.memory_bytes)}"
    )


def _stage_dot(plan: PipelinePlan) -> str:
    lines = ["digraph plan {", "  rankdir=TB;", *_GRAPH_STYLE]
    lines.append('  input [shape=ellipse, style=filled, fillcolor="#eeeeee", label="input"];')
    for s in plan.stages:
        hot = s.cost >= plan.bottleneck and plan.num_stages > 1
        fill = "#f6c9a8" if hot else "#d8e6f3"
        lines.append(
            f'  s{s.index} [label={dot_quote(_stage_label(plan, s))}, fillcolor="{fill}"];'
        )
    lines.append('  output [shape=ellipse, style=filled, fillcolor="#eeeeee", label="output"];')
    lines.append("  input -> s0;")
    for e in plan.edges:
        for c in e.consumers:
            skip = c - e.producer > 1
            style = ', style=dashed, color="#b5533c"' if skip else ""
            label = dot_quote(f"{e.value}\n{format_bytes(e.bytes)}")
            tip = dot_quote(f"{e.value}: {e.bytes:,} bytes, stage {e.producer} -> {c}")
            lines.append(f"  s{e.producer} -> s{c} [label={label}, tooltip={tip}{style}];")
    for j in _output_stages(plan):
        lines.append(f"  s{j} -> output;")
    lines.append("}")
    return "\n".join(lines) + "\n"


def _output_stages(plan: PipelinePlan) -> list[int]:
    """Stages that produce a value of the model's output."""
    out = [n for n in plan.graph_module.graph.nodes if n.op == "output"]
    stages = {plan.stage_of[a.name] for node in out for a in node.all_input_nodes}
    return sorted(stages) or [plan.num_stages - 1]


def _node_kind(plan: PipelinePlan, node: fx.Node) -> str:
    """What a node does, in a few words: module type, function (and its module), or role."""
    if node.op == "call_module":
        return type(plan.graph_module.get_submodule(str(node.target))).__name__
    if node.op in ("call_function", "call_method"):
        fn = str(getattr(node.target, "__name__", node.target))
        path = module_path(node)
        return f"{fn} in {path}" if path else ("" if fn == node.name else fn)
    return {"get_attr": "attribute", "placeholder": "input"}.get(node.op, node.op)


def _node_dot(plan: PipelinePlan) -> str:
    lines = ["digraph nodes {", *_GRAPH_STYLE]
    nodes = {n.name: n for n in plan.graph_module.graph.nodes}
    for s in plan.stages:
        lines.append(f"  subgraph cluster_{s.index} {{")
        title = f"stage {s.index} ({s.device}), {format_cost(s.cost, plan.costs.unit)}"
        lines.append(f'    label={dot_quote(title)}; style=rounded; color="#7a9cc6";')
        for name in s.nodes:
            label = f"{name}\n{_node_kind(plan, nodes[name])}".rstrip()
            lines.append(f'    {dot_quote(name)} [label={dot_quote(label)}, fillcolor="#eef3f9"];')
        lines.append("  }")
    sizes = {e.value: e.bytes for e in plan.edges}
    for node in plan.graph_module.graph.nodes:
        for user in node.users:
            edge = f"  {dot_quote(node.name)} -> {dot_quote(user.name)}"
            crosses = plan.stage_of[node.name] != plan.stage_of[user.name]
            if crosses and node.name in sizes:
                label = dot_quote(format_bytes(sizes[node.name]))
                edge += f' [label={label}, color="#b5533c", penwidth=1.6]'
            lines.append(edge + ";")
    lines.append("}")
    return "\n".join(lines) + "\n"
