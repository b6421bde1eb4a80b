"""What the asynchronous schedule holds on each stage: how many micro-batches are in flight,
how many updates a micro-batch's backward may come after its forward (its staleness), how
many weight versions a mitigation keeps, and their bytes; found by walking each stage's own
order of events (``Async1F1B``'s rule, :mod:`fxpipe.distributed.rank.asynchronous`)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

__all__ = ["StageStaleness", "Staleness", "staleness_of"]


@dataclass(frozen=True)
class StageStaleness:
    """One stage under the asynchronous schedule, in its steady state."""

    stage: int
    #: Micro-batches whose forward ran and whose backward has not (right after a forward).
    in_flight: int
    #: The most updates of this stage between a micro-batch's forward and its backward.
    stale: int
    #: Weight versions kept beside the Parameters (stashed copies or predicted weights).
    versions: int
    #: Their bytes: ``versions`` x the stage's Parameter bytes.
    extra_bytes: int


@dataclass(frozen=True)
class Staleness:
    """Every stage's figures, for ``staleness`` (the mitigation) and ``step_every``."""

    staleness: str
    step_every: int
    stages: tuple[StageStaleness, ...]

    def summary(self) -> str:
        """A table: each stage's micro-batches in flight, staleness in updates, weight
        versions kept and their bytes."""
        lines = [
            f"Async1F1B, staleness={self.staleness!r}, an update every {self.step_every} "
            "micro-batch(es) on each stage",
            f"{'stage':>5}  {'in flight':>9}  {'stale (updates)':>15}  {'versions':>8}  "
            f"{'extra MiB':>9}",
        ]
        for s in self.stages:
            lines.append(
                f"{s.stage:>5}  {s.in_flight:>9}  {s.stale:>15}  {s.versions:>8}  "
                f"{s.extra_bytes / 2**20:>9.2f}"
            )
        return "\n".join(lines)


def staleness_of(staleness: str, step_every: int, param_bytes: tuple[int, ...]) -> Staleness:
    """The figures of every stage of a pipeline whose stages hold ``param_bytes``."""
    stages = []
    for s in range(len(param_bytes)):
        stale, versions = _walk(len(param_bytes) - 1 - s, step_every, staleness)
        stages.append(StageStaleness(s, len(param_bytes) - s, stale, versions,
                                     versions * param_bytes[s]))  # fmt: skip
    return Staleness(staleness, step_every, tuple(stages))


def _walk(warmup: int, every: int, staleness: str) -> tuple[int, int]:
    """(the most updates between a forward and its backward, the most weight versions kept
    at once) for a stage that keeps ``warmup`` micro-batches in flight between its
    forwards, over a stream long enough to repeat its pattern."""
    since, updates = 0, 0
    flight: deque[tuple[int, int]] = deque()  # (version at forward, staleness)
    most_stale = most_kept = 0
    for _ in range((warmup + 2) * every * 2):
        stale = (since + len(flight)) // every
        flight.append((updates, stale))
        most_stale = max(most_stale, stale)
        kept = {key if staleness == "predict" else key[0] for key in flight if key[1] > 0}
        most_kept = max(most_kept, 0 if staleness == "none" else len(kept))
        while len(flight) > warmup:
            flight.popleft()
            since += 1
            if since == every:
                since, updates = 0, updates + 1
    return most_stale, most_kept
