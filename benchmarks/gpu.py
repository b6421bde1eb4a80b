"""fxpipe's runtime on one CUDA device: step time, peak memory, stage-cost prediction, overlap.

Run from the repository root::

    python -m benchmarks.gpu [--out PATH] [--budget-s S]
    python -m benchmarks.gpu --dry-run      # the same code paths on CPU, tiny sizes

Made to run once, unattended, in under 5 minutes on one GPU. Every section is guarded: an
error is printed and recorded and the next section runs; a section that would start after
``--budget-s`` seconds is skipped; a watchdog prints what was measured, writes it and exits
if the whole run passes the budget by a minute. Results go to
``benchmarks/results/gpu.json`` after every section. Without a CUDA device (and without
``--dry-run``) it says so and exits with code 0.

With one GPU every stage is ``cuda:0``. Stages on the same device hand values over
directly (no copy, no copy stream), so copy/compute overlap is measured on its own.

Sections (``cuda:0``; ``cpu`` in a dry run):

1. Step time (forward + backward, loss = mean of squares) of a residual MLP: the plain model
   on the whole batch, the same model micro-batch by micro-batch by hand (8 chunks), and
   pipelines with K=1 and K=4 stages, chunks=8, checkpoint "never" (and K=4 "always"). The
   variants alternate inside every round; each step is timed with CUDA events; medians.
2. Peak ``torch.cuda.max_memory_allocated`` during one step (minus the allocation before it,
   parameter gradients already allocated) of a deeper residual MLP, K=4, chunks=8, for each
   checkpoint mode, against the plain model; beside the always/never ratio, the GPipe
   estimate O(N + (L/K)(N/M)) / O(N L) and fxpipe's plan estimate.
3. Predicted against measured stage time: a K=4 plan made with ``cost="time"``; each stage
   module alone, forward + backward on the example batch as the cost model prices a node,
   timed with CUDA events, against ``plan.stages[j].cost``; and the GPipe speedup each
   predicts.
4. Copy/compute overlap: device-to-host copies of the K=4 plan's boundary values (every
   micro-batch, into pinned memory) on a side stream while the compute stream runs the
   stages' forward; overlap = (T_compute + T_copy - T_both) / min(T_compute, T_copy), 1 when
   the shorter one is hidden completely, 0 when they serialise.
"""

from __future__ import annotations

import argparse
import faulthandler
import gc
import json
import os
import platform
import re
import statistics
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

import fxpipe
from benchmarks.harness.mlp import chunked_step, plain_step, residual_mlp
from benchmarks.harness.output import command_line, result_path
from fxpipe.passes.plan import PARAM_COPIES
from fxpipe.runtime.stream import current_stream, new_stream, use_stream, wait_stream

DEFAULT_OUT = result_path("gpu")
STAGES = 4
CHUNKS = 8
MODES = ("never", "except_last", "always")
MIB = 1024.0 * 1024.0


@dataclass(frozen=True)
class Sizes:
    """(batch, width, hidden, depth) of each section's residual MLP, and repeats."""

    step: tuple[int, int, int, int]
    memory: tuple[int, int, int, int]
    stage: tuple[int, int, int, int]
    rounds: int
    stage_repeats: int
    overlap_repeats: int


GPU_SIZES = Sizes(
    step=(4096, 1024, 4096, 8),  # ~1.6 TFLOP per step
    memory=(8192, 512, 2048, 32),  # activations ~10x the parameters
    stage=(4096, 1024, 4096, 8),
    rounds=15,
    stage_repeats=20,
    overlap_repeats=10,
)
DRY_SIZES = Sizes(
    step=(64, 32, 64, 4),
    memory=(2048, 32, 64, 8),
    stage=(64, 32, 64, 4),
    rounds=3,
    stage_repeats=3,
    overlap_repeats=2,
)


# ---------------------------------------------------------------------------- model


def make_model(
    shape: tuple[int, int, int, int], device: torch.device
) -> tuple[nn.Module, torch.Tensor]:
    batch, width, hidden, depth = shape
    model = residual_mlp(width, hidden, depth).to(device)
    return model, torch.randn(batch, width, device=device)


# ---------------------------------------------------------------------------- device


