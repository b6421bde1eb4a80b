"""The records of a tensor-parallel plan: a Shard's pieces, and the block a parameter is in."""

from __future__ import annotations

import torch

from fxpipe.passes.tensor.records import Shard, block_of


def test_a_piece_is_one_slice_of_every_part() -> None:
    t = torch.arange(12)
    assert Shard(0).take(t, 2, 1).tolist() == [6, 7, 8, 9, 10, 11]
    assert Shard(0, blocks=3).take(t, 2, 0).tolist() == [0, 1, 4, 5, 8, 9]
    m = torch.arange(24).reshape(2, 12)
    assert Shard(1, blocks=3).take(m, 2, 1).tolist() == [
        [2, 3, 6, 7, 10, 11],
        [14, 15, 18, 19, 22, 23],
    ]


def test_the_pieces_of_all_ranks_make_the_whole_and_carry_its_gradient() -> None:
    w = torch.randn(6, 4, requires_grad=True)
    pieces = [Shard(0, blocks=3).take(w, 2, r) for r in range(2)]
    assert sorted(torch.cat(pieces).flatten().tolist()) == sorted(w.flatten().tolist())
    sum(p.sum() * (r + 1) for r, p in enumerate(pieces)).backward()  # type: ignore[union-attr]
    assert w.grad is not None and w.grad[[0, 2, 4]].eq(1).all() and w.grad[[1, 3, 5]].eq(2).all()


def test_the_block_of_a_parameter_is_its_path_to_the_first_number() -> None:
    assert block_of("model.layers.0.mlp.up_proj.weight") == "model.layers.0"
    assert block_of("transformer.h.11.attn.c_attn.bias") == "transformer.h.11"
    assert block_of("lm_head.weight") is None
