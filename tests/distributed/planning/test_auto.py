"""``n_microbatches="auto"`` and ``schedule="auto"``: the fastest predicted layout of the
pipeline ranks given, the same on every rank, and trained as eager trains."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fxpipe.distributed.options import SPLIT_BACKWARD, ScheduleOptions
from fxpipe.distributed.planning.auto import choose_schedule
from fxpipe.distributed.planning.layout import LAYOUT_SCHEDULES, suggest_layout
from fxpipe.errors import ConfigError
from tests.distributed.ranks import (
    check_against_eager,
    launch,
    preload,
    problem,
    results,
    train,
)

preload(__name__)

CPU = torch.device("cpu")


def _choose(**kw: object) -> object:
    build, args, kwargs, _, _ = problem("unet")
    options = kw.pop("options", ScheduleOptions(n_microbatches=1))
    return choose_schedule(build(), (args, kwargs), options, pp=2, device=CPU, **kw)  # type: ignore[arg-type]


def test_the_choice_is_the_fastest_two_rank_layout_suggest_layout_ranks() -> None:
    choice = _choose(n_microbatches="auto", schedule="auto")
    build, args, kwargs, _, _ = problem("unet")
    ranked = suggest_layout(build(), args, 2, example_kwargs=kwargs, cost="roofline",
                            device="cpu", virtual=(2, 4), schedules=LAYOUT_SCHEDULES)  # fmt: skip
    two_ranks = [e for e in ranked if e.pp == 2 and e.dp == 1]
    best = min(e.step_s for e in two_ranks)
    assert choice.weighed[0].step_s == pytest.approx(best)  # type: ignore[attr-defined]
    assert len(choice.weighed) == len(two_ranks)  # type: ignore[attr-defined]
    assert "predicted" in choice.summary()  # type: ignore[attr-defined]


def test_what_is_given_stays_and_other_options_narrow_the_schedules() -> None:
    fixed = _choose(n_microbatches=4, schedule="auto")
    assert {e.chunks for e in fixed.weighed} == {4}  # type: ignore[attr-defined]
    gpipe = _choose(n_microbatches="auto", schedule="GPipe")
    assert {e.schedule for e in gpipe.weighed} == {"gpipe"}  # type: ignore[attr-defined]
    compiled = ScheduleOptions(n_microbatches=1, compile=True)
    narrowed = _choose(n_microbatches="auto", schedule="auto", options=compiled)
    assert not {e.schedule for e in narrowed.weighed} & SPLIT_BACKWARD  # type: ignore[attr-defined]


def test_stages_per_rank_given_leaves_the_schedules_of_that_count() -> None:
    given = ScheduleOptions(n_microbatches=1, schedule="loopedbfs", stages_per_rank=2)
    choice = _choose(n_microbatches="auto", schedule="auto", options=given)
    assert {e.virtual for e in choice.weighed} == {2}  # type: ignore[attr-defined]


def test_a_count_no_schedule_can_run_is_refused() -> None:
    with pytest.raises(ConfigError, match="n_microbatches=7"):
        _choose(n_microbatches=7, schedule="auto")  # 7 does not divide the batch


def test_two_ranks_run_the_choice_and_match_eager(tmp_path: Path) -> None:
    runs = launch(train, 2, tmp_path, name="unet", schedule="auto", n_mb="auto")
    per_rank = results(runs)
    ran = {r["ran"] for r in per_rank}
    assert len(ran) == 1  # every rank chose alike
    expected = _choose(n_microbatches="auto", schedule="auto")
    schedule, n, spr = ran.pop()
    assert (schedule, n, spr) == (expected.schedule, expected.n_microbatches,  # type: ignore[attr-defined]
                                  expected.stages_per_rank)  # type: ignore[attr-defined]  # fmt: skip
    check_against_eager("unet", per_rank)


@pytest.mark.slow
def test_an_auto_schedule_keeps_the_stages_per_rank_given(tmp_path: Path) -> None:
    runs = launch(train, 2, tmp_path, name="unet", schedule="auto", n_mb="auto", spr=2)
    per_rank = results(runs)
    ((schedule, _, spr),) = {r["ran"] for r in per_rank}
    assert spr == 2 and schedule not in ("gpipe", "1f1b")
    check_against_eager("unet", per_rank)
