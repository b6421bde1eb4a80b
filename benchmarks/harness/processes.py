"""Processes the benchmarks start: a benchmark module in a fresh interpreter, ports, env,
and a job on the ranks of a gloo process group."""

from __future__ import annotations

import datetime
import json
import os
import socket
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from benchmarks.harness.output import ROOT

__all__ = [
    "SINGLE_THREAD_ENV", "free_port", "module_command", "run_json", "on_ranks", "gather_ranks",
]  # fmt: skip

#: A child that computes on one thread and never reaches the network.
SINGLE_THREAD_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
                     "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}  # fmt: skip


def free_port() -> int:
    """A TCP port on 127.0.0.1 free now, for a process group's rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def module_command(module: str, *args: str) -> list[str]:
    """The command that runs ``module`` (``benchmarks.NAME``) in this interpreter."""
    return [sys.executable, "-m", module, *args]


def run_json(
    module: str, args: list[str], env: dict[str, str] | None = None, timeout: float = 600
) -> Any:
    """Run ``module`` with ``args`` in a fresh process from the repository root; the JSON
    it prints on its last line of output."""
    done = subprocess.run(
        module_command(module, *args),
        cwd=ROOT,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if done.returncode != 0:
        raise RuntimeError(f"{module} {' '.join(args)} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def on_ranks(job: Callable[..., Any], world: int, *args: Any, timeout_s: float = 300) -> Any:
    """``job(rank, world, *args)`` in ``world`` fresh processes (spawned), each on one torch
    thread in a gloo process group on loopback (``timeout_s``: its collectives' limit);
    what rank 0's call returned (through JSON). A rank that raises stops them all
    (``torch.multiprocessing.ProcessRaisedException``, ``ProcessExitedException``)."""
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rank0.json")
        mp.start_processes(
            _rank_entry,
            args=(world, port, timeout_s, out, job, args),
            nprocs=world,
            start_method="spawn",
        )
        return json.loads(Path(out).read_text())


def gather_ranks(target: Callable[..., None], spec: Any, world: int = 2) -> list[Any]:
    """``target(rank, port, spec, results)`` in ``world`` spawned processes, each putting one
    dict with its ``"rank"`` (and an ``"error"`` traceback where it failed) on the
    ``results`` queue; every rank's dict, in the order they came. RuntimeError with the
    failed ranks' tracebacks."""
    ctx = mp.get_context("spawn")
    port = free_port()
    results = ctx.SimpleQueue()
    procs = [ctx.Process(target=target, args=(r, port, spec, results)) for r in range(world)]
    for p in procs:
        p.start()
    found = [results.get() for _ in procs]
    for p in procs:
        p.join()
    errors = [f"rank {f['rank']}:\n{f['error']}" for f in found if "error" in f]
    if errors:
        raise RuntimeError("\n".join(errors))
    return found


def _rank_entry(
    rank: int,
    world: int,
    port: int,
    timeout_s: float,
    out: str,
    job: Callable[..., Any],
    args: tuple[Any, ...],
) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    result = job(rank, world, *args)
    if rank == 0:
        Path(out).write_text(json.dumps(result))
    dist.destroy_process_group()
