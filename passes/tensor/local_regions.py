"""Where a tensor-parallel local program's cut values meet whole ones: the values cut along
the sequence run as DTensors (entries, gathers, a norm module as its function), and a whole
value with a gradient that a cut computation reads goes through a replicated read whose
gradient the ranks sum."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from fxpipe.errors import ConfigError
from fxpipe.passes.tensor.cut_modules import ReplicatedRead, SequenceEntry, gathered, local
from fxpipe.passes.tensor.records import TensorPlan
from fxpipe.passes.tensor.sequence import NORM_MODULES, whole_readers

__all__ = ["on_sequence", "partial_reads"]


def on_sequence(
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


def partial_reads(
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
