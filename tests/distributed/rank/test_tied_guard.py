"""fxpipe.distributed.rank.tied_guard: an optimizer update of a tied copy without
``sync_tied_gradients`` before it is refused at the next step, on every rank holding one."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import sweep
from torch.utils._pytree import tree_map

import fxpipe.distributed as fd
from fxpipe.errors import ConfigError
from tests.distributed.ranks import BATCH, N_MB, launch, preload, problem, results, step

preload(__name__)


def _forgotten_sum(
    rank: int, world: int, *, dp: int = 1, schedule: str = "gpipe"
) -> dict[str, Any]:
    """The tied-embedding transformer, on a pipeline or (dp=2) a 2 x 2 FSDP mesh: gradient
    accumulation (two steps, one sum, one update), a load between steps, then an update
    without the sum, which the next step refuses on every rank holding a copy before
    anything is sent. Under ZBV rank 0 holds the embedding and the head, and FSDP leaves
    the weight whole on each replica: only rank 0 holds it (the other does not step)."""
    build, args, kwargs, loss_fn, target = problem("transformer", dp * BATCH)
    mesh = None
    if dp > 1:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (world // dp, dp), mesh_dim_names=("pp", "dp"))
        args, kwargs, target = tree_map(
            lambda t: t.chunk(dp)[mesh.get_local_rank("dp")], (args, kwargs, target)
        )
    pipe = fd.pipeline_schedule(
        build(), args, example_kwargs=kwargs, n_microbatches=N_MB, loss_fn=loss_fn,
        mesh=mesh, data_parallel="fsdp", schedule=schedule,
        stages_per_rank=2 if schedule == "zbvzerobubble" else 1,
    )  # fmt: skip
    optimizer = torch.optim.SGD(pipe.parameters(), lr=0.01)
    for _ in range(2):  # accumulation: two steps, then one sum and one update
        step(pipe, args, kwargs, target)
    pipe.sync_tied_gradients()
    optimizer.step()
    optimizer.zero_grad()
    step(pipe, args, kwargs, target)
    pipe.load_stage_state_dict(build().state_dict())  # the same values on every rank
    step(pipe, args, kwargs, target)
    optimizer.step()  # the sum forgotten
    if not set(pipe.replicated_keys) & {k for k, _ in pipe.named_parameters()}:
        return {"refused": None}  # holds no copy: its peers stop before sending to it
    try:
        step(pipe, args, kwargs, target)
        refused = ""
    except ConfigError as e:
        refused = str(e)
    return {"refused": refused}


@pytest.mark.slow
@pytest.mark.parametrize("dp, schedule", sweep([(1, "gpipe"), (2, "gpipe"), (2, "zbvzerobubble")]))
def test_an_update_without_summing_tied_gradients_is_refused_at_the_next_step(
    tmp_path: Path, dp: int, schedule: str
) -> None:
    """Forgetting sync_tied_gradients would leave each rank's copy of the tied embedding
    updated with its own share of the gradient (or, left whole by FSDP, each replica's
    with its own), the copies differing from then on."""
    runs = results(launch(_forgotten_sum, 2 * dp, tmp_path, dp=dp, schedule=schedule))
    holders = [r["refused"] for r in runs if r["refused"] is not None]
    assert len(holders) == (dp if schedule == "zbvzerobubble" else 2 * dp)
    for refused in holders:
        assert "['tok.weight']" in refused and "sync_tied_gradients()" in refused
