"""How a cut travels through the ops that compute: element-wise ops with whole operands,
softmax, reductions, batched products, attention; size reads and unknown ops."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from helpers import follow_node, tensor_rules

from fxpipe.passes.tensor.cuts import Blocked
from fxpipe.passes.tensor.records import Shard


def test_element_wise_ops_take_only_operands_that_broadcast_along_the_cut() -> None:
    def fn(x: torch.Tensor, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return (x + z) * y

    rules = tensor_rules(fn, torch.randn(2, 8, 64), torch.randn(2, 8, 64), torch.randn(2, 8, 1))
    assert follow_node(rules, "add", {"x": Shard(2)}) == Shard(2)
    assert follow_node(rules, "mul", {"add": Shard(2), "y": Shard(2)}) == Shard(2)
    blocked = follow_node(rules, "mul", {"add": Shard(2)})
    assert isinstance(blocked, Blocked) and "whole along that dimension (64)" in blocked.reason
    assert isinstance(follow_node(rules, "mul", {"add": Shard(2), "y": Shard(1)}), Blocked)


def test_softmax_and_reductions_over_another_dimension_only() -> None:
    def fn(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return torch.softmax(x, dim=-1), x.sum(-1), x.mean(1, keepdim=True)

    rules = tensor_rules(fn, torch.randn(2, 4, 8, 8))
    assert follow_node(rules, "softmax", {"x": Shard(1)}) == Shard(1)
    assert isinstance(follow_node(rules, "softmax", {"x": Shard(3)}), Blocked)
    assert follow_node(rules, "sum_1", {"x": Shard(1)}) == Shard(1)
    assert follow_node(rules, "mean", {"x": Shard(2)}) == Shard(2)
    blocked = follow_node(rules, "mean", {"x": Shard(1)})
    assert isinstance(blocked, Blocked) and "partial result" in blocked.reason


def test_batched_products_keep_cut_heads_and_refuse_a_cut_contraction() -> None:
    rules = tensor_rules(
        lambda q, k: q @ k.transpose(-2, -1), torch.randn(2, 4, 8, 16), torch.randn(2, 4, 8, 16)
    )
    assert follow_node(rules, "matmul", {"q": Shard(1), "transpose": Shard(1)}) == Shard(1)
    assert isinstance(follow_node(rules, "matmul", {"q": Shard(1)}), Blocked)  # k whole per head
    blocked = follow_node(rules, "matmul", {"q": Shard(3), "transpose": Shard(2)})
    assert isinstance(blocked, Blocked) and "partial sum" in blocked.reason


def test_attention_is_cut_along_its_heads() -> None:
    def fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=m)

    qkv = [torch.randn(2, 4, 8, 16) for _ in range(3)]
    rules = tensor_rules(fn, *qkv, torch.zeros(2, 1, 8, 8))
    cut = {"q": Shard(1), "k": Shard(1), "v": Shard(1)}
    assert follow_node(rules, "scaled_dot_product_attention", cut) == Shard(1)
    blocked = follow_node(rules, "scaled_dot_product_attention", {"q": Shard(1), "v": Shard(1)})
    assert isinstance(blocked, Blocked) and "its key (k) is not cut" in blocked.reason
    per_head = tensor_rules(fn, *qkv, torch.zeros(2, 4, 8, 8))
    blocked = follow_node(per_head, "scaled_dot_product_attention", cut)
    assert isinstance(blocked, Blocked) and "holds every head whole" in blocked.reason


def test_size_reads_compute_nothing_and_unknown_ops_block() -> None:
    rules = tensor_rules(lambda x: (x.size(0), torch.cumsum(x, 1)), torch.randn(2, 8, 64))
    assert follow_node(rules, "size", {"x": Shard(2)}) is None
    blocked = follow_node(rules, "cumsum", {"x": Shard(2)})
    assert isinstance(blocked, Blocked) and "not known to keep a cut local" in blocked.reason
