"""Exact splits of one order: the DP solvers against brute force over every border set."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from helpers import stage_costs

from fxpipe.passes.partition.chain_dp import min_bytes_split, min_max_split

INF = float("inf")


def splits(n: int, k: int, first_cut: int) -> list[list[int]]:
    """Every border set of ``n`` items into ``k`` non-empty stages, borders >= first_cut."""
    return [list(b) for b in itertools.combinations(range(max(first_cut, 1), n), k - 1)]


def costs_of(w: np.ndarray, borders: list[int]) -> list[float]:
    edges = [0, *borders, len(w)]
    return [float(sum(w[a:b])) for a, b in zip(edges, edges[1:])]


def brute_min_max(w: np.ndarray, k: int, first_cut: int) -> float:
    return min((max(costs_of(w, b)) for b in splits(len(w), k, first_cut)), default=INF)


def brute_min_bytes(w: np.ndarray, cut: np.ndarray, k: int, cap: float, first_cut: int) -> float:
    ok = [b for b in splits(len(w), k, first_cut) if max(costs_of(w, b)) <= cap]
    return min((float(sum(cut[c] for c in b)) for b in ok), default=INF)


def check_borders(borders: list[int], n: int, k: int, first_cut: int) -> None:
    assert len(borders) == k - 1
    assert all(isinstance(b, int) for b in borders)
    assert borders == sorted(set(borders))
    if borders:
        assert borders[0] >= max(first_cut, 1) and borders[-1] < n


def random_cases(seed: int, count: int) -> list[tuple[np.ndarray, int, int]]:
    """Integer-valued weights (exact sums) with many zeros and ties; N <= 12, K <= 5."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        n = int(rng.integers(1, 13))
        k = int(rng.integers(1, 6))
        first_cut = int(rng.integers(0, 5))
        high = int(rng.choice([1, 2, 4, 10, 1000]))
        w = rng.integers(0, high + 1, n).astype(np.float64)
        if rng.random() < 0.2:
            w[:] = w[0]  # all equal
        out.append((w, k, first_cut))
    return out


@pytest.mark.parametrize("seed", range(6))
def test_min_max_split_equals_brute_force(seed: int) -> None:
    for w, k, first_cut in random_cases(seed, 120):
        value, borders = min_max_split(w, k, first_cut=first_cut)
        want = brute_min_max(w, k, first_cut)
        assert value == want, (w.tolist(), k, first_cut)
        if want == INF:
            assert borders == []
            continue
        check_borders(borders, len(w), k, first_cut)
        assert max(costs_of(w, borders)) == value
        assert stage_costs(w, borders) == costs_of(w, borders)


@pytest.mark.parametrize("seed", range(4))
def test_min_max_split_on_real_valued_weights(seed: int) -> None:
    rng = np.random.default_rng(100 + seed)
    for _ in range(100):
        n, k = int(rng.integers(1, 13)), int(rng.integers(1, 6))
        w = np.where(rng.random(n) < 0.25, 0.0, rng.random(n))
        first_cut = int(rng.integers(0, 4))
        value, borders = min_max_split(w, k, first_cut=first_cut)
        want = brute_min_max(w, k, first_cut)
        if want == INF:
            assert value == INF and borders == []
            continue
        assert value == pytest.approx(want, rel=1e-12, abs=1e-12)
        check_borders(borders, n, k, first_cut)
        assert max(stage_costs(w, borders)) == pytest.approx(value, rel=1e-12, abs=1e-12)


def test_min_max_split_edge_cases() -> None:
    w = np.array([3.0, 1.0, 2.0])
    assert min_max_split(w, 1) == (6.0, [])
    assert min_max_split(w, 3) == (3.0, [1, 2])
    assert min_max_split(w, 4)[0] == INF  # more stages than items
    assert min_max_split(w, 2, first_cut=3)[0] == INF  # no border position left
    value, borders = min_max_split(w, 2, first_cut=2)
    assert (value, borders) == (brute_min_max(w, 2, 2), [2])


@pytest.mark.parametrize("seed", range(6))
def test_min_bytes_split_equals_brute_force(seed: int) -> None:
    rng = np.random.default_rng(1000 + seed)
    for w, k, first_cut in random_cases(seed + 50, 120):
        n = len(w)
        cut = rng.integers(0, 6, n + 1).astype(np.float64)
        best = brute_min_max(w, k, first_cut)
        caps = [float(rng.integers(0, int(w.sum()) + 2))]
        if best < INF:
            caps += [best, best + 1.0]
        for cap in caps:
            value, borders = min_bytes_split(w, cut, k, cap, first_cut=first_cut)
            want = brute_min_bytes(w, cut, k, cap, first_cut)
            assert value == want, (w.tolist(), cut.tolist(), k, cap, first_cut)
            if want == INF:
                assert borders == []
                continue
            check_borders(borders, n, k, first_cut)
            assert max(costs_of(w, borders)) <= cap
            assert float(sum(cut[c] for c in borders)) == value


def test_min_bytes_split_accepts_the_min_max_value_as_cap() -> None:
    w = np.array([0.3, 0.7])
    best, borders = min_max_split(w, 2)
    assert (best, borders) == (0.7, [1]) and max(stage_costs(w, borders)) <= best
    value, found = min_bytes_split(w, np.zeros(3), 2, best)
    assert (value, found) == (0.0, [1])
