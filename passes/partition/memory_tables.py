"""The memory tables the searches read: per split, per ideal pair, per segment of an order.

They count :mod:`fxpipe.passes.partition.memory`'s estimate, term for term; that module says
what the terms, the spread items and the received values are.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import networkx as nx
import numpy as np

from fxpipe.ir import LEAST_RECOMPUTATION_FIRST, Checkpoints
from fxpipe.passes.partition.memory import (
    FIRST_READER,
    FIRST_STAGE,
    LAST_STAGE,
    MODEL_INPUT,
    PARAM_COPIES,
    Entering,
    MemoryModel,
    Spread,
    memory_terms,
    param_copies,
    received_on_ideals,
    stage_mode,
    whole_coef,
)

__all__ = [
    "UnitMemory",
    "IdealMemory",
    "OrderMemory",
    "unit_memory",
]


@dataclass(frozen=True)
class UnitMemory:
    """Memory of any stage of a unit DAG split into ``k`` stages."""

    k: int
    chunks: int
    #: One checkpoint mode for every stage, or one per stage position.
    checkpoint: Checkpoints
    #: Parameter bytes held by one unit only, per unit.
    param_add: np.ndarray
    #: Saved bytes of one unit only, per unit.
    saved_add: np.ndarray
    spread: tuple[Spread, ...] = ()
    values: tuple[Entering, ...] = ()
    #: Activation bytes (saved and received) are multiplied by this (a smaller batch).
    activations: float = 1.0
    #: Training memory (else inference: weights once, one micro-batch in flight).
    training: bool = True
    #: The per-ideal-pair tables already made, by the ideals (and coefficients) they were
    #: made for; the raw bytes do not depend on ``k``, ``chunks``, ``checkpoint`` or
    #: ``activations``, so copies made by ``dataclasses.replace`` share them.
    _tables: dict[tuple[Any, ...], tuple[np.ndarray, IdealMemory]] = field(
        default_factory=dict, compare=False, repr=False
    )

    @property
    def num_units(self) -> int:
        return len(self.param_add)

    def coefficients(self) -> tuple[np.ndarray, np.ndarray]:
        """(saved_coef, input_coef) of each stage position."""
        k, training = self.k, self.training
        checkpoint = self.checkpoint
        if not isinstance(checkpoint, str) and len(checkpoint) != k:  # a what-if of other k:
            checkpoint = max(
                checkpoint, key=LEAST_RECOMPUTATION_FIRST.index
            )  # the most recomputing mode
        terms = [
            memory_terms(
                self.chunks, stage_mode(checkpoint, j), last=j == k - 1, training=training
            )
            for j in range(k)
        ]
        saved = np.array([s for s, _ in terms]) * self.activations
        inputs = np.array([i for _, i in terms]) * self.activations
        return saved, inputs

    # ------------------------------------------------------------------ one split

    @property
    def copies(self) -> int:
        """Copies of each parameter a stage holds."""
        return param_copies(self.training)

    def parts(self, unit_stage: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(parameter bytes x copies, activation bytes) of each stage of ``unit_stage``."""
        k = self.k
        params = np.bincount(unit_stage, weights=self.param_add, minlength=k)
        saved = np.bincount(unit_stage, weights=self.saved_add, minlength=k)
        for item in self.spread:
            for j in {self._holder_stage(h, unit_stage) for h in item.holders}:
                if item.param:
                    params[j] += item.bytes
                else:
                    saved[j] += item.bytes
        received, whole = np.zeros(k), np.zeros(k)
        for v in self.values:
            reading = {int(unit_stage[r]) for r in v.readers}
            if v.to_output:
                reading.add(k - 1)
            if v.producer == MODEL_INPUT:
                made = 0
            elif v.producer == FIRST_READER:
                made = min(int(unit_stage[r]) for r in v.readers)
            else:
                made = int(unit_stage[v.producer])
            for j in reading - {made}:
                (received if v.batched else whole)[j] += v.bytes
        saved_coef, input_coef = self.coefficients()
        fixed = whole_coef(self.training) * whole
        return self.copies * params, saved_coef * saved + input_coef * received + fixed

    def stage_bytes(self, unit_stage: np.ndarray) -> np.ndarray:
        """Estimated memory of each stage of ``unit_stage`` (stage ids 0..k-1)."""
        params, activations = self.parts(unit_stage)
        return np.asarray(params + activations)

    def _holder_stage(self, holder: tuple[int, ...], unit_stage: np.ndarray) -> int:
        if holder == (FIRST_STAGE,):
            return 0
        if holder == (LAST_STAGE,):
            return self.k - 1
        return min(int(unit_stage[u]) for u in holder)

    # ------------------------------------------------------------------ coarser units

    def coarsen(self, of_unit: np.ndarray, values: Iterable[Entering]) -> UnitMemory:
        """The same memory on coarse units (``of_unit[u]``: the coarse unit of unit u);
        ``values``: the received values seen on the coarse units."""
        count = int(of_unit.max()) + 1 if len(of_unit) else 0
        param_add = np.bincount(of_unit, weights=self.param_add, minlength=count)
        saved_add = np.bincount(of_unit, weights=self.saved_add, minlength=count)
        spread = []
        for item in self.spread:
            holders = tuple(
                sorted({h if h[0] < 0 else tuple(sorted({int(of_unit[u]) for u in h}))
                        for h in item.holders})
            )  # fmt: skip
            if len(holders) == 1 and len(holders[0]) == 1 and holders[0][0] >= 0:
                target = param_add if item.param else saved_add
                target[holders[0][0]] += item.bytes
            else:
                spread.append(Spread(item.bytes, item.param, holders))
        return UnitMemory(
            self.k,
            self.chunks,
            self.checkpoint,
            param_add,
            saved_add,
            tuple(spread),
            tuple(values),
            self.activations,
            self.training,
        )

    # ------------------------------------------------------------------ ideals

    def on_ideals(self, ideals: np.ndarray) -> IdealMemory:
        """The memory of every stage ``I - J`` of the ideals (rows ordered by size, as
        :func:`fxpipe.passes.partition.ideals.enumerate_ideals` returns them)."""
        saved_coef, input_coef = self.coefficients()
        key = (id(ideals), tuple(saved_coef), tuple(input_coef), self.copies)
        cached = self._tables.get(key)
        if cached is not None and cached[0] is ideals:
            return cached[1]
        base = self._tables.get((id(ideals),))
        if base is None or base[0] is not ideals:
            self._tables.clear()
            params, saved, received, whole = self._ideal_tables(ideals)
            base = (ideals, IdealMemory(params, saved, received, saved_coef, input_coef,
                                        len(ideals), whole))  # fmt: skip
            self._tables[(id(ideals),)] = base
        raw = base[1]
        table = IdealMemory(
            self.copies * raw.params, raw.saved, raw.received, saved_coef, input_coef, raw.count,
            whole_coef(self.training) * raw.whole,
        )  # fmt: skip
        self._tables[key] = (ideals, table)
        return table

    def _ideal_tables(
        self, ideals: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Parameter, saved, received (cut with the batch) and received whole bytes of every
        stage ``I - J``."""
        rows = ideals.astype(np.float64)
        p_in, s_in = rows @ self.param_add, rows @ self.saved_add
        params = p_in[:, None] - p_in[None, :]
        saved = s_in[:, None] - s_in[None, :]
        for item in self.spread:
            marks = np.stack([self._holder_in(h, ideals) for h in item.holders], axis=1)
            _, pattern = np.unique(marks, axis=0, return_inverse=True)
            pattern = pattern.reshape(-1)
            held = pattern[:, None] != pattern[None, :]  # some holder starts in I - J
            (params if item.param else saved)[...] += item.bytes * held
        batched = [v for v in self.values if v.batched]
        whole = [v for v in self.values if not v.batched]
        return (
            params,
            saved,
            received_on_ideals(ideals, batched, _held_in),
            received_on_ideals(ideals, whole, _held_in),
        )

    @staticmethod
    def _holder_in(holder: tuple[int, ...], ideals: np.ndarray) -> np.ndarray:
        """Which ideals hold the first unit of ``holder`` (any of its units)."""
        count = len(ideals)
        if holder == (FIRST_STAGE,):
            return np.asarray(np.arange(count) > 0)  # row 0 is the empty ideal
        if holder == (LAST_STAGE,):
            return np.asarray(np.arange(count) == count - 1)  # the last row is the full one
        return np.asarray(ideals[:, list(holder)].any(axis=1))

    # ------------------------------------------------------------------ one order

    def on_order(self, order: Sequence[int]) -> OrderMemory:
        """The memory of every segment of ``order`` (a topological order of the units)."""
        num = len(order)
        position = np.empty(self.num_units, dtype=np.int64)
        position[np.asarray(order, dtype=np.int64)] = np.arange(num)
        events: list[list[tuple[int, int, float]]] = [[] for _ in range(num)]
        for item in self.spread:
            kind = 0 if item.param else 1
            firsts = sorted({self._holder_position(h, position, num) for h in item.holders})
            before = -1
            for q in firsts:
                events[q].append((kind, before, float(item.bytes)))
                before = q
        for v in self.values:
            reads = {int(position[r]) for r in v.readers}
            if v.to_output:
                reads.add(num - 1)
            if v.producer == MODEL_INPUT:
                made = 0  # in the stage that starts at 0: received by any later one
            elif v.producer == FIRST_READER:
                made = min(int(position[r]) for r in v.readers)
            else:
                made = int(position[v.producer])
            before = made
            kind = 2 if v.batched else 3
            for r in sorted(p for p in reads if p > made):
                events[r].append((kind, before, float(v.bytes)))
                before = r
        order_array = np.asarray(order, dtype=np.int64)
        params = np.concatenate([[0.0], np.cumsum(self.param_add[order_array])])
        saved = np.concatenate([[0.0], np.cumsum(self.saved_add[order_array])])
        saved_coef, input_coef = self.coefficients()
        return OrderMemory(
            self.copies * params, saved, events, saved_coef, input_coef, copies=self.copies,
            whole=whole_coef(self.training),
        )  # fmt: skip

    def _holder_position(self, holder: tuple[int, ...], position: np.ndarray, num: int) -> int:
        if holder == (FIRST_STAGE,):
            return 0
        if holder == (LAST_STAGE,):
            return num - 1
        return min(int(position[u]) for u in holder)


@dataclass(frozen=True)
class IdealMemory:
    """Memory of stage ``I - J`` for every pair of ideals (J a subset of I)."""

    #: Copies x parameter bytes, saved bytes and received bytes, each [I, J].
    params: np.ndarray
    saved: np.ndarray
    received: np.ndarray
    saved_coef: np.ndarray
    input_coef: np.ndarray
    count: int
    #: Received whole values (not cut with the batch) x their copies, [I, J].
    whole: np.ndarray

    _stages: dict[tuple[float, float], np.ndarray] = field(
        default_factory=dict, compare=False, repr=False
    )

    def stage(self, j: int) -> np.ndarray:
        """``out[I, J]``: the memory of stage ``I - J`` at position j (do not modify it)."""
        key = (float(self.saved_coef[j]), float(self.input_coef[j]))
        if key not in self._stages:
            self._stages[key] = np.asarray(
                self.params + key[0] * self.saved + key[1] * self.received + self.whole
            )
        return self._stages[key]


class OrderMemory:
    """Memory of every segment ``[s, t)`` of one order, swept by segment end ``t``.

    Call :meth:`advance` with t = 1, 2, ..., N in turn; then :meth:`stage` gives the memory
    of ``[s, t)`` for a range of starts s. The spread and received bytes of every start are
    kept in vectors, updated as each item joins the segment's end."""

    def __init__(
        self,
        params: np.ndarray,
        saved: np.ndarray,
        events: list[list[tuple[int, int, float]]],
        saved_coef: np.ndarray,
        input_coef: np.ndarray,
        *,
        copies: int = PARAM_COPIES,
        whole: float = 2.0,
    ) -> None:
        num = len(events)
        self.prefix_params = params  # copies x prefix sums of the one-unit bytes
        self.copies = copies
        self.whole = whole
        self.prefix_saved = saved
        self.saved_coef = saved_coef
        self.input_coef = input_coef
        self._events = events
        # spread params, spread saved, received, received whole
        self._vectors = np.zeros((4, num + 1))
        self._t = 0

    def reset(self) -> None:
        """Start a new sweep."""
        self._vectors[:] = 0.0
        self._t = 0

    def advance(self, t: int) -> None:
        """Add the item at position ``t - 1`` to the end of every segment."""
        if t != self._t + 1:
            raise ValueError(f"advance({t}) after advance({self._t}): sweep t = 1, 2, ...")
        self._t = t
        for kind, before, size in self._events[t - 1]:
            scale = self.copies if kind == 0 else self.whole if kind == 3 else 1
            self._vectors[kind, before + 1 : t] += size * scale

    def additive(self, j: int) -> np.ndarray:
        """The one-unit part of a segment's memory at position j, as prefix sums: the
        segment ``[s, t)`` holds at least ``out[t] - out[s]`` bytes."""
        return np.asarray(self.prefix_params + self.saved_coef[j] * self.prefix_saved)

    def stage(self, start: int, j: int, stop: int | None = None) -> np.ndarray:
        """Memory at position j of the segments ``[s, t)`` for s = start .. stop - 1
        (default: t - 1)."""
        t = self._t
        end = t if stop is None else stop
        params, saved, received, whole = self._vectors[:, start:end]
        p = self.prefix_params[t] - self.prefix_params[start:end] + params
        s = self.prefix_saved[t] - self.prefix_saved[start:end] + saved
        return np.asarray(p + self.saved_coef[j] * s + self.input_coef[j] * received + whole)


def _held_in(ideals: np.ndarray, v: Entering) -> np.ndarray:
    """Which ideals hold the stage that makes ``v``: a model input is the first stage's (no
    stage receives it from the empty ideal)."""
    if v.producer == MODEL_INPUT:
        return np.arange(len(ideals)) > 0
    if v.producer == FIRST_READER:
        return np.asarray(ideals[:, list(v.readers)].any(axis=1))
    return np.asarray(ideals[:, v.producer])


def unit_memory(
    model: MemoryModel,
    g: nx.DiGraph,
    unit_of: Mapping[str, int],
    num_units: int,
    values: Iterable[Entering],
) -> UnitMemory:
    """``model`` on the units of ``g`` (``unit_of``: compute node -> unit)."""
    param_add = np.zeros(num_units)
    saved_add = np.zeros(num_units)
    spread: list[Spread] = []

    def holder(name: str) -> tuple[int, ...]:
        if name in unit_of:
            return (unit_of[name],)
        op = g.nodes[name]["op"]
        if op == "get_attr":  # lives in the stage of its first reader
            readers = sorted({unit_of[v] for v in g.successors(name) if v in unit_of})
            if readers:
                return tuple(readers)
            if any(g.nodes[v]["op"] == "output" for v in g.successors(name)):
                return (LAST_STAGE,)
        return (LAST_STAGE,) if op == "output" else (FIRST_STAGE,)

    for name, size in model.saved.items():
        if name not in g:
            continue
        h = holder(name)
        if len(h) == 1 and h[0] >= 0:
            saved_add[h[0]] += size
        else:
            spread.append(Spread(size, False, (h,)))

    def holders_of(name: str) -> set[tuple[int, ...]]:
        if g.nodes[name]["op"] == "get_attr" and g.nodes[name].get("replicated", False):
            each: set[tuple[int, ...]] = {(u,) for u in holder(name) if u >= 0}  # each reader
            return each or {holder(name)}
        return {holder(name)}

    for size, names in model.params:
        holders = tuple(sorted(set().union(*(holders_of(n) for n in names if n in g))))
        if not holders:
            continue
        if len(holders) == 1 and len(holders[0]) == 1 and holders[0][0] >= 0:
            param_add[holders[0][0]] += size
        else:
            spread.append(Spread(size, True, holders))
    return UnitMemory(
        k=len(model.budgets),
        chunks=model.chunks,
        checkpoint=model.checkpoint,
        param_add=param_add,
        saved_add=saved_add,
        spread=tuple(spread),
        values=tuple(values),
        training=model.training,
    )
