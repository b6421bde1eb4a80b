"""``n_microbatches="auto"`` and ``schedule="auto"``: the schedule, the stages per rank and
the micro-batch count of ``fd.pipeline_schedule`` chosen by the model that ranks
``fd.suggest_layout``'s layouts, for the pipeline ranks it is given.

The layouts weighed are this pipeline's: ``pp`` ranks, one replica's batch (the replicas
of a mesh all run the same, and their gradient reduction costs every candidate alike), each
schedule the other options allow (``compile=`` and ``data_parallel=`` refuse some), the
looped ones with 2 or 4 stages per rank unless ``stages_per_rank`` says, and every
micro-batch count that divides the batch. They are priced by the roofline of the ranks'
kind of device (the same on every rank: every rank chooses alike), so a micro-batch costs
its kernels' fixed time and small ones are not free; the fastest predicted step wins.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from fxpipe.distributed.options import ScheduleOptions
from fxpipe.distributed.planning.estimate import LayoutEstimate
from fxpipe.distributed.planning.layout import LAYOUT_SCHEDULES, suggest_layout
from fxpipe.errors import ConfigError

__all__ = ["AUTO", "ScheduleChoice", "choose_schedule"]

AUTO = "auto"
#: Stages per rank tried for a looped schedule when ``stages_per_rank`` is left at 1.
LOOPS = (2, 4)


@dataclass(frozen=True)
class ScheduleChoice:
    """What was chosen, and the layouts it was chosen from (fastest first)."""

    schedule: str
    n_microbatches: int
    stages_per_rank: int
    weighed: tuple[LayoutEstimate, ...]

    def summary(self) -> str:
        """One line: the choice, its predicted step and the runner-up's."""
        best = self.weighed[0]
        text = (
            f"schedule={self.schedule!r}, n_microbatches={self.n_microbatches}, "
            f"stages_per_rank={self.stages_per_rank}: predicted {best.step_s * 1e3:.3g} ms "
            f"per step, of {len(self.weighed)} weighed"
        )
        if len(self.weighed) > 1:
            second = self.weighed[1]
            text += (
                f"; runner-up {second.schedule} v={second.virtual} m={second.chunks} "
                f"{second.step_s * 1e3:.3g} ms"
            )
        return text


def choose_schedule(
    model: nn.Module,
    example: tuple[tuple[Any, ...], Mapping[str, Any]],
    options: ScheduleOptions,
    *,
    pp: int,
    n_microbatches: int | str,
    schedule: str,
    device: torch.device,
) -> ScheduleChoice:
    """The fastest predicted (schedule, stages per rank, micro-batch count) for ``pp``
    pipeline ranks, fixing whichever of ``n_microbatches`` and ``schedule`` is not
    ``"auto"`` (``options`` holds the others, checked). ConfigError when none is left."""
    args, kwargs = example
    names = [s for s in LAYOUT_SCHEDULES if _allowed(options, s)]
    if schedule != AUTO:
        names = [schedule.lower()]
    loops = (options.stages_per_rank,) if options.stages_per_rank > 1 else LOOPS
    chunks = None if n_microbatches == AUTO else int(n_microbatches)
    pricing = "roofline" if device.type != "meta" else "flops"
    asked = f"n_microbatches={n_microbatches!r}, schedule={schedule!r}"
    try:
        layouts = suggest_layout(
            model, args, pp, example_kwargs=dict(kwargs), cost=pricing, tracer=options.tracer,
            schedules=names, virtual=loops, chunks=chunks, slack=options.slack,
            device="cuda" if device.type == "meta" else device,
        )  # fmt: skip
    except ConfigError as e:
        raise ConfigError(f"{asked}: no layout to choose from ({e})") from e
    mine = [e for e in layouts if e.pp == pp and e.dp == 1 and _fits_rank(options, e)]
    if options.stages_per_rank > 1:  # given: schedules of that many stages per rank only
        mine = [e for e in mine if e.virtual == options.stages_per_rank]
    if not mine:
        raise ConfigError(
            f"{asked}: no schedule and micro-batch count of {pp} pipeline ranks is left for "
            "this batch (a count must divide its rows); give both"
        )
    mine.sort(key=lambda e: (e.step_s, e.chunks, e.virtual))
    best = mine[0]
    return ScheduleChoice(best.schedule, best.chunks, best.virtual, tuple(mine))


def _allowed(options: ScheduleOptions, schedule: str) -> bool:
    """Whether ``options`` accept ``schedule`` (compile and FSDP refuse some)."""
    try:
        replace(options, schedule=schedule, stages_per_rank=_loop_of(schedule))
    except ConfigError:
        return False
    return True


def _loop_of(schedule: str) -> int:
    return 1 if schedule in ("gpipe", "1f1b") else 2


def _fits_rank(options: ScheduleOptions, e: LayoutEstimate) -> bool:
    """A layout ``fd.pipeline_schedule`` runs with these options: its stage count, when
    ``num_stages`` is given."""
    return options.num_stages is None or options.num_stages == e.pp * e.virtual
