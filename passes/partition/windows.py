"""Coarsens the unit DAG around the borders of a split, so that the exact search fits.

When the unit DAG has too many ideals for the exact search, the order search finds a good
split. Its borders can still be placed exactly within *windows*: the last units of each
stage and the first units of the next stay free, and the rest of each stage (its interior,
which is convex, so contracting it keeps the DAG acyclic) becomes one unit. Every split of
the coarse DAG is a valid split of the fine one, and the split it was built from is among
them, so the exact search on it can only do better. :func:`coarsen_values` maps the values
the search reads onto the coarse units.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import networkx as nx
import numpy as np

from fxpipe.passes.partition.ideals import enumerate_ideals
from fxpipe.passes.partition.memory import FIRST_READER, Entering
from fxpipe.passes.partition.units import Units

__all__ = ["coarsen_near_borders", "coarsen_values"]


def coarsen_near_borders(
    units: Units, unit_stage: np.ndarray, k: int, limit: int
) -> tuple[Units, np.ndarray, np.ndarray] | None:
    """The coarse units with the widest windows (doubling the free units per side) whose
    DAG has at most ``limit`` ideals: (coarse units, fine unit -> coarse unit, its ideals).
    ``None`` when even one free unit on each side of every border gives too many."""
    edges = np.array(list(units.dag.edges), dtype=np.int64).reshape(-1, 2)
    found = None
    width = 1
    largest = int(np.bincount(unit_stage, minlength=k).max())
    while width <= largest:
        of_unit, dag = _coarse_dag(units, edges, unit_stage, k, width)
        ideals = enumerate_ideals(dag, limit)
        if ideals is None:
            break
        found = (of_unit, dag, ideals)
        if dag.number_of_nodes() == units.num_units:
            break  # every unit is free already
        width *= 2
    if found is None:
        return None
    of_unit, dag, ideals = found
    return _coarse_units(units, of_unit, dag), of_unit, ideals


def _coarse_dag(
    units: Units, edges: np.ndarray, unit_stage: np.ndarray, k: int, width: int
) -> tuple[np.ndarray, nx.DiGraph]:
    """Fine unit -> coarse unit, and the coarse DAG (ids in a topological order)."""
    dag = units.dag
    free = np.zeros(units.num_units, dtype=bool)
    for j in range(k):
        ids = np.flatnonzero(unit_stage == j)  # ascending ids: a topological order
        if j + 1 < k:
            free[_closed(ids[::-1], dag.successors, unit_stage, j, width)] = True
        if j > 0:
            free[_closed(ids, dag.predecessors, unit_stage, j, width)] = True
    # one group per free unit, one per stage interior; numbered by first unit, then sorted
    key = np.where(free, np.arange(units.num_units), -1 - unit_stage)
    _, first, group = np.unique(key, return_index=True, return_inverse=True)
    pairs = np.unique(group[edges], axis=0) if len(edges) else np.zeros((0, 2), np.int64)
    pairs = pairs[pairs[:, 0] != pairs[:, 1]]
    quotient = nx.DiGraph()
    quotient.add_nodes_from(range(len(first)))
    quotient.add_edges_from(pairs.tolist())
    order = list(nx.lexicographical_topological_sort(quotient, key=lambda c: first[c]))
    renumber = np.empty(len(order), dtype=np.int64)
    renumber[order] = np.arange(len(order))
    coarse = nx.DiGraph()
    coarse.add_nodes_from(range(len(order)))
    coarse.add_edges_from(renumber[pairs].tolist())
    return renumber[group], coarse


def _closed(
    candidates: Iterable[int],
    neighbours: Callable[[int], Iterable[int]],
    unit_stage: np.ndarray,
    j: int,
    width: int,
) -> list[int]:
    """Up to ``width`` of ``candidates`` (visited neighbours first) whose neighbours in
    stage ``j`` are all taken too."""
    taken: set[int] = set()
    for u in candidates:
        if len(taken) >= width:
            break
        if all(v in taken for v in neighbours(int(u)) if unit_stage[v] == j):
            taken.add(int(u))
    return sorted(taken)


def _coarse_units(units: Units, of_unit: np.ndarray, dag: nx.DiGraph) -> Units:
    count = dag.number_of_nodes()
    members: list[list[str]] = [[] for _ in range(count)]
    for u, names in enumerate(units.members):
        members[of_unit[u]].extend(names)
    return Units(
        dag=dag,
        unit_of={n: int(of_unit[u]) for n, u in units.unit_of.items()},
        members=tuple(tuple(m) for m in members),
        weight=np.bincount(of_unit, weights=units.weight, minlength=count),
        pinned_first=frozenset(int(of_unit[u]) for u in units.pinned_first),
    )


def coarsen_values(values: list[Entering], of_unit: np.ndarray) -> list[Entering]:
    """``values`` seen on coarse units (``of_unit[u]``: the coarse unit of fine unit u): what
    :func:`fxpipe.passes.partition.search._values` returns for them, without walking the graph
    again."""
    out = []
    for v in values:
        producer = v.producer if v.producer < 0 else int(of_unit[v.producer])
        others = sorted({int(of_unit[r]) for r in v.readers} - {producer})
        lone_attr = producer == FIRST_READER and len(others) < 2
        if (others or v.to_output) and not lone_attr:
            out.append(Entering(v.bytes, producer, tuple(others), v.to_output, v.batched))
    return out
