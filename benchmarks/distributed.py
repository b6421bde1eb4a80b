"""Training throughput of fxpipe plans on torch.distributed.pipelining against one eager process.

Run from the repository root::

    python -m benchmarks.distributed [--out PATH] [--steps N] [--rounds R] [--chunks M]

A balanced deep model (8 pre-LayerNorm residual MLP blocks, width 512, hidden 1024) trains
with SGD on a batch of ``M`` micro-batches (``--chunks``, 32 by default) of 4 samples of 128
tokens each (every matrix product has 128 rows per sample): 128 samples by default. Side by
side in one run, ``--rounds`` times in turn:

- eager: the whole model in this process, one torch thread, the whole batch at once;
- eager-mb: the same, in the pipelines' micro-batches one after the other (gradient
  accumulation): the work of the pipelines without the pipeline, to read the speed-ups by;
- GPipe and 1F1B: ``fxpipe.distributed.pipeline_schedule`` in 2 processes (gloo on
  loopback), one torch thread each, 2 stages, the same micro-batches of 4 samples, the same
  global batch, loss (sum-reduced, ``scale_grads=False``) and optimizer: the 2 x 1 layout;
- interleaved and loopedbfs: interleaved 1F1B and the looped breadth-first schedule on the
  same 2 processes, each holding 2 of 4 stages (0 and 2, 1 and 3): the fill of a stage's
  share of a micro-batch, half of 1F1B's, for a boundary more to cross each way;
- zbv: the zero-bubble V schedule (``ZBVZeroBubble``) on the same 2 processes, each holding
  2 of 4 stages (0 and 3, 1 and 2), backward split into its input and weight parts, which
  fill the bubble the other two schedules leave at each end of a step;
- ddp and fsdp: the 1 x 2 layout, the same call with a ``(pp, dp) = (1, 2)`` mesh: each
  process trains on half the batch in one go, and DDP averages the gradients (``fsdp``:
  FSDP2, each process holding half of every parameter; the loss counts each half twice,
  so the gradients are the others');
- halves: how this machine scales to 2 busy processes: 2 processes that each train the
  whole model on half the batch at the same time, with no communication at all (DDP
  without its all-reduce). Two busy processes share the machine's caches and memory
  bandwidth, so each runs slower than one alone;
- work, looped-work and zbv-work: the bound for the pipelines, measured: 2 processes that
  each run their pipeline rank's own work at the same time, with nothing sent and nothing
  waited for (each stage of the rank, built by ``pipeline_schedule`` as for GPipe and 1F1B,
  for interleaved 1F1B and looped BFS, or for ZBV, runs forward and backward on every
  micro-batch, on the inputs its first micro-batch had in a real step; zbv-work splits the
  backward as ZBV does). A pipeline rank does that work and more (it sends, receives and
  waits), so a schedule's speed-up is at most its work row's; GPipe and 1F1B on 2 stages
  also wait one micro-batch's forward and backward (the second rank for the first
  forward, the first rank for the last backward), so they reach at most
  work x m / (m + 1); interleaved 1F1B and looped BFS wait one stage's share of that, half
  a rank's, so at most looped-work x 2m / (2m + 1).

Why 32 micro-batches of 512 rows: with ``m`` micro-batches two stages are busy together for
all but one micro-batch's time, so the pipeline's speed-up is at most ``2 m / (m + 1)``:
1.78x at 8, 1.88x at 16, 1.94x at 32. At 16 that leaves the 1.8x target 4% for everything
else (the two processes slowing each other, the sends, a shared host's noise), and runs at
16 met it in one of three (``benchmarks/docs/distributed.md``); 32 is what GPipe's and torchgpipe's
throughput benchmarks use (AmoebaNet-D, m = 32). More micro-batches of the same size make
a larger batch, not smaller pieces of work: a pipeline computes every weight gradient once
per micro-batch and adds it to the last, which moves the whole weight matrix each time; at
8 rows per micro-batch that memory traffic, and BLAS's poor speed on products with an inner
size of 8, cost more on one CPU core than the arithmetic (16 such micro-batches took 2-3
times as long as their batch in one go); at 512 rows they take about as long (the eager-mb
row), as on an accelerator, and what is left is the schedule's bound.

Each measurement runs ``--warmup`` steps first (not timed; start-up and planning are not
timed either), then ``--steps`` timed steps; a pipelined step is timed between barriers on
every rank and the slowest rank counts. The table shows medians over the rounds; a
speed-up is the median of the rounds' ratios to the faster of eager and eager-mb in the same
round: which of the two is faster depends on the host's caches (on some, the whole batch at
once runs slower than its micro-batches), and a speed-up over the slower would count its
loss as the pipeline's gain; the columns ``vs eager`` and ``vs eager-mb`` give both. The
target: the best pipeline >= 1.8x on a 2-core machine. Printed beside it, from the same
run: the bounds the work rows set, what each schedule reaches of its bound, and the
schedule's own bound ``2 m / (m + 1)``; the verdict says when no schedule's bound reaches
the target. Beside the measurements,
``fd.suggest_layout``'s predictions for the pipelined and 1 x 2 layouts (node costs profiled
here on one thread, sends over an assumed 2 GB/s) and the ranking each gives. ``cpu ms``
is the CPU time per step of the busiest process: on a machine shared with other work the
wall-clock ratios shrink, while the CPU times show the work each process does. The rows
and the settings go to ``benchmarks/results/distributed.json``.
"""

