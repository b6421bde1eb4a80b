"""The program each tp rank runs: a graph with its plan's cut products made module calls and
the sizes its plan cuts divided by tp."""

from __future__ import annotations

import copy
import operator
from collections.abc import Mapping, Sequence
from operator import attrgetter
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from fxpipe.errors import ConfigError
from fxpipe.passes.ops import is_check, op_name
from fxpipe.passes.tensor.cut_modules import (
    Cut,
    CutEmbedding,
    CutInOut,
    CutLinear,
    ReplicatedRead,
    SequenceEntry,
    gathered,
    local,
)
from fxpipe.passes.tensor.products import Embedding, Product, find_embeddings, find_products
from fxpipe.passes.tensor.records import Shard, TensorPlan
from fxpipe.passes.tensor.sequence import NORM_MODULES, whole_readers

__all__ = ["local_program", "cut_sizes", "whole_shape"]

#: Ops whose size arguments name their output's sizes (the cut one divided by tp).
_SIZED = frozenset({"view", "reshape", "_unsafe_view", "expand"})
#: Ops whose size arguments name the pieces of their input along ``dim``.
_SPLIT = frozenset({"split", "split_with_sizes"})
#: Ops that take a range of their input along a dimension (whole parts of a cut one).
_SLICE = frozenset({"slice", "narrow", "getitem"})


def local_program(gm: fx.GraphModule, plan: TensorPlan) -> fx.GraphModule:
    """What every rank of ``plan``'s tp ranks runs, as a new GraphModule (``gm`` is left as
    it was).

    Each product ``plan`` cuts becomes a call to a module holding the model's own
    Parameters, at the path of the weight's owner (``blocks.0.attn.qkv``; a second module
    reading the same weight, a tied LM head, is named after its node): a
    :class:`~fxpipe.passes.tensor.cut_modules.CutLinear` (weight stored (out, in)), a
    :class:`~fxpipe.passes.tensor.cut_modules.CutInOut` (stored (in, out), transformers'
    ``Conv1D``) or a :class:`~fxpipe.passes.tensor.cut_modules.CutEmbedding`, each carrying
    the plan's :class:`~fxpipe.passes.tensor.cut_modules.Cut`. The modules hold whole
    weights: :func:`~fxpipe.passes.tensor.parallelize.parallelize_stage` cuts them. Every
    size the plan cuts (a view's, reshape's or expand's size along its output's cut
    dimension, a split's sizes along its input's cut dimension) is divided by tp; a size read
    off a cut value (``x.shape``, ``x.size(d)``, ``numel``) reads the whole size, as the
    graph was written for; an assertion on a cut value is dropped. Every other node runs as
    it was, on the rank's pieces and whole values. Node metadata keeps the whole shapes.
    The values the plan holds cut along the sequence (``plan.sequence``) are DTensors
    (:func:`_on_sequence`). A whole value with a gradient that a cut computation reads
    (``plan.partial_reads``) is read there through a :class:`ReplicatedRead`, so that the
    ranks' parts of its gradient are summed (:func:`_partial_reads`).
    """
    nodes = {n.name: n for n in gm.graph.nodes}
    missing = sorted(set(plan.node_styles) - set(nodes))
    if missing:
        raise ConfigError(
            f"the tensor-parallel plan cuts nodes {missing} the graph does not have: plan "
            "this graph itself (tensor_plan(gm, tp, example_values))"
        )
    graph = copy.deepcopy(gm.graph)
    copied = {n.name: n for n in graph.nodes}
    if set(copied) != set(nodes):  # the copy keeps every name; the plan reads them
        raise AssertionError("copying the graph renamed its nodes")
    _cut_sizes(graph, plan)
    _read_whole_sizes(graph, plan)
    _drop_checks_of_cut_values(graph, plan)
    pending = _call_modules(gm, graph, plan)
    _drop_dead_reads(gm, graph, [m for m, _ in pending.values()])
    installed = _place_modules(graph, pending)
    installed.update(_on_sequence(gm, graph, plan, installed))
    installed.update(_partial_reads(gm, graph, plan, installed))
    graph.lint()
    root: dict[str, Any] = {}
    for n in graph.nodes:
        if n.op in ("get_attr", "call_module"):
            target = str(n.target)
            root[target] = installed[target] if target in installed else attrgetter(target)(gm)
    return fx.GraphModule(root, graph, class_name=type(gm).__name__)


# --------------------------------------------------------------------------------- sizes


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


def _cut_sizes(graph: fx.Graph, plan: TensorPlan) -> None:
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


