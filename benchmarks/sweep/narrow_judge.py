"""The verdict in a dtype narrower than float64: each output leaf, gradient and persistent
buffer fxpipe gave no further from eager in float64 than ``FACTOR`` x eager's own in that
dtype (``benchmarks/harness/precision.py``); a loss over a floor of its terms' errors."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.utils._pytree import keystr, tree_flatten_with_path

from benchmarks.harness.compare import Side, compare, compare_outputs
from benchmarks.harness.precision import FACTOR, Against, error_floor, no_further, sum_floor
from benchmarks.harness.rows import Row
from benchmarks.sweep.narrow import Wants, dtype_name

__all__ = ["leaves", "loss_terms", "judge_narrow"]

Tensors = dict[str, Tensor | None]
#: The largest relative gap between float64's loss and the sum of a form of its terms at
#: which the form is taken to be the model's loss (the loss is float32: transformers
#: computes it from ``logits.float()``).
SAME_SUM = 1e-5


def leaves(output: Any) -> Tensors:
    """The tensor leaves of an output pytree by name (``['logits']``)."""
    return {
        keystr(path): x
        for path, x in tree_flatten_with_path(output)[0]
        if isinstance(x, Tensor)
    }  # fmt: skip


def _cross_entropy(logits: Tensor, labels: Tensor, shift: bool) -> Tensor | None:
    """Per counted label, its cross-entropy over the count (their sum: the mean loss), in
    float64; None where the shapes do not fit this form."""
    if shift:
        logits, labels = logits[..., :-1, :], labels[..., 1:]
    if logits.dim() < 2 or logits.shape[:-1] != labels.shape:
        return None
    flat, target = logits.reshape(-1, logits.size(-1)).double(), labels.reshape(-1)
    kept = target != -100
    if not kept.any() or int(target[kept].max()) >= flat.size(-1) or int(target.min()) < -100:
        return None
    flat, target = flat[kept], target[kept]
    picked = flat.gather(1, target[:, None])[:, 0]
    return (flat.logsumexp(-1) - picked) / kept.sum()


def loss_terms(
    name: str, labels: Tensor | None, eager: Tensors, ref: Tensors
) -> tuple[Tensor, Tensor] | None:
    """The terms of loss leaf ``name`` (eager's in the run's dtype, float64's) where it is a
    mean cross-entropy of the logits beside it with ``labels`` (the next token's, or each
    position's or row's own): the form whose float64 sum is float64's loss; else None."""
    logits = name.replace("loss", "logits")
    want = ref.get(name)
    if labels is None or logits == name or ref.get(logits) is None or want is None:
        return None
    for shift in (True, False):
        terms = _cross_entropy(ref[logits], labels, shift)  # type: ignore[arg-type]
        if terms is None:
            continue
        if abs(float(terms.sum()) - float(want)) <= SAME_SUM * max(abs(float(want)), 1e-30):
            mine = _cross_entropy(eager[logits], labels, shift)  # type: ignore[arg-type]
            return (mine, terms) if mine is not None else None
    return None


def _outputs(got: Side, wants: Wants, dtype: torch.dtype, labels: Tensor | None) -> Against:
    """Every output leaf, a 0-dim floating one (a loss) each on its own: over
    :func:`sum_floor` of its terms where :func:`loss_terms` finds them, else the dtype's
    epsilon, as a tensor's."""
    sides = leaves(got.output), leaves(wants.eager.output), leaves(wants.reference.output)
    ref = sides[2]
    scalars = [
        k for k, x in ref.items() if x is not None and x.dim() == 0 and x.is_floating_point()
    ]
    rest = [k for k in ref if k not in scalars]
    parts = [no_further("output", *({k: t.get(k) for k in rest} for t in sides), dtype)]
    for name in scalars:
        terms = loss_terms(name, labels, sides[1], ref)
        least = sum_floor(*terms, dtype) if terms else error_floor(dtype)
        one = [{name: t.get(name)} for t in sides]
        parts.append(no_further(f"output{name}", *one, dtype, least))
    worst = max(parts, key=lambda a: a.ratio)
    problem = next((a.problem for a in parts if a.problem), None)
    return Against(problem, max(a.err for a in parts), max(a.eager for a in parts), worst.ratio)


def _finite(tensors: Tensors) -> bool:
    return all(x is None or not x.is_floating_point() or bool(x.isfinite().all())
               for x in tensors.values())  # fmt: skip


def _unjudged(verdicts: dict[str, Against], wants: Wants) -> str | None:
    """Why eager cannot judge a kind: eager in the run's dtype and in float64 are NaN or
    infinite in other places (float64's own NaN, a mask of its ``finfo.min``, say)."""
    off = [kind for kind, a in verdicts.items() if math.isinf(a.eager)]
    if not off:
        return None
    ref = wants.reference
    kinds = {"output": leaves(ref.output), "grad": ref.grads, "buffer": ref.buffers}
    where = ", ".join(off)
    if not all(_finite(kinds[k]) for k in off):
        return f"eager in float64 is NaN or infinite where eager in this dtype is not ({where})"
    return f"eager in this dtype is NaN or infinite where float64 is not ({where})"


def judge_narrow(
    got: Side,
    wants: Wants,
    dtype: torch.dtype,
    again: Callable[[], Wants],
    labels: Tensor | None = None,
) -> Row:
    """equal, wrong or skipped: fxpipe's outputs (structure, then every leaf), gradients and
    buffers against eager's in ``dtype`` (structure) and float64's (values), each no
    further from float64 than ``FACTOR`` x eager's error. Before calling a difference
    wrong, eager in ``dtype`` is run again (``again``): it must repeat itself."""
    shape_problem, worst = compare_outputs(got.output, wants.eager.output)
    if worst == float("inf"):
        return {"status": "wrong", "reason": shape_problem, "dtype": dtype_name(dtype)}
    eager, ref = wants.eager, wants.reference
    verdicts = {
        "output": _outputs(got, wants, dtype, labels),
        "grad": no_further("grad", got.grads, eager.grads, ref.grads, dtype),
        "buffer": no_further("buffer", got.buffers, eager.buffers, ref.buffers, dtype),
    }
    row: Row = {
        "max_err": {k: a.err for k, a in verdicts.items()},
        "eager_err": {k: a.eager for k, a in verdicts.items()},
        "ratio": {k: a.ratio for k, a in verdicts.items()},
    }
    problem = next((a.problem for a in verdicts.values() if a.problem), None)
    if problem is None:
        unjudged = _unjudged(verdicts, wants)
        status = "skipped" if unjudged else "equal"
        return {"status": status, "reason": unjudged or "", **row}
    repeat, _ = compare(again().eager, eager)
    if repeat is not None:
        return {"status": "skipped", "reason": f"eager is not deterministic: {repeat}", **row}
    return {"status": "wrong", "reason": f"{problem} (over {FACTOR:g}x)", **row}
