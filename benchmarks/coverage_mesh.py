"""Coverage harness for the multi-process mode: real models on a 2 x 2 mesh of gloo ranks.

Run from the repository root::

    python benchmarks/coverage_mesh.py [--only PATTERN] [--configs all|N] [--timeout 240]

Every model of ``benchmarks/coverage.py`` (float64, every dropout at zero, train mode) is
pipelined by ``fxpipe.distributed.pipeline_schedule`` on 4 CPU processes (gloo on loopback)
arranged as a ``(pp, dp) = (2, 2)`` mesh: two pipeline replicas, each fed half of the global
batch, under several (schedule, data parallelism) configurations. Each rank runs one step
with a sum-reduced loss, sums its tied copies (``sync_tied_gradients``), takes one SGD step
and hands back its gradients and its state-dict shard (FSDP's shards gathered). The oracle
is eager PyTorch in this process, on the same micro-batches (micro-batching changes what a
BatchNorm or capacity-limited router computes, which is what the pipeline promises to
equal): the loss summed over every micro-batch of both replicas, every gradient over the
replicas (DDP and FSDP average them), every parameter after the same SGD step.

The loss is a fixed random projection of every floating-point leaf of the model's output,
with each sample's weights drawn from its index in the global batch (the target), so that
any micro-batch, on any replica, is weighed as eager weighs it. A model whose example
batch has fewer rows than the configuration's micro-batches on both replicas (kept small
for speed in ``coverage.py``) gets its batch repeated to that many rows; the row says so
(``batch``).

Each (model, configuration) is one launch of 4 ranks from a fork server, with a time limit;
a row is equal / refused (an ``FxPipeError``, on every rank) / crashed / wrong / timeout /
skipped (eager itself fails, or the batch does not split between the replicas). Rows go
to ``benchmarks/results/coverage_mesh.json`` after each launch.
Needs transformers (in the ``test`` extra); timm and torchvision models run where those
import (see ``coverage.py``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import sys
import time
import traceback
import zlib
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

sys.path.insert(0, str(Path(__file__).resolve().parent))
import coverage as cov  # noqa: E402  (benchmarks/coverage.py: the models and the comparisons)
from common import free_port  # noqa: E402

import fxpipe.distributed as fd  # noqa: E402
from fxpipe.errors import FxPipeError  # noqa: E402

Row = dict[str, Any]
PP, DP = 2, 2
WORLD = PP * DP
LR = 0.01
PG_TIMEOUT_S = 60
#: What a rank whose peer died reports (gloo over TCP): not the cause.
_SYMPTOM = "Connection reset by peer"
STATUSES = ("equal", "refused", "crashed", "wrong", "timeout", "skipped")
DEFAULT_OUT = cov.ROOT / "benchmarks" / "results" / "coverage_mesh.json"


@dataclass(frozen=True)
class Config:
    """One way to run the mesh: torch's schedule, stages per rank, the data parallelism, and
    the micro-batches per replica (each the fewest the schedule accepts on 2 ranks)."""

    schedule: str
    stages_per_rank: int
    data_parallel: str
    n_microbatches: int

    @property
    def name(self) -> str:
        return f"{self.schedule}/{self.data_parallel}"


CONFIGS = (
    Config("gpipe", 1, "ddp", 2),
    Config("1f1b", 1, "fsdp", 2),
    Config("loopedbfs", 2, "ddp", 2),
    Config("interleaved1f1b", 2, "fsdp", 2),
    Config("zbvzerobubble", 2, "fsdp", 4),  # zero bubble: FSDP only (DDP misses W passes)
)


def configs_for(name: str, count: int) -> list[Config]:
    """``count`` of the configurations (all when ``count >= len(CONFIGS)``), starting at one
    fixed per model name, so that a sweep over many models covers each about equally."""
    if count >= len(CONFIGS):
        return list(CONFIGS)
    start = zlib.crc32(name.encode()) % len(CONFIGS)
    return [CONFIGS[(start + i) % len(CONFIGS)] for i in range(count)]


# ---------------------------------------------------------------------------------------------
# The model, its batch and the loss, made alike in every rank and in the driver


def prepared(name: str, m: int | None = None) -> tuple[nn.Module, cov.Args, cov.Kwargs]:
    """The model of ``name`` in float64 with no dropout, in train mode, and its global batch
    (with ``m``: :func:`widened` to ``m`` micro-batches per replica)."""
    spec = cov.registry()[name]
    torch.manual_seed(0)
    # the driver checks model after model: each gets its own default dtype, as a rank does
    torch.set_default_dtype(torch.float64 if spec.default_double else torch.float32)
    model, args, kwargs = spec.build()
    model = model.double().train()
    cov.zero_dropout(model)
    args, kwargs = cov.to_double(args), cov.to_double(kwargs)
    return (model, *widened(args, kwargs, DP * m)) if m else (model, args, kwargs)


def widened(args: cov.Args, kwargs: cov.Kwargs, rows: int) -> tuple[cov.Args, cov.Kwargs]:
    """The batch, when it has fewer than ``rows`` rows, repeated along dim 0 to ``rows``
    (every tensor, as ``cov.split_rows`` splits every tensor): a model whose example batch
    is kept small for speed still gives each replica the micro-batches a schedule needs. The
    loss weighs each copy of a sample by its own global index, so a copy that went to
    another position would still show."""
    have = batch_size(args, kwargs)
    if have >= rows:
        return args, kwargs
    reps = math.ceil(rows / have)

    def grow(x: Any) -> Any:
        if not isinstance(x, torch.Tensor) or not x.dim():
            return x
        return x.repeat(reps, *[1] * (x.dim() - 1))[:rows]

    args, kwargs = tree_map(grow, (args, kwargs))
    return args, kwargs


def batch_size(args: cov.Args, kwargs: cov.Kwargs) -> int:
    return next(x.size(0) for x in tree_flatten((args, kwargs))[0] if isinstance(x, torch.Tensor))


def _weights(i: int, x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Leaf ``i``'s loss weights: per sample (from its global index) when the leaf's first
    dimension is the micro-batch's, else one fixed draw for the whole leaf."""
    gen = torch.Generator()
    if x.dim() and x.size(0) == index.numel():
        rows = []
        for s in index.tolist():
            gen.manual_seed(1_000_003 * i + int(s))
            rows.append(torch.randn(x.shape[1:], generator=gen, dtype=x.dtype))
        return torch.stack(rows)
    gen.manual_seed(10**9 + i)
    return torch.randn(x.shape, generator=gen, dtype=x.dtype)


