"""fxpipe's logger: how long each planning phase took, and how far pricing has got.

Everything goes to ``logging.getLogger("fxpipe")``, which has only a ``NullHandler``: the
library prints nothing unless the application configures logging, for instance
``logging.basicConfig(level=logging.INFO)`` for one line per phase with its duration.
Records carry their phase in ``record.fxpipe_phase`` (``"trace"``, ``"check"``,
``"price"``, ``"partition"``, ``"split"``) and ``record.fxpipe_state`` (``"start"``,
``"progress"``, ``"done"``); progress records (DEBUG) also carry ``done`` and ``total``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

__all__ = ["LOGGER", "phase", "pricing_progress"]

LOGGER = logging.getLogger("fxpipe")
LOGGER.addHandler(logging.NullHandler())

#: Progress records per phase, at most (one per percent of the nodes).
_STEPS = 100


@contextmanager
def phase(name: str, what: str) -> Iterator[None]:
    """Log the start (DEBUG) and the end of a phase with its duration (INFO)."""
    LOGGER.debug("%s: %s", name, what, extra={"fxpipe_phase": name, "fxpipe_state": "start"})
    start = time.perf_counter()
    yield
    seconds = time.perf_counter() - start
    LOGGER.info(
        "%s: %s in %.2f s",
        name,
        what,
        seconds,
        extra={"fxpipe_phase": name, "fxpipe_state": "done", "seconds": seconds},
    )


def pricing_progress() -> Callable[[int, int], None]:
    """A ``progress(done, total)`` for the cost model that logs a DEBUG record at every
    percent of the nodes (nothing at all while DEBUG is off for the logger)."""
    last = [-1]

    def progress(done: int, total: int) -> None:
        step = done * _STEPS // max(total, 1)
        if step == last[0] or not LOGGER.isEnabledFor(logging.DEBUG):
            return
        last[0] = step
        LOGGER.debug(
            "price: %d of %d nodes",
            done,
            total,
            extra={
                "fxpipe_phase": "price",
                "fxpipe_state": "progress",
                "done": done,
                "total": total,
            },
        )

    return progress
