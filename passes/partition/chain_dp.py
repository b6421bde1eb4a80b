"""Exact splits of one fixed order into K contiguous stages: min-max cost, then min bytes.

``w[u]`` is the cost of the u-th item of the order and ``cut_bytes[c]`` the bytes that
cross a border placed before item ``c`` (0 < c < N). Borders may only go at positions
``c >= first_cut``. Both solvers are exact for this order. With ``speeds``, stage j of a
split takes its cost divided by ``speeds[j]`` (the relative speed of its device); both
then work on those times.

Min-max (``min_max_split``): with ``f_k(t)`` the best bottleneck of the first ``t`` items
in ``k`` stages, ``f_k(t) = min_s max(f_{k-1}(s), S(t) - S(s))``. ``f_{k-1}`` and the
prefix sum ``S`` both grow with ``s``, so the best ``s`` is where ``f_{k-1}(s) + S(s)``
first reaches ``S(t)``: one ``searchsorted`` per stage count, O(K N log N) in all. With
speeds that differ, ``f_{k-1}`` need not grow with ``s`` (weights 1, 10, 1 on stages of
speed 1 and 0.5: two items need 20, three only 11), so every ``s`` is tried instead, a
block of targets at a time: O(K N^2), still exact.

Min bytes under a cap (``min_bytes_split``): ``g_k(t) = min_s g_{k-1}(s) + cut_bytes[s]``
over the window of ``s`` whose stage ``(s, t]`` costs at most the cap; a sparse table
answers all the window minima of one stage count at once.
"""

from __future__ import annotations

import numpy as np

__all__ = ["min_max_split", "min_bytes_split"]

_INF = float("inf")
#: Cells of the (targets x starts) table priced at once when every start is tried.
_BLOCK_CELLS = 1 << 20


def min_max_split(
    w: np.ndarray,
    num_stages: int,
    *,
    first_cut: int = 1,
    speeds: np.ndarray | None = None,
) -> tuple[float, list[int]]:
    """Smallest bottleneck over splits of ``w`` into ``num_stages`` non-empty stages, and the
    borders (positions, increasing) of one split that reaches it. ``speeds[j]``: stage j's
    cost is divided by it (None: all 1)."""
    n = len(w)
    s = np.concatenate([[0.0], np.cumsum(w)])
    speed = np.ones(num_stages) if speeds is None else np.asarray(speeds, dtype=np.float64)
    first_cut = max(first_cut, 1)
    if num_stages == 1:
        return float(s[n] / speed[0]), []
    if n - first_cut < num_stages - 1:
        return _INF, []
    # f[t] = best bottleneck of prefix t in k stages; only t >= first_cut may end a stage.
    f = np.where(np.arange(n + 1) >= first_cut, s / speed[0], _INF)
    step = _min_max_step if (speed == speed[0]).all() else _min_max_step_every_start
    choice = []
    for k in range(2, num_stages + 1):
        f, arg = step(f, s, k, first_cut, float(speed[k - 1]))
        choice.append(arg)
    borders, t = [], n
    for arg in reversed(choice):
        t = int(arg[t])
        borders.append(t)
    return float(f[n]), borders[::-1]


def _min_max_step(
    f: np.ndarray, s: np.ndarray, k: int, first_cut: int, speed: float = 1.0
) -> tuple[np.ndarray, np.ndarray]:
    n = len(s) - 1
    lo = first_cut + k - 2  # smallest prefix that k-1 stages can cover
    targets = np.arange(lo + 1, n + 1)
    h = speed * f[lo:] + s[lo:]
    h = np.maximum.accumulate(np.where(np.isfinite(h), h, _INF))
    pos = np.searchsorted(h, s[targets], side="left") + lo
    best = np.full(n + 1, _INF)
    arg = np.zeros(n + 1, dtype=np.int64)
    for cand in (pos - 1, pos):
        c = np.clip(cand, lo, targets - 1)
        value = np.maximum(f[c], (s[targets] - s[c]) / speed)
        better = value < best[targets]
        best[targets] = np.where(better, value, best[targets])
        arg[targets] = np.where(better, c, arg[targets])
    return best, arg


