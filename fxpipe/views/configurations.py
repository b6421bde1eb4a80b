"""The configurations a plan was chosen from: the table, and the summary's line about them."""

from __future__ import annotations

from collections.abc import Sequence

from fxpipe.ir import Configuration, ConfigurationTable, PipelinePlan
from fxpipe.passes.configure.step_time import predict_plan

__all__ = ["plan_configurations", "configuration_table", "configuration_notes", "modes_text"]

_HEAD = ("", "chunks", "checkpoint", "found", "step", "compute", "recompute", "idle",
         "runtime", "memory", "")  # fmt: skip


def plan_configurations(plan: PipelinePlan) -> ConfigurationTable:
    """The table ``plan`` was chosen from; for a plan whose configuration was given, that
    configuration alone, predicted the same way."""
    if plan.weighed is not None:
        return plan.weighed
    return ConfigurationTable((predict_plan(plan),), 0, "given")


def modes_text(modes: Sequence[str]) -> str:
    """``('never', 'never')`` -> ``'never'``; differing modes as a list, shortened."""
    if len(set(modes)) == 1:
        return modes[0]
    short = {"never": "N", "except_last": "E", "always": "A"}
    return "".join(short[m] for m in modes) + " (per stage)"


def _seconds(value: float | None) -> str:
    if value is None:
        return "-"
    if value >= 1:
        return f"{value:.3g} s"
    return f"{value * 1e3:.3g} ms"


def _memory(row: Configuration) -> str:
    if not row.memory:
        return "-"
    return ", ".join(f"{device} {size / 2**20:.1f} MiB" for device, size in row.memory)


def configuration_table(table: ConfigurationTable) -> str:
    """One row per configuration, fastest first, the chosen one marked ``*``; a legend for
    the per-stage modes (N never, E except_last, A always, stage by stage)."""
    rows = []
    for i, row in enumerate(table.rows):
        rows.append([
            "*" if i == table.chosen else "",
            str(row.chunks),
            modes_text(row.checkpoint),
            row.kind,
            _seconds(row.step),
            _seconds(row.compute) if row.fits else "-",
            _seconds(row.recompute) if row.fits else "-",
            _seconds(row.idle) if row.fits else "-",
            _seconds(row.overhead) if row.fits else "-",
            _memory(row),
            row.refused and f"does not fit: {row.refused}",
        ])  # fmt: skip
    widths = [max(len(r[c]) for r in [list(_HEAD), *rows]) for c in range(len(_HEAD))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in [_HEAD, *rows]]
    fits = sum(1 for r in table.rows if r.fits)
    title = (
        f"Configurations weighed ({table.searched}): {len(table.rows)}, {fits} fit; step = "
        "predicted seconds of one step (per device: compute, recompute, idle, runtime)"
    )
    legend = "per-stage modes, stage by stage: N never, E except_last, A always"
    return "\n".join([title, *lines, legend])


def configuration_notes(plan: PipelinePlan) -> list[str]:
    """The summary's lines: the predicted step, and for a chosen configuration why (the
    runner-up's prediction, how many did not fit). Nothing for costs not in seconds."""
    if plan.costs.unit != "s":
        return []
    table = plan_configurations(plan)
    chosen = table.choice
    head = (
        f"step:        predicted {_seconds(chosen.step)} (compute {_seconds(chosen.compute)}, "
        f"recompute {_seconds(chosen.recompute)}, idle {_seconds(chosen.idle)}, runtime "
        f"{_seconds(chosen.overhead)} per device), chunks={chosen.chunks}, "
        f"checkpoint={modes_text(chosen.checkpoint)}"
    )
    if plan.weighed is None:
        return [head]
    others = [r for i, r in enumerate(table.rows) if i != table.chosen and r.fits]
    refused = sum(1 for r in table.rows if not r.fits)
    why = [f"chosen from {len(table.rows)} configurations ({table.searched})"]
    if others and chosen.step:
        second = others[0]
        assert second.step is not None
        why.append(
            f"runner-up chunks={second.chunks}, checkpoint={modes_text(second.checkpoint)} "
            f"{_seconds(second.step)} (+{100 * (second.step / chosen.step - 1):.1f}%)"
        )
    if refused:
        why.append(f"{refused} do not fit the memory budgets")
    return [head, "configure:   " + "; ".join(why) + "; plan.configurations() lists them"]
