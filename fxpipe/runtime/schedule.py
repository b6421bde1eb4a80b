"""The GPipe clock-cycle schedule, as data: which (micro-batch, stage) cells run at each tick."""

from __future__ import annotations

from collections.abc import Iterator

from fxpipe.errors import ConfigError

__all__ = ["clock_cycles", "format_schedule"]


def clock_cycles(m: int, n: int) -> Iterator[list[tuple[int, int]]]:
    """Yield, for each clock tick ``k``, the cells ``(i, j)`` with ``i + j == k``.

    ``m`` micro-batches run through ``n`` stages in ``m + n - 1`` ticks. Micro-batch ``i``
    reaches stage ``j`` one tick after it left stage ``j - 1`` and one tick after micro-batch
    ``i - 1`` left stage ``j``. Cells of a tick are listed by ascending stage ``j``. For
    ``m = 4, n = 3``::

        k   cells (i, j)
        0   (0,0)
        1   (1,0) (0,1)
        2   (2,0) (1,1) (0,2)
        3   (3,0) (2,1) (1,2)
        4         (3,1) (2,2)
        5               (3,2)
    """
    if m < 1 or n < 1:
        raise ConfigError(
            f"a schedule needs at least one micro-batch and one stage (m={m}, n={n})"
        )
    for k in range(m + n - 1):
        yield [(k - j, j) for j in range(max(1 + k - m, 0), min(1 + k, n))]


def format_schedule(m: int, n: int) -> str:
    """A grid a person reads: one row per stage ``j``, one column per tick ``k``.

    A cell shows the micro-batch ``i`` stage ``j`` runs at tick ``k``, or ``.`` when idle::

        k    0  1  2  3  4  5
        j=0  0  1  2  3  .  .
        j=1  .  0  1  2  3  .
        j=2  .  .  0  1  2  3
    """
    ticks = list(clock_cycles(m, n))
    width = max(len(str(m - 1)), len(str(len(ticks) - 1)))
    grid = [["." for _ in ticks] for _ in range(n)]
    for k, cells in enumerate(ticks):
        for i, j in cells:
            grid[j][k] = str(i)
    label = max(len(f"j={n - 1}"), 1)
    lines = ["k".ljust(label) + "".join(f"  {k:>{width}}" for k in range(len(ticks)))]
    for j, row in enumerate(grid):
        lines.append(f"j={j}".ljust(label) + "".join(f"  {c:>{width}}" for c in row))
    return "\n".join(lines)
