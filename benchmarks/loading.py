"""Host memory of loading a sharded checkpoint into a pipeline built on ``meta``.

Run from the repository root::

    python -m benchmarks.loading [--out PATH] [--tmp DIR] [--width N] [--depth N]

About 3 minutes on 2 cores; needs ~3 GB of free disk under ``--tmp`` (default: the system's
temporary directory; removed at the end) and ~3 GB of memory. CPU only.

The model is ``depth`` Linear layers of ``width`` x ``width`` (default 8 of 5632: 1.0 GB of
float32), built under ``with torch.device("meta"):`` and split by ``fxpipe.pipeline`` over
four CPU stages, which makes every stage's parameters on the CPU, uninitialised. Its
checkpoint is written once, as four shards of two layers each (254 MB) with a Hugging
Face-style ``*.index.json``: once as ``torch.save`` files, once as ``.safetensors`` files
(when the package is installed); and once more as a single ``torch.save`` file of the whole
model. Each way of loading then runs in a fresh process:

- ``fxpipe.load_checkpoint(pipe, directory)`` on the torch shards, on the safetensors shards,
  and on the single file (all memory-mapped: the single file is one "shard" of 1 GB);
- ``pipe.load_state_dict(sd)`` after ``sd`` = every shard read with a plain ``torch.load``
  (the usual way, for comparison).

What is measured, and why it is sound: the parameters made by ``fxpipe.pipeline`` are
uninitialised allocations the kernel has not backed with pages yet, so just before loading
the resident set size (``VmRSS``) holds the process without the model. The kernel's
resident high-water mark (``VmHWM`` in ``/proc/self/status``) is reset to the current size
just before loading by writing ``5`` to ``/proc/self/clear_refs`` (Linux 4.0+), so after
loading it is the exact peak during the load, however brief (no sampling can miss it).
Once the load returns, and every reference to what it read is dropped (a memory-mapped file
is unmapped then), the resident size is the process plus the loaded model; the peak above
*that* is the memory the loading itself needed: file pages mapped while a shard is copied,
temporary tensors, a whole state dict. It is reported in MiB and over the largest shard
(target: under 1.25x for the sharded loads). Two checks beside it: ``resident after -
before - model bytes`` (near 0: the model is resident once and nothing read stays behind),
and the peak seen by a thread that samples ``VmRSS`` every 0.5 ms (a lower bound of the
kernel's figure). Where ``clear_refs`` cannot be written, ``ru_maxrss`` is used and the row
says so. Every child also checks one layer's values against the generator that wrote them
and runs the pipeline once (it refuses a call while anything is unloaded).

The table and the same rows, with the command line, torch version and core count, go to
``benchmarks/results/loading.json``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

import fxpipe
from benchmarks.harness.memory import RssSampler, maxrss_kib, reset_peak, status_kib
from benchmarks.harness.output import command_line, result_path, save_json
from benchmarks.harness.processes import run_json

DEFAULT_OUT = result_path("loading")
STAGES = 4
SHARDS = 4
TARGET = 1.25
MIB = 2**20
METHODS = {
    "torch_shards": "load_checkpoint, 4 torch.save shards + index",
    "safetensors_shards": "load_checkpoint, 4 safetensors shards + index",
    "torch_file": "load_checkpoint, one torch.save file",
    "torch_load": "torch.load 4 shards + pipe.load_state_dict",
}


class Wide(nn.Module):
    """``depth`` square Linear layers, each followed by a ReLU."""

    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x


def layer_state(i: int, width: int) -> dict[str, torch.Tensor]:
    """Layer ``i``'s weight and bias, the same on every call (a generator seeded by ``i``)."""
    g = torch.Generator().manual_seed(i)
    scale = width**-0.5
    return {
        f"layers.{i}.weight": torch.randn(width, width, generator=g) * scale,
        f"layers.{i}.bias": torch.randn(width, generator=g) * scale,
    }


