"""The ideals of a DAG (its predecessor-closed sets), which the exact search runs on: every
one listed, smallest first, and none past the limit."""

from __future__ import annotations

import itertools
import random

import networkx as nx
import pytest

from fxpipe.passes.partition.ideals import enumerate_ideals


@pytest.mark.parametrize("seed", range(8))
def test_enumerate_ideals_lists_every_predecessor_closed_set(seed: int) -> None:
    rng = random.Random(seed)
    n = rng.randint(1, 9)
    dag = nx.DiGraph()
    dag.add_nodes_from(range(n))
    dag.add_edges_from((i, j) for j in range(n) for i in range(j) if rng.random() < 0.3)
    closed = [
        frozenset(s)
        for r in range(n + 1)
        for s in itertools.combinations(range(n), r)
        if all(p in s for v in s for p in dag.predecessors(v))
    ]
    ideals = enumerate_ideals(dag, limit=10_000)
    assert ideals is not None and ideals.shape == (len(closed), n)
    rows = [frozenset(int(v) for v in row.nonzero()[0]) for row in ideals]
    assert sorted(rows, key=sorted) == sorted(closed, key=sorted)
    assert [len(r) for r in rows] == sorted(len(r) for r in rows)
    assert enumerate_ideals(dag, limit=len(closed) - 1) is None
