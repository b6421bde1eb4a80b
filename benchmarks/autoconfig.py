"""Automatic configuration: ``chunks="auto"``, ``checkpoint="auto"`` against every
configuration of a grid, each measured the same way in one run, at a loose and a tight
memory budget.

Run from the repository root::

    python -m benchmarks.autoconfig [--out PATH] [--repeats N] [--models a,b] [--calibrate]
                                    [--device cpu|cuda] [--budgets loose,tight]

Per model (a ResNet-like CNN, a U-Net, a GPT-2 decoder, a BERT encoder, and a residual MLP
on a large batch: large activations, small weights), 4 stages on one device (the CPU, or
``--device cuda``: the GPU, each step synchronised before its clock stops):

1. The memory fxpipe estimates for every global configuration of the grid (chunks 1, 2, 4,
   8, 16, 32, at most the batch; checkpoint ``never``, ``except_last``, ``always``) gives
   the *tight* budget: the largest of a few points between the least that ``always`` needs
   (over the counts) and the least that ``except_last`` needs at which no ``never`` or
   ``except_last`` configuration fits, the split searched under the budget: only
   ``always`` fits as a global mode, with the most room left for per-stage modes. The
   *loose* budget is the machine's memory (everything fits).
2. At each budget, a pipeline per configuration of the grid that fits (the planner refuses
   the others, ``MemoryPlanError``) and one with ``chunks="auto", checkpoint="auto"``, each
   on its own copy of the model, and one training step of each (forward, the loss,
   backward) timed round by round, the order flipped every round, one thread
   (``benchmarks.harness.timing``). Step time: the median over rounds.

Read per model and budget: the automatic configuration's time over the grid's best (target
<= 1.05 on at least 4 of 5 models, never above 1.15), over the best configuration with
``checkpoint="always"`` (tight budget: per-stage checkpointing, target <= 0.90 on at least
2 models; beside it the bound, ``never`` over ``always`` at the same count, measured
without a budget: no choice of modes per stage gains more), over the default
(``chunks=None``, ``except_last``), and its predicted step over its measured one (the
prediction error). Ratios are medians of per-round ratios. Where the chosen configuration
is one of the grid's (one mode for every stage), its time is the grid's run of it, and
the automatic pipeline's own run is shown beside it: two pipelines of one configuration
differ by the machine's noise, which that pair measures. "Fits" is the planner's estimate
against the budget (how close that estimate is to measured memory: ``benchmarks.runtime``).

``--calibrate`` measures the runtime's fixed costs per cell, per checkpointed cell and per
step that the prediction uses (``fxpipe.passes.configure.step_time.OVERHEADS``): a model
of tiny products, so that its compute is negligible, at 1 and 4 stages, 1 and 32
micro-batches (``--device cuda``: on the GPU, written to ``autoconfig_calibration_cuda.json``).
"""

from __future__ import annotations

import argparse
import copy
import itertools
import statistics
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

import fxpipe
from benchmarks.harness.machine import machine_record
from benchmarks.harness.models.steps import MODELS as STEP_MODELS
from benchmarks.harness.models.steps import Batch, Loss, TinyProducts
from benchmarks.harness.models.zoo_nets import ResidualMLP, UNet
from benchmarks.harness.output import command_line, format_table, result_path, save_json
from benchmarks.harness.timing import paired_ratio, time_interleaved
from fxpipe.errors import ChunksWarning, MemoryPlanError
from fxpipe.passes.configure.choose import mode_memory

STAGES = 4
GRID_CHUNKS = (1, 2, 4, 8, 16, 32)
MODES = ("never", "except_last", "always")
AUTO = "auto"
#: Targets: auto over the grid's best (on MODELS_AT models, and never above NEVER_OVER);
#: per-stage checkpointing over the best "always" at the tight budget (on PER_STAGE_AT).
WITHIN, MODELS_AT, NEVER_OVER = 1.05, 4, 1.15
PER_STAGE, PER_STAGE_AT = 0.90, 2
#: Where the tight budget is tried, from the least "always" needs (0) to the least
#: "except_last" needs (1): the first at which only "always" fits globally.
TIGHT_FRACTIONS = (0.99, 0.95, 0.9, 0.8, 0.6, 0.4, 0.2, 0.0)

Build = Callable[[], tuple[nn.Module, Batch, Loss]]


def _unet() -> tuple[nn.Module, Batch, Loss]:
    return UNet(), ((torch.randn(4, 3, 64, 64),), {}), lambda out: out.pow(2).mean()


