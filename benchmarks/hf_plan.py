"""Plans Hugging Face models at their published sizes on ``meta`` devices: no weights, no
memory, FLOP costs. The partitioner at the scale it is meant for.

Run from the repository root (transformers is in the ``test`` extra)::

    python -m benchmarks.hf_plan [--out PATH] [--models llama-7b gpt2-xl] [--stages 4 8]

For each model (a batch of 8 sequences of 1,024 tokens, ``use_cache=False``) and K: the
fxpipe bottleneck over LB0 = max(total / K, heaviest unit) at slack 0 (the default), 1%
and 5%; the activation bytes the stages send each other (direct sends) for the split a
min-max solver without a bytes objective returns on the fx order (``mm``) and for fxpipe
at each slack; the planning time (``partition_graph`` alone, and the whole ``fxpipe.plan``, which
adds tracing with torch.export and pricing on fake tensors).
"""

from __future__ import annotations

import argparse
import platform
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import transformers

import fxpipe
from benchmarks.harness.models.giants import GIANTS
from benchmarks.harness.output import command_line, format_table, result_path, save_json
from benchmarks.harness.splits import min_max_only, traffic
from fxpipe.passes.partition.cost_graph import to_networkx
from fxpipe.passes.partition.search import partition_graph
from fxpipe.passes.partition.units import build_units
from fxpipe.passes.price.estimate import estimate_costs
from fxpipe.trace.tracing import trace

BATCH, TOKENS = 8, 1024
SLACKS = (0.0, 0.01, 0.05)
GIB = 2.0**30


def rows_for(name: str, stages: Sequence[int]) -> list[dict[str, Any]]:
    build, vocab = GIANTS[name]
    with torch.device("meta"):
        model = build()
    ids = torch.randint(0, vocab, (BATCH, TOKENS), device="meta")
    started = time.perf_counter()
    traced = trace(model, (ids,), {})
    costs = estimate_costs(traced.graph_module, traced.example_values, mode="flops")
    g = to_networkx(traced.graph_module, costs)
    front_s = time.perf_counter() - started
    units = build_units(g)
    total = float(units.weight.sum())
    out = []
    for k in stages:
        lb0 = max(total / k, float(units.weight.max()))
        mm_bytes, _ = traffic(g, min_max_only(g, units, None, k))  # on the fx order
        row: dict[str, Any] = {
            "model": name,
            "K": k,
            "nodes": g.number_of_nodes(),
            "units": units.num_units,
            "trace_and_price_s": front_s,
            "mm_gib": mm_bytes / GIB,
        }
        for slack in SLACKS:
            t0 = time.perf_counter()
            part = partition_graph(g, k, slack=slack)
            seconds = time.perf_counter() - t0
            sent, _ = traffic(g, part.stage_of)
            key = f"{slack:.0%}"
            row[f"bneck_lb0@{key}"] = part.bottleneck / lb0
            row[f"gib@{key}"] = sent / GIB
            row[f"plan_s@{key}"] = seconds
            row[f"method@{key}"] = part.method
        row["mm_over_5%"] = row["mm_gib"] / max(row["gib@5%"], 1e-12)
        t0 = time.perf_counter()
        fxpipe.plan(model, ids, ["meta"] * k, cost="flops")
        row["fxpipe_plan_s"] = time.perf_counter() - t0
        out.append(row)
    return out


COLUMNS: list[tuple[str, Callable[[dict[str, Any]], str]]] = [
    ("model", lambda r: r["model"]),
    ("K", lambda r: str(r["K"])),
    ("nodes", lambda r: f"{r['nodes']:,}"),
    *[
        (f"bn/LB0@{s:.0%}", (lambda key: lambda r: f"{r[f'bneck_lb0@{key}']:.3f}")(f"{s:.0%}"))
        for s in SLACKS
    ],
    ("GiB mm", lambda r: f"{r['mm_gib']:.2f}"),
    *[
        (f"GiB@{s:.0%}", (lambda key: lambda r: f"{r[f'gib@{key}']:.2f}")(f"{s:.0%}"))
        for s in SLACKS
    ],
    ("mm/5%", lambda r: f"{r['mm_over_5%']:.2f}"),
    ("split s@1%", lambda r: f"{r['plan_s@1%']:.2f}"),
    ("method@1%", lambda r: r["method@1%"]),
    ("fxpipe.plan s", lambda r: f"{r['fxpipe_plan_s']:.1f}"),
]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--out",
        type=Path,
        default=result_path("hf_plan"),
        help="where to write the JSON rows (default: benchmarks/results/hf_plan.json)",
    )
    parser.add_argument("--models", nargs="*", default=list(GIANTS), choices=list(GIANTS))
    parser.add_argument("--stages", type=int, nargs="*", default=[4, 8])
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    started = time.perf_counter()
    command = command_line()
    print(
        f"command: {command}\ntorch {torch.__version__}, transformers "
        f"{transformers.__version__}, python {platform.python_version()}",
        flush=True,
    )
    rows = [r for name in args.models for r in rows_for(name, args.stages)]
    print(
        "\nBatch 8 x 1,024 tokens, FLOP costs, meta devices. bn/LB0: bottleneck over "
        "max(total/K, heaviest unit). GiB: activation bytes sent between stages per batch, "
        "min-max-only split of the fx order (mm) and fxpipe at each slack.\n"
    )
    print(format_table(rows, COLUMNS))
    wall = time.perf_counter() - started
    print(f"\nwall time {wall:.0f} s")
    payload = {
        "command": command,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "batch": BATCH,
        "tokens": TOKENS,
        "rows": rows,
        "wall_s": wall,
    }
    return save_json(args.out, payload)


if __name__ == "__main__":
    raise SystemExit(main())
