"""One launch of the mesh sweep: 4 gloo ranks from a fork server, each building its part of
the pipeline, running one step and one SGD update, and saving what it got."""

from __future__ import annotations

import datetime
import os
import time
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import fxpipe.distributed as fd
from benchmarks.harness.failures import scrub
from benchmarks.harness.oracle import split_rows
from benchmarks.harness.prepare import fresh
from benchmarks.harness.processes import free_port
from benchmarks.harness.rows import Row
from benchmarks.mesh_sweep.batch import (
    DP,
    LR,
    PP,
    WORLD,
    Config,
    batch_size,
    prepared,
    projection_loss,
)
from fxpipe.errors import FxPipeError

__all__ = ["CONTEXT", "rank_job", "rank_entry", "launch"]

PG_TIMEOUT_S = 60


def _whole(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor: a DTensor's shards gathered over "dp" (a collective)."""
    full = getattr(t, "full_tensor", None)
    return (full() if callable(full) else t).detach().clone()


def rank_job(name: str, config: Config) -> Row:
    """Build this rank's part of the pipeline, run one step and one SGD update."""
    from torch.distributed.device_mesh import init_device_mesh

    model, args, kwargs = prepared(name, config.n_microbatches)
    mesh = init_device_mesh("cpu", (PP, DP), mesh_dim_names=("pp", "dp"))
    replica = mesh.get_local_rank("dp")
    index = torch.arange(batch_size(args, kwargs))
    args, kwargs, index = split_rows((args, kwargs, index), DP)[replica]
    pipe = fd.pipeline_schedule(
        model,
        fresh(args),
        example_kwargs=fresh(kwargs),
        n_microbatches=config.n_microbatches,
        loss_fn=projection_loss,
        scale_grads=False,  # sum-reduced: the gradients are eager's on the replica's rows
        schedule=config.schedule,
        stages_per_rank=config.stages_per_rank,
        mesh=mesh,
        data_parallel=config.data_parallel,
    )
    losses: list[torch.Tensor] = []
    inputs = (args, kwargs) if pipe.is_first else ((), {})
    pipe.step(*inputs[0], target=index if pipe.is_last else None, losses=losses, **inputs[1])
    pipe.sync_tied_gradients()
    own = pipe.named_parameters()
    grads = {k: _whole(p.grad) for k, p in own if p.grad is not None}
    torch.optim.SGD(pipe.parameters(), lr=LR).step()
    state = {k: _whole(v) for k, v in pipe.state_dict().items()}
    return {
        "replica": replica,
        "stages": pipe.stage_indices,
        "loss": float(sum(float(x.detach()) for x in losses)) if losses else None,
        "grads": grads,
        "params": {k for k, _ in own},
        "state": state,
    }


def rank_entry(rank: int, port: int, out: str, name: str, config: Config) -> None:
    """A rank's process: the job's result, or its error, saved to ``out``/rank<r>.pt."""
    torch.set_num_threads(1)
    path = Path(out) / f"rank{rank}.pt"
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=WORLD,
        timeout=datetime.timedelta(seconds=PG_TIMEOUT_S),
    )
    try:
        result: Row = {"ok": rank_job(name, config)}
    except FxPipeError as e:  # raised on every rank before anything is sent
        result = {"refused": f"{type(e).__name__}: {e}"}
    except BaseException as e:
        text = scrub(f"{type(e).__name__}: {e}")
        torch.save({"error": text, "traceback": scrub(traceback.format_exc())}, path)
        os._exit(1)  # peers may be blocked in a collective: no orderly shutdown
    torch.save(result, path)
    os._exit(0)


CONTEXT = mp.get_context("forkserver")


def launch(name: str, config: Config, timeout: float, tmp: Path) -> tuple[list[Any], bool]:
    """Run the 4 ranks; (exit code, saved result) per rank, and whether it timed out. Once a
    rank has failed, the others get a few seconds to fail alike, then are killed."""
    port = free_port()
    procs = [
        CONTEXT.Process(target=rank_entry, args=(r, port, str(tmp), name, config), daemon=True)
        for r in range(WORLD)
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(p.is_alive() for p in procs):
        if any(p.exitcode not in (None, 0) for p in procs):
            deadline = min(deadline, time.monotonic() + 5)
        time.sleep(0.1)
    timed_out = any(p.is_alive() for p in procs)
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join()
    files = [tmp / f"rank{r}.pt" for r in range(WORLD)]
    runs = [
        (p.exitcode, torch.load(f, weights_only=False) if f.exists() else None)
        for p, f in zip(procs, files)
    ]
    return runs, timed_out
