"""The sizes a tensor-parallel local program computes with: a view's, reshape's or expand's
size along a cut dimension divided by tp, a split's and a slice's bounds alike, and a size
read off a cut value read whole (as the graph was written for)."""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx as fx

from fxpipe.errors import ConfigError
from fxpipe.passes.ops import op_name
from fxpipe.passes.tensor.records import Shard, TensorPlan

__all__ = [
    "cut_graph_sizes",
    "read_whole_sizes",
    "cut_sizes",
    "cut_split_sizes",
    "whole_shape",
    "sliced_parts",
    "indexed_parts",
]

#: Ops whose size arguments name their output's sizes (the cut one divided by tp).
_SIZED = frozenset({"view", "reshape", "_unsafe_view", "expand"})
#: Ops whose size arguments name the pieces of their input along ``dim``.
_SPLIT = frozenset({"split", "split_with_sizes"})
#: Ops that take a range of their input along a dimension (whole parts of a cut one).
_SLICE = frozenset({"slice", "narrow", "getitem"})


def cut_sizes(sizes: int | Sequence[int], dim: int, tp: int) -> int | list[int]:
    """``sizes`` (a view's shape, or one int) with the size at ``dim`` divided by ``tp``
    (``-1``, inferred, left as it is)."""
    if isinstance(sizes, int):
        return sizes if sizes == -1 else sizes // tp
    out = list(sizes)
    if out[dim] != -1:
        out[dim] //= tp
    return out


def cut_split_sizes(
    x: torch.Tensor, sizes: int | Sequence[int], dim: int, cut: int, tp: int
) -> int | list[int]:
    """A split's ``sizes`` along ``dim`` of ``x``, divided by ``tp`` where ``dim`` is the cut
    dimension ``cut``."""
    if dim % x.dim() != cut:
        return sizes if isinstance(sizes, int) else list(sizes)
    return sizes // tp if isinstance(sizes, int) else [s // tp for s in sizes]


def whole_shape(x: torch.Tensor, dim: int, tp: int) -> torch.Size:
    """The whole sizes of a value cut along ``dim`` over ``tp`` ranks, from one rank's piece."""
    sizes = list(x.shape)
    sizes[dim] *= tp
    return torch.Size(sizes)


def cut_graph_sizes(graph: fx.Graph, plan: TensorPlan) -> None:
    for n in list(graph.nodes):
        if n.op not in ("call_function", "call_method"):
            continue
        name = op_name(n)
        layout = plan.layouts.get(n.name)
        if name in _SIZED and isinstance(layout, Shard):
            _cut_shape_args(graph, n, layout.dim, plan.tp)
        elif name in _SPLIT and isinstance(n.args[0], fx.Node):
            source = plan.layouts.get(n.args[0].name)
            if isinstance(source, Shard):
                _cut_split_args(graph, n, source.dim, plan.tp)
        elif name in _SLICE and layout is not None and isinstance(n.args[0], fx.Node):
            source = plan.layouts.get(n.args[0].name)
            if isinstance(source, Shard):
                _cut_slice_args(n, source.dim, plan.tp)


def _cut_shape_args(graph: fx.Graph, n: fx.Node, dim: int, tp: int) -> None:
    """Divide the size at ``dim`` of a view, reshape or expand node's shape."""
    args = list(n.args)
    if "size" in n.kwargs or "shape" in n.kwargs:
        key = "size" if "size" in n.kwargs else "shape"
        kwargs = dict(n.kwargs)
        kwargs[key] = _cut_shape(graph, n, kwargs[key], dim, tp)
        n.kwargs = kwargs
    elif n.op == "call_method" and len(args) > 2:  # x.view(b, t, h, d): sizes as arguments
        args[1 + dim] = _divided(graph, n, args[1 + dim], tp)
        n.args = tuple(args)
    elif len(args) >= 2:
        args[1] = _cut_shape(graph, n, args[1], dim, tp)
        n.args = tuple(args)
    else:
        raise ConfigError(f"{n.format_node()} has no shape the tensor-parallel pass can cut")


def _cut_shape(graph: fx.Graph, n: fx.Node, shape: Any, dim: int, tp: int) -> Any:
    if isinstance(shape, (list, tuple)):
        out = list(shape)
        out[dim] = _divided(graph, n, out[dim], tp)
        return type(shape)(out) if isinstance(shape, tuple) else out
    if isinstance(shape, int) and dim == 0:
        return _divided(graph, n, shape, tp)
    with graph.inserting_before(n):  # a shape computed at run time
        return graph.call_function(cut_sizes, (shape, dim, tp))


def _divided(graph: fx.Graph, n: fx.Node, size: Any, tp: int) -> Any:
    """One size divided by tp: an int now, a size computed at run time by a new node."""
    if isinstance(size, fx.Node):
        with graph.inserting_before(n):
            return graph.call_function(operator.floordiv, (size, tp))
    if isinstance(size, int):
        if size == -1:
            return size
        if size % tp:
            raise ConfigError(
                f"{n.format_node()} names a size of {size} along the dimension the "
                f"tensor-parallel plan cuts, which tp={tp} does not divide; plan with a tp "
                "that divides it"
            )
        return size // tp
    raise ConfigError(f"{n.format_node()}: the size {size!r} cannot be divided by tp={tp}")


