"""Prices a graph from the shapes ``torch.export`` recorded on its nodes, running nothing.

Export leaves the fake value of every node in ``node.meta["val"]``, its sizes symbolic in
the batch but with the example's size as hint. The roofline needs only those sizes, which
tensors need a gradient (propagated here from the parameters, as autograd would) and the
FLOPs of the few ops that multiply matrices (counted on empty ``meta`` tensors of the
recorded sizes). A graph with a node export did not record is priced by a fake run instead.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from operator import attrgetter
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import FlopCounterMode, flop_registry

from fxpipe.ir import CostTable, NodeCost
from fxpipe.passes.ops import op_name
from fxpipe.passes.price.op_work import Facts, aliases, attribute, node_cost, tensors
from fxpipe.passes.price.roofline import Roofline

__all__ = [
    "recorded_shapes",
    "recorded_sizes",
    "recorded_outputs",
    "recorded_at",
    "price_recorded",
]

_COMPOSITE = "CompositeImplicitAutograd"
_SYMBOLIC = (torch.SymInt, torch.SymFloat, torch.SymBool)


def recorded_shapes(gm: fx.GraphModule, example_values: Sequence[Any]) -> dict[str, Any] | None:
    """Node name -> the value export recorded for it (the attribute itself for a
    ``get_attr`` with none); None unless every other node has one whose sizes are known
    for the example."""
    values: dict[str, Any] = {}
    for n in gm.graph.nodes:
        if n.op == "output":
            continue
        if n.op == "get_attr" and "val" not in n.meta:
            values[n.name] = attrgetter(str(n.target))(gm)
        elif "val" in n.meta and _hinted(n.meta["val"]):
            values[n.name] = n.meta["val"]
        else:
            return None
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(example_values):
        return None
    for n, example in zip(placeholders, example_values):
        if _shapes(values[n.name]) != _shapes(example):
            return None
    return values


def recorded_sizes(gm: fx.GraphModule, example_values: Sequence[Any]) -> dict[str, int] | None:
    """Bytes of every node's output from the recorded shapes (None as for
    :func:`recorded_shapes`); the output node's are those of the values it returns."""
    values = recorded_shapes(gm, example_values)
    if values is None:
        return None
    sizes = {name: sum(_size(t)[1] for t in tensors(v)) for name, v in values.items()}
    for n in gm.graph.nodes:
        if n.op == "output":
            sizes[n.name] = sum(sizes[a.name] for a in n.all_input_nodes)
    return sizes


def recorded_outputs(
    gm: fx.GraphModule, example_values: Sequence[Any], batch: int
) -> list[list[tuple[bool, Any]]] | None:
    """The graph's output leaves for a batch of ``batch`` and of ``batch + 1``, from the
    sizes export recorded in terms of the inputs' batch sizes: ``(True, shape)`` for a
    tensor, ``(False, value)`` for anything else. None where the recording cannot tell
    (a batch size export fixed, a value it did not record)."""
    runs = recorded_at(gm, example_values, batch)
    if runs is None:
        return None
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    leaves = [a.name if isinstance(a, fx.Node) else a for a in output.args[0]]
    out = []
    for run in runs:
        found = [
            run.get(leaf) if isinstance(leaf, str) else (False, leaf)
            for leaf in leaves  # a str is a node's name; anything else a constant leaf
        ]
        if any(x is None for x in found):
            return None
        out.append([x for x in found if x is not None])
    return out


def recorded_at(
    gm: fx.GraphModule, example_values: Sequence[Any], batch: int
) -> list[dict[str, tuple[bool, Any]]] | None:
    """Every node's value for a batch of ``batch`` and of ``batch + 1`` (two dicts: node
    name -> ``(True, shape)`` for a tensor, ``(False, value)`` for anything else; a
    tuple of tensors is ``(False, tuple of those pairs)``), from the sizes export recorded;
    every other recorded size is the example's. None where the recording cannot tell (a
    batch size export fixed, a value it did not record)."""
    values = recorded_shapes(gm, example_values)
    if values is None:
        return None
    batch_sizes: list[Any] = []  # sympy symbols
    for n in gm.graph.nodes:
        for t in tensors(values[n.name]) if n.op == "placeholder" else []:
            if t.ndim == 0:
                continue
            leading = t.shape[0]
            if not isinstance(leading, torch.SymInt):
                return None  # fixed at export time
            batch_sizes.append(leading.node.expr)
    runs: list[dict[str, tuple[bool, Any]]] = []
    for size in (batch, batch + 1):
        at = {symbol: size for symbol in batch_sizes}
        run: dict[str, tuple[bool, Any]] = {}
        for n in gm.graph.nodes:
            if n.op == "output":
                continue
            found = _evaluated(values[n.name], at)
            if found is not None:
                run[n.name] = found
        runs.append(run)
    return runs


