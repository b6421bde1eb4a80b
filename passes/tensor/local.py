"""The program each tp rank runs: a graph with its plan's cut products made module calls and
the sizes its plan cuts divided by tp."""

from __future__ import annotations

import copy
from operator import attrgetter
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from fxpipe.errors import ConfigError
from fxpipe.passes.ops import is_check
from fxpipe.passes.tensor.cut_modules import (
    Cut,
    CutEmbedding,
    CutInOut,
    CutLinear,
)
from fxpipe.passes.tensor.local_regions import on_sequence, partial_reads
from fxpipe.passes.tensor.local_sizes import (
    cut_graph_sizes,
    cut_sizes,
    read_whole_sizes,
    whole_shape,
)
from fxpipe.passes.tensor.products import Embedding, Product, find_embeddings, find_products
from fxpipe.passes.tensor.records import TensorPlan

__all__ = ["local_program", "cut_sizes", "whole_shape"]  # the sizes: from local_sizes


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
    cut_graph_sizes(graph, plan)
    read_whole_sizes(graph, plan)
    _drop_checks_of_cut_values(graph, plan)
    pending = _call_modules(gm, graph, plan)
    _drop_dead_reads(gm, graph, [m for m, _ in pending.values()])
    installed = _place_modules(graph, pending)
    installed.update(on_sequence(gm, graph, plan, installed))
    installed.update(partial_reads(gm, graph, plan, installed))
    graph.lint()
    root: dict[str, Any] = {}
    for n in graph.nodes:
        if n.op in ("get_attr", "call_module"):
            target = str(n.target)
            root[target] = installed[target] if target in installed else attrgetter(target)(gm)
    return fx.GraphModule(root, graph, class_name=type(gm).__name__)


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
