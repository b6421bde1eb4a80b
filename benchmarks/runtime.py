"""Runtime overhead and activation memory of fxpipe's GPipe executor, measured side by side.

Run from the repository root::

    python -m benchmarks.runtime [--out PATH] [--repeats N] [--skip-memory]

Everything runs on CPU with ``torch.set_num_threads(1)``; about 1.5 minutes on 2 cores.

1. Overhead of one training step (forward + backward, loss = mean of squared outputs):

   a. a 1-stage pipeline (chunks=1, checkpoint="never") against the plain model;
   b. 4 stages on ``["cpu"] * 4`` with chunks=8, checkpoint="never", against the same model
      run micro-batch by micro-batch by hand (``tensor_split`` into 8 chunks, forward and
      backward each, gradients accumulating in ``.grad``); checkpoint="always" beside it
      for the cost of recomputation (no target);
   c. the fixed cost per call (K=1, M=1) and per (micro-batch, stage) cell (K=4, M=8) on a
      tiny model, in this process and again in a fresh one started with OMP_NUM_THREADS=1
      (threads the runtime starts then run one OpenMP thread whatever
      ``torch.set_num_threads`` said; a difference between the two is the runtime's).

   The variants of a row alternate inside every round (the order flips each round) and the
   ratio is the median over rounds of the per-round wall-time ratio: these machines are
   shared and noisy, and a slow spell then hits both sides of a ratio. Beside it: the
   interquartile range of those ratios, the ratio of the fastest steps, and the median
   per-round ratio of process CPU time (all threads), which waiting for a busy core does
   not inflate.

2. Peak memory of one training step of a deep residual MLP (activations ~20x the
   parameters), K=4 stages, chunks=8, for each checkpoint mode and for the plain model, each
   in a fresh process: peak resident size during the step minus the resident size just
   before it (the kernel's high-water mark, reset before the step; a 0.5 ms RSS sampler as
   a cross-check). The step runs twice; the second is the one compared (its parameter
   gradients already exist). The measured always/never ratio is printed beside

   - the GPipe estimate O(N + (L/K)(N/M)) against O(N L): N activations of one layer for the
     whole batch, L layers, K stages, M micro-batches;
   - the same in this model's bytes, with all K stages in one process: every stage keeps its
     boundary inputs for every micro-batch, plus one stage's micro-batch being recomputed
     ("1 live") or one per stage at once ("K live", when backward recomputes ahead along
     the wavefront of ready cells); the saved bytes come from ``saved_tensors_hooks``;
   - fxpipe's own plan estimate (``StagePlan.memory_bytes`` less the parameter copies).

A summary block states each target, the measured value and PASS or MISS. The same rows, the
command line, torch version and core count go to ``benchmarks/results/runtime.json``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

import fxpipe
from benchmarks.harness.machine import usable_cores
from benchmarks.harness.memory import RssSampler, maxrss_kib, reset_peak, status_kib
from benchmarks.harness.mlp import chunked_step, loss_of, plain_step, residual_mlp
from benchmarks.harness.output import command_line, result_path, save_json
from benchmarks.harness.processes import run_json
from fxpipe.passes.split.plan import PARAM_COPIES

DEFAULT_OUT = result_path("runtime")

# Targets.
OVERHEAD_K1 = 1.03
OVERHEAD_K4 = 1.10
MEMORY_RATIO = 0.30

#: (batch, width, hidden, depth) of each row's residual MLP.
SINGLE = (128, 256, 1024, 4)  # about 20-50 ms per step on one core
CHUNKED = (256, 256, 1024, 8)
TINY = (64, 32, 32, 4)
DEEP = (2048, 64, 256, 32)  # activations ~20x the parameters
STAGES = 4
CHUNKS = 8
MEMORY_MODES = ("never", "except_last", "always", "plain")
#: Row 1c again in a process started with OMP_NUM_THREADS=1.
FIXED_OMP1_LABEL = "1c tiny model, OMP_NUM_THREADS=1"
#: Large blocks go straight to mmap, so the resident size follows the live tensors.
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "65536"}
MIB = 1024.0 * 1024.0


# ---------------------------------------------------------------------------- model


def build(
    shape: tuple[int, int, int, int], stages: int, chunks: int, checkpoint: str
) -> tuple[nn.Module, torch.Tensor, fxpipe.Pipeline]:
    batch, width, hidden, depth = shape
    model = residual_mlp(width, hidden, depth)
    x = torch.randn(batch, width)
    return model, x, build_on(model, x, stages, chunks, checkpoint)


def build_on(
    model: nn.Module, x: torch.Tensor, stages: int, chunks: int, checkpoint: str
) -> fxpipe.Pipeline:
    return fxpipe.pipeline(
        model, x, ["cpu"] * stages, chunks=chunks, checkpoint=checkpoint, cost="flops"
    )


# ---------------------------------------------------------------------------- timing


Times = dict[str, dict[str, list[float]]]


def time_interleaved(
    model: nn.Module,
    variants: dict[str, Callable[[], None]],
    repeats: int,
    *,
    warmup: int = 3,
    budget_s: float = 60.0,
) -> Times:
    """Wall and CPU seconds per step of every variant: one step of each per round, the order
    flipped every round; stops early (after at least 5 rounds) once ``budget_s`` is spent."""
    names = list(variants)
    times: Times = {"wall": {n: [] for n in names}, "cpu": {n: [] for n in names}}
    start = time.perf_counter()
    for r in range(warmup + repeats):
        gc.collect()
        gc.disable()  # a collection inside one variant's step would bias the ratio
        try:
            for name in names if r % 2 == 0 else names[::-1]:
                model.zero_grad(set_to_none=True)
                wall, cpu = time.perf_counter(), time.process_time()
                variants[name]()
                cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
                if r >= warmup:
                    times["wall"][name].append(wall)
                    times["cpu"][name].append(cpu)
        finally:
            gc.enable()
        if r >= warmup + 4 and time.perf_counter() - start > budget_s:
            break
    return times


def ratio_row(
    name: str, times: Times, variant: str, base: str, target: float | None
) -> dict[str, Any]:
    wall, cpu = times["wall"], times["cpu"]
    ratios = [a / b for a, b in zip(wall[variant], wall[base], strict=True)]
    cpu_ratios = [a / b for a, b in zip(cpu[variant], cpu[base], strict=True)]
    return {
        "row": name,
        "variant": variant,
        "baseline": base,
        "variant_ms": 1e3 * statistics.median(wall[variant]),
        "baseline_ms": 1e3 * statistics.median(wall[base]),
        "ratio": statistics.median(ratios),
        "ratio_q1_q3": _quartiles(ratios),
        "ratio_of_min": min(wall[variant]) / min(wall[base]),
        "cpu_ratio": statistics.median(cpu_ratios),
        "target": target,
        "rounds": len(ratios),
    }


def _quartiles(values: list[float]) -> list[float]:
    if len(values) < 4:
        return [min(values), max(values)]
    q = statistics.quantiles(values, n=4)
    return [q[0], q[2]]


def overhead_single(repeats: int) -> list[dict[str, Any]]:
    model, x, pipe = build(SINGLE, 1, 1, "never")
    variants = {"plain": plain_step(model, x), "pipeline": plain_step(pipe, x)}
    times = time_interleaved(model, variants, 3 * repeats, budget_s=20.0)
    return [ratio_row("1a K=1 M=1 never / plain", times, "pipeline", "plain", OVERHEAD_K1)]


def overhead_chunked(repeats: int) -> list[dict[str, Any]]:
    model, x, pipe = build(CHUNKED, STAGES, CHUNKS, "never")
    pipe_ckpt = build_on(model, x, STAGES, CHUNKS, "always")
    variants = {
        "by hand": chunked_step(model, x, CHUNKS),
        "pipeline never": plain_step(pipe, x),
        "pipeline always": plain_step(pipe_ckpt, x),
    }
    times = time_interleaved(model, variants, repeats, budget_s=40.0)
    return [
        ratio_row("1b K=4 M=8 never / by hand", times, "pipeline never", "by hand", OVERHEAD_K4),
        ratio_row("1b K=4 M=8 always / by hand", times, "pipeline always", "by hand", None),
    ]


def fixed_costs(repeats: int, label: str = "1c tiny model") -> list[dict[str, Any]]:
    """Microseconds the runtime adds per call (K=1, M=1) and per cell (K=4, M=8)."""
    model, x, pipe1 = build(TINY, 1, 1, "never")
    pipe4 = build_on(model, x, STAGES, CHUNKS, "never")
    variants = {
        "plain": plain_step(model, x),
        "K=1 M=1": plain_step(pipe1, x),
        "by hand M=8": chunked_step(model, x, CHUNKS),
        "K=4 M=8": plain_step(pipe4, x),
    }
    times = time_interleaved(model, variants, 4 * repeats, budget_s=10.0)
    row: dict[str, Any] = {"row": label, "rounds": len(times["wall"]["plain"])}
    for kind in ("wall", "cpu"):
        med = {k: 1e6 * statistics.median(v) for k, v in times[kind].items()}
        row[kind] = {
            "plain_us": med["plain"],
            "k1_us": med["K=1 M=1"],
            "by_hand_m8_us": med["by hand M=8"],
            "k4_m8_us": med["K=4 M=8"],
            "per_call_us": med["K=1 M=1"] - med["plain"],
            "per_cell_us": (med["K=4 M=8"] - med["by hand M=8"]) / (STAGES * CHUNKS),
        }
    return [row]


# ---------------------------------------------------------------------------- memory


def memory_child(mode: str) -> dict[str, Any]:
    """One process, one mode: build the model and measure two training steps."""
    torch.set_num_threads(1)
    batch, width, hidden, depth = DEEP
    model = residual_mlp(width, hidden, depth)
    x = torch.randn(batch, width)
    run: nn.Module = model
    plan_bytes = None
    if mode != "plain":
        pipe = fxpipe.pipeline(
            model, x, ["cpu"] * STAGES, chunks=CHUNKS, checkpoint=mode, cost="flops"
        )
        run = pipe
        plan_bytes = sum(s.memory_bytes - PARAM_COPIES * s.param_bytes for s in pipe.plan.stages)
    steps = []
    for step in range(2):
        model.zero_grad(set_to_none=step == 0)
        gc.collect()
        base = status_kib("VmRSS") or maxrss_kib()
        reset = reset_peak()
        maxrss_before = maxrss_kib()
        with RssSampler() as sampler:
            loss_of(run(x), x.numel()).backward()
        hwm = status_kib("VmHWM") if reset else None
        steps.append(
            {
                "base_mib": base / 1024,
                "peak_mib": ((hwm if hwm is not None else maxrss_kib()) - base) / 1024,
                "method": "VmHWM after reset" if reset else "ru_maxrss",
                "sampled_mib": (sampler.peak - base) / 1024,
                "maxrss_grew_mib": (maxrss_kib() - maxrss_before) / 1024,
            }
        )
    return {"mode": mode, "steps": steps, "plan_activation_bytes": plan_bytes}


def run_child(flag: str, value: str, env: dict[str, str]) -> Any:
    """Run this benchmark with ``flag value`` in a fresh process; return the JSON it prints."""
    return run_json("benchmarks.runtime", [flag, value], env)


def run_memory_child(mode: str) -> dict[str, Any]:
    result: dict[str, Any] = run_child("--memory-child", mode, MALLOC_ENV)
    return result


def saved_bytes_by_stage() -> tuple[list[int], list[int]]:
    """Bytes autograd saves in each stage for the whole batch (model activations only,
    parameters excluded), and bytes of each stage's boundary inputs from earlier stages."""
    batch, width, hidden, depth = DEEP
    model = residual_mlp(width, hidden, depth)
    x = torch.randn(batch, width)
    pipe = fxpipe.pipeline(model, x, ["cpu"] * STAGES, chunks=CHUNKS, cost="flops")
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    env: dict[str, Any] = {}
    saved: list[int] = []
    inputs: list[int] = []
    first = next(n.name for n in pipe.plan.graph_module.graph.nodes if n.op == "placeholder")
    env[first] = x
    for j, stage in enumerate(pipe.stages):
        names = [n.name for n in stage.graph.nodes if n.op == "placeholder"]
        args = [env[name] for name in names]
        inputs.append(0 if j == 0 else sum(a.numel() * a.element_size() for a in args))
        seen: dict[int, int] = {}

        def pack(t: torch.Tensor, seen: dict[int, int] = seen) -> torch.Tensor:
            storage = t.untyped_storage()
            if storage.data_ptr() not in params:
                seen[storage.data_ptr()] = storage.nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            outs = stage(*[a.detach().requires_grad_() for a in args])
        saved.append(sum(seen.values()))
        out: Any = stage.graph.output_node().args[0]
        out_names = [n.name for n in (out if isinstance(out, (tuple, list)) else [out])]
        env.update({k: v.detach() for k, v in zip(out_names, outs, strict=True)})
    return saved, inputs


