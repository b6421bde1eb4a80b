"""Model sweep: real models (transformers, timm, torchvision) pipelined by fxpipe vs eager.

Run from the repository root::

    python -m benchmarks.sweep [--only PATTERN] [--cost flops] [--jobs 1] [--timeout 240] \\
        [--out PATH] [--merge | --resume] [--list] [--show [--markdown]] [--label TEXT] \\
        [--compile BACKEND]

``--compile BACKEND`` runs every pipeline of every check with its stages through
``torch.compile`` (``compile={"backend": BACKEND}``): the same checks against eager.

``--dtype float32`` or ``bfloat16`` runs eager and fxpipe in that dtype (floating inputs cast
to it, a Mixture-of-Experts model with the experts implementation it was built with) and
judges both against eager in float64: fxpipe's error may be up to ``FACTOR`` (4) x eager's
own (``benchmarks/harness/precision.py``); rows go to ``sweep_DTYPE.json``.
``--by-dtype FILE ...`` prints the coverage of one result file per dtype side by side.

Each model runs in a subprocess of its own (``worker.py``), in float64 with every dropout at
zero, over 2-4 CPU stages with 4 micro-batches, through every check of ``checks.py``: train
mode and eval mode, each comparing outputs (structure, containers and every leaf), every
parameter's gradient and every persistent buffer with the eager model's (the oracle,
``benchmarks/harness/oracle.py``; in train mode a model whose modules mix samples, BatchNorm
and the like, is compared with eager run on the same micro-batches fxpipe makes); and for
the transformers models (``hf_checks.py``) dropout on in both modes, a loss computed inside
the model from ``labels=``, and sequence lengths other than the example's. Each check, and
the model as the worst of them, is classified equal / refused / crashed / wrong / timeout
(or skipped when eager itself fails here). Needs timm, torchvision and
transformers, which fxpipe's own environment does not have: see
``benchmarks/docs/sweep.md``. Rows go to ``benchmarks/results/sweep.json`` after each model.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from benchmarks.harness.failures import first_line
from benchmarks.harness.models.registry import interleave, registry, select
from benchmarks.harness.models.spec import Spec
from benchmarks.harness.output import ROOT, result_path
from benchmarks.harness.processes import SINGLE_THREAD_ENV, module_command
from benchmarks.harness.rows import Row, load_rows, save_rows
from benchmarks.sweep.by_dtype import file_dtype, side_by_side
from benchmarks.sweep.narrow import DTYPES
from benchmarks.sweep.progress import MARK
from benchmarks.sweep.report import markdown, meta, table
from benchmarks.sweep.worker import stages_for, worker

DEFAULT_OUT = result_path("sweep")


def default_out(dtype: str) -> Path:
    """A dtype's result file: ``sweep.json`` for float64, else ``sweep_DTYPE.json``."""
    return DEFAULT_OUT if dtype == "float64" else result_path(f"sweep_{dtype}")


def _last_phase(stderr: str) -> str:
    marks = [line for line in stderr.splitlines() if line.startswith(MARK)]
    return marks[-1][len(MARK) :] if marks else "start"


def _finish(row: Row, timed_out: bool, rc: int | None, stderr: str, timeout: float) -> Row:
    """The row of a child that timed out or died without a verdict."""
    complete = row.pop("complete", False)
    if timed_out:
        row["status"] = "timeout"
        row["reason"] = f"no verdict after {timeout:.0f} s (in {_last_phase(stderr)})"
    elif "status" not in row or not complete and rc != 0:
        tail = first_line(stderr.strip().splitlines()[-1] if stderr.strip() else "", 300)
        row["status"] = "crashed"
        row["reason"] = f"worker exited with {rc} in {_last_phase(stderr)}: {tail}"
    return row


