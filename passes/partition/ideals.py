"""The exact optimum over every convex split of a small DAG (the ideal-lattice DP).

A split of a DAG into K ordered stages with all edges going forward is a chain of
*ideals* (sets closed under predecessors) ``{} < I1 < ... < IK = V``; stage k is
``Ik - Ik-1``. With ``f_k(I)`` the best bottleneck of ideal ``I`` in k stages,
``f_k(I) = min over J < I of max(f_{k-1}(J), W(I) - W(J))``. Dense numpy over all ideal
pairs: O(K I^2) time and O(I^2) memory, so it is for DAGs with at most a few thousand
ideals (chains and near-chains; wide branching makes the count explode).

Per stage position k the stage value may be a time (``W(I) - W(J)`` over the speed of
stage k's device) or any table ``value_k[I, J]`` (memory over a budget, say), and a table
``allowed_k[I, J]`` may rule stages out (one whose memory exceeds its budget): the
recursion is the same, so the search stays exact under both.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import networkx as nx
import numpy as np

__all__ = ["enumerate_ideals", "ideal_split", "ideal_stages"]

_INF = float("inf")


def enumerate_ideals(dag: nx.DiGraph, limit: int) -> np.ndarray | None:
    """All ideals of ``dag`` (nodes 0..U-1) as a boolean matrix, one row per ideal ordered
    by size; ``None`` when there are more than ``limit``."""
    num = dag.number_of_nodes()
    if num + 1 > limit:  # every DAG has at least num + 1 ideals
        return None
    preds = [sum(1 << p for p in dag.predecessors(v)) for v in range(num)]
    succs = [list(dag.successors(v)) for v in range(num)]
    sources = [v for v in range(num) if not preds[v]]
    # Each ideal is grown by the nodes whose predecessors it holds ("ready" nodes); adding
    # v can only make v's successors ready, so the ready list is updated, not recomputed.
    frontier: list[tuple[int, tuple[int, ...]]] = [(0, tuple(sources))]
    seen = {0}
    while frontier:
        nxt = []
        for ideal, ready in frontier:
            for v in ready:
                grown = ideal | (1 << v)
                if grown in seen:
                    continue
                seen.add(grown)
                more = [u for u in succs[v] if preds[u] & ~grown == 0]
                nxt.append((grown, tuple(u for u in ready if u != v) + tuple(more)))
            if len(seen) > limit:
                return None
        frontier = nxt
    rows = sorted(seen, key=lambda m: (m.bit_count(), m))
    width = max(1, (num + 7) // 8)
    packed = np.frombuffer(b"".join(m.to_bytes(width, "little") for m in rows), dtype=np.uint8)
    bits = np.unpackbits(packed.reshape(len(rows), width), axis=1, bitorder="little")
    return bits[:, :num].astype(bool)


def ideal_split(
    ideals: np.ndarray,
    weight: np.ndarray,
    num_stages: int,
    *,
    required_first: Sequence[int] = (),
    border_bytes: np.ndarray | None = None,
    cap: float | None = None,
    balance: float = 0.0,
    speeds: np.ndarray | None = None,
    allowed: Callable[[int], np.ndarray] | None = None,
    stage_value: Callable[[int], np.ndarray] | None = None,
    stage_sum: Callable[[int], np.ndarray] | None = None,
) -> tuple[float, list[int]]:
    """Best split into ``num_stages`` non-empty stages as the row indices of the interior
    ideals (increasing). Every stage's units ``required_first`` must be in the first stage.
    The value is inf (and the rows meaningless) when no split qualifies.

    A stage's value is its cost ``W(I) - W(J)``, divided by ``speeds[j]`` at position j
    when given, or ``stage_value(j)[I, J]`` when that is given. ``allowed(j)[I, J]`` False
    rules stage ``I - J`` out of position j. With ``cap``, ``stage_sum(j)[I, J]`` is added
    to the summed objective for stage ``I - J`` at position j (its memory, say).

    Without ``cap`` this minimises the bottleneck. With ``cap`` and ``border_bytes`` it
    minimises the summed bytes over splits whose stages all cost at most ``cap``; the
    returned number is then those bytes. ``border_bytes[J]`` prices a border after ideal J
    (bytes leaving J); ``border_bytes[I, J]`` prices the stage ``I - J`` (bytes entering it).
    ``balance`` adds ``balance * cost**2`` per stage to that sum: a small one breaks ties
    between splits that send the same bytes in favour of the more even one.
    """
    count = len(ideals)
    w = ideals.astype(np.float64) @ weight
    sub = _strict_subsets(ideals)
    start: np.ndarray = np.ones(count, dtype=bool)
    if len(required_first):
        start = np.asarray(ideals[:, list(required_first)].all(axis=1))
    start[0] = False  # the empty ideal ends no stage

    def value(j: int) -> np.ndarray:
        if stage_value is not None:
            return stage_value(j)
        stage = w[:, None] - w[None, :]
        return stage if speeds is None else np.asarray(stage / speeds[j])

    first = w if stage_value is None and speeds is None else value(0)[:, 0]
    if allowed is not None:
        start = start & allowed(0)[:, 0]
    if cap is None:
        f = np.where(start, first, _INF)
    else:
        f = np.where(start & (first <= cap), balance * first**2, _INF)
        if stage_sum is not None:
            f = f + stage_sum(0)[:, 0]
    choice = []
    for j in range(1, num_stages):
        stage = value(j)
        if cap is None:
            cand = np.maximum(f[None, :], stage)
        else:
            extra = np.zeros(count) if border_bytes is None else border_bytes
            priced = f[None, :] + (extra if extra.ndim == 2 else extra[None, :])
            if balance:
                priced = priced + balance * stage**2
            if stage_sum is not None:
                priced = priced + stage_sum(j)
            cand = np.where(stage <= cap, priced, _INF)
        if allowed is not None:
            cand = np.where(allowed(j), cand, _INF)
        cand = np.where(sub, cand, _INF)
        arg = cand.argmin(axis=1)
        f = cand[np.arange(count), arg]
        choice.append(arg)
    full = count - 1
    borders, row = [], full
    for arg in reversed(choice):
        row = int(arg[row])
        borders.append(row)
    return float(f[full]), borders[::-1]


def ideal_stages(ideals: np.ndarray, rows: Sequence[int]) -> np.ndarray:
    """The stage of every node of the split whose interior ideals are ``rows`` (as
    :func:`ideal_split` returns them): the number of those ideals not holding the node."""
    stage: np.ndarray = np.zeros(ideals.shape[1], dtype=np.int64)
    for row in rows:
        stage += ~ideals[row]
    return stage


def _strict_subsets(ideals: np.ndarray) -> np.ndarray:
    """``sub[i, j]``: ideal j is a strict subset of ideal i (kept for the last ideals asked
    about: searches under memory limits split the same ideals many times)."""
    last = _LAST_SUBSETS.get("ideals")
    if last is not None and last[0] is ideals:
        return last[1]
    a = ideals.astype(np.float32)
    outside = a @ (1.0 - a).T  # outside[j, i] = |J - I|
    sizes = ideals.sum(axis=1)
    sub = np.asarray((outside.T == 0) & (sizes[None, :] < sizes[:, None]))
    _LAST_SUBSETS["ideals"] = (ideals, sub)
    return sub


_LAST_SUBSETS: dict[str, tuple[np.ndarray, np.ndarray]] = {}
