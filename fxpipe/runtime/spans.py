"""How a checkpointed cell times its recompute and backward: a span factory, and the one that
times nothing (the default, when no recording is attached)."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext

__all__ = ["SpanFactory", "no_span"]

#: ``span(phase)``: a context manager that times the block as ``phase`` of one cell.
SpanFactory = Callable[[str], AbstractContextManager[None]]

#: The one context manager :func:`no_span` hands out (``nullcontext`` can be re-entered).
_NO_SPAN: AbstractContextManager[None] = nullcontext()


def no_span(phase: str) -> AbstractContextManager[None]:
    """The :data:`SpanFactory` that times nothing: the same do-nothing context every call."""
    return _NO_SPAN
