"""fxpipe.distributed.options: the record of pipeline_schedule's options, every bad value
refused by it, naming the value and the remedy, on every rank before any communication;
pipeline_schedule's keywords make the record."""

from __future__ import annotations

import dataclasses
import inspect
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import fxpipe.distributed as fd
from fxpipe.distributed import build
from fxpipe.distributed.options import SCHEDULES, ScheduleOptions, stage_ranks
from fxpipe.errors import ConfigError, FxPipeError
from fxpipe.options import PlanOptions
from tests.distributed.ranks import N_MB, launch, preload, problem, results

preload(__name__)

#: Bad options of the record, each with what its error names (a regular expression).
BAD: dict[str, tuple[dict[str, Any], str]] = {
    "schedule unknown": ({"schedule": "zigzag"}, r"schedule='zigzag' is not one of .*'GPipe'"),
    "schedule None": ({"schedule": None}, r"schedule=None is not one of"),
    "no micro-batch": ({"n_microbatches": 0}, r"n_microbatches=0 must be a whole number >= 1"),
    "micro-batches float": ({"n_microbatches": 4.0}, r"n_microbatches=4\.0 must be a whole"),
    "micro-batches bool": ({"n_microbatches": True}, r"n_microbatches=True must be a whole"),
    "no stage per rank": ({"stages_per_rank": 0}, r"stages_per_rank=0 must be a whole number"),
    "1f1b two per rank": (
        {"schedule": "1F1B", "stages_per_rank": 2},
        r"schedule='1F1B' runs one stage per rank but stages_per_rank=2; pass stages_per_rank=1",
    ),
    "interleaved one per rank": (
        {"schedule": "interleaved1f1b"},
        r"interleaves several stages per rank but stages_per_rank=1; pass stages_per_rank=2",
    ),
    "V of three": (
        {"schedule": "zbvzerobubble", "stages_per_rank": 3},
        r"schedule='zbvzerobubble' places two stages per rank in a V; pass stages_per_rank=2",
    ),
    "scale_grads not bool": ({"scale_grads": "yes"}, r"scale_grads='yes' must be True or False"),
    "data_parallel unknown": (
        {"data_parallel": "zero3"},
        r"data_parallel='zero3' is not one of \('ddp', 'fsdp'\); pass 'ddp'",
    ),
    "data_parallel upper case": ({"data_parallel": "DDP"}, r"data_parallel='DDP' is not one"),
    "cost unknown": ({"cost": "FLOPS"}, r"cost='FLOPS' is not one of"),
    "cost None": ({"cost": None}, r"cost=None is not one of .* or a callable"),
    "tracer unknown": ({"tracer": "jit"}, r"tracer='jit' is not one of"),
    "slack negative": ({"slack": -0.1}, r"slack=-0\.1 must be a number >= 0"),
    "slack infinite": ({"slack": float("inf")}, r"slack=inf must be a number"),
    "slack bool": ({"slack": True}, r"slack=True must be a number"),
    "no stage": ({"num_stages": 0}, r"num_stages=0 must be a whole number >= 1 \(or None"),
    "stages as text": ({"num_stages": "4"}, r"num_stages='4' must be a whole number"),
    "compile unknown": ({"compile": "yes"}, r"compile='yes' must be True, False or a dict"),
    "compile zero bubble": (
        {"compile": True, "schedule": "zbvzerobubble", "stages_per_rank": 2},
        r"compile= with schedule='zbvzerobubble': a zero-bubble schedule splits",
    ),
    "compile fsdp": (
        {"compile": True, "data_parallel": "fsdp"},
        r"compile= with data_parallel='fsdp' is not supported",
    ),
}


@pytest.mark.parametrize("case", list(BAD), ids=list(BAD))
def test_every_bad_option_is_refused_by_the_record_naming_it(case: str) -> None:
    options, message = BAD[case]
    with pytest.raises(ConfigError, match=message) as info:
        ScheduleOptions(**{"n_microbatches": N_MB, **options})
    assert isinstance(info.value, ValueError)  # a user mistake: also a ValueError