# ---------------------------------------------------------------------------- writing


def write_checkpoints(folder: Path, width: int, depth: int) -> dict[str, Any]:
    """The three layouts under ``folder``; returns their paths and the largest shard."""
    per = -(-depth // SHARDS)
    layouts = {"torch_shards": (folder / "torch", ".bin")}
    if _has_safetensors():
        layouts["safetensors_shards"] = (folder / "safetensors", ".safetensors")
    maps: dict[str, dict[str, str]] = {name: {} for name in layouts}
    largest = 0
    whole: dict[str, torch.Tensor] = {}
    for s in range(SHARDS):
        part: dict[str, torch.Tensor] = {}
        for i in range(s * per, min(depth, (s + 1) * per)):
            part.update(layer_state(i, width))
        largest = max(largest, sum(t.nbytes for t in part.values()))
        whole.update(part)
        for name, (sub, suffix) in layouts.items():
            sub.mkdir(parents=True, exist_ok=True)
            file = f"model-{s + 1:05d}-of-{SHARDS:05d}{suffix}"
            if suffix == ".safetensors":
                from safetensors.torch import save_file

                save_file(part, str(sub / file))
            else:
                torch.save(part, sub / file)
            maps[name].update(dict.fromkeys(part, file))
    for name, (sub, suffix) in layouts.items():
        index = {"metadata": {}, "weight_map": maps[name]}
        (sub / f"model{suffix}.index.json").write_text(json.dumps(index))
    single = folder / "single" / "model.pt"
    single.parent.mkdir()
    torch.save(whole, single)
    paths = {name: str(sub) for name, (sub, _) in layouts.items()}
    paths["torch_file"] = str(single)
    paths["torch_load"] = str(layouts["torch_shards"][0])
    return {"paths": paths, "largest_shard": largest, "file": os.path.getsize(single)}


def _has_safetensors() -> bool:
    try:
        import safetensors  # noqa: F401
    except ImportError:
        return False
    return True


# ---------------------------------------------------------------------------- measuring


def _load(method: str, pipe: fxpipe.Pipeline, path: Path) -> None:
    """Load the checkpoint at ``path`` the way ``method`` says; keeps nothing it read."""
    if method == "torch_load":
        state: dict[str, torch.Tensor] = {}
        for shard in sorted(path.glob("*.bin")):
            state.update(torch.load(shard, map_location="cpu", weights_only=True))
        pipe.load_state_dict(state)
    else:
        fxpipe.load_checkpoint(pipe, path)


def child(method: str, path: Path, width: int, depth: int) -> dict[str, Any]:
    """One process, one way of loading: build on meta, load, measure, check."""
    torch.set_num_threads(1)
    with torch.device("meta"):
        model = Wide(width, depth)
    x = torch.randn(8, width)
    pipe = fxpipe.pipeline(model, x, ["cpu"] * STAGES, chunks=2)
    model_bytes = sum(t.nbytes for t in [*model.parameters(), *model.buffers()])
    gc.collect()
    before = status_kib("VmRSS") or maxrss_kib()
    reset = reset_peak()
    start = time.perf_counter()
    with RssSampler() as sampler:
        _load(method, pipe, path)
        gc.collect()
    seconds = time.perf_counter() - start
    peak = status_kib("VmHWM") if reset else maxrss_kib()
    after = status_kib("VmRSS") or maxrss_kib()
    assert peak is not None
    want = layer_state(depth - 1, width)[f"layers.{depth - 1}.weight"]
    correct = torch.equal(model.layers[depth - 1].weight.detach(), want)
    del want
    with torch.no_grad():
        runs = bool(torch.isfinite(pipe(x)).all())
    return {
        "method": method,
        "model_mib": model_bytes / MIB,
        "before_mib": before / 1024,
        "after_mib": after / 1024,
        "peak_over_model_mib": (peak - after) / 1024,
        "sampled_over_model_mib": (sampler.peak - after) / 1024,
        "leftover_mib": (after - before) / 1024 - model_bytes / MIB,
        "peak_source": "VmHWM after clear_refs" if reset else "ru_maxrss (whole process)",
        "seconds": seconds,
        "values_correct": correct,
        "pipeline_runs": runs,
    }


def run_child(method: str, path: str, width: int, depth: int) -> dict[str, Any]:
    """This benchmark with ``--child`` in a fresh process; the JSON it prints."""
    args = ["--child", method, "--path", path, "--width", str(width), "--depth", str(depth)]
    result: dict[str, Any] = run_json("benchmarks.loading", args, timeout=900)
    return result


# ---------------------------------------------------------------------------- report


def print_table(rows: list[dict[str, Any]], largest_mib: float) -> None:
    print(
        f"\nmodel {rows[0]['model_mib']:.0f} MiB on {STAGES} CPU stages built on meta; "
        f"largest shard {largest_mib:.0f} MiB\n"
    )
    head = (
        f"{'method':<46} {'peak over model':>15} {'/ largest shard':>15} "
        f"{'sampled':>8} {'leftover':>8} {'seconds':>7}  ok"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        ok = "yes" if r["values_correct"] and r["pipeline_runs"] else "NO"
        print(
            f"{METHODS[r['method']]:<46} {r['peak_over_model_mib']:>11.0f} MiB "
            f"{r['over_largest_shard']:>14.2f}x {r['sampled_over_model_mib']:>4.0f} MiB "
            f"{r['leftover_mib']:>4.0f} MiB {r['seconds']:>7.1f}  {ok}"
        )
    sources = {r["peak_source"] for r in rows}
    print(f"\npeak: {', '.join(sorted(sources))}; leftover = after - before - model bytes")


def summary(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    checks = []
    for r in rows:
        if r["method"].endswith("_shards"):
            checks.append(
                {
                    "target": f"{METHODS[r['method']]}: peak < {TARGET}x largest shard",
                    "measured": r["over_largest_shard"],
                    "pass": r["over_largest_shard"] < TARGET,
                }
            )
    print("\nsummary")
    for c in checks:
        print(f"  {c['target']:<72} {c['measured']:.2f}x  {'PASS' if c['pass'] else 'MISS'}")
    return checks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--tmp", type=Path, default=None, help="where the checkpoints go")
    parser.add_argument("--width", type=int, default=5632)
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--child", choices=list(METHODS), help=argparse.SUPPRESS)
    parser.add_argument("--path", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.path, args.width, args.depth)))
        return
    start = time.perf_counter()
    folder = Path(tempfile.mkdtemp(prefix="fxpipe-loading-", dir=args.tmp)).resolve()
    try:
        written = write_checkpoints(folder, args.width, args.depth)
        largest_mib = written["largest_shard"] / MIB
        rows = []
        for method, path in written["paths"].items():
            row = run_child(method, path, args.width, args.depth)
            row["over_largest_shard"] = row["peak_over_model_mib"] / largest_mib
            rows.append(row)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    rows.sort(key=lambda r: list(METHODS).index(r["method"]))
    print_table(rows, largest_mib)
    checks = summary(rows)
    elapsed = time.perf_counter() - start
    print(f"\n{elapsed:.0f} s")
    record = {
        "command": command_line(),
        "torch": torch.__version__,
        "fxpipe": fxpipe.__version__,
        "python": platform.python_version(),
        "cores": os.cpu_count(),
        "width": args.width,
        "depth": args.depth,
        "stages": STAGES,
        "shards": SHARDS,
        "largest_shard_mib": largest_mib,
        "single_file_mib": written["file"] / MIB,
        "seconds": elapsed,
        "rows": rows,
        "summary": checks,
    }
    save_json(args.out, record)


if __name__ == "__main__":
    main()
