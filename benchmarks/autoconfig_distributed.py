"""Automatic configuration on 2 processes: ``fd.pipeline_schedule(..., schedule="auto",
n_microbatches="auto")`` against every schedule and micro-batch count of a grid, each
measured the same way in one run.

Run from the repository root::

    python -m benchmarks.autoconfig_distributed [--out PATH] [--repeats N] [--models a,b]

Per model (a residual MLP on a large batch, a GPT-2 decoder, a BERT encoder), 2 processes
(gloo on loopback, one torch thread each), one pipeline rank each:

1. The automatic pipeline is built first; what it weighed (``pipe.schedule_choice``: every
   schedule ``fd.pipeline_schedule`` runs on 2 ranks, the looped ones with 2 and 4 stages
   per rank, every micro-batch count that divides the batch) with a count of 1, 2, 4, 8,
   16 or 32 is the grid, and each of its configurations gets a pipeline of its own, on its
   own copy of the model.
2. One training step of each (forward, the loss, backward; no optimizer), round by round,
   the order flipped every round (``benchmarks.harness.timing``), every step started on
   both ranks together by a barrier; a step's time is its slower rank's. Step time: the
   median over rounds; a ratio: the median of per-round ratios.

Read per model: the automatic configuration's step over the grid's best (target <= 1.05
on at least 4 of 5 models, here the same share of the models run; never above 1.15), and
its predicted step over its measured one (the prediction error). Where the chosen
configuration is in the grid, its time is the grid's run of it, and the automatic
pipeline's own run is shown beside it: two pipelines of one configuration differ by the
machine's noise, which that pair measures.
"""

from __future__ import annotations

import argparse
import copy
import math
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import fxpipe.distributed as fd
from benchmarks.harness.machine import machine_record
from benchmarks.harness.models.steps import MODELS as STEP_MODELS
from benchmarks.harness.models.steps import TinyProducts
from benchmarks.harness.models.zoo_nets import ResidualMLP
from benchmarks.harness.output import command_line, format_table, result_path, save_json
from benchmarks.harness.processes import on_ranks
from benchmarks.harness.timing import paired_ratio, time_interleaved
from fxpipe.distributed.options import SCHEDULES

WORLD = 2
GRID_CHUNKS = (1, 2, 4, 8, 16, 32)
AUTO = "auto"
#: Targets: auto over the grid's best within WITHIN on SHARE of the models (4 of 5 in the
#: issue), and never above NEVER_OVER.
WITHIN, SHARE, NEVER_OVER = 1.05, 0.8, 1.15
_NAMES = {s.lower(): s for s in SCHEDULES}

#: (model, positional inputs, keyword inputs, target, loss of (output, target)).
Problem = tuple[nn.Module, tuple[Any, ...], dict[str, Any], torch.Tensor, Callable[..., Any]]


def _mlp() -> Problem:
    """Small weights, a large batch: activations dominate."""
    model = ResidualMLP(d_in=32, width=64, depth=6)
    x = torch.randn(2048, 32)
    return model, (x,), {}, torch.zeros(2048), lambda out, _: out.pow(2).mean()


def _logits_loss(out: Any, target: torch.Tensor) -> torch.Tensor:
    logits = out["logits"]
    return F.cross_entropy(logits.flatten(0, -2), target.flatten())


def _text(name: str) -> Callable[[], Problem]:
    """A transformers model of the step models; its labels become the target of a loss on
    the logits, outside the model (the last stage computes it)."""

    def build() -> Problem:
        model, (args, kwargs), _ = STEP_MODELS[name]()
        kwargs = dict(kwargs)
        target = kwargs.pop("labels")
        return model, args, kwargs, target, _logits_loss

    return build


MODELS: dict[str, Callable[[], Problem]] = {
    "mlp": _mlp,
    "decoder": _text("decoder"),
    "encoder": _text("encoder"),
}


def _label(schedule: str, virtual: int, chunks: int) -> str:
    looped = virtual > 1 and schedule not in ("zbvzerobubble", "dualpipev")
    return f"{_NAMES[schedule]}{f' v={virtual}' if looped else ''} M={chunks}"


