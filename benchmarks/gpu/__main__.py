"""fxpipe's runtime on one CUDA device: step time, peak memory, stage-cost prediction, overlap.

Run from the repository root::

    python -m benchmarks.gpu [--out PATH] [--budget-s S]
    python -m benchmarks.gpu --dry-run      # the same code paths on CPU, tiny sizes

Made to run once, unattended, in under 5 minutes on one GPU. Every section is guarded: an
error is printed and recorded and the next section runs; a section that would start after
``--budget-s`` seconds is skipped; a watchdog prints what was measured, writes it and exits
if the whole run passes the budget by a minute. Results go to
``benchmarks/results/gpu.json`` after every section. Without a CUDA device (and without
``--dry-run``) it says so and exits with code 0.

With one GPU every stage is ``cuda:0``. Stages on the same device hand values over
directly (no copy, no copy stream), so copy/compute overlap is measured on its own.

Sections (``cuda:0``; ``cpu`` in a dry run):

1. Step time (forward + backward, loss = mean of squares) of a residual MLP: the plain model
   on the whole batch, the same model micro-batch by micro-batch by hand (8 chunks), and
   pipelines with K=1 and K=4 stages, chunks=8, checkpoint "never" (and K=4 "always"). The
   variants alternate inside every round; each step is timed with CUDA events; medians.
2. Peak ``torch.cuda.max_memory_allocated`` during one step (minus the allocation before it,
   parameter gradients already allocated) of a deeper residual MLP, K=4, chunks=8, for each
   checkpoint mode, against the plain model; beside the always/never ratio, the GPipe
   estimate O(N + (L/K)(N/M)) / O(N L) and fxpipe's plan estimate.
3. Predicted against measured stage time: a K=4 plan made with ``cost="time"``; each stage
   module alone, forward + backward on the example batch as the cost model prices a node,
   timed with CUDA events, against ``plan.stages[j].cost``; and the GPipe speedup each
   predicts.
4. Copy/compute overlap: device-to-host copies of the K=4 plan's boundary values (every
   micro-batch, into pinned memory) on a side stream while the compute stream runs the
   stages' forward; overlap = (T_compute + T_copy - T_both) / min(T_compute, T_copy), 1 when
   the shorter one is hidden completely, 0 when they serialise.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchmarks.gpu.device import Device, device_name
from benchmarks.gpu.run import Run, start_watchdog
from benchmarks.gpu.settings import DEFAULT_OUT, DRY_SIZES, GPU_SIZES, Sizes
from benchmarks.gpu.stages import overlap, stage_prediction
from benchmarks.gpu.steps import memory_peaks, step_times
from benchmarks.gpu.table import print_table


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--dry-run", action="store_true", help="run on CPU with tiny sizes")
    parser.add_argument("--budget-s", type=float, default=240.0, help="start no section after")
    args = parser.parse_args()
    if not args.dry_run and not torch.cuda.is_available():
        print(
            "no CUDA device: nothing measured, nothing written. "
            "`python -m benchmarks.gpu --dry-run` runs the same code on CPU."
        )
        return 0
    if args.out is None:  # a dry run's numbers are no GPU results: keep them out of the tree
        dry = Path(tempfile.gettempdir()) / "fxpipe-gpu-dry-run.json"
        args.out = dry if args.dry_run else DEFAULT_OUT
    dev = Device(torch.device("cpu") if args.dry_run else torch.device("cuda", 0))
    if args.dry_run:
        torch.set_num_threads(1)
    sizes = DRY_SIZES if args.dry_run else GPU_SIZES
    run = Run(args, dev)
    start_watchdog(run, args.budget_s + 60.0)
    print(f"fxpipe GPU benchmark on {device_name(dev)}, torch {torch.__version__}", flush=True)
    sections: list[tuple[str, Callable[[Run, Sizes, dict[str, Any]], None]]] = [
        ("step time", step_times),
        ("peak memory", memory_peaks),
        ("stage prediction", stage_prediction),
        ("overlap", overlap),
    ]
    for name, fn in sections:
        with run.section(name) as rec:
            if rec["status"] == "run":
                fn(run, sizes, rec)
    run.finished = True
    try:
        print_table(run)
    except Exception:  # the sections' own lines above already hold every number
        traceback.print_exc()
    run.write()
    failed = [n for n, r in run.sections.items() if r.get("status") != "ok"]
    state = "complete" if not failed else f"partial ({', '.join(failed)} not ok)"
    print(f"{state}; {run.elapsed():.0f} s; wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