class Device:
    """Timing, synchronisation and peak memory on CUDA, with CPU stand-ins for a dry run."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def mark(self) -> Any:
        """A point on the current stream's timeline (an event) or on the host clock."""
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def ms(self, start: Any, end: Any) -> float:
        if self.cuda:
            end.synchronize()
            return float(start.elapsed_time(end))
        return 1e3 * float(end - start)

    def time_ms(self, fn: Callable[[], Any]) -> float:
        start = self.mark()
        fn()
        return self.ms(start, self.mark())

    def start_peak(self) -> int:
        """Reset the peak counter; return the bytes allocated now."""
        gc.collect()
        self.sync()
        if self.cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)
            return int(torch.cuda.memory_allocated(self.device))
        return _reset_rss_peak()

    def peak_since(self, base: int) -> int | None:
        self.sync()
        if self.cuda:
            return int(torch.cuda.max_memory_allocated(self.device)) - base
        peak = _status_bytes("VmHWM")
        return None if peak is None or base < 0 else peak - base

    def free(self) -> None:
        gc.collect()
        if self.cuda:
            try:
                torch.cuda.empty_cache()
            except Exception as e:  # a broken context already failed its section
                print(f"  (empty_cache failed: {e})", flush=True)


def _status_bytes(field: str) -> int | None:
    try:
        text = Path("/proc/self/status").read_text()
    except OSError:
        return None
    match = re.search(rf"^{field}:\s+(\d+)\s+kB", text, re.MULTILINE)
    return 1024 * int(match.group(1)) if match else None


