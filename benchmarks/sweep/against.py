"""What every check of the sweep shares: the model as checks receive it (:class:`Subject`),
a pipeline of it run against the eager oracle, and the verdict on the difference."""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten

from benchmarks.harness.compare import TOLERANCE, Side, compare, compare_kinds, compare_outputs
from benchmarks.harness.failures import first_line
from benchmarks.harness.models.spec import Args, Kwargs, Spec
from benchmarks.harness.oracle import backward, eager_side, loss_weights, mixes_samples
from benchmarks.harness.prepare import fresh
from benchmarks.harness.rows import Row
from benchmarks.sweep.narrow import Wants, cast, dtype_name, in_dtype, narrow_eager
from benchmarks.sweep.narrow_judge import judge_narrow
from benchmarks.sweep.progress import failure, phase

__all__ = ["CHUNKS", "Subject", "Check", "all_nan", "build_pipeline", "pipeline_side",
           "against_eager", "judge", "piped_copy", "narrow_oracle", "eager_narrow",
           "against_narrow"]  # fmt: skip

#: Micro-batches of every pipeline the sweep builds.
CHUNKS = 4


@dataclass(frozen=True)
class Subject:
    """One model as every check receives it."""

    spec: Spec
    #: Built, in float64, every dropout at zero (a Mixture-of-Experts model's experts by
    #: batched products where the run's dtype is narrower); a check must not change it.
    model: nn.Module
    #: The example batch, float64: positional and keyword arguments.
    inputs: tuple[Args, Kwargs]
    #: CPU stages of its pipelines (2, 3 or 4, fixed per model name).
    stages: int
    #: fxpipe's ``cost=`` for this run.
    cost: str
    #: Per row of the batch, its weight in a mean the model takes over the batch (the labels
    #: its loss counts in it): how eager on micro-batches joins a 0-dim output. None: alike.
    counts: Tensor | None = None
    #: The torch.compile backend of its pipelines' stages ("": not compiled).
    compile: str = ""
    #: The dtype eager and fxpipe run in; narrower than float64, ``model`` is the float64
    #: reference both are measured against, copied into this dtype for each run.
    dtype: torch.dtype = torch.float64
    #: The experts implementation the model was built with (its copies in ``dtype`` run it);
    #: None: not a Mixture-of-Experts model that takes one, or the run is in float64.
    experts: str | None = None

    @property
    def narrow(self) -> bool:
        """Does this run's dtype round more than float64?"""
        return self.dtype != torch.float64


Check = Callable[[Subject], Row | None]


def all_nan(want: Side) -> str | None:
    """Why eager's outputs cannot judge anything: every floating-point element of every output
    leaf is NaN (a float32 cast of float64's ``finfo.min`` times 0, say), so that anything
    the pipeline gives that is NaN too would count as equal; else None."""
    leaves = [x for x in tree_flatten(want.output)[0]
              if isinstance(x, Tensor) and x.is_floating_point() and x.numel()]  # fmt: skip
    if leaves and all(bool(x.isnan().all()) for x in leaves):
        return "eager's outputs are all NaN in float64"
    return None


def build_pipeline(subject: Subject, piped: nn.Module, label: str, chunks: int = CHUNKS) -> Any:
    """fxpipe's pipeline of ``piped`` (in the mode it is in) over the subject's example, with
    ``chunks`` micro-batches."""
    import fxpipe

    args, kwargs = cast(subject.inputs, subject.dtype) if subject.narrow else subject.inputs
    phase(f"{label}: fxpipe.pipeline")
    options: Kwargs = {"chunks": chunks, "cost": subject.cost, "example_kwargs": fresh(kwargs)}
    if subject.compile:
        options["compile"] = {"backend": subject.compile}
    return fxpipe.pipeline(piped, fresh(args), ["cpu"] * subject.stages, **options)


def pipeline_side(
    pipe: Any,
    piped: nn.Module,
    inputs: tuple[Args, Kwargs],
    want: Side,
    label: str,
    weights: list[Tensor | None] | None = None,
) -> Side:
    """``pipe`` on ``inputs``, then backward through the projection eager used (``weights``,
    default :func:`loss_weights` of eager's outputs; also where an output's value differs, so
    that the gradients are measured too); outputs only where their structure, a type or a
    shape differs from eager's."""
    args, kwargs = inputs
    phase(f"{label}: pipeline forward")
    output = pipe(*fresh(args), **fresh(kwargs))
    _, worst = compare_outputs(output, want.output)
    if worst == float("inf"):
        return Side(output, {}, {})
    phase(f"{label}: pipeline backward")
    return backward(piped, output, loss_weights(want.output) if weights is None else weights)


def piped_copy(subject: Subject, model: nn.Module | None = None) -> nn.Module:
    """The copy of ``model`` (default: the subject's) that a pipeline takes: a deep copy, in
    the run's dtype with the experts implementation the model was built with."""
    model = subject.model if model is None else model
    if subject.narrow:
        return in_dtype(model, subject.dtype, subject.experts)
    return copy.deepcopy(model)


def narrow_oracle(
    subject: Subject, inputs: tuple[Args, Kwargs], train: bool, chunks: int | None
) -> Wants:
    """Eager in the run's dtype and in float64 on ``inputs`` (float64), as
    :func:`benchmarks.sweep.narrow.narrow_eager` runs them for the subject."""
    return narrow_eager(subject.spec, subject.model, inputs, subject.dtype, subject.experts,
                        train, chunks, subject.counts)  # fmt: skip