from __future__ import annotations

import argparse
import functools
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

import fxpipe.distributed as fd
from benchmarks.harness.output import result_path, save_json
from benchmarks.harness.processes import on_ranks

WIDTH, HIDDEN, DEPTH, TOKENS, MICRO = 512, 1024, 8, 128, 4
#: Micro-batches per step by default (``--chunks``); the batch is ``chunks * MICRO`` samples.
CHUNKS = 32
TARGET = 1.8


class Block(nn.Module):
    """Pre-LayerNorm residual MLP block."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.fc1 = nn.Linear(WIDTH, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class DeepResMLP(nn.Module):
    """Input projection, ``DEPTH`` equal residual blocks, a LayerNorm and a linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(WIDTH, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(DEPTH))
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))


def _model() -> nn.Module:
    torch.manual_seed(0)
    return DeepResMLP()


def _batch(chunks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and targets of one step: ``chunks`` micro-batches of ``MICRO`` samples."""
    g = torch.Generator().manual_seed(1)
    shape = (chunks * MICRO, TOKENS, WIDTH)
    return torch.randn(shape, generator=g), torch.randn(shape, generator=g)


def _loss(out: torch.Tensor, target: torch.Tensor, *, batch: int) -> torch.Tensor:
    """Squared error summed, over the ``batch`` samples of the whole step."""
    return ((out - target) ** 2).sum() / batch


def eager(warmup: int, steps: int, chunks: int, split: bool) -> dict[str, float]:
    """Wall and CPU seconds per training step of the whole model here, on one thread, on
    the batch of ``chunks`` micro-batches: at once, or (``split``) one micro-batch after the
    other, their gradients adding up."""
    torch.set_num_threads(1)
    model, (x, y) = _model(), _batch(chunks)
    loss = functools.partial(_loss, batch=len(x))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    parts = chunks if split else 1
    for i in range(warmup + steps):
        if i == warmup:
            start, cpu = time.perf_counter(), time.process_time()
        for xs, ys in zip(x.chunk(parts), y.chunk(parts)):
            loss(model(xs), ys).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    return {"step_s": wall / steps, "cpu_s": cpu / steps}


def _replica_loss(out: torch.Tensor, target: torch.Tensor, *, batch: int) -> torch.Tensor:
    """``_loss`` for one of 2 data-parallel replicas: DDP averages the replicas' gradients,
    so each counts its half of the batch twice to give the gradients of ``_loss``."""
    return 2 * _loss(out, target, batch=batch)


def _rank(
    rank: int, world: int, schedule: str, warmup: int, steps: int, chunks: int
) -> dict[str, Any]:
    x, y = _batch(chunks)
    loss, replica_loss = (functools.partial(f, batch=len(x)) for f in (_loss, _replica_loss))
    if schedule == "halves":  # the whole model on this rank's half; nothing sent in a step
        x, y = x.chunk(world)[rank], y.chunk(world)[rank]
        model = _model()
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        return _timed(warmup, steps, lambda: replica_loss(model(x), y).backward(), opt)
    if schedule in ("ddp", "fsdp"):  # 1 stage x 2 replicas: half the batch each, whole
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("pp", "dp"))
        x, y = x.chunk(world)[rank], y.chunk(world)[rank]
        pipe = fd.pipeline_schedule(
            _model(), x, schedule="gpipe", n_microbatches=1, loss_fn=replica_loss, mesh=mesh,
            data_parallel=schedule,
        )  # fmt: skip
    else:
        kind, per_rank = PIPELINED[schedule]
        pipe = fd.pipeline_schedule(
            _model(), x, schedule=kind, n_microbatches=chunks, loss_fn=loss,
            stages_per_rank=per_rank, scale_grads=False,
        )  # fmt: skip
    opt = torch.optim.SGD(pipe.parameters(), lr=1e-3)

    def step() -> None:
        if pipe.is_first and pipe.is_last:
            pipe.schedule.step(x, target=y)
        elif pipe.is_first:
            pipe.schedule.step(x)
        else:
            pipe.schedule.step(target=y)

    if schedule.endswith("work"):
        work = _own_work(pipe, step, y.chunk(chunks), loss, split=schedule == "zbv-work")
        return _timed(warmup, steps, work, opt)
    return _timed(warmup, steps, step, opt, [s.cost for s in pipe.plan.stages])


def _own_work(
    pipe: fd.DistributedPipeline,
    step: Callable[[], None],
    targets: tuple[torch.Tensor, ...],
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    split: bool,
) -> Callable[[], None]:
    """A step of this rank's own work in the pipeline with nothing sent and nothing waited
    for: each of its stages runs forward and backward on every micro-batch, one after the
    other, as the torch stage runs them (its backward in input and weight parts where
    ``split``, as ZBV does, but on stage 0), by the stage's own backward method. Each stage
    takes the inputs its first micro-batch had in one real ``step``, and one that does not
    end in the loss takes its outputs' own values as their gradients."""
    seen: dict[int, tuple[Any, ...]] = {}

    def keep(index: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            seen.setdefault(index, tuple(a.detach().clone() for a in args))

        return hook

    handles = [
        s.submod.register_forward_pre_hook(keep(s.stage_index), with_kwargs=True)
        for s in pipe.stages
    ]
    step()
    for handle in handles:
        handle.remove()
    last = pipe.num_stages - 1

    def work() -> None:
        for ys in targets:
            for s in pipe.stages:
                index = s.stage_index
                inputs = [a.clone().requires_grad_(index != 0) for a in seen[index]]
                out = s.submod(*inputs)
                outs = [loss(out, ys)] if index == last else list(out)
                grads = None if index == last else [o.detach() for o in outs]
                parts = {"output_grads": grads, "input_values": inputs}
                if split and index != 0:  # torch's stage 0 runs its backward whole
                    _, groups = s.backward_maybe_with_nosync(
                        "input", {"stage_output": outs, **parts}
                    )
                    s.backward_maybe_with_nosync("weight", {"param_groups": groups})
                else:  # torch hands the loss over bare, the outputs with their gradients
                    bare = outs[0] if index == last else outs
                    s.backward_maybe_with_nosync("full", {"stage_output": bare, **parts})

    return work


def _timed(
    warmup: int,
    steps: int,
    step: Callable[[], Any],
    opt: torch.optim.Optimizer,
    costs: list[float] | None = None,
) -> dict[str, Any]:
    """``warmup`` untimed steps, then ``steps`` timed between barriers (``step`` and an
    optimizer step each): the slowest rank's wall and CPU seconds per step, and ``costs``."""
    for i in range(warmup + steps):
        if i == warmup:
            dist.barrier()
            start, cpu = time.perf_counter(), time.process_time()
        step()
        opt.step()
        opt.zero_grad(set_to_none=True)
    dist.barrier()
    spent = torch.tensor([time.perf_counter() - start, time.process_time() - cpu])
    dist.all_reduce(spent, op=dist.ReduceOp.MAX)
    return {"step_s": spent[0].item() / steps, "cpu_s": spent[1].item() / steps,
            "costs": costs or []}  # fmt: skip


def pipelined(
    schedule: str, warmup: int, steps: int, chunks: int, world: int = 2
) -> dict[str, Any]:
    """Wall seconds per step and CPU seconds per step of the busiest rank, pipelined."""
    result: dict[str, Any] = on_ranks(_rank, world, schedule, warmup, steps, chunks)
    return result


MODES = (
    ("eager", 1),
    ("eager-mb", 1),
    ("gpipe", 2),
    ("1f1b", 2),
    ("interleaved", 2),
    ("loopedbfs", 2),
    ("zbv", 2),
    ("ddp", 2),
    ("fsdp", 2),
    ("halves", 2),
    ("work", 2),
    ("looped-work", 2),
    ("zbv-work", 2),
)
PIPELINES = ("gpipe", "1f1b", "interleaved", "loopedbfs", "zbv")
#: The pipelines and work rows: torch schedule and stages per rank (two: in a V for ZBV, 0 and
#: 3, 1 and 2; looped for the others, 0 and 2, 1 and 3). A work row builds its schedule's.
PIPELINED = {"gpipe": ("gpipe", 1), "1f1b": ("1f1b", 1), "work": ("gpipe", 1),
             "interleaved": ("interleaved1f1b", 2), "loopedbfs": ("loopedbfs", 2),
             "looped-work": ("interleaved1f1b", 2), "zbv": ("zbvzerobubble", 2),
             "zbv-work": ("zbvzerobubble", 2)}  # fmt: skip
#: The layouts fd.suggest_layout predicts (all but the halves, which is no layout).
LAYOUTS = ("gpipe", "1f1b", "interleaved", "loopedbfs", "zbv", "ddp", "fsdp")


def measure(
    rounds: int, warmup: int, steps: int, chunks: int, failures: list[str]
) -> tuple[dict[str, list[Any]], list[float]]:
    """Every mode once per round, in turn; per mode the list of its rounds' results. A run
    whose process dies (one aborted here once, from the C++ side of gloo or torch, in many
    runs) is run again once, and said in ``failures``."""
    runs: dict[str, list[Any]] = {name: [] for name, _ in MODES}
    costs: list[float] = []
    for r in range(rounds):
        runs["eager"].append(eager(warmup, steps, chunks, split=False))
        runs["eager-mb"].append(eager(warmup, steps, chunks, split=True))
        for schedule, _ in MODES[2:]:
            try:
                result = pipelined(schedule, warmup, steps, chunks)
            except mp.ProcessExitedException as e:  # said, and counted in the JSON
                print(f"round {r + 1}: {schedule}: a process died ({e}); running it again")
                failures.append(f"round {r + 1}, {schedule}: {e}")
                result = pipelined(schedule, warmup, steps, chunks)
            if schedule in ("gpipe", "1f1b"):
                costs = result["costs"]
            result.pop("costs")
            runs[schedule].append(result)
        line = ", ".join(f"{k} {v[-1]['step_s'] * 1e3:.0f} ms" for k, v in runs.items())
        print(f"round {r + 1}/{rounds}: {line}", flush=True)
    return runs, costs


def table(runs: dict[str, list[Any]], chunks: int) -> list[dict[str, Any]]:
    """One row per mode: medians over rounds; speed-up = median of per-round ratios."""
    rows: list[dict[str, Any]] = []
    for name, procs in MODES:
        walls = [r["step_s"] for r in runs[name]]
        # the speed-up is over the faster of the two single processes in the same round
        one = [min(e["step_s"], m["step_s"]) for e, m in zip(runs["eager"], runs["eager-mb"])]
        ratios = [o / w for o, w in zip(one, walls)]
        per_eager = [e["step_s"] / r["step_s"] for e, r in zip(runs["eager"], runs[name])]
        per_mb = [e["step_s"] / r["step_s"] for e, r in zip(runs["eager-mb"], runs[name])]
        step = statistics.median(walls)
        rows.append(
            {
                "mode": name,
                "processes": procs,
                "threads_per_process": 1,
                "stages": 2 * PIPELINED[name][1] if name in PIPELINED else 1,
                "replicas": 2 if name in ("ddp", "fsdp", "halves") else 1,
                "micro_batches": 1 if name in ("eager", "ddp", "fsdp", "halves") else chunks,
                "step_ms": step * 1e3,
                "cpu_ms_busiest_process": statistics.median(r["cpu_s"] for r in runs[name]) * 1e3,
                "samples_per_s": chunks * MICRO / step,
                "speedup": statistics.median(ratios),
                "speedup_over_eager": statistics.median(per_eager),
                "speedup_over_eager_mb": statistics.median(per_mb),
                "round_step_ms": [w * 1e3 for w in walls],
                "round_speedups": ratios,
            }
        )
    return rows


#: Bytes/s assumed between the 2 processes for the prediction (gloo on loopback, one thread).
LOOPBACK = 2e9


def predict(rows: list[dict[str, Any]], chunks: int) -> dict[str, float]:
    """Each measured layout's step time as ``fd.suggest_layout`` predicts it on 2 ranks:
    node costs profiled here on one thread (the ranks' setting), sends and the all-reduce
    over :data:`LOOPBACK`."""
    torch.set_num_threads(1)
    x, _ = _batch(chunks)
    layouts = fd.suggest_layout(
        _model(), x, 2, cost="time", device="cpu",
        schedules=("gpipe", "1f1b", "interleaved1f1b", "loopedbfs", "zbvzerobubble"),
        virtual=(2,), chunks=(1, chunks), link_bandwidth=LOOPBACK, dp_bandwidth=LOOPBACK,
        data_parallel=("ddp", "fsdp"),
    )  # fmt: skip
    # mode -> (pp, dp, stages per rank, micro-batches, schedule; None for data parallel)
    wanted = {mode: (2, 1, PIPELINED[mode][1], chunks, PIPELINED[mode][0]) for mode in PIPELINES}
    wanted |= {"ddp": (1, 2, 1, 1, None), "fsdp": (1, 2, 1, 1, None)}
    out = {}
    for mode, (pp, dp, v, m, schedule) in wanted.items():
        kind = mode if dp > 1 else "ddp"
        (layout,) = [
            e
            for e in layouts
            if (e.pp, e.dp, e.virtual, e.chunks) == (pp, dp, v, m)
            and schedule in (None, e.schedule)
            and e.data_parallel == kind
        ][:1]
        out[mode] = layout.step_s * 1e3
    assert {r["mode"] for r in rows if r["mode"] in LAYOUTS} == set(out)
    return out


def _options() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=result_path("distributed"))
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--chunks", type=int, default=CHUNKS, help=f"micro-batches of {MICRO} samples per step"
    )
    opts = parser.parse_args()
    if opts.chunks < 4 or opts.chunks % 2:
        parser.error(
            f"--chunks {opts.chunks}: pass an even number >= 4 (a micro-batch for each of the "
            "4 stages, in rounds of one per rank for the interleaved schedules)"
        )
    return opts


