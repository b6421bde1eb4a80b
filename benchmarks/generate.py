"""Pipelined generation's throughput, measured side by side: ``pipe.generate()`` with each
stage's cache on its device and lanes of sequences in flight.

Run from the repository root::

    python -m benchmarks.generate [--quick] [--rounds N] [--out PATH]

A Llama-shaped model from a config (8 layers, width 512, 8 heads, vocabulary 8192,
float32, random weights), 2 stages on the CPU, prompts of 16 to 128 tokens (left-padded),
greedy decoding with no end token (every row makes every new token). Every case runs in a
fresh process on one torch thread (``OMP_NUM_THREADS=1``), its variants alternating round by
round (the order flipped each round); a ratio is the median over rounds of the per-round
ratio of tokens per second.

Rows (the issue's targets):

1. lanes: ``lanes=2`` over ``lanes=1`` (the order a ``device_map`` runs in) on the same
   split, 64 prompts x 64 new tokens (target 1.7x, stated for two processes); and with 4
   prompts (target 0.95x), where ``lanes="auto"`` is shown too (one lane per device the
   stages span: one here). Lanes pay only where the stages compute at once: each lanes row
   has its *bound*, what two threads of the same process computing at once got done over
   one alone in the same rounds (the same matrix products, one OpenMP thread each; the
   median over rounds), which no design of lanes gets past; and its *split* bound, the
   stages' summed busy time over the busiest stage's in a recorded one-lane run (lanes
   overlap the stages, so they reach at most that on this split); and its *work* bound, the
   one-lane time over the busiest stage's busy time in the variant's own run (lanes cut the
   rows, so each stage's work grows: every lane's step reads every weight, and the stages
   compute beside each other: what that variant reaches if no stage ever waited); and its
   *even* bound, the same over half the stages' summed busy time in that run (the busiest
   stage of any split of that work into two does at least half of it: what two lanes reach
   on the best split, which no split moves); the line under the table is the first bound
   for two processes, once, at the start;
2. processes: the same two rows one process per stage (``fxpipe.distributed``'s pipeline,
   2 gloo ranks of one thread each, ``generate`` on both, timed on rank 0): ``lanes=2`` over
   ``lanes=1`` with 64 prompts (target 1.7x) and with 4 (target 0.95x; ``lanes="auto"``
   there too: one lane, as 4 rows a lane are the fewest it gives a lane), and the crossover
   (2 to 16 sequences per lane); the bound column is
   the two-process line under the table, the split and work bounds from each rank's busy
   time (its stage's modules timed) in the timed runs, per round; ``lanes=2, prompts
   whole`` (``prefill_chunk=None``) shows what sending each prompt in chunks gains; under
   the table, for the 4-prompt cases, each stage's median step time with one lane and with
   two, and a *cpu* bound: the one-lane time over the busiest process's CPU time (every
   thread: its stage, home's ``generate`` loops, the messages) in the two-lane run;
3. overhead: ``pipe.generate(lanes=1)`` over ``model.generate`` with its own cache (one
   thread, the model on one device), 64 x 64 (target 0.9x);
4. against today's path: over ``model.generate`` with ``use_cache=False`` (what a
   pipelined model's config says, and what ``pipe.generate()`` ran before this), 64 prompts x
   16 new tokens (target 10x);
5. crossover: ``lanes=2`` over ``lanes=1`` for 1, 2, 4, 8 and 16 sequences per lane.

``--device cuda`` (what ``benchmarks/gpu_check.sh`` runs on a GPU machine) measures instead
one lane through 2 stages on that one device over ``model.generate`` with a static cache
(target 0.9x) and with its own cache, in this process.

Token equality with ``model.generate`` is checked on every case's first round. The table
and ``benchmarks/results/generate.json`` hold every row, the command and the machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks.harness.machine import machine_record
from benchmarks.harness.output import ROOT, command_line, format_table, result_path, save_json
from benchmarks.harness.processes import SINGLE_THREAD_ENV, gather_ranks, run_json

MODEL = dict(
    vocab_size=8192, hidden_size=512, intermediate_size=1376, num_hidden_layers=8,
    num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=512,
    use_cache=False, pad_token_id=0, bos_token_id=1, eos_token_id=None,
)  # fmt: skip


# ---------------------------------------------------------------------------- in a child


def _model_and_prompts(rows: int, seed: int = 0) -> tuple[Any, Any, Any]:
    import torch
    import transformers

    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**MODEL)).eval()
    g = torch.Generator().manual_seed(seed + 1)
    lengths = torch.randint(16, 129, (rows,), generator=g)
    width = int(lengths.max())
    ids = torch.randint(3, MODEL["vocab_size"], (rows, width), generator=g)  # type: ignore[call-overload]
    mask = torch.zeros(rows, width, dtype=torch.long)
    for r, n in enumerate(lengths.tolist()):
        mask[r, width - n :] = 1
    return model, ids.masked_fill(mask == 0, 0), mask


def _case(spec: dict[str, Any]) -> dict[str, Any]:
    """Times of each variant of one case, per round (seconds), and token equality."""
    import torch

    import fxpipe

    torch.set_num_threads(1)
    model, ids, mask = _model_and_prompts(spec["rows"])
    kwargs = dict(attention_mask=mask, max_new_tokens=spec["new"], do_sample=False)
    example = {"attention_mask": mask[:4]}
    pipe = fxpipe.pipeline(model, ids[:4], ["cpu"] * 2, example_kwargs=example)
    runs = {
        "model.generate": lambda: model.generate(ids, use_cache=True, **kwargs),
        "model.generate(use_cache=False)": lambda: model.generate(ids, **kwargs),
        **{name: (lambda name=name: pipe.generate(ids, **_lanes(name), **kwargs))
           for name in spec["variants"] if name.startswith("lanes")},
    }  # fmt: skip
    variants = spec["variants"]
    for name in variants:  # traces each step variant once, outside the timing
        if name.startswith("lanes"):
            pipe.generate(ids[:4], attention_mask=mask[:4], max_new_tokens=2, **_lanes(name))
    times: dict[str, list[float]] = {n: [] for n in variants}
    outputs: dict[str, Any] = {}
    bounds = []
    for r in range(spec["rounds"]):
        for name in variants if r % 2 == 0 else variants[::-1]:
            start = time.perf_counter()
            out = runs[name]()
            times[name].append(time.perf_counter() - start)
            outputs.setdefault(name, out)
        bounds.append(_threads_bound())
    first = outputs[variants[0]]
    equal = all(torch.equal(o, first) for o in outputs.values())
    split, work, even, step_ms = None, {}, {}, {}
    if "lanes=1" in variants:  # each stage's busy time with one lane: what the split allows
        for name in [n for n in variants if n.startswith("lanes")]:
            with fxpipe.record(pipe) as timeline:
                runs[name]()
            took = [[t.end - t.start for t in timeline.tasks if t.j == j] for j in range(2)]
            busy = [sum(t) for t in took]
            step_ms[name] = [1000 * statistics.median(t) for t in took]
            work[name] = statistics.median(times["lanes=1"]) / max(busy)
            even[name] = statistics.median(times["lanes=1"]) / (sum(busy) / 2)
            if name == "lanes=1":
                split = sum(busy) / max(busy)
    return {"times": times, "equal": equal, "tokens": spec["rows"] * spec["new"],
            "bound": statistics.median(bounds), "split_bound": split,
            "work_bound": work, "even_bound": even, "step_ms": step_ms}  # fmt: skip


def _lanes(name: str) -> dict[str, Any]:
    """``generate``'s lanes options of a variant's name: ``lanes=N`` or ``lanes=auto``,
    ``, prompts whole`` for ``prefill_chunk=None``."""
    lanes, _, rest = name.removeprefix("lanes=").partition(",")
    out: dict[str, Any] = {"lanes": lanes if lanes == "auto" else int(lanes)}
    if rest.strip() == "prompts whole":
        out["prefill_chunk"] = None
    return out


def _ranks_case(spec: dict[str, Any]) -> dict[str, Any]:
    """The case of :func:`_case` one process per stage: 2 ranks (gloo, one thread each)
    of ``fxpipe.distributed.pipeline_schedule``'s pipeline, timed on rank 0; the split bound
    from each rank's busy time (its stage's modules timed) in one one-lane run."""
    found = gather_ranks(_rank, spec)
    (first,) = [f for f in found if f["rank"] == 0]
    ranks = sorted(found, key=lambda f: f["rank"])
    times = first["times"]
    busy = {n: [[f["busy"][n][r] for f in ranks] for r in range(len(times[n]))] for n in times}
    if "lanes=1" in times:
        first["split_bound"] = statistics.median(sum(b) / max(b) for b in busy["lanes=1"])
        first["work_bound"] = {
            n: statistics.median(t1 / max(b) for t1, b in zip(times["lanes=1"], busy[n]))
            for n in times
        }
        first["even_bound"] = {
            n: statistics.median(t1 / (sum(b) / 2) for t1, b in zip(times["lanes=1"], busy[n]))
            for n in times
        }
    first["busy"] = busy
    # each variant's median step time (ms) of each rank's stage: mostly decode steps
    first["step_ms"] = {n: [f["step_ms"][n] for f in ranks] for n in times}
    if "lanes=1" in times:  # the one-lane time over the busiest process's CPU time (all of
        # its threads: its stage, home's generate loops, the messages) in the variant's run
        first["cpu_bound"] = {
            n: statistics.median(
                t1 / max(f["cpu"][n][r] for f in ranks) for r, t1 in enumerate(times["lanes=1"])
            )
            for n in times
        }
    first["ranks"] = True
    return first  # type: ignore[no-any-return]


def _rank(rank: int, port: int, spec: dict[str, Any], results: Any) -> None:
    """One rank of :func:`_ranks_case`: its times (rank 0) and its stage's busy seconds."""
    import traceback

    try:
        results.put({"rank": rank, **_rank_times(rank, port, spec)})
    except BaseException:
        results.put({"rank": rank, "error": traceback.format_exc()})


