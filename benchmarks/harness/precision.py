"""The oracle for a dtype narrower than float64: what fxpipe computed in it may be no further
from a float64 run than eager itself is in that dtype (a factor of it, over a floor)."""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from benchmarks.harness.compare import FLOOR, _largest, err

__all__ = ["FACTOR", "Against", "error_floor", "sum_floor", "no_further", "NarrowOps"]

#: fxpipe's error from float64 may be up to FACTOR x eager's own in the same dtype: the
#: two round alike but not identically (micro-batches summed in another order, a product cut
#: over ranks and its parts summed, replicas averaged, attention on a rank's own heads), so
#: one may sit a few times further off than the other (Phi-2's q and k gradients cut over 2
#: ranks: 5.0x eager's, their float64 run equal to 3e-15); a fault (a lost term, a part of a
#: gradient kept on one rank) is of the order of the values themselves, some 1e6 x eager's
#: error, and a value passed in a narrower dtype (bfloat16: 1e-3) some 1e3 x.
FACTOR = 8.0

Tensors = Mapping[str, torch.Tensor | None]


@dataclass
class Against:
    """One set of tensors against the float64 reference: the first over its bound (None when
    none is), the largest error of fxpipe's and of eager's, and the largest ratio of
    fxpipe's error over eager's (floored)."""

    problem: str | None
    err: float
    eager: float
    ratio: float


def error_floor(dtype: torch.dtype) -> float:
    """The least eager error a bound is made of: ``dtype``'s epsilon (float32: 1.2e-7), so
    that a tensor eager happens to give exactly (a zero gradient) does not divide by 0."""
    return float(torch.finfo(dtype).eps)


def sum_floor(terms: torch.Tensor, reference: torch.Tensor, dtype: torch.dtype) -> float:
    """The least eager error of a scalar that sums many terms (a loss): the root of the sum
    of the squares of eager's errors in its terms (``terms`` in ``dtype``, against float64's
    ``reference``), over the sum's magnitude: the sum's error were those errors of random
    signs, its typical size. A scalar's own error is one draw from it, where a tensor's is
    the largest of many, and eager's draw may happen to be small."""
    total = abs(float(reference.sum()))
    spread = float((terms.double() - reference).norm())
    return max(error_floor(dtype), spread / max(total, 1e-300))


def _named_problem(kind: str, got: Tensors, eager: Tensors, reference: Tensors) -> str | None:
    """Names that differ, a tensor against None, or another shape or dtype than eager's."""
    if list(got) != list(reference) or list(eager) != list(reference):
        missing = sorted(set(reference) ^ set(got))[:3]
        return f"{kind} names differ (e.g. {missing})"
    for name, want in reference.items():
        g, e = got[name], eager[name]
        if (g is None) != (want is None):
            return f"{kind} {name}: got {'None' if g is None else 'a tensor'}, float64 eager not"
        if g is not None and e is not None and (g.shape != e.shape or g.dtype != e.dtype):
            shapes = f"{tuple(g.shape)} {g.dtype}, eager {tuple(e.shape)} {e.dtype}"
            return f"{kind} {name}: got {shapes}"
    return None


def no_further(
    kind: str,
    got: Tensors,
    eager: Tensors,
    reference: Tensors,
    dtype: torch.dtype | None = None,
    least: float | None = None,
    factor: float = FACTOR,
) -> Against:
    """Tensors by name (gradients, parameters, a loss as a 0-dim tensor): each of ``got`` no
    further from the float64 ``reference`` than ``factor`` x ``eager``'s error (eager in
    the run's ``dtype``, by default each tensor's own). That error is taken as at least the
    median of eager's errors over the set (a small tensor's error is the largest of a few
    draws, and eager's may happen to be small) and ``least`` (default :func:`error_floor`
    of the dtype; :func:`sum_floor` for a loss). Errors are relative to the tensor's largest
    magnitude (under ``FLOOR`` x the largest of the set, as
    :func:`benchmarks.harness.compare.err`)."""
    problem = _named_problem(kind, got, eager, reference)
    if problem:
        return Against(problem, float("inf"), 0.0, float("inf"))
    scale = FLOOR * _largest(reference.values())
    errors = {
        name: (err(got[name], want, scale), err(eager[name], want, scale), got[name].dtype)
        for name, want in reference.items()
        if want is not None and got[name] is not None and eager[name] is not None
    }
    typical = statistics.median([e for _, e, _ in errors.values()] or [0.0])
    out = Against(None, 0.0, 0.0, 0.0)
    for name, (mine, theirs, got_dtype) in errors.items():
        both_off = math.isinf(mine) and math.isinf(theirs)  # NaN or a mismatch in eager too
        floor = least if least is not None else error_floor(dtype or got_dtype)
        ratio = 1.0 if both_off else mine / max(theirs, typical, floor)
        out.err, out.eager = max(out.err, mine), max(out.eager, theirs)
        if ratio > out.ratio:
            out.ratio = ratio
            if not ratio <= factor:
                out.problem = f"{kind} {name}: err {mine:.2e}, eager's {theirs:.2e}"
    return out


@dataclass
class NarrowOps(TorchDispatchMode):
    """While active, the ops whose floating-point outputs are narrower than ``dtype``, by
    name and count: a float64 model's own float32 work (Gemma's norms upcast to float32,
    rotary tables), whose rounding (about 1e-7) another layout of the same work may round
    otherwise."""

    dtype: torch.dtype = torch.float64
    ops: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        super().__init__()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        narrow = (
            isinstance(x, torch.Tensor)
            and x.is_floating_point()
            and x.dtype.itemsize < self.dtype.itemsize
            for x in tree_leaves(out)
        )
        if any(narrow):
            name = str(func.overloadpacket.__name__)
            self.ops[name] = self.ops.get(name, 0) + 1
        return out