def _min_max_step_every_start(
    f: np.ndarray, s: np.ndarray, k: int, first_cut: int, speed: float
) -> tuple[np.ndarray, np.ndarray]:
    """:func:`_min_max_step` for an ``f`` that need not grow: every start ``s`` is tried."""
    n = len(s) - 1
    lo = first_cut + k - 2
    best = np.full(n + 1, _INF)
    arg = np.zeros(n + 1, dtype=np.int64)
    block = max(1, _BLOCK_CELLS // max(n, 1))
    for first in range(lo + 1, n + 1, block):
        targets = np.arange(first, min(first + block, n + 1))
        starts = np.arange(lo, targets[-1])
        value = np.maximum(f[starts][None, :], (s[targets][:, None] - s[starts][None, :]) / speed)
        value = np.where(starts[None, :] < targets[:, None], value, _INF)
        pick = value.argmin(axis=1)
        best[targets] = value[np.arange(len(targets)), pick]
        arg[targets] = starts[pick]
    return best, arg


def min_bytes_split(
    w: np.ndarray,
    cut_bytes: np.ndarray,
    num_stages: int,
    cap: float,
    *,
    first_cut: int = 1,
    speeds: np.ndarray | None = None,
) -> tuple[float, list[int]]:
    """Fewest total border bytes over splits whose every stage costs at most ``cap``
    (stage j's cost divided by ``speeds[j]``; None: all 1)."""
    n = len(w)
    s = np.concatenate([[0.0], np.cumsum(w)])
    speed = np.ones(num_stages) if speeds is None else np.asarray(speeds, dtype=np.float64)
    first_cut = max(first_cut, 1)
    # Stage costs are differences of prefix sums; forgive their rounding, not more.
    cap = cap + 8 * np.finfo(np.float64).eps * max(float(s[n]), abs(cap), 1e-300)
    if num_stages == 1:
        return (0.0, []) if s[n] <= cap * speed[0] else (_INF, [])
    g = np.where((np.arange(n + 1) >= first_cut) & (s <= cap * speed[0]), 0.0, _INF)
    g[0] = _INF
    choice = []
    for k in range(2, num_stages + 1):
        g, arg = _min_bytes_step(g, s, cut_bytes, cap * speed[k - 1], k, first_cut)
        choice.append(arg)
    if not np.isfinite(g[n]):
        return _INF, []
    borders, t = [], n
    for arg in reversed(choice):
        t = int(arg[t])
        borders.append(t)
    return float(g[n]), borders[::-1]


def _min_bytes_step(
    g: np.ndarray, s: np.ndarray, cut_bytes: np.ndarray, cap: float, k: int, first_cut: int
) -> tuple[np.ndarray, np.ndarray]:
    n = len(s) - 1
    a = g + cut_bytes
    a[: first_cut + k - 2] = _INF
    targets = np.arange(1, n + 1)
    left = np.searchsorted(s, s[targets] - cap, side="left")
    right = targets - 1
    ok = left <= right
    best = np.full(n + 1, _INF)
    arg = np.zeros(n + 1, dtype=np.int64)
    value, where = _range_min(a, left[ok], right[ok])
    best[targets[ok]] = value
    arg[targets[ok]] = where
    return best, arg


def _range_min(
    a: np.ndarray, left: np.ndarray, right: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Minimum and its position of ``a[left[q] : right[q] + 1]`` for every query q."""
    idx = [np.arange(len(a))]
    span = 1
    while 2 * span <= len(a):
        prev = idx[-1]
        nxt = prev.copy()
        nxt[: len(a) - span] = np.where(
            a[prev[span:]] < a[prev[: len(a) - span]], prev[span:], prev[: len(a) - span]
        )
        idx.append(nxt)
        span *= 2
    length = right - left + 1
    level = np.floor(np.log2(np.maximum(length, 1))).astype(np.int64)
    table = np.stack(idx)
    i1 = table[level, left]
    i2 = table[level, right - (1 << level) + 1]
    pick = np.where(a[i2] < a[i1], i2, i1)
    return a[pick], pick
