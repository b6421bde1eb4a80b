"""Rewires the readers of shared values to private copies of the chains that make them."""

from __future__ import annotations

import torch.fx as fx

__all__ = ["copy_per_reader"]


def copy_per_reader(
    gm: fx.GraphModule, chain: set[fx.Node], values: set[fx.Node], mark: str | None = None
) -> int:
    """Give every reader outside ``chain`` (the output node aside) of a value in ``values``
    its own copy of that value and of the ``chain`` nodes it is computed from, inserted just
    before the reader (``node.meta[mark] = True`` on each copy when ``mark`` is given); then
    erase the ``chain`` nodes no longer read. Rewrites ``gm`` in place and returns how many
    reader inputs were rewired."""
    graph = gm.graph
    rewired = 0
    for reader in list(graph.nodes):
        if reader in chain or reader.op == "output":
            continue
        for value in [n for n in reader.all_input_nodes if n in values]:
            with graph.inserting_before(reader):
                copy = _copy(graph, value, chain, mark)
            reader.replace_input_with(value, copy)
            rewired += 1
    for node in reversed(list(graph.nodes)):
        if node in chain and not node.users:
            graph.erase_node(node)
    graph.lint()
    gm.recompile()
    return rewired


def _copy(graph: fx.Graph, value: fx.Node, chain: set[fx.Node], mark: str | None) -> fx.Node:
    """A fresh copy of ``value`` and of the ``chain`` nodes it reads; other inputs shared."""
    copies: dict[fx.Node, fx.Node] = {}

    def copy(node: fx.Node) -> fx.Node:
        if node not in chain:
            return node
        if node not in copies:
            clone = graph.node_copy(node, copy)
            if mark is not None:
                clone.meta[mark] = True
            copies[node] = clone
        return copies[node]

    return copy(value)
