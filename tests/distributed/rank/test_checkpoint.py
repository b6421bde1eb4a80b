"""fxpipe.distributed.rank.checkpoint: one torch.distributed.checkpoint for a whole job, saved at
one layout and read back at another, and by the unpipelined model."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from helpers import sweep
from models import ResidualMLP

import fxpipe.distributed as fd
from fxpipe.errors import CheckpointError
from tests.distributed.ranks import (
    BATCH,
    N_MB,
    close,
    launch,
    preload,
    problem,
    results,
    step,
    tiny_gpt,
    whole,
)

preload(__name__)


def _lm_mean(out: Any, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.flatten(0, 1), target.flatten())


def _optimizer(parameters: Any) -> torch.optim.Optimizer:
    """SGD with momentum: state to restore (Adam would amplify rounding on near-zero
    gradients, such as the rows of tokens the batch does not use, far above it)."""
    return torch.optim.SGD(parameters, lr=0.05, momentum=0.9)


def _train_steps(
    pipe: fd.DistributedPipeline, optimizer: Any, args: Any, target: Any, steps: int
) -> list[float]:
    """``steps`` training steps; each one's mean micro-batch loss on the last stage."""
    out = []
    for _ in range(steps):
        optimizer.zero_grad()
        losses = step(pipe, args, {}, target)
        pipe.sync_tied_gradients()
        optimizer.step()
        out.append(float(torch.stack(losses).mean()) if losses else float("nan"))
    return out


def _eager_steps(
    args: Any, target: torch.Tensor, steps: int = 3
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The oracle of a resumed run: the tied-embedding transformer trained eagerly, the
    same optimizer and loss, for ``steps`` steps; each step's loss, and the state after the
    first (what a checkpoint saved then holds)."""
    eager = tiny_gpt()
    optimizer = _optimizer(eager.parameters())
    losses: list[float] = []
    after_first: dict[str, torch.Tensor] = {}
    for _ in range(steps):
        optimizer.zero_grad()
        loss = _lm_mean(eager(*args), target)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        after_first = after_first or {k: v.clone() for k, v in eager.state_dict().items()}
    return losses, after_first


def _resume(
    rank: int, world: int, *, folder: str, other: str, data_parallel: str, schedule: str
) -> dict[str, Any]:
    """The tied-embedding transformer, SGD with momentum, a mean loss over a global batch of
    2 x BATCH: one step at 2 pipeline ranks x 2 replicas (``schedule``; ``data_parallel``
    over them; under ZBV, 4 stages, the tied weight left whole by FSDP on rank 0), saved
    with torch.distributed.checkpoint; then loaded at 4 stages x 1 replica (1F1B), which
    takes two more steps."""
    from torch.distributed.device_mesh import init_device_mesh

    _, args, _, _, target = problem("transformer", 2 * BATCH)
    saved: dict[str, Any] = {}
    for layout, (pp, dp) in (("save", (2, 2)), ("load", (4, 1))):
        mesh = init_device_mesh("cpu", (pp, dp), mesh_dim_names=("pp", "dp"))
        replica = mesh.get_local_rank("dp")
        mine = (args[0].chunk(dp)[replica],), target.chunk(dp)[replica]
        kind = schedule if layout == "save" else "1f1b"
        pipe = fd.pipeline_schedule(
            tiny_gpt(), mine[0], n_microbatches=N_MB, loss_fn=_lm_mean, scale_grads=True,
            mesh=mesh, schedule=kind, data_parallel=data_parallel,
            stages_per_rank=2 if kind == "zbvzerobubble" else 1,
        )  # fmt: skip
        optimizer = _optimizer(pipe.parameters())
        if layout == "save":
            saved["losses"] = _train_steps(pipe, optimizer, mine[0], mine[1], 1)
            pipe.save_checkpoint(folder, optimizer)
            shard = {k: whole(v) for k, v in pipe.state_dict().items()}  # every replica
            if replica == 0:
                saved["shard"] = shard
        else:
            saved["refused"] = []
            for wrong in (other, folder + "-missing"):  # each rank alone, nothing sent
                try:
                    pipe.load_checkpoint(wrong, optimizer)
                except CheckpointError as e:
                    saved["refused"].append(str(e))
            pipe.load_checkpoint(folder, optimizer)
            saved["loaded"] = {k: v.clone() for k, v in pipe.state_dict().items()}
            saved["resumed"] = _train_steps(pipe, optimizer, mine[0], mine[1], 2)
    return saved


@pytest.mark.parametrize(
    "data_parallel, schedule",
    sweep([("fsdp", "1f1b"), ("ddp", "1f1b"), ("fsdp", "zbvzerobubble")]),
)
def test_a_checkpoint_saved_at_two_by_two_resumes_at_four_by_one_and_in_eager(
    tmp_path: Path, data_parallel: str, schedule: str
) -> None:
    """torch.distributed.checkpoint writes one checkpoint for a 2 x 2 job (DDP: each replica
    holds every tensor; FSDP: each holds half of each, as DTensor shards, but the tied
    weight ZBV leaves whole on rank 0); a 4 x 1 job and the unpipelined model read it back
    with identical tensors, and training resumes with the losses of an uninterrupted eager
    run (the optimizer's momentum included)."""
    import torch.distributed.checkpoint as dcp

    folder, other = tmp_path / "checkpoint", tmp_path / "other"
    dcp.save({"model": ResidualMLP().state_dict()}, checkpoint_id=str(other))
    runs = launch(
        _resume, 4, tmp_path, folder=str(folder), other=str(other),
        data_parallel=data_parallel, schedule=schedule,
    )  # fmt: skip
    per_rank = results(runs)
    for r in per_rank:  # another model's checkpoint, and none at all: refused by each rank
        assert len(r["refused"]) == 2, r["refused"]
        assert "does not match stage(s)" in r["refused"][0] and "it lacks" in r["refused"][0]
        assert "not a torch.distributed.checkpoint folder" in r["refused"][1]
    _, args, _, _, target = problem("transformer", 2 * BATCH)
    losses, after_first = _eager_steps(args, target)
    replicas = [r["losses"][0] for r in per_rank if r["losses"][0] == r["losses"][0]]
    assert len(replicas) == 2  # each replica's mean loss: their mean is the global one
    assert sum(replicas) / 2 == pytest.approx(losses[0], rel=1e-5)
    saved = fd.merge_state_dicts(r["shard"] for r in per_rank if "shard" in r)
    loaded = fd.merge_state_dicts(r["loaded"] for r in per_rank)
    assert saved.keys() == loaded.keys() == tiny_gpt().state_dict().keys()
    for key, value in saved.items():
        assert torch.equal(loaded[key], value), key
        if value.is_floating_point():
            close(value, after_first[key], f"{key} after one step")
        else:
            assert torch.equal(value, after_first[key]), key
    resumed = [r["resumed"] for r in per_rank if r["resumed"][0] == r["resumed"][0]]
    assert len(resumed) == 1 and resumed[0] == pytest.approx(losses[1:], rel=1e-4)
    fresh = tiny_gpt()
    state = fresh.state_dict()
    dcp.load({"model": state}, checkpoint_id=str(folder))  # one process: the eager model
    for key, value in saved.items():
        assert torch.equal(state[key], value), key
