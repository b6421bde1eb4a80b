"""Planning reports its phases through the ``fxpipe`` logger (silent unless configured) and
the command line draws a progress bar from it on a terminal."""

from __future__ import annotations

import io
import logging

import pytest
from models import ZOO

import fxpipe
from fxpipe.command import cli

PHASES = ("trace", "check", "price", "partition", "split")


def _plan() -> fxpipe.PipelinePlan:
    case = ZOO["resnet"]
    args, kwargs = case.example(case.batch)
    return fxpipe.plan(case.build(), args, ["cpu"] * 2, example_kwargs=kwargs)


def test_the_library_is_silent_by_default(capsys: pytest.CaptureFixture[str]) -> None:
    logger = logging.getLogger("fxpipe")
    assert any(isinstance(h, logging.NullHandler) for h in logger.handlers)
    _plan()
    out, err = capsys.readouterr()
    assert out == "" and err == ""


def test_each_phase_logs_its_duration(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="fxpipe"):
        _plan()
    done = [r for r in caplog.records if getattr(r, "fxpipe_state", None) == "done"]
    assert [r.fxpipe_phase for r in done] == list(PHASES)
    for record in done:
        assert record.levelno == logging.INFO and record.name == "fxpipe"
        seconds = record.seconds
        assert seconds >= 0 and f"in {seconds:.2f} s" in record.getMessage()


def test_pricing_progress_is_logged_at_debug(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.DEBUG, logger="fxpipe"):
        plan = _plan()
    steps = [r for r in caplog.records if getattr(r, "fxpipe_state", None) == "progress"]
    total = len(plan.stage_of)
    assert steps and all(r.total == total for r in steps)
    done = [r.done for r in steps]
    assert done == sorted(set(done)) and done[-1] == total


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_the_command_line_draws_a_bar_of_the_nodes_priced() -> None:
    logger = logging.getLogger("fxpipe")
    level, handlers = logger.level, list(logger.handlers)
    status = cli._Status()
    status.handle(logging.makeLogRecord({"fxpipe_phase": "trace", "fxpipe_state": "start"}))
    assert status.describe() == "tracing"
    record = {"fxpipe_phase": "price", "fxpipe_state": "progress", "done": 30, "total": 120}
    status.handle(logging.makeLogRecord(record))
    assert status.describe() == "pricing [#####...............] 30/120 nodes"
    screen = _Terminal()
    with cli._progress("fxpipe: planning", screen):
        _plan()
    assert (
        screen.getvalue().endswith("\x1b[K\n") and "fxpipe: planning: done in" in screen.getvalue()
    )
    assert logger.level == level and logger.handlers == handlers


def test_the_command_line_prints_nothing_off_a_terminal() -> None:
    quiet = io.StringIO()
    with cli._progress("fxpipe: planning", quiet):
        _plan()
    assert quiet.getvalue() == ""
