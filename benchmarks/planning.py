"""Planning speed, plan determinism and stage-time prediction of fxpipe's cost modes.

Run from the repository root (transformers is in the ``test`` extra)::

    python -m benchmarks.planning [--out PATH] [--models resnet50 gpt2 llama-7b]
                                  [--repeats 5] [--skip-load] [--skip-prediction]
    python -m benchmarks.planning --calibrate     # the CPU rates the roofline uses

One torch thread throughout. Three models: a ResNet-50-like CNN (bottleneck blocks
3-4-6-3, BatchNorm, batch 16 of 64x64 images, traced by torch.fx), a GPT-2-small-like
language model (Hugging Face GPT-2: 12 layers, width 768, 12 heads, the 50,257-token
vocabulary tied to the LM head, batch 4 of 32 tokens, traced by torch.export) on four CPU
stages, and Llama-7B's shape on ``meta`` (batch 8 of 1,024 tokens) on four ``meta`` stages.

1. Build time of ``fxpipe.pipeline`` per cost mode (``fxpipe.plan`` for the meta model)
   against one eager training step of the same batch (forward, backward of the mean
   square of the outputs) and against ``torch.export`` of the same model alone: after one
   untimed build, 3 rounds (1 for "time") of an export and a build back to back, then as
   many eager steps; each ratio is the median of the per-round ratios.
2. Distinct plans (the stage of every node) over ``--repeats`` builds of each mode while
   two background processes spin both cores.
3. Stage-time prediction: for each mode's pipeline (the default micro-batches,
   ``checkpoint="never"`` so that each stage runs exactly the forward and backward the
   cost model prices), the busy time of every stage measured by ``fxpipe.record`` over 3
   steps (median per stage, after a warm-up step), against the mode's predicted share of
   the total; the error of a stage is |predicted share / measured share - 1|, and a mode's
   error is the largest over the stages. Modes that predict seconds also show their total
   against the measured one.

``--calibrate`` measures the rates the CPU roofline uses, each on one op (a 512 x 1024 x 1024
matrix product, 3x3 convolutions over 32x32 and 2x2 maps, attention over 256 tokens,
``relu`` over 128 KiB, 2 MiB and 64 MiB, a chain of tiny ops, a BatchNorm), best of 9 runs,
and prints them; the constants in ``passes/price/roofline.py`` are rounded from such runs and
checked against the stage times of section 3.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import fxpipe
from benchmarks.harness.machine import cpu_model, load_average
from benchmarks.harness.models.giants import GIANTS
from benchmarks.harness.output import command_line, format_table, result_path, save_json

DEFAULT_OUT = result_path("planning")
MODES = ("auto", "flops", "params", "time")
STAGES = 4
#: Targets of the issue this benchmark answers.
BUILD_OVER_STEP = 3.0
PLAN_OVER_EXPORT = 1.5
PREDICTION_ERROR = 0.15


# ------------------------------------------------------------------------------ models


class Bottleneck(nn.Module):
    """1x1 -> 3x3 (stride) -> 1x1 convolutions with BatchNorm, plus the shortcut."""

    def __init__(self, cin: int, width: int, stride: int) -> None:
        super().__init__()
        cout = 4 * width
        self.conv1 = nn.Conv2d(cin, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, cout, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(cout)
        self.down: nn.Module | None = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        y = F.relu(self.bn2(self.conv2(y)))
        y = self.bn3(self.conv3(y))
        return F.relu(y + (x if self.down is None else self.down(x)))


class ResNet50Like(nn.Module):
    """ResNet-50's layout: a 7x7 stem, bottleneck stages of 3, 4, 6 and 3 blocks."""

    def __init__(self, classes: int = 1000) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, 64, 7, 2, 3, bias=False),
            nn.BatchNorm2d(64),
            nn.ReLU(),
            nn.MaxPool2d(3, 2, 1),
        )
        blocks, cin = [], 64
        for width, depth, stride in ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)):
            for i in range(depth):
                blocks.append(Bottleneck(cin, width, stride if i == 0 else 1))
                cin = 4 * width
        self.blocks = nn.Sequential(*blocks)
        self.fc = nn.Linear(cin, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.blocks(self.stem(x))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


class Logits(nn.Module):
    """A Hugging Face causal LM that returns its logits (the loss is taken outside)."""

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.lm(ids).logits
        return logits


def _resnet50() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return ResNet50Like(), torch.randn(16, 3, 64, 64)


def _gpt2_small() -> tuple[nn.Module, torch.Tensor]:
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=12, n_embd=768, n_head=12, vocab_size=50257, n_positions=1024,
        use_cache=False,
    )  # fmt: skip
    ids = torch.randint(0, 50257, (4, 32), generator=torch.Generator().manual_seed(1))
    return Logits(transformers.GPT2LMHeadModel(config)), ids


