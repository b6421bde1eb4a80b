"""fxpipe.distributed.rank.runner: a rank whose stage fails stops every rank of the job, with a
mesh too, within the time limit."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from helpers import sweep

import fxpipe.distributed as fd
from tests.distributed.ranks import (
    BATCH,
    N_MB,
    TIME_LIMIT,
    launch,
    preload,
    problem,
    step,
)

preload(__name__)


def _fail(
    rank: int, world: int, *, bad_rank: int, dp: int = 1, data_parallel: str = "ddp"
) -> dict[str, Any]:
    """Rank ``bad_rank``'s stage raises in its forward on the second step (with ``dp``: in
    one replica of a (world / dp) x dp mesh, whose other replica waits on it in DDP or
    FSDP)."""
    build, args, kwargs, loss_fn, target = problem("mlp_residual", dp * BATCH)
    mesh = None
    if dp > 1:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (world // dp, dp), mesh_dim_names=("pp", "dp"))
        replica = mesh.get_local_rank("dp")
        args, target = (args[0].chunk(dp)[replica],), target.chunk(dp)[replica]
    pipe = fd.pipeline_schedule(
        build(), args, n_microbatches=N_MB, loss_fn=loss_fn, mesh=mesh, data_parallel=data_parallel
    )
    calls = []

    def boom(*_: Any) -> None:
        calls.append(1)
        if len(calls) > N_MB:
            raise RuntimeError(f"injected failure on rank {rank}")

    if rank == bad_rank:
        pipe.stage_modules[0].register_forward_pre_hook(boom)
    for _ in range(3):
        step(pipe, args, kwargs, target)
    return {}


@pytest.mark.slow
@pytest.mark.parametrize(
    "world, dp, data_parallel", sweep([(3, 1, "ddp"), (4, 2, "ddp"), (4, 2, "fsdp")])
)
def test_failing_rank_stops_every_rank(
    tmp_path: Path, world: int, dp: int, data_parallel: str
) -> None:
    start = time.monotonic()
    runs = launch(
        _fail, world, tmp_path, bad_rank=1, pg_timeout=15, dp=dp, data_parallel=data_parallel
    )
    assert time.monotonic() - start < TIME_LIMIT
    assert all(code != 0 for code, _ in runs), [code for code, _ in runs]
    assert all(res is not None and "error" in res for _, res in runs)
    assert "injected failure on rank 1" in runs[1][1]["traceback"]