def _print_rows(rows: list[dict[str, Any]], batch: int, costs: list[float]) -> None:
    print(
        f"\n{DEPTH} residual MLP blocks, width {WIDTH}, hidden {HIDDEN}; batch {batch} x "
        f"{TOKENS} tokens; plan stage costs {[f'{c:.3g}' for c in costs]}"
    )
    print(
        f"{'mode':<11} {'procs':>5} {'threads':>7} {'mb':>3} {'step ms':>9} {'cpu ms':>8} "
        f"{'samples/s':>10} {'speed-up':>9} {'vs eager':>9} {'vs eager-mb':>12}"
    )
    for row in rows:
        print(
            f"{row['mode']:<11} {row['processes']:>5} {row['threads_per_process']:>7} "
            f"{row['micro_batches']:>3} {row['step_ms']:>9.1f} "
            f"{row['cpu_ms_busiest_process']:>8.1f} {row['samples_per_s']:>10.1f} "
            f"{row['speedup']:>8.2f}x {row['speedup_over_eager']:>8.2f}x "
            f"{row['speedup_over_eager_mb']:>11.2f}x"
        )


def _bounds(rows: list[dict[str, Any]], chunks: int) -> dict[str, float]:
    """The speed-ups the work rows allow each kind of schedule, measured in this run, and
    the schedule's own bound ``2 m / (m + 1)``; printed with the verdict."""
    speedup = {row["mode"]: row["speedup"] for row in rows}
    best_mode = max(PIPELINES, key=lambda mode: speedup[mode])
    best = speedup[best_mode]
    bound = 2 * chunks / (chunks + 1)
    ceiling = speedup["halves"]
    # GPipe and 1F1B on 2 stages: the second rank waits for the first micro-batch's forward,
    # the first for the last micro-batch's backward: one micro-batch's work more than a rank's
    bubbled_bound = speedup["work"] * chunks / (chunks + 1)
    # interleaved 1F1B and looped BFS, 2 stages per rank: the same wait, for one stage's share
    # of a micro-batch (half a rank's): 2m / (2m + 1), Megatron-LM's (p - 1) / (v m) at p = 2
    looped_bound = speedup["looped-work"] * 2 * chunks / (2 * chunks + 1)
    zbv_bound = speedup["zbv-work"]
    bubbled = max(speedup["gpipe"], speedup["1f1b"])
    looped = max(speedup["interleaved"], speedup["loopedbfs"])
    verdict = "PASS" if best >= TARGET else "MISS"
    bounds = {
        "GPipe and 1F1B": bubbled_bound,
        "interleaved 1F1B and looped BFS": looped_bound,
        "ZBV": zbv_bound,
    }
    under = [f"{name} at most {b:.3f}x" for name, b in bounds.items() if b < TARGET]
    if best < TARGET and under:
        everything = "no schedule here can reach it" if len(under) == len(bounds) else "under it"
        verdict += f"; {everything} in this run, by the ranks' own work: {', '.join(under)}"
    print(
        f"best pipelined speed-up {best:.2f}x, {best_mode} (target >= {TARGET}x): {verdict}\n"
        f"same run: the ranks' own work with nothing sent and nothing waited for, "
        f"{speedup['work']:.3f}x on 2 stages (work), {speedup['looped-work']:.3f}x on 4 "
        f"looped (looped-work) and {zbv_bound:.3f}x on ZBV's 4 with the backward split "
        f"(zbv-work); GPipe and 1F1B add one micro-batch's work to theirs, so reach at most "
        f"work x m / (m + 1) = {bubbled_bound:.3f}x (their schedule alone: 2m / (m + 1) = "
        f"{bound:.2f}x) and the better reaches {bubbled / bubbled_bound:.0%} of that; "
        f"interleaved 1F1B and looped BFS add half of one, at most looped-work x 2m / (2m + 1) "
        f"= {looped_bound:.3f}x, and the better reaches {looped / looped_bound:.0%}; ZBV "
        f"reaches {speedup['zbv'] / zbv_bound:.0%} of its work's; 2 busy processes each "
        f"training the whole model on half the batch (halves) {ceiling:.2f}x, DDP "
        f"{speedup['ddp'] / ceiling:.0%} of that"
    )
    return {
        "bound_speedup": bound,
        "halves_speedup": ceiling,
        "gpipe_1f1b_work_bound_speedup": bubbled_bound,
        "looped_work_bound_speedup": looped_bound,
        "zbv_work_bound_speedup": zbv_bound,
    }


