"""Coarsens a cost graph into *units*: the smallest groups of nodes a stage border may not split.

A unit is one compute node, or several merged because a non-tensor value (a tuple, an
int, a dict) flows between them: such values never cross a stage border. Merging keeps
the unit graph acyclic by collapsing any cycle it would create (a convex hull). Zero-cost
nodes that only name values are not units: placeholders are pinned to the first stage,
``get_attr`` nodes join the first stage that reads them, and the output node the last.
A ``get_attr`` of a submodule (the body of a higher-order op, which several copies of the
op may call) is not a value that crosses a border either: every stage that reads it names
it itself, so it ties none of its readers together. A caller may tie groups of nodes together too
(``together``: a tensor-parallel region, whose cut values a border would make whole).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

import networkx as nx
import numpy as np

from fxpipe.passes.partition.cost_graph import COMPUTE_OPS

__all__ = ["Units", "build_units"]


@dataclass(frozen=True)
class Units:
    """The unit DAG of a cost graph and the maps between nodes and units."""

    #: Unit DAG; unit ids are 0..U-1 in a topological order close to the fx order.
    dag: nx.DiGraph
    #: Compute node name -> unit id.
    unit_of: dict[str, int]
    #: Unit id -> compute node names in fx order.
    members: tuple[tuple[str, ...], ...]
    #: Unit id -> summed cost (get_attr costs added to their first reader's unit).
    weight: np.ndarray
    #: Units that must sit in the first stage (they read a non-tensor model input).
    pinned_first: frozenset[int]

    @property
    def num_units(self) -> int:
        return len(self.members)


def build_units(g: nx.DiGraph, together: Sequence[Collection[str]] = ()) -> Units:
    """Group the compute nodes of ``g`` (from
    :func:`fxpipe.passes.partition.cost_graph.to_networkx`); each group of ``together``
    (node names; names ``g`` lacks and nodes that compute nothing are skipped) in one
    unit."""
    index = nx.get_node_attributes(g, "index")
    compute = sorted((n for n, op in g.nodes(data="op") if op in COMPUTE_OPS), key=index.get)
    parent = {n: n for n in compute}
    for u, v, tensor in g.edges(data="is_tensor"):
        if not tensor and u in parent and v in parent:
            _union(parent, u, v)
    for group in together:
        members = [n for n in group if n in parent]
        for n in members[1:]:
            _union(parent, members[0], n)
    group = {n: _find(parent, n) for n in compute}
    if all(group[n] == n for n in compute):  # nothing merged: the fx order is topological
        return _singletons(g, compute)
    quotient = nx.DiGraph()
    quotient.add_nodes_from(set(group.values()))
    for u, v in g.edges():
        if u in group and v in group and group[u] != group[v]:
            quotient.add_edge(group[u], group[v])
    condensed = nx.condensation(quotient)
    scc_of = condensed.graph["mapping"]
    first_index: dict[int, int] = {}
    for n in compute:
        first_index.setdefault(scc_of[group[n]], index[n])
    order = sorted(first_index, key=lambda s: first_index[s])
    renumber = {s: k for k, s in enumerate(_stable_topo(condensed, order))}
    unit_of = {n: renumber[scc_of[group[n]]] for n in compute}
    return _assemble(g, compute, unit_of, renumber, condensed)


def _singletons(g: nx.DiGraph, compute: list[str]) -> Units:
    unit_of = {n: k for k, n in enumerate(compute)}
    dag = nx.DiGraph()
    dag.add_nodes_from(range(len(compute)))
    dag.add_edges_from(
        (unit_of[u], unit_of[v]) for u, v in g.edges() if u in unit_of and v in unit_of
    )
    return _assemble(g, compute, unit_of, {k: k for k in range(len(compute))}, dag)


def _assemble(
    g: nx.DiGraph,
    compute: list[str],
    unit_of: dict[str, int],
    renumber: dict[int, int],
    condensed: nx.DiGraph,
) -> Units:
    num = len(renumber)
    members: list[list[str]] = [[] for _ in range(num)]
    weight = np.zeros(num)
    for n in compute:
        members[unit_of[n]].append(n)
        weight[unit_of[n]] += g.nodes[n]["weight"]
    for n, op in g.nodes(data="op"):
        if op == "get_attr":
            readers = [unit_of[v] for v in g.successors(n) if v in unit_of]
            if readers:
                weight[min(readers)] += g.nodes[n]["weight"]
    dag = nx.DiGraph()
    dag.add_nodes_from(range(num))
    dag.add_edges_from((renumber[a], renumber[b]) for a, b in condensed.edges())
    pinned = frozenset(
        unit_of[v]
        for n, op in g.nodes(data="op")
        if op == "placeholder"
        for v in g.successors(n)
        if v in unit_of and not g.edges[n, v]["is_tensor"]
    )
    return Units(dag, unit_of, tuple(tuple(m) for m in members), weight, pinned)


def _stable_topo(dag: nx.DiGraph, preferred: list[int]) -> list[int]:
    """A topological order of ``dag`` that follows ``preferred`` wherever it can."""
    rank = {s: k for k, s in enumerate(preferred)}
    return list(nx.lexicographical_topological_sort(dag, key=rank.__getitem__))


def _find(parent: dict[str, str], n: str) -> str:
    while parent[n] != n:
        parent[n] = parent[parent[n]]
        n = parent[n]
    return n


def _union(parent: dict[str, str], a: str, b: str) -> None:
    ra, rb = _find(parent, a), _find(parent, b)
    if ra != rb:
        parent[rb] = ra