def _rank_times(rank: int, port: int, spec: dict[str, Any]) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    import fxpipe.distributed as fd

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world_size=2, is_master=rank == 0)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    model, ids, mask = _model_and_prompts(spec["rows"])
    kwargs = dict(attention_mask=mask, max_new_tokens=spec["new"], do_sample=False)
    pipe = fd.pipeline_schedule(
        model, ids[:4], example_kwargs={"attention_mask": mask[:4]}, n_microbatches=1,
        loss_fn=None,
    )  # fmt: skip
    variants = spec["variants"]

    for name in variants:  # traces each step variant once, outside the timing
        pipe.generate(ids[:4], attention_mask=mask[:4], max_new_tokens=2, **_lanes(name))
    busy = _stage_timers(pipe)
    times: dict[str, list[float]] = {n: [] for n in variants}
    cpu: dict[str, list[float]] = {n: [] for n in variants}
    outputs: dict[str, Any] = {}
    for r in range(spec["rounds"]):
        for name in variants if r % 2 == 0 else variants[::-1]:
            dist.barrier()
            busy.label = (name, r)
            start, used = time.perf_counter(), time.process_time()
            out = pipe.generate(ids, **_lanes(name), **kwargs)
            times[name].append(time.perf_counter() - start)
            cpu[name].append(time.process_time() - used)
            outputs.setdefault(name, out)
    if rank == 0:  # the model alone, built again (this rank's holds only its stage)
        want = _model_and_prompts(spec["rows"])[0].generate(ids, use_cache=True, **kwargs)
    equal = rank != 0 or all(torch.equal(o, want) for o in outputs.values())
    dist.destroy_process_group()
    per_round = {n: [busy.seconds.get((n, r), 0.0) for r in range(spec["rounds"])]
                 for n in variants}  # fmt: skip
    step_ms = {n: 1000 * statistics.median(busy.calls[n]) for n in variants}
    return {"times": times, "equal": equal, "tokens": spec["rows"] * spec["new"],
            "busy": per_round, "step_ms": step_ms, "cpu": cpu}  # fmt: skip


