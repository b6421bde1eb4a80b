"""Partition quality and planning speed of fxpipe's partitioner.

Run from the repository root::

    python -m benchmarks.partition [--out PATH] [--repeats N] [--sizes 5000 50000]

Tables 1a and 1b (``quality.py``), for every model of the benchmark's zoo
(``benchmarks/harness/models/zoo.py``) and K = 2, 4, 8, once at the tests' sizes and once
at benchmark sizes (``BENCH_SIZE``: images of 64-128 pixels, feature batches of 512-2048
rows, the GPT at GPT-2 small's proportions, the Llama at Llama-2's), where arithmetic
rather than per-operator overhead sets node times:

- the fxpipe bottleneck (``partition_graph(g, K)``) on costs profiled once per model
  (``mode="time"``: forward + backward per node, median of ``--repeats``);
- ``/exact``: divided by the exact optimum over every convex split (the ideal DP on the unit
  DAG), or, when the unit DAG has too many ideals, by the exact split of the fx order
  (marked ``fo``); ``orders/exact``: the same for ``partition_graph(g, K, exact_limit=0)``,
  the fallback fxpipe uses on graphs with too many ideals (order search, then its borders
  re-placed exactly within windows);
- ``/LB0``: divided by max(total / K, heaviest unit); units are the pieces no split can cut;
- baselines on the same time costs, each the exact min-max split of the unit order (fx
  order) under another weight and then evaluated under the time costs: equal node count,
  parameter bytes (DeepSpeed's default) and FLOPs; shown as baseline / fxpipe (> 1: fxpipe
  is better);
- bytes the stages send each other with direct sends (the default codegen: a value goes
  once to every other stage that reads it), activations and parameters apart, for three
  splits: the one a min-max solver without a bytes objective returns (``mm``), fxpipe at
  slack 0 and fxpipe at 5% slack; with the ratios mm / 5% and 0 / 5% of activation bytes
  (a tied embedding goes from the first stage to the last whatever the split);
- the GPipe speedup over one device predicted by the makespan formula with M = 4K
  micro-batches and no communication term: total / (sum(c) / M + (M - 1) max(c) / M).

Table 2 (``speed.py``): planning time of ``partition_graph`` on synthetic residual/branchy
graphs of 5,000 and 50,000 nodes, with and without the exact search's ideal enumeration.

The summary checks the goals (``goals.py``); its ``bound`` lines say what any convex split
could reach on the same rows (a baseline over the exact optimum; whether the 5%-slack bytes
are exact).

The same rows, the targets and the run's settings go to ``benchmarks/results/partition.json``.
"""

from __future__ import annotations

import argparse
import os
import platform
import time
from collections.abc import Sequence
from pathlib import Path

import networkx as nx
import numpy as np
import torch

from benchmarks.harness.models.zoo import ZOO
from benchmarks.harness.output import command_line, format_table, result_path, save_json
from benchmarks.partition.goals import targets
from benchmarks.partition.quality import EXACT_IDEALS, SLACK, STAGES, ZOO_COLUMNS, zoo_rows
from benchmarks.partition.speed import PLAN_COLUMNS, PLAN_SIZES, PLAN_STAGES, plan_rows


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--out",
        type=Path,
        default=result_path("partition"),
        help="where to write the JSON rows (default: benchmarks/results/partition.json)",
    )
    parser.add_argument(
        "--repeats", type=int, default=7, help="timed runs per node when profiling (median)"
    )
    parser.add_argument(
        "--batch",
        type=int,
        default=None,
        help="profile the test-size zoo at this batch size (default: each model's own, 8)",
    )
    parser.add_argument(
        "--models",
        nargs="*",
        default=None,
        choices=list(ZOO),
        help="only these zoo models (default: all; the summary then covers fewer rows)",
    )
    parser.add_argument(
        "--sizes",
        type=int,
        nargs="*",
        default=list(PLAN_SIZES),
        help="synthetic graph sizes for the planning-time table",
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    started = time.perf_counter()
    command = command_line()
    header = (
        f"command: {command}\n"
        f"torch {torch.__version__}, networkx {nx.__version__}, numpy {np.__version__}, "
        f"python {platform.python_version()}; {os.cpu_count()} cores "
        f"({platform.machine()}, {platform.system()}), 1 torch thread"
    )
    print(header, flush=True)

    legend = (
        "Bottlenecks on profiled fwd+bwd time (ms). /exact: exact optimum over convex splits "
        "(fo: exact on the fx order only). x/fx: baseline bottleneck / fxpipe bottleneck. "
        "act KiB: activation bytes sent between stages (direct sends) by the min-max-only "
        f"split (mm), by fxpipe at slack 0 and at {SLACK:.0%}; param KiB: parameter bytes "
        f"sent, same three splits. bn@{SLACK:.0%}: bottleneck at {SLACK:.0%} slack / at 0. "
        "GPipe x: predicted speedup, M = 4K."
    )
    zoo = []
    for number, size, what in (
        ("1a", "test", "the tests' sizes (microseconds per node)"),
        ("1b", "bench", "benchmark sizes (BENCH_SIZE)"),
    ):
        rows = zoo_rows(args.repeats, size, args.batch, args.models)
        print(f"\nTable {number}. The zoo at {what}. {legend}\n", flush=True)
        print(format_table(rows, ZOO_COLUMNS), flush=True)
        zoo += rows

    plans = plan_rows(args.sizes)
    print(
        "\nTable 2. partition_graph planning time on synthetic residual/branchy graphs "
        "(median of up to 3 runs); 's, exact off': the same with exact_limit=0.\n"
    )
    print(format_table(plans, PLAN_COLUMNS))

    goals = targets(zoo, plans)
    print("\nSummary")
    width = max(len(t["goal"]) for t in goals)
    for t in goals:
        verdict = {True: "PASS", False: "MISS", None: "" if t["target"] == "-" else "n/a"}[
            t["pass"]
        ]
        print(f"  {t['goal']:<{width}}  target {t['target']:<22}  {t['measured']:<44}  {verdict}")
    elapsed = time.perf_counter() - started
    print(f"\nwall time {elapsed:.0f} s")

    result = {
        "command": command,
        "torch": torch.__version__,
        "networkx": nx.__version__,
        "numpy": np.__version__,
        "python": platform.python_version(),
        "machine": {
            "cores": os.cpu_count(),
            "arch": platform.machine(),
            "system": platform.system(),
            "torch_threads": torch.get_num_threads(),
        },
        "settings": {
            "stages": list(STAGES),
            "slack": SLACK,
            "profile_repeats": args.repeats,
            "models": args.models or list(ZOO),
            "exact_ideal_limit": EXACT_IDEALS,
            "micro_batches": "4K",
            "plan_sizes": list(args.sizes),
            "plan_stages": list(PLAN_STAGES),
        },
        "zoo": zoo,
        "planning": plans,
        "targets": goals,
        "wall_s": elapsed,
    }
    return save_json(args.out, result)


if __name__ == "__main__":
    raise SystemExit(main())
