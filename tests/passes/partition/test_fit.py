"""Device speeds in the searches: the exact search, the order search and the solvers of one
order (``chain_dp`` and ``fit.order_split``) against brute force, each stage's time being its
cost over its device's speed."""

from __future__ import annotations

import itertools
import random
from typing import Any

import numpy as np
import pytest
from dags import all_valid_splits, brute_time, check_valid, random_dag

from fxpipe.passes.partition.chain_dp import min_bytes_split, min_max_split
from fxpipe.passes.partition.fit import order_split
from fxpipe.passes.partition.search import partition_graph

pytestmark = pytest.mark.usefixtures("one_thread")

INF = float("inf")


def _small_cases(count: int, seed: int) -> list[Any]:
    rng = random.Random(seed)
    out = []
    for i in range(count):
        n = rng.randint(2, 8)
        k = rng.randint(2, min(4, n))
        density = rng.choice([0.15, 0.35, 0.6])
        out.append(pytest.param(n, k, density, seed * 1000 + i, id=f"n{n}-k{k}-{i}"))
    return out


@pytest.mark.parametrize("n, k, density, seed", _small_cases(30, 7))
def test_speeds_against_brute_force(n: int, k: int, density: float, seed: int) -> None:
    rng = random.Random(seed)
    g = random_dag(rng, n, density)
    speeds = [rng.choice([0.5, 1.0, 2.0, 3.0]) for _ in range(k)]
    valid = all_valid_splits(g, k)
    best = min(brute_time(g, s, speeds) for s in valid)
    exact = partition_graph(g, k, speed=speeds)
    assert exact.method == "ideals"
    check_valid(g, exact.stage_of, k)
    assert exact.bottleneck == pytest.approx(brute_time(g, exact.stage_of, speeds))
    assert exact.bottleneck == pytest.approx(best, rel=1e-9)
    orders = partition_graph(g, k, speed=speeds, exact_limit=0)
    check_valid(g, orders.stage_of, k)
    assert orders.bottleneck == pytest.approx(brute_time(g, orders.stage_of, speeds))
    assert orders.bottleneck >= best * (1 - 1e-9)
    chain = random_dag(rng, n, density, chain=True)
    best_chain = min(brute_time(chain, s, speeds) for s in all_valid_splits(chain, k))
    on_chain = partition_graph(chain, k, speed=speeds, exact_limit=0, window_limit=0)
    assert on_chain.bottleneck == pytest.approx(best_chain, rel=1e-9)


@pytest.mark.slow
def test_speeds_of_one_change_nothing() -> None:
    rng = random.Random(3)
    for _ in range(10):
        g = random_dag(rng, 30, 0.1)
        for exact_limit in (1500, 0):
            plain = partition_graph(g, 4, exact_limit=exact_limit, slack=0.1)
            ones = partition_graph(g, 4, exact_limit=exact_limit, slack=0.1, speed=[1.0] * 4)
            assert (plain.stage_of, plain.bottleneck) == (ones.stage_of, ones.bottleneck)


def _borders(n: int, k: int, first_cut: int) -> list[tuple[int, ...]]:
    return list(itertools.combinations(range(max(first_cut, 1), n), k - 1))


def _times(w: np.ndarray, borders: tuple[int, ...], speeds: np.ndarray) -> list[float]:
    edges = [0, *borders, len(w)]
    return [float(w[a:b].sum()) / v for a, b, v in zip(edges, edges[1:], speeds)]


@pytest.mark.parametrize("seed", range(5))
def test_order_solvers_with_speeds_against_brute_force(seed: int) -> None:
    rng = np.random.default_rng(seed)
    for _ in range(40):
        n, k = int(rng.integers(1, 11)), int(rng.integers(1, 5))
        first_cut = int(rng.integers(0, 3))
        w = rng.integers(0, 9, n).astype(np.float64)
        cut = rng.integers(0, 50, n + 1).astype(np.float64)
        speeds = rng.choice([0.5, 1.0, 2.0, 4.0], k)
        splits = _borders(n, k, first_cut)
        best = min((max(_times(w, b, speeds)) for b in splits), default=INF)
        value, borders = min_max_split(w, k, first_cut=first_cut, speeds=speeds)
        assert value == pytest.approx(best)
        same, _ = order_split(w, k, first_cut=first_cut, speeds=speeds)
        assert same == pytest.approx(best)
        ones = min_max_split(w, k, first_cut=first_cut, speeds=np.ones(k))
        assert ones == min_max_split(w, k, first_cut=first_cut)  # bit for bit
        if np.isfinite(best):
            assert max(_times(w, tuple(borders), speeds)) == pytest.approx(best)
            cap = best * 1.3
            fewest = min(
                float(sum(cut[c] for c in b)) for b in splits if max(_times(w, b, speeds)) <= cap
            )
            moved, _ = min_bytes_split(w, cut, k, cap, first_cut=first_cut, speeds=speeds)
            assert moved == fewest
            moved, _ = order_split(
                w, k, first_cut=first_cut, speeds=speeds, objective="bytes", cut_bytes=cut,
                cap=cap,
            )  # fmt: skip
            assert moved == fewest