@pytest.mark.parametrize(
    ("options", "world", "mesh", "message"),
    [
        ({"num_stages": 3}, 2, False, r"num_stages=3 but the group has 2 rank\(s\) x "),
        ({"num_stages": 3}, 2, True, r"num_stages=3 but the mesh's 'pp' dimension has 2"),
        ({"num_stages": 2, "schedule": "loopedbfs", "stages_per_rank": 2}, 2, False, "= 4"),
        ({"n_microbatches": 1, "schedule": "1f1b"}, 2, False, r"n_microbatches=1 < 2 stages"),
        (
            {"n_microbatches": 3, "schedule": "dualpipev", "stages_per_rank": 2},
            2,
            False,
            r"n_microbatches=3 < 4 stages; pass n_microbatches >= 4, or schedule='gpipe'",
        ),
        (
            {"n_microbatches": 5, "schedule": "interleaved1f1b", "stages_per_rank": 2},
            2,
            False,
            r"in 2 equal rounds .* n_microbatches=5 .* such as n_microbatches=4",
        ),
    ],
)
def test_what_depends_on_the_ranks_is_refused_by_stage_count(
    options: dict[str, Any], world: int, mesh: bool, message: str
) -> None:
    record = ScheduleOptions(**{"n_microbatches": N_MB, **options})
    with pytest.raises(ConfigError, match=message):
        record.stage_count(world, mesh=mesh)


def test_stage_count_is_the_ranks_times_the_stages_per_rank() -> None:
    assert ScheduleOptions(N_MB).stage_count(3) == 3
    assert ScheduleOptions(N_MB, "1f1b", num_stages=4).stage_count(4) == 4
    assert ScheduleOptions(N_MB, "zbvzerobubble", 2, num_stages=4).stage_count(2) == 4
    assert ScheduleOptions(1, "gpipe").stage_count(4) == 4  # GPipe runs any number
    assert ScheduleOptions(6, "interleaved1f1b", 2).stage_count(2) == 4  # 3 rounds of 2
    assert stage_ranks(2, 4, v_shaped=False) == (0, 1, 0, 1)
    assert stage_ranks(2, 4, v_shaped=True) == (0, 1, 1, 0)


def test_every_schedule_is_taken_in_any_case_and_kept_in_lower_case() -> None:
    per_rank = {"interleaved1f1b": 2, "loopedbfs": 2, "interleavedzerobubble": 2}
    per_rank |= {"zbvzerobubble": 2, "dualpipev": 2}
    for name in SCHEDULES:
        for spelled in (name, name.lower(), name.upper()):
            record = ScheduleOptions(N_MB, spelled, per_rank.get(name.lower(), 1))
            assert record.schedule == name.lower()
    assert ScheduleOptions(N_MB, "LoopedBFS").stages_per_rank == 1  # any number per rank


def test_the_record_is_frozen_and_has_pipeline_schedules_names_and_defaults() -> None:
    record = ScheduleOptions(N_MB)
    with pytest.raises(dataclasses.FrozenInstanceError):
        record.schedule = "1f1b"  # type: ignore[misc]
    signature = inspect.signature(fd.pipeline_schedule).parameters
    for field in dataclasses.fields(ScheduleOptions):
        assert field.name in signature, field.name
        assert signature[field.name].kind is inspect.Parameter.KEYWORD_ONLY
        default = field.default
        if default is dataclasses.MISSING:
            default = inspect.Parameter.empty
        assert signature[field.name].default == default, field.name
    assert record.keywords() == {
        f.name: getattr(record, f.name) for f in dataclasses.fields(record)
    }


def test_the_plan_options_relay_hold_tied_weights_on_each_rank_and_price_auto_as_flops() -> None:
    planned = ScheduleOptions(N_MB, cost="auto", tracer="fx", slack=0.1).plan_options()
    assert planned == PlanOptions(
        cost="flops", tracer="fx", chunks=N_MB, slack=0.1, traffic="relay",
        replicate_weights=True, reductions=False,
    )  # fmt: skip
    assert ScheduleOptions(N_MB, cost="time").plan_options().cost == "time"


