"""The sweeps' result rows: their classes, and their file, merged run over run with the label
of the run that made each row."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

__all__ = ["Row", "STATUSES", "load_rows", "save_rows"]

Row = dict[str, Any]
#: A row's classes: equal to eager, refused on purpose (an FxPipeError), crashed, wrong, no
#: verdict in time, or skipped (eager itself fails here).
STATUSES = ("equal", "refused", "crashed", "wrong", "timeout", "skipped")


def _upgraded(row: Row) -> Row:
    """A row as this harness writes it: per-check results under ``checks`` (rows written
    before the checks had a name of their own kept the train and eval ones under
    ``modes``)."""
    if "modes" in row and "checks" not in row:
        row = {("checks" if k == "modes" else k): v for k, v in row.items()}
    return row


def load_rows(path: Path) -> tuple[Row, list[Row]]:
    """The run settings and the rows of a result file, each row with its run's label."""
    before = json.loads(path.read_text())
    label = before["meta"].get("label", "")
    return before["meta"], [_upgraded({"label": label, **r}) for r in before["rows"]]


def save_rows(
    path: Path,
    rows: list[Row],
    meta: Row,
    merge: bool,
    order: Sequence[str],
    key: Callable[[Row], Any] = lambda r: r["name"],
) -> list[Row]:
    """Write ``rows``, each with the label of the run that made it (with ``merge``: over the
    rows already in ``path`` of other ``key`` s, which keep theirs; a row written before
    rows had labels takes its file's), models in ``order`` (others are dropped)."""
    rows = [{"label": meta["label"], **r} for r in rows]
    if merge and path.exists():
        old = {key(r): r for r in load_rows(path)[1]}
        old.update({key(r): r for r in rows})
        place = {name: i for i, name in enumerate(order)}
        rows = sorted((r for r in old.values() if r["name"] in place),
                      key=lambda r: place[r["name"]])  # fmt: skip
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    return rows
