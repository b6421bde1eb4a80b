"""fxpipe's asynchronous pipeline against its synchronous schedules on 2 processes.

``schedule="Async1F1B"`` (1F1B with no flush between steps, each stage updating its own
weights every ``step_every`` micro-batches) against GPipe and 1F1B: accuracy reached per
second of fine-tuning, and the step time.

Run from the repository root::

    python -m benchmarks.async_pipeline [--quick] [--seeds N] [--epochs N] [--rounds N]
                                        [--out PATH]

Needs scikit-learn (``python -m pip install scikit-learn``) for its bundled digits data set
(``sklearn.datasets.load_digits``: 1,797 8x8 images, 10 classes; nothing is downloaded); it
stops with a message saying so when scikit-learn is missing.

The data: the digits, standardized (each pixel by the training split's mean and deviation),
a fixed validation split of 30% (seed 0). The model: an MLP of float32, 64 -> 1024 -> 1024 ->
1024 -> 1024 -> 1024 -> 5 with GELU (4.3 M parameters), which fxpipe splits into 2 stages of
about 2.1 M each (a micro-batch of 16 rows: about 7 ms of forward and backward per stage on
one core, the activation sent 64 KiB). It is pre-trained once, in this process (eager, one
thread, seed 0, 5 epochs of SGD), on classes 0-4; every run starts from those weights.

Every pipeline runs on 2 processes (gloo on loopback, one torch thread each, one stage each;
started afresh for each seed and for the step times), built by
``fxpipe.distributed.pipeline_schedule`` with ``scale_grads=False`` and a loss of the
micro-batch's mean cross-entropy over M (the gradients of a batch's mean, whichever the
schedule); SGD with momentum 0.9 over ``pipe.parameters()``. The synchronous ones run the
torch way (``schedule.step``, ``sync_tied_gradients``, ``opt.step``, ``opt.zero_grad``), the
asynchronous one with ``step_every=M`` and its optimizer given to ``schedule.attach`` (an
update each batch's worth of micro-batches, as the synchronous ones).

1. Fine-tuning on classes 5-9, relabelled 0-4 (the 5-way head re-initialized from the
   run's seed): batches of 32 rows, M = 2 micro-batches of 16, learning rate 0.02, 12
   epochs (19 updates each; the seed sets the head and the data order, each epoch a fresh
   permutation, its last partial batch left out), for synchronous GPipe and 1F1B and the
   asynchronous schedule with each staleness mitigation ("stash", "predict", "none"). For
   each seed the 5 configurations run in one pair of processes, one epoch each in turn (the
   order turned every epoch, so that a slow spell of a shared machine falls on all). An
   epoch's wall time runs from a barrier to a barrier after its last step (after
   ``flush()`` for the asynchronous runs, which a user calls before evaluating); the state
   dict is then gathered and rank 0 measures the validation accuracy with the eager model,
   outside the time. Columns: the final accuracy (mean and least over seeds); the median
   epoch time, and its ratio to GPipe's epoch in the same turn (the median over seeds and
   epochs); the training time; the time to reach GPipe's final accuracy less 0.5 points in
   the same seed (the first epoch of the curve at or above it; "never" if none; the mean
   over the seeds that reach it); "ratio", that time over GPipe's time to its own final
   accuracy (the target's measure as set: <= 0.85x for the best mitigation, reached in
   every seed, the mean over seeds; GPipe's own row shows how much the 0.5 points give);
   "same level", that time over GPipe's time to the same level (like for like), with the
   same target; each with its worst seed. Under the table: both processes' CPU seconds an
   epoch over GPipe's in the same turn (the median over seeds and epochs).
2. Steady-state step time for M = 2, 4, 8, 16 micro-batches of 16 rows (batches of 16 M
   rows): GPipe, 1F1B and the asynchronous schedule ("stash") on one pair of processes,
   rounds of each in turn (the order turned every round); a round is 2 steps of warm-up,
   then 64 / M (at least 4) steps one after another with nothing between them (the
   optimizer's step after each synchronous one), its time per step their span on rank 0
   over their number; a figure is the median over rounds, a ratio the median of the rounds'
   ratios. "CPU": both processes' CPU seconds a step. Beside async / GPipe and async / 1F1B:
   the bubble bound M / (M + K - 1) (K = 2 stages: the synchronous schedules' busy
   fraction, the least the ratio can be when the bubble is all they lose), and the
   machine's, M / (M + b - 1), the same reasoning with two processes at once each running
   at b / 2 of one alone's speed.
3. The crossover: the least M at which GPipe's step time comes within 5% of the
   asynchronous one's.

The bound b: what the two rank processes get done running one stage's forward and backward
(the same layers, 16 rows) at once, over one alone (the other waiting in a barrier, which
does not spin), measured after every fine-tuning epoch and every step-time round: the same
processes, in the same minutes, as the figures it bounds (the medians are printed; a b
under 2 is the machine's: its caches and memory shared, or other work on its cores).

The whole run takes about 8 minutes on 2 cores; ``--quick`` (one seed, 10 epochs, M in 2 and
4, 8 rounds) about 2. The tables and ``benchmarks/results/async_pipeline.json`` hold every
row, every seed's per-epoch curves, times, training losses and bounds, the command, the
commit and the machine. A rank's error comes back with its traceback; a rank that waits
more than 300 s for the other fails (a hang shows as an error).
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import subprocess
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

from benchmarks.harness.machine import load_average, machine_record
from benchmarks.harness.output import ROOT, command_line, format_table, result_path, save_json
from benchmarks.harness.processes import SINGLE_THREAD_ENV, gather_ranks, run_json

#: The MLP: input, hidden widths, classes.
INPUT, HIDDEN, LAYERS, CLASSES = 64, 1024, 5, 5
#: Rows per micro-batch (every run), micro-batches per batch in the fine-tuning.
ROWS, FINETUNE_M = 16, 2
#: SGD with momentum for every configuration; the pre-training's.
LR, MOMENTUM, PRETRAIN_LR, PRETRAIN_EPOCHS = 0.02, 0.9, 0.05, 5
VALIDATION, SPLIT_SEED = 0.3, 0
#: The fine-tuning's configurations: (name, schedule, staleness).
CONFIGS = [
    ("sync GPipe", "gpipe", None),
    ("sync 1F1B", "1f1b", None),
    ("async stash", "Async1F1B", "stash"),
    ("async predict", "Async1F1B", "predict"),
    ("async none", "Async1F1B", "none"),
]
REFERENCE = "sync GPipe"
#: Points below GPipe's final accuracy that count as reaching it; the time ratio's target.
SLACK_POINTS, TARGET = 0.5, 0.85
#: A collective or receive that waits longer than this fails (a hang shows as an error).
TIMEOUT_S = 300
#: Units of work (a stage's forward and backward of a micro-batch) per bound measurement.
BOUND_COUNT = 40


def _needs_sklearn() -> None:
    try:
        import sklearn.datasets  # noqa: F401
    except ImportError:
        raise SystemExit(
            "benchmarks.async_pipeline needs scikit-learn for its bundled digits data set "
            "(sklearn.datasets.load_digits; nothing is downloaded): "
            "python -m pip install scikit-learn"
        ) from None


# ---------------------------------------------------------------------------- data and model


def _data() -> dict[str, Any]:
    """The digits, standardized by the training split's statistics: the pre-training set
    (classes 0-4), the fine-tuning's training and validation sets (classes 5-9 as 0-4)."""
    import numpy as np
    import torch
    from sklearn.datasets import load_digits

    digits = load_digits()
    x, y = digits.data.astype(np.float32), digits.target.astype(np.int64)
    order = np.random.default_rng(SPLIT_SEED).permutation(len(x))
    x, y = x[order], y[order]
    n_val = int(VALIDATION * len(x))
    x_val, y_val, x_train, y_train = x[:n_val], y[:n_val], x[n_val:], y[n_val:]
    mean, std = x_train.mean(0), x_train.std(0)
    std[std == 0] = 1.0  # the pixels that are blank in every training image
    x_train, x_val = (x_train - mean) / std, (x_val - mean) / std

    def part(xs: Any, ys: Any, low: int) -> tuple[Any, Any]:
        keep = (ys >= low) & (ys < low + 5)
        return torch.from_numpy(xs[keep].copy()), torch.from_numpy(ys[keep] - low)

    return {"pretrain": part(x_train, y_train, 0), "pretrain_val": part(x_val, y_val, 0),
            "train": part(x_train, y_train, 5), "val": part(x_val, y_val, 5)}  # fmt: skip


