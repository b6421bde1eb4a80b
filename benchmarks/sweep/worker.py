"""One model of the sweep, in its own process: built, made ready, run through every check."""

from __future__ import annotations

import json
import time
import zlib
from collections.abc import Callable
from pathlib import Path

import torch
from torch.utils._pytree import tree_flatten

from benchmarks.harness.failures import first_line, scrub
from benchmarks.harness.models.registry import registry
from benchmarks.harness.models.spec import Spec
from benchmarks.harness.prepare import to_double, zero_dropout
from benchmarks.harness.rows import Row
from benchmarks.sweep.checks import CHECKS, Subject
from benchmarks.sweep.narrow import DTYPES, dtype_name, experts_of, reference
from benchmarks.sweep.progress import phase

__all__ = ["PRIORITY", "GROUPED_FLOAT64", "overall", "stages_for", "check_model", "worker"]

#: Why a model whose experts transformers runs by grouped products is not run in float64.
GROUPED_FLOAT64 = (
    "grouped products take no float64: its experts run by transformers' default grouped_mm "
    "(torch's grouped matrix product: float32, bfloat16 or float16 only); the same family "
    "runs in float64 by batched_mm under its name without -grouped"
)

#: A model's class is the first of these any of its checks has (all skipped: skipped).
PRIORITY = ("wrong", "crashed", "refused", "equal")


def overall(checks: dict[str, Row]) -> tuple[str, str]:
    """The model's class: the worst of its checks (all skipped: skipped)."""
    for status in PRIORITY:
        for name, result in checks.items():
            if result["status"] == status:
                return status, f"{name}: {result['reason']}" if result["reason"] else ""
    first = next(iter(checks.values()), {"reason": "no check applies"})
    return "skipped", first["reason"]


def stages_for(name: str) -> int:
    """2, 3 or 4 stages, fixed per model name."""
    return 2 + zlib.crc32(name.encode()) % 3


def check_model(
    spec: Spec,
    cost: str,
    save: Callable[[Row], None],
    compile: str = "",
    dtype: torch.dtype = torch.float64,
) -> Row:
    """Build and prepare ``spec`` (float64, no dropout), then run every check on it in
    ``dtype``, saving the row after each (``compile``: the torch.compile backend of the
    pipelines' stages). In a narrower dtype, the float64 model is the reference (a
    Mixture-of-Experts model's experts by batched products there) and each check runs
    copies of it in ``dtype`` with the experts implementation it was built with."""
    row: Row = {"name": spec.name, "family": spec.family, "stages": stages_for(spec.name),
                "dtype": dtype_name(dtype)}  # fmt: skip
    phase("build")
    torch.manual_seed(0)
    if spec.default_double:
        torch.set_default_dtype(torch.float64)
    try:
        model, args, kwargs = spec.build()
    except Exception as exc:
        return {**row, "status": "skipped", "reason": f"build failed: {first_line(repr(exc))}"}
    experts = experts_of(model)
    if experts == "grouped_mm" and dtype == torch.float64:
        return {**row, "status": "skipped", "reason": GROUPED_FLOAT64, "checks": {}}
    model = model.double()
    zero_dropout(model)
    inputs = (to_double(args), to_double(kwargs))
    row["params"] = sum(p.numel() for p in model.parameters())
    row["batch"] = next(x.size(0) for x in tree_flatten(inputs)[0] if isinstance(x, torch.Tensor))
    narrow = dtype != torch.float64
    if narrow:
        torch.set_default_dtype(torch.float32)  # as users run it; the reference sets its own
        row["experts"] = experts
        reference(model)
    subject = Subject(spec, model, inputs, row["stages"], cost, compile=compile, dtype=dtype,
                      experts=experts if narrow else None)  # fmt: skip
    row["checks"] = {}
    for name, check in CHECKS.items():
        result = check(subject)
        if result is None:
            continue
        row["checks"][name] = result
        row["status"], row["reason"] = overall(row["checks"])
        save(row)
    row["status"], row["reason"] = overall(row["checks"])
    return row


def worker(name: str, cost: str, result: Path, compile: str = "", dtype: str = "float64") -> None:
    """Check model ``name`` in ``dtype``; its row goes to ``result`` after each check, marked
    ``complete`` once every check has run."""
    torch.set_num_threads(1)
    started = time.perf_counter()

    def save(row: Row, complete: bool = False) -> None:
        seconds = round(time.perf_counter() - started, 1)
        result.write_text(scrub(json.dumps({**row, "seconds": seconds, "complete": complete})))

    save(check_model(registry()[name], cost, save, compile, DTYPES[dtype]), complete=True)
