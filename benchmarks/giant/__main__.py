"""Giant models under memory budgets: fxpipe's budgeted partitioner against the device maps
of Hugging Face Accelerate (``infer_auto_device_map``, "sequential" and "balanced").

Run from the repository root (transformers is in the ``test`` extra; Accelerate is needed by
this benchmark only, not by fxpipe: ``pip install accelerate``)::

    python -m benchmarks.giant [--out PATH] [--models llama-7b gpt2-xl] [--ratios 4 2 ...]

Llama-7B's and GPT-2 XL's shapes (``benchmarks/harness/models/giants.py``, float32) are built
under ``torch.device("meta")`` (no weights, no memory) and put in eval mode; the example is
a batch of 16 sequences of 1,024 tokens, run as 16 micro-batches of one sequence
(``chunks=16``) over 4 devices ``cuda:0``..``cuda:3`` (planned only: they need not be
present). Each model is traced once and priced once in FLOP on fake tensors
(``cost="flops"``, forward and backward of every node, as ``hf_plan.py`` prices); every split
below, fxpipe's, the brute force's and Accelerate's, is priced on that one cost table, so
only ratios of costs are reported.

Memory is fxpipe's inference estimate (``training=False``; what Accelerate's maps are for):
per stage, its weights once, plus one micro-batch's activations: the bytes all its nodes
keep for backward and the values it receives from other stages, over ``chunks``. (That sums
the whole stage's activations of one sequence, more than a forward holds at its peak.) The
*floor* is the least per-device budget (the same for the 4 devices) at which any split fits.
It is found twice: by bisection on the budget with fxpipe's search (to 0.1%), and by a brute
force over every split of the model into 4 contiguous runs of its unit order (fxpipe's
indivisible groups of nodes, numbered in a topological order close to the fx order) whose 3
cuts lie at decoder-block boundaries (before each block, or after the last: C(33, 3) = 5,456
splits for Llama's 32 blocks, C(49, 3) = 18,424 for GPT-2 XL's 48), each priced from
interval tables built here from the cost table, independently of fxpipe's search, and
checked against ``build_plan``'s stage memory on sampled splits. The floor is the smaller of
the two. Beside it, a lower bound no split can beat: every parameter is in some stage and
every node's kept bytes in one, so the busiest of 4 stages needs at least a quarter of
(copies x parameter bytes + the smallest kept-bytes multiple x kept bytes).

Budgets are ratios of the floor, from 4x (where everything fits) down to the floor, and one
below it. At each budget:

- fxpipe: ``partition_graph(g, 4, memory=memory_model(..., training=False))``, timed alone
  (tracing and pricing excluded), then ``build_plan``; whether it fits, its bottleneck over
  LB0 = max(total / 4, heaviest unit), and over the best block-boundary split that fits
  (the brute force's; fxpipe may cut inside a block, so it may do better);
- Accelerate, sequential: ``infer_auto_device_map(model, max_memory={0: B, .., 3: B},
  no_split_module_classes=[the decoder block])``; balanced: the same on
  ``get_balanced_memory(model, max_memory, no_split_module_classes)``, as ``from_pretrained``
  does for ``device_map="balanced"``. Accelerate counts parameter and buffer bytes only, and
  keeps room for the largest layer on device 0. Int keys are CUDA indices; Accelerate
  accepts them without a GPU (it logs that each is not available, silenced here) and
  appends ``"disk"`` for what does not fit, so its map *fits* when no module lands on
  ``"cpu"`` or ``"disk"``. The map becomes a stage per node: the device of the longest
  module name in the map that prefixes the node's module path; a compute node without one
  takes the previous compute node's, a parameter its module's, a placeholder its first
  reader's. That assignment (not a pipeline: Llama's rotary embedding sits on the last
  device Accelerate fills, and GPT-2's LM head with the tied embedding on the first) is
  priced like fxpipe's: its bottleneck (the busiest device), and its memory under the same
  estimate: does the map still fit once activations are counted? Accelerate runs the whole
  batch at once; counting one sequence's activations is in its favour;
- fxpipe's training estimate (``training=True``: weights, gradients and Adam state, the
  activations of the micro-batches in flight, ``checkpoint="except_last"``): does a split
  fit? Below the training lower bound nothing is searched (``no*``);
- predicted step time: fxpipe's pipeline, GPipe's makespan sum(c)/M + (M - 1) max(c)/M with
  M = 16 over its stage costs c, against Accelerate's run, which uses one device after the
  other on the whole batch: the sum of all costs, whatever its map.

Targets: fxpipe fits at every budget at which any split fits (down to the floor); its
bottleneck is within 1% of the best block-boundary split that fits; the step time predicted
with chunks=16 is at least 2.5x lower than the sequential run's; a search takes under 2 s,
wall clock (processor seconds are recorded too: the machine may be shared), judged apart for
searches that find a split and for refusals. A refusal's time is the search's, up to the
MemoryPlanError's diagnosis (the least-memory split and the remedies its message names:
work beyond the search, whose time is printed beside it, timed apart by wrapping
``fxpipe.passes.partition.budgeted._no_fit_error`` in this process). Summary lines give the
smallest budget at which each tool's map fits (bisection to 0.1%, taking a map that fits
to fit at every larger budget) and fxpipe's training floor (to 1%) over the inference
floor. Results, with the machine, the
command and every timed search: ``benchmarks/results/giant.json``.
"""