def against_narrow(
    subject: Subject, pipe: Any, piped: nn.Module, inputs: tuple[Args, Kwargs], wants: Wants,
    train: bool, chunks: int | None, label: str,
) -> Row:  # fmt: skip
    """``pipe`` (of ``piped``, in the run's dtype) on ``inputs`` (float64, cast) against
    ``wants``: no further from float64 than eager in that dtype (outputs, gradients,
    buffers)."""
    mine = cast(inputs, subject.dtype)
    got = pipeline_side(pipe, piped, mine, Side(wants.eager.output, {}, {}), label, wants.weights)
    labels = inputs[1].get("labels")
    phase(f"{label}: judged against float64")
    again = lambda: narrow_oracle(subject, inputs, train, chunks)  # noqa: E731
    return judge_narrow(got, wants, subject.dtype, again, labels)


def eager_narrow(
    subject: Subject, inputs: tuple[Args, Kwargs], train: bool, chunks: int | None, label: str
) -> Wants | Row:
    """Eager in the run's dtype and in float64, or the row of a check they leave nothing
    to judge (either fails, or every output is NaN)."""
    name = dtype_name(subject.dtype)
    phase(f"{label}: eager in float64 and in {name}")
    try:
        wants = narrow_oracle(subject, inputs, train, chunks)
    except Exception as exc:
        return {"status": "skipped", "reason": f"eager failed: {first_line(repr(exc))}"}
    nan = all_nan(wants.reference)
    if nan or all_nan(wants.eager):
        return {"status": "skipped", "reason": nan or f"eager's outputs are all NaN in {name}"}
    return wants


def against_eager(subject: Subject, train: bool, label: str) -> Row:
    """Eager against fxpipe in one mode, each on a fresh deep copy of the model: outputs,
    every parameter's gradient and every persistent buffer after one backward. ``label``
    names the check in the worker's phases. In a dtype narrower than float64, both in it
    against eager in float64 (:func:`against_narrow`)."""
    model = subject.model
    chunks = CHUNKS if mixes_samples(subject.spec, model, train) else None
    if subject.narrow:
        return _narrow_mode(subject, train, chunks, label)
    row: Row = {"oracle": "micro-batches" if chunks else "whole batch"}
    phase(f"{label}: eager")
    try:
        want = eager_side(model, subject.inputs, train, chunks, subject.counts)
    except Exception as exc:
        return {**row, "status": "skipped", "reason": f"eager failed: {first_line(repr(exc))}"}
    if all_nan(want):
        return {**row, "status": "skipped", "reason": all_nan(want)}
    piped = copy.deepcopy(model).train(train)
    try:
        pipe = build_pipeline(subject, piped, label)
        row["tracer"] = getattr(getattr(pipe, "_traced", None), "tracer", None)
        got = pipeline_side(pipe, piped, subject.inputs, want, label)
    except Exception as exc:
        return {**row, **failure(exc)}
    return {**row, **judge(subject, train, chunks, got, want, label)}


def _narrow_mode(subject: Subject, train: bool, chunks: int | None, label: str) -> Row:
    """:func:`against_eager` in a dtype narrower than float64."""
    row: Row = {"oracle": "micro-batches" if chunks else "whole batch"}
    wants = eager_narrow(subject, subject.inputs, train, chunks, label)
    if not isinstance(wants, Wants):
        return {**row, **wants}
    piped = piped_copy(subject).train(train)
    try:
        pipe = build_pipeline(subject, piped, label)
        row["tracer"] = getattr(getattr(pipe, "_traced", None), "tracer", None)
        verdict = against_narrow(subject, pipe, piped, subject.inputs, wants, train, chunks,
                                 label)  # fmt: skip
    except Exception as exc:
        return {**row, **failure(exc)}
    return {**row, **verdict}


def judge(
    subject: Subject,
    train: bool,
    chunks: int | None,
    got: Side,
    want: Side,
    label: str,
    grads: bool = True,
) -> Row:
    """equal or wrong. Before calling a difference wrong: eager is run again (it must repeat
    itself), and, on a whole-batch oracle, eager on the micro-batches measures the model's own
    noise under micro-batching (float32 casts inside a float64 model round differently):
    errors within 10x that noise count as equal (for each kind that differs). ``grads``
    False: ``want`` is outputs only, as eager under ``torch.no_grad()`` gives them."""
    kinds = compare_kinds(got, want)
    worst = {kind: error for kind, (_, error) in kinds.items()}
    errors = {k: v for k, v in worst.items() if v != float("inf")}
    problem = next((p for p, _ in kinds.values() if p), None)
    if problem is None:
        return {"status": "equal", "reason": "", "max_err": errors}
    inputs, counts = subject.inputs, subject.counts
    phase(f"{label}: eager again")
    again, _ = compare(eager_side(subject.model, inputs, train, chunks, counts, grads), want)
    if again is not None:
        return {"status": "skipped", "reason": f"eager is not deterministic: {again}"}
    if chunks is None and len(errors) == len(worst):
        phase(f"{label}: eager on micro-batches")
        _, noise = compare(eager_side(subject.model, inputs, train, CHUNKS, counts, grads), want)
        bound = {k: max(TOLERANCE, 10 * noise.get(k, 0.0)) for k in worst}
        if all(worst[k] <= bound[k] for k, (p, _) in kinds.items() if p):
            return {"status": "equal", "reason": "", "max_err": errors, "noise": noise}
        return {"status": "wrong", "reason": problem, "max_err": errors, "noise": noise}
    return {"status": "wrong", "reason": problem, "max_err": errors}
