"""The documentation's code and links: every ```` ```python runnable ```` block of README.md
and docs/*.md runs, and every relative link points to a file and heading that exist.

A runnable block is self-contained: it runs as-is on a CPU machine with the ``test`` extra
installed, in a fresh namespace, in a temporary working directory (files it writes land
there). Blocks that need a GPU, several processes or the network stay plain ```` ```python ````.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import fxpipe  # noqa: F401  (imported once, before any block changes the working directory)

pytestmark = pytest.mark.usefixtures("one_thread")

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
PAGES = [README, *sorted(DOCS.glob("*.md"))]
README_MAX_LINES = 300

FENCE = re.compile(r"^( *)(`{3,}|~{3,})(.*)$")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
SRC = re.compile(r"<img\s[^>]*src=\"([^\"]+)\"")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
INLINE_CODE = re.compile(r"`+[^`]*`+")


@dataclass(frozen=True)
class Block:
    """One fenced code block: its page, the line of its opening fence, info string, text."""

    path: Path
    line: int
    info: str
    source: str

    @property
    def runnable(self) -> bool:
        return self.info.split() == ["python", "runnable"]

    @property
    def name(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def _scan(path: Path) -> tuple[list[Block], list[tuple[int, str]]]:
    """The page's fenced blocks, and its other lines (number, text) outside them."""
    blocks: list[Block] = []
    prose: list[tuple[int, str]] = []
    fence: tuple[str, str, int, str] | None = None  # indent, marker, line, info
    body: list[str] = []
    for number, text in enumerate(path.read_text().splitlines(), start=1):
        match = FENCE.match(text)
        if fence is None and match:
            fence, body = (match[1], match[2], number, match[3].strip()), []
        elif fence is not None and match and match[2].startswith(fence[1]) and not match[3]:
            indent, _, line, info = fence
            source = "\n".join(t[len(indent) :] if t.startswith(indent) else t for t in body)
            blocks.append(Block(path, line, info, source))
            fence = None
        elif fence is not None:
            body.append(text)
        else:
            prose.append((number, text))
    assert fence is None, f"{path.name}:{fence[2]}: code block never closed"
    return blocks, prose


def _blocks(path: Path) -> list[Block]:
    return _scan(path)[0]


RUNNABLE = [block for page in PAGES for block in _blocks(page) if block.runnable]


@pytest.mark.parametrize("block", RUNNABLE, ids=lambda block: block.name)
def test_runnable_block_runs(
    block: Block, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The block runs in a fresh namespace; a traceback names the page and its lines."""
    monkeypatch.chdir(tmp_path)
    torch.manual_seed(0)
    code = compile("\n" * block.line + block.source, str(block.path), "exec")
    exec(code, {"__name__": "__main__"})


def test_there_are_runnable_blocks() -> None:
    assert len(RUNNABLE) >= 10, [block.name for block in RUNNABLE]


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(ROOT)))
def test_every_page_with_python_code_runs_some(page: Path) -> None:
    """A page that shows Python shows at least one block that runs."""
    blocks = _blocks(page)
    python = [block for block in blocks if block.info.split()[:1] == ["python"]]
    if python:
        assert any(block.runnable for block in python), f"{page.name}: no runnable block"


def test_readme_is_short() -> None:
    lines = len(README.read_text().splitlines())
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines"


def test_readme_links_every_docs_page() -> None:
    linked = {
        (README.parent / target.split("#")[0]).resolve()
        for _, target in _links(README)
        if target.split("#")[0]
    }
    missing = [p.name for p in sorted(DOCS.glob("*.md")) if p.resolve() not in linked]
    assert not missing, f"README.md does not link {missing}"


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link keeps its text
    text = re.sub(r"<[^>]+>", "", text).lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    seen: Counter[str] = Counter()
    anchors = set()
    for _, text in _scan(path)[1]:
        match = HEADING.match(text)
        if match:
            slug = _slug(match[2])
            anchors.add(slug if not seen[slug] else f"{slug}-{seen[slug]}")
            seen[slug] += 1
    return anchors


def _links(path: Path) -> list[tuple[int, str]]:
    """(line, target) of every link and image outside code, relative ones and anchors."""
    found = []
    for number, text in _scan(path)[1]:
        text = INLINE_CODE.sub("", text)
        for target in LINK.findall(text) + SRC.findall(text):
            if not re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                found.append((number, target))
    return found


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(ROOT)))
def test_relative_links_resolve(page: Path) -> None:
    """Every relative link names an existing file, and a #anchor an existing heading."""
    broken = []
    for number, target in _links(page):
        file, _, anchor = target.partition("#")
        dest = (page.parent / file).resolve() if file else page
        if not dest.exists():
            broken.append(f"{page.name}:{number}: {target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(f"{page.name}:{number}: {target} (no such heading)")
    assert not broken, "\n".join(broken)