def _read_whole_sizes(graph: fx.Graph, plan: TensorPlan) -> None:
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


def _drop_checks_of_cut_values(graph: fx.Graph, plan: TensorPlan) -> None:
    """An assertion recorded on a cut value states its whole sizes; the rank holds a piece
    (or, cut along the sequence, a DTensor, which torch's checks do not take)."""
    cut = {*plan.layouts, *plan.sequence}
    for n in list(graph.nodes):
        if is_check(n) and not n.users and any(a.name in cut for a in n.all_input_nodes):
            graph.erase_node(n)


# ------------------------------------------------------------------------------- products


def _call_modules(
    gm: fx.GraphModule, graph: fx.Graph, plan: TensorPlan
) -> dict[str, tuple[nn.Module, str]]:
    """Replace each cut product and embedding by a call to a generated module, at a
    temporary path; temporary path -> (module, the path its weight's owner has)."""
    products, embeddings = find_products(gm), find_embeddings(gm)
    pending: dict[str, tuple[nn.Module, str]] = {}
    for n in list(graph.nodes):
        style = plan.node_styles.get(n.name)
        if style is None:
            continue
        if style == "vocab":
            e = embeddings[n.name]
            module: nn.Module = _embedding(gm, n, e, plan)
            weight, x = e.weight, e.ids
        else:
            p = products[n.name]
            module = _linear(gm, p, plan, style)
            weight, x = p.weight, p.x
        path = f"_cut_{n.name}"  # placed at its real path once the weight reads are gone
        pending[path] = (module, weight.rpartition(".")[0])
        source = next(a for a in n.all_input_nodes if a.name == x)
        n.op, n.target = "call_module", path  # in place: the node keeps its name and place
        n.args, n.kwargs = (source,), {}
    return pending


def _place_modules(
    graph: fx.Graph, pending: dict[str, tuple[nn.Module, str]]
) -> dict[str, nn.Module]:
    """Each generated module at its weight owner's path where nothing else the graph reads
    lives there, beneath or above it (the first, in graph order, of modules sharing a
    weight), else at a path named after its node; path -> module."""
    taken = {
        str(n.target)
        for n in graph.nodes
        if n.op in ("get_attr", "call_module") and str(n.target) not in pending
    }
    installed: dict[str, nn.Module] = {}
    for n in graph.nodes:
        if n.op != "call_module" or n.target not in pending:
            continue
        module, owner = pending[str(n.target)]
        node = str(n.target).removeprefix("_cut_")
        path = next(
            p
            for p in (owner, node, f"{node}_cut", f"_cut_{node}")
            if p and all(not _overlaps(p, t) for t in [*taken, *installed])
        )
        installed[path] = module
        n.target = path
    return installed


def _linear(gm: fx.GraphModule, p: Product, plan: TensorPlan, style: Any) -> nn.Module:
    weight = _parameter(gm, p.weight)
    bias = None if p.bias is None else _parameter(gm, p.bias)
    w_cut = plan.params[p.weight].shard
    b_cut = None if p.bias is None else plan.params[p.bias].shard
    sequence = plan.sequence.get(p.node) if style == "rowwise" else None
    cut = Cut(p.node, style, w_cut, b_cut, sequence)
    if w_cut is not None and weight.shape[w_cut.dim] % (w_cut.blocks * plan.tp):
        raise ConfigError(
            f"{p.weight} has {weight.shape[w_cut.dim]} rows along dim {w_cut.dim}, which "
            f"{w_cut.blocks} parts of tp={plan.tp} pieces do not divide; plan with a tp that "
            "divides it"
        )
    if p.out_dim == 0:
        return CutLinear(weight, bias, cut)
    return CutInOut(weight, bias, cut)


def _embedding(gm: fx.GraphModule, n: fx.Node, e: Embedding, plan: TensorPlan) -> nn.Module:
    weight = _parameter(gm, e.weight)
    padding_idx, options = _embedding_options(gm, n)
    if options:
        shown = ", ".join(f"{k}={v!r}" for k, v in options.items())
        raise ConfigError(
            f"embedding {n.name} is called with {shown}, which a lookup cut over the "
            "vocabulary does not take; leave them at their defaults to cut it"
        )
    if weight.shape[0] % plan.tp:
        raise ConfigError(
            f"{e.weight} has {weight.shape[0]} rows, which tp={plan.tp} does not divide; plan "
            "with a tp that divides the vocabulary"
        )
    cut = Cut(n.name, "vocab", plan.params[e.weight].shard, None, plan.sequence.get(n.name))
    return CutEmbedding(weight, padding_idx, cut)