from __future__ import annotations

import argparse
import os
import platform
import time
from collections.abc import Sequence
from pathlib import Path

import torch
import transformers

from benchmarks.giant.accelerate_maps import Accelerate, load_accelerate
from benchmarks.giant.budgets import rows_for
from benchmarks.giant.graph import GIANTS, build_graph
from benchmarks.giant.report import COLUMNS, summary
from benchmarks.giant.search import time_diagnoses
from benchmarks.giant.settings import BATCH, CHECKPOINT, CHUNKS, RATIOS, STAGES, TOKENS
from benchmarks.harness.output import command_line, format_table, result_path, save_json


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--out",
        type=Path,
        default=result_path("giant"),
        help="where to write the JSON results (default: benchmarks/results/giant.json)",
    )
    parser.add_argument("--models", nargs="*", default=list(GIANTS), choices=list(GIANTS))
    parser.add_argument("--ratios", type=float, nargs="*", default=list(RATIOS))
    args = parser.parse_args(argv)
    infer, balanced, accelerate_version = load_accelerate()
    accel = Accelerate(infer, balanced)
    time_diagnoses()
    torch.set_num_threads(1)
    started = time.perf_counter()
    command = command_line()
    load_before = os.getloadavg()[0]
    print(
        f"command: {command}\ntorch {torch.__version__}, transformers "
        f"{transformers.__version__}, accelerate {accelerate_version}, python "
        f"{platform.python_version()}; {os.cpu_count()} cores, load average {load_before:.2f}",
        flush=True,
    )
    results, verdicts = [], {}
    for name in args.models:
        print(f"\n{name}: tracing and pricing ...", flush=True)
        graph = build_graph(name)
        result = rows_for(graph, accel, args.ratios)
        results.append(result)
        lines, targets = summary(result)
        verdicts.update(targets)
        print(
            f"\n{name}: {result['nodes']:,} nodes, {result['units']:,} units, "
            f"{result['param_gib']:.2f} GiB of parameters; batch {BATCH} x {TOKENS:,} tokens, "
            f"chunks={CHUNKS}, {STAGES} devices; inference floor {result['floor_gib']:.3f} GiB "
            f"per device; trace and price {result['trace_and_price_s']:.1f} s\n"
        )
        print(format_table(result["rows"], COLUMNS))
        print()
        print("\n".join(lines))
    wall = time.perf_counter() - started
    print(
        "\nfx: fxpipe's split fits (inference estimate); /LB0: bottleneck over "
        "max(total/4, heaviest unit); bf: best block-boundary split that fits; seq, bal: "
        "Accelerate's map fits as it counts (weights), +act: with activations (fxpipe's "
        "estimate); seq/fx, bal/fx: bottleneck of Accelerate's map over fxpipe's; step x: "
        "Accelerate's sequential run over fxpipe's pipelined step (chunks=16); train: a split "
        "fits fxpipe's training estimate (no*: the budget is below a lower bound on any "
        "split's training memory, so nothing was searched).\n"
    )
    for text, ok in verdicts.items():
        print(f"{'PASS' if ok else 'FAIL'}  {text}")
    print(f"\nwall time {wall:.0f} s")
    payload = {
        "command": command,
        "date": time.strftime("%Y-%m-%d"),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "accelerate": accelerate_version,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cores": os.cpu_count(),
        "cuda": torch.cuda.is_available(),
        "load_average_before": load_before,
        "load_average_after": os.getloadavg()[0],
        "batch": BATCH,
        "tokens": TOKENS,
        "chunks": CHUNKS,
        "stages": STAGES,
        "checkpoint": CHECKPOINT,
        "targets": {text: ok for text, ok in verdicts.items()},
        "models": results,
        "wall_s": wall,
    }
    return save_json(args.out, payload)


if __name__ == "__main__":
    raise SystemExit(main())
