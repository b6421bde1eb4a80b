"""Mesh sweep: the model sweep's models on a 2 x 2 mesh of gloo ranks, against eager.

Run from the repository root::

    python -m benchmarks.mesh_sweep [--only PATTERN] [--configs all|N] [--timeout 240]

Every model of the sweeps' registry (``benchmarks/harness/models/registry.py``; float64,
every dropout at zero, train mode) is pipelined by ``fxpipe.distributed.pipeline_schedule``
on 4 CPU processes (gloo on loopback; ``ranks.py``) arranged as a ``(pp, dp) = (2, 2)``
mesh: two pipeline replicas, each fed half of the global batch, under several (schedule,
data parallelism) configurations. Each rank runs one step with a sum-reduced loss, sums its
tied copies (``sync_tied_gradients``), takes one SGD step and hands back its gradients and
its state-dict shard (FSDP's shards gathered). The oracle (``oracle.py``) is eager PyTorch
in this process, on the same micro-batches (micro-batching changes what a BatchNorm or
capacity-limited router computes, which is what the pipeline promises to equal): the loss
summed over every micro-batch of both replicas, every gradient over the replicas (DDP and
FSDP average them), every parameter after the same SGD step.

The loss is a fixed random projection of every floating-point leaf of the model's output,
with each sample's weights drawn from its index in the global batch (the target), so that
any micro-batch, on any replica, is weighed as eager weighs it. A model whose example
batch has fewer rows than the configuration's micro-batches on both replicas (kept small
for speed in the registry) gets its batch repeated to that many rows; the row says so
(``batch``).

Each (model, configuration) is one launch of 4 ranks from a fork server, with a time limit;
a row is equal / refused (an ``FxPipeError``, on every rank) / crashed / wrong / timeout /
skipped (eager itself fails, or the batch does not split between the replicas). Rows go
to ``benchmarks/results/mesh_sweep.json`` after each launch.
Needs transformers (in the ``test`` extra); timm and torchvision models run where those
import (see ``benchmarks/docs/sweep.md``).
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch

from benchmarks.harness.compare import TOLERANCE
from benchmarks.harness.failures import first_line
from benchmarks.harness.machine import library_versions
from benchmarks.harness.models.registry import interleave, registry, select
from benchmarks.harness.output import result_path
from benchmarks.harness.processes import SINGLE_THREAD_ENV
from benchmarks.harness.rows import STATUSES, Row, load_rows, save_rows
from benchmarks.mesh_sweep.batch import CONFIGS, DP, PP, Config, batch_size, configs_for, prepared
from benchmarks.mesh_sweep.oracle import judge, oracle
from benchmarks.mesh_sweep.ranks import CONTEXT, launch

#: What a rank whose peer died reports (gloo over TCP): not the cause.
_SYMPTOM = "Connection reset by peer"
DEFAULT_OUT = result_path("mesh_sweep")
LIBRARIES = ("torch", "torchvision", "timm", "transformers")


def check(name: str, config: Config, timeout: float, oracles: dict[int, Any]) -> Row:
    """One (model, configuration): launched, then judged against the (cached) oracle."""
    row: Row = {"name": name, "family": registry()[name].family, "config": config.name}
    started = time.perf_counter()
    try:
        model, args, kwargs = prepared(name)
    except Exception as exc:
        return {
            **row,
            "status": "skipped",
            "reason": f"build failed: {first_line(repr(exc))}",
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
            oracles[m] = f"eager failed: {first_line(repr(exc))}"
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
        line = first_line(res["error"], 300)
        return {**row, "status": "crashed", "reason": f"{dead}rank {r}: {line}",
                "traceback": res["traceback"][-3000:]}  # fmt: skip
    refused = {res["refused"] for _, res in runs if res and "refused" in res}
    if refused:
        whole = len(refused) == 1 and all(res and "refused" in res for _, res in runs)
        status = "refused" if whole else "crashed"
        reason = sorted(refused)[0] if whole else f"refused on some ranks only: {sorted(refused)}"
        return {**row, "status": status, "reason": first_line(reason, 300)}
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
        reason = first_line(r.get("reason", ""), 140)
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
        "tolerance": TOLERANCE,
        "label": args.label,
        **library_versions(LIBRARIES),
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
        print(table(load_rows(args.out)[1]))
        return
    count = len(CONFIGS) if args.configs == "all" else int(args.configs)
    specs = interleave(select(registry(), args.only))
    jobs = [(s.name, c) for s in specs for c in configs_for(s.name, count)]
    if args.config:
        jobs = [(name, c) for name, c in jobs if c.name in args.config.split(",")]
    if args.list:
        print("\n".join(f"{name:<34} {c.name}" for name, c in jobs))
        return
    for key, value in SINGLE_THREAD_ENV.items():
        os.environ.setdefault(key, value)
    torch.set_num_threads(1)
    CONTEXT.set_forkserver_preload(["torch", "torch.distributed", "fxpipe.distributed"])
    meta, rows = _meta(args), []
    order = list(registry())
    oracles: dict[str, dict[int, Any]] = {}
    for i, (name, config) in enumerate(jobs, 1):
        row = check(name, config, args.timeout, oracles.setdefault(name, {}))
        rows.append(row)
        head = f"[{i}/{len(jobs)}] {name:<30} {config.name:<22} {row['status']:<8}"
        seconds = row.get("seconds", 0.0)
        print(f"{head} {seconds:6.1f} s  {first_line(row.get('reason', ''), 90)}", flush=True)
        save_rows(args.out, rows, meta, args.merge, order, key=lambda r: (r["name"], r["config"]))
        if len(oracles) > 2:  # keep the last model's oracles only
            oracles.pop(next(iter(oracles)))
    print()
    print(table(rows))


if __name__ == "__main__":
    main()