def _evaluated(value: Any, at: dict[Any, int]) -> tuple[bool, Any] | None:
    """``value`` with the batch sizes set as in ``at`` and every other size at the
    example's; None where that cannot be told."""
    if isinstance(value, torch.Tensor):
        dims = [_at(d, at) for d in value.shape]
        return None if any(d is None for d in dims) else (True, tuple(dims))
    if isinstance(value, (torch.SymInt, torch.SymFloat)):
        number = _at(value, at)
        return None if number is None else (False, number)
    if isinstance(value, (tuple, list)) and any(isinstance(x, torch.Tensor) for x in value):
        parts = [_evaluated(x, at) for x in value]
        return None if any(p is None for p in parts) else (False, tuple(parts))
    leaves, _ = tree_flatten(value)
    if any(isinstance(x, (torch.Tensor, *_SYMBOLIC)) for x in leaves):
        return None
    return False, value


def _at(value: Any, at: dict[Any, int]) -> Any:
    if not isinstance(value, (torch.SymInt, torch.SymFloat)):
        return value
    expr = value.node.expr.subs(at)
    if not expr.is_number:  # other sizes (a sequence length): the example's
        env = value.node.shape_env
        hints = getattr(env, "backed_var_to_val", None) or getattr(env, "var_to_val", {})
        expr = expr.xreplace({s: hints[s] for s in expr.free_symbols if s in hints})
    if not expr.is_number:
        return None
    return int(expr) if isinstance(value, torch.SymInt) else float(expr)


def price_recorded(
    gm: fx.GraphModule, example_values: Sequence[Any], roofline: Roofline, micro_batches: int
) -> CostTable:
    """Roofline costs of every node from the recorded shapes (``recorded_shapes`` must not
    be None)."""
    values = recorded_shapes(gm, example_values)
    assert values is not None, "price_recorded needs a graph whose shapes export recorded"
    grad = _gradients(gm, values, example_values)
    batched: set[fx.Node] = set()
    costs: dict[str, NodeCost] = {}
    runs: dict[Any, tuple[dict[Any, int], bool | None]] = {}
    for n in gm.graph.nodes:
        inputs = [(a, values[a.name]) for a in n.all_input_nodes]
        if n.op == "placeholder" or any(a in batched for a, _ in inputs):
            batched.add(n)
        out = values[n.name] if n.op != "output" else [v for _, v in inputs]
        seconds = 0.0
        if n.op == "get_attr":
            work = attribute(attrgetter(str(n.target))(gm), len(n.users))
            seconds = roofline.seconds(work, micro_batches)
        elif n.op not in ("placeholder", "output"):
            counted, alias = _run_on_meta(n, values, runs)
            facts = Facts.of_node(
                gm,
                n,
                inputs=inputs,
                out=out,
                module=None,
                counted=counted,
                batched=lambda a: a in batched,
                grad=lambda a, _: grad[a],
                size=_size,
                alias=alias,
            )
            seconds = roofline.seconds(facts.work(), micro_batches)
        costs[n.name] = _cost(n, out, seconds, grad[n], _param_bytes(gm, n))
    return CostTable("roofline", "s", costs, _batch_size(example_values))


def _gradients(
    gm: fx.GraphModule, values: dict[str, Any], example_values: Sequence[Any]
) -> dict[fx.Node, bool]:
    """Whether each node's value requires grad: parameters (and inputs) that do, and float
    results of anything that reads one."""
    examples = iter(example_values)
    grad: dict[fx.Node, bool] = {}
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            grad[n] = any(t.requires_grad for t in tensors(next(examples)))
        elif n.op == "get_attr":
            grad[n] = any(t.requires_grad for t in tensors(attrgetter(str(n.target))(gm)))
        elif n.op == "output":
            grad[n] = any(grad[a] for a in n.all_input_nodes)
        else:
            out = tensors(values[n.name])
            floats = any(t.is_floating_point() or t.is_complex() for t in out)
            grad[n] = floats and op_name(n) != "detach" and any(grad[a] for a in n.all_input_nodes)
    return grad


