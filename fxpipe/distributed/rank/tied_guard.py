"""Catches an optimizer update of a Parameter held on several ranks (or left whole by FSDP on
each replica) whose gradient was never summed (``sync_tied_gradients`` forgotten): from then
on the copies differ, silently.

Each rank holding such a copy notes, at the start of every step, whether the copy changed in
place (its version counter) since the previous step began while no sum ran in between: only
an update between steps does that (an optimizer step), and a rank's update of a copy whose
gradient is its own stages' share is the mistake. Gradient accumulation (several steps, one
sum, one update) passes; fxpipe's own loads reset the record.
"""

from __future__ import annotations

import torch

from fxpipe.distributed.parallel.ownership import Ownership
from fxpipe.errors import ConfigError

__all__ = ["TiedGuard"]


class TiedGuard:
    """The record of one rank: whether a step has run since the last sum, and the version of
    each tied copy this rank holds when that step began."""

    def __init__(self, own: Ownership) -> None:
        self._own = own
        self._pending = False  # a step began and no sum has run since
        self._versions: list[int] = []

    def _current(self) -> list[int]:
        return [_version(t) for _, _, t in self._own.replicated if t is not None]

    def step_started(self) -> None:
        """Called by every stage of the rank at the start of each step, before anything is
        sent; ConfigError when a tied copy was updated in place since the previous step
        began and its gradient was not summed in between."""
        if not self._own.replicated:
            return
        now = self._current()
        if self._pending and now != self._versions:
            held = [k for k, _, t in self._own.replicated if t is not None]
            changed = [k for k, a, b in zip(held, now, self._versions, strict=True) if a != b]
            raise ConfigError(
                f"the Parameter(s) {changed} are held by several ranks (or left whole by "
                "FSDP on each replica), and this rank's copy changed (an optimizer step) "
                "after the last step without sync_tied_gradients() in between: it was "
                "updated with this rank's share of the gradient only, so the copies now "
                "differ; call "
                "pipe.sync_tied_gradients() on every rank after schedule.step and before "
                "optimizer.step(), and resume from a checkpoint saved before this step"
            )
        self._pending, self._versions = True, now

    def summed(self) -> None:
        """The gradients were summed (or the copies loaded alike): nothing is pending."""
        self._pending = False


def _version(t: torch.Tensor) -> int:
    """The in-place version counter of ``t``: an FSDP shard's is the DTensor's own (an
    in-place op on a DTensor bumps the wrapper's counter, not its local tensor's)."""
    return int(t._version)
