"""The sweep's table: models per family and class, one column per check, then every model
that is not equal; and the settings a run records."""

from __future__ import annotations

import argparse
import os
import platform
import time
from collections import Counter

from benchmarks.harness.compare import FLOOR, TOLERANCE
from benchmarks.harness.failures import first_line
from benchmarks.harness.machine import library_versions
from benchmarks.harness.precision import FACTOR
from benchmarks.harness.rows import STATUSES, Row
from benchmarks.sweep.checks import CHECKS, CHUNKS

__all__ = ["LIBRARIES", "table", "markdown", "meta"]

#: The libraries the models come from, recorded with every run.
LIBRARIES = ("torch", "torchvision", "timm", "transformers")
_ORDER = {s: i for i, s in enumerate(("wrong", "crashed", "timeout", "refused", "skipped"))}


def _check_cell(rows: list[Row], check: str) -> str:
    """Models equal in ``check`` / models it judged (skipped and absent left out)."""
    results = [r.get("checks", {}).get(check) for r in rows]
    judged = [c for c in results if c is not None and c["status"] != "skipped"]
    if not judged:
        return "-"
    return f"{sum(c['status'] == 'equal' for c in judged)}/{len(judged)}"


def table(rows: list[Row]) -> str:
    """Counts per family and class (total: the models counted, skipped ones left out), a
    column per check (equal / judged), then one line per model that is not equal."""
    families = list(dict.fromkeys(r["family"] for r in rows))
    checks = list(dict.fromkeys([*CHECKS, *(c for r in rows for c in r.get("checks", {}))]))
    counts = Counter((r["family"], r["status"]) for r in rows)
    head = f"{'family':<12}" + "".join(f"{s:>9}" for s in STATUSES[:-1]) + f"{'total':>9}"
    head += f"{'skipped':>9}" + "".join(f"{c:>9}" for c in checks)
    lines = [head, "-" * len(head)]
    for fam in families + ["all"]:
        n = [sum(counts[(f, s)] for f in families) if fam == "all" else counts[(fam, s)]
             for s in STATUSES]  # fmt: skip
        cells = "".join(f"{c:>9}" for c in n[:-1])
        mine = rows if fam == "all" else [r for r in rows if r["family"] == fam]
        per_check = "".join(f"{_check_cell(mine, c):>9}" for c in checks)
        lines.append(f"{fam:<12}{cells}{sum(n[:-1]):>9}{n[-1]:>9}{per_check}")
        if fam == families[-1]:
            lines.append("-" * len(head))
    lines.append(
        f"per check ({', '.join(checks)}): models equal in it / models it judged (skipped "
        "and not applicable left out)"
    )
    bad = [r for r in rows if r["status"] != "equal"]
    lines.append("")
    for r in sorted(bad, key=lambda r: (_ORDER.get(r["status"], 9), r["family"], r["name"])):
        lines.append(f"{r['status']:<8} {r['name']:<34} {first_line(r.get('reason', ''), 150)}")
    return "\n".join(lines)


def markdown(rows: list[Row]) -> str:
    """A Markdown table of every model: its family, its class and each check's (``-``: the
    check does not apply to it); then the models equal in each check over those it judged,
    and the models per class."""
    checks = list(dict.fromkeys([*CHECKS, *(c for r in rows for c in r.get("checks", {}))]))
    lines = ["| model | family | " + " | ".join(checks) + " | class |",
             "|---|---|" + "---|" * len(checks) + "---|"]  # fmt: skip
    for r in rows:
        cells = [r.get("checks", {}).get(c, {}).get("status", "-") for c in checks]
        lines.append(
            f"| {r['name']} | {r['family']} | " + " | ".join(cells) + f" | {r['status']} |"
        )
    per_check = [_check_cell(rows, c) for c in checks]
    lines.append("| equal / judged | | " + " | ".join(per_check) + " | |")
    counts = Counter(r["status"] for r in rows)
    totals = ", ".join(f"{counts[s]} {s}" for s in STATUSES)
    return "\n".join(lines) + f"\n\n{len(rows)} models: {totals}."


def meta(args: argparse.Namespace) -> Row:
    """The settings of a run, kept in its JSON."""
    narrow = args.dtype != "float64"
    return {"date": time.strftime("%Y-%m-%d"), "python": platform.python_version(),
            "cpus": os.cpu_count(), "cost": args.cost, "compile": args.compile or None,
            "timeout_s": args.timeout, "dtype": args.dtype,
            "chunks": CHUNKS, "tolerance": TOLERANCE, "floor": FLOOR, "label": args.label,
            "factor": FACTOR if narrow else None,
            "checks": list(CHECKS), **library_versions(LIBRARIES)}  # fmt: skip