def _build(problem: Problem, schedule: str, chunks: int | str, virtual: int) -> Any:
    model, args, kwargs, _, loss = problem
    return fd.pipeline_schedule(
        copy.deepcopy(model), args, example_kwargs=kwargs, schedule=schedule,
        n_microbatches=chunks, loss_fn=loss, stages_per_rank=virtual,
    )  # fmt: skip


def _step(pipe: Any, problem: Problem) -> Callable[[], None]:
    _, args, kwargs, target, _ = problem
    inputs = (args, kwargs) if pipe.is_first else ((), {})
    last = target if pipe.is_last else None

    def run() -> None:
        pipe.step(*inputs[0], target=last, **inputs[1])

    return run


def rank_job(rank: int, world: int, name: str, repeats: int, warmup: int) -> dict[str, Any]:
    """On every rank: the automatic pipeline, the grid's, their steps timed side by side;
    each step's time is the slower rank's. Returns the times and what auto weighed."""
    torch.manual_seed(0)
    problem = MODELS[name]()
    problem[0].train()
    started = time.perf_counter()
    auto = _build(problem, AUTO, AUTO, 1)
    choice = auto.schedule_choice
    grid = [e for e in choice.weighed if e.chunks in GRID_CHUNKS]
    pipes = {_label(e.schedule, e.virtual, e.chunks): _build(problem, e.schedule, e.chunks,
             e.virtual) for e in grid}  # fmt: skip
    pipes[AUTO] = auto
    built = time.perf_counter() - started
    holder = nn.ModuleList(m for p in pipes.values() for m in p.stage_modules)
    steps = {label: _step(p, problem) for label, p in pipes.items()}
    times = time_interleaved(holder, steps, repeats, warmup=warmup, budget_s=math.inf,
                             sync=dist.barrier)  # fmt: skip
    slowest = {}
    for kind in ("wall", "cpu"):
        spent = torch.tensor([times[kind][label] for label in pipes], dtype=torch.float64)
        dist.all_reduce(spent, op=dist.ReduceOp.MAX)
        slowest[kind] = {label: spent[i].tolist() for i, label in enumerate(pipes)}
    return {
        "build_s": built,
        "batch": int(choice.weighed[0].chunks * choice.weighed[0].micro_batch),
        "choice": _label(choice.schedule, choice.stages_per_rank, choice.n_microbatches),
        "summary": choice.summary(),
        "weighed": len(choice.weighed),
        "predicted_s": {_label(e.schedule, e.virtual, e.chunks): e.step_s for e in grid}
        | {AUTO: choice.weighed[0].step_s},
        "wall_s": slowest["wall"],
        "cpu_s": slowest["cpu"],
    }


def measure(name: str, repeats: int, warmup: int) -> dict[str, Any]:
    """One model's row: every configuration's median step, the grid's best, auto's."""
    got = on_ranks(rank_job, WORLD, name, repeats, warmup)
    wall, predicted = got["wall_s"], got["predicted_s"]
    median = {k: statistics.median(v) for k, v in wall.items()}
    grid = {k: v for k, v in median.items() if k != AUTO}
    best = min(grid, key=grid.__getitem__)
    chosen = got["choice"]
    same = chosen if chosen in grid else AUTO  # the grid's run of the same configuration
    by_measure = sorted(grid, key=grid.__getitem__)
    by_prediction = sorted(grid, key=predicted.__getitem__)
    return {
        "model": name,
        "batch": got["batch"],
        "configurations": len(grid),
        "weighed": got["weighed"],
        "build_s": round(got["build_s"], 1),
        "rounds": len(wall[AUTO]),
        "step_ms": {k: round(1e3 * v, 3) for k, v in median.items()},
        "cpu_ms": {k: round(1e3 * statistics.median(v), 3) for k, v in got["cpu_s"].items()},
        "predicted_ms": {k: round(1e3 * v, 3) for k, v in predicted.items()},
        "best": best,
        "best_ms": 1e3 * median[best],
        "auto_choice": chosen,
        "auto_summary": got["summary"],
        "auto_ms": 1e3 * median[same],
        "auto_own_ms": 1e3 * median[AUTO],
        "auto_measured_as": same,
        "auto_over_best": paired_ratio(wall, same, best),
        "auto_own_over_best": paired_ratio(wall, AUTO, best),
        "auto_rank_measured": by_measure.index(same) + 1 if same in grid else None,
        "best_rank_predicted": by_prediction.index(best) + 1,
        "predicted_ms_auto": 1e3 * predicted[AUTO],
        "prediction_error": predicted[AUTO] / median[same] - 1.0,
        "prediction_errors": {k: predicted[k] / median[k] - 1.0 for k in grid},
        "measured_order": by_measure[:5],
        "predicted_order": by_prediction[:5],
    }


