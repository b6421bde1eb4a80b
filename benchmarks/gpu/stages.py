"""The GPU benchmark's stage sections: each stage's time against the plan's prediction, and
copy/compute overlap of the boundary values."""

from __future__ import annotations

import statistics
from typing import Any

import torch
from torch import nn

import fxpipe
from benchmarks.gpu.device import Device
from benchmarks.gpu.run import Run
from benchmarks.gpu.settings import CHUNKS, MIB, STAGES, Sizes, make_model
from benchmarks.gpu.steps import pipeline_on
from fxpipe.runtime.stream import current_stream, new_stream, use_stream, wait_stream


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
