"""fxpipe.distributed.rank.stage: what a stage module hands torch to send under zero bubble."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.distributed.ranks import check_against_eager, launch, preload, results, train

preload(__name__)


@pytest.mark.slow
def test_zero_bubble_sends_a_stage_output_that_is_transposed(tmp_path: Path) -> None:
    """A stage of the Llama-shaped zoo model ends on a transposed tensor; under zero bubble the
    stage hands out copies, which kept its strides, and gloo refuses to send them ("input
    tensor has to be contiguous") until the copies were made contiguous."""
    runs = launch(train, 2, tmp_path, name="llama", schedule="interleavedzerobubble", spr=2)
    check_against_eager("llama", results(runs))
