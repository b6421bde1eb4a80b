"""The sweep's checks: each one function of a built model, one column of the table, one entry
of a row's ``checks`` in the JSON.

A check takes the :class:`Subject` (the model built, in float64 with every dropout at zero,
its inputs, its stage count and the cost mode) and returns its result row: ``status``
(one of ``harness.rows.STATUSES``), ``reason``, and whatever it measured; or None where it
does not apply to the model (its column then shows nothing for it). To add one, write the
function here and add it to :data:`CHECKS`: the worker runs it after the others, in the
model's own process, the model's class becomes the worst over all its checks, and the
table gains its column. Each check gets the model as built; one that changes it (dropout
on, another sequence length, ``labels=``) works on its own copy or builds its own from
``subject.spec``.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from benchmarks.harness.compare import TOLERANCE, Side, compare, compare_outputs
from benchmarks.harness.failures import first_line
from benchmarks.harness.models.spec import Args, Kwargs, Spec
from benchmarks.harness.oracle import backward, eager_side, loss_weights, mixes_samples
from benchmarks.harness.prepare import fresh
from benchmarks.harness.rows import Row
from benchmarks.sweep.progress import failure, phase

__all__ = ["CHUNKS", "Subject", "Check", "CHECKS", "against_eager"]

#: Micro-batches of every pipeline the sweep builds.
CHUNKS = 4


@dataclass(frozen=True)
class Subject:
    """One model as every check receives it."""

    spec: Spec
    #: Built, in float64, every dropout at zero; a check must not change it.
    model: nn.Module
    #: The example batch, float64: positional and keyword arguments.
    inputs: tuple[Args, Kwargs]
    #: CPU stages of its pipelines (2, 3 or 4, fixed per model name).
    stages: int
    #: fxpipe's ``cost=`` for this run.
    cost: str


Check = Callable[[Subject], Row | None]


def against_eager(subject: Subject, train: bool, label: str) -> Row:
    """Eager against fxpipe in one mode, each on a fresh deep copy of the model: outputs,
    every parameter's gradient and every persistent buffer after one backward. ``label``
    names the check in the worker's phases."""
    import fxpipe

    model, (args, kwargs) = subject.model, subject.inputs
    chunks = CHUNKS if mixes_samples(subject.spec, model, train) else None
    row: Row = {"oracle": "micro-batches" if chunks else "whole batch"}
    phase(f"{label}: eager")
    try:
        want = eager_side(model, subject.inputs, train, chunks)
    except Exception as exc:
        return {**row, "status": "skipped", "reason": f"eager failed: {first_line(repr(exc))}"}
    weights = loss_weights(want.output)
    piped = copy.deepcopy(model).train(train)
    try:
        phase(f"{label}: fxpipe.pipeline")
        options: Kwargs = {"chunks": CHUNKS, "cost": subject.cost, "example_kwargs": fresh(kwargs)}
        pipe = fxpipe.pipeline(piped, fresh(args), ["cpu"] * subject.stages, **options)
        row["tracer"] = getattr(getattr(pipe, "_traced", None), "tracer", None)
        phase(f"{label}: pipeline forward")
        output = pipe(*fresh(args), **fresh(kwargs))
        phase(f"{label}: pipeline backward")
        problem, _ = compare_outputs(output, want.output)
        got = Side(output, {}, {}) if problem else backward(piped, output, weights)
    except Exception as exc:
        return {**row, **failure(exc)}
    return {**row, **judge(subject, train, chunks, got, want, label)}


def judge(
    subject: Subject, train: bool, chunks: int | None, got: Side, want: Side, label: str
) -> Row:
    """equal or wrong. Before calling a difference wrong: eager is run again (it must repeat
    itself), and, on a whole-batch oracle, eager on the micro-batches measures the model's own
    noise under micro-batching (float32 casts inside a float64 model round differently):
    errors within 10x that noise count as equal."""
    problem, worst = compare(got, want)
    errors = {k: v for k, v in worst.items() if v != float("inf")}
    if problem is None:
        return {"status": "equal", "reason": "", "max_err": errors}
    phase(f"{label}: eager again")
    again, _ = compare(eager_side(subject.model, subject.inputs, train, chunks), want)
    if again is not None:
        return {"status": "skipped", "reason": f"eager is not deterministic: {again}"}
    if chunks is None and len(errors) == len(worst):
        phase(f"{label}: eager on micro-batches")
        _, noise = compare(eager_side(subject.model, subject.inputs, train, CHUNKS), want)
        bound = {k: max(TOLERANCE, 10 * noise.get(k, 0.0)) for k in worst}
        if all(worst[k] <= bound[k] for k in worst):
            return {"status": "equal", "reason": "", "max_err": errors, "noise": noise}
        return {"status": "wrong", "reason": problem, "max_err": errors, "noise": noise}
    return {"status": "wrong", "reason": problem, "max_err": errors}


def train_mode(subject: Subject) -> Row:
    """Train mode (BatchNorm and routing against eager on the same micro-batches)."""
    return against_eager(subject, train=True, label="train")


def eval_mode(subject: Subject) -> Row:
    """Eval mode."""
    return against_eager(subject, train=False, label="eval")


#: Every check, in the order a worker runs them; the name is the table's column and the key
#: of the row's ``checks``.
CHECKS: dict[str, Check] = {
    "train": train_mode,
    "eval": eval_mode,
}