def verdicts(rows: list[dict[str, Any]]) -> list[str]:
    ratios = [r["auto_over_best"] for r in rows]
    within = sum(x <= WITHIN for x in ratios)
    need = math.ceil(SHARE * len(rows))
    worst = max(ratios, default=float("nan"))
    ok = within >= need and worst <= NEVER_OVER
    errors = ", ".join(f"{r['model']} {r['prediction_error']:+.0%}" for r in rows)
    spread = ", ".join(
        f"{r['model']} {min(r['prediction_errors'].values()):+.0%} to "
        f"{max(r['prediction_errors'].values()):+.0%}"
        for r in rows
    )
    return [
        f"auto within {WITHIN - 1:.0%} of the grid's best on {within} of {len(rows)} models "
        f"(target >= {need}), worst {worst:.3f} (target <= {NEVER_OVER}): "
        f"{'PASS' if ok else 'MISS'}",
        f"prediction error of the chosen configuration (predicted/measured - 1): {errors}; "
        f"over the whole grid: {spread}",
    ]


def _print(rows: list[dict[str, Any]]) -> None:
    def ms(key: str) -> Callable[[dict[str, Any]], str]:
        return lambda r: f"{r[key]:.1f}"

    columns = [
        ("model", lambda r: r["model"]),
        ("configs", lambda r: str(r["configurations"])),
        ("grid best", lambda r: r["best"]),
        ("best ms", ms("best_ms")),
        ("auto chose", lambda r: r["auto_choice"]),
        ("auto ms", ms("auto_ms")),
        ("own ms", ms("auto_own_ms")),
        ("auto/best", lambda r: f"{r['auto_over_best']:.3f}"),
        ("measured rank", lambda r: str(r["auto_rank_measured"] or "-")),
        ("predicted ms", ms("predicted_ms_auto")),
        ("pred. error", lambda r: f"{r['prediction_error']:+.0%}"),
        ("rounds", lambda r: str(r["rounds"])),
    ]
    print(
        f"\none training step, {WORLD} processes (gloo, one thread each), one pipeline rank "
        "each (ms: median over rounds, the slower rank's; auto/best: median of per-round "
        "ratios; auto ms: the grid's run of the chosen configuration, own ms: auto's own "
        "pipeline; measured rank: the choice's place in the grid by measured step)"
    )
    print(format_table(rows, columns, left=3))
    for r in rows:
        print(
            f"{r['model']}: fastest measured {', '.join(r['measured_order'])}; fastest "
            f"predicted {', '.join(r['predicted_order'])} (the measured best is "
            f"{r['best_rank_predicted']} of {r['configurations']} by prediction)"
        )


# ------------------------------------------------------------------------------ calibrate


#: (schedule, stages per rank, few and many micro-batches), and per micro-batch on a rank:
#: stage passes (forward, backward) and messages (a send or a receive of one border's values:
#: the looped placement's stages all border the other rank; a V's tip sends nothing), and
#: the Parameters whose weight part a split backward computes apart (none for the others).
CALIBRATION = {
    "gpipe": ("gpipe", 1, (1, 32), 2, 2, 0),
    "interleaved1f1b": ("interleaved1f1b", 2, (2, 32), 4, 6, 0),
    "interleavedzerobubble": ("interleavedzerobubble", 2, (2, 32), 4, 6, 8),
    "zbv": ("zbvzerobubble", 2, (4, 32), 4, 4, 8),
}