def _activations() -> tuple[nn.Module, Batch, Loss]:
    """Small weights (about 0.1 M parameters), a large batch: activations dominate."""
    model = ResidualMLP(d_in=32, width=64, depth=6)
    return model, ((torch.randn(2048, 32),), {}), lambda out: out.pow(2).mean()


MODELS: dict[str, Build] = {
    "cnn": STEP_MODELS["cnn"],
    "unet": _unet,
    "decoder": STEP_MODELS["decoder"],
    "encoder": STEP_MODELS["encoder"],
    "activations": _activations,
}

Config = tuple[Any, Any]  # (chunks, checkpoint)


def _label(config: Config) -> str:
    chunks, checkpoint = config
    return "auto" if config == (AUTO, AUTO) else f"M={chunks} {checkpoint}"


def _batch_size(batch: Batch) -> int:
    args, kwargs = batch
    first = next(t for t in [*args, *kwargs.values()] if isinstance(t, torch.Tensor))
    return int(first.shape[0])


def _on(batch: Batch, device: str) -> Batch:
    """``batch`` with its tensors on ``device``."""
    args, kwargs = batch
    move = lambda v: v.to(device) if isinstance(v, torch.Tensor) else v  # noqa: E731
    return tuple(move(a) for a in args), {k: move(v) for k, v in kwargs.items()}


def _pipe(
    model: nn.Module, batch: Batch, config: Config, budget: int | None, device: str
) -> fxpipe.Pipeline:
    args, kwargs = batch
    chunks, checkpoint = config
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ChunksWarning)
        return fxpipe.pipeline(
            model, args, [device] * STAGES, example_kwargs=kwargs, chunks=chunks,
            checkpoint=checkpoint, max_memory=budget,
        )  # fmt: skip


def _need(
    model: nn.Module, batch: Batch, config: Config, device: str, budget: int | None = None
) -> int:
    """fxpipe's estimate of the device memory of ``config`` (split under ``budget``);
    MemoryPlanError when no split fits it."""
    args, kwargs = batch
    plan = fxpipe.plan(model, args, [device] * STAGES, example_kwargs=kwargs,
                       chunks=config[0], checkpoint=config[1], max_memory=budget)  # fmt: skip
    return sum(s.memory_bytes for s in plan.stages)


def _grid(batch: Batch) -> list[Config]:
    counts = [c for c in GRID_CHUNKS if c <= _batch_size(batch)]
    return [(c, m) for c in counts for m in MODES]


def _fits(model: nn.Module, batch: Batch, config: Config, budget: int, device: str) -> bool:
    try:
        _need(model, batch, config, device, budget)
    except MemoryPlanError:
        return False
    return True


def _budgets(
    model: nn.Module, batch: Batch, device: str
) -> tuple[dict[str, int | None], dict[str, int]]:
    """The loose budget (None: the machine's) and the tight one: the largest of a few
    fractions of the way from the least ``always`` needs to the least ``except_last`` needs
    at which no ``never`` or ``except_last`` configuration of the grid fits (the split
    searched under the budget), so that per-stage modes have the most room."""
    needs = {_label(c): _need(model, batch, c, device) for c in _grid(batch)}
    least = {m: min(v for k, v in needs.items() if k.endswith(" " + m)) for m in MODES}
    lighter = [c for c in _grid(batch) if c[1] != "always"]
    gap = least["except_last"] - least["always"]
    for fraction in TIGHT_FRACTIONS:
        tight = least["always"] + int(fraction * gap)
        if not any(_fits(model, batch, c, tight, device) for c in lighter):
            return {"loose": None, "tight": tight}, needs
    return {"loose": None, "tight": least["always"]}, needs