def _print_predictions(rows: list[dict[str, Any]], chunks: int) -> None:
    """Each layout's predicted step beside its measured one (added to its row), the rankings
    both give, and the pipeline's step against data parallelism's."""
    ddp = next(row for row in rows if row["mode"] == "ddp")
    measured = [row for row in rows if row["mode"] in LAYOUTS]
    predicted = predict(rows, chunks)
    for row in measured:
        row["predicted_step_ms"] = predicted[row["mode"]]
    print("predicted (fd.suggest_layout, cost='time' on this CPU) against measured step:")
    for row in measured:
        print(
            f"  {row['mode']:<11} predicted {row['predicted_step_ms']:8.1f} ms, measured "
            f"{row['step_ms']:8.1f} ms ({row['step_ms'] / row['predicted_step_ms']:.2f}x)"
        )
    by_prediction = sorted(measured, key=lambda r: r["predicted_step_ms"])
    by_measure = sorted(measured, key=lambda r: r["step_ms"])
    print(
        f"ranking, predicted: {', '.join(r['mode'] for r in by_prediction)}; measured: "
        f"{', '.join(r['mode'] for r in by_measure)}"
    )
    piped = min(r["step_ms"] for r in rows if r["mode"] in PIPELINES)
    print(
        f"step time, 2 x 1 (pipeline, best schedule) / 1 x 2 (data parallel): "
        f"{piped / ddp['step_ms']:.2f}"
    )