def memory_rows() -> list[dict[str, Any]]:
    results = {mode: run_memory_child(mode) for mode in MEMORY_MODES}
    saved, inputs = saved_bytes_by_stage()
    batch, width, hidden, depth = DEEP
    out_bytes = batch * width * 4  # the model output, kept for the loss in every mode
    # GPipe: O(N + (L/K)(N/M)) with re-materialisation against O(N L) without it.
    gpipe = 1.0 / depth + 1.0 / (STAGES * CHUNKS)
    # The same in this model's bytes. All K stages live in this one process, so every stage
    # keeps its boundary inputs for every micro-batch; one stage's micro-batch is recomputed
    # at a time ("1 live"), or, when backward recomputes ahead along the wavefront of cells
    # (i, j) that are ready, up to K of them at once ("K live").
    kept = sum(inputs) + out_bytes
    never_bytes = sum(saved) + out_bytes
    bytes_one = (kept + max(saved) / CHUNKS) / never_bytes
    bytes_k = (kept + sum(saved) / CHUNKS) / never_bytes
    never = results["never"]
    plan_never = never["plan_activation_bytes"]
    rows = []
    for mode in MEMORY_MODES:
        r = results[mode]
        step1, step2 = r["steps"]
        plan = r["plan_activation_bytes"]
        always = mode == "always"
        rows.append(
            {
                "row": f"2 memory {mode}",
                "mode": mode,
                "step1_mib": step1["peak_mib"],
                "step2_mib": step2["peak_mib"],
                "sampled_step2_mib": step2["sampled_mib"],
                "method": step2["method"],
                "ratio_to_never": step2["peak_mib"] / never["steps"][1]["peak_mib"],
                "ratio_to_never_step1": step1["peak_mib"] / never["steps"][0]["peak_mib"],
                "plan_ratio": None if plan is None else plan / plan_never,
                "gpipe_ratio": gpipe if always else None,
                "bytes_ratio_1_live": bytes_one if always else None,
                "bytes_ratio_k_live": bytes_k if always else None,
                "target": MEMORY_RATIO if always else None,
                "raw": r,
            }
        )
    params = residual_mlp(width, hidden, depth).parameters()
    rows.append(
        {
            "row": "2 activation bytes",
            "saved_mib_per_stage": [b / MIB for b in saved],
            "boundary_input_mib_per_stage": [b / MIB for b in inputs],
            "param_mib": sum(p.numel() * p.element_size() for p in params) / MIB,
        }
    )
    return rows


