"""Helpers only the tests (and the partition benchmark) use, kept out of the package.

Imported as ``helpers`` (tests/ is on sys.path; see conftest.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest
import torch

from fxpipe.passes.partition.units import Units
from fxpipe.passes.partition.windows import _coarse_dag, _coarse_units
from fxpipe.passes.tensor.cuts import Rules
from fxpipe.passes.tensor.layouts import follow
from fxpipe.passes.tensor.records import Layout
from fxpipe.passes.tensor.values import node_shapes
from fxpipe.runtime.checkpoint import Checkpointing
from fxpipe.runtime.worker import InQueue, OutQueue, WorkerPool


@contextmanager
def spawn_workers(
    devices: Sequence[torch.device | str | int],
) -> Iterator[tuple[list[InQueue], list[OutQueue]]]:
    """A :class:`WorkerPool` for one block: in/out queues aligned with ``devices``, and every
    thread stopped and joined on exit (also on an exception or KeyboardInterrupt)."""
    pool = WorkerPool()
    try:
        yield pool.queues(devices)
    finally:
        pool.close()


def checkpoint_stage(
    function: Callable[..., Sequence[Any]], *args: Any, device: torch.device | str = "cpu"
) -> Any:
    """``function(*args)``, checkpointed GPipe-style in the calling thread."""
    checkpointing = Checkpointing(function, args, device)
    return checkpointing.recompute(checkpointing.checkpoint())


def coarsen(units: Units, unit_stage: np.ndarray, k: int, width: int) -> tuple[Units, np.ndarray]:
    """Contract each stage's interior, leaving up to ``width`` units free on each side of
    every border: the tail of stage j (closed under successors in j) and the head of stage
    j + 1 (closed under predecessors in j + 1). Returns the coarse units, numbered in a
    topological order, and for every fine unit its coarse unit."""
    edges = np.array(list(units.dag.edges), dtype=np.int64).reshape(-1, 2)
    of_unit, dag = _coarse_dag(units, edges, unit_stage, k, width)
    return _coarse_units(units, of_unit, dag), of_unit


def stage_costs(w: np.ndarray, borders: list[int]) -> list[float]:
    """Cost of each stage of the split of ``w`` at ``borders``."""
    edges = [0, *borders, len(w)]
    s = np.concatenate([[0.0], np.cumsum(w)])
    return [float(s[b] - s[a]) for a, b in zip(edges, edges[1:])]


def sweep(values: Iterable[Any], quick: int = 1) -> list[Any]:
    """``values`` as pytest parameters (a tuple gives one value per argument name), all but
    the first ``quick`` marked ``slow``: the quick subset (``pytest -m "not slow"``) runs the
    start of the sweep, the whole suite all of it."""
    return [
        pytest.param(*(v if isinstance(v, tuple) else (v,)), marks=() if i < quick else SLOW)
        for i, v in enumerate(values)
    ]


SLOW = pytest.mark.slow


def tensor_rules(fn: Callable[..., Any], *example: torch.Tensor, tp: int = 2) -> Rules:
    """The tensor-parallel rules of ``fn`` traced by torch.fx, its shapes from ``example``."""
    gm = torch.fx.symbolic_trace(fn)
    return Rules(gm, tp, node_shapes(gm, example))


def follow_node(rules: Rules, node: str, layouts: dict[str, Layout]) -> Any:
    """How the cut ``layouts`` of its inputs pass through the node named ``node``."""
    n = next(n for n in rules.gm.graph.nodes if n.name == node)
    return follow(n, layouts, rules)


def logits_of(out: Any) -> torch.Tensor:
    """The logits of a model's output: the tensor itself, the first of a tuple, or a
    transformers output's ``logits``."""
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)):
        return logits_of(out[0])
    return out["logits"]  # type: ignore[no-any-return]