def _embedding_options(gm: fx.GraphModule, n: fx.Node) -> tuple[int | None, dict[str, Any]]:
    """An embedding call's padding index (None: none) and the other options it sets away
    from their defaults."""
    if n.op == "call_module":
        m = gm.get_submodule(str(n.target))
        assert isinstance(m, nn.Embedding)
        extra = {"scale_grad_by_freq": m.scale_grad_by_freq, "sparse": m.sparse}
        return m.padding_idx, {k: v for k, v in extra.items() if v}
    rows = int(attrgetter(str(_weight_node(n).target))(gm).shape[0])
    if isinstance(n.target, torch._ops.OpOverload):  # aten: (weight, ids, padding_idx, ...)
        names = ["padding_idx", "scale_grad_by_freq", "sparse"]
        given: dict[str, Any] = dict(zip(names, n.args[2:]), **n.kwargs)
        padding = int(given.get("padding_idx", -1))
        extra = {k: given[k] for k in names[1:] if given.get(k)}
        return (None if padding == -1 else padding), extra
    keys = ["padding_idx", "max_norm", "norm_type", "scale_grad_by_freq"]
    called: dict[str, Any] = {**dict(zip(keys, n.args[2:])), **n.kwargs}
    index = called.get("padding_idx")
    extra = {k: called[k] for k in ("scale_grad_by_freq", "sparse") if called.get(k)}
    return (None if index is None else int(index) % rows), extra


def _weight_node(n: fx.Node) -> fx.Node:
    aten = isinstance(n.target, torch._ops.OpOverload)
    w = n.args[0] if aten else n.args[1]
    assert isinstance(w, fx.Node)
    return w


def _parameter(gm: fx.GraphModule, name: str) -> nn.Parameter:
    value = attrgetter(name)(gm)
    assert isinstance(value, nn.Parameter), name
    return value


def _overlaps(a: str, b: str) -> bool:
    return a == b or a.startswith(b + ".") or b.startswith(a + ".")


def _drop_dead_reads(gm: fx.GraphModule, graph: fx.Graph, modules: list[nn.Module]) -> None:
    """Remove the reads of the weights the generated modules now hold (and the transposes
    the products read them through); a weight still read elsewhere cannot be cut."""
    held = {id(p) for m in modules for p in m.parameters()}
    for n in reversed(list(graph.nodes)):
        if n.users or n.op not in ("get_attr", "call_function", "call_method"):
            continue
        source = n if n.op == "get_attr" else n.args[0] if n.args else None
        if isinstance(source, fx.Node) and source.op == "get_attr":
            value = attrgetter(str(source.target))(gm)
            if id(value) in held and (n is source or len(n.all_input_nodes) == 1):
                graph.erase_node(n)
    for n in graph.nodes:
        if n.op == "get_attr" and id(attrgetter(str(n.target))(gm)) in held:
            readers = ", ".join(u.name for u in n.users)
            raise ConfigError(
                f"{n.target} is cut by the tensor-parallel plan but {readers} also read it "
                "whole; plan this graph itself (tensor_plan leaves such a weight whole)"
            )


# ------------------------------------------------------------------------------- sequence


def _on_sequence(
    gm: fx.GraphModule, graph: fx.Graph, plan: TensorPlan, installed: Mapping[str, nn.Module]
) -> dict[str, nn.Module]:
    """Run the values ``plan`` cuts along the sequence as DTensors: the row-wise products
    and embeddings that start a region give theirs cut (their style says so; one that
    reads the tokens flattened reads them unflattened), a whole value a region op reads
    enters through a :class:`SequenceEntry` call (one per value), a torch norm module there
    runs as its function (its weights entering alike), and a value read outside the
    regions is all-gathered once (:func:`gathered`): column-wise products read the
    replicated DTensor, anything else its :func:`local` tensor (size queries read the cut
    DTensor, whose sizes are the whole value's). The generated modules, by path."""
    cut = {n.name for n in graph.nodes if n.name in plan.sequence and n.op != "placeholder"}
    if not cut:
        return {}
    _unflatten(graph, plan)
    path = next(p for p in ("_sequence_entry", "_sequence_entry_") if p not in installed)
    for n in list(graph.nodes):
        if n.name in cut and n.op == "call_module" and str(n.target) not in installed:
            if isinstance(gm.get_submodule(str(n.target)), NORM_MODULES):
                _norm_as_function(gm, graph, n)
    entries: dict[str, fx.Node] = {}
    for n in list(graph.nodes):
        if n.name not in cut or n.name in plan.node_styles:
            continue
        for a in n.all_input_nodes:
            if a.name in cut:
                continue
            if a.name not in entries:
                with graph.inserting_before(n):
                    entries[a.name] = graph.call_module(path, (a,))
            n.replace_input_with(a, entries[a.name])
    by_name = {n.name: n for n in graph.nodes}
    for value, readers in whole_readers(graph, cut).items():
        source = by_name[value]
        with graph.inserting_after(source):
            replicated = graph.call_function(gathered, (source,))
        plain: fx.Node | None = None
        for reader in (by_name[r] for r in readers):
            if reader.name in plan.node_styles:  # a column-wise product reads the DTensor
                reader.replace_input_with(source, replicated)
                continue
            if plain is None:
                with graph.inserting_after(replicated):
                    plain = graph.call_function(local, (replicated,))
            reader.replace_input_with(source, plain)
    return {path: SequenceEntry()}