def _mlp() -> Any:
    from torch import nn

    widths = [INPUT] + [HIDDEN] * LAYERS
    layers: list[nn.Module] = []
    for a, b in zip(widths, widths[1:]):
        layers += [nn.Linear(a, b), nn.GELU()]
    return nn.Sequential(*layers, nn.Linear(HIDDEN, CLASSES))


def _accuracy(model: Any, xs: Any, ys: Any) -> float:
    import torch

    with torch.no_grad():
        return 100.0 * float((model(xs).argmax(1) == ys).float().mean())


def _pretrain(path: Path) -> dict[str, Any]:
    """The shared starting point: the MLP trained eagerly on classes 0-4 (one thread, seed
    0), saved to ``path``."""
    import torch
    from torch import nn

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    data = _data()
    xs, ys = data["pretrain"]
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=PRETRAIN_LR, momentum=MOMENTUM)
    g = torch.Generator().manual_seed(0)
    batch = ROWS * FINETUNE_M
    start = time.perf_counter()
    for _ in range(PRETRAIN_EPOCHS):
        perm = torch.randperm(len(xs), generator=g)
        for i in range(len(xs) // batch):
            idx = perm[i * batch : (i + 1) * batch]
            loss = nn.functional.cross_entropy(model(xs[idx]), ys[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
    seconds = time.perf_counter() - start
    torch.save(model.state_dict(), path)
    accuracy = _accuracy(model, *data["pretrain_val"])
    torch.set_num_threads(threads)
    return {"epochs": PRETRAIN_EPOCHS, "lr": PRETRAIN_LR, "seconds": seconds,
            "val_accuracy_0_4": accuracy, "train_rows": len(xs),
            "finetune_train_rows": len(data["train"][0]),
            "finetune_val_rows": len(data["val"][0])}  # fmt: skip


# ---------------------------------------------------------------------------- the ranks


def _on_ranks(spec: dict[str, Any]) -> dict[str, Any]:
    """``spec``'s job on 2 fresh processes (gloo on loopback, one torch thread each): each
    rank's result, by rank; any rank's error (its traceback) raised."""
    return {f["rank"]: f for f in gather_ranks(_rank, spec)}


def _rank(rank: int, port: int, spec: dict[str, Any], results: Any) -> None:
    import torch
    import torch.distributed as dist

    try:
        torch.set_num_threads(1)
        timeout = datetime.timedelta(seconds=TIMEOUT_S)
        store = dist.TCPStore("127.0.0.1", port, world_size=2, is_master=rank == 0,
                              timeout=timeout)  # fmt: skip
        dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=timeout)
        job = _finetune if spec["job"] == "finetune" else _step_times
        out = job(rank, spec)
        dist.barrier()
        dist.destroy_process_group()
        results.put({"rank": rank, **out})
    except BaseException:
        results.put({"rank": rank, "error": traceback.format_exc()})


class _Run:
    """One configuration's pipeline on this rank: the model from the pre-trained weights
    with the seed's head, its pipeline and optimizer."""

    def __init__(self, schedule: str, staleness: str | None, m: int, seed: int,
                 weights: str) -> None:  # fmt: skip
        import torch
        from torch import nn

        import fxpipe.distributed as fd

        model = _mlp()
        model.load_state_dict(torch.load(weights))
        torch.manual_seed(seed)
        model[-1].reset_parameters()  # the new task's head, alike on both ranks

        def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            return nn.functional.cross_entropy(out, target) / m

        self.asynchronous = staleness is not None
        extra: dict[str, Any] = {}
        if self.asynchronous:
            extra = {"staleness": staleness, "step_every": m}
        self.pipe = fd.pipeline_schedule(
            model, torch.zeros(m * ROWS, INPUT), n_microbatches=m, loss_fn=loss_fn,
            schedule=schedule, scale_grads=False, **extra,
        )  # fmt: skip
        self.opt = torch.optim.SGD(self.pipe.parameters(), lr=LR, momentum=MOMENTUM)
        if self.asynchronous:
            self.pipe.schedule.attach(self.opt, lr_scheduler=None, max_grad_norm=None)

    def step(self, x: Any, y: Any, losses: list[Any]) -> None:
        pipe, these = self.pipe, list[Any]()  # torch's schedules clear the list they are given
        if pipe.is_first:
            pipe.schedule.step(x)
        else:
            pipe.schedule.step(target=y, losses=these)
            losses.extend(float(v.detach()) for v in these)
        if not self.asynchronous:
            pipe.sync_tied_gradients()
            self.opt.step()
            self.opt.zero_grad()

    def flush(self) -> None:
        if self.asynchronous:
            self.pipe.schedule.flush()


def _batches(n: int, size: int, seed: int, epoch: int) -> list[Any]:
    """Epoch ``epoch``'s batches of row indices: a permutation from the seed, its last
    partial batch left out (every step takes the example's rows)."""
    import torch

    g = torch.Generator().manual_seed(1000 * seed + epoch)
    perm = torch.randperm(n, generator=g)
    return [perm[i * size : (i + 1) * size] for i in range(n // size)]


class _Work:
    """One stage's share of a micro-batch (2 of the hidden layers, forward and backward, 16
    rows) on this process's one thread: the bound's unit of work."""

    def __init__(self) -> None:
        import torch
        from torch import nn

        torch.manual_seed(0)
        self.stage = nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.GELU(),
                                   nn.Linear(HIDDEN, HIDDEN), nn.GELU())  # fmt: skip
        self.x = torch.randn(ROWS, HIDDEN, requires_grad=True)
        self.seconds(3)

    def seconds(self, count: int) -> float:
        start = time.perf_counter()
        for _ in range(count):
            self.stage(self.x).sum().backward()
        return time.perf_counter() - start


def _pair_bound(rank: int, work: _Work, count: int = BOUND_COUNT) -> dict[str, float]:
    """What the two rank processes get done computing at once over one alone, now: rank 0
    runs ``count`` units alone (rank 1 waits in a barrier, which does not spin), then both
    run them at once; ``2 * alone / slower``."""
    import torch
    import torch.distributed as dist

    dist.barrier()
    alone = work.seconds(count) if rank == 0 else 0.0
    dist.barrier()
    together = torch.tensor([work.seconds(count)], dtype=torch.float64)
    dist.all_reduce(together, op=dist.ReduceOp.MAX)
    slower = float(together)
    return {"alone_s": alone, "together_s": slower, "ratio": 2 * alone / slower}


def _finetune(rank: int, spec: dict[str, Any]) -> dict[str, Any]:
    """Every configuration's fine-tuning for one seed, an epoch of each in turn. Rank 0:
    each epoch's seconds and validation accuracy; rank 1: each epoch's mean training
    loss; both: each epoch's CPU seconds."""
    import torch.distributed as dist

    seed, epochs, m = spec["seed"], spec["epochs"], FINETUNE_M
    data = _data()
    xs, ys = data["train"]
    x_val, y_val = data["val"]
    names = [c[0] for c in CONFIGS]
    runs = {n: _Run(s, st, m, seed, spec["weights"]) for n, s, st in CONFIGS}
    evaluator, work, bounds = _mlp(), _Work(), []
    seconds: dict[str, list[float]] = {n: [] for n in names}
    cpu: dict[str, list[float]] = {n: [] for n in names}
    accuracy: dict[str, list[float]] = {n: [] for n in names}
    loss: dict[str, list[float]] = {n: [] for n in names}

    def evaluate(name: str) -> None:
        state = runs[name].pipe.gather_state_dict()
        if rank == 0:
            evaluator.load_state_dict(state)
            accuracy[name].append(_accuracy(evaluator, x_val, y_val))

    for name in names:  # epoch 0: before any update (the seed's head)
        evaluate(name)
    for epoch in range(epochs):
        batches = _batches(len(xs), m * ROWS, seed, epoch)
        turn = epoch % len(names)
        for name in names[turn:] + names[:turn]:
            run, losses = runs[name], list[float]()
            dist.barrier()
            start, start_cpu = time.perf_counter(), time.process_time()
            for idx in batches:
                run.step(xs[idx], ys[idx], losses)
            run.flush()
            dist.barrier()
            seconds[name].append(time.perf_counter() - start)
            cpu[name].append(time.process_time() - start_cpu)
            if losses:
                loss[name].append(sum(losses) * m / len(losses))
            evaluate(name)
        bounds.append(_pair_bound(rank, work))
    summaries = {n: r.pipe.schedule.summary() for n, r in runs.items() if r.asynchronous}
    if rank == 0:
        return {"seconds": seconds, "accuracy": accuracy, "summaries": summaries, "cpu": cpu,
                "steps_per_epoch": len(xs) // (m * ROWS), "bounds": bounds}  # fmt: skip
    return {"loss": loss, "summaries": summaries, "cpu": cpu}


def _step_times(rank: int, spec: dict[str, Any]) -> dict[str, Any]:
    """Seconds a step on this rank (its timed steps' span over their number), and its CPU
    seconds a step, per round, of GPipe, 1F1B and the asynchronous schedule ("stash") at
    each M; the bound after each round."""
    import torch.distributed as dist

    xs, ys = _data()["train"]
    names = ["gpipe", "1f1b", "async"]
    work = _Work()
    out: dict[str, Any] = {}
    for m in spec["ms"]:
        runs = {
            "gpipe": _Run("gpipe", None, m, 0, spec["weights"]),
            "1f1b": _Run("1f1b", None, m, 0, spec["weights"]),
            "async": _Run("Async1F1B", "stash", m, 0, spec["weights"]),
        }
        warm, timed = 2, max(4, 64 // m)
        batches = _batches(len(xs), m * ROWS, 0, 0)
        rounds: dict[str, list[float]] = {n: [] for n in names}
        cpu_s: dict[str, list[float]] = {n: [] for n in names}
        bounds, k = [], 0
        for r in range(spec["rounds"]):
            turn = r % len(names)
            for name in names[turn:] + names[:turn]:
                run, losses = runs[name], list[float]()
                dist.barrier()
                stamps, cpu = [], []
                for _ in range(warm + timed):
                    idx = batches[k % len(batches)]
                    k += 1
                    run.step(xs[idx], ys[idx], losses)
                    stamps.append(time.perf_counter())
                    cpu.append(time.process_time())
                run.flush()
                dist.barrier()
                rounds[name].append((stamps[-1] - stamps[warm - 1]) / timed)
                cpu_s[name].append((cpu[-1] - cpu[warm - 1]) / timed)
            bounds.append(_pair_bound(rank, work))
        out[str(m)] = {
            "rounds": rounds,
            "warm": warm,
            "timed": timed,
            "bounds": bounds,
            "cpu_s": cpu_s,
        }
        del runs
    return {"steps": out}


# ---------------------------------------------------------------------------- the parent


def _run(spec: dict[str, Any]) -> Any:
    return run_json("benchmarks.async_pipeline", ["--worker", json.dumps(spec)],
                    env=SINGLE_THREAD_ENV, timeout=3600)  # fmt: skip


def _first(curve: list[float], times: list[float], level: float) -> float | None:
    """Cumulative seconds at the first epoch whose accuracy is at least ``level`` (curve[0]
    is before training, at 0 s); None if none is."""
    elapsed = [0.0]
    for t in times:
        elapsed.append(elapsed[-1] + t)
    for acc, at in zip(curve, elapsed):
        if acc >= level - 1e-9:
            return at
    return None


def _finetune_rows(seeds: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The table's rows from every seed's curves, and the target's verdicts: as stated (a
    configuration's time to GPipe's final accuracy less the slack over GPipe's time to its
    own final accuracy) and like for like (over GPipe's time to the same level)."""
    per_seed = []
    for s in seeds:
        ref_curve, ref_times = s["accuracy"][REFERENCE], s["seconds"][REFERENCE]
        final = ref_curve[-1]
        level = final - SLACK_POINTS
        ref_time = _first(ref_curve, ref_times, final)
        ref_level = _first(ref_curve, ref_times, level)
        assert ref_time and ref_level, "GPipe's final accuracy is on its curve, after epoch 0"
        reached = {}
        for name, _, _ in CONFIGS:
            t = _first(s["accuracy"][name], s["seconds"][name], level)
            reached[name] = {
                "time_s": t, "ratio": None if t is None else t / ref_time,
                "same_level": None if t is None else t / ref_level,
                "ratio_over_whole": None if t is None else t / sum(ref_times),
                "epoch_over_reference": [a / b for a, b in zip(s["seconds"][name], ref_times)],
            }  # fmt: skip
        per_seed.append({"seed": s["seed"], "reference_final": final,
                         "reference_time_s": ref_time, "reference_level_time_s": ref_level,
                         "reached": reached})  # fmt: skip
    rows = []
    for name, schedule, staleness in CONFIGS:
        finals = [s["accuracy"][name][-1] for s in seeds]
        hits = [p["reached"][name] for p in per_seed]
        times = [h["time_s"] for h in hits if h["time_s"] is not None]
        ratios = [h["ratio"] for h in hits if h["ratio"] is not None]
        same = [h["same_level"] for h in hits if h["same_level"] is not None]
        every = len(times) == len(seeds)
        rows.append({
            "config": name, "schedule": schedule, "staleness": staleness,
            "final_mean": statistics.mean(finals), "final_min": min(finals),
            "epoch_s": statistics.median(t for s in seeds for t in s["seconds"][name]),
            "epoch_over_reference": statistics.median(
                r for h in hits for r in h["epoch_over_reference"]),
            "wall_s": statistics.mean(sum(s["seconds"][name]) for s in seeds),
            "cpu_over_reference": statistics.median(
                a / b for s in seeds
                for a, b in zip(s["cpu"][name], s["cpu"][REFERENCE], strict=True)),
            "reached": len(times), "seeds": len(seeds),
            "to_target_s": statistics.mean(times) if times else None,
            "ratio_mean": statistics.mean(ratios) if ratios else None,
            "ratio_worst": max(ratios) if every else None,
            "same_level_mean": statistics.mean(same) if same else None,
            "same_level_worst": max(same) if every else None,
        })  # fmt: skip
    candidates = [r for r in rows if r["staleness"] and r["reached"] == r["seeds"]]
    verdict: dict[str, Any] = {"target": TARGET, "per_seed": per_seed}
    for key in ("ratio", "same_level"):
        best = min(candidates, key=lambda r: r[f"{key}_mean"]) if candidates else None
        verdict[key] = {
            "best": best["config"] if best else None,
            "mean": best[f"{key}_mean"] if best else None,
            "worst": best[f"{key}_worst"] if best else None,
            "pass": bool(best and best[f"{key}_mean"] <= TARGET),
        }
    return rows, verdict


def _step_rows(steps: dict[str, Any], steps_rank1: dict[str, Any]) -> list[dict[str, Any]]:
    """Each M's row: rank 0's step times, both ranks' CPU seconds a step, the bounds."""
    rows = []
    for m_key, case in steps.items():
        m, rounds = int(m_key), case["rounds"]
        bound = statistics.median(b["ratio"] for b in case["bounds"])
        other = steps_rank1[m_key]["cpu_s"]
        cpu = {n: [a + b for a, b in zip(t, other[n], strict=True)]
               for n, t in case["cpu_s"].items()}  # fmt: skip

        def ratio(a: str, b: str, rounds: dict[str, list[float]] = rounds) -> float:
            return statistics.median(x / y for x, y in zip(rounds[a], rounds[b], strict=True))

        rows.append({
            "m": m, "batch": m * ROWS,
            "gpipe_ms": 1e3 * statistics.median(rounds["gpipe"]),
            "1f1b_ms": 1e3 * statistics.median(rounds["1f1b"]),
            "async_ms": 1e3 * statistics.median(rounds["async"]),
            "async_over_gpipe": ratio("async", "gpipe"),
            "async_over_1f1b": ratio("async", "1f1b"),
            "cpu_gpipe_ms": 1e3 * statistics.median(cpu["gpipe"]),
            "cpu_async_ms": 1e3 * statistics.median(cpu["async"]),
            "cpu_async_over_gpipe": ratio("async", "gpipe", cpu),
            "bubble_bound": m / (m + 2 - 1), "pair": bound,
            "machine_bound": m / (m + bound - 1),
            "rounds": len(rounds["gpipe"]), "timed_steps": case["timed"],
        })  # fmt: skip
    return rows


def _git(*args: str) -> str:
    done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True)
    return done.stdout.strip()


def _ms(r: dict[str, Any], key: str) -> str:
    return f"{r[key]:.1f}"


FINETUNE_COLUMNS = [
    ("configuration", lambda r: r["config"]),
    ("final % mean", lambda r: f"{r['final_mean']:.2f}"),
    ("min", lambda r: f"{r['final_min']:.2f}"),
    ("epoch s", lambda r: f"{r['epoch_s']:.3f}"),
    ("/GPipe", lambda r: f"{r['epoch_over_reference']:.3f}"),
    ("wall s", lambda r: f"{r['wall_s']:.2f}"),
    ("reached", lambda r: f"{r['reached']}/{r['seeds']}"),
    ("to target s", lambda r: "never" if r["to_target_s"] is None
     else f"{r['to_target_s']:.2f}"),
    ("ratio", lambda r: "-" if r["ratio_mean"] is None else f"{r['ratio_mean']:.2f}x"),
    ("worst", lambda r: "never" if r["ratio_worst"] is None else f"{r['ratio_worst']:.2f}x"),
    ("same level", lambda r: "-" if r["same_level_mean"] is None
     else f"{r['same_level_mean']:.2f}x"),
    ("worst ", lambda r: "never" if r["same_level_worst"] is None
     else f"{r['same_level_worst']:.2f}x"),
]  # fmt: skip
STEP_COLUMNS = [
    ("M", lambda r: str(r["m"])),
    ("batch", lambda r: str(r["batch"])),
    ("GPipe ms", lambda r: _ms(r, "gpipe_ms")),
    ("1F1B ms", lambda r: _ms(r, "1f1b_ms")),
    ("async ms", lambda r: _ms(r, "async_ms")),
    ("async/GPipe", lambda r: f"{r['async_over_gpipe']:.3f}"),
    ("async/1F1B", lambda r: f"{r['async_over_1f1b']:.3f}"),
    ("CPU async/GPipe", lambda r: f"{r['cpu_async_over_gpipe']:.3f}"),
    ("bound M/(M+1)", lambda r: f"{r['bubble_bound']:.3f}"),
    ("b", lambda r: f"{r['pair']:.2f}"),
    ("machine M/(M+b-1)", lambda r: f"{r['machine_bound']:.3f}"),
]


def _measure(n_seeds: int, epochs: int, ms: list[int], rounds: int) -> dict[str, Any]:
    """Pre-training, every seed's fine-tuning, the step times: what was measured."""
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        weights = Path(tmp) / "pretrained.pt"
        pretrain = _pretrain(weights)
        print(f"pre-trained on classes 0-4: validation accuracy "
              f"{pretrain['val_accuracy_0_4']:.1f}% ({pretrain['seconds']:.1f} s)")  # fmt: skip
        seeds = []
        for seed in range(n_seeds):
            found = _run({"job": "finetune", "seed": seed, "epochs": epochs,
                          "weights": str(weights)})  # fmt: skip
            rank0, rank1 = found["0"], found["1"]
            both = {n: [a + b for a, b in zip(t, rank1["cpu"][n], strict=True)]
                    for n, t in rank0["cpu"].items()}  # fmt: skip
            seeds.append({"seed": seed, **rank0, "cpu": both, "loss": rank1["loss"]})
            curve = ", ".join(f"{n} {found['0']['accuracy'][n][-1]:.1f}%" for n, _, _ in CONFIGS)
            print(f"seed {seed}: {curve} ({time.perf_counter() - started:.0f} s)")
        steps = _run({"job": "steps", "ms": ms, "rounds": rounds, "weights": str(weights)})
    return {"pretrain": pretrain, "seeds": seeds, "steps": steps}


def _bound_line(label: str, pairs: list[dict[str, float]]) -> str:
    ratios = [b["ratio"] for b in pairs]
    return (
        f"bound: the two rank processes running a stage's forward and backward at once got "
        f"b = {statistics.median(ratios):.2f}x the work of one alone (median over "
        f"{len(ratios)} {label}, {min(ratios):.2f}-{max(ratios):.2f}x): with two stages at "
        f"once each at b/2 of one alone's speed, async/sync is at least M/(M+b-1)"
    )


def _report(found: dict[str, Any], epochs: int, ms: list[int], rounds: int) -> dict[str, Any]:
    """Print the tables and the verdicts; the result's rows."""
    seeds, steps = found["seeds"], found["steps"]
    finetune_pairs = [b for s in seeds for b in s["bounds"]]
    finetune_bound = statistics.median(b["ratio"] for b in finetune_pairs)
    step_pairs = [b for case in steps["0"]["steps"].values() for b in case["bounds"]]
    rows, verdict = _finetune_rows(seeds)
    step_rows = _step_rows(steps["0"]["steps"], steps["1"]["steps"])
    print(f"\nfine-tuning on classes 5-9: M = {FINETUNE_M} micro-batches of {ROWS} rows, "
          f"{seeds[0]['steps_per_epoch']} updates an epoch, {epochs} epochs, {len(seeds)} "
          f"seed(s); target: {REFERENCE}'s final accuracy - {SLACK_POINTS} points in the same "
          "seed")  # fmt: skip
    print(format_table(rows, FINETUNE_COLUMNS, left=1))
    cpus = ", ".join(f"{r['config']} {r['cpu_over_reference']:.3f}" for r in rows[1:])
    print(f"CPU seconds an epoch (both processes) over {REFERENCE}'s in the same turn: {cpus}")
    m = FINETUNE_M
    print(f"\nbounds at M = {m}: the bubble {m / (m + 1):.2f}x, this machine "
          f"{m / (m + finetune_bound - 1):.2f}x (b = {finetune_bound:.2f}, below)")  # fmt: skip
    gpipe = rows[0]
    stated = (f"over {REFERENCE}'s time to its own final accuracy (where {REFERENCE} itself "
              f"scores {gpipe['ratio_mean']:.2f}x)")  # fmt: skip
    for key, label in (("ratio", stated), ("same_level", f"over {REFERENCE}'s time to it")):
        v = verdict[key]
        if v["best"] is None:
            print(f"target: no asynchronous configuration reached {REFERENCE}'s final "
                  f"accuracy - {SLACK_POINTS} in every seed: MISS (<= {TARGET}x)")  # fmt: skip
            break
        print(f"target, {key.replace('_', ' ')}: {v['best']} (the best mitigation) reached "
              f"{REFERENCE}'s final accuracy - {SLACK_POINTS} in every seed in "
              f"{v['mean']:.2f}x (worst seed {v['worst']:.2f}x) {label}: "
              f"{'PASS' if v['pass'] else 'MISS'} (<= {TARGET}x)")  # fmt: skip
    print(f"\nsteady-state step time (async: staleness='stash'), micro-batches of {ROWS} rows, "
          f"median over {rounds} rounds; CPU: both processes' CPU seconds a step")  # fmt: skip
    print(format_table(step_rows, STEP_COLUMNS))
    print()
    print(_bound_line("fine-tuning epochs", finetune_pairs))
    print(_bound_line("step-time rounds", step_pairs))
    within = [r["m"] for r in step_rows if r["async_over_gpipe"] >= 1 / 1.05]
    crossover = min(within) if within else None
    print(f"crossover (GPipe's step time within 5% of async's): "
          f"{f'M = {crossover}' if crossover else f'none up to {max(ms)}'}")  # fmt: skip
    return {
        "finetune": {"rows": rows, "verdict": verdict, "seeds": seeds,
                     "machine_bound_m2": m / (m + finetune_bound - 1)},
        "steps": {"rows": step_rows, "rounds": rounds, "crossover_m": crossover,
                  "raw": steps["0"]["steps"], "raw_rank1": steps["1"]["steps"]},
        "bound": {"finetune": finetune_bound,
                  "steps": statistics.median(b["ratio"] for b in step_pairs)},
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="one seed, 10 epochs, M in 2 and 4, 8 rounds")  # fmt: skip
    parser.add_argument("--seeds", type=int, default=5, help="fine-tuning seeds (default 5)")
    parser.add_argument("--epochs", type=int, default=12, help="fine-tuning epochs (default 12)")
    parser.add_argument("--rounds", type=int, default=20, help="step-time rounds (default 20)")
    parser.add_argument("--out", default=str(result_path("async_pipeline")))
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    _needs_sklearn()
    if args.worker:
        print(json.dumps(_on_ranks(json.loads(args.worker))))
        return 0
    n_seeds, epochs = (1, 10) if args.quick else (args.seeds, args.epochs)
    ms, rounds = ([2, 4], 8) if args.quick else ([2, 4, 8, 16], args.rounds)
    started, load_before = time.perf_counter(), load_average()
    found = _measure(n_seeds, epochs, ms, rounds)
    result = _report(found, epochs, ms, rounds)
    total, load_after = time.perf_counter() - started, load_average()
    loads = " / ".join(
        "-" if x is None else " ".join(f"{v:.1f}" for v in x) for x in (load_before, load_after)
    )
    print(f"\n{total:.0f} s; load average (1, 5, 15 min) before / after: {loads}")
    dirty = _git("status", "--porcelain", "--", "fxpipe")  # the library, not this benchmark
    payload = {
        "command": command_line(), "date": datetime.date.today().isoformat(),
        "commit": _git("rev-parse", "--short", "HEAD"), "fxpipe_uncommitted": bool(dirty),
        "machine": machine_record(("torch", "sklearn")),
        "load_average": {"before": load_before, "after": load_after},
        "setup": {"model": f"MLP {INPUT} -> {' -> '.join([str(HIDDEN)] * LAYERS)} -> "
                           f"{CLASSES}, GELU, float32",
                  "rows_per_microbatch": ROWS, "finetune_m": FINETUNE_M,
                  "batch": ROWS * FINETUNE_M, "lr": LR, "momentum": MOMENTUM,
                  "epochs": epochs, "seeds": n_seeds, "validation": VALIDATION,
                  "slack_points": SLACK_POINTS, "target": TARGET,
                  "pretrain": found["pretrain"]},
        **result, "seconds": total,
    }  # fmt: skip
    return save_json(Path(args.out), payload)


if __name__ == "__main__":
    raise SystemExit(main())
