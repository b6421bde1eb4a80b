"""Layout estimates as a table a person reads: :func:`format_layouts`."""

from __future__ import annotations

from collections.abc import Iterable

from fxpipe.distributed.planning.estimate import LayoutEstimate

__all__ = ["format_layouts"]


def format_layouts(layouts: Iterable[LayoutEstimate], limit: int | None = None) -> str:
    """A table a person reads: one row per layout, in the order given (``limit``: the first
    ``limit`` rows only)."""
    rows = list(layouts)[:limit]
    head: tuple[str, ...] = ("pp", "dp", "v", "m", "rows", "schedule", "replicas", "step",
                             "compute", "bubble", "p2p", "allreduce", "memory/rank",
                             "fits")  # fmt: skip
    body: list[tuple[str, ...]] = [
        (str(e.pp), str(e.dp), str(e.virtual), str(e.chunks), str(e.micro_batch), e.schedule,
         e.data_parallel if e.dp > 1 else "-", _seconds(e.step_s), _seconds(e.compute_s),
         f"{e.bubble:.1%}", _seconds(e.p2p_s), _seconds(e.allreduce_s),
         _bytes(e.memory_bytes), "yes" if e.fits else "no")
        for e in rows
    ]  # fmt: skip
    if any(e.tp > 1 for e in rows):  # the tensor-parallel size beside the other two
        head = (*head[:2], "tp", *head[2:])
        body = [(*r[:2], str(e.tp), *r[2:]) for r, e in zip(body, rows, strict=True)]
    widths = [max(len(r[i]) for r in [head, *body]) for i in range(len(head))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in [head, *body]]
    return "\n".join([lines[0], "  ".join("-" * w for w in widths), *lines[1:]])


def _seconds(x: float) -> str:
    if x == 0.0:
        return "0"
    if x >= 1.0:
        return f"{x:.2f} s"
    return f"{x * 1e3:.2f} ms" if x >= 1e-3 else f"{x * 1e6:.1f} us"


def _bytes(n: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"