class _StageTimer:
    """Seconds this process's stage modules ran, per label (the variant and round), and
    each call's seconds per variant."""

    def __init__(self) -> None:
        self.label: Any = None
        self.seconds: dict[Any, float] = {}
        self.calls: dict[str, list[float]] = {}


def _stage_timers(pipe: Any) -> _StageTimer:
    """Every step variant's module of this rank's stage timed into one :class:`_StageTimer`."""
    timer = _StageTimer()
    generator = pipe._generator
    assert generator is not None
    stage = generator.stage
    for v in generator.variants:
        module = v.program.modules[stage]

        def timed(*args: Any, _forward: Any = module.forward) -> Any:
            start = time.perf_counter()
            out = _forward(*args)
            took = time.perf_counter() - start
            timer.seconds[timer.label] = timer.seconds.get(timer.label, 0.0) + took
            if timer.label is not None:
                timer.calls.setdefault(timer.label[0], []).append(took)
            return out

        module.forward = timed
    return timer


def _threads_bound() -> float:
    """Work two threads of this process get done at once over one thread alone (the same
    matrix products, one OpenMP thread each): what two stages computing at once could gain
    in this round, the most lanes can."""
    alone = _matmuls(100)
    pair: list[float] = []
    threads = [threading.Thread(target=lambda: pair.append(_matmuls(100))) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return 2 * alone / max(pair)


def _matmuls(count: int = 300) -> float:
    """Seconds of ``count`` matrix products on one thread (the bounds' unit of work)."""
    import torch

    torch.set_num_threads(1)
    a, w = torch.randn(1024, 512), torch.randn(512, 1376)
    for _ in range(3):
        a @ w
    start = time.perf_counter()
    for _ in range(count):
        a @ w
    return time.perf_counter() - start


# ---------------------------------------------------------------------------- the parent


def _bound() -> dict[str, Any]:
    """What two computations at once get here: two single-thread processes running the same
    products, against one alone; the speed-up two stages computing at once could reach."""
    env = {**SINGLE_THREAD_ENV}
    command = [sys.executable, "-m", "benchmarks.generate", "--worker", "matmuls"]
    alone = run_json("benchmarks.generate", ["--worker", "matmuls"], env=env)
    both = [
        subprocess.Popen(command, cwd=ROOT, env={**_environ(), **env}, stdout=subprocess.PIPE)
        for _ in range(2)
    ]
    seconds = [json.loads(p.communicate()[0].decode().strip().splitlines()[-1]) for p in both]
    return {
        "row": "bound: 2 processes at once over 1",
        "alone_s": alone,
        "together_s": seconds,
        "ratio": 2 * alone / max(seconds),
    }


def _one_device(device: str, out: Path, *, quick: bool) -> int:
    """One lane through 2 stages on ``device`` over ``model.generate`` with a static cache
    (compiled or not, as transformers picks) and with its own dynamic cache, 64 prompts x 64
    new tokens (16 x 16 with ``quick``), variants alternating over 5 rounds after a warm-up;
    tokens compared with the static run's."""
    import torch

    import fxpipe

    rows, new = (16, 16) if quick else (64, 64)
    model, ids, mask = _model_and_prompts(rows)
    where = torch.device(device)
    model, ids, mask = model.to(where), ids.to(where), mask.to(where)
    kwargs = dict(attention_mask=mask, max_new_tokens=new, do_sample=False)
    pipe = fxpipe.pipeline(
        model, ids[:4], [where] * 2, example_kwargs={"attention_mask": mask[:4]}
    )
    runs = {
        "lanes=1": lambda: pipe.generate(ids, lanes=1, **kwargs),
        "static cache": lambda: model.generate(
            ids, use_cache=True, cache_implementation="static", **kwargs
        ),
        "dynamic cache": lambda: model.generate(ids, use_cache=True, **kwargs),
    }
    sync = torch.cuda.synchronize if where.type == "cuda" else (lambda: None)
    times: dict[str, list[float]] = {n: [] for n in runs}
    outputs = {n: f() for n, f in runs.items()}  # warm-up, and the tokens to compare
    for r in range(5):
        for name in list(runs) if r % 2 == 0 else list(runs)[::-1]:
            sync()
            start = time.perf_counter()
            runs[name]()
            sync()
            times[name].append(time.perf_counter() - start)
    rows_out = [
        {"row": f"one device ({device}), {rows} x {new}", "variant": "lanes=1", "baseline": b,
         "ratio": _ratio(times, "lanes=1", b),
         "equal": bool(torch.equal(outputs["lanes=1"].cpu(), outputs[b].cpu()))}
        for b in ("static cache", "dynamic cache")
    ]  # fmt: skip
    for r in rows_out:
        print(f"{r['row']}: {r['variant']} over model.generate with a {r['baseline']}: "
              f"{r['ratio']:.2f}x (target 0.9x), tokens equal: {r['equal']}")  # fmt: skip
    payload = {"command": command_line(), "machine": machine_record(), "rows": rows_out,
               "times": times}  # fmt: skip
    return save_json(out, payload)


def _environ() -> dict[str, str]:
    import os

    return dict(os.environ)


def _ratio(times: dict[str, list[float]], a: str, b: str) -> float:
    """Median over rounds of ``b``'s time over ``a``'s (``a``'s tokens per second over
    ``b``'s)."""
    return statistics.median(y / x for x, y in zip(times[a], times[b], strict=True))


def _notes(
    table: list[dict[str, Any]],
    bound: dict[str, Any],
    small: dict[str, Any],
    ranked_small: dict[str, Any],
) -> None:
    """The lines under the table: the two-process bound, the 4-prompt steps, and each
    missed target's even bound."""
    print(
        f"\nbound: two single-thread processes at once ran {bound['ratio']:.2f}x the work of "
        f"one alone ({bound['alone_s']:.2f} s alone, "
        f"{', '.join(f'{s:.2f}' for s in bound['together_s'])} s together): the most any "
        "lanes can gain here, two stages computing at once"
    )
    for name, case in (("one process", small), ("2 processes", ranked_small)):
        ms = case["step_ms"]
        print(
            f"4 prompts, {name}: a step's median time (ms) at stages 0 and 1: "
            f"{'/'.join(f'{t:.1f}' for t in ms['lanes=1'])} with one lane of 4 rows, "
            f"{'/'.join(f'{t:.1f}' for t in ms['lanes=2'])} with two lanes of 2 (both stages "
            "at work): a step reads every weight whatever its rows, so two lanes do the "
            "stages' work of one twice over"
        )
    print(
        "4 prompts, 2 processes: cpu bound (the one-lane time over the busiest process's "
        "CPU time, every thread, in the two-lane run) "
        f"{ranked_small['cpu_bound']['lanes=2']:.2f}x"
    )
    for r in table:
        if r["even_bound"] is not None and r["target"] is not None and r["ratio"] < r["target"]:
            print(
                f"{r['row']}, {r['variant']}: {r['ratio']:.2f}x under the target "
                f"{r['target']}x; its even bound, what two lanes reach on any split of the "
                f"work that run did, is {r['even_bound']:.2f}x"
            )


def _run(spec: dict[str, Any]) -> dict[str, Any]:
    return run_json(  # type: ignore[no-any-return]
        "benchmarks.generate", ["--worker", json.dumps(spec)], env=SINGLE_THREAD_ENV, timeout=3600
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="16 prompts x 16 tokens, 2 rounds")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=str(result_path("generate")))
    parser.add_argument(
        "--device",
        help="instead of the table: on this device alone (cuda on a GPU machine), one lane "
        "through 2 stages over model.generate with a static cache and with its own cache",
    )
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.device:
        return _one_device(args.device, Path(args.out), quick=args.quick)
    if args.worker == "matmuls":
        print(json.dumps(_matmuls()))
        return 0
    if args.worker:
        spec = json.loads(args.worker)
        print(json.dumps(_ranks_case(spec) if spec.get("ranks") else _case(spec)))
        return 0
    rows, new = (16, 16) if args.quick else (64, 64)
    rounds = 2 if args.quick else args.rounds
    started = time.perf_counter()
    bound = _bound()
    table: list[dict[str, Any]] = []

    def row(name: str, case: dict[str, Any], a: str, b: str, target: float | None) -> None:
        times = case["times"]
        table.append({
            "row": name, "variant": a, "baseline": b, "ratio": _ratio(times, a, b),
            "variant_tok_s": case["tokens"] / statistics.median(times[a]),
            "baseline_tok_s": case["tokens"] / statistics.median(times[b]),
            "target": target, "equal": case["equal"], "rounds": len(times[a]),
            "bound": (bound["ratio"] if case.get("ranks") else case["bound"])
            if a.startswith("lanes=") and a != "lanes=1" else None,
            "split_bound": case["split_bound"] if a.startswith("lanes=") and a != "lanes=1"
            else None,
            "work_bound": case.get("work_bound", {}).get(a) if a.startswith("lanes=2") else None,
            "even_bound": case.get("even_bound", {}).get(a) if a.startswith("lanes=2") else None,
            "step_ms": {n: case.get("step_ms", {}).get(n) for n in (a, b)},
            "cpu_bound": case.get("cpu_bound", {}).get(a),
        })  # fmt: skip

    main_case = _run({"rows": rows, "new": new, "rounds": rounds,
                      "variants": ["model.generate", "lanes=1", "lanes=2"]})  # fmt: skip
    row(f"lanes, {rows} prompts x {new}", main_case, "lanes=2", "lanes=1", 1.7)
    small = _run({"rows": 4, "new": new, "rounds": rounds + 2,
                  "variants": ["lanes=1", "lanes=2", "lanes=auto"]})  # fmt: skip
    row(f"lanes, 4 prompts x {new}", small, "lanes=2", "lanes=1", 0.95)
    row(f"lanes, 4 prompts x {new}", small, "lanes=auto", "lanes=1", 0.95)
    whole = "lanes=2, prompts whole"
    ranked = _run({"ranks": True, "rows": rows, "new": new, "rounds": rounds,
                   "variants": ["lanes=1", "lanes=2", whole]})  # fmt: skip
    row(f"2 processes, {rows} prompts x {new}", ranked, "lanes=2", "lanes=1", 1.7)
    row(f"2 processes, {rows} prompts x {new}", ranked, whole, "lanes=1", None)
    ranked_small = _run({"ranks": True, "rows": 4, "new": new, "rounds": rounds + 2,
                         "variants": ["lanes=1", "lanes=2", "lanes=auto"]})  # fmt: skip
    row(f"2 processes, 4 prompts x {new}", ranked_small, "lanes=2", "lanes=1", 0.95)
    row(f"2 processes, 4 prompts x {new}", ranked_small, "lanes=auto", "lanes=1", 0.95)
    for per_lane in (2, 4, 8, 16):
        case = _run({"ranks": True, "rows": 2 * per_lane, "new": new, "rounds": rounds,
                     "variants": ["lanes=1", "lanes=2"]})  # fmt: skip
        row(f"2 processes, {per_lane} per lane", case, "lanes=2", "lanes=1", None)
    row(f"overhead, {rows} x {new}", main_case, "lanes=1", "model.generate", 0.9)
    recompute = _run({"rows": rows, "new": 16, "rounds": 1,
                      "variants": ["model.generate(use_cache=False)", "lanes=1"]})  # fmt: skip
    row(f"over no cache, {rows} x 16", recompute, "lanes=1", "model.generate(use_cache=False)", 10)
    for per_lane in (1, 2, 4, 8, 16):
        case = _run({"rows": 2 * per_lane, "new": new, "rounds": rounds + 2,
                     "variants": ["lanes=1", "lanes=2"]})  # fmt: skip
        row(f"crossover, {per_lane} per lane", case, "lanes=2", "lanes=1", None)
    columns = [
        ("row", lambda r: r["row"]),
        ("variant", lambda r: r["variant"]),
        ("baseline", lambda r: r["baseline"]),
        ("tok/s", lambda r: f"{r['variant_tok_s']:.0f}"),
        ("base tok/s", lambda r: f"{r['baseline_tok_s']:.0f}"),
        ("ratio", lambda r: f"{r['ratio']:.2f}x"),
        ("target", lambda r: "-" if r["target"] is None else f">= {r['target']}x"),
        ("bound", lambda r: "-" if r["bound"] is None else f"{r['bound']:.2f}x"),
        ("split", lambda r: "-" if r["split_bound"] is None else f"{r['split_bound']:.2f}x"),
        ("work", lambda r: "-" if r["work_bound"] is None else f"{r['work_bound']:.2f}x"),
        ("even", lambda r: "-" if r["even_bound"] is None else f"{r['even_bound']:.2f}x"),
        ("equal", lambda r: "yes" if r["equal"] else "NO"),
    ]
    print(format_table(table, columns, left=3))
    _notes(table, bound, small, ranked_small)
    print(f"\n{time.perf_counter() - started:.0f} s")
    payload = {"command": command_line(), "machine": machine_record(), "model": MODEL,
               "bound": bound, "rows": table}  # fmt: skip
    return save_json(Path(args.out), payload)


if __name__ == "__main__":
    raise SystemExit(main())
