"""Processes the benchmarks start: a benchmark module in a fresh interpreter, ports, env."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from typing import Any

from benchmarks.harness.output import ROOT

__all__ = ["SINGLE_THREAD_ENV", "free_port", "module_command", "run_json"]

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
