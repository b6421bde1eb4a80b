"""The GPU benchmark's step time and peak memory sections."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import fxpipe
from benchmarks.gpu.device import Device
from benchmarks.gpu.run import Run
from benchmarks.gpu.settings import CHUNKS, MIB, MODES, STAGES, Sizes, make_model
from benchmarks.gpu.table import fmt
from benchmarks.harness.mlp import chunked_step, plain_step
from fxpipe.passes.split.plan import PARAM_COPIES


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
            f"  {row['variant']:<20} peak {fmt(row['peak_mib'], '.1f')} MiB  /plain "
            f"{fmt(row['vs_plain'])}  /never {fmt(row['vs_never'])}  plan "
            f"{fmt(row['plan_vs_never'])}",
            flush=True,
        )
    print(f"  GPipe estimate always/never {rec['gpipe_always_vs_never']:.3f}", flush=True)
    if not dev.cuda:
        print("  (dry run: resident-size stand-in; freed memory is reused, not comparable)")


def _ratio(a: int | None, b: int | None) -> float | None:
    return None if a is None or b is None or b <= 0 else a / b
