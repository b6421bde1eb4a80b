"""The GPU benchmark's one table, from the sections' records."""

from __future__ import annotations

from typing import Any

import torch

from benchmarks.gpu.device import device_name
from benchmarks.gpu.settings import CHUNKS, STAGES


def print_table(device: Any, sections: dict[str, dict[str, Any]]) -> None:
    """The run's sections as a table, under a line naming ``device``."""
    print()
    print(f"fxpipe on {device_name(device)}; torch {torch.__version__}; K={STAGES}, M={CHUNKS}")
    head = f"{'measurement':<30} {'measured':>12} {'ratio':>7}  {'ratio to':<12} {'predicted':<22}"
    print(head)
    print("-" * len(head))
    for name, rec in sections.items():
        if rec.get("status") != "ok":
            print(f"{name:<30} {rec.get('status', '?')}")
            continue
        for cells in _table_rows(name, rec):
            label, value, ratio, ref, pred = cells
            print(f"{label:<30} {value:>12} {ratio:>7}  {ref:<12} {pred:<22}")
    print("-" * len(head))


Cells = tuple[str, str, str, str, str]


def _table_rows(name: str, rec: dict[str, Any]) -> list[Cells]:
    if name == "step time":
        return [
            (
                f"step {r['variant']}",
                f"{r['ms']:.2f} ms",
                f"{r['vs_plain' if i < 2 else 'vs_by_hand']:.3f}",
                "plain" if i < 2 else "by hand M=8",
                "-",
            )
            for i, r in enumerate(rec["rows"])
        ]
    if name == "peak memory":
        rows = []
        for r in rec["rows"]:
            mode = r["variant"].rsplit(" ", 1)[-1]
            to_never = mode in ("except_last", "always")
            pred = "-"
            if to_never:
                pred = f"plan {fmt(r['plan_vs_never'])}"
            if mode == "always":
                pred = f"GPipe {rec['gpipe_always_vs_never']:.3f}, " + pred
            rows.append(
                (
                    f"peak {r['variant']}",
                    f"{fmt(r['peak_mib'], '.1f')} MiB",
                    fmt(r["vs_never"] if to_never else r["vs_plain"]),
                    "never" if to_never else "plain",
                    pred,
                )
            )
        return rows
    if name == "stage prediction":
        rows = [
            (
                f"stage {r['stage']} fwd+bwd alone",
                f"{r['measured_ms']:.2f} ms",
                fmt(r["measured_vs_predicted"]),
                "predicted",
                f"{r['predicted_ms']:.2f} ms"
                if rec["cost_unit"] == "s"
                else f"{r['predicted_ms']:.3g} {rec['cost_unit']}",
            )
            for r in rec["rows"]
        ]
        rows.append(
            (
                f"GPipe speedup at M={CHUNKS}",
                f"{rec['measured_speedup']:.2f}x",
                "-",
                "-",
                f"{rec['predicted_speedup']:.2f}x",
            )
        )
        return rows
    if name == "overlap":
        both = f"{rec['compute_ms']:.2f}+{rec['copy_ms']:.2f}->{rec['both_ms']:.2f} ms"
        return [("D2H copy/compute overlap", f"{rec['overlap']:.2f}", "-", "-", both)]
    return []


def fmt(value: float | None, spec: str = ".3f") -> str:
    """``value`` in ``spec``, or "-" when there is none."""
    return "-" if value is None else format(value, spec)
