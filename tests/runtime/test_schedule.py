"""The clock-cycle schedule against literal tables."""

from __future__ import annotations

import pytest

from fxpipe.errors import ConfigError
from fxpipe.runtime.schedule import clock_cycles, format_schedule


def test_clock_cycles_4x3() -> None:
    assert list(clock_cycles(4, 3)) == [
        [(0, 0)],
        [(1, 0), (0, 1)],
        [(2, 0), (1, 1), (0, 2)],
        [(3, 0), (2, 1), (1, 2)],
        [(3, 1), (2, 2)],
        [(3, 2)],
    ]


def test_clock_cycles_fewer_micro_batches_than_stages() -> None:
    assert list(clock_cycles(2, 3)) == [
        [(0, 0)],
        [(1, 0), (0, 1)],
        [(1, 1), (0, 2)],
        [(1, 2)],
    ]


def test_clock_cycles_degenerate() -> None:
    assert list(clock_cycles(1, 1)) == [[(0, 0)]]
    assert list(clock_cycles(3, 1)) == [[(0, 0)], [(1, 0)], [(2, 0)]]
    assert list(clock_cycles(1, 3)) == [[(0, 0)], [(0, 1)], [(0, 2)]]


@pytest.mark.parametrize("m, n", [(1, 1), (5, 2), (2, 5), (7, 4)])
def test_every_cell_once_after_its_dependencies(m: int, n: int) -> None:
    done: set[tuple[int, int]] = set()
    for cells in clock_cycles(m, n):
        for i, j in cells:
            assert (i - 1, j) in done or i == 0
            assert (i, j - 1) in done or j == 0
        done.update(cells)
    assert done == {(i, j) for i in range(m) for j in range(n)}


def test_format_schedule() -> None:
    assert format_schedule(4, 3) == (
        "k    0  1  2  3  4  5\n"
        "j=0  0  1  2  3  .  .\n"
        "j=1  .  0  1  2  3  .\n"
        "j=2  .  .  0  1  2  3"
    )


@pytest.mark.parametrize("m, n", [(0, 2), (2, 0)])
def test_empty_schedule_is_rejected(m: int, n: int) -> None:
    with pytest.raises(ConfigError):
        list(clock_cycles(m, n))
