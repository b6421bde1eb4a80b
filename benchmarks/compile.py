"""Compiled stages: the step time of a pipeline whose stages run through ``torch.compile``,
beside the eager model, ``torch.compile(model)`` and the uncompiled pipeline, in one run.

Run from the repository root::

    python -m benchmarks.compile [--out PATH] [--repeats N] [--device cpu|cuda]
                                 [--models cnn,decoder,encoder] [--mode MODE]

Per model (a small ResNet-like CNN, a GPT-2 decoder and a BERT encoder from transformers
configs, their losses inside the model for the two transformers ones), variants of one
training step (forward, loss, backward, gradients zeroed first), on one device:

- ``eager``: the model; ``compiled``: ``torch.compile(model)`` (inductor, default settings,
  or ``--mode``: ``reduce-overhead`` replays CUDA graphs on a GPU; every compiled variant
  below takes the same mode);
- ``compiled by hand M=4``: that compiled model over 4 micro-batches one after another,
  gradients accumulating: what micro-batching costs on one device whatever runs it;
- ``pipeline M=m`` and ``compiled pipeline M=m`` for m = 1 and 4: ``fxpipe.pipeline`` over
  2 stages on the device, ``chunks=m``, ``checkpoint="never"`` (on one device there is
  nothing to overlap, and checkpointing only adds the recomputation), without and with
  ``compile=True``;
- ``compiled 1-stage pipeline M=1``: the same with one stage, the traced graph compiled in
  one piece: over ``compiled`` it is what fxpipe's graph costs the compiler without a cut,
  and the 2-stage compiled pipeline over it is what cutting the graph in two costs (the
  compiler fuses nothing across a stage border);
- ``compiled stages by hand M=1``: the uncompiled 2-stage pipeline's stage graphs, each
  through ``torch.compile`` as the model is, called one after another by hand with nothing
  between them: what the compiled stages of this cut cost without any runtime, the bound of
  any runtime that compiles its stages one by one.

The targets (issue "compiled stages"): the compiled pipeline at most 0.85x the pipeline on
at least two of the three models, and at most 1.05x ``torch.compile(model)``, both at M=1,
where the pipeline runs what the model runs; at M=4 the same ratios are printed beside the
bound, ``compiled by hand M=4`` over ``compiled``, and the compiled pipeline is compared
with that by-hand run, so that the pipeline's own overhead shows apart from micro-batching's.
Each M=1 target prints its bound measured in the same run: ``torch.compile(model)`` over the
pipeline (the compiler's own gain on the whole model, which no design compiling with it can
pass), and the stages compiled by hand over ``torch.compile(model)`` (what cutting the graph
costs the compiler, with no runtime to blame).

Every pipeline runs on its own copy of the model (the compiled model on the eager one). The
first two steps of each compiled variant are timed apart (compilation happens there;
``pipe.compilation`` adds the seconds the backend spent per stage), and each compiled
pipeline's graph count is read again after the timed steps: a recompilation would show.
Before timing, one step of each compiled pipeline is compared with its uncompiled twin on
the same batch (the loss and every gradient, relative error).

The steps then alternate round by round (``benchmarks.harness.timing``: the ratio is the
median of per-round ratios, since these machines are shared and noisy), with one thread on
CPU. The rows go to ``benchmarks/results/compile.json`` (``compile_cuda.json`` on a GPU).
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_unflatten

import fxpipe
from benchmarks.harness.machine import device_record
from benchmarks.harness.models.steps import MODELS, Batch, Loss
from benchmarks.harness.output import command_line, format_table, result_path, save_json
from benchmarks.harness.timing import ratio_row, time_interleaved
from fxpipe.ir import ValueRef

#: Targets: compiled pipeline over pipeline (on at least MODELS_AT_TARGET models) and over
#: torch.compile(model).
OVER_PIPELINE = 0.85
OVER_COMPILED_MODEL = 1.05
MODELS_AT_TARGET = 2
CHUNKS = 4
#: The pipeline of one stage, compiled: the traced graph through the compiler in one piece.
ONE_STAGE = "compiled 1-stage pipeline M=1"
#: The 2-stage pipeline's stage graphs, each through torch.compile, called in turn by hand.
BY_HAND = "compiled stages by hand M=1"


def _on(value: Any, device: torch.device) -> Any:
    return value.to(device) if isinstance(value, torch.Tensor) else value


def _step(
    module: nn.Module, params: nn.Module, batch: Batch, loss: Loss, device: torch.device
) -> Callable[[], torch.Tensor]:
    """One training step of ``module`` (whose parameters ``params`` holds)."""
    args, kwargs = batch

    def step() -> torch.Tensor:
        params.zero_grad(set_to_none=True)
        torch.compiler.cudagraph_mark_step_begin()  # CUDA graphs (--mode): a new step
        value = loss(module(*args, **kwargs))
        value.backward()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return value.detach().clone()

    return step


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


Step = Callable[[], torch.Tensor]


def _agreement(
    pipe_step: Step, plain: nn.Module, compiled_step: Step, mine: nn.Module
) -> dict[str, float]:
    """The compiled pipeline's loss and gradients against the pipeline's, one step each:
    the loss's relative error, and the gradients' as one vector (a single parameter's own
    relative error means little where its gradient is nearly zero, as a convolution's
    before a BatchNorm)."""
    want, got = pipe_step(), compiled_step()
    pairs = [
        (p.grad.flatten(), q.grad.flatten())
        for p, q in zip(mine.parameters(), plain.parameters(), strict=True)
        if q.grad is not None and p.grad is not None
    ]
    mine_grads = torch.cat([a for a, _ in pairs])
    plain_grads = torch.cat([b for _, b in pairs])
    return {"loss": _relative(got, want), "grad": _relative(mine_grads, plain_grads)}


def _first_steps(step: Callable[[], torch.Tensor]) -> float:
    start = time.perf_counter()
    step()
    step()
    return time.perf_counter() - start


def _by_hand(
    module: nn.Module, params: nn.Module, batch: Batch, loss: Loss, device: torch.device
) -> Step:
    """One training step of ``module`` over CHUNKS micro-batches run one after another by
    hand (gradients accumulating): what micro-batching costs on one device, any runtime."""
    args, kwargs = batch

    def part(value: Any, i: int) -> Any:
        return value.tensor_split(CHUNKS)[i] if isinstance(value, torch.Tensor) else value

    def step() -> torch.Tensor:
        params.zero_grad(set_to_none=True)
        total = torch.zeros((), device=device)
        for i in range(CHUNKS):
            chunk_args = tuple(part(a, i) for a in args)
            chunk_kwargs = {k: part(v, i) for k, v in kwargs.items()}
            torch.compiler.cudagraph_mark_step_begin()  # each micro-batch its own replay
            value = loss(module(*chunk_args, **chunk_kwargs))
            total += value.detach()  # read before the next replay reuses its memory
            value.backward()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return total

    return step


def _stages_by_hand(pipe: fxpipe.Pipeline, mode: str | None, device: torch.device) -> Any:
    """``pipe``'s stage graphs, each through ``torch.compile`` as the model is (``mode``,
    defaults otherwise), called one after another over the whole batch with nothing between
    them, the output made as the pipeline makes it: what its compiled stages cost without a
    runtime, the bound of any runtime that compiles the stages of this cut one by one."""
    variant = pipe.variants[0]
    program, traced = variant.program, variant.traced
    stages = [torch.compile(gm, mode=mode) for gm in program.modules]

    def run(*args: Any, **kwargs: Any) -> Any:
        values = traced.binder.bind(args, kwargs)
        env = dict(zip(program.graph_inputs, values, strict=True))
        for j, stage in enumerate(stages):
            env.update(zip(program.outputs[j], stage(*(env[v] for v in program.inputs[j]))))
        leaves = [env[x.name] if isinstance(x, ValueRef) else x for x in program.output_leaves]
        if traced.finalize is not None:  # a loss from labels=, over the one micro-batch
            read = [values[i] for i in traced.finalize.inputs]
            leaves = list(traced.finalize.graph_module(*leaves, *read, device))
        return tree_unflatten(leaves, program.output_spec)

    return run


def measure(
    name: str, repeats: int, device: torch.device, mode: str | None = None
) -> list[dict[str, Any]]:
    torch.manual_seed(0)
    model, (args, kwargs), loss = MODELS[name]()
    model = model.to(device).train()
    batch: Batch = (
        tuple(_on(a, device) for a in args),
        {k: _on(v, device) for k, v in kwargs.items()},
    )
    compiled_model = torch.compile(model, mode=mode)
    options: dict[str, Any] | bool = {"mode": mode} if mode else True
    steps: dict[str, Step] = {
        "eager": _step(model, model, batch, loss, device),
        "compiled": _step(compiled_model, model, batch, loss, device),
        f"compiled by hand M={CHUNKS}": _by_hand(compiled_model, model, batch, loss, device),
    }
    pipes: dict[str, tuple[fxpipe.Pipeline, nn.Module]] = {}
    for m in (1, CHUNKS):
        for compiled in (False, True):
            key = f"{'compiled pipeline' if compiled else 'pipeline'} M={m}"
            copied = copy.deepcopy(model)
            pipe = fxpipe.pipeline(
                copied, batch[0], [device, device], chunks=m, checkpoint="never",
                example_kwargs=batch[1], compile=options if compiled else False,
            )  # fmt: skip
            pipes[key] = (pipe, copied)
            steps[key] = _step(pipe, copied, batch, loss, device)
    whole = copy.deepcopy(model)  # the traced graph compiled in one piece: no cut
    one = fxpipe.pipeline(whole, batch[0], [device], chunks=1, checkpoint="never",
                          example_kwargs=batch[1], compile=options)  # fmt: skip
    steps[ONE_STAGE] = _step(one, whole, batch, loss, device)
    plain, params = pipes["pipeline M=1"]  # its stage graphs compiled apart, its parameters
    steps[BY_HAND] = _step(_stages_by_hand(plain, mode, device), params, batch, loss, device)
    compiled_keys = [k for k in steps if k.startswith("compiled")]
    first = {k: _first_steps(steps[k]) for k in compiled_keys}
    mine = [k for k in pipes if k.startswith("compiled")]
    after_two = {k: sum(c.graphs for c in pipes[k][0].compilation) for k in mine}
    agreement = {
        k: _agreement(steps[k.removeprefix("compiled ")], pipes[k.removeprefix("compiled ")][1],
                      steps[k], pipes[k][1])
        for k in mine
    }  # fmt: skip
    times = time_interleaved(nn.Module(), steps, repeats, budget_s=120.0)
    hand = f"compiled by hand M={CHUNKS}"
    table = [
        ("compiled pipeline M=1", "pipeline M=1", OVER_PIPELINE),
        ("compiled pipeline M=1", "compiled", OVER_COMPILED_MODEL),
        (f"compiled pipeline M={CHUNKS}", f"pipeline M={CHUNKS}", OVER_PIPELINE),
        (f"compiled pipeline M={CHUNKS}", hand, OVER_COMPILED_MODEL),
        (hand, "compiled", None),  # the bound: micro-batches on one device, any runtime
        ("pipeline M=1", "eager", None),
        ("compiled", "eager", None),
        # the bounds of the cut: fxpipe's traced graph compiled whole, against the model
        # compiled whole, and the two stages against that one
        (ONE_STAGE, "compiled", None),
        ("compiled pipeline M=1", ONE_STAGE, None),
        # the bounds of the targets: the compiler's own gain on the whole model over the
        # pipeline; the stages compiled by hand, no runtime, over the model compiled whole;
        # and what the runtime adds over them
        ("compiled", "pipeline M=1", None),
        (BY_HAND, "compiled", None),
        ("compiled pipeline M=1", BY_HAND, None),
    ]
    rows = [ratio_row(f"{name}: {v} / {b}", times, v, b, t) for v, b, t in table]
    for row in rows:
        key = row["variant"]
        row.update(model=name, step_ms={k: 1e3 * statistics.median(v) for k, v in
                                        times["wall"].items()})  # fmt: skip
        if key in pipes and key in mine:
            pipe = pipes[key][0]
            row.update(
                first_two_steps_s=first[key],
                model_first_two_steps_s=first["compiled"],
                stage_compile_s=[round(c.seconds, 2) for c in pipe.compilation],
                stages_compiled=[c.compiled for c in pipe.compilation],
                graphs_after_two_steps=after_two[key],
                recompiled_after_two_steps=sum(c.graphs for c in pipe.compilation)
                - after_two[key],
                agreement=agreement[key],
            )
    return rows


def _verdicts(rows: list[dict[str, Any]]) -> list[str]:
    def ratios(variant: str, baseline: str) -> list[float]:
        return [r["ratio"] for r in rows if (r["variant"], r["baseline"]) == (variant, baseline)]

    over_pipe = ratios("compiled pipeline M=1", "pipeline M=1")
    met = sum(r <= OVER_PIPELINE for r in over_pipe)
    worst = max(ratios("compiled pipeline M=1", "compiled"), default=float("nan"))
    mine = [r for r in rows if "recompiled_after_two_steps" in r and r["baseline"] != "compiled"]
    recompiled = sum(r["recompiled_after_two_steps"] for r in mine)
    pipe4 = sum(r <= OVER_PIPELINE for r in ratios(f"compiled pipeline M={CHUNKS}",
                                                     f"pipeline M={CHUNKS}"))  # fmt: skip
    hand = ratios(f"compiled pipeline M={CHUNKS}", f"compiled by hand M={CHUNKS}")
    bound = ratios(f"compiled by hand M={CHUNKS}", "compiled")
    gain = ratios("compiled", "pipeline M=1")
    hand_over_model = ratios(BY_HAND, "compiled")
    return [
        f"M=1: compiled pipeline / pipeline <= {OVER_PIPELINE} on {met} of {len(over_pipe)} "
        f"models (target >= {MODELS_AT_TARGET}): {'PASS' if met >= MODELS_AT_TARGET else 'MISS'}",
        "  bound: torch.compile(model) / pipeline (the compiler's own gain on the whole model "
        f"over the pipeline): {_listed(gain)}, at or under {OVER_PIPELINE} on "
        f"{sum(g <= OVER_PIPELINE for g in gain)} of {len(gain)}",
        f"M=1: compiled pipeline / torch.compile(model): worst {worst:.3f} (target <= "
        f"{OVER_COMPILED_MODEL}): {'PASS' if worst <= OVER_COMPILED_MODEL else 'MISS'}",
        "  bound: the 2 stage graphs compiled and called by hand, no runtime / "
        f"torch.compile(model): {_listed(hand_over_model)}, at or under {OVER_COMPILED_MODEL} "
        f"on {sum(h <= OVER_COMPILED_MODEL for h in hand_over_model)} of "
        f"{len(hand_over_model)}; compiled pipeline / those: "
        + _listed(ratios("compiled pipeline M=1", BY_HAND)),
        f"M={CHUNKS}: compiled pipeline / pipeline <= {OVER_PIPELINE} on {pipe4} of "
        f"{len(over_pipe)} models; over torch.compile(model) by hand in micro-batches: worst "
        f"{max(hand, default=float('nan')):.3f}; that by hand over the whole batch (the bound "
        f"of any runtime at M={CHUNKS} on one device): " + _listed(bound),
        "bounds of the cut, M=1: the traced graph compiled whole / torch.compile(model): "
        + _listed(ratios(ONE_STAGE, "compiled"))
        + "; 2 stages / 1 stage, both compiled: "
        + _listed(ratios("compiled pipeline M=1", ONE_STAGE)),
        f"graphs compiled after the first two steps: {recompiled} (target 0): "
        f"{'PASS' if recompiled == 0 else 'MISS'}",
    ]


def _listed(values: list[float]) -> str:
    return ", ".join(f"{v:.3f}" for v in values)


def _print(rows: list[dict[str, Any]], device: torch.device) -> None:
    columns = [
        ("row", lambda r: r["row"]),
        ("variant ms", lambda r: f"{r['variant_ms']:.1f}"),
        ("baseline ms", lambda r: f"{r['baseline_ms']:.1f}"),
        ("ratio", lambda r: f"{r['ratio']:.3f}"),
        ("q1-q3", lambda r: "-".join(f"{q:.3f}" for q in r["ratio_q1_q3"])),
        ("cpu ratio", lambda r: f"{r['cpu_ratio']:.3f}"),
        ("target", lambda r: "-" if r["target"] is None else f"<= {r['target']}"),
        ("rounds", lambda r: str(r["rounds"])),
    ]
    print(f"\nstep time on {device} (one training step; median of per-round ratios)")
    print(format_table(rows, columns, left=1))
    print("\ncompilation")
    seen = [r for r in rows if "agreement" in r and r["baseline"].startswith("pipeline")]
    compile_columns = [
        ("model", lambda r: r["model"]),
        ("variant", lambda r: r["variant"]),
        ("torch.compile 2 steps s", lambda r: f"{r['model_first_two_steps_s']:.1f}"),
        ("first 2 steps s", lambda r: f"{r['first_two_steps_s']:.1f}"),
        ("stage backend s", lambda r: ", ".join(f"{s:.1f}" for s in r["stage_compile_s"])),
        ("graphs", lambda r: str(r["graphs_after_two_steps"])),
        ("recompiled after", lambda r: str(r["recompiled_after_two_steps"])),
        ("loss rel err", lambda r: f"{r['agreement']['loss']:.1e}"),
        ("grad rel err", lambda r: f"{r['agreement']['grad']:.1e}"),
    ]
    print(format_table(seen, compile_columns, left=2))
    print()
    for line in _verdicts(rows):
        print(line)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument(
        "--warm-cache", action="store_true",
        help="keep torch's compile caches (default: a fresh one, so compile times are cold)",
    )  # fmt: skip
    parser.add_argument("--mode", default=None, help="torch.compile's mode, for every variant")
    a = parser.parse_args(argv)
    if not a.warm_cache:  # read when inductor first compiles, after this
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="inductor-")
    device = torch.device(a.device)
    if device.type == "cpu":
        torch.set_num_threads(1)
    rows: list[dict[str, Any]] = []
    for name in a.models.split(","):
        print(f"{name}: building, compiling and timing ...", flush=True)
        try:
            rows.extend(measure(name, a.repeats, device, a.mode))
        except ImportError as exc:  # transformers, on a machine without it
            print(f"{name}: skipped ({exc})")
    _print(rows, device)
    name = "compile" if device.type == "cpu" else f"compile_{device.type}"
    name += f"_{a.mode.replace('-', '_')}" if a.mode else ""
    out = Path(a.out) if a.out else result_path(name)
    meta = {
        "command": command_line(),
        **device_record(device),
        "threads": torch.get_num_threads(),
        "compile_cache": "warm" if a.warm_cache else "cold",
        "mode": a.mode,
        "verdicts": _verdicts(rows),
    }
    return save_json(out, {"meta": meta, "rows": rows})


if __name__ == "__main__":
    raise SystemExit(main())
