"""Measures of a split that the partition benchmarks share: bytes sent, min-max baselines."""

from __future__ import annotations

import networkx as nx
import numpy as np

from fxpipe.passes.partition.chain_dp import min_max_split
from fxpipe.passes.partition.cost_graph import readers
from fxpipe.passes.partition.ideals import ideal_split, ideal_stages
from fxpipe.passes.partition.search import Partition, node_stages
from fxpipe.passes.partition.units import Units

__all__ = ["first_cut", "stage_costs", "traffic", "min_max_only", "is_valid"]


def first_cut(units: Units) -> int:
    """Smallest border position in unit order (units reading non-tensor inputs stay first)."""
    return max(units.pinned_first, default=-1) + 1


def stage_costs(w: np.ndarray, borders: list[int]) -> list[float]:
    """Cost of each stage of the split of ``w`` at ``borders``."""
    edges = [0, *borders, len(w)]
    s = np.concatenate([[0.0], np.cumsum(w)])
    return [float(s[b] - s[a]) for a, b in zip(edges, edges[1:])]


def traffic(g: nx.DiGraph, stage_of: dict[str, int]) -> tuple[float, float]:
    """(activation bytes, parameter bytes) the stages send each other with direct sends (the
    default codegen): a value goes once to every other stage that reads it."""
    sent = {"activation": 0.0, "parameter": 0.0}
    for u, data in g.nodes(data=True):
        reading_nodes = readers(g, u)
        if data["op"] == "output" or not reading_nodes:
            continue
        reading = {stage_of[v] for v in reading_nodes if g.nodes[v]["op"] != "output"}
        source = 0 if data["op"] == "placeholder" else stage_of[u]
        kind = "parameter" if data["op"] == "get_attr" else "activation"
        sent[kind] += data["bytes"] * len(reading - {source})
    return sent["activation"], sent["parameter"]


def min_max_only(g: nx.DiGraph, units: Units, ideals: np.ndarray | None, k: int) -> dict[str, int]:
    """The split a min-max solver without a bytes objective returns: the exact optimum over
    ideals (or over the fx order) as the solver first finds it."""
    if ideals is not None:
        _, rows = ideal_split(ideals, units.weight, k, required_first=sorted(units.pinned_first))
        unit_stage = ideal_stages(ideals, rows)
    else:
        _, borders = min_max_split(units.weight, k, first_cut=first_cut(units))
        unit_stage = np.searchsorted(np.array(borders), np.arange(units.num_units), side="right")
    return node_stages(g, units, unit_stage, k)


def is_valid(g: nx.DiGraph, part: Partition, k: int) -> bool:
    """Every node placed, every stage used, every edge going forward."""
    stage = part.stage_of
    if set(stage) != set(g.nodes) or set(stage.values()) != set(range(k)):
        return False
    return all(stage[u] <= stage[v] for u, v in g.edges)
