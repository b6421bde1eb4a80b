"""Plan views: the summary table and DOT for every zoo model, parsed back; rendering."""

from __future__ import annotations

import re
import shutil
from collections import Counter
from typing import Any

import pytest
import torch
from models import ZOO
from torch import nn

import fxpipe
from fxpipe.errors import ConfigError, FxPipeError
from fxpipe.ir import PipelinePlan
from fxpipe.views import viz
from fxpipe.views.report import (
    PATH_WIDTH,
    boundary_in,
    boundary_out,
    dot_quote,
    format_bytes,
    format_cost,
)

HAS_DOT = shutil.which("dot") is not None
try:
    import matplotlib  # noqa: F401

    HAS_MPL = True
except ImportError:  # pragma: no cover - depends on the environment
    HAS_MPL = False

_PLANS: dict[str, PipelinePlan] = {}


def _plan(name: str) -> PipelinePlan:
    """A flops-priced plan of a zoo model over up to 4 CPU stages (built once per session)."""
    if name not in _PLANS:
        case = ZOO[name]
        args, kwargs = case.example(case.batch)
        example = args[0] if len(args) == 1 else args
        k = min(4, case.max_stages)
        _PLANS[name] = fxpipe.plan(
            case.build(),
            example,
            ["cpu"] * k,
            example_kwargs=kwargs,
            cost="flops",
            tracer=case.tracer,
        )
    return _PLANS[name]


# ------------------------------------------------------------------------- DOT parsing

_STRING = r'"((?:[^"\\]|\\.)*)"'
_ATTRS = r"\[(.*)\]"


def _unquote(text: str) -> str:
    return re.sub(r"\\(.)", lambda m: "\n" if m.group(1) == "n" else m.group(1), text)


def _attrs(text: str) -> dict[str, str]:
    pairs = re.findall(r"(\w+)=(?:" + _STRING + r"|([\w.#]+))", text)
    return {k: _unquote(quoted) if quoted or not bare else bare for k, quoted, bare in pairs}


def _parse_dot(
    dot: str,
) -> tuple[dict[str, dict[str, str]], list[tuple[str, str, dict[str, str]]]]:
    """Nodes (name -> attributes) and edges (tail, head, attributes) of our DOT output."""
    assert dot.count("{") == dot.count("}")
    nodes: dict[str, dict[str, str]] = {}
    edges = []
    name = r'(\w+|"(?:[^"\\]|\\.)*")'
    for line in dot.splitlines():
        line = line.strip()
        edge = re.fullmatch(name + r" -> " + name + r"(?: " + _ATTRS + r")?;", line)
        if edge:
            tail, head = (_unquote(x.strip('"')) for x in edge.group(1, 2))
            edges.append((tail, head, _attrs(edge.group(3) or "")))
            continue
        node = re.fullmatch(name + r"(?: " + _ATTRS + r")?;", line)
        if node and node.group(1) not in ("graph", "node", "edge"):
            nodes[_unquote(node.group(1).strip('"'))] = _attrs(node.group(2) or "")
    return nodes, edges


# ------------------------------------------------------------------------- summary


@pytest.mark.parametrize("name", list(ZOO))
def test_summary_of_every_zoo_model(name: str) -> None:
    plan = _plan(name)
    text = plan.summary()
    lines = text.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("stage  device"))
    rows = lines[head + 2 : head + 2 + plan.num_stages]
    for s, row in zip(plan.stages, rows):
        cells = row.split()
        assert cells[0] == str(s.index) and cells[1] == str(s.device)
        assert cells[2] == str(len(s.nodes))
        first, last = s.span
        assert first[:10] in row and last[-10:] in row
        assert format_cost(s.cost, plan.costs.unit) in row
        assert row.endswith(format_bytes(boundary_out(plan, s.index)))
        assert format_bytes(boundary_in(plan, s.index)) in row
    assert lines[head + 3 + plan.num_stages].startswith("total")
    ends = {len(line) for line in lines[head : head + 2 + plan.num_stages]}
    assert len(ends) == 1, "the rows of the table are not aligned"
    for word in ("bottleneck:", "lower bound", "predicted bubble", "speedup", "per micro-batch"):
        assert word in text
    assert str(plan) == text