def _measure(
    name: str, build: Build, budget_name: str, budget: int | None, repeats: int, device: str
) -> dict[str, Any]:
    model, batch, loss = build()
    batch, model = _on(batch, device), model.to(device)
    model.train()
    configs = [*_grid(batch), (AUTO, AUTO)]
    pipes: dict[str, fxpipe.Pipeline] = {}
    refused: dict[str, str] = {}
    for config in configs:
        try:
            pipes[_label(config)] = _pipe(copy.deepcopy(model), batch, config, budget, device)
        except MemoryPlanError as e:
            refused[_label(config)] = str(e).splitlines()[0][:100]
    auto = pipes.get("auto")
    combos = []
    if auto is not None and budget is not None:  # every per-stage combination that fits
        for modes in _fitting_modes(auto.plan, budget):
            label = f"M={auto.chunks} {_modes(modes)}"
            if len(set(modes)) > 1 and label not in pipes:
                try:
                    pipes[label] = _pipe(copy.deepcopy(model), batch, (auto.chunks, list(modes)),
                                         budget, device)  # fmt: skip
                    combos.append(label)
                except MemoryPlanError:
                    refused[label] = "its own split does not fit"
    bound = None
    if auto is not None and budget is not None:  # recomputing nothing, at auto's count
        bound = f"M={auto.chunks} never"
        if bound not in pipes:
            pipes[f"{bound} (bound)"] = _pipe(copy.deepcopy(model), batch, (auto.chunks,
                                              "never"), None, device)  # fmt: skip
            bound = f"{bound} (bound)"
    args, kwargs = batch

    def step(pipe: fxpipe.Pipeline) -> Callable[[], None]:
        def run() -> None:
            loss(pipe(*args, **kwargs)).backward()
            _sync(device)

        return run

    holder = nn.ModuleList(p.module for p in pipes.values())
    steps = {label: step(pipe) for label, pipe in pipes.items()}
    times = time_interleaved(holder, steps, repeats, warmup=2, budget_s=150.0)
    wall = times["wall"]
    median = {k: statistics.median(v) for k, v in wall.items()}
    grid = {k: v for k, v in median.items() if k.startswith("M=") and "bound" not in k
            and k not in combos}  # fmt: skip
    best = min(grid, key=grid.__getitem__) if grid else None
    row: dict[str, Any] = {
        "model": name,
        "budget": budget_name,
        "budget_bytes": budget,
        "fits": sorted(k for k in pipes if "bound" not in k),
        "refused": refused,
        "step_ms": {k: round(1e3 * v, 3) for k, v in median.items()},
        "rounds": len(next(iter(wall.values()))),
        "best": best,
        "best_ms": 1e3 * median[best] if best else None,
    }
    if auto is None:
        row["auto_refused"] = refused.get("auto")
        return row
    assert best is not None
    choice = auto.plan.configurations().choice
    label = f"M={choice.chunks} {choice.mode}" if isinstance(choice.mode, str) else None
    same = label if label in grid else "auto"  # the grid's run of the same configuration
    always = {k: v for k, v in grid.items() if k.endswith(" always")}
    best_always = min(always, key=always.__getitem__) if always else None
    default = f"M={min(4 * STAGES, _batch_size(batch))} except_last"
    row.update(
        auto_choice=f"M={choice.chunks} {_modes(choice.checkpoint)}",
        auto_ms=1e3 * median[same],
        auto_own_ms=1e3 * median["auto"],
        auto_measured_as=same,
        auto_over_best=paired_ratio(wall, same, best),
        auto_own_over_best=paired_ratio(wall, "auto", best),
        predicted_ms=1e3 * (choice.step or 0.0),
        prediction_error=(choice.step or 0.0) / median[same] - 1.0,
        best_always=best_always,
        auto_over_always=paired_ratio(wall, same, best_always) if best_always else None,
        bound=bound,
        bound_over_always=(
            paired_ratio(wall, bound, f"M={auto.chunks} always")
            if bound and f"M={auto.chunks} always" in wall
            else None
        ),
        default=default,
        auto_over_default=paired_ratio(wall, same, default) if default in wall else None,
        predicted_over_always=_predicted_over_always(auto.plan),
        per_stage=combos,
        per_stage_best=min(combos, key=median.__getitem__) if combos else None,
        per_stage_best_over_always=(
            min(paired_ratio(wall, c, f"M={auto.chunks} always") for c in combos)
            if combos and f"M={auto.chunks} always" in wall
            else None
        ),
        auto_memory_bytes=sum(s.memory_bytes for s in auto.plan.stages),
        configurations=len(auto.plan.configurations().rows),
    )
    return row


def _fitting_modes(plan: fxpipe.PipelinePlan, budget: int) -> list[tuple[str, ...]]:
    """Every combination of one checkpoint mode per stage whose memory on ``plan``'s split
    fits ``budget`` (its stages share one device), by fxpipe's estimate."""
    need = mode_memory(plan)
    combos = itertools.product(MODES, repeat=plan.num_stages)
    return [c for c in combos if sum(need[j, x] for j, x in enumerate(c)) <= budget]


def _predicted_over_always(plan: fxpipe.PipelinePlan) -> float | None:
    """The chosen configuration's predicted step over ``always``'s at the same count: with
    modes per stage, the most the budget lets recomputation shrink (the choice is the
    least recomputation over every combination of modes that fits, by the predictions)."""
    table = plan.configurations()
    chosen = table.choice
    always = [r for r in table.rows if r.chunks == chosen.chunks and r.kind == "global"
              and set(r.checkpoint) == {"always"} and r.step]  # fmt: skip
    if not always or chosen.step is None or always[0].step is None:
        return None
    return chosen.step / always[0].step