# ---------------------------------------------------------------------------- report


def print_header() -> None:
    print(
        f"torch {torch.__version__}, fxpipe {fxpipe.__version__}, {os.cpu_count()} cores, "
        f"torch threads {torch.get_num_threads()}; wall-time ratios are medians over "
        "rounds of the per-round ratio (variants interleaved)"
    )
    print()


def print_overhead(rows: list[dict[str, Any]]) -> None:
    head = (
        f"{'row':<30} {'variant ms':>10} {'base ms':>8} {'ratio':>6} {'q1..q3':>12} "
        f"{'min/min':>7} {'cpu':>6} {'rounds':>6} {'target':>7}"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        if "ratio" in r:
            q = r["ratio_q1_q3"]
            target = f"<={r['target']:.2f}" if r["target"] else "-"
            print(
                f"{r['row']:<30} {r['variant_ms']:>10.2f} {r['baseline_ms']:>8.2f} "
                f"{r['ratio']:>6.3f} {q[0]:>5.3f}..{q[1]:<5.3f} {r['ratio_of_min']:>7.3f} "
                f"{r['cpu_ratio']:>6.3f} {r['rounds']:>6} {target:>7}"
            )
    for r in rows:
        if r["row"].startswith("1c"):
            for kind in ("wall", "cpu"):
                c = r[kind]
                print(
                    f"{r['row']}, {kind} us: plain {c['plain_us']:.0f}, K=1 M=1 "
                    f"{c['k1_us']:.0f} (+{c['per_call_us']:.0f} per call); by hand M=8 "
                    f"{c['by_hand_m8_us']:.0f}, K=4 M=8 {c['k4_m8_us']:.0f} "
                    f"(+{c['per_cell_us']:.0f} per cell)"
                )


def print_memory(rows: list[dict[str, Any]]) -> None:
    mem = [r for r in rows if r["row"].startswith("2 memory")]
    if not mem:
        return
    batch, width, hidden, depth = DEEP
    print()
    print(
        f"memory: {depth} blocks {width}->{hidden}->{width}, batch {batch}, K={STAGES} "
        f"(one process), M={CHUNKS}; peak RSS of step 2 minus RSS before it "
        f"({mem[0]['method']}); estimates of the always/never ratio on the right"
    )
    head = (
        f"{'mode':<12} {'step 1 MiB':>10} {'step 2 MiB':>10} {'sampled':>8} {'/never':>7} "
        f"{'plan':>6} {'GPipe O()':>9} {'bytes,1 live':>12} {'bytes,K live':>12} "
        f"{'target':>7}"
    )
    print(head)
    print("-" * len(head))
    for r in mem:
        target = "<=" + format(r["target"], ".2f") if r["target"] else "-"
        print(
            f"{r['mode']:<12} {r['step1_mib']:>10.1f} {r['step2_mib']:>10.1f} "
            f"{r['sampled_step2_mib']:>8.1f} {r['ratio_to_never']:>7.3f} "
            f"{_opt(r['plan_ratio']):>6} {_opt(r['gpipe_ratio']):>9} "
            f"{_opt(r['bytes_ratio_1_live']):>12} {_opt(r['bytes_ratio_k_live']):>12} "
            f"{target:>7}"
        )
    act = next((r for r in rows if r["row"] == "2 activation bytes"), None)
    if act:
        per = ", ".join(f"{b:.1f}" for b in act["saved_mib_per_stage"])
        inp = ", ".join(f"{b:.1f}" for b in act["boundary_input_mib_per_stage"])
        print(
            f"saved for backward, whole batch, per stage (MiB): {per}; boundary inputs per "
            f"stage (MiB): {inp}; parameters {act['param_mib']:.1f} MiB"
        )


def _opt(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def summary(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    checks = []
    for r in rows:
        if r.get("target") is None:
            continue
        value = r["ratio"] if "ratio" in r else r["ratio_to_never"]
        checks.append(
            {
                "target": f"{r['row']} <= {r['target']:.2f}",
                "measured": value,
                "pass": value <= r["target"],
            }
        )
    print()
    print("summary")
    for c in checks:
        print(
            f"  {c['target']:<44} measured {c['measured']:.3f}  {'PASS' if c['pass'] else 'MISS'}"
        )
    return checks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--repeats", type=int, default=15, help="timed rounds per row")
    parser.add_argument("--skip-memory", action="store_true")
    parser.add_argument("--memory-child", choices=MEMORY_MODES, help=argparse.SUPPRESS)
    parser.add_argument("--fixed-child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.memory_child:
        print(json.dumps(memory_child(args.memory_child)))
        return
    torch.set_num_threads(1)
    if args.fixed_child:
        print(json.dumps(fixed_costs(args.repeats, args.fixed_child)))
        return
    start = time.perf_counter()
    rows = overhead_single(args.repeats) + overhead_chunked(args.repeats)
    rows += fixed_costs(args.repeats)
    rows += run_child("--fixed-child", FIXED_OMP1_LABEL, {"OMP_NUM_THREADS": "1"})
    if not args.skip_memory:
        rows += memory_rows()
    print_header()
    print_overhead(rows)
    print_memory(rows)
    checks = summary(rows)
    elapsed = time.perf_counter() - start
    print(f"\n{elapsed:.0f} s")
    record = {
        "command": command_line(),
        "torch": torch.__version__,
        "fxpipe": fxpipe.__version__,
        "python": platform.python_version(),
        "cores": os.cpu_count(),
        "cores_usable": usable_cores(),
        "torch_threads": torch.get_num_threads(),
        "repeats": args.repeats,
        "seconds": elapsed,
        "rows": rows,
        "summary": checks,
    }
    save_json(args.out, record)


if __name__ == "__main__":
    main()
