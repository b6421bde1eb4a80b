"""The sweep's coverage side by side over dtypes: per family, each dtype's models equal,
refused, wrong, crashed (timeouts apart) and skipped, from one result file per dtype, and the
headline, the share of models equal in the worst dtype."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from benchmarks.harness.output import format_table
from benchmarks.harness.rows import Row, load_rows

__all__ = ["CELL", "file_dtype", "coverage", "side_by_side"]

#: What a cell counts, in order.
CELL = ("equal", "refused", "wrong", "crashed", "skipped")


def file_dtype(meta: Row, rows: list[Row]) -> str:
    """The dtype a result file was run in: its settings', else its rows', else float64 (the
    files written before the sweep took ``--dtype``)."""
    return str(meta.get("dtype") or next((r["dtype"] for r in rows if "dtype" in r), "float64"))


def _cell(rows: list[Row]) -> str:
    """``equal/refused/wrong/crashed/skipped``, then ``+N timeout`` where any timed out."""
    n = Counter(r["status"] for r in rows)
    cell = "/".join(str(n[s]) for s in CELL)
    return cell + (f" +{n['timeout']} timeout" if n["timeout"] else "") if rows else "-"


def coverage(rows: list[Row]) -> tuple[int, int]:
    """Models equal, and models counted (all but the skipped ones)."""
    counted = [r for r in rows if r["status"] != "skipped"]
    return sum(r["status"] == "equal" for r in counted), len(counted)


def _share(rows: list[Row]) -> str:
    equal, counted = coverage(rows)
    return f"{equal}/{counted} ({100 * equal / counted:.1f}%)" if counted else "-"


def _headline(runs: dict[str, list[Row]]) -> str:
    """Each dtype's share of counted models equal over the models every file holds, and the
    headline: the worst of them."""
    common = set.intersection(*({r["name"] for r in rows} for rows in runs.values()))
    shares = {d: coverage([r for r in rows if r["name"] in common]) for d, rows in runs.items()}
    ratio = {d: equal / counted if counted else 1.0 for d, (equal, counted) in shares.items()}
    each = ", ".join(f"{d} {e}/{c} ({100 * ratio[d]:.1f}%)" for d, (e, c) in shares.items())
    worst = min(ratio, key=lambda d: ratio[d])
    return (
        f"over the {len(common)} models every file holds, counted models equal: {each}\n"
        f"headline (the worst dtype): {100 * ratio[worst]:.1f}% in {worst}"
    )


def side_by_side(paths: list[Path], markdown: bool = False) -> str:
    """Families x dtypes (``equal/refused/wrong/crashed/skipped`` per cell), the share of
    counted models equal per dtype, and the headline: the worst dtype's share."""
    runs: dict[str, list[Row]] = {}
    for path in paths:
        meta, rows = load_rows(path)
        runs[file_dtype(meta, rows)] = rows
    families = list(dict.fromkeys(r["family"] for rows in runs.values() for r in rows))
    table: list[dict[str, str]] = []
    for family in [*families, "all"]:
        line = {"family": family}
        for dtype, rows in runs.items():
            line[dtype] = _cell([r for r in rows if family in ("all", r["family"])])
        table.append(line)
    table.append({"family": "equal / counted", **{d: _share(r) for d, r in runs.items()}})
    columns = [(k, lambda r, k=k: r[k]) for k in ["family", *runs]]
    if markdown:
        lines = ["| " + " | ".join(k for k, _ in columns) + " |", "|---" * len(columns) + "|"]
        lines += ["| " + " | ".join(fmt(r) for _, fmt in columns) + " |" for r in table]
        text = "\n".join(lines)
    else:
        text = format_table(table, columns, left=1)
    legend = f"each cell: models {'/'.join(CELL)} (timeouts apart)"
    gap = "\n\n" if markdown else "\n"
    return f"{text}{gap}{legend}\n{_headline(runs)}"
