"""fxpipe.distributed's options: every bad value refused on every rank, naming it and the
remedy, before any communication."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

import fxpipe.distributed as fd
from fxpipe.errors import ConfigError, FxPipeError
from tests.distributed.ranks import N_MB, launch, preload, problem, results

preload(__name__)


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