def _llama_7b() -> tuple[nn.Module, torch.Tensor]:
    build, vocab = GIANTS["llama-7b"]
    with torch.device("meta"):
        model = build()
    return model, torch.randint(0, vocab, (8, 1024), device="meta")


#: name -> (build, device of the stages).
MODELS: dict[str, tuple[Callable[[], tuple[nn.Module, torch.Tensor]], str]] = {
    "resnet50": (_resnet50, "cpu"),
    "gpt2": (_gpt2_small, "cpu"),
    "llama-7b": (_llama_7b, "meta"),
}


# ------------------------------------------------------------------------------ calibration


def _best_of(step: Callable[[], None], repeats: int = 9) -> float:
    """The fastest of ``repeats`` runs of ``step`` after one warm-up (a busy machine only
    ever makes a run slower)."""
    step()
    runs = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        runs.append(time.perf_counter() - start)
    return min(runs)


def _training(module: nn.Module | Callable[..., torch.Tensor], *inputs: torch.Tensor) -> float:
    """Best forward + backward seconds of ``module(*inputs)``, gradients cleared each time."""
    params = list(module.parameters()) if isinstance(module, nn.Module) else []

    def step() -> None:
        for p in params:
            p.grad = None
        out = module(*inputs)
        out.backward(torch.ones_like(out))

    return _best_of(step)


def _elementwise(n: int) -> float:
    """Best forward + backward seconds of ``relu`` over ``n`` floats that require grad."""
    return _training(torch.relu, torch.randn(n, requires_grad=True))


def calibrate() -> dict[str, float]:
    """Measure, on one thread, the CPU rates the roofline uses, one op per rate, with
    the byte and FLOP counts of :func:`fxpipe.passes.price.roofline.node_work`; print them."""
    x = torch.randn(8, 4, requires_grad=True)
    chain = _training(lambda v: (v * 1.5 + 0.5).relu() * 2 + 1, x) - _training(torch.neg, x)
    overhead = chain / 4 / 2  # four more ops, each a forward and a backward kernel
    rows, width = 512, 1024
    linear = _training(nn.Linear(width, width), torch.randn(rows, width, requires_grad=True))
    conv = _training(nn.Conv2d(64, 64, 3, padding=1), torch.randn(8, 64, 32, 32))
    small = _training(nn.Conv2d(256, 256, 3, padding=1), torch.randn(64, 256, 2, 2))
    q = torch.randn(8, 8, 256, 64, requires_grad=True)
    attention = _training(lambda a: F.scaled_dot_product_attention(a, a, a), q)
    conv_rate = 2 * 2 * 8 * 1024 * 64 * 64 * 9 / conv  # no input gradient: 2x forward
    small_rate = 2 * 2 * 64 * 4 * 256 * 256 * 9 / small
    out = {
        "matmul": 3 * 2 * rows * width * width / linear,
        "conv": conv_rate,
        "conv_pixels": 4 * max(conv_rate / small_rate - 1, 0.0),
        "attention": 3 * 2 * 8 * 8 * 256 * 256 * 128 / attention,
        "bandwidth": 5 * 4 * 2**24 / (_elementwise(2**24) - 2 * overhead),
        "cache_bandwidth": 5 * 4 * 2**15 / max(_elementwise(2**15) - 2 * overhead, 1e-7),
        "overhead": overhead,
    }
    middle = 5 * 4 * 2**19 / (_elementwise(2**19) - 2 * overhead)  # 10 MiB moved
    share = (middle - out["bandwidth"]) / max(out["cache_bandwidth"] - out["bandwidth"], 1.0)
    out["cache_bytes"] = 5 * 4 * 2**19 * share / max(1 - share, 1e-3)
    bn = _training(nn.BatchNorm2d(64), torch.randn(16, 64, 64, 64, requires_grad=True))
    out["batch_norm_passes"] = bn / (5 * 4 * 2**22 / out["bandwidth"])
    print(json.dumps({k: float(f"{v:.3g}") for k, v in out.items()}, indent=1))
    return out


