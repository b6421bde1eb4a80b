"""The mesh sweep's printed table: counts per class, by configuration (the schedules) or by
family x configuration x dtype (the layouts), then one line per row that is not equal."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from benchmarks.harness.failures import first_line
from benchmarks.harness.rows import STATUSES, Row
from benchmarks.mesh_sweep.batch import DTYPES
from benchmarks.mesh_sweep.configs import CONFIGS, SCHEDULES

__all__ = ["table", "counts", "dtype_of"]

#: Models whose tensor-parallel rows cut less than this share of a block's products.
LOW_SHARE = 0.8

_ORDER = {s: i for i, s in enumerate(("wrong", "crashed", "timeout", "refused", "skipped"))}


def dtype_of(row: Row) -> str:
    """A row's dtype (rows written before the sweep had dtypes are float64)."""
    return str(row.get("dtype", "float64"))


def _key(row: Row, by: Sequence[str]) -> tuple[str, ...]:
    return tuple(dtype_of(row) if k == "dtype" else str(row[k]) for k in by)


def counts(rows: list[Row], by: Sequence[str], lead: int = 22) -> list[str]:
    """Lines of counts per class for each value of the ``by`` fields, in the order met
    (configurations and dtypes in their own order), then ``all``."""
    place = {c.name: i for i, c in enumerate(CONFIGS)} | {d: i for i, d in enumerate(DTYPES)}
    keys = sorted({_key(r, by) for r in rows}, key=lambda key: [place.get(k, 0) for k in key])
    if "family" in by:  # families in the order the registry gives them
        met = list(dict.fromkeys(r["family"] for r in rows))
        keys.sort(key=lambda key: met.index(key[by.index("family")]))
    tally = Counter((_key(r, by), r["status"]) for r in rows)
    widths = [max([len(k[i]) for k in keys] + [len(by[i]), 3]) for i in range(len(by))]
    widths[-1] = max(widths[-1], lead - sum(w + 2 for w in widths[:-1]))
    head = "  ".join(f"{b:<{w}}" for b, w in zip(by, widths))
    head += "".join(f"{s:>9}" for s in STATUSES)
    lines = [head, "-" * len(head)]
    for key in keys + ["all"]:
        n = [sum(tally[(k, s)] for k in keys) if key == "all" else tally[(key, s)]
             for s in STATUSES]  # fmt: skip
        cells = ["all"] + [""] * (len(by) - 1) if key == "all" else list(key)
        lines.append("  ".join(f"{c:<{w}}" for c, w in zip(cells, widths)))
        lines[-1] += "".join(f"{c:>9}" for c in n)
    return lines


def table(rows: list[Row]) -> str:
    """Counts by configuration where every row is one of the schedules in float64, else by
    family x configuration x dtype and by configuration x dtype; then the rows not equal."""
    schedules = {c.name for c in SCHEDULES}
    old = all(r["config"] in schedules and dtype_of(r) == "float64" for r in rows)
    lines = counts(rows, ("config",)) if old else counts(rows, ("family", "config", "dtype"))
    if not old:
        lines += [""] + counts(rows, ("config", "dtype"))
    lines += _shares(rows)
    lines.append("")
    for r in sorted(
        (r for r in rows if r["status"] != "equal"),
        key=lambda r: (_ORDER.get(r["status"], 9), r["name"], r["config"], dtype_of(r)),
    ):
        reason = first_line(r.get("reason", ""), 140)
        dtype = "" if old else f" {dtype_of(r):<8}"
        lines.append(f"{r['status']:<8} {r['name']:<30} {r['config']:<22}{dtype} {reason}")
    return "\n".join(lines)


def _shares(rows: list[Row]) -> list[str]:
    """The tensor-parallel rows' least share of a block's matrix products cut on any rank:
    its spread over the models, and each model below LOW_SHARE by name."""
    shares: dict[str, float] = {}
    for r in rows:
        if r.get("share") is not None:
            shares[r["name"]] = min(shares.get(r["name"], 1.0), float(r["share"]))
    if not shares:
        return []
    full = sum(v >= 1.0 for v in shares.values())
    low = sorted((v, k) for k, v in shares.items() if v < LOW_SHARE)
    lines = ["", f"tensor parallel: {len(shares)} models, {full} with every block's products cut "
             f"on every rank, {len(low)} below {LOW_SHARE:.0%} on some rank"]  # fmt: skip
    lines += [f"  {k:<30} {v:.0%}" for v, k in low]
    return lines
