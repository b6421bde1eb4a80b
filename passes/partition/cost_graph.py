"""Turns a priced fx graph into a networkx DiGraph: node weight = cost, edge weight = bytes."""

from __future__ import annotations

from collections.abc import Mapping
from operator import attrgetter
from typing import Any

import networkx as nx
import torch
import torch.fx as fx
from torch import nn

from fxpipe.ir import RECOMPUTE, CostTable
from fxpipe.passes.ops import (
    COMPUTE_OPS,
    is_check,
    is_view,
    mutated_input,
    stateful_regions,
    viewed_input,
)

__all__ = [
    "to_networkx",
    "readers",
    "carries_value",
    "replicated_attrs",
    "replicate_shared_weights",
    "REPLICATED",
    "batched_nodes",
    "COMPUTE_OPS",
]


def to_networkx(gm: fx.GraphModule, costs: CostTable) -> nx.DiGraph:
    """One networkx node per fx node, with attributes

    - ``op``: the fx opcode; ``index``: position in the fx graph;
    - ``weight``: the node's cost; ``bytes``: its output bytes;
    - ``is_tensor``: whether the output is one tensor; ``param_bytes``;
    - ``replicated``: a ``get_attr`` every stage reading it names itself (a non-tensor
      object, or a weight so marked: :func:`replicated_attrs`): it sends 0 bytes;
    - ``batched``: whether the value is computed from a model input (cut with the batch);

    and one edge per (producer, consumer) pair with ``bytes`` and ``is_tensor`` of the value
    (``is_tensor`` is False out of a node recomputed beside its reader, as out of a
    non-tensor value: the units pass keeps both ends together; out of a replicated
    attribute it is False too, but the units pass ties only compute nodes together, so
    the readers of one higher-order op body stay free to sit in different stages). Edges
    with ``order=True`` carry no value: they keep the readers of a value written in place
    on the right side of the write (:func:`readers` leaves them out).
    """
    g = nx.DiGraph()
    shared = replicated_attrs(gm)
    batched = batched_nodes(gm)
    for index, node in enumerate(gm.graph.nodes):
        c = costs.nodes[node.name]
        g.add_node(
            node.name,
            op=node.op,
            index=index,
            weight=c.cost,
            bytes=0 if node.name in shared else c.output_bytes,
            is_tensor=c.is_tensor,
            param_bytes=c.param_bytes,
            saved_bytes=c.saved_bytes,
            replicated=node.name in shared,
            batched=node.name in batched,
        )
        check = is_check(node)  # an assertion stays beside what it checks
        for arg in node.all_input_nodes:
            a = costs.nodes[arg.name]
            glued = check or bool(arg.meta.get(RECOMPUTE))  # never sent
            tensor = a.is_tensor and not glued
            sent = 0 if arg.name in shared else a.output_bytes
            g.add_edge(arg.name, node.name, bytes=sent, is_tensor=tensor)
    _order_in_place_ops(gm, g)
    _glue_stateful_regions(gm, g)
    return g


#: ``node.meta`` key of a ``get_attr`` of a weight that every stage reading it holds itself
#: (:func:`replicate_shared_weights`).
REPLICATED = "fxpipe_replicated"


def replicated_attrs(gm: fx.GraphModule) -> frozenset[str]:
    """Names of the ``get_attr`` nodes every stage reading them names itself: those whose
    value is not a tensor (a submodule, such as the body GraphModule a higher-order op of
    ``torch.export`` calls: code, not data), and the weights
    :func:`replicate_shared_weights` marked. Such a value is shared by reference, never a
    boundary value, and never ties the stages that read it together."""
    return frozenset(
        n.name
        for n in gm.graph.nodes
        if n.op == "get_attr"
        and (
            n.meta.get(REPLICATED, False)
            or not isinstance(attrgetter(str(n.target))(gm), torch.Tensor)
        )
    )