# ------------------------------------------------------------------------------ measurements


def _plan_hash(plan: fxpipe.PipelinePlan) -> str:
    text = repr(sorted(plan.stage_of.items()))
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def _eager_step(model: nn.Module, x: torch.Tensor) -> float:
    """Median seconds of one forward and backward of the mean square of the outputs."""

    def step() -> None:
        model(x).float().pow(2).mean().backward()
        model.zero_grad(set_to_none=True)

    step()
    runs = []
    for _ in range(3):
        start = time.perf_counter()
        step()
        runs.append(time.perf_counter() - start)
    return statistics.median(runs)


def _export_seconds(model: nn.Module, x: torch.Tensor) -> float:
    """``torch.export`` of the model alone, as fxpipe calls it (non-strict, dynamic batch)."""
    start = time.perf_counter()
    torch.export.export(model, (x,), strict=False, dynamic_shapes=({0: torch.export.Dim.AUTO},))
    return time.perf_counter() - start


def _build(
    model: nn.Module, x: torch.Tensor, device: str, mode: str, **options: Any
) -> tuple[Any, float]:
    """(pipeline, or plan on meta devices; seconds to build it)."""
    start = time.perf_counter()
    if device == "meta":
        built: Any = fxpipe.plan(model, x, [device] * STAGES, cost=mode)
    else:
        built = fxpipe.pipeline(model, x, [device] * STAGES, cost=mode, **options)
    return built, time.perf_counter() - start


def modes_for(device: str) -> list[str]:
    """Cost modes that can price a model on ``device`` ("time" needs data)."""
    return [m for m in MODES if device != "meta" or m != "time"]


def build_rows(name: str) -> list[dict[str, Any]]:
    """Section 1: build time per mode against one eager step and one torch.export, in
    rounds that time an export and a build back to back (after one untimed build of each
    mode: what a process pays once, importing and warming torch's fake tensors, is left
    out of both); each ratio is the median of its rounds' ratios."""
    build, device = MODELS[name]
    model, x = build()
    _export_seconds(model, x)
    rows = []
    for mode in modes_for(device):
        _build(model, x, device, mode)
        rounds = 1 if mode == "time" else 3
        pairs = [(_export_seconds(model, x), _build(model, x, device, mode)[1])]
        for _ in range(rounds - 1):
            pairs.append((_export_seconds(model, x), _build(model, x, device, mode)[1]))
        steps = [] if device == "meta" else [_eager_step(model, x) for _ in range(rounds)]
        built = statistics.median(b for _, b in pairs)
        rows.append(
            {
                "model": name,
                "mode": mode,
                "build_s": built,
                "eager_step_s": statistics.median(steps) if steps else None,
                "export_s": statistics.median(e for e, _ in pairs),
                "build_over_step": statistics.median(b / s for (_, b), s in zip(pairs, steps))
                if steps
                else None,
                "build_over_export": statistics.median(b / e for e, b in pairs),
            }
        )
        print(f"build: {name} {mode}: {built:.2f} s", flush=True)
    return rows