def main() -> None:
    opts = _options()
    chunks, batch = opts.chunks, opts.chunks * MICRO
    load_before = os.getloadavg()[0]
    failures: list[str] = []
    runs, costs = measure(opts.rounds, opts.warmup, opts.steps, chunks, failures)
    rows = table(runs, chunks)
    _print_rows(rows, batch, costs)
    bounds = _bounds(rows, chunks)
    _print_predictions(rows, chunks)
    print(f"load average (1 min) before / after: {load_before:.2f} / {os.getloadavg()[0]:.2f}")
    print(f"runs again after a process died: {len(failures)}")
    settings = {
        "width": WIDTH,
        "hidden": HIDDEN,
        "depth": DEPTH,
        "batch": batch,
        "micro_batches": chunks,
        "tokens": TOKENS,
        "micro_batch": MICRO,
        "steps": opts.steps,
        "warmup": opts.warmup,
        "rounds": opts.rounds,
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "machine": platform.machine(),
        "python": sys.version.split()[0],
        "load_average_before": load_before,
    }
    result = {
        "rows": rows,
        "stage_costs": costs,
        "target_speedup": TARGET,
        **bounds,
        "runs_again_after_a_process_died": failures,
        "settings": settings,
    }
    save_json(opts.out, result)


if __name__ == "__main__":
    main()