def test_pipeline_schedule_passes_on_the_record_its_keywords_make(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A call with keywords and one with a record's keywords pass on equal records; a bad
    keyword is the record's error."""
    seen: list[ScheduleOptions] = []
    monkeypatch.setattr(build, "_check_initialised", lambda: None)
    monkeypatch.setattr(build, "_build", lambda model, example, options, *_: seen.append(options))
    model, x = nn.Linear(2, 2), torch.randn(8, 2)
    record = ScheduleOptions(
        8, "Interleaved1F1B", 2, num_stages=4, cost="params", tracer="fx", scale_grads=False,
        slack=0.1, data_parallel="fsdp",
    )  # fmt: skip
    fd.pipeline_schedule(model, x, loss_fn=None, **record.keywords())
    fd.pipeline_schedule(
        model, x, n_microbatches=8, loss_fn=None, schedule="Interleaved1F1B", stages_per_rank=2,
        num_stages=4, cost="params", tracer="fx", scale_grads=False, slack=0.1,
        data_parallel="fsdp",
    )  # fmt: skip
    fd.pipeline_schedule(model, x, n_microbatches=8, loss_fn=None)
    assert seen == [record, record, ScheduleOptions(8)]
    assert ScheduleOptions(**record.keywords()) == record
    for options, message in BAD.values():
        with pytest.raises(ConfigError, match=message):
            fd.pipeline_schedule(model, x, loss_fn=None, **{"n_microbatches": N_MB, **options})
    assert len(seen) == 3  # nothing bad went further


def _bad_inputs(rank: int, world: int) -> dict[str, Any]:
    """Bad options fail on each rank alone: rank 1 tries them only after rank 0 has
    finished, and rank 0 before rank 1 reaches its first collective (any communication in
    the failed calls would pair with the barrier or wait for a peer and time out)."""
    from torch.distributed.device_mesh import init_device_mesh

    build, args, _, loss_fn, _ = problem("mlp_residual")
    model = build()
    flat = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))  # made by all ranks
    mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("pp", "dp"))
    attempts: dict[str, dict[str, Any]] = {
        "schedule": {"schedule": "zigzag"},
        "num_stages": {"num_stages": world + 1},
        "interleaved": {"schedule": "interleaved1f1b"},
        "per_rank": {"schedule": "1f1b", "stages_per_rank": 2},
        "batch": {"n_microbatches": 3},
        "mesh_dims": {"mesh": flat},
        "mesh_type": {"mesh": [[0], [1]]},
        "data_parallel": {"mesh": mesh, "data_parallel": "zero3"},
        "mesh_and_group": {"mesh": mesh, "group": dist.group.WORLD},
        "mesh_stages": {"mesh": mesh, "num_stages": 3},
        "mesh_schedule": {"mesh": mesh, "schedule": "zbvzerobubble", "stages_per_rank": 2},
        "one_per_stage": {"schedule": "1f1b", "n_microbatches": 1},
        "rounds": {"schedule": "interleaved1f1b", "stages_per_rank": 2, "n_microbatches": 5},
    }
    if rank == 1:
        dist.barrier()
    errors: dict[str, Any] = {}
    for what, options in attempts.items():
        options.setdefault("n_microbatches", N_MB)
        try:
            fd.pipeline_schedule(model, args, loss_fn=loss_fn, **options)
            errors[what] = None
        except FxPipeError as e:
            errors[what] = (isinstance(e, ValueError), str(e))
    if rank == 0:
        dist.barrier()
    errors["untouched"] = all(not p.is_meta for p in model.parameters())
    return errors


@pytest.mark.slow
def test_bad_options_fail_on_every_rank_before_communication(tmp_path: Path) -> None:
    for errors in results(launch(_bad_inputs, 2, tmp_path, pg_timeout=20)):
        assert errors.pop("untouched")
        assert all(e is not None and e[0] for e in errors.values()), errors
        assert "'zigzag'" in errors["schedule"][1] and "Interleaved1F1B" in errors["schedule"][1]
        assert "num_stages=3" in errors["num_stages"][1]
        assert "stages_per_rank=1" in errors["interleaved"][1]
        assert "stages_per_rank=2" in errors["per_rank"][1]
        assert "n_microbatches=3" in errors["batch"][1]
        assert "('pp', 'dp')" in errors["mesh_dims"][1] and "('dp',)" in errors["mesh_dims"][1]
        assert "not a torch DeviceMesh" in errors["mesh_type"][1]
        assert "data_parallel='zero3'" in errors["data_parallel"][1]
        assert "pass mesh alone" in errors["mesh_and_group"][1]
        assert "num_stages=3" in errors["mesh_stages"][1]
        assert "'pp'" in errors["mesh_stages"][1]
        assert "splits backward" in errors["mesh_schedule"][1]
        assert "data_parallel='fsdp'" in errors["mesh_schedule"][1]
        assert "n_microbatches=1 < 2 stages" in errors["one_per_stage"][1]
        assert "n_microbatches=4" in errors["rounds"][1] and "=5" in errors["rounds"][1]


def test_without_a_process_group_names_the_remedy() -> None:
    assert not dist.is_initialized()
    build, args, _, loss_fn, _ = problem("mlp_residual")
    with pytest.raises(ConfigError, match=r"init_process_group"):
        fd.pipeline_schedule(build(), args, n_microbatches=N_MB, loss_fn=loss_fn)