class _Spinners:
    """Background processes that keep every core busy while the block runs."""

    def __init__(self, count: int) -> None:
        self.count = count
        self.procs: list[subprocess.Popen[bytes]] = []

    def __enter__(self) -> _Spinners:
        loop = "while True:\n    pass\n"
        self.procs = [subprocess.Popen([sys.executable, "-c", loop]) for _ in range(self.count)]
        return self

    def __exit__(self, *exc: object) -> None:
        for proc in self.procs:
            proc.kill()
            proc.wait()


def load_rows(name: str, repeats: int, modes: Sequence[str]) -> list[dict[str, Any]]:
    """Section 2: distinct plans over ``repeats`` plans per mode under a competing load."""
    build, device = MODELS[name]
    model, x = build()
    rows = []
    with _Spinners(os.cpu_count() or 2):
        for mode in [m for m in modes_for(device) if m in modes]:
            hashes = []
            for _ in range(repeats):
                start = time.perf_counter()
                plan = fxpipe.plan(model, x, [device] * STAGES, cost=mode)
                hashes.append(_plan_hash(plan))
                seconds = time.perf_counter() - start
            rows.append(
                {
                    "model": name,
                    "mode": mode,
                    "builds": repeats,
                    "distinct": len(set(hashes)),
                    "last_plan_s": seconds,
                },  # fmt: skip
            )
            print(f"load: {name} {mode}: {len(set(hashes))} distinct of {repeats}", flush=True)
    return rows


def _measured_stages(pipe: fxpipe.Pipeline, x: torch.Tensor) -> list[float]:
    """Busy seconds of every stage (forward + backward), median over 3 recorded steps."""

    def step() -> None:
        pipe(x).float().pow(2).mean().backward()
        pipe.zero_grad(set_to_none=True)

    step()
    runs = []
    for _ in range(3):
        with fxpipe.record(pipe) as timeline:
            pipe(x).float().pow(2).mean().backward()
        pipe.zero_grad(set_to_none=True)
        runs.append([timeline.busy(j) for j in range(pipe.plan.num_stages)])
    return [statistics.median(run[j] for run in runs) for j in range(pipe.plan.num_stages)]


def prediction_rows(name: str) -> list[dict[str, Any]]:
    """Section 3: each mode's predicted stage shares against the measured ones."""
    build, device = MODELS[name]
    model, x = build()
    rows = []
    for mode in modes_for(device):
        pipe, _ = _build(model, x, device, mode, checkpoint="never")
        measured = _measured_stages(pipe, x)
        predicted = [s.cost for s in pipe.plan.stages]
        shares_m = [m / sum(measured) for m in measured]
        shares_p = [p / sum(predicted) for p in predicted]
        errors = [abs(p / m - 1) for p, m in zip(shares_p, shares_m)]
        seconds = pipe.plan.costs.unit == "s"
        rows.append(
            {
                "model": name,
                "mode": mode,
                "chunks": pipe.chunks,
                "measured_s": measured,
                "predicted": predicted,
                "unit": pipe.plan.costs.unit,
                "max_error": max(errors),
                "mean_error": statistics.mean(errors),
                "total_over_measured": sum(predicted) / sum(measured) if seconds else None,
            }
        )
        print(f"predict: {name} {mode}: max error {max(errors):.1%}", flush=True)
        del pipe
    return rows


# ------------------------------------------------------------------------------ report