def _reset_rss_peak() -> int:
    """CPU stand-in: reset the resident high-water mark; the resident bytes now, -1 if the
    kernel does not let us (then no CPU peak is reported)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return -1
    return _status_bytes("VmRSS") or -1


# ---------------------------------------------------------------------------- run state


class Run:
    """Results so far, the time budget, and what to print and write at any moment."""

    def __init__(self, args: argparse.Namespace, dev: Device) -> None:
        self.args = args
        self.dev = dev
        self.start = time.perf_counter()
        self.sections: dict[str, dict[str, Any]] = {}
        self.lock = threading.Lock()
        self.finished = False

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    @contextmanager
    def section(self, name: str) -> Iterator[dict[str, Any]]:
        """Run a section's block guarded; its ``status`` is "run" inside the block unless
        the budget is spent (then the caller must not run it)."""
        record: dict[str, Any] = {"status": "run"}
        with self.lock:
            self.sections[name] = record
        if self.elapsed() > self.args.budget_s:
            record["status"] = f"skipped: past the {self.args.budget_s:.0f} s budget"
            print(f"[{name}] {record['status']}", flush=True)
            yield record
            return
        t0 = time.perf_counter()
        print(f"[{name}] start at {self.elapsed():.0f} s", flush=True)
        try:
            yield record
            record["status"] = "ok"
        except Exception as e:  # one section's failure must not stop the others
            record["status"] = f"error: {type(e).__name__}: {e}"
            record["traceback"] = traceback.format_exc(limit=8)
            print(f"[{name}] ERROR {type(e).__name__}: {e}", flush=True)
        finally:
            record["seconds"] = time.perf_counter() - t0
            self.dev.free()
            print(f"[{name}] {record['status']} ({record['seconds']:.1f} s)", flush=True)
            self.write()

    def write(self) -> None:
        out: Path = self.args.out
        try:
            self._write(out)
        except Exception as e:  # writing must never be what fails the run
            print(f"could not write {out}: {e}", flush=True)

    def _write(self, out: Path) -> None:
        record = {
            "command": command_line(),
            "dry_run": self.args.dry_run,
            "device": device_name(self.dev),
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "fxpipe": fxpipe.__version__,
            "python": platform.python_version(),
            "cores": os.cpu_count(),
            "float32_matmul_precision": torch.get_float32_matmul_precision(),
            "seconds": self.elapsed(),
            "finished": self.finished,
            "sections": self.sections,
        }
        out.parent.mkdir(parents=True, exist_ok=True)
        with self.lock:
            text = json.dumps(record, indent=2, default=str)
        out.write_text(text + "\n")


def device_name(dev: Device) -> str:
    if not dev.cuda:
        return "cpu (dry run)"
    try:
        return f"{dev.device} {torch.cuda.get_device_name(dev.device)}"
    except Exception:
        return str(dev.device)


def start_watchdog(run: Run, limit_s: float) -> None:
    """After ``limit_s`` seconds: print the thread stacks and the results so far, write
    them, and end the process (code 0: the results are what this run is for)."""

    def fire() -> None:
        if run.finished:
            return
        print(f"\nwatchdog: still running after {limit_s:.0f} s; stopping", flush=True)
        faulthandler.dump_traceback(all_threads=True)
        with run.lock:
            for rec in run.sections.values():
                if rec.get("status") == "run":
                    rec["status"] = "stopped by the watchdog while running"
        try:
            print_table(run)
        finally:
            run.write()
            sys.stdout.flush()
            os._exit(0)

    timer = threading.Timer(limit_s, fire)
    timer.daemon = True
    timer.start()


# ---------------------------------------------------------------------------- sections


def pipeline_on(
    model: nn.Module, x: torch.Tensor, dev: Device, stages: int, checkpoint: str, **kw: Any
) -> fxpipe.Pipeline:
    kw.setdefault("cost", "flops")
    return fxpipe.pipeline(
        model, x, [dev.device] * stages, chunks=CHUNKS, checkpoint=checkpoint, **kw
    )


def step_times(run: Run, sizes: Sizes, rec: dict[str, Any]) -> None:
    dev = run.dev
    model, x = make_model(sizes.step, dev.device)
    variants = {
        "plain": plain_step(model, x),
        "by hand M=8": chunked_step(model, x, CHUNKS),
        "K=1 M=8 never": plain_step(pipeline_on(model, x, dev, 1, "never"), x),
        "K=4 M=8 never": plain_step(pipeline_on(model, x, dev, STAGES, "never"), x),
        "K=4 M=8 always": plain_step(pipeline_on(model, x, dev, STAGES, "always"), x),
    }
    times: dict[str, list[float]] = {name: [] for name in variants}
    names = list(variants)
    warmup = 2
    for r in range(warmup + sizes.rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            model.zero_grad(set_to_none=False)
            dev.sync()
            ms = dev.time_ms(variants[name])
            if r >= warmup:
                times[name].append(ms)
        if r >= warmup + 2 and run.elapsed() > run.args.budget_s * 0.4:
            break  # enough rounds for a median; leave time for the other sections
    med = {name: statistics.median(v) for name, v in times.items()}
    rec["rows"] = [
        {
            "variant": name,
            "ms": med[name],
            "vs_plain": med[name] / med["plain"],
            "vs_by_hand": med[name] / med["by hand M=8"],
            "rounds": len(times[name]),
        }
        for name in names
    ]
    rec["shape"] = sizes.step
    for row in rec["rows"]:
        print(
            f"  {row['variant']:<16} {row['ms']:9.2f} ms  /plain {row['vs_plain']:.3f}  "
            f"/by hand {row['vs_by_hand']:.3f}",
            flush=True,
        )


def peak_of(dev: Device, model: nn.Module, step: Callable[[], None]) -> int | None:
    model.zero_grad(set_to_none=True)
    step()  # makes the gradients and any one-off allocations
    model.zero_grad(set_to_none=False)
    base = dev.start_peak()
    step()
    return dev.peak_since(base)


def memory_peaks(run: Run, sizes: Sizes, rec: dict[str, Any]) -> None:
    dev = run.dev
    model, x = make_model(sizes.memory, dev.device)
    peaks: dict[str, int | None] = {"plain": peak_of(dev, model, plain_step(model, x))}
    plan_bytes: dict[str, float] = {}
    for mode in MODES:
        pipe = pipeline_on(model, x, dev, STAGES, mode)
        peaks[mode] = peak_of(dev, model, plain_step(pipe, x))
        plan_bytes[mode] = sum(
            s.memory_bytes - PARAM_COPIES * s.param_bytes for s in pipe.plan.stages
        )
        del pipe
        dev.free()
    depth = sizes.memory[3]
    rows: list[dict[str, Any]] = []
    for name, peak in peaks.items():
        never = peaks["never"]
        rows.append(
            {
                "variant": name if name == "plain" else f"K=4 M=8 {name}",
                "peak_mib": None if peak is None else peak / MIB,
                "vs_plain": _ratio(peak, peaks["plain"]),
                "vs_never": _ratio(peak, never),
                "plan_vs_never": plan_bytes[name] / plan_bytes["never"]
                if name in plan_bytes
                else None,
            }
        )
    rec["rows"] = rows
    rec["gpipe_always_vs_never"] = 1.0 / depth + 1.0 / (STAGES * CHUNKS)
    rec["shape"] = sizes.memory
    rec["param_mib"] = sum(p.numel() * p.element_size() for p in model.parameters()) / MIB
    for row in rows:
        print(
            f"  {row['variant']:<20} peak {_fmt(row['peak_mib'], '.1f')} MiB  /plain "
            f"{_fmt(row['vs_plain'])}  /never {_fmt(row['vs_never'])}  plan "
            f"{_fmt(row['plan_vs_never'])}",
            flush=True,
        )
    print(f"  GPipe estimate always/never {rec['gpipe_always_vs_never']:.3f}", flush=True)
    if not dev.cuda:
        print("  (dry run: resident-size stand-in; freed memory is reused, not comparable)")


def _ratio(a: int | None, b: int | None) -> float | None:
    return None if a is None or b is None or b <= 0 else a / b


def _fmt(value: float | None, spec: str = ".3f") -> str:
    return "-" if value is None else format(value, spec)


def stage_io(pipe: fxpipe.Pipeline) -> tuple[list[list[str]], list[list[str]]]:
    """Names each stage reads and returns, from its GraphModule's placeholders and output."""
    inputs: list[list[str]] = []
    outputs: list[list[str]] = []
    for stage in pipe.stages:
        inputs.append([n.name for n in stage.graph.nodes if n.op == "placeholder"])
        out: Any = stage.graph.output_node().args[0]
        outputs.append([n.name for n in (out if isinstance(out, (tuple, list)) else [out])])
    return inputs, outputs


