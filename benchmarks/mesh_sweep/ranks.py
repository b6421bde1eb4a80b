"""One launch of the mesh sweep: a configuration's gloo ranks from a fork server, each
building its part of the pipeline, running each step with an SGD update after it, and saving
what it got."""

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
from benchmarks.harness.models.hf_text import HfBuild
from benchmarks.harness.models.spec import Spec
from benchmarks.harness.prepare import fresh
from benchmarks.harness.processes import free_port
from benchmarks.harness.rows import Row
from benchmarks.mesh_sweep.batch import LR, prepared, projection_loss, replica_part
from benchmarks.mesh_sweep.configs import Config
from fxpipe.distributed.parallel.dtensors import full_tensor
from fxpipe.errors import FxPipeError

__all__ = ["CONTEXT", "PG_TIMEOUT_S", "preload", "rank_job", "rank_entry", "launch"]

PG_TIMEOUT_S = 60


def _whole(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor: a DTensor's parts gathered (a collective over its mesh; FSDP's shards
    of a weight cut over "tp" as fxpipe gathers them)."""
    return full_tensor(t).detach().clone()


def _mesh(config: Config) -> tuple[Any, int, int]:
    """The device mesh (None for the pipeline's ranks alone), this rank's replica and its
    "tp" coordinate."""
    from torch.distributed.device_mesh import init_device_mesh

    if len(config.shape) == 1:
        return None, 0, 0
    names = ("pp", "dp", "tp")[: len(config.shape)]
    mesh = init_device_mesh("cpu", config.shape, mesh_dim_names=names)
    return mesh, mesh.get_local_rank("dp"), mesh.get_local_rank("tp") if config.tp > 1 else 0


def _step(pipe: Any, part: list[Any], optimizer: torch.optim.Optimizer) -> Row:
    """One step on this replica's ``part`` and one SGD update: the loss (the last stage's),
    the whole gradients and the state after the update."""
    args, kwargs, index = part
    losses: list[torch.Tensor] = []
    inputs = (args, kwargs) if pipe.is_first else ((), {})
    pipe.step(*inputs[0], target=index if pipe.is_last else None, losses=losses, **inputs[1])
    pipe.sync_tied_gradients()
    grads = {k: _whole(p.grad) for k, p in pipe.named_parameters() if p.grad is not None}
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return {
        "loss": float(sum(float(x.detach()) for x in losses)) if losses else None,
        "grads": grads,
        "state": {k: _whole(v) for k, v in pipe.state_dict().items()},
    }


def _share(pipe: Any) -> float | None:
    """The least share of a block's matrix-product parameters cut on this rank (tp only)."""
    plan = pipe.tensor_plan
    if plan is None:
        return None
    fractions = plan.block_fractions({k for k, _ in pipe.named_parameters()})
    return min(fractions.values(), default=None)


def rank_job(name: str, config: Config, dtype: torch.dtype, phase: list[str]) -> Row:
    """Build this rank's part of the pipeline, then each step with an SGD update; a step
    refused (another length: FxPipeError, on every rank before anything is sent) ends them.
    ``phase`` holds what is under way, for an error's report."""
    got = prepared(name, config, dtype)
    mesh, replica, tp = _mesh(config)
    parts = [replica_part(a, k, config.dp, replica) for a, k in got.batches]
    phase.append("build")
    pipe = fd.pipeline_schedule(
        got.model,
        fresh(parts[0][0]),
        example_kwargs=fresh(parts[0][1]),
        n_microbatches=config.n_microbatches,
        loss_fn=projection_loss,
        scale_grads=False,  # sum-reduced: the gradients are eager's on the replica's rows
        schedule=config.schedule,
        stages_per_rank=config.stages_per_rank,
        mesh=mesh,
        data_parallel=config.data_parallel,
        tensor_parallel="auto" if config.tp > 1 else None,
    )
    optimizer = torch.optim.SGD(pipe.parameters(), lr=LR)
    steps: list[Row] = []
    for s, (part, length) in enumerate(zip(parts, got.lengths), 1):
        phase.append(f"step {s}" + (f" ({length} tokens)" if length else ""))
        try:
            steps.append(_step(pipe, part, optimizer))
        except FxPipeError as e:
            if s == 1:
                raise
            steps.append({"refused": f"{type(e).__name__}: {e}"})
            break
    return {"replica": replica, "tp": tp, "stages": pipe.stage_indices,
            "params": sorted(k for k, _ in pipe.named_parameters()), "steps": steps,
            "share": _share(pipe)}  # fmt: skip


def rank_entry(
    rank: int, port: int, out: str, name: str, config: Config, dtype: torch.dtype, pg: float
) -> None:
    """A rank's process: the job's result, or its error, saved to ``out``/rank<r>.pt."""
    torch.set_num_threads(1)
    path = Path(out) / f"rank{rank}.pt"
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=config.world,
        timeout=datetime.timedelta(seconds=pg),
    )
    phase: list[str] = []
    try:
        result: Row = {"ok": rank_job(name, config, dtype, phase)}
    except FxPipeError as e:  # raised on every rank before anything is sent
        result = {"refused": f"{type(e).__name__}: {e}"}
    except BaseException as e:
        text = scrub(f"{type(e).__name__}: {e}")
        where = phase[-1] if phase else "prepare"
        torch.save({"error": text, "phase": where,
                    "traceback": scrub(traceback.format_exc())}, path)  # fmt: skip
        os._exit(1)  # peers may be blocked in a collective: no orderly shutdown
    torch.save(result, path)
    os._exit(0)


CONTEXT = mp.get_context("forkserver")


def preload(specs: list[Spec]) -> None:
    """What the fork server imports once for every rank: torch, fxpipe and the transformers
    modeling modules of ``specs`` (a rank would spend most of a pipeline-only launch on
    importing its own; one that is not found is skipped)."""
    from transformers.models.auto.configuration_auto import model_type_to_module_name

    types = {s.build.model_type for s in specs if isinstance(s.build, HfBuild)}
    modules = sorted(f"transformers.models.{m}.modeling_{m}"
                     for m in map(model_type_to_module_name, types))  # fmt: skip
    base = ["torch", "torch.distributed", "fxpipe.distributed", "benchmarks.mesh_sweep.ranks"]
    CONTEXT.set_forkserver_preload(base + modules)


def launch(
    name: str,
    config: Config,
    dtype: torch.dtype,
    timeout: float,
    tmp: Path,
    pg_timeout: float = PG_TIMEOUT_S,
) -> tuple[list[Any], bool]:
    """Run the configuration's ranks; (exit code, saved result) per rank, and whether it
    timed out. Once a rank has failed, the others get a few seconds to fail alike, then
    are killed."""
    port = free_port()
    procs = [
        CONTEXT.Process(target=rank_entry, daemon=True,
                        args=(r, port, str(tmp), name, config, dtype, pg_timeout))
        for r in range(config.world)
    ]  # fmt: skip
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
    files = [tmp / f"rank{r}.pt" for r in range(config.world)]
    runs = [
        (p.exitcode, torch.load(f, weights_only=False) if f.exists() else None)
        for p, f in zip(procs, files)
    ]
    return runs, timed_out