def _unflatten(graph: fx.Graph, plan: TensorPlan) -> None:
    """A product that reads the tokens flattened and starts or ends a region reads them
    unflattened (its flattening view, now unread, goes): its output, or the value it
    gathers, is then laid out by sequence (the view after it restores the same sizes)."""
    nodes = {n.name: n for n in graph.nodes}
    for name, source in plan.unflattened.items():
        product = nodes.get(name)
        if product is None or source not in nodes:
            continue
        flat = product.args[0]
        assert isinstance(flat, fx.Node), product.format_node()
        product.replace_input_with(flat, nodes[source])
        if not flat.users:
            graph.erase_node(flat)


def _norm_as_function(gm: fx.GraphModule, graph: fx.Graph, n: fx.Node) -> None:
    """A call of a torch norm module, made in place (the node keeps its name) a call of its
    function on its weights read by ``get_attr`` (so that they can enter a region as
    DTensors)."""
    module = gm.get_submodule(str(n.target))
    assert isinstance(module, (nn.LayerNorm, nn.RMSNorm)), module
    with graph.inserting_before(n):
        weight = graph.get_attr(f"{n.target}.weight") if module.weight is not None else None
        args: Any
        if isinstance(module, nn.LayerNorm):
            bias = graph.get_attr(f"{n.target}.bias") if module.bias is not None else None
            args = (n.args[0], tuple(module.normalized_shape), weight, bias, module.eps)
            n.target = torch.nn.functional.layer_norm
        else:
            args = (n.args[0], tuple(module.normalized_shape), weight, module.eps)
            n.target = torch.nn.functional.rms_norm
        n.args = args
    n.op, n.kwargs = "call_function", {}


# ------------------------------------------------------------------------- partial reads


def _partial_reads(
    gm: fx.GraphModule, graph: fx.Graph, plan: TensorPlan, installed: Mapping[str, nn.Module]
) -> dict[str, nn.Module]:
    """Each whole value with a gradient that a cut node reads, read there through one
    :class:`ReplicatedRead` call (placed before its first such reader); a norm module a cut
    node calls runs as its function, its weights read alike. The generated module, by
    path."""
    nodes = {n.name: n for n in graph.nodes}
    reads = {k: list(v) for k, v in plan.partial_reads.items()}
    for name in plan.partial_modules:
        n = nodes.get(name)
        if n is None:
            continue
        module = gm.get_submodule(str(n.target))
        if not isinstance(module, NORM_MODULES):
            raise ConfigError(
                f"{n.name} calls {n.target} ({type(module).__name__}) on values cut over the "
                "tp ranks, and its own parameters would get each rank's part of their "
                "gradient only; leave its products whole (a plan that does not cut them)"
            )
        _norm_as_function(gm, graph, n)
        for weight in n.all_input_nodes:
            if weight.op == "get_attr":
                reads.setdefault(weight.name, []).append(n.name)
    if not reads:
        return {}
    path = next(p for p in ("_replicated_read", "_replicated_read_") if p not in installed)
    order = {n.name: k for k, n in enumerate(graph.nodes)}
    nodes = {n.name: n for n in graph.nodes}
    for value, readers in reads.items():
        mine = sorted((nodes[r] for r in readers if r in nodes), key=lambda r: order[r.name])
        if value not in nodes or not mine:
            continue
        with graph.inserting_before(mine[0]):
            read = graph.call_module(path, (nodes[value],))
        for reader in mine:
            reader.replace_input_with(nodes[value], read)
    return {path: ReplicatedRead(plan.tp)}