def stage_inputs(pipe: fxpipe.Pipeline, x: torch.Tensor) -> list[list[torch.Tensor]]:
    """Every stage's arguments for the whole batch ``x``, from running the stages in order."""
    graph_in = [n.name for n in pipe.plan.graph_module.graph.nodes if n.op == "placeholder"]
    env: dict[str, Any] = {graph_in[0]: x}
    inputs, outputs = stage_io(pipe)
    args = []
    with torch.no_grad():
        for stage, names_in, names_out in zip(pipe.stages, inputs, outputs, strict=True):
            args.append([env[n] for n in names_in])
            env.update(zip(names_out, stage(*args[-1]), strict=True))
    return args


def time_stage(dev: Device, stage: nn.Module, args: list[torch.Tensor], repeats: int) -> float:
    """Median ms of forward + backward of ``stage`` alone (gradients of its float inputs and
    parameters, output gradients of ones), as the cost model prices a node."""
    params = [p for p in stage.parameters() if p.requires_grad]

    def once() -> None:
        leaves = [a.detach().requires_grad_(a.is_floating_point()) for a in args]
        outs = [y for y in stage(*leaves) if isinstance(y, torch.Tensor) and y.requires_grad]
        wrt = [a for a in leaves if a.requires_grad] + params
        if outs and wrt:
            torch.autograd.grad(outs, wrt, [torch.ones_like(y) for y in outs], allow_unused=True)

    once()
    dev.sync()
    return statistics.median(dev.time_ms(once) for _ in range(repeats))


def stage_prediction(run: Run, sizes: Sizes, rec: dict[str, Any]) -> None:
    dev = run.dev
    model, x = make_model(sizes.stage, dev.device)
    pipe = pipeline_on(model, x, dev, STAGES, "never", cost="time")
    plan = pipe.plan
    rec["cost_unit"] = plan.costs.unit
    args = stage_inputs(pipe, x)
    measured = [
        time_stage(dev, stage, a, sizes.stage_repeats)
        for stage, a in zip(pipe.stages, args, strict=True)
    ]
    scale = 1e3 if plan.costs.unit == "s" else 1.0
    predicted = [s.cost * scale for s in plan.stages]
    rows = []
    for j, (p, m) in enumerate(zip(predicted, measured, strict=True)):
        rows.append(
            {
                "stage": j,
                "nodes": len(plan.stages[j].nodes),
                "predicted_ms": p,
                "measured_ms": m,
                "measured_vs_predicted": m / p if p > 0 and plan.costs.unit == "s" else None,
                "predicted_share": p / sum(predicted),
                "measured_share": m / sum(measured),
            }
        )
        r = rows[-1]
        print(
            f"  stage {j}: predicted {p:8.2f} ms  measured {m:8.2f} ms  "
            f"share {r['predicted_share']:.3f} vs {r['measured_share']:.3f}",
            flush=True,
        )
    rec["rows"] = rows
    rec["predicted_speedup"] = plan.gpipe_prediction(CHUNKS)[1]
    total, worst = sum(measured), max(measured)
    rec["measured_speedup"] = total / (total / CHUNKS + (CHUNKS - 1) * worst / CHUNKS)
    rec["same_bottleneck"] = predicted.index(max(predicted)) == measured.index(worst)
    print(
        f"  GPipe speedup at M={CHUNKS}: predicted costs {rec['predicted_speedup']:.2f}x, "
        f"measured stage times {rec['measured_speedup']:.2f}x",
        flush=True,
    )


