"""Comparing what fxpipe produced with what eager produced: outputs (structure and leaves),
gradients and buffers, each by its largest relative error."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import keystr, tree_flatten, tree_flatten_with_path

__all__ = ["TOLERANCE", "LOW_EPS", "FLOOR", "Side", "err", "tolerance", "compare_outputs",
           "compare_tensors", "compare_kinds", "compare"]  # fmt: skip

#: err < TOLERANCE counts as equal. float64 rounding of sums taken in another order (as
#: micro-batching does) stays near 1e-13; a real fault (a lost term, a mis-routed micro-batch)
#: is of order 1e-3 or more. 1e-7 sits far from both.
TOLERANCE = 1e-7
#: a leaf in a narrower float than float64 is equal within this many of its type's epsilon.
LOW_EPS = 8
#: an error's denominator never falls under FLOOR x the largest magnitude of the set
#: (outputs, or gradients), so an exactly-zero gradient is not divided by zero.
FLOOR = 1e-3


@dataclass
class Side:
    """What one side (eager or fxpipe) produced: outputs, gradients, buffers after the step."""

    output: Any
    grads: dict[str, torch.Tensor | None]
    buffers: dict[str, torch.Tensor]


def err(got: torch.Tensor, want: torch.Tensor, floor: float) -> float:
    """max|got - want| / max(max|want|, floor); NaN where both are NaN counts as equal."""
    if want.numel() == 0:
        return 0.0
    if not want.is_floating_point() and not want.is_complex():
        return 0.0 if torch.equal(got, want) else float("inf")
    g, w = got.detach().to(torch.complex128 if want.is_complex() else torch.float64), want
    both = torch.isnan(g) & torch.isnan(w)
    if (torch.isnan(g) ^ torch.isnan(w)).any():
        return float("inf")
    diff = (g - w).abs().masked_fill(both, 0).max().item()
    scale = max(w.abs().masked_fill(both, 0).max().item(), floor)
    return diff / scale if scale > 0 else diff


def _largest(tensors: Iterable[Any]) -> float:
    sizes = [
        t.detach().abs().nan_to_num().max().item()
        for t in tensors
        if isinstance(t, torch.Tensor) and t.numel() and (t.is_floating_point() or t.is_complex())
    ]
    return max(sizes, default=0.0)


def _shape_problem(name: str, got: Any, want: torch.Tensor) -> str | None:
    if not isinstance(got, torch.Tensor):
        return f"{name}: got {type(got).__name__}, eager a tensor"
    if got.shape != want.shape or got.dtype != want.dtype:
        shapes = f"{tuple(got.shape)} {got.dtype}, eager {tuple(want.shape)} {want.dtype}"
        return f"{name}: got {shapes}"
    return None


Named = Iterable[tuple[str, torch.Tensor, Any]]


def tolerance(want: torch.Tensor) -> float:
    """The error under which a leaf counts as equal: TOLERANCE, or for a leaf the model gives
    in a narrower float than float64 (a transformers loss, computed in float32) LOW_EPS of
    that type's epsilon, its own rounding (float32: 9.5e-7)."""
    if want.is_floating_point() and want.dtype.itemsize < 8:
        return max(TOLERANCE, LOW_EPS * torch.finfo(want.dtype).eps)
    return TOLERANCE


def _worst(named: Named, floor: float) -> tuple[str | None, float]:
    """The largest error, and the leaf furthest over its tolerance (None when none is); a
    leaf of another type, shape or dtype is reported at once."""
    worst, over, where = 0.0, 1.0, ""
    for name, w, g in named:
        problem = _shape_problem(name, g, w)
        if problem:
            return problem, float("inf")
        e = err(g, w, floor)
        worst = e if not e <= worst else worst
        ratio = e / tolerance(w)
        if not ratio < over:
            over, where = ratio, f"{name}: err {e:.2e}"
    return (where or None), worst


def compare_outputs(got: Any, want: Any) -> tuple[str | None, float]:
    """The worst difference in structure or value (None when equal), and the largest error."""
    if type(got) is not type(want):
        return f"output type {type(got).__name__}, eager {type(want).__name__}", float("inf")
    got_leaves, got_spec = tree_flatten(got)
    want_paths, want_spec = tree_flatten_with_path(want)
    if got_spec != want_spec:
        return f"output structure differs: got {got_spec}, eager {want_spec}"[:400], float("inf")
    named = []
    for (path, w), g in zip(want_paths, got_leaves):
        name = f"output{keystr(path)}"
        if isinstance(w, torch.Tensor):
            named.append((name, w, g))
        elif g != w:
            return f"{name}: got {g!r}, eager {w!r}", float("inf")
    return _worst(named, FLOOR * _largest(tree_flatten(want)[0]))


def compare_tensors(
    kind: str, got: dict[str, Any], want: dict[str, Any]
) -> tuple[str | None, float]:
    """Gradients or buffers by name: None against not None, shape, then the error."""
    if list(got) != list(want):
        missing = sorted(set(want) ^ set(got))[:3]
        return f"{kind} names differ (e.g. {missing})", float("inf")
    for name, w in want.items():
        if (got[name] is None) != (w is None):
            which = ["a tensor", "None"]
            return (f"{kind} {name}: got {which[got[name] is None]}, eager "
                    f"{which[w is None]}"), float("inf")  # fmt: skip
    named = [(f"{kind} {n}", w, got[n]) for n, w in want.items() if w is not None]
    return _worst(named, FLOOR * _largest(want.values()))


def compare_kinds(got: Side, want: Side) -> dict[str, tuple[str | None, float]]:
    """Per kind (output, grad, buffer): its worst difference (None when equal) and largest
    error; the outputs alone where their structure, a type or a shape differs."""
    kinds = {"output": compare_outputs(got.output, want.output)}
    if kinds["output"][1] == float("inf"):
        return kinds
    kinds["grad"] = compare_tensors("grad", got.grads, want.grads)
    kinds["buffer"] = compare_tensors("buffer", got.buffers, want.buffers)
    return kinds


def compare(got: Side, want: Side) -> tuple[str | None, dict[str, float]]:
    """The first kind (outputs, gradients, buffers) that differs, by its worst leaf, and the
    largest error of each kind (of the outputs alone where their structure, a type or a
    shape differs)."""
    kinds = compare_kinds(got, want)
    first = next((problem for problem, _ in kinds.values() if problem), None)
    return first, {kind: worst for kind, (_, worst) in kinds.items()}