def _fmt(value: Any, spec: str, suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


COLUMNS: list[tuple[str, Callable[[dict[str, Any]], str]]] = [
    ("model", lambda r: r["model"]),
    ("mode", lambda r: r["mode"] + (" (roofline)" if r["mode"] == "auto" else "")),
    ("build s", lambda r: _fmt(r.get("build_s"), ".2f")),
    ("eager step s", lambda r: _fmt(r.get("eager_step_s"), ".2f")),
    ("build/step", lambda r: _fmt(r.get("build_over_step"), ".2f")),
    ("export s", lambda r: _fmt(r.get("export_s"), ".2f")),
    ("build/export", lambda r: _fmt(r.get("build_over_export"), ".2f")),
    ("plans under load", lambda r: _plans(r)),
    ("stage err max", lambda r: _fmt(r.get("max_error"), ".1%")),
    ("mean", lambda r: _fmt(r.get("mean_error"), ".1%")),
    ("pred/meas s", lambda r: _fmt(r.get("total_over_measured"), ".2f")),
]


def _plans(row: dict[str, Any]) -> str:
    if row.get("distinct") is None:
        return "-"
    return f"{row['distinct']} of {row['builds']}"


def merge(*sections: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows of the sections joined on (model, mode), in first-seen order."""
    merged: dict[tuple[str, str], dict[str, Any]] = {}
    for rows in sections:
        for row in rows:
            merged.setdefault((row["model"], row["mode"]), {}).update(row)
    return list(merged.values())


def summary(rows: Sequence[dict[str, Any]]) -> list[str]:
    """The issue's targets, PASS or MISS each, on the default cost."""
    auto = {r["model"]: r for r in rows if r["mode"] == "auto"}
    lines = []

    def check(label: str, value: float | None, ok: bool | None) -> None:
        verdict = "n/a" if ok is None else "PASS" if ok else "MISS"
        lines.append(f"{verdict:4s}  {label}: {_fmt(value, '.3g')}")

    cnn = auto.get("resnet50", {})
    ratio = cnn.get("build_over_step")
    check(f"ResNet-50-like build / eager step < {BUILD_OVER_STEP}", ratio,
          None if ratio is None else ratio < BUILD_OVER_STEP)  # fmt: skip
    for name, r in auto.items():
        if r.get("distinct") is not None:
            check(f"{name}: distinct default plans under load == 1", r["distinct"],
                  r["distinct"] == 1)  # fmt: skip
    llama = auto.get("llama-7b", {}).get("build_over_export")
    check(f"Llama-7B fxpipe.plan / torch.export < {PLAN_OVER_EXPORT}", llama,
          None if llama is None else llama < PLAN_OVER_EXPORT)  # fmt: skip
    for name, r in auto.items():
        if r.get("max_error") is not None:
            check(f"{name}: default's largest stage-share error < {PREDICTION_ERROR:.0%}",
                  r["max_error"], r["max_error"] < PREDICTION_ERROR)  # fmt: skip
    return lines


def _machine() -> dict[str, Any]:
    return {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "load_average": load_average(),
        "torch": torch.__version__,
        "python": platform.python_version(),
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON rows")
    parser.add_argument("--models", nargs="*", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--repeats", type=int, default=5, help="plans per mode under load")
    parser.add_argument("--load-modes", nargs="*", default=list(MODES), choices=list(MODES))
    parser.add_argument("--skip-load", action="store_true")
    parser.add_argument("--skip-prediction", action="store_true")
    parser.add_argument("--calibrate", action="store_true", help="only measure the CPU rates")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")  # BatchNorm statistics per micro-batch, export notes
    if args.calibrate:
        calibrate()
        return 0
    started = time.perf_counter()
    command = command_line()
    machine = _machine()
    print(f"command: {command}\n{json.dumps(machine)}", flush=True)
    builds = [r for name in args.models for r in build_rows(name)]
    loads = [] if args.skip_load else [
        r for name in args.models for r in load_rows(name, args.repeats, args.load_modes)
    ]  # fmt: skip
    predictions = [] if args.skip_prediction else [
        r for name in args.models if MODELS[name][1] != "meta" for r in prediction_rows(name)
    ]  # fmt: skip
    rows = merge(builds, loads, predictions)
    print()
    print(format_table(rows, COLUMNS, left=2, rule=False))
    print()
    print("\n".join(summary(rows)))
    machine["load_average_end"] = load_average()
    record = {
        "command": command,
        "machine": machine,
        "seconds": time.perf_counter() - started,
        "rows": rows,
        "summary": summary(rows),
    }
    print(f"\n{time.perf_counter() - started:.0f} s")
    return save_json(args.out, record, indent=1)


if __name__ == "__main__":
    raise SystemExit(main())