def overlap(run: Run, sizes: Sizes, rec: dict[str, Any]) -> None:
    dev = run.dev
    model, x = make_model(sizes.stage, dev.device)
    pipe = pipeline_on(model, x, dev, STAGES, "never")
    # Stage arguments of every micro-batch; the boundary values are those of stages j >= 1.
    per_micro = [stage_inputs(pipe, xi) for xi in x.tensor_split(CHUNKS)]
    sources = [t for args in per_micro for a in args[1:] for t in a]
    pinned = dev.cuda
    targets = [torch.empty(t.shape, dtype=t.dtype, pin_memory=pinned) for t in sources]
    nbytes = sum(t.numel() * t.element_size() for t in sources)
    compute_stream, side = current_stream(dev.device), new_stream(dev.device)

    def compute(micro_batches: int) -> None:
        with torch.no_grad():
            for args in per_micro[:micro_batches]:
                for stage, a in zip(pipe.stages, args, strict=True):
                    stage(*a)

    def start_copies() -> None:
        wait_stream(side, compute_stream)  # the copies wait for what produced their sources
        with use_stream(side):
            for src, dst in zip(sources, targets, strict=True):
                dst.copy_(src, non_blocking=pinned)

    def copy() -> None:
        start_copies()
        wait_stream(compute_stream, side)

    def both(micro_batches: int) -> None:
        start_copies()
        compute(micro_batches)
        wait_stream(compute_stream, side)

    # Compute as many micro-batches as take about as long as the copies: the overlap is
    # best resolved when neither side dwarfs the other.
    for _ in range(2):  # warm-up
        copy()
        compute(1)
    dev.sync()
    one = statistics.median(dev.time_ms(lambda: compute(1)) for _ in range(3))
    alone = statistics.median(dev.time_ms(copy) for _ in range(3))
    n = max(1, min(CHUNKS, round(alone / max(one, 1e-9))))
    fns = {"compute": lambda: compute(n), "copy": copy, "both": lambda: both(n)}
    samples: dict[str, list[float]] = {name: [] for name in fns}
    both(n)
    for _ in range(sizes.overlap_repeats):
        for name, fn in fns.items():
            dev.sync()
            samples[name].append(dev.time_ms(fn))
    med = {k: statistics.median(v) for k, v in samples.items()}
    hidden = med["compute"] + med["copy"] - med["both"]
    shorter = max(min(med["compute"], med["copy"]), 1e-9)
    rec.update(
        {
            "compute_ms": med["compute"],
            "copy_ms": med["copy"],
            "both_ms": med["both"],
            "copy_mib": nbytes / MIB,
            "compute_micro_batches": n,
            "pinned": pinned,
            "copy_gib_s": nbytes / 2**30 / max(med["copy"] / 1e3, 1e-9),
            "overlap": max(0.0, min(1.0, hidden / shorter)),
        }
    )
    print(
        f"  compute {med['compute']:.2f} ms, copy {med['copy']:.2f} ms ({rec['copy_mib']:.1f} "
        f"MiB, {rec['copy_gib_s']:.1f} GiB/s), both {med['both']:.2f} ms: overlap "
        f"{rec['overlap']:.2f}",
        flush=True,
    )


# ---------------------------------------------------------------------------- table


def print_table(run: Run) -> None:
    print()
    print(f"fxpipe on {device_name(run.dev)}; torch {torch.__version__}; K={STAGES}, M={CHUNKS}")
    head = f"{'measurement':<30} {'measured':>12} {'ratio':>7}  {'ratio to':<12} {'predicted':<22}"
    print(head)
    print("-" * len(head))
    for name, rec in run.sections.items():
        if rec.get("status") != "ok":
            print(f"{name:<30} {rec.get('status', '?')}")
            continue
        for cells in _table_rows(name, rec):
            label, value, ratio, ref, pred = cells
            print(f"{label:<30} {value:>12} {ratio:>7}  {ref:<12} {pred:<22}")
    print("-" * len(head))


