"""The option records: every choice the public signatures allow is accepted, everything
else is refused once, by the record, with the value named; and the choices are defined in
one place only."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal, get_args, get_origin, get_type_hints

import pytest
import torch

import fxpipe
import fxpipe.distributed as fd
from fxpipe.errors import ConfigError
from fxpipe.options import PlanOptions, RunOptions, default_chunks

ROOT = Path(__file__).resolve().parents[1]


def _choices(hint: Any) -> set[str]:
    """The strings a Literal annotation (possibly inside a union) allows."""
    if get_origin(hint) is Literal:
        return set(get_args(hint))
    return set().union(*(_choices(h) for h in get_args(hint)))


PUBLIC = [fxpipe.pipeline, fxpipe.plan, fd.pipeline_schedule]


@pytest.mark.parametrize("function", PUBLIC, ids=lambda f: f.__qualname__)
def test_every_annotated_choice_is_accepted(function: Callable[..., Any]) -> None:
    hints = get_type_hints(function)
    for name in ("cost", "tracer", "checkpoint"):
        if name not in hints:
            continue
        choices = _choices(hints[name])
        assert choices, name
        for choice in choices:
            if name == "checkpoint":
                assert RunOptions(checkpoint=choice).checkpoint == choice  # type: ignore[arg-type]
            assert getattr(PlanOptions(**{name: choice}), name) == choice


BAD: dict[str, tuple[Callable[[], object], str]] = {
    "cost unknown": (lambda: PlanOptions(cost="FLOPS"), "cost='FLOPS'"),  # type: ignore[arg-type]
    "cost None": (lambda: PlanOptions(cost=None), "cost=None"),  # type: ignore[arg-type]
    "tracer unknown": (lambda: PlanOptions(tracer="jit"), "tracer='jit'"),  # type: ignore[arg-type]
    "traffic unknown": (
        lambda: PlanOptions(traffic="bogus"),  # type: ignore[arg-type]
        r"traffic='bogus'.*'direct', 'relay'",
    ),
    "slack negative": (lambda: PlanOptions(slack=-0.1), r"slack=-0\.1 must be a number"),
    "slack infinite": (lambda: PlanOptions(slack=float("inf")), "slack=inf"),
    "slack bool": (lambda: PlanOptions(slack=True), "slack=True"),
    "plan chunks zero": (lambda: PlanOptions(chunks=0), "chunks=0"),
    "run chunks float": (lambda: RunOptions(chunks=2.0), r"chunks=2\.0"),  # type: ignore[arg-type]
    "checkpoint unknown": (
        lambda: RunOptions(checkpoint="sometimes"),  # type: ignore[arg-type]
        "checkpoint='sometimes'.*'always', 'except_last', 'never'",
    ),
    "deferred not bool": (
        lambda: RunOptions(deferred_batch_norm="yes"),  # type: ignore[arg-type]
        "deferred_batch_norm='yes'",
    ),
}


@pytest.mark.parametrize("case", list(BAD), ids=list(BAD))
def test_bad_options_are_refused_by_the_record(case: str) -> None:
    make, message = BAD[case]
    with pytest.raises(ConfigError, match=message) as info:
        make()
    assert isinstance(info.value, ValueError)  # a user mistake: also a ValueError


@pytest.mark.parametrize("mode", ["bogus", "FLOPS", "", "seconds"])
def test_an_unknown_cost_mode_is_refused_naming_it(mode: str) -> None:
    with pytest.raises(ConfigError) as info:
        PlanOptions(cost=mode)  # type: ignore[arg-type]
    assert isinstance(info.value, ValueError) and repr(mode) in str(info.value)


def test_records_are_frozen_and_resolve_their_defaults() -> None:
    options = PlanOptions()
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.cost = "flops"  # type: ignore[misc]
    assert options.pricing() == "roofline"  # "auto": the analytic, repeatable default
    assert PlanOptions(cost="flops").pricing() == "flops"
    assert options.micro_batches(stages=3, batch=64) == 12 == default_chunks(3, 64)
    assert options.micro_batches(stages=3, batch=5) == 5
    assert PlanOptions(chunks=2).micro_batches(stages=3, batch=64) == 2
    run = RunOptions.of(
        chunks=None, checkpoint="never", deferred_batch_norm=False, output_device="cpu"
    )
    assert run.output_device == torch.device("cpu")


def _package_sources() -> list[Path]:
    return [*(ROOT / "fxpipe").rglob("*.py"), *(ROOT / "passes").rglob("*.py")]


@pytest.mark.parametrize(
    "pattern",
    [
        r"""["']except_last["'],\s*["']never["']""",  # checkpoint modes
        r"""["']direct["'],\s*["']relay["']""",  # traffic
        r"""["']fx["'],\s*["']export["']\]""",  # tracers (a Literal's closing bracket)
        r"""["']flops["'],\s*["']params["']""",  # cost modes
    ],
)
def test_each_set_of_choices_is_written_once(pattern: str) -> None:
    """The choices live in the Literal types of fxpipe/ir.py; nobody spells them out again."""
    found = [
        p.relative_to(ROOT).as_posix()
        for p in _package_sources()
        if re.search(pattern, p.read_text())
    ]
    assert found == ["fxpipe/ir.py"], found
