"""How a cut travels through the ops that move elements: head splits and merges, fused
q, k, v parts, splits; and the part counts worth trying for a product's output features."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from helpers import follow_node, tensor_rules
from torch import nn

from fxpipe.passes.tensor.cuts import Blocked
from fxpipe.passes.tensor.records import Shard
from fxpipe.passes.tensor.reshapes import feature_parts


def test_a_view_as_heads_keeps_the_cut_on_the_heads() -> None:
    rules = tensor_rules(lambda x: x.view(2, 8, 4, 16), torch.randn(2, 8, 64))
    assert follow_node(rules, "view", {"x": Shard(2)}) == Shard(2)


def test_the_heads_merged_back_are_cut_as_features() -> None:
    rules = tensor_rules(lambda x: x.transpose(1, 2).reshape(2, 8, 64), torch.randn(2, 4, 8, 16))
    assert follow_node(rules, "transpose", {"x": Shard(1)}) == Shard(2)
    assert follow_node(rules, "reshape", {"transpose": Shard(2)}) == Shard(2)


def test_a_fused_qkv_view_needs_three_parts() -> None:
    rules = tensor_rules(lambda x: x.view(2, 8, 3, 4, 16), torch.randn(2, 8, 192))
    assert follow_node(rules, "view", {"x": Shard(2, blocks=3)}) == Shard(3)
    blocked = follow_node(rules, "view", {"x": Shard(2)})
    assert isinstance(blocked, Blocked)
    assert "as (3, 4, 16): 3 (the head count, in attention) does not divide by tp=2" in (
        blocked.reason
    )


def test_a_head_count_tp_does_not_divide_is_named() -> None:
    rules = tensor_rules(lambda x: x.view(2, 8, 3, 16), torch.randn(2, 8, 48))
    blocked = follow_node(rules, "view", {"x": Shard(2)})
    assert isinstance(blocked, Blocked)
    assert "views the cut features (48) as (3, 16): 3 (the head count" in blocked.reason


def test_a_split_along_the_cut_must_follow_its_parts() -> None:
    rules = tensor_rules(lambda x: x.split(64, dim=2), torch.randn(2, 8, 192))
    assert follow_node(rules, "split", {"x": Shard(2, blocks=3)}) == (Shard(2),) * 3
    assert isinstance(follow_node(rules, "split", {"x": Shard(2)}), Blocked)
    other = tensor_rules(lambda x: x.split(4, dim=1), torch.randn(2, 8, 64))
    assert follow_node(other, "split", {"x": Shard(2)}) == (Shard(2),) * 2


class _Fused(nn.Module):
    def __init__(self, view: bool) -> None:
        super().__init__()
        self.qkv, self.view = nn.Linear(64, 192), view

    def forward(self, x: torch.Tensor) -> Any:
        y = self.qkv(x)
        return y.view(2, 8, 3, 4, 16) if self.view else y.split(64, dim=-1)


@pytest.mark.parametrize("view", [True, False])
def test_a_fused_product_is_tried_in_as_many_parts_as_it_is_cut_apart(view: bool) -> None:
    rules = tensor_rules(_Fused(view), torch.randn(2, 8, 64))
    assert feature_parts(next(n for n in rules.gm.graph.nodes if n.name == "qkv"), rules) == [1, 3]


def test_a_plain_product_is_tried_whole_only() -> None:
    rules = tensor_rules(nn.Sequential(nn.Linear(64, 64)), torch.randn(2, 8, 64))
    n = next(n for n in rules.gm.graph.nodes if n.op == "call_module")
    assert feature_parts(n, rules) == [1]


def test_a_slice_of_whole_parts_is_cut_as_the_parts_it_takes() -> None:
    """q, k and v sliced off a fused product (Phi-3): a slice along the cut dimension that
    takes whole parts keeps each rank's pieces of them; one that cuts through a part, or
    slices a value cut in one part, cannot."""
    rules = tensor_rules(lambda x: x[..., 64:192], torch.randn(2, 8, 192))
    node = next(n for n in rules.gm.graph.nodes if n.op == "call_function")
    assert follow_node(rules, node.name, {"x": Shard(2, blocks=3)}) == Shard(2, blocks=2)
    assert isinstance(follow_node(rules, node.name, {"x": Shard(2)}), Blocked)
    through = tensor_rules(lambda x: x[..., 32:96], torch.randn(2, 8, 192))
    node = next(n for n in through.gm.graph.nodes if n.op == "call_function")
    blocked = follow_node(through, node.name, {"x": Shard(2, blocks=3)})
    assert isinstance(blocked, Blocked) and "not whole parts of its 3" in blocked.reason


class _Sliced(nn.Module):
    """A fused product of q (4 heads) and k, v (2 heads each), sliced apart."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(32, 64)

    def forward(self, x: torch.Tensor) -> Any:
        y = self.qkv(x)
        return y[..., :32], y[..., 32:48], y[..., 48:]


def test_a_fused_product_sliced_apart_is_tried_in_parts_its_slices_allow() -> None:
    rules = tensor_rules(_Sliced(), torch.randn(2, 8, 32))
    n = next(n for n in rules.gm.graph.nodes if n.name == "qkv")
    assert feature_parts(n, rules) == [1, 4]  # parts of 16: q takes two, k and v one each
