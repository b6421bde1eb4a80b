"""Soak test: many consecutive training steps through one pipeline, watching for leaks.

Run from the repository root::

    python -m benchmarks.soak [--steps 1000] [--every 50] [--out PATH]

A residual MLP on K=4 CPU stages, chunks=4, checkpoint="except_last", AdamW; every step is
forward, backward, optimizer step and ``zero_grad``. After every step the script reads the
Python thread count (``threading.active_count()``), the process's OS thread count and its
resident set size (``/proc/self``); every ``--every`` steps it prints a row with the step
time. The drift of each is the mean over the last 100 steps minus the mean over the first
100. A leak of one worker thread per step, or of one activation per step, shows as a
drift that grows with ``--steps``; a flat thread count and an RSS drift of a few MiB (the
allocator settling) are the expected result.

The table and every sample go to ``benchmarks/results/soak.json``.
"""

from __future__ import annotations

import argparse
import os
import platform
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

import fxpipe
from benchmarks.harness.memory import os_threads, rss_bytes
from benchmarks.harness.output import command_line, result_path, save_json

RESULTS = result_path("soak")
WINDOW = 100


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, 2 * width)
        self.fc2 = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class SoakNet(nn.Module):
    """Input projection, residual blocks and a head, with a skip from the stem to the head."""

    def __init__(self, width: int = 64, depth: int = 8) -> None:
        super().__init__()
        self.inp = nn.Linear(32, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h0 = self.inp(x)
        h = h0
        for block in self.blocks:
            h = block(h)
        return self.head(h + h0)


def soak(steps: int, every: int, stages: int, chunks: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = SoakNet()
    x0 = torch.randn(32, 32)
    pipe = fxpipe.pipeline(model, x0, ["cpu"] * stages, chunks=chunks, cost="flops")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    baseline = threading.active_count()
    # Preallocated, so that recording a sample allocates nothing the RSS would show.
    columns = ("threads", "os_threads", "rss_mib", "loss")
    data = np.zeros((steps, len(columns)))
    rows: list[dict[str, float]] = []
    started = last = time.perf_counter()
    for step in range(steps):
        x = torch.randn(32, 32)
        y = torch.randint(0, 10, (32,))
        loss = F.cross_entropy(pipe(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        data[step] = (
            threading.active_count(),
            os_threads(),
            rss_bytes() / 2**20,
            loss.item(),
        )
        if (step + 1) % every == 0:
            now = time.perf_counter()
            row = {"step": step + 1, **dict(zip(columns, data[step].tolist()))}
            rows.append({**row, "ms_per_step": 1e3 * (now - last) / every})
            last = now
            _print_row(rows[-1])
    first, final = data[:WINDOW], data[-WINDOW:]
    return {
        "settings": {
            "steps": steps,
            "every": every,
            "stages": stages,
            "chunks": chunks,
            "checkpoint": pipe.checkpoint,
            "parameters": sum(p.numel() for p in model.parameters()),
            "command": command_line(),
            "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(),
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
        },
        "baseline_threads": baseline,
        "seconds": time.perf_counter() - started,
        "drift": {
            key: float(final[:, k].mean() - first[:, k].mean())
            for k, key in enumerate(columns[:3])
        },
        "range": {
            key: [float(data[:, k].min()), float(data[:, k].max())]
            for k, key in enumerate(columns[:3])
        },
        "rows": rows,
        "samples": {key: data[:, k].tolist() for k, key in enumerate(columns)},
    }


def _print_row(row: dict[str, float]) -> None:
    print(
        f"{int(row['step']):>6}  {int(row['threads']):>7}  {int(row['os_threads']):>10}  "
        f"{row['rss_mib']:>8.1f}  {row['ms_per_step']:>8.2f}  {row['loss']:>7.4f}",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--every", type=int, default=50)
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--chunks", type=int, default=4)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    if args.steps < 2 * WINDOW:
        parser.error(f"--steps must be at least {2 * WINDOW} (two windows of {WINDOW} steps)")
    torch.set_num_threads(1)
    print(f"{'step':>6}  {'threads':>7}  {'os threads':>10}  {'RSS MiB':>8}  {'ms/step':>8}  loss")
    result = soak(args.steps, args.every, args.stages, args.chunks)
    drift, span = result["drift"], result["range"]
    print()
    print(f"drift, mean of the last {WINDOW} steps minus the first {WINDOW}:")
    for key, unit in (("threads", ""), ("os_threads", ""), ("rss_mib", " MiB")):
        low, high = span[key]
        print(f"  {key:<10} {drift[key]:+9.2f}{unit}   (range over the run: {low:g} .. {high:g})")
    print(f"{result['settings']['steps']} steps in {result['seconds']:.1f} s")
    save_json(args.out, result, indent=1)


if __name__ == "__main__":
    main()
