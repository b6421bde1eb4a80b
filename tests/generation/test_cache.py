"""The generation cache: each attention layer's layout found from one run of the model
(grouped key/value heads, head sizes, dtype), its bytes, and a lane's rows reordered in place
for beam search."""

from __future__ import annotations

import pytest
import torch

from fxpipe.errors import ConfigError
from fxpipe.generation.cache import CacheLayout, LayerLayout, StageCaches, lane_cache, probe_layout
from tests.generation.test_driver import built, gpt2, llama

transformers = pytest.importorskip("transformers")


def test_the_probe_finds_grouped_heads_and_the_bytes_follow() -> None:
    model = built(llama, layers=3)  # 4 query heads over 2 key/value heads of 8
    layout = probe_layout(model, torch.zeros(1, 2, 32), "cache")
    assert layout == CacheLayout((LayerLayout(2, 8, 8, torch.float32),) * 3)
    assert layout.bytes(rows=5, length=11) == (5 * 11 * 2 * (8 + 8) * 4,) * 3
    caches = StageCaches(layout, [torch.device("cpu")] * 3, rows=5, length=11)
    assert [tuple(t.shape) for t in caches.tensors] == [(5, 2, 11, 8)] * 6
    assert sum(t.numel() * t.element_size() for t in caches.tensors) == sum(layout.bytes(5, 11))


def test_a_model_that_takes_no_cache_is_refused_with_what_to_do() -> None:
    model = built(gpt2)
    with pytest.raises(ConfigError, match="own generate"):
        probe_layout(model, torch.zeros(1, 2, 32), "not_a_cache_argument")


def test_a_lane_reorders_its_rows_in_place_for_beam_search() -> None:
    layout = CacheLayout((LayerLayout(1, 2, 2, torch.float32),))
    caches = StageCaches(layout, [torch.device("cpu")], rows=6, length=3)
    for t in caches.tensors:
        t.copy_(torch.arange(6.0).view(6, 1, 1, 1).expand_as(t))
    lane = lane_cache(caches.rows_of(2, 5))  # rows 2, 3, 4 of the batch
    lane.reorder_cache(torch.tensor([2, 2, 0]))
    for t in caches.tensors:
        assert t[:, 0, 0, 0].tolist() == [0, 1, 4, 4, 2, 5]  # the other rows untouched
    assert lane.get_seq_length() == 0 and not lane.is_compileable