def replicate_shared_weights(gm: fx.GraphModule) -> tuple[str, ...]:
    """Mark (in place) every ``get_attr`` of a Parameter that several nodes read, such as a
    tied embedding and LM head, so that each stage reading it holds the Parameter itself
    instead of receiving it from the first with every micro-batch. For runtimes whose stages
    hold their own copies and sum the copies' gradients once per step (one process per
    stage); returns the targets marked."""
    marked = []
    for node in gm.graph.nodes:
        if node.op != "get_attr" or len(node.users) < 2:
            continue
        if isinstance(attrgetter(str(node.target))(gm), nn.Parameter):
            node.meta[REPLICATED] = True
            marked.append(str(node.target))
    return tuple(marked)


def readers(g: nx.DiGraph, name: str) -> list[str]:
    """The nodes that read ``name``'s value (its successors but those only ordered after it)."""
    return [v for v, edge in g.succ[name].items() if carries_value(edge)]


def carries_value(edge: Mapping[str, Any]) -> bool:
    """Whether an edge's attributes describe a value read (not an ordering edge)."""
    return not edge.get("order", False)


def _order_in_place_ops(gm: fx.GraphModule, g: nx.DiGraph) -> None:
    """An op that writes a value in place stays with that value and every view of it (their
    edges are marked not-a-tensor, so no border separates them), and every other reader of
    the value or of its views is ordered before or after the write as in the fx graph,
    though no data edge says so."""
    position = {n: i for i, n in enumerate(gm.graph.nodes)}
    aliases = _alias_groups(gm)
    for node in gm.graph.nodes:
        target = mutated_input(gm, node)
        if target is None:
            continue
        group = aliases[target]
        for member in group:
            for user in member.users:
                if user in group or user is node:
                    g.edges[member.name, user.name]["is_tensor"] = False
        for reader in (u for m in group for u in m.users):
            if reader is node or reader.op == "output" or reader in group:
                continue
            a, b = (reader, node) if position[reader] < position[node] else (node, reader)
            if not g.has_edge(a.name, b.name):
                g.add_edge(a.name, b.name, bytes=0, is_tensor=True, order=True)


def _glue_stateful_regions(gm: fx.GraphModule, g: nx.DiGraph) -> None:
    """Chain the compute nodes of each region that runs under a changed interpreter state
    (:func:`fxpipe.passes.ops.stateful_regions`) with not-a-tensor ordering edges, so that
    the units pass keeps the region in one unit and so in one stage, in graph order."""
    for region in stateful_regions(gm.graph):
        members = [n.name for n in region if n.op in COMPUTE_OPS]
        for a, b in zip(members, members[1:]):
            if g.has_edge(a, b):
                g.edges[a, b]["is_tensor"] = False
            else:
                g.add_edge(a, b, bytes=0, is_tensor=False, order=True)


def _alias_groups(gm: fx.GraphModule) -> dict[fx.Node, frozenset[fx.Node]]:
    """Each node -> the nodes that may share its memory (a base and all views of it)."""
    parent = {n: n for n in gm.graph.nodes}

    def find(n: fx.Node) -> fx.Node:
        while parent[n] is not n:
            parent[n] = parent[parent[n]]
            n = parent[n]
        return n  # type: ignore[no-any-return]

    for node in gm.graph.nodes:
        base = viewed_input(node) if is_view(node) else None
        if base is not None:
            parent[find(node)] = find(base)
    groups: dict[fx.Node, set[fx.Node]] = {}
    for node in gm.graph.nodes:
        groups.setdefault(find(node), set()).add(node)
    return {n: frozenset(groups[find(n)]) for n in gm.graph.nodes}


def batched_nodes(gm: fx.GraphModule) -> set[str]:
    """Names of the nodes computed from a model input: their values are cut with the batch.
    The others (a weight read by ``get_attr``, what is computed from weights alone) are the
    same whole value in every micro-batch."""
    out: set[str] = set()
    for node in gm.graph.nodes:
        if node.op == "placeholder" or any(a.name in out for a in node.all_input_nodes):
            out.add(node.name)
    return out
