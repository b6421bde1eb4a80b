"""Border windows: coarse DAGs stay acyclic, keep the split they came from, and let the
order search reach the exact optimum when the windows cover the whole graph."""

from __future__ import annotations

import random

import networkx as nx
import numpy as np
import pytest
from dags import bottleneck, check_valid, random_dag
from helpers import coarsen, sweep

from fxpipe.passes.partition.chain_dp import min_max_split
from fxpipe.passes.partition.ideals import enumerate_ideals, ideal_split, ideal_stages
from fxpipe.passes.partition.search import EXACT_LIMIT, partition_graph
from fxpipe.passes.partition.units import Units, build_units
from fxpipe.passes.partition.windows import coarsen_near_borders, coarsen_values

CASES = [(seed, 6 + seed % 20, (2, 3, 4, 6)[seed % 4]) for seed in range(40)]


def _weighted_dag(seed: int, n: int) -> nx.DiGraph:
    rng = random.Random(seed)
    g = random_dag(rng, n, rng.choice([0.08, 0.15, 0.3]))
    for name, op in g.nodes(data="op"):
        if op == "call_function":
            g.nodes[name]["weight"] = rng.lognormvariate(0.0, 1.0)
    return g


def _split(units: Units, k: int) -> np.ndarray:
    """An exact split of the unit ids in order, the kind the order search hands over."""
    _, borders = min_max_split(units.weight, k)
    return np.searchsorted(np.array(borders), np.arange(units.num_units), side="right")


@pytest.mark.parametrize("seed, n, k", CASES)
def test_coarse_dag_is_acyclic_topological_and_keeps_the_split(seed: int, n: int, k: int) -> None:
    units = build_units(_weighted_dag(seed, n))
    if units.num_units < k:
        pytest.skip("fewer units than stages")
    stage = _split(units, k)
    for width in (1, 2, 4, 64):
        coarse, of_unit = coarsen(units, stage, k, width)
        assert nx.is_directed_acyclic_graph(coarse.dag)
        assert all(a < b for a, b in coarse.dag.edges)  # ids are a topological order
        assert np.isclose(coarse.weight.sum(), units.weight.sum())
        for c in range(coarse.num_units):  # a coarse unit never straddles a border
            assert len({int(stage[u]) for u in np.flatnonzero(of_unit == c)}) == 1
        # each stage keeps one interior at most: the rest of it is free, one unit each
        sizes = np.bincount(of_unit, minlength=coarse.num_units)
        assert sum(size > 1 for size in sizes) <= k


@pytest.mark.parametrize("seed, n, k", CASES)
def test_every_coarse_split_is_a_valid_fine_split(seed: int, n: int, k: int) -> None:
    g = _weighted_dag(seed, n)
    units = build_units(g)
    if units.num_units < k:
        pytest.skip("fewer units than stages")
    found = coarsen_near_borders(units, _split(units, k), k, limit=400)
    if found is None:  # only when the narrowest windows already have too many ideals
        narrow, _ = coarsen(units, _split(units, k), k, 1)
        assert enumerate_ideals(narrow.dag, 400) is None
        return
    coarse, of_unit, ideals = found
    best, rows = ideal_split(ideals, coarse.weight, k)
    fine = ideal_stages(ideals, rows)[of_unit]
    assert set(fine.tolist()) == set(range(k))
    assert all(fine[a] <= fine[b] for a, b in units.dag.edges)
    assert np.isclose(np.bincount(fine, weights=units.weight, minlength=k).max(), best)
    assert best <= np.bincount(_split(units, k), weights=units.weight, minlength=k).max() + 1e-9


def test_windows_grow_until_the_ideal_limit() -> None:
    units = build_units(_weighted_dag(3, 24))
    stage = _split(units, 3)
    small = coarsen_near_borders(units, stage, 3, limit=30)
    large = coarsen_near_borders(units, stage, 3, limit=10**6)
    assert small is not None and large is not None
    assert len(small[2]) <= 30
    assert large[0].num_units == units.num_units  # wide enough to free every unit
    every = enumerate_ideals(units.dag, 10**6)
    assert every is not None and len(large[2]) == len(every)


@pytest.mark.parametrize("seed, n, k", sweep(CASES, quick=4))
def test_order_search_with_windows(seed: int, n: int, k: int) -> None:
    g = _weighted_dag(seed, n)
    try:
        exact = partition_graph(g, k)
    except Exception:
        pytest.skip("fewer units than stages")
    plain = partition_graph(g, k, exact_limit=0, window_limit=0)
    windowed = partition_graph(g, k, exact_limit=0)
    whole = partition_graph(g, k, exact_limit=0, window_limit=EXACT_LIMIT)
    for part in (plain, windowed, whole):
        check_valid(g, part.stage_of, k)
        assert part.bottleneck == pytest.approx(bottleneck(g, part.stage_of, k))
    assert exact.bottleneck <= windowed.bottleneck + 1e-9
    assert windowed.bottleneck <= plain.bottleneck + 1e-9
    if exact.method == "ideals":  # few enough ideals: the windows grow over the whole DAG
        assert whole.bottleneck == pytest.approx(exact.bottleneck)


@pytest.mark.slow
def test_windows_again_around_the_new_borders_only_improve(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Windows re-placed around the borders the last windows found: never worse than one
    round of windows, and better on some random graphs."""
    import fxpipe.passes.partition.orders as order_search

    rounds: dict[int, list[float]] = {1: [], order_search.WINDOW_ROUNDS: []}
    for seed in range(40):
        for n, k in ((30, 4), (40, 6)):
            g = _weighted_dag(seed, n)
            for count in rounds:
                monkeypatch.setattr(order_search, "WINDOW_ROUNDS", count)
                part = partition_graph(g, k, exact_limit=0, window_limit=150)
                check_valid(g, part.stage_of, k)
                rounds[count].append(part.bottleneck)
    one, more = np.array(rounds[1]), np.array(rounds[max(rounds)])
    assert (more <= one + 1e-9).all()
    assert (more < one - 1e-9).sum() >= 3


@pytest.mark.parametrize("seed", range(0, 60, 6))
def test_values_mapped_onto_coarse_units_equal_values_read_from_the_graph(seed: int) -> None:
    """The order path maps the values it found on the fine units onto the windows' coarse
    units instead of walking the graph again; both must give the same values."""
    import fxpipe.passes.partition.search as partition

    def key(values: list) -> list:
        return sorted((v.bytes, v.producer, v.readers, v.to_output) for v in values)

    for s in range(seed, seed + 6):
        g = _weighted_dag(s, 30)
        units = build_units(g)
        for k in (2, 4):
            stage = _split(units, k)
            for traffic in ("direct", "relay"):
                fine = partition._values(g, units, traffic)
                for width in (1, 3):
                    coarse, of_unit = coarsen(units, stage, k, width)
                    mapped = coarsen_values(fine, of_unit)
                    assert key(mapped) == key(partition._values(g, coarse, traffic))