def _run_on_meta(
    n: fx.Node, values: dict[str, Any], runs: dict[Any, tuple[dict[Any, int], bool | None]]
) -> tuple[dict[Any, int], bool | None]:
    """For an op that multiplies matrices or may decompose into ops that do (and may
    then return its input as it is, as ``dropout(p=0)`` does): its forward FLOP per aten
    op and whether its output aliases an input, run on empty meta tensors of the recorded
    sizes. ``({}, None)`` for any other node (its recorded value says whether it aliases).
    ``runs`` keeps the answer per op and argument sizes: the layers of a model repeat."""
    target = n.target
    if n.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return {}, None
    name = target.name()  # type: ignore[no-untyped-call]
    composite = torch._C._dispatch_has_kernel_for_dispatch_key(name, _COMPOSITE)
    if "scaled_dot_product" in name or not (composite or target.overloadpacket in flop_registry):
        return {}, None  # attention is priced by formula, and never returns its input
    args, kwargs = fx.node.map_arg((n.args, n.kwargs), lambda a: _empty(values[a.name]))
    key = (name, _signature((args, kwargs)))
    if key not in runs:
        runs[key] = _counted(target, args, kwargs)
    return runs[key]


def _counted(target: Any, args: Any, kwargs: Any) -> tuple[dict[Any, int], bool | None]:
    try:
        with FlopCounterMode(display=False) as counter:
            out = target(*args, **kwargs)
    except Exception:  # an op meta tensors cannot run: no product counted
        return {}, None
    counted = dict(counter.get_flop_counts().get("Global", {}))
    return counted, aliases(tensors(out), tensors((args, kwargs)))


def _signature(value: Any) -> str:
    """The sizes, strides and types of the tensors in ``value``, and its other leaves."""
    leaves, spec = tree_flatten(value)
    described = [
        (tuple(x.shape), x.stride(), x.dtype) if isinstance(x, torch.Tensor) else x for x in leaves
    ]
    return repr((described, spec))


def _empty(value: Any) -> Any:
    """A meta tensor of the recorded value's sizes, strides and dtype; a number for a
    symbolic size; other values as they are."""
    if isinstance(value, torch.Tensor):
        return torch.empty_strided(
            [_hint(d) for d in value.shape],
            [_hint(s) for s in value.stride()],
            dtype=value.dtype,
            device="meta",
        )
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return type(value.node.hint)(value.node.hint)
    if isinstance(value, (list, tuple)):
        return type(value)(_empty(v) for v in value)
    return value


def _cost(n: fx.Node, out: Any, seconds: float, grad: bool, param_bytes: int) -> NodeCost:
    found = tensors(out)
    cost: NodeCost = node_cost(
        n,
        seconds,
        param_bytes,
        out_bytes=sum(_size(t)[1] for t in found),
        is_tensor=isinstance(out, torch.Tensor),
        grad=grad and bool(found),
    )
    return cost


def _param_bytes(gm: fx.GraphModule, n: fx.Node) -> int:
    if n.op != "get_attr":
        return 0
    value = attrgetter(str(n.target))(gm)
    return value.numel() * value.element_size() if isinstance(value, nn.Parameter) else 0


def _size(t: torch.Tensor) -> tuple[int, int]:
    numel = math.prod(_hint(d) for d in t.shape)
    return numel, numel * t.element_size()


def _hint(d: Any) -> int:
    return int(d.node.hint) if isinstance(d, torch.SymInt) else int(d)


def _hinted(value: Any) -> bool:
    """Whether every symbolic size in ``value`` has a hint (the example's size)."""
    leaves, _ = tree_flatten(value)
    for leaf in leaves:
        dims = list(leaf.shape) + list(leaf.stride()) if isinstance(leaf, torch.Tensor) else [leaf]
        if any(isinstance(d, torch.SymInt) and d.node.hint is None for d in dims):
            return False
    return True


def _shapes(value: Any) -> list[tuple[int, ...]]:
    return [tuple(_hint(d) for d in t.shape) for t in tensors(value)]


def _batch_size(values: Sequence[Any]) -> int:
    found = [t for t in tensors(list(values)) if t.ndim > 0]
    return int(found[0].shape[0]) if found else 1
