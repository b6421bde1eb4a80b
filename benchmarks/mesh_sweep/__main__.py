"""Mesh sweep: the model sweep's models on meshes of gloo ranks, against eager.

Run from the repository root::

    python -m benchmarks.mesh_sweep [--only PATTERN] [--meshes GROUP] [--configs all|N]
        [--config NAMES] [--dtype float64,float32] [--timeout 240]

Every model of the sweeps' registry (``benchmarks/harness/models/registry.py``; built in
float64, every dropout at zero, train mode) is pipelined by
``fxpipe.distributed.pipeline_schedule`` on CPU processes (gloo on loopback; ``ranks.py``)
under configurations (``configs.py``) that ``--meshes`` groups: ``schedules`` (the
default), five (schedule, data parallelism) pairs on a ``(pp, dp) = (2, 2)`` mesh, one step
at the model's example batch; ``layouts``, the pipeline alone on 2 ranks, two 2 x 2 meshes
(DDP, FSDP) and ``tensor_parallel="auto"`` on ``("pp", "dp", "tp")`` meshes of 1 x 1 x 2 and
2 x 1 x 2, replicas of 2, 4 or 8 sequences, two steps each (12 tokens, then 7; a model
without a sequence takes one). Each rank runs each step with a sum-reduced loss, sums its
tied copies (``sync_tied_gradients``), hands back its whole gradients (DTensors gathered)
and, after an SGD step, its state-dict shard (gathered likewise). The oracle (``oracle.py``)
is eager PyTorch in this process, on the same micro-batches (micro-batching changes what a
BatchNorm or capacity-limited router computes, which is what the pipeline promises to
equal), step by step (a step after the first from the parameters the pipeline held after
its step before, already judged): the loss summed over every micro-batch of every replica,
every gradient over the replicas (DDP and FSDP average them), every parameter after the same
SGD step. In float64 each is within 1e-7 of eager's; in float32 (``--dtype``; the model built
in float64 and copied) each is no further from eager in float64 than ``FACTOR`` x eager in
float32 is (``benchmarks/harness/precision.py``; ``judge.py``).

The loss is a fixed random projection of every floating-point leaf of the model's output,
with each sample's weights drawn from its index in the global batch (the target), so that
any micro-batch, on any replica, is weighed as eager weighs it. A model whose example
batch has fewer rows than a schedule's micro-batches on both replicas (kept small for speed
in the registry) gets its batch repeated to that many rows; the row says so (``batch``).

Each (model, configuration, dtype) is one launch of the ranks from a fork server, with a
time limit; a row is equal / refused (an ``FxPipeError``, on every rank) / crashed / wrong /
timeout / skipped (eager itself fails, or the batch does not split between the replicas),
its worst step's. Rows go to ``benchmarks/results/mesh_sweep.json`` (the schedules) or
``mesh_sweep_layouts.json`` after each launch.
Needs transformers (in the ``test`` extra); timm and torchvision models run where those
import (see ``benchmarks/docs/sweep.md``).
"""

from __future__ import annotations

import argparse
import os
import platform
import time
from pathlib import Path

import torch

from benchmarks.harness.compare import TOLERANCE
from benchmarks.harness.failures import first_line
from benchmarks.harness.machine import library_versions
from benchmarks.harness.models.registry import interleave, registry, select
from benchmarks.harness.output import result_path
from benchmarks.harness.precision import FACTOR
from benchmarks.harness.processes import SINGLE_THREAD_ENV
from benchmarks.harness.rows import Row, load_rows, save_rows
from benchmarks.mesh_sweep.batch import DTYPES
from benchmarks.mesh_sweep.check import Oracles, check
from benchmarks.mesh_sweep.configs import GROUPS, SCHEDULES, Config, configs_for
from benchmarks.mesh_sweep.ranks import PG_TIMEOUT_S, preload
from benchmarks.mesh_sweep.table import dtype_of, table

DEFAULT_OUT = result_path("mesh_sweep")
LAYOUTS_OUT = result_path("mesh_sweep_layouts")
LIBRARIES = ("torch", "torchvision", "timm", "transformers")
#: Seconds a rank of a layout waits at a collective: a tensor-parallel plan traces the model
#: twice, and 4 ranks share 2 cores.
LAYOUT_PG_TIMEOUT_S = 240


