"""Turns a priced fx graph into a networkx DiGraph: node weight = cost, edge weight = bytes."""

from __future__ import annotations

import networkx as nx
import torch
import torch.fx as fx

from fxpipe.ir import CostTable

__all__ = ["to_networkx", "mutated_input", "COMPUTE_OPS"]

#: fx opcodes that do work; placeholders, get_attr and output only name values.
COMPUTE_OPS = frozenset({"call_function", "call_method", "call_module"})


def to_networkx(gm: fx.GraphModule, costs: CostTable) -> nx.DiGraph:
    """One networkx node per fx node, with attributes

    - ``op``: the fx opcode; ``index``: position in the fx graph;
    - ``weight``: the node's cost; ``bytes``: its output bytes;
    - ``is_tensor``: whether the output is one tensor; ``param_bytes``;

    and one edge per (producer, consumer) pair with ``bytes`` and ``is_tensor`` of the value.
    """
    g = nx.DiGraph()
    for index, node in enumerate(gm.graph.nodes):
        c = costs.nodes[node.name]
        g.add_node(
            node.name,
            op=node.op,
            index=index,
            weight=c.cost,
            bytes=c.output_bytes,
            is_tensor=c.is_tensor,
            param_bytes=c.param_bytes,
            saved_bytes=c.saved_bytes,
        )
        for arg in node.all_input_nodes:
            a = costs.nodes[arg.name]
            g.add_edge(arg.name, node.name, bytes=a.output_bytes, is_tensor=a.is_tensor)
    _order_in_place_ops(gm, g)
    return g


def _order_in_place_ops(gm: fx.GraphModule, g: nx.DiGraph) -> None:
    """An op that modifies a value in place stays with that value's producer (its edge is
    marked not-a-tensor, so no border separates them), and every other reader of the value
    is ordered before or after it as in the fx graph, though no data edge says so."""
    position = {n: i for i, n in enumerate(gm.graph.nodes)}
    for node in gm.graph.nodes:
        target = mutated_input(gm, node)
        if target is None:
            continue
        g.edges[target.name, node.name]["is_tensor"] = False
        for reader in target.users:
            if reader is node or reader.op == "output":
                continue
            if position[reader] < position[node]:
                g.add_edge(reader.name, node.name, bytes=0, is_tensor=True)
            else:
                g.add_edge(node.name, reader.name, bytes=0, is_tensor=True)


def mutated_input(gm: fx.GraphModule, node: fx.Node) -> fx.Node | None:
    """The input ``node`` modifies in place, if any (``x.relu_()``, ``inplace=True``,
    mutable aten overloads)."""
    first = node.args[0] if node.args and isinstance(node.args[0], fx.Node) else None
    if first is None or node.op not in COMPUTE_OPS:
        return None
    if node.kwargs.get("inplace") is True:
        return first
    if node.op == "call_module":
        return first if getattr(gm.get_submodule(str(node.target)), "inplace", False) else None
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        schema = target._schema.arguments
        for arg, value in zip(schema, node.args):
            if arg.alias_info is not None and arg.alias_info.is_write:
                return value if isinstance(value, fx.Node) else None
        return None
    name = target if isinstance(target, str) else getattr(target, "__name__", "")
    if name.endswith("_") and not name.startswith("_"):
        return first
    return None
