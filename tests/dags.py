"""Small random cost graphs and brute-force oracles for the partitioner's tests."""

from __future__ import annotations

import itertools
import random

import networkx as nx


def random_dag(rng: random.Random, n: int, density: float, *, chain: bool = False) -> nx.DiGraph:
    """``n`` compute nodes c0..c{n-1} (edges only forward), one placeholder source feeding
    the nodes without predecessors and one output sink fed by those without successors."""
    g = nx.DiGraph()
    names = [f"c{i}" for i in range(n)]

    def node(name: str, op: str, index: int, weight: float) -> None:
        g.add_node(
            name,
            op=op,
            index=index,
            weight=weight,
            bytes=rng.randint(1, 64),
            is_tensor=True,
            param_bytes=0,
            saved_bytes=0,
        )

    node("x", "placeholder", 0, 0.0)
    for i, name in enumerate(names):
        node(name, "call_function", i + 1, float(rng.choice([0, 0, 1, 2, 3, 5, 8, 13])))
    node("output", "output", n + 1, 0.0)
    for j in range(n):
        for i in range(j):
            if (i == j - 1) if chain else rng.random() < density:
                g.add_edge(names[i], names[j])
    for name in names:
        if g.in_degree(name) == 0:
            g.add_edge("x", name)
        if g.out_degree(name) == 0:
            g.add_edge(name, "output")
    for u, v in g.edges:
        g.edges[u, v].update(bytes=g.nodes[u]["bytes"], is_tensor=True)
    return g


def compute_nodes(g: nx.DiGraph) -> list[str]:
    return sorted((n for n, op in g.nodes(data="op") if op == "call_function"),
                  key=lambda n: g.nodes[n]["index"])  # fmt: skip


def all_valid_splits(g: nx.DiGraph, k: int) -> list[dict[str, int]]:
    """Every assignment of compute nodes to stages 0..k-1 with every stage non-empty and
    every edge going to an equal or later stage."""
    names = compute_nodes(g)
    out = []
    for stages in itertools.product(range(k), repeat=len(names)):
        if len(set(stages)) != k:
            continue
        st = dict(zip(names, stages))
        if all(st[u] <= st[v] for u, v in g.edges if u in st and v in st):
            out.append(st)
    return out


def bottleneck(g: nx.DiGraph, stage_of: dict[str, int], k: int) -> float:
    cost = [0.0] * k
    for name in compute_nodes(g):
        cost[stage_of[name]] += g.nodes[name]["weight"]
    return max(cost)


def brute_time(g: nx.DiGraph, stage_of: dict[str, int], speeds: list[float]) -> float:
    """The bottleneck of a split on devices of relative ``speeds``: the largest stage cost
    over its device's speed."""
    cost = [0.0] * len(speeds)
    for name in compute_nodes(g):
        cost[stage_of[name]] += g.nodes[name]["weight"]
    return max(c / v for c, v in zip(cost, speeds))


def relay_bytes(g: nx.DiGraph, stage_of: dict[str, int], k: int) -> float:
    """Bytes crossing every border: a value crosses each border between its producer's stage
    (0 for the model input) and its last reader's (k - 1 when the output reads it)."""
    total = 0.0
    for u, op in g.nodes(data="op"):
        if op == "output" or not g.out_degree(u):
            continue
        made = 0 if op == "placeholder" else stage_of[u]
        last = max(k - 1 if g.nodes[v]["op"] == "output" else stage_of[v] for v in g.successors(u))
        total += g.nodes[u]["bytes"] * (last - made)
    return total


def direct_bytes(g: nx.DiGraph, stage_of: dict[str, int], k: int) -> float:
    """Bytes sent straight from producer to readers: a value goes once to every other stage
    that reads it (a model output is returned by the stage that makes it)."""
    total = 0.0
    for u, op in g.nodes(data="op"):
        if op == "output" or not g.out_degree(u):
            continue
        made = 0 if op == "placeholder" else stage_of[u]
        reading = {stage_of[v] for v in g.successors(u) if g.nodes[v]["op"] != "output"}
        total += g.nodes[u]["bytes"] * len(reading - {made})
    return total


SENT = {"direct": direct_bytes, "relay": relay_bytes}


def check_valid(g: nx.DiGraph, stage_of: dict[str, int], k: int) -> None:
    assert set(stage_of) == set(g.nodes)
    assert {stage_of[n] for n in compute_nodes(g)} == set(range(k))
    assert all(stage_of[u] <= stage_of[v] for u, v in g.edges)
    assert stage_of["x"] == 0 and stage_of["output"] == k - 1
