"""The reductions over the batch whose partial form over micro-batches fxpipe knows: sums,
means, losses with ``reduction="mean"`` or ``"sum"`` (by name: aten's, torch.nn.functional's,
a loss module's), histograms over a fixed range; and the counts a mean divides by, which the
stages compute (:mod:`fxpipe.passes.batch.reductions` rewrites each into its partial form)."""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn
from torch.nn import _reduction as legacy

from fxpipe.passes.ops import op_name

__all__ = [
    "Loss",
    "loss_of",
    "counts",
    "reduced_count",
    "class_count",
    "element_count",
    "batch_rows",
    "dims_of",
    "broadcast",
    "CLASS_LOSSES",
    "ENUM",
    "where",
]


# ------------------------------------------------------------------ counts the stages compute


def reduced_count(x: torch.Tensor, dim: Any = None) -> int:
    """How many elements of ``x`` a mean over ``dim`` (None or []: all) averages."""
    return int(math.prod(x.shape[d] for d in dims_of(x, dim)))


def dims_of(x: torch.Tensor, dim: Any) -> list[int]:
    if dim is None or (isinstance(dim, (list, tuple)) and len(dim) == 0):
        return list(range(x.ndim))
    return [dim] if isinstance(dim, int) else list(dim)


def class_count(
    input: torch.Tensor, target: torch.Tensor, weight: torch.Tensor | None, ignore_index: int
) -> torch.Tensor:
    """What ``cross_entropy``'s and ``nll_loss``'s mean divides by: the summed class weight
    of the targets not ignored (their number without weights); for targets given as
    probabilities, the number of samples (every position but the class dimension)."""
    if target.is_floating_point():
        classes = input.shape[1] if input.ndim > 1 else input.shape[0]
        return torch.tensor(input.numel() // classes, dtype=input.dtype, device=input.device)
    keep = target != ignore_index
    if weight is None:
        return keep.sum().to(input.dtype)
    picked = weight.to(input.dtype)[torch.where(keep, target, 0)]
    return (picked * keep).sum()


def element_count(input: torch.Tensor, target: torch.Tensor) -> int:
    """What an element-wise loss's mean divides by: the elements of input and target
    broadcast together."""
    return int(math.prod(broadcast(input.shape, target.shape)))


def broadcast(a: Sequence[Any], b: Sequence[Any]) -> list[Any]:
    """The shape ``a`` and ``b`` broadcast to (sizes may be symbolic)."""
    n = max(len(a), len(b))
    a, b = [1] * (n - len(a)) + list(a), [1] * (n - len(b)) + list(b)
    return [y if x == 1 else x for x, y in zip(a, b, strict=True)]


def batch_rows(input: torch.Tensor) -> int:
    """What ``kl_div(..., reduction="batchmean")`` divides by: the input's first size."""
    return int(input.shape[0]) if input.ndim else 1


# ------------------------------------------------------------------ which reductions are known

#: aten loss ops (torch.export) and torch.nn.functional losses (torch.fx), by name.
CLASS_LOSSES = frozenset({"cross_entropy_loss", "nll_loss_nd", "cross_entropy", "nll_loss"})
_ELEMENT_LOSSES = frozenset(
    "mse_loss l1_loss smooth_l1_loss huber_loss binary_cross_entropy "
    "binary_cross_entropy_with_logits kl_div soft_margin_loss".split()
)
#: Loss modules (torch.fx leaves) -> the functional they compute.
_LOSS_MODULES: dict[type[nn.Module], Callable[..., Any]] = {
    nn.CrossEntropyLoss: F.cross_entropy,
    nn.NLLLoss: F.nll_loss,
    nn.MSELoss: F.mse_loss,
    nn.L1Loss: F.l1_loss,
    nn.SmoothL1Loss: F.smooth_l1_loss,
    nn.HuberLoss: F.huber_loss,
    nn.BCELoss: F.binary_cross_entropy,
    nn.BCEWithLogitsLoss: F.binary_cross_entropy_with_logits,
    nn.KLDivLoss: F.kl_div,
    nn.SoftMarginLoss: F.soft_margin_loss,
}
ENUM = {"none": 0, "mean": 1, "sum": 2}


@dataclass(frozen=True)
class Loss:
    """A loss node's arguments by name, and how its reduction is written."""

    name: str
    args: dict[str, Any]
    #: "enum" (aten: 0/1/2), "string" (torch.nn.functional), "module" (a loss module).
    style: str
    reduction: str


def loss_of(gm: fx.GraphModule, node: fx.Node) -> Loss | None:
    """The loss ``node`` computes, with its arguments by name; None for anything else."""
    args: dict[str, Any]
    if node.op == "call_module":
        module = gm.get_submodule(str(node.target))
        functional = _LOSS_MODULES.get(type(module))
        if functional is None:
            return None
        params = list(inspect.signature(type(module).forward).parameters)[1:]
        args = dict(zip(params, node.args))
        args.update(node.kwargs)
        for extra in ("weight", "ignore_index", "label_smoothing", "pos_weight"):
            if hasattr(module, extra):
                args[extra] = getattr(module, extra)
        return Loss(functional.__name__, args, "module", str(module.reduction))
    name = op_name(node)
    if node.op != "call_function" or name not in CLASS_LOSSES | _ELEMENT_LOSSES:
        return None
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        schema = list(target._schema.arguments)
        args = {a.name: a.default_value for a in schema if a.has_default_value()}
        args.update(zip((a.name for a in schema), node.args))
        args.update(node.kwargs)
        args["input"] = args.pop("self")
        reduction = {v: k for k, v in ENUM.items()}.get(int(args["reduction"]), "?")
        return Loss(name, args, "enum", reduction)
    try:
        bound = inspect.signature(target).bind(*node.args, **node.kwargs)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None
    bound.apply_defaults()
    args = dict(bound.arguments)
    if args.get("size_average") is not None or args.get("reduce") is not None:
        reduction = legacy.legacy_get_string(args.get("size_average"), args.get("reduce"))
    else:
        reduction = str(args.get("reduction", "mean"))
    return Loss(name, args, "string", reduction)


#: Ops that add a batch's rows into bins of a fixed table (a router's tokens per expert).
_ADDS_INTO = frozenset({"scatter_add", "scatter_add_", "index_add", "index_add_"})
#: Ops that make a table of zeros.
_ZEROS = frozenset({"zeros", "zeros_like", "new_zeros"})


def counts(node: fx.Node) -> bool:
    """Whether ``node`` is a histogram of the batch over a fixed range (``histc`` with
    ``min < max``: each micro-batch's counts add up to the batch's), or adds the batch's rows
    into a table of zeros (``zeros(E).scatter_add_(0, expert, weight)``: the same sum)."""
    name = op_name(node)
    if name == "histc":
        low = node.args[2] if len(node.args) > 2 else node.kwargs.get("min", 0)
        high = node.args[3] if len(node.args) > 3 else node.kwargs.get("max", 0)
        if isinstance(low, int | float) and isinstance(high, int | float):
            return bool(low < high)
        return False
    if name in _ADDS_INTO:
        table = node.args[0] if node.args else node.kwargs.get("input")
        return isinstance(table, fx.Node) and op_name(table) in _ZEROS
    return False


def where(node: fx.Node) -> str:
    """``'mean_1' (aten.mean.dim in module 'head')``: a node as a message names it."""
    stack = node.meta.get("nn_module_stack")
    module = str(list(stack.values())[-1][0]) if stack else ""
    if node.op == "call_module":
        module = str(node.target)
    what = op_name(node)
    return f"{node.name!r} ({what}{f' in module {module!r}' if module else ''})"
