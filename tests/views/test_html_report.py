"""The HTML report, parsed: its sections, tables, inline images, and what it says when a
drawing tool is missing."""

from __future__ import annotations

import base64
import shutil
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest
import torch
from models import ZOO

import fxpipe
from fxpipe.errors import ConfigError
from fxpipe.views import viz
from fxpipe.views.html_report import render_report, write_report

pytest.importorskip("matplotlib")


pytestmark = pytest.mark.usefixtures("one_thread")


_VOID = {
    "meta",
    "img",
    "br",
    "hr",
    "link",
    "input",
    "path",
    "polygon",
    "ellipse",
    "polyline",
    "text",
    "title",
    "g",
    "svg",
}


class _Page(HTMLParser):
    """Sections by id, tables (rows of cell texts), images, and whether tags balance."""

    def __init__(self) -> None:
        super().__init__()
        self.stack: list[str] = []
        self.sections: dict[str, list[str]] = {}
        self.tables: dict[str, list[list[str]]] = {}
        self.images: list[dict[str, str | None]] = []
        self.svg = 0
        self.section: str | None = None
        self.cell: list[str] | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        if tag == "section":
            self.section = a["id"]
            self.sections[self.section or ""] = []
        if tag not in _VOID:
            self.stack.append(tag)
        if tag == "img":
            self.images.append({"section": self.section, **a})
        if tag == "svg":
            self.svg += 1
        if tag == "tr" and self.section is not None:
            self.tables.setdefault(self.section, []).append([])
        if tag in ("td", "th"):
            self.cell = []

    def handle_endtag(self, tag: str) -> None:
        if tag in _VOID:
            return
        assert self.stack and self.stack[-1] == tag, f"</{tag}> closes <{self.stack[-1:]}>"
        self.stack.pop()
        if tag in ("td", "th") and self.cell is not None and self.section is not None:
            self.tables[self.section][-1].append("".join(self.cell).strip())
            self.cell = None

    def handle_data(self, data: str) -> None:
        if self.cell is not None:
            self.cell.append(data)
        if self.section is not None:
            self.sections[self.section].append(data)


def _parse(text: str) -> _Page:
    page = _Page()
    page.feed(text)
    page.close()
    assert page.stack == [], f"unclosed tags {page.stack}"
    return page


def _recorded() -> fxpipe.Timeline:
    case = ZOO["unet"]
    (x,), _ = case.example(4)
    pipe = fxpipe.pipeline(case.build(), x, ["cpu"] * 3, chunks=2, cost="flops")
    with fxpipe.record(pipe) as tl:
        pipe(x).sum().backward()
    return tl


@pytest.mark.slow
def test_report_has_every_part(tmp_path: Path) -> None:
    tl = _recorded()
    plan = tl.plan
    path = write_report(plan, tmp_path / "report.html", timeline=tl, title='unet "K=3"')
    page = _parse(path.read_text(encoding="utf-8"))
    assert list(page.sections) == ["summary", "stages", "graph", "balance", "edges", "timeline"]
    assert "PipelinePlan: 3 stages" in "".join(page.sections["summary"])
    stages = page.tables["stages"]
    assert stages[0][:3] == ["stage", "device", "nodes"]
    assert [row[0] for row in stages[1:]] == ["0", "1", "2"]
    edges = page.tables["edges"][1:]
    assert sorted((r[0], int(r[3].replace(",", ""))) for r in edges) == sorted(
        (e.value, e.bytes) for e in plan.edges
    )
    pngs = {img["section"]: img["src"] or "" for img in page.images}
    assert set(pngs) == {"balance", "timeline"}
    for src in pngs.values():
        assert src.startswith("data:image/png;base64,")
        assert base64.b64decode(src.split(",", 1)[1]).startswith(b"\x89PNG")
    assert "measured bubble" in "".join(page.sections["timeline"])
    if shutil.which("dot"):
        assert page.svg == 1 and "stage 0 (cpu)" in "".join(page.sections["graph"])
    assert "http" not in "".join(img.get("src") or "" for img in page.images)  # self-contained


def test_report_without_graphviz_or_timeline(monkeypatch: Any) -> None:
    monkeypatch.setattr(viz.shutil, "which", lambda name: None)
    case = ZOO["mlp_residual"]
    (x,), _ = case.example(4)
    plan = fxpipe.plan(case.build(), x, ["cpu", "cpu"], cost="flops")
    page = _parse(render_report(plan))
    assert "timeline" not in page.sections and page.svg == 0
    graph = "".join(page.sections["graph"])
    assert "apt-get install graphviz" in graph and "digraph plan" in graph


def test_report_without_matplotlib(monkeypatch: Any) -> None:
    def missing(*args: Any) -> Any:
        raise viz.MissingDependencyError("charts need matplotlib, which is not installed")

    monkeypatch.setattr(viz, "_figure", missing)
    plan = fxpipe.plan(torch.nn.Linear(4, 4), torch.randn(2, 4), ["cpu"], cost="flops")
    page = _parse(render_report(plan))
    assert "charts need matplotlib" in "".join(page.sections["balance"])
    assert page.images == []


def test_report_path_is_checked(tmp_path: Path) -> None:
    plan = fxpipe.plan(torch.nn.Linear(4, 4), torch.randn(2, 4), ["cpu"], cost="flops")
    with pytest.raises(ConfigError, match="does not exist"):
        write_report(plan, tmp_path / "nowhere" / "r.html")