def _cut_split_args(graph: fx.Graph, n: fx.Node, cut: int, tp: int) -> None:
    args, kwargs = list(n.args), dict(n.kwargs)
    dim = args[2] if len(args) > 2 else kwargs.get("dim", 0)
    key = "split_size" if "split_size" in kwargs else "split_size_or_sections"
    sizes = args[1] if len(args) > 1 else kwargs.get(key, kwargs.get("split_sizes"))
    if isinstance(dim, int) and dim >= 0 and not isinstance(sizes, fx.Node):
        if dim != cut:
            return
        if isinstance(sizes, (list, tuple)):
            new: Any = [_divided(graph, n, s, tp) for s in sizes]
        else:
            new = _divided(graph, n, sizes, tp)
    else:  # a negative or computed dim, or computed sizes: cut at run time
        with graph.inserting_before(n):
            new = graph.call_function(cut_split_sizes, (args[0], sizes, dim, cut, tp))
    if len(args) > 1:
        args[1] = new
    else:
        kwargs[key if key in kwargs else "split_sizes"] = new
    n.args, n.kwargs = tuple(args), kwargs


def _cut_slice_args(n: fx.Node, cut: int, tp: int) -> None:
    """A slice (or index) of whole parts of the cut dimension (q of a fused q, k, v) takes
    the rank's pieces of them: it becomes :func:`sliced_parts` (or :func:`indexed_parts`),
    which divide its bounds by tp on the rank's piece."""
    name, x = op_name(n), n.args[0]
    if name == "getitem":
        n.op, n.target, n.kwargs = "call_function", indexed_parts, {}
        n.args = (x, n.args[1], cut, tp)
        return
    dim = arg_of(n, 1, "dim", 0)
    if isinstance(dim, int) and 0 <= dim != cut:
        return  # another dimension: as it was
    if name == "narrow":
        begin = arg_of(n, 2, "start", 0)
        bounds = (begin, begin + arg_of(n, 3, "length", 0), 1)
    else:
        bounds = (arg_of(n, 2, "start", None), arg_of(n, 3, "end", None), arg_of(n, 4, "step", 1))
    n.op, n.target, n.kwargs = "call_function", sliced_parts, {}
    n.args = (x, dim, *bounds, cut, tp)


def arg_of(n: fx.Node, index: int, key: str, default: Any) -> Any:
    """Argument ``index`` or keyword ``key`` of ``n``."""
    return n.args[index] if len(n.args) > index else n.kwargs.get(key, default)


def sliced_parts(
    x: torch.Tensor, dim: int, start: Any, stop: Any, step: Any, cut: int, tp: int
) -> Any:
    """``x[start:stop:step]`` along ``dim``, where ``x`` is one rank's piece of a value cut
    along ``cut`` in parts; along ``cut`` the slice takes whole parts (unit step): the
    rank's pieces of them."""
    if dim % x.dim() != cut:
        return x[(slice(None),) * (dim % x.dim()) + (slice(start, stop, step),)]
    a, b, _ = slice(start, stop).indices(x.shape[cut] * tp)
    return x.narrow(cut, a // tp, max(b - a, 0) // tp)


def indexed_parts(x: torch.Tensor, index: Any, cut: int, tp: int) -> Any:
    """``x[index]``, where ``x`` is one rank's piece of a value cut along ``cut`` in parts
    and the index slices whole parts of it: the rank's pieces of them."""
    items = list(index) if isinstance(index, tuple) else [index]
    if Ellipsis in items:
        at = items.index(Ellipsis)
        used = sum(1 for i in items if i is not None and i is not Ellipsis)
        items[at : at + 1] = [slice(None)] * (x.dim() - used)
    dim = 0
    for k, item in enumerate(items):
        if item is None:
            continue
        if dim == cut and isinstance(item, slice):
            a, b, _ = item.indices(x.shape[cut] * tp)
            items[k] = slice(a // tp, a // tp + max(b - a, 0) // tp)
            break
        dim += 1
    return x[tuple(items)]


def read_whole_sizes(graph: fx.Graph, plan: TensorPlan) -> None:
    """Sizes read off a cut value read its whole sizes (the graph computes with them)."""
    for n in list(graph.nodes):
        if n.op not in ("call_function", "call_method") or not n.args:
            continue
        x = n.args[0]
        layout = plan.layouts.get(x.name) if isinstance(x, fx.Node) else None
        if not isinstance(layout, Shard):
            continue
        assert isinstance(x, fx.Node)
        name, rest = op_name(n), list(n.args[1:])
        if (name == "getattr" and rest == ["shape"]) or (name == "size" and not rest):
            replacement = _whole(graph, n, x, layout.dim, plan.tp, None)
        elif name in ("size", "sym_size") and len(rest) == 1:
            replacement = _whole(graph, n, x, layout.dim, plan.tp, rest[0])
        elif name == "numel" and not rest:
            _scale_uses(graph, n, plan.tp)
            continue
        else:
            continue
        n.replace_all_uses_with(replacement)
        graph.erase_node(n)


def _scale_uses(graph: fx.Graph, n: fx.Node, tp: int) -> None:
    """Every use of ``n`` reads ``n * tp`` instead."""
    with graph.inserting_after(n):
        scaled = graph.call_function(operator.mul, (n, tp))
    n.replace_all_uses_with(scaled, delete_user_cb=lambda u: u is not scaled)


def _whole(graph: fx.Graph, n: fx.Node, x: fx.Node, dim: int, tp: int, item: Any) -> fx.Node:
    with graph.inserting_before(n):
        shape = graph.call_function(whole_shape, (x, dim, tp))
        return shape if item is None else graph.call_function(operator.getitem, (shape, item))
