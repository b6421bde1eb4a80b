"""The sweeps' registry: every model by name, and a run's selection of them."""

from __future__ import annotations

import fnmatch

from benchmarks.harness.models.hf_moe import hf_moe_specs
from benchmarks.harness.models.hf_text import hf_text_specs
from benchmarks.harness.models.hf_vision import hf_vision_specs
from benchmarks.harness.models.spec import Spec
from benchmarks.harness.models.vision import timm_specs, torchvision_specs

__all__ = ["registry", "select", "interleave"]


def registry() -> dict[str, Spec]:
    """Every model of the sweeps by name: transformers text, vision and Mixture-of-Experts
    models, then timm and torchvision."""
    specs = hf_text_specs() + hf_vision_specs() + hf_moe_specs()
    specs += timm_specs() + torchvision_specs()
    table = {s.name: s for s in specs}
    assert len(table) == len(specs), "duplicate model names"
    return table


def select(table: dict[str, Spec], only: str | None) -> list[Spec]:
    """Models whose name or family matches one of the comma-separated patterns (a model's
    exact name; else a pattern without a wildcard matches as a substring)."""
    if not only:
        return list(table.values())
    wanted = [p for p in only.split(",") if p]
    pats = [p if p in table or any(c in p for c in "*?[") else f"*{p}*" for p in wanted]
    return [
        s for s in table.values()
        if any(fnmatch.fnmatch(s.name, p) or fnmatch.fnmatch(s.family, p) for p in pats)
    ]  # fmt: skip


def interleave(specs: list[Spec]) -> list[Spec]:
    """Round-robin over families, so that any prefix of a run samples every family."""
    groups: dict[str, list[Spec]] = {}
    for spec in specs:
        groups.setdefault(spec.family, []).append(spec)
    order: list[Spec] = []
    while any(groups.values()):
        order += [group.pop(0) for group in groups.values() if group]
    return order