def calibrate_job(rank: int, world: int, repeats: int) -> dict[str, Any]:
    torch.manual_seed(0)
    x = torch.randn(64, 4)
    tiny = TinyProducts(8, torch.tanh)
    problem: Problem = (tiny, (x,), {}, torch.zeros(64), lambda out, _: out.pow(2).mean())
    pipes = {
        f"{name} M={m}": _build(problem, schedule, m, v)
        for name, (schedule, v, counts, *_) in CALIBRATION.items()
        for m in counts
    }
    holder = nn.ModuleList(m for p in pipes.values() for m in p.stage_modules)
    steps = {label: _step(p, problem) for label, p in pipes.items()}
    times = time_interleaved(holder, steps, repeats, warmup=3, budget_s=math.inf,
                             sync=dist.barrier)  # fmt: skip
    spent = torch.tensor([times["wall"][k] for k in pipes], dtype=torch.float64)
    dist.all_reduce(spent, op=dist.ReduceOp.MAX)
    return {k: spent[i].tolist() for i, k in enumerate(pipes)}


def calibrate(repeats: int) -> dict[str, Any]:
    """The distributed runtime's fixed costs on this machine, fitted (least squares) to each
    schedule's added time per micro-batch on a model of tiny products (8 layers: each
    rank holds 8 Parameters): per stage pass, per message, and per Parameter whose weight
    part a split backward computes apart (torch's weight pass calls autograd once per
    group of Parameters)."""
    wall = on_ranks(calibrate_job, WORLD, repeats)
    median = {k: statistics.median(v) for k, v in wall.items()}
    rows, added = [], []
    for name, (_, _, (few, many), *counts) in CALIBRATION.items():
        per = (median[f"{name} M={many}"] - median[f"{name} M={few}"]) / (many - few)
        rows.append([float(c) for c in counts])
        added.append(per)
    fit = torch.linalg.lstsq(
        torch.tensor(rows, dtype=torch.float64),
        torch.tensor(added, dtype=torch.float64).unsqueeze(1),
    ).solution
    found = [float(v) for v in fit.squeeze(1)]
    for (name, (*_, passes, messages, params)), per, row in zip(
        CALIBRATION.items(), added, rows, strict=True
    ):
        model = sum(c * f for c, f in zip(row, found, strict=True))
        print(f"{name}: {per * 1e6:.0f} us per micro-batch measured, {model * 1e6:.0f} us fitted "
              f"({passes} passes, {messages} messages, {params} Parameters)")  # fmt: skip
    pass_s, message_s, weight_s = found
    print(f"runtime costs: {pass_s * 1e6:.0f} us per stage pass, {message_s * 1e6:.0f} us per "
          f"message, {weight_s * 1e6:.0f} us per Parameter of a split backward")  # fmt: skip
    return {
        "pass_s": pass_s,
        "message_s": message_s,
        "weight_s": weight_s,
        "per_micro_batch_s": dict(zip(CALIBRATION, added, strict=True)),
        "step_ms": {k: round(1e3 * v, 3) for k, v in median.items()},
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--calibrate", action="store_true")
    args = parser.parse_args()
    started = time.time()
    if args.calibrate:
        found = calibrate(max(args.repeats, 15))
        out = Path(args.out) if args.out else result_path("autoconfig_distributed_calibration")
        payload = {"command": command_line(), "machine": machine_record(), **found}
        return save_json(out, payload)
    rows = []
    for name in args.models.split(","):
        rows.append(measure(name, args.repeats, args.warmup))
        print(f"{name}: done ({time.time() - started:.0f} s)", flush=True)
    _print(rows)
    found = verdicts(rows)
    print("\n" + "\n".join(found))
    payload = {
        "command": command_line(),
        "machine": machine_record(),
        "processes": WORLD,
        "seconds": round(time.time() - started, 1),
        "rows": rows,
        "verdicts": found,
    }
    out = Path(args.out) if args.out else result_path("autoconfig_distributed")
    return save_json(out, payload)


if __name__ == "__main__":
    raise SystemExit(main())
