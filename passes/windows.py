"""Coarsens the unit DAG around the borders of a split, so that the exact search fits.

When the unit DAG has too many ideals for the exact search, the order search finds a good
split. Its borders can still be placed exactly within *windows*: the last units of each
stage and the first units of the next stay free, and the rest of each stage (its interior,
which is convex, so contracting it keeps the DAG acyclic) becomes one unit. Every split of
the coarse DAG is a valid split of the fine one, and the split it was built from is among
them, so the exact search on it can only do better.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import networkx as nx
import numpy as np

from fxpipe.passes.ideals import enumerate_ideals
from fxpipe.passes.units import Units

__all__ = ["coarsen_near_borders", "coarsen"]


def coarsen_near_borders(
    units: Units, unit_stage: np.ndarray, k: int, limit: int
) -> tuple[Units, np.ndarray, np.ndarray] | None:
    """The coarse units with the widest windows (doubling the free units per side) whose
    DAG has at most ``limit`` ideals: (coarse units, fine unit -> coarse unit, its ideals).
    ``None`` when even one free unit on each side of every border gives too many."""
    found = None
    width = 1
    largest = int(np.bincount(unit_stage, minlength=k).max())
    while width <= largest:
        coarse, of_unit = coarsen(units, unit_stage, k, width)
        ideals = enumerate_ideals(coarse.dag, limit)
        if ideals is None:
            break
        found = (coarse, of_unit, ideals)
        if coarse.num_units == units.num_units:
            break  # every unit is free already
        width *= 2
    return found


def coarsen(units: Units, unit_stage: np.ndarray, k: int, width: int) -> tuple[Units, np.ndarray]:
    """Contract each stage's interior, leaving up to ``width`` units free on each side of
    every border: the tail of stage j (closed under successors in j) and the head of stage
    j + 1 (closed under predecessors in j + 1). Returns the coarse units and, for every
    fine unit, its coarse unit."""
    dag = units.dag
    free = np.zeros(units.num_units, dtype=bool)
    for j in range(k):
        ids = np.flatnonzero(unit_stage == j)  # ascending ids: a topological order
        if j + 1 < k:
            free[_closed(ids[::-1], dag.successors, unit_stage, j, width)] = True
        if j > 0:
            free[_closed(ids, dag.predecessors, unit_stage, j, width)] = True
    group = [("free", u) if free[u] else ("stage", int(unit_stage[u])) for u in range(len(free))]
    first: dict[tuple[str, int], int] = {}
    for u, key in enumerate(group):
        first.setdefault(key, u)
    quotient = nx.DiGraph()
    quotient.add_nodes_from(first)
    quotient.add_edges_from((group[a], group[b]) for a, b in dag.edges if group[a] != group[b])
    order = nx.lexicographical_topological_sort(quotient, key=first.__getitem__)
    coarse_id = {key: c for c, key in enumerate(order)}
    of_unit = np.array([coarse_id[key] for key in group], dtype=np.int64)
    return _coarse_units(units, of_unit, len(coarse_id)), of_unit


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


def _coarse_units(units: Units, of_unit: np.ndarray, count: int) -> Units:
    members: list[list[str]] = [[] for _ in range(count)]
    for u, names in enumerate(units.members):
        members[of_unit[u]].extend(names)
    dag = nx.DiGraph()
    dag.add_nodes_from(range(count))
    dag.add_edges_from(
        (int(of_unit[a]), int(of_unit[b])) for a, b in units.dag.edges if of_unit[a] != of_unit[b]
    )
    return Units(
        dag=dag,
        unit_of={n: int(of_unit[u]) for n, u in units.unit_of.items()},
        members=tuple(tuple(m) for m in members),
        weight=np.bincount(of_unit, weights=units.weight, minlength=count),
        pinned_first=frozenset(int(of_unit[u]) for u in units.pinned_first),
    )