def test_boundary_bytes_in_and_out_balance() -> None:
    plan = _plan("unet")
    sent = sum(boundary_out(plan, j) for j in range(plan.num_stages))
    received = sum(boundary_in(plan, j) for j in range(plan.num_stages))
    assert sent == received == sum(e.bytes * len(e.consumers) for e in plan.edges) > 0


class _Deep(nn.Module):
    """Module paths far longer than the summary's column."""

    def __init__(self) -> None:
        super().__init__()
        inner: nn.Module = nn.Linear(8, 8)
        for k in range(6):
            inner = nn.Sequential(nn.ModuleDict({f"very_long_module_name_{k}": inner}))
        self.encoder_with_a_long_name = inner
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x
        module: Any = self.encoder_with_a_long_name
        for k in reversed(range(6)):
            module = module[0][f"very_long_module_name_{k}"]
        return self.head(module(h))


def test_long_module_paths_are_shortened_in_the_middle() -> None:
    plan = fxpipe.plan(_Deep(), torch.randn(4, 8), ["cpu", "cpu"], cost="params")
    first, _ = plan.stages[0].span
    assert len(first) > PATH_WIDTH
    text = plan.summary()
    assert first not in text
    assert first[:10] in text and first[-10:] in text and "..." in text
    lines = text.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("stage"))
    assert len({len(line) for line in lines[head : head + 4]}) == 1


def test_cost_units() -> None:
    assert format_cost(0.00285, "s") == "2.85 ms"
    assert format_cost(2.5, "s") == "2.5 s"
    assert format_cost(4.2e-5, "s") == "42 us"
    assert format_cost(3.6e8, "flop") == "360 MFLOP"
    assert format_cost(2048, "B") == "2.0 KiB"
    assert format_bytes(3 * 1024**3) == "3.0 GiB"


# ------------------------------------------------------------------------- DOT


@pytest.mark.parametrize("name", list(ZOO))
def test_stage_dot_of_every_zoo_model(name: str) -> None:
    plan = _plan(name)
    nodes, edges = _parse_dot(plan.to_dot())
    for s in plan.stages:
        label = nodes[f"s{s.index}"]["label"]
        assert label.startswith(f"stage {s.index} ({s.device})")
        assert f"{len(s.nodes)} nodes" in label
    between = Counter(
        (t, h, a["label"], int(re.findall(r": ([\d,]+) bytes", a["tooltip"])[0].replace(",", "")))
        for t, h, a in edges
        if t.startswith("s") and h.startswith("s")
    )
    expected = Counter(
        (f"s{e.producer}", f"s{c}", f"{e.value}\n{format_bytes(e.bytes)}", e.bytes)
        for e in plan.edges
        for c in e.consumers
    )
    assert between == expected
    for t, h, a in edges:
        if t.startswith("s") and h.startswith("s"):
            skip = int(h[1:]) - int(t[1:]) > 1
            assert (a.get("style") == "dashed") == skip  # skip connections are drawn dashed
    assert ("input", "s0") in {(t, h) for t, h, _ in edges}
    assert any(h == "output" for _, h, _ in edges)


def test_node_dot_clusters_every_node_by_stage() -> None:
    plan = _plan("transformer")
    dot = plan.to_dot(level="node")
    clusters = re.findall(r"subgraph cluster_(\d+) \{(.*?)\n  \}", dot, flags=re.DOTALL)
    assert [int(k) for k, _ in clusters] == list(range(plan.num_stages))
    for (_, body), s in zip(clusters, plan.stages):
        names = [_unquote(n) for n in re.findall(r'^    "((?:[^"\\]|\\.)*)" \[', body, re.M)]
        assert names == list(s.nodes)
    _, edges = _parse_dot(dot)
    graph_edges = {(n.name, u.name) for n in plan.graph_module.graph.nodes for u in n.users}
    assert {(t, h) for t, h, _ in edges} == graph_edges
    crossing = [a for t, h, a in edges if plan.stage_of[t] != plan.stage_of[h]]
    assert crossing and all("label" in a for a in crossing)


