"""The plan in torch's own form: ``parallelize_module``'s ``{module path: ParallelStyle}``
over the model's ``nn.Linear`` and ``nn.Embedding`` modules, and what that form cannot say.

torch's styles cut one module's parameters, contiguously: ``ColwiseParallel`` an
``nn.Linear``'s weight along dim 0 (an LM head with ``output_layouts=Replicate()``: logits
all-gathered), ``RowwiseParallel`` along dim 1 (its bias whole, added after the all-reduce)
and an ``nn.Embedding``'s along dim 0 (given whole indices). A cut the plan makes elsewhere
has no style: a product whose weight is not an ``nn.Linear``'s (transformers' ``Conv1D``
stores it (in, out); a functional call on a bare parameter), and a fused q, k, v cut in
parts. Those stay in :attr:`TorchPlan.missing` with the reason. The model's own code then
runs on each rank's pieces, so its views must not name whole head counts (transformers'
models write -1 or read them off their tensors); a weight two modules share (a tied
embedding and head) becomes one parameter per module and must be tied again after.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from torch import nn
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

from fxpipe.passes.tensor.records import NodeStyle, Shard, TensorPlan

__all__ = ["TorchPlan", "torch_plan"]


@dataclass(frozen=True)
class TorchPlan:
    """A :class:`TensorPlan` as ``parallelize_module(model, mesh["tp"], styles)`` takes it."""

    #: Module path -> the style to apply to it.
    styles: Mapping[str, ParallelStyle]
    #: Parameter name -> why torch's styles cannot cut it as the plan does (it stays whole
    #: under ``styles``).
    missing: Mapping[str, str]
    #: What the model must do besides (tie shared weights again).
    notes: tuple[str, ...]


def torch_plan(plan: TensorPlan, model: nn.Module) -> TorchPlan:
    """``plan`` over ``model``'s modules (the model the plan's graph was traced from). A group
    with one member torch's styles cannot cut is left out whole: a row-wise style needs
    the column-wise cut before it."""
    holders = _holders(model)
    styles: dict[str, ParallelStyle] = {}
    missing: dict[str, str] = {}
    modules_of: dict[str, list[str]] = {}
    for group in plan.groups:
        found = {node: _modules(plan, model, holders, node) for node in group.columns + group.rows}
        why = next((w for w in found.values() if isinstance(w, str)), None)
        for node, paths in found.items():
            weight = plan.node_weights[node]
            if why is not None:
                missing[weight] = (
                    paths if isinstance(paths, str) else f"its group stays whole: {why}"
                )
                continue
            assert not isinstance(paths, str)
            for path in paths:
                styles[path] = _style(plan.node_styles[node])
                modules_of.setdefault(weight, []).append(path)
    notes = tuple(
        f"{' and '.join(paths)} share {weight}: parallelize_module gives each its own "
        "parameter; tie them again after it (each is cut along dim 0)"
        for weight, paths in modules_of.items()
        if len(paths) > 1
    )
    if plan.sequence:
        notes += (
            f"the plan holds {len(plan.sequence)} values between row-wise and column-wise "
            "products cut along the sequence; these styles leave them whole (fxpipe runs a "
            "given plan without sequence parallelism; in torch's form it is SequenceParallel() "
            "on each norm module with the row-wise outputs and column-wise inputs laid out "
            "Shard(1))",
        )
    return TorchPlan(styles, missing, notes)


def _modules(
    plan: TensorPlan,
    model: nn.Module,
    holders: dict[int, list[tuple[str, nn.Module, str]]],
    node: str,
) -> list[str] | str:
    """The paths of the modules torch's style for ``node`` applies to, or why none does."""
    style, weight = plan.node_styles[node], plan.node_weights[node]
    kind = nn.Embedding if style == "vocab" else nn.Linear
    try:
        param = model.get_parameter(weight)
    except AttributeError:
        return f"{weight} is not a parameter of the model (is the plan of another model?)"
    found = [(path, m) for path, m, local in holders.get(id(param), []) if local == "weight"]
    why = _inexpressible(plan.params[weight].shard, found, kind)
    if why is not None:
        return f"{weight} {why}"
    return [path for path, m in found if type(m) is kind]


def _holders(model: nn.Module) -> dict[int, list[tuple[str, nn.Module, str]]]:
    """id of each parameter -> every (module path, module, local name) holding it (a module
    reached by two paths counted once, by its first)."""
    out: dict[int, list[tuple[str, nn.Module, str]]] = {}
    seen: set[int] = set()
    for path, module in model.named_modules(remove_duplicate=False):
        if id(module) in seen:
            continue
        seen.add(id(module))
        for local, p in module.named_parameters(recurse=False):
            out.setdefault(id(p), []).append((path, module, local))
    return out


def _inexpressible(
    shard: Shard | None,
    found: list[tuple[str, nn.Module]],
    kind: type[nn.Module],
) -> str | None:
    if shard is not None and shard.blocks > 1:
        return (
            f"is cut in {shard.blocks} parts (a fused q, k, v): torch's styles cut one contiguous "
            "piece per rank; permute its rows so each rank's parts are adjacent first"
        )
    if not any(type(m) is kind for _, m in found):
        shown = ", ".join(f"{path} ({type(m).__name__})" for path, m in found) or "no module"
        layout = " (its weight stored (in, out))" if "Conv1D" in shown else ""
        return (
            f"is held by {shown}{layout}, not an nn.{kind.__name__}: torch's styles cut only "
            "nn.Linear and nn.Embedding"
        )
    return None


def _style(style: NodeStyle) -> ParallelStyle:
    if style == "colwise":
        return ColwiseParallel()
    if style == "gathered":
        return ColwiseParallel(output_layouts=Replicate())
    if style == "vocab":
        return RowwiseParallel(input_layouts=Replicate())
    return RowwiseParallel()
