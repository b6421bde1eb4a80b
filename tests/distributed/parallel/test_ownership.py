"""fxpipe.distributed.parallel.ownership: which of the model's tensors each rank keeps (a tied
weight on every rank that reads it), the others released, a model built on ``meta`` materialised
and loaded rank by rank, and the shards merged."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import sweep
from models import ZOO, ResidualMLP

import fxpipe.distributed as fd
from fxpipe.errors import ConfigError
from tests.distributed.ranks import (
    BATCH,
    N_MB,
    check_against_eager,
    close,
    eager,
    launch,
    preload,
    problem,
    results,
    step,
    train,
    whole,
)

preload(__name__)


def _meta_model(rank: int, world: int, *, dp: int = 1) -> dict[str, Any]:
    """A model built on ``meta``: planned, its stage materialised and loaded, trained. With
    ``dp > 1``: replicas over a (world / dp) x dp mesh with FSDP, each loading its shards
    from the full state dict and training on its slice of a batch of ``dp * BATCH``."""
    _, args, kwargs, loss_fn, target = problem("mlp_residual", dp * BATCH)
    with torch.device("meta"):
        model = ResidualMLP()
    mesh, replica = None, 0
    if dp > 1:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (world // dp, dp), mesh_dim_names=("pp", "dp"))
        replica = mesh.get_local_rank("dp")
        args, target = tuple(a.chunk(dp)[replica] for a in args), target.chunk(dp)[replica]
    pipe = fd.pipeline_schedule(
        model, args, n_microbatches=N_MB, loss_fn=loss_fn, schedule="1f1b", mesh=mesh,
        data_parallel="fsdp", scale_grads=False,
    )  # fmt: skip
    own = dict(pipe.named_parameters())
    placed = all(not p.is_meta for p in own.values())
    released = all(p.is_meta for k, p in model.named_parameters() if k not in own)
    full = ZOO["mlp_residual"].build().state_dict()
    try:
        pipe.load_stage_state_dict({})
        refused = ""
    except ConfigError as e:
        refused = str(e)
    try:  # every rank stops before sending: its stages hold uninitialised memory
        step(pipe, args, kwargs, target)
        unloaded = ""
    except ConfigError as e:
        unloaded = str(e)
    pipe.load_stage_state_dict(full)
    losses = step(pipe, args, kwargs, target)
    grads = {k: whole(p.grad) for k, p in own.items()}
    merged = pipe.gather_state_dict(dst=0)
    return {
        "placed": placed,
        "released": released,
        "refused": refused,
        "unloaded": unloaded,
        "grads": grads,
        "loss": float(sum(losses)) if losses else None,
        "merged": merged,
    }


@pytest.mark.slow
def test_a_tied_embedding_is_held_by_each_rank_using_it_and_summed_once(
    tmp_path: Path,
) -> None:
    """The embedding and the LM head share one weight: each of the two ranks holds its own
    copy (nothing sent with the micro-batches), and sync_tied_gradients sums the copies'
    gradients once per step into eager's."""
    per_rank = results(launch(train, 2, tmp_path, name="transformer", schedule="1f1b"))
    check_against_eager("transformer", per_rank)
    holders = [r for r in per_rank if "tok.weight" in r["grads"]]
    assert len(holders) == 2, "each rank reading the tied weight holds it"
    assert all({"tok.weight", "head.weight"} <= set(r["shard"]) for r in holders)
    assert all(r["replicated"] == ("tok.weight",) for r in per_rank)
    assert all(r["sent_attrs"] == [] for r in per_rank)  # no weight crosses a border


@pytest.mark.slow
def test_module_called_in_two_stages_is_held_by_both_ranks(tmp_path: Path) -> None:
    per_rank = results(launch(train, 2, tmp_path, name="shared_module", schedule="gpipe"))
    assert all(r["stages_using_shared"] == {0, 1} for r in per_rank)
    assert all("shared.fc1.weight" in r["replicated"] for r in per_rank)
    holders = [r for r in per_rank if "shared.fc1.weight" in r["grads"]]
    assert len(holders) == 2
    check_against_eager("shared_module", per_rank)


@pytest.mark.slow
@pytest.mark.parametrize("dp", sweep([1, 2]))
def test_meta_model_materialises_and_loads_its_stage(tmp_path: Path, dp: int) -> None:
    """On one pipeline, and (dp=2) on two FSDP replicas, each rank loading its shards."""
    per_rank = results(launch(_meta_model, 2 * dp, tmp_path, dp=dp))
    model, loss = eager("mlp_residual", dp * BATCH)
    assert all(r["placed"] and r["released"] for r in per_rank)
    assert all("lacks" in r["refused"] for r in per_rank)
    assert all("never loaded" in r["unloaded"] for r in per_rank)
    rank_losses = [r["loss"] for r in per_rank if r["loss"] is not None]
    assert len(rank_losses) == dp and sum(rank_losses) == pytest.approx(loss, rel=1e-5)
    expected = dict(model.named_parameters())
    for r in per_rank:
        for key, grad in r["grads"].items():
            close(grad, expected[key].grad / dp, key)
    fresh = ZOO["mlp_residual"].build().state_dict()
    for r in per_rank:  # pipeline rank 0 of each replica (global ranks 0 .. dp - 1) merges
        merged = r["merged"]
        if r is per_rank[0] or (dp > 1 and r is per_rank[1]):
            ZOO["mlp_residual"].build().load_state_dict(merged, strict=True)
            for key, value in fresh.items():
                assert torch.equal(merged[key], value), key
        else:
            assert merged is None
