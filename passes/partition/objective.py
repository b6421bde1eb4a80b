"""What the partitioner's searches compare splits by: the bottleneck and the bytes sent."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from fxpipe.ir import Traffic
from fxpipe.passes.partition.memory import FIRST_READER, MODEL_INPUT, Entering

__all__ = ["Pick", "sent_bytes", "bottleneck_of"]

#: The split that sends the fewest bytes with every stage <= a cap: (unit stages, method).
Pick = Callable[[float], tuple[np.ndarray, str]]


def sent_bytes(values: list[Entering], unit_stage: np.ndarray, k: int, traffic: Traffic) -> float:
    """Bytes the stages of ``unit_stage`` send each other under ``traffic``."""
    total = 0.0
    for v in values:
        reading = {int(unit_stage[r]) for r in v.readers}
        if v.to_output:
            reading.add(k - 1)
        if v.producer == MODEL_INPUT:
            source = 0
        elif v.producer == FIRST_READER:
            source = min(reading)
        else:
            source = int(unit_stage[v.producer])
        if traffic == "relay":
            total += v.bytes * (max(reading) - source)
        else:
            total += v.bytes * len(reading - {source})
    return total


def bottleneck_of(
    weight: np.ndarray, unit_stage: np.ndarray, k: int, speeds: np.ndarray | None = None
) -> float:
    """The largest stage time of ``unit_stage``: stage j's cost over ``speeds[j]``."""
    costs = np.bincount(unit_stage, weights=weight, minlength=k)
    return float((costs if speeds is None else costs / speeds).max())