def run_child(
    spec: Spec, cost: str, timeout: float, compile: str = "", dtype: str = "float64"
) -> Row:
    """Run one model's worker in a subprocess of its own, killed after ``timeout`` seconds;
    ``compile``: the torch.compile backend of its pipelines' stages ("": none); ``dtype``:
    the dtype its checks run in."""
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "row.json"
        cmd = module_command("benchmarks.sweep", "--worker", spec.name, "--cost", cost,
                             "--compile", compile, "--dtype", dtype,
                             "--result", str(result))  # fmt: skip
        started = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, **SINGLE_THREAD_ENV},
                                text=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                start_new_session=True)  # fmt: skip
        try:
            _, stderr = proc.communicate(timeout=timeout)
            timed_out = False
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            _, stderr = proc.communicate()
            timed_out = True
        row: Row = json.loads(result.read_text()) if result.exists() else {}
    row = {"name": spec.name, "family": spec.family, "stages": stages_for(spec.name),
           "dtype": dtype, **row}  # fmt: skip
    row = _finish(row, timed_out, proc.returncode, stderr, timeout)
    row["seconds"] = round(time.perf_counter() - started, 1)
    return row


def run_all(specs: list[Spec], args: argparse.Namespace, settings: Row) -> list[Row]:
    """Run every model, saving the rows to ``args.out`` after each one."""
    rows: list[Row] = []
    everything: list[Row] = []
    merge = args.merge or args.resume
    order = list(registry())
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        futures = [pool.submit(run_child, s, args.cost, args.timeout, args.compile, args.dtype)
                   for s in specs]  # fmt: skip
        for i, future in enumerate(futures, 1):
            row = future.result()
            rows.append(row)
            head = f"[{i}/{len(specs)}] {row['name']:<34} {row['status']:<8}"
            print(f"{head} {row['seconds']:6.1f} s  {first_line(row.get('reason', ''), 90)}",
                  flush=True)  # fmt: skip
            everything = save_rows(args.out, rows, settings, merge or i > 1, order)
    return everything


def _same_dtype(args: argparse.Namespace) -> None:
    """Refuse to merge rows of one dtype into a file of another."""
    if (args.merge or args.resume) and args.out.exists():
        before = file_dtype(*load_rows(args.out))
        if before != args.dtype:
            raise SystemExit(f"{args.out} holds {before} rows; --dtype is {args.dtype}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="comma-separated name or family patterns")
    parser.add_argument("--cost", default="flops", help="fxpipe's cost= (default flops)")
    parser.add_argument(
        "--compile", default="", metavar="BACKEND",
        help="run every pipeline's stages through torch.compile with this backend "
        "(inductor, aot_eager, ...; default: not compiled)",
    )  # fmt: skip
    parser.add_argument("--jobs", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=240.0, help="seconds per model")
    parser.add_argument(
        "--dtype", default="float64", choices=list(DTYPES),
        help="the dtype eager and fxpipe run in; narrower than float64, judged against eager "
        "in float64 (default float64)",
    )  # fmt: skip
    parser.add_argument(
        "--out", type=Path, help="result file (default benchmarks/results/sweep.json, "
        "sweep_DTYPE.json for a narrower dtype)",
    )  # fmt: skip
    parser.add_argument(
        "--merge",
        action="store_true",
        help="keep the rows of --out for the models not run this time",
    )
    parser.add_argument(
        "--resume", action="store_true", help="skip the models --out already has (implies --merge)"
    )
    parser.add_argument("--list", action="store_true", help="list the selected models")
    parser.add_argument("--label", default="", help="a note kept in the JSON (which fxpipe)")
    parser.add_argument("--show", action="store_true", help="print the table of --out only")
    parser.add_argument(
        "--markdown", action="store_true", help="with --show: one Markdown row per model"
    )
    parser.add_argument(
        "--by-dtype", nargs="+", type=Path, metavar="FILE",
        help="print the coverage of these result files (one per dtype) side by side",
    )  # fmt: skip
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.worker, args.cost, args.result, args.compile, args.dtype)
        sys.stdout.flush()
        os._exit(0)  # fxpipe's worker threads must not hold the process open
    if args.by_dtype:
        print(side_by_side(args.by_dtype, args.markdown))
        return
    args.out = args.out or default_out(args.dtype)
    if args.show:
        rows = load_rows(args.out)[1]
        print(markdown(rows) if args.markdown else table(rows))
        return
    _same_dtype(args)
    specs = select(registry(), args.only)
    if args.resume and args.out.exists():
        done = {r["name"] for r in load_rows(args.out)[1]}
        specs = [s for s in specs if s.name not in done]
    if args.list:
        print("\n".join(f"{s.family:<12} {s.name}" for s in specs))
        return
    rows = run_all(interleave(specs), args, meta(args))
    print()
    print(table(rows))


if __name__ == "__main__":
    main()
