"""A generate call resolved: lanes="auto" is one lane per device the stages span, sampling
runs one lane, asked-for lanes are never more than the groups."""

from __future__ import annotations

import pytest

from fxpipe.errors import ConfigError
from fxpipe.generation.request import lanes_and_rows

transformers = pytest.importorskip("transformers")


def test_auto_lanes_are_one_per_device_the_stages_span_and_one_when_sampling() -> None:
    greedy, sampling = (
        transformers.GenerationConfig(),
        transformers.GenerationConfig(do_sample=True),
    )
    assert lanes_and_rows("auto", None, 5, 2, greedy) == (2, 3)
    assert lanes_and_rows("auto", None, 5, 1, greedy) == (1, 5)
    assert lanes_and_rows("auto", None, 1, 4, greedy) == (1, 1)
    assert lanes_and_rows("auto", None, 5, 2, sampling) == (1, 5)
    assert lanes_and_rows("auto", None, 7, 2, greedy, lane_rows=4) == (1, 7)  # 2 of 3, 4
    assert lanes_and_rows("auto", None, 8, 3, greedy, lane_rows=4) == (2, 4)
    assert lanes_and_rows(3, 1, 5, 1, greedy) == (
        3,
        1,
    )  # asked for: five groups of one, three lanes
    assert lanes_and_rows(4, 3, 5, 1, greedy) == (2, 3)  # no more lanes than groups
    with pytest.raises(ConfigError, match="lanes=0"):
        lanes_and_rows(0, None, 5, 1, greedy)


def test_prompts_go_in_chunks_only_where_other_lanes_can_pass_between_them() -> None:
    from fxpipe.generation.request import CHUNK_BUDGET, prefill_tokens

    assert prefill_tokens("auto", 32, lanes=2) == CHUNK_BUDGET // 32
    assert prefill_tokens("auto", 4 * CHUNK_BUDGET, lanes=3) == 2  # a step of one is a decode
    assert prefill_tokens("auto", 32, lanes=1) == 0  # nothing would pass: the prompt at once
    assert prefill_tokens(None, 32, lanes=2) == 0
    assert prefill_tokens(5, 32, lanes=1) == 5  # asked for
    for bad in (1, True, "4"):
        with pytest.raises(ConfigError, match="prefill_chunk"):
            prefill_tokens(bad, 32, lanes=2)
