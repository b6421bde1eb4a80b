"""The partitioner's exact search on the ideals: the least bottleneck, then the fewest bytes."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from fxpipe.ir import Traffic
from fxpipe.passes.partition.fit import StageFit
from fxpipe.passes.partition.ideals import ideal_split, ideal_stages
from fxpipe.passes.partition.memory import FIRST_READER, MODEL_INPUT, Entering, received_on_ideals
from fxpipe.passes.partition.objective import Pick
from fxpipe.passes.partition.units import Units

__all__ = ["search_on_ideals", "fewest_bytes_on_ideals"]


def search_on_ideals(
    units: Units,
    values: list[Entering],
    ideals: np.ndarray,
    k: int,
    traffic: Traffic,
    fit: StageFit,
) -> tuple[float, Pick]:
    """The exact best bottleneck over every convex split that ``fit`` allows, and the
    fewest-bytes pick."""
    allowed = fit.allowed_on(ideals)
    best, _ = ideal_split(
        ideals,
        units.weight,
        k,
        required_first=sorted(units.pinned_first),
        speeds=fit.speeds,
        allowed=allowed,
    )

    def pick(cap: float) -> tuple[np.ndarray, str]:
        chosen = fewest_bytes_on_ideals(units, values, ideals, k, cap, traffic, fit, allowed)
        return chosen, "ideals"

    return best, pick


def fewest_bytes_on_ideals(
    units: Units,
    values: list[Entering],
    ideals: np.ndarray,
    k: int,
    cap: float,
    traffic: Traffic,
    fit: StageFit,
    allowed: Callable[[int], np.ndarray] | None = None,
) -> np.ndarray:
    """The unit stages of the split that sends the fewest bytes with every stage <= cap
    (``allowed``: the memory masks of ``fit`` on these ideals, when already made)."""
    if traffic == "relay":
        priced = _bytes_leaving(ideals, values)
    else:
        priced = received_on_ideals(ideals, values, _made_in)
    total = float(units.weight.sum())
    if fit.speeds is not None:
        total /= float(fit.speeds.min())  # the times sum to at most this
    _, rows = ideal_split(
        ideals,
        units.weight,
        k,
        required_first=sorted(units.pinned_first),
        border_bytes=priced,
        cap=cap,
        balance=_tie_break(total),
        speeds=fit.speeds,
        allowed=allowed if allowed is not None else fit.allowed_on(ideals),
    )
    stages: np.ndarray = ideal_stages(ideals, rows)
    return stages


def _made_in(ideals: np.ndarray, v: Entering) -> np.ndarray:
    """Which ideals hold the stage that makes ``v``."""
    if v.producer == MODEL_INPUT:
        return np.ones(len(ideals), dtype=bool)
    if v.producer == FIRST_READER:
        return np.asarray(ideals[:, list(v.readers)].any(axis=1))
    return np.asarray(ideals[:, v.producer])


def _bytes_leaving(ideals: np.ndarray, values: list[Entering]) -> np.ndarray:
    """Relay traffic: ``out[J]``, the bytes of values made in ideal J and read outside it."""
    leaving = np.zeros(len(ideals))
    for v in values:
        made = _made_in(ideals, v)
        read_outside = ~ideals[:, list(v.readers)].all(axis=1) if v.readers else False
        leaving += v.bytes * (made & (read_outside | v.to_output))
    return leaving


def _tie_break(total: float) -> float:
    """The per-stage ``cost**2`` weight that ranks splits sending the same bytes by their
    evenness and never outweighs one byte: the squares sum to at most ``total**2``."""
    return 0.25 / total**2 if total > 0 else 0.0
