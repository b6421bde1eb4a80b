"""What a sweep worker is doing, said on stderr, and the verdict on an exception raised there."""

from __future__ import annotations

import sys

from benchmarks.harness.failures import describe, first_line
from benchmarks.harness.rows import Row

__all__ = ["MARK", "phase", "failure"]

#: The prefix of a phase line on the worker's stderr (the driver reports the last one).
MARK = "[sweep] phase: "
_PHASE = ["start"]


def phase(text: str) -> None:
    """Say on stderr what the worker is doing (the driver reports the last one on a timeout)."""
    _PHASE[0] = text
    print(f"{MARK}{text}", file=sys.stderr, flush=True)


def failure(exc: BaseException) -> Row:
    """refused for an FxPipeError fxpipe raises on purpose, crashed for anything else."""
    import fxpipe
    from fxpipe.errors import StageError

    on_purpose = isinstance(exc, fxpipe.FxPipeError) and not isinstance(exc, StageError)
    info = describe(exc)
    return {
        "status": "refused" if on_purpose else "crashed",
        "where": _PHASE[0],
        "reason": first_line(f"{info['type']}: {info['message']}"),
        "error": info,
    }
