"""What every benchmark writes: the command as run, result files, aligned text tables."""

from __future__ import annotations

import json
import os
import shlex
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

__all__ = ["ROOT", "RESULTS", "result_path", "command_line", "shown", "save_json", "format_table"]

#: The repository root, where every benchmark is run from.
ROOT = Path(__file__).resolve().parents[2]
#: Where the stored results live, one JSON file per benchmark.
RESULTS = ROOT / "benchmarks" / "results"

Columns = Sequence[tuple[str, Callable[[dict[str, Any]], str]]]


def result_path(name: str) -> Path:
    """The default result file of benchmark ``name``: ``benchmarks/results/NAME.json``."""
    return RESULTS / f"{name}.json"


def command_line() -> str:
    """This process's command as typed from the repository root: ``python -m
    benchmarks.NAME ARGS`` (no machine paths, whatever ``sys.argv[0]`` holds)."""
    spec = getattr(sys.modules["__main__"], "__spec__", None)
    name = getattr(spec, "name", None)
    if name:
        module = name.removesuffix(".__main__")
        return shlex.join(["python", "-m", module, *sys.argv[1:]])
    return shlex.join(["python", shown(Path(sys.argv[0])), *sys.argv[1:]])


def shown(path: Path) -> str:
    """``path`` relative to the current directory when it lies below it, else as given."""
    relative = os.path.relpath(path)
    return str(path) if relative.startswith("..") else relative


def save_json(path: Path, payload: dict[str, Any], indent: int = 2) -> int:
    """Write ``payload`` to ``path`` (indented JSON), say so, and return 0 (success)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=indent) + "\n")
    print(f"wrote {shown(path)}")
    return 0


def format_table(
    rows: Sequence[dict[str, Any]], columns: Columns, *, left: int = 0, rule: bool = True
) -> str:
    """One line per row, columns aligned: the first ``left`` to the left, the others to the
    right; a rule of dashes under the header when ``rule``."""
    cells = [[header for header, _ in columns]]
    cells += [[fmt(r) for _, fmt in columns] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(columns))]

    def line(row: Sequence[str]) -> str:
        parts = [
            c.ljust(w) if i < left else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))
        ]
        return "  ".join(parts).rstrip()

    lines = [line(row) for row in cells]
    if rule:
        lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