def projection_loss(output: Any, index: torch.Tensor) -> torch.Tensor:
    """A fixed random projection of every floating-point leaf of ``output`` (sum-reduced);
    ``index`` holds the global batch positions of the micro-batch's samples."""
    leaves = [x for x in tree_flatten(output)[0] if isinstance(x, torch.Tensor)]
    terms = [
        (x * _weights(i, x, index)).sum() for i, x in enumerate(leaves) if x.is_floating_point()
    ]
    return sum(terms, torch.zeros((), dtype=torch.float64))


def micro_batches(args: cov.Args, kwargs: cov.Kwargs, m: int) -> list[list[Any]]:
    """Per replica, its ``m`` micro-batches as ``(args, kwargs, index)``."""
    index = torch.arange(batch_size(args, kwargs))
    return [cov.split_rows(part, m) for part in cov.split_rows((args, kwargs, index), DP)]


# ---------------------------------------------------------------------------------------------
# One rank


def _whole(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor: a DTensor's shards gathered over "dp" (a collective)."""
    full = getattr(t, "full_tensor", None)
    return (full() if callable(full) else t).detach().clone()


def rank_job(name: str, config: Config) -> Row:
    """Build this rank's part of the pipeline, run one step and one SGD update."""
    from torch.distributed.device_mesh import init_device_mesh

    model, args, kwargs = prepared(name, config.n_microbatches)
    mesh = init_device_mesh("cpu", (PP, DP), mesh_dim_names=("pp", "dp"))
    replica = mesh.get_local_rank("dp")
    index = torch.arange(batch_size(args, kwargs))
    args, kwargs, index = cov.split_rows((args, kwargs, index), DP)[replica]
    pipe = fd.pipeline_schedule(
        model,
        cov.fresh(args),
        example_kwargs=cov.fresh(kwargs),
        n_microbatches=config.n_microbatches,
        loss_fn=projection_loss,
        scale_grads=False,  # sum-reduced: the gradients are eager's on the replica's rows
        schedule=config.schedule,
        stages_per_rank=config.stages_per_rank,
        mesh=mesh,
        data_parallel=config.data_parallel,
    )
    losses: list[torch.Tensor] = []
    inputs = (args, kwargs) if pipe.is_first else ((), {})
    pipe.step(*inputs[0], target=index if pipe.is_last else None, losses=losses, **inputs[1])
    pipe.sync_tied_gradients()
    own = pipe.named_parameters()
    grads = {k: _whole(p.grad) for k, p in own if p.grad is not None}
    torch.optim.SGD(pipe.parameters(), lr=LR).step()
    state = {k: _whole(v) for k, v in pipe.state_dict().items()}
    return {
        "replica": replica,
        "stages": pipe.stage_indices,
        "loss": float(sum(float(x.detach()) for x in losses)) if losses else None,
        "grads": grads,
        "params": {k for k, _ in own},
        "state": state,
    }


def rank_entry(rank: int, port: int, out: str, name: str, config: Config) -> None:
    """A rank's process: the job's result, or its error, saved to ``out``/rank<r>.pt."""
    torch.set_num_threads(1)
    path = Path(out) / f"rank{rank}.pt"
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=WORLD,
        timeout=datetime.timedelta(seconds=PG_TIMEOUT_S),
    )
    try:
        result: Row = {"ok": rank_job(name, config)}
    except FxPipeError as e:  # raised on every rank before anything is sent
        result = {"refused": f"{type(e).__name__}: {e}"}
    except BaseException as e:
        text = cov.scrub(f"{type(e).__name__}: {e}")
        torch.save({"error": text, "traceback": cov.scrub(traceback.format_exc())}, path)
        os._exit(1)  # peers may be blocked in a collective: no orderly shutdown
    torch.save(result, path)
    os._exit(0)