def _described(c: Config) -> Row:
    """A configuration as the JSON's meta says it."""
    return {"shape": list(c.shape), "schedule": c.schedule, "stages_per_rank": c.stages_per_rank,
            "data_parallel": c.data_parallel, "n_microbatches": c.n_microbatches,
            "rows_per_replica": c.rows, "lengths": list(c.lengths)}  # fmt: skip


def _meta(args: argparse.Namespace, configs: tuple[Config, ...]) -> Row:
    return {
        "date": time.strftime("%Y-%m-%d"),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "meshes": args.meshes,
        "configs": {c.name: _described(c) for c in configs},
        "dtypes": args.dtype.split(","),
        "per_model": args.configs,
        "timeout_s": args.timeout,
        "tolerance": TOLERANCE,
        "factor": FACTOR,
        "label": args.label,
        **library_versions(LIBRARIES),
    }


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="comma-separated name or family patterns")
    parser.add_argument("--meshes", default="schedules", choices=sorted(GROUPS),
                        help="which configurations: the five schedules on 2 x 2 (default), "
                        "the layouts (pp, dp, tp or all of them), or all")  # fmt: skip
    parser.add_argument("--configs", help="configurations per model: 'all' or a number "
                        "(default 2 of the schedules, all of the layouts)")  # fmt: skip
    parser.add_argument("--config", help="only these configurations (comma-separated names)")
    parser.add_argument("--dtype", default="float64", help="float64, float32 or both, "
                        "comma-separated (default float64)")  # fmt: skip
    parser.add_argument("--timeout", type=float, default=240.0, help="seconds per launch")
    parser.add_argument("--out", type=Path, help="default: benchmarks/results/mesh_sweep.json "
                        "(the schedules) or mesh_sweep_layouts.json")  # fmt: skip
    parser.add_argument("--merge", action="store_true", help="keep --out's other rows")
    parser.add_argument("--show", action="store_true", help="print the table of --out only")
    parser.add_argument("--list", action="store_true", help="list what would run")
    parser.add_argument("--label", default="", help="a note kept in the JSON (which fxpipe)")
    return parser


def _jobs(args: argparse.Namespace) -> list[tuple[str, Config, str]]:
    """(model, configuration, dtype) in the order they run: model by model."""
    configs = GROUPS[args.meshes]
    count = args.configs or ("2" if configs == SCHEDULES else "all")
    count = len(configs) if count == "all" else int(count)
    dtypes = args.dtype.split(",")
    unknown = set(dtypes) - set(DTYPES)
    if unknown:
        raise SystemExit(f"--dtype {sorted(unknown)}: one of {sorted(DTYPES)}")
    specs = interleave(select(registry(), args.only))
    jobs = [(s.name, c, d) for s in specs for c in configs_for(s.name, count, configs)
            for d in dtypes]  # fmt: skip
    if args.config:
        jobs = [job for job in jobs if job[1].name in args.config.split(",")]
    return jobs


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    out = args.out or (DEFAULT_OUT if GROUPS[args.meshes] == SCHEDULES else LAYOUTS_OUT)
    if args.show:
        print(table(load_rows(out)[1]))
        return
    jobs = _jobs(args)
    if args.list:
        print("\n".join(f"{name:<34} {c.name:<22} {d}" for name, c, d in jobs))
        return
    for key, value in SINGLE_THREAD_ENV.items():
        os.environ.setdefault(key, value)
    torch.set_num_threads(1)
    preload([registry()[name] for name in dict.fromkeys(name for name, _, _ in jobs)])
    meta, rows = _meta(args, GROUPS[args.meshes]), []
    order = list(registry())
    oracles: dict[str, Oracles] = {}
    for i, (name, config, dtype) in enumerate(jobs, 1):
        pg = PG_TIMEOUT_S if config in SCHEDULES else LAYOUT_PG_TIMEOUT_S
        row = check(name, config, dtype, args.timeout, oracles.setdefault(name, {}), pg)
        rows.append(row)
        head = f"[{i}/{len(jobs)}] {name:<24} {config.name:<22} {dtype:<8} {row['status']:<8}"
        seconds = row.get("seconds", 0.0)
        print(f"{head} {seconds:6.1f} s  {first_line(row.get('reason', ''), 90)}", flush=True)
        save_rows(out, rows, meta, args.merge, order,
                  key=lambda r: (r["name"], r["config"], dtype_of(r)))  # fmt: skip
        if len(oracles) > 2:  # keep the last model's oracles only
            oracles.pop(next(iter(oracles)))
    print()
    print(table(rows))


if __name__ == "__main__":
    main()