Cells = tuple[str, str, str, str, str]


def _table_rows(name: str, rec: dict[str, Any]) -> list[Cells]:
    if name == "step time":
        return [
            (
                f"step {r['variant']}",
                f"{r['ms']:.2f} ms",
                f"{r['vs_plain' if i < 2 else 'vs_by_hand']:.3f}",
                "plain" if i < 2 else "by hand M=8",
                "-",
            )
            for i, r in enumerate(rec["rows"])
        ]
    if name == "peak memory":
        rows = []
        for r in rec["rows"]:
            mode = r["variant"].rsplit(" ", 1)[-1]
            to_never = mode in ("except_last", "always")
            pred = "-"
            if to_never:
                pred = f"plan {_fmt(r['plan_vs_never'])}"
            if mode == "always":
                pred = f"GPipe {rec['gpipe_always_vs_never']:.3f}, " + pred
            rows.append(
                (
                    f"peak {r['variant']}",
                    f"{_fmt(r['peak_mib'], '.1f')} MiB",
                    _fmt(r["vs_never"] if to_never else r["vs_plain"]),
                    "never" if to_never else "plain",
                    pred,
                )
            )
        return rows
    if name == "stage prediction":
        rows = [
            (
                f"stage {r['stage']} fwd+bwd alone",
                f"{r['measured_ms']:.2f} ms",
                _fmt(r["measured_vs_predicted"]),
                "predicted",
                f"{r['predicted_ms']:.2f} ms"
                if rec["cost_unit"] == "s"
                else f"{r['predicted_ms']:.3g} {rec['cost_unit']}",
            )
            for r in rec["rows"]
        ]
        rows.append(
            (
                f"GPipe speedup at M={CHUNKS}",
                f"{rec['measured_speedup']:.2f}x",
                "-",
                "-",
                f"{rec['predicted_speedup']:.2f}x",
            )
        )
        return rows
    if name == "overlap":
        both = f"{rec['compute_ms']:.2f}+{rec['copy_ms']:.2f}->{rec['both_ms']:.2f} ms"
        return [("D2H copy/compute overlap", f"{rec['overlap']:.2f}", "-", "-", both)]
    return []


# ---------------------------------------------------------------------------- main


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--dry-run", action="store_true", help="run on CPU with tiny sizes")
    parser.add_argument("--budget-s", type=float, default=240.0, help="start no section after")
    args = parser.parse_args()
    if not args.dry_run and not torch.cuda.is_available():
        print(
            "no CUDA device: nothing measured, nothing written. "
            "`python -m benchmarks.gpu --dry-run` runs the same code on CPU."
        )
        return 0
    if args.out is None:  # a dry run's numbers are no GPU results: keep them out of the tree
        dry = Path(tempfile.gettempdir()) / "fxpipe-gpu-dry-run.json"
        args.out = dry if args.dry_run else DEFAULT_OUT
    dev = Device(torch.device("cpu") if args.dry_run else torch.device("cuda", 0))
    if args.dry_run:
        torch.set_num_threads(1)
    sizes = DRY_SIZES if args.dry_run else GPU_SIZES
    run = Run(args, dev)
    start_watchdog(run, args.budget_s + 60.0)
    print(f"fxpipe GPU benchmark on {device_name(dev)}, torch {torch.__version__}", flush=True)
    sections: list[tuple[str, Callable[[Run, Sizes, dict[str, Any]], None]]] = [
        ("step time", step_times),
        ("peak memory", memory_peaks),
        ("stage prediction", stage_prediction),
        ("overlap", overlap),
    ]
    for name, fn in sections:
        with run.section(name) as rec:
            if rec["status"] == "run":
                fn(run, sizes, rec)
    run.finished = True
    try:
        print_table(run)
    except Exception:  # the sections' own lines above already hold every number
        traceback.print_exc()
    run.write()
    failed = [n for n, r in run.sections.items() if r.get("status") != "ok"]
    state = "complete" if not failed else f"partial ({', '.join(failed)} not ok)"
    print(f"{state}; {run.elapsed():.0f} s; wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