def test_dot_quote_escapes_quotes_backslashes_and_newlines() -> None:
    text = 'a "quoted" C:\\path\nnext'
    quoted = dot_quote(text)
    assert quoted == '"a \\"quoted\\" C:\\\\path\\nnext"'
    assert _unquote(re.fullmatch(_STRING, quoted).group(1)) == text  # type: ignore[union-attr]


def test_unknown_level_is_refused() -> None:
    with pytest.raises(ConfigError, match="level='edges'"):
        _plan("mlp_residual").to_dot(level="edges")


def test_pydot_reads_the_stage_graph() -> None:
    pydot = pytest.importorskip("pydot")
    plan = _plan("unet")
    (graph,) = pydot.graph_from_dot_data(plan.to_dot())
    assert len(graph.get_edges()) == sum(len(e.consumers) for e in plan.edges) + 1 + len(
        [e for e in graph.get_edges() if e.get_destination() == "output"]
    )


# ------------------------------------------------------------------------- rendering


@pytest.mark.skipif(not HAS_DOT, reason="Graphviz dot is not installed")
@pytest.mark.parametrize("suffix", ["svg", "png"])
def test_draw_renders_the_stage_graph(tmp_path: Any, suffix: str) -> None:
    plan = _plan("unet")
    out = plan.draw(tmp_path / f"plan.{suffix}")
    data = out.read_bytes()
    assert data.startswith(b"\x89PNG") if suffix == "png" else b"<svg" in data
    if suffix == "svg":
        for s in plan.stages:
            assert f"stage {s.index} (cpu)".encode() in data


@pytest.mark.skipif(not HAS_DOT, reason="Graphviz dot is not installed")
def test_dot_accepts_labels_with_quotes_and_backslashes() -> None:
    label = dot_quote('say "hi" \\ C:\\x')
    dot = "digraph g { a [label=" + label + "]; }"
    assert b"<svg" in viz.render_dot(dot, "svg")


def test_draw_without_graphviz_names_the_package(monkeypatch: Any, tmp_path: Any) -> None:
    monkeypatch.setattr(viz.shutil, "which", lambda name: None)
    with pytest.raises(FxPipeError, match="apt-get install graphviz"):
        _plan("unet").draw(tmp_path / "plan.svg")


def test_draw_dot_text_needs_no_graphviz(monkeypatch: Any, tmp_path: Any) -> None:
    monkeypatch.setattr(viz.shutil, "which", lambda name: None)
    out = _plan("unet").draw(tmp_path / "plan.dot")
    assert out.read_text() == _plan("unet").to_dot()


@pytest.mark.skipif(not HAS_MPL, reason="matplotlib is not installed")
@pytest.mark.parametrize("suffix", ["png", "svg"])
def test_balance_chart(tmp_path: Any, suffix: str) -> None:
    out = _plan("transformer").draw_balance(tmp_path / f"balance.{suffix}")
    data = out.read_bytes()
    assert data.startswith(b"\x89PNG") if suffix == "png" else b"<svg" in data
    if suffix == "svg":
        assert b"lower bound" in data


@pytest.mark.parametrize(
    "path, kind, message",
    [
        ("plan.gif", "graph", "'.*plan.gif'.*suffix must be one of .svg"),
        ("plan.dot", "balance", "'.*plan.dot'.*suffix must be one of .png"),
        ("missing/plan.svg", "graph", "folder '.*missing' does not exist"),
        ("plan.svg", "pie", "kind='pie'"),
    ],
)
def test_bad_draw_requests(tmp_path: Any, path: str, kind: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        _plan("unet").draw(tmp_path / path, kind=kind)