def _modes(modes: tuple[str, ...]) -> str:
    if len(set(modes)) == 1:
        return modes[0]
    return (
        "[" + ",".join({"never": "N", "except_last": "E", "always": "A"}[m] for m in modes) + "]"
    )


def _verdicts(rows: list[dict[str, Any]]) -> list[str]:
    out = []
    for budget in ("loose", "tight"):
        ratios = [r["auto_over_best"] for r in rows if r["budget"] == budget and
                  r.get("auto_over_best") is not None]  # fmt: skip
        within = sum(x <= WITHIN for x in ratios)
        worst = max(ratios, default=float("nan"))
        ok = within >= MODELS_AT and worst <= NEVER_OVER
        out.append(
            f"{budget}: auto within {WITHIN - 1:.0%} of the grid's best on {within} of "
            f"{len(ratios)} models (target >= {MODELS_AT}), worst {worst:.3f} (target <= "
            f"{NEVER_OVER}): {'PASS' if ok else 'MISS'}"
        )
    missing = [f"{r['model']} {r['budget']}" for r in rows if "auto_ms" not in r and r["fits"]]
    out.append(
        "auto fits wherever a grid configuration fits: "
        + ("PASS" if not missing else f"MISS ({', '.join(missing)})")
    )
    gains = [r["auto_over_always"] for r in rows if r["budget"] == "tight" and
             r.get("auto_over_always") is not None]  # fmt: skip
    met = sum(x <= PER_STAGE for x in gains)
    bounds = ", ".join(f"{r['model']} {r['bound_over_always']:.3f}" for r in rows
                       if r.get("bound_over_always") is not None)  # fmt: skip
    under = ", ".join(f"{r['model']} {r['predicted_over_always']:.3f}" for r in rows
                      if r["budget"] == "tight" and r.get("predicted_over_always"))  # fmt: skip
    measured = ", ".join(
        f"{r['model']} {r['per_stage_best_over_always']:.3f} ({len(r['per_stage'])} tried)"
        if r.get("per_stage_best_over_always")
        else f"{r['model']} none fits"
        for r in rows
        if r["budget"] == "tight" and "per_stage" in r
    )
    out.append(
        f"tight: auto over the best checkpoint='always' <= {PER_STAGE} on {met} of "
        f"{len(gains)} models (target >= {PER_STAGE_AT}): "
        f"{'PASS' if met >= PER_STAGE_AT else 'MISS'}; bound without the budget (never over "
        f"always at auto's count, measured): {bounds}; bound under the budget (the least "
        f"recomputation of every per-stage combination that fits, predicted, over always): "
        f"{under}; measured, the best of every per-stage combination that fits at auto's "
        f"count over always: {measured}"
    )
    errors = ", ".join(f"{r['model']} {r['budget']} {r['prediction_error']:+.0%}"
                       for r in rows if "prediction_error" in r)  # fmt: skip
    out.append(f"prediction error of the chosen configuration (predicted/measured - 1): {errors}")
    return out


def _print(rows: list[dict[str, Any]]) -> None:
    def ms(key: str) -> Callable[[dict[str, Any]], str]:
        return lambda r: "-" if r.get(key) is None else f"{r[key]:.1f}"

    def ratio(key: str) -> Callable[[dict[str, Any]], str]:
        return lambda r: "-" if r.get(key) is None else f"{r[key]:.3f}"

    columns = [
        ("model", lambda r: r["model"]),
        ("budget", lambda r: r["budget"]),
        ("fit", lambda r: f"{len(r['fits'])}/{len(r['fits']) + len(r['refused'])}"),
        ("grid best", lambda r: r["best"] or "-"),
        ("best ms", ms("best_ms")),
        ("auto chose", lambda r: r.get("auto_choice", "-")),
        ("auto ms", ms("auto_ms")),
        ("own ms", ms("auto_own_ms")),
        ("auto/best", ratio("auto_over_best")),
        ("auto/always", ratio("auto_over_always")),
        ("bound", ratio("bound_over_always")),
        ("pred/always", ratio("predicted_over_always")),
        ("auto/default", ratio("auto_over_default")),
        ("predicted ms", ms("predicted_ms")),
        ("rounds", lambda r: str(r["rounds"])),
    ]
    print(
        "\none training step, 4 stages on the CPU (ms: median over rounds; ratios: median of "
        "per-round ratios; auto ms: the grid's run of the chosen configuration where it is "
        "one, own ms: auto's own pipeline; bound: recomputing nothing over 'always' at auto's "
        "count, the most any checkpointing per stage can gain)"
    )
    print(format_table(rows, columns, left=2))


