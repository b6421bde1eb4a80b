"""The ring of stage workers: a step through worker threads equals the stages run in turn
(the reference composition), several lanes at once; an error in a stage reaches its lane;
each stage's run is a recorder cell (lane, stage)."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
from torch import nn

import fxpipe
from fxpipe.generation.ring import Ring
from fxpipe.ir import StageProgram
from fxpipe.passes.split.codegen import run_stages
from fxpipe.runtime.recording import NullRecorder


def program() -> StageProgram:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3))
    pipe = fxpipe.pipeline(model, torch.randn(4, 6), ["cpu"] * 3, chunks=1)
    return pipe._session.variants.first.program


class Cells(NullRecorder):
    """Counts the cells it is handed."""

    def __init__(self) -> None:
        self.cells: list[tuple[int, int]] = []
        self.lock = threading.Lock()

    def cell(self, ij: tuple[int, int], *args: Any) -> Any:
        with self.lock:
            self.cells.append(ij)
        return super().cell(ij, *args)


def test_lanes_through_worker_threads_equal_the_stages_run_in_turn() -> None:
    prog = program()
    inputs = [torch.randn(4, 6) for _ in range(3)]
    want = [run_stages(prog, (x,))[0] for x in inputs]
    cells = Cells()
    out: dict[int, torch.Tensor] = {}
    with Ring([torch.device("cpu")] * 3, threads=True, recorder=cells) as ring:

        def lane(j: int) -> None:
            for _ in range(5):  # each lane steps again once its step is back
                out[j] = ring.step(j, prog, (inputs[j],))

        threads = [threading.Thread(target=lane, args=(j,)) for j in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    for j in range(3):
        torch.testing.assert_close(out[j], want[j], rtol=0, atol=0)
    assert sorted(set(cells.cells)) == [(i, j) for i in range(3) for j in range(3)]
    assert len(cells.cells) == 3 * 3 * 5
    with Ring([torch.device("cpu")] * 3, threads=False) as inline:
        torch.testing.assert_close(inline.step(0, prog, (inputs[0],)), want[0], rtol=0, atol=0)


def test_an_error_in_a_stage_reaches_the_lane_and_the_workers_stop() -> None:
    prog = program()
    with Ring([torch.device("cpu")] * 3, threads=True) as ring:
        with pytest.raises(RuntimeError, match="shape|size|mat1"):
            ring.step(0, prog, (torch.randn(4, 5),))  # the first layer takes 6 features
        torch.testing.assert_close(  # the ring still serves the next step
            ring.step(1, prog, (torch.ones(2, 6),)), run_stages(prog, (torch.ones(2, 6),))[0]
        )
        workers = list(ring._workers)
    assert workers and not any(w.is_alive() for w in workers)
