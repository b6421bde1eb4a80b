"""Text views of a plan: the per-stage summary table and Graphviz DOT of stages or nodes."""

from __future__ import annotations

from typing import TYPE_CHECKING

from fxpipe.devices import device_capacity
from fxpipe.errors import ConfigError

if TYPE_CHECKING:
    import torch.fx as fx

    from fxpipe.ir import PipelinePlan

__all__ = ["plan_summary", "plan_to_dot", "module_path", "format_bytes", "gpipe_prediction"]


def format_bytes(n: float) -> str:
    """``1536`` -> ``'1.5 KiB'``."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def module_path(node: fx.Node) -> str:
    """The module a node belongs to: its target for module calls, else its innermost
    entry of ``nn_module_stack``, else the node name."""
    if node.op in ("call_module", "get_attr"):
        return str(node.target)
    stack = node.meta.get("nn_module_stack")
    if stack:
        path = list(stack.values())[-1][0]
        return str(path) or node.name
    return node.name


def gpipe_prediction(plan: PipelinePlan, chunks: int) -> tuple[float, float]:
    """(bubble fraction, predicted speedup over one device) for ``chunks`` micro-batches,
    from the GPipe makespan sum(c_j)/M + (M - 1) max(c_j)/M, no communication term."""
    m = max(chunks, 1)
    costs = [s.cost for s in plan.stages]
    total = sum(costs)
    if total <= 0:
        return 0.0, 1.0
    makespan = total / m + (m - 1) * max(costs) / m
    busy = total / len(costs)
    bubble = 1.0 - busy / makespan
    return bubble, total / makespan


def plan_summary(plan: PipelinePlan) -> str:
    """One row per stage, totals and the GPipe prediction below."""
    nodes = {n.name: n for n in plan.graph_module.graph.nodes}
    capacity = device_capacity(plan.devices)
    total = plan.total_cost or 1.0
    unit = plan.costs.unit
    head = (
        f"{'stage':>5} {'device':<8} {'nodes':>5}  {'modules (first .. last)':<34} "
        f"{'params':>9} {'cost':>10} {'share':>6} {'memory / capacity':>21} "
        f"{'in':>9} {'out':>9}"
    )
    rows = [head, "-" * len(head)]
    for s in plan.stages:
        work = [nodes[n] for n in s.nodes if nodes[n].op not in ("placeholder", "output")]
        span = f"{module_path(work[0])} .. {module_path(work[-1])}" if work else "-"
        span = span if len(span) <= 34 else span[:31] + "..."
        cap = capacity[s.index]
        mem = format_bytes(s.memory_bytes) + (f" / {format_bytes(cap)}" if cap else "")
        rows.append(
            f"{s.index:>5} {str(s.device):<8} {len(s.nodes):>5}  {span:<34} "
            f"{format_bytes(s.param_bytes):>9} {_cost(s.cost, unit):>10} "
            f"{100 * s.cost / total:>5.1f}% {mem:>21} "
            f"{format_bytes(_edge_bytes(plan, s.inputs)):>9} "
            f"{format_bytes(_edge_bytes(plan, s.outputs)):>9}"
        )
    bubble, speedup = gpipe_prediction(plan, plan.chunks)
    rows += [
        "-" * len(head),
        f"cost model: {plan.costs.mode} ({unit}); search: {plan.info.get('method', '?')}",
        f"bottleneck {_cost(plan.bottleneck, unit)} / lower bound "
        f"{_cost(plan.lower_bound, unit)} = {plan.bottleneck / max(plan.lower_bound, 1e-30):.3f}",
        f"boundary values: {len(plan.edges)}, "
        f"{format_bytes(sum(e.bytes * len(e.consumers) for e in plan.edges))} per batch",
        f"with chunks={plan.chunks}: predicted bubble {100 * bubble:.1f}%, "
        f"speedup over one device {speedup:.2f}x",
    ]
    return "\n".join(rows)


def _edge_bytes(plan: PipelinePlan, names: tuple[str, ...]) -> int:
    sizes = {e.value: e.bytes for e in plan.edges}
    return sum(sizes.get(n, 0) for n in names)


def _cost(value: float, unit: str) -> str:
    if unit == "s":
        return f"{value * 1e3:.3g} ms"
    if unit == "flop":
        return f"{value / 1e6:.3g} MF"
    if unit == "B":
        return format_bytes(value)
    return f"{value:.3g}"


def plan_to_dot(plan: PipelinePlan, level: str = "stage") -> str:
    """Graphviz text: a node per stage and an edge per boundary value labelled with its
    bytes (``level="stage"``), or every fx node clustered by stage (``level="node"``)."""
    if level == "stage":
        return _stage_dot(plan)
    if level == "node":
        return _node_dot(plan)
    raise ConfigError(f"level={level!r} is not 'stage' or 'node'; pick one of them")


def _stage_dot(plan: PipelinePlan) -> str:
    total = plan.total_cost or 1.0
    lines = ["digraph plan {", "  rankdir=LR;", '  node [shape=box, fontname="Helvetica"];']
    for s in plan.stages:
        label = (
            f"stage {s.index}\\n{s.device}\\n{len(s.nodes)} nodes, "
            f"{100 * s.cost / total:.0f}% cost\\nparams {format_bytes(s.param_bytes)}"
        )
        lines.append(f'  s{s.index} [label="{label}"];')
    for e in plan.edges:
        for c in e.consumers:
            style = ", style=dashed" if c - e.producer > 1 else ""
            label = f"{e.value}\\n{format_bytes(e.bytes)}"
            lines.append(f'  s{e.producer} -> s{c} [label="{label}"{style}];')
    lines.append("}")
    return "\n".join(lines)


def _node_dot(plan: PipelinePlan) -> str:
    lines = ["digraph nodes {", '  node [shape=box, fontsize=10, fontname="Helvetica"];']
    graph = plan.graph_module.graph
    for s in plan.stages:
        lines.append(f"  subgraph cluster_{s.index} {{")
        lines.append(f'    label="stage {s.index} ({s.device})";')
        for name in s.nodes:
            lines.append(f'    "{name}";')
        lines.append("  }")
    for node in graph.nodes:
        for user in node.users:
            lines.append(f'  "{node.name}" -> "{user.name}";')
    lines.append("}")
    return "\n".join(lines)