_CONTEXT = mp.get_context("forkserver")


def launch(name: str, config: Config, timeout: float, tmp: Path) -> tuple[list[Any], bool]:
    """Run the 4 ranks; (exit code, saved result) per rank, and whether it timed out. Once a
    rank has failed, the others get a few seconds to fail alike, then are killed."""
    port = free_port()
    procs = [
        _CONTEXT.Process(target=rank_entry, args=(r, port, str(tmp), name, config), daemon=True)
        for r in range(WORLD)
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(p.is_alive() for p in procs):
        if any(p.exitcode not in (None, 0) for p in procs):
            deadline = min(deadline, time.monotonic() + 5)
        time.sleep(0.1)
    timed_out = any(p.is_alive() for p in procs)
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join()
    files = [tmp / f"rank{r}.pt" for r in range(WORLD)]
    runs = [
        (p.exitcode, torch.load(f, weights_only=False) if f.exists() else None)
        for p, f in zip(procs, files)
    ]
    return runs, timed_out


# ---------------------------------------------------------------------------------------------
# The oracle and the verdict


@dataclass
class Oracle:
    """Eager on every micro-batch of both replicas: the summed loss, the gradients averaged
    over the replicas, and the parameters after one SGD step with them."""

    loss: float
    grads: dict[str, torch.Tensor | None]
    params: dict[str, torch.Tensor]


def oracle(name: str, m: int) -> Oracle:
    model, args, kwargs = prepared(name, m)
    total = torch.zeros((), dtype=torch.float64)
    for replica in micro_batches(args, kwargs, m):
        for a, k, index in replica:
            loss = projection_loss(model(*cov.fresh(a), **cov.fresh(k)), index)
            total = total + loss.detach()
            if loss.requires_grad:
                loss.backward()
    grads = {
        n: None if p.grad is None else p.grad.detach() / DP for n, p in model.named_parameters()
    }
    with torch.no_grad():
        params = {
            n: p.detach() - LR * grads[n] if grads[n] is not None else p.detach().clone()
            for n, p in model.named_parameters()
        }
    return Oracle(float(total), grads, params)


def judge(results: list[Row], want: Oracle) -> Row:
    """equal or wrong: the loss, every gradient (each replica's, each once) and every
    parameter after the update (each replica's merged shards) against the oracle."""
    worst: dict[str, float] = {}
    losses = [r["loss"] for r in results if r["loss"] is not None]
    if len(losses) != DP:
        return {"status": "wrong", "reason": f"{len(losses)} ranks report a loss, not {DP}"}
    got_loss = sum(losses)
    worst["loss"] = abs(got_loss - want.loss) / max(abs(want.loss), 1e-30)
    if not worst["loss"] < cov.TOLERANCE:
        reason = f"loss {got_loss!r}, eager {want.loss!r}: err {worst['loss']:.2e}"
        return {"status": "wrong", "reason": reason, "max_err": worst}
    first: str | None = None
    for replica in range(DP):
        mine = [r for r in results if r["replica"] == replica]
        grads: dict[str, Any] = {k: None for k in want.grads}
        for r in mine:
            grads.update(r["grads"])
        params = fd.merge_state_dicts([r["state"] for r in mine])
        params = {k: params.get(k) for k in want.params}
        for kind, got, ref in (("grad", grads, want.grads), ("param", params, want.params)):
            problem, err = cov.compare_tensors(f"replica {replica}: {kind}", got, ref)
            worst[kind] = max(worst.get(kind, 0.0), err)
            first = first or problem
    if first:
        return {"status": "wrong", "reason": first, "max_err": worst}
    return {"status": "equal", "reason": "", "max_err": worst}


def check(name: str, config: Config, timeout: float, oracles: dict[int, Any]) -> Row:
    """One (model, configuration): launched, then judged against the (cached) oracle."""
    import tempfile

    row: Row = {"name": name, "family": cov.registry()[name].family, "config": config.name}
    started = time.perf_counter()
    try:
        model, args, kwargs = prepared(name)
    except Exception as exc:
        return {
            **row,
            "status": "skipped",
            "reason": f"build failed: {cov._first_line(repr(exc))}",
        }
    m = config.n_microbatches
    have = batch_size(args, kwargs)
    if have < DP * m:  # the example batch is repeated (prepared(name, m)); said in the row
        row["batch"] = f"{have} repeated to {DP * m}"
    elif have % DP:
        return {**row, "status": "skipped", "reason": f"batch {have} does not split in {DP}"}
    if m not in oracles:
        try:
            oracles[m] = oracle(name, m)
        except Exception as exc:
            oracles[m] = f"eager failed: {cov._first_line(repr(exc))}"
    if isinstance(oracles[m], str):
        return {**row, "status": "skipped", "reason": oracles[m]}
    with tempfile.TemporaryDirectory() as tmp:
        runs, timed_out = launch(name, config, timeout, Path(tmp))
    row["seconds"] = round(time.perf_counter() - started, 1)
    if timed_out and all(res is None for _, res in runs):
        return {**row, "status": "timeout", "reason": f"no rank done after {timeout:.0f} s"}
    died = [r for r, (code, res) in enumerate(runs) if res is None and code not in (0, None)]
    errors = sorted(  # a peer's lost connection is a symptom: the cause first
        ((r, res) for r, (_, res) in enumerate(runs) if res and "error" in res),
        key=lambda item: _SYMPTOM in item[1]["error"],
    )
    if errors or died:
        codes = [code for code, _ in runs]
        dead = f"rank(s) {died} died without a word (exit codes {codes}); " if died else ""
        r, res = errors[0] if errors else (died[0], {"error": "", "traceback": ""})
        line = cov._first_line(res["error"], 300)
        return {**row, "status": "crashed", "reason": f"{dead}rank {r}: {line}",
                "traceback": res["traceback"][-3000:]}  # fmt: skip
    refused = {res["refused"] for _, res in runs if res and "refused" in res}
    if refused:
        whole = len(refused) == 1 and all(res and "refused" in res for _, res in runs)
        status = "refused" if whole else "crashed"
        reason = sorted(refused)[0] if whole else f"refused on some ranks only: {sorted(refused)}"
        return {**row, "status": status, "reason": cov._first_line(reason, 300)}
    if timed_out or any(code != 0 or not res for code, res in runs):
        codes = [code for code, _ in runs]
        return {**row, "status": "timeout" if timed_out else "crashed",
                "reason": f"ranks ended without a result (exit codes {codes})"}  # fmt: skip
    if not math.isfinite(oracles[m].loss):  # it ran, but there is nothing to compare with
        reason = f"eager's loss is {oracles[m].loss} (its outputs are not finite here)"
        return {**row, "status": "skipped", "reason": reason}
    return {**row, **judge([res["ok"] for _, res in runs], oracles[m])}


# ---------------------------------------------------------------------------------------------
# The driver


def table(rows: list[Row]) -> str:
    """Counts per configuration and class, then one line per row that is not equal."""
    names = [c.name for c in CONFIGS]
    counts = Counter((r["config"], r["status"]) for r in rows)
    head = f"{'config':<22}" + "".join(f"{s:>9}" for s in STATUSES)
    lines = [head, "-" * len(head)]
    for name in names + ["all"]:
        n = [
            sum(counts[(c, s)] for c in names) if name == "all" else counts[(name, s)]
            for s in STATUSES
        ]
        lines.append(f"{name:<22}" + "".join(f"{c:>9}" for c in n))
    order = {s: i for i, s in enumerate(("wrong", "crashed", "timeout", "refused", "skipped"))}
    lines.append("")
    for r in sorted(
        (r for r in rows if r["status"] != "equal"),
        key=lambda r: (order.get(r["status"], 9), r["name"], r["config"]),
    ):
        reason = cov._first_line(r.get("reason", ""), 140)
        lines.append(f"{r['status']:<8} {r['name']:<30} {r['config']:<22} {reason}")
    return "\n".join(lines)


def _meta(args: argparse.Namespace) -> Row:
    return {
        "date": time.strftime("%Y-%m-%d"),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "mesh": {"pp": PP, "dp": DP},
        "configs": [c.name for c in CONFIGS],
        "per_model": args.configs,
        "timeout_s": args.timeout,
        "tolerance": cov.TOLERANCE,
        "label": args.label,
        **cov.library_versions(),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="comma-separated name or family patterns")
    parser.add_argument(
        "--configs", default="2", help="configurations per model: 'all' or a number (default 2)"
    )
    parser.add_argument("--config", help="only these configurations (comma-separated names)")
    parser.add_argument("--timeout", type=float, default=240.0, help="seconds per launch")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--merge", action="store_true", help="keep --out's other rows")
    parser.add_argument("--show", action="store_true", help="print the table of --out only")
    parser.add_argument("--list", action="store_true", help="list what would run")
    parser.add_argument("--label", default="", help="a note kept in the JSON (which fxpipe)")
    args = parser.parse_args(argv)
    if args.show:
        print(table(json.loads(args.out.read_text())["rows"]))
        return
    count = len(CONFIGS) if args.configs == "all" else int(args.configs)
    specs = cov.interleave(cov.select(cov.registry(), args.only))
    jobs = [(s.name, c) for s in specs for c in configs_for(s.name, count)]
    if args.config:
        jobs = [(name, c) for name, c in jobs if c.name in args.config.split(",")]
    if args.list:
        print("\n".join(f"{name:<34} {c.name}" for name, c in jobs))
        return
    for key, value in cov.CHILD_ENV.items():
        os.environ.setdefault(key, value)
    torch.set_num_threads(1)
    _CONTEXT.set_forkserver_preload(["torch", "torch.distributed", "fxpipe.distributed"])
    meta, rows = _meta(args), []
    oracles: dict[str, dict[int, Any]] = {}
    for i, (name, config) in enumerate(jobs, 1):
        row = check(name, config, args.timeout, oracles.setdefault(name, {}))
        rows.append(row)
        head = f"[{i}/{len(jobs)}] {name:<30} {config.name:<22} {row['status']:<8}"
        seconds = row.get("seconds", 0.0)
        print(f"{head} {seconds:6.1f} s  {cov._first_line(row.get('reason', ''), 90)}", flush=True)
        cov.save(args.out, rows, meta, args.merge, key=lambda r: (r["name"], r["config"]))
        if len(oracles) > 2:  # keep the last model's oracles only
            oracles.pop(next(iter(oracles)))
    print()
    print(table(rows))


if __name__ == "__main__":
    main()