# ------------------------------------------------------------------------------ calibrate


def _sync(device: str) -> None:
    """Waits for the GPU's queued work (a step's clock stops when its kernels finished)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def calibrate(repeats: int, device: str = "cpu") -> dict[str, float]:
    """The runtime's costs on ``device``, from models of tiny products (compute negligible):
    per node and micro-batch (forward and backward), per cell beyond its nodes, per
    checkpointed cell beyond its nodes' second forward, per step."""
    x = torch.randn(64, 4, device=device)
    variants: dict[str, Callable[[], None]] = {}
    for layers in (8, 64):
        model = TinyProducts(layers).to(device)
        for k, m, mode in [(1, 1, "never"), (4, 1, "never"), (4, 32, "never"),
                           (4, 32, "always")]:  # fmt: skip
            pipe = fxpipe.pipeline(copy.deepcopy(model), x, [device] * k, chunks=m,
                                   checkpoint=mode)  # fmt: skip

            def run(pipe: fxpipe.Pipeline = pipe) -> None:
                pipe(x).sum().backward()
                _sync(device)

            variants[f"{layers} {k} {m} {mode}"] = run

        def eager(model: nn.Module = model) -> None:
            model(x).sum().backward()
            _sync(device)

        variants[f"{layers} eager"] = eager
    times = time_interleaved(nn.Module(), variants, repeats, budget_s=60.0)
    t = {k: statistics.median(v) for k, v in times["wall"].items()}
    extra = {n: (t[f"{n} 4 32 never"] - t[f"{n} 4 1 never"]) / 31 for n in (8, 64)}
    node = (extra[64] - extra[8]) / (2 * (64 - 8))  # two nodes per layer
    cell = (extra[8] - node * 2 * 8) / 4
    again = (t["8 4 32 always"] - t["8 4 32 never"]) / (4 * 32) - node * 2 * 8 / 4 / 3
    step = t["8 1 1 never"] - t["8 eager"] - cell
    found = {"node": node, "cell": cell, "checkpointed": again, "step": step}
    print("runtime costs:", {k: f"{v * 1e6:.0f} us" for k, v in found.items()})
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--calibrate", action="store_true")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (one device, 4 stages)")
    parser.add_argument("--budgets", default="loose,tight", help="which budgets to measure")
    args = parser.parse_args()
    torch.set_num_threads(1)
    started = time.time()
    device = str(torch.device(args.device if args.device != "cuda" else "cuda:0"))
    suffix = "" if device == "cpu" else "_cuda"
    machine = {
        **machine_record(),
        "device": torch.cuda.get_device_name(device) if suffix else "cpu",
    }
    if args.calibrate:
        found = calibrate(max(args.repeats, 15), device)
        out = Path(args.out) if args.out else result_path("autoconfig_calibration" + suffix)
        return save_json(
            out, {"command": command_line(), "machine": machine, "runtime_costs_s": found}
        )
    rows: list[dict[str, Any]] = []
    budgets_seen: dict[str, Any] = {}
    out = Path(args.out) if args.out else result_path("autoconfig" + suffix)

    def payload(verdicts: list[str] | None) -> dict[str, Any]:
        return {
            "command": command_line(),
            "machine": machine,
            "seconds": round(time.time() - started, 1),
            "complete": verdicts is not None,  # False: a row's partial save, run cut short
            "budgets": budgets_seen,
            "rows": rows,
            "verdicts": verdicts or [],
        }

    for name in args.models.split(","):
        torch.manual_seed(0)
        model, batch, _ = MODELS[name]()
        budgets, needs = _budgets(model.to(device), _on(batch, device), device)
        budgets_seen[name] = {"budgets": budgets, "needs": needs}
        for budget_name, budget in budgets.items():
            if budget_name not in args.budgets.split(","):
                continue
            torch.manual_seed(0)
            rows.append(_measure(name, MODELS[name], budget_name, budget, args.repeats, device))
            print(f"{name} {budget_name}: done ({time.time() - started:.0f} s)", flush=True)
            save_json(out, payload(None))  # each row kept, should the run be cut short
    _print(rows)
    verdicts = _verdicts(rows)
    print("\n" + "\n".join(verdicts))
    return save_json(out, payload(verdicts))


if __name__ == "__main__":
    raise SystemExit(main())
