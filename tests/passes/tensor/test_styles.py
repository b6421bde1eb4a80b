"""Which ``parallelize_module`` style each generated module gets: torch's own where they place
the plan's cut, subclasses placing a Conv1D weight and a fused q, k, v otherwise; the
placement of each cut (a fused one as ``_StridedShard``, which holds the plan's pieces)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.tensor import Replicate
from torch.distributed.tensor import Shard as TorchShard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
from torch.distributed.tensor.placement_types import _StridedShard

from fxpipe.passes.tensor.cut_modules import Cut, CutEmbedding, CutInOut, CutLinear
from fxpipe.passes.tensor.records import Shard
from fxpipe.passes.tensor.styles import PlacedColwise, PlacedRowwise, placement_of, style_of

W = nn.Parameter(torch.zeros(6, 4))


def test_each_cut_is_placed_as_the_plan_says() -> None:
    assert placement_of(None) == Replicate()
    assert placement_of(Shard(1)) == TorchShard(1)
    assert placement_of(Shard(0, blocks=3)) == _StridedShard(0, split_factor=3)


def test_a_strided_placement_holds_the_plans_pieces() -> None:
    """``_StridedShard(0, split_factor=3)`` over 2 ranks keeps, on rank r, piece r of each of
    the 3 parts: what ``Shard(0, blocks=3).take`` gives (checked through torch's own local
    chunking, without a process group)."""
    whole = torch.arange(12.0).reshape(12, 1)
    placement = _StridedShard(0, split_factor=3)
    for rank in range(2):
        local = placement._split_tensor(whole, 2, with_padding=False)[0][rank]
        torch.testing.assert_close(local, Shard(0, blocks=3).take(whole, 2, rank))


@pytest.mark.parametrize(
    ("module", "kind"),
    [
        (CutLinear(W, None, Cut("a", "colwise", Shard(0), None)), ColwiseParallel),
        (CutLinear(W, None, Cut("a", "rowwise", Shard(1), None)), RowwiseParallel),
        (CutEmbedding(W, None, Cut("e", "vocab", Shard(0), None)), RowwiseParallel),
        (CutLinear(W, None, Cut("q", "colwise", Shard(0, blocks=3), None)), PlacedColwise),
        (CutInOut(W, None, Cut("c", "colwise", Shard(1), None)), PlacedColwise),
        (CutInOut(W, None, Cut("c", "rowwise", Shard(0), None)), PlacedRowwise),
    ],
)
def test_torchs_styles_where_they_place_the_cut_else_a_placed_one(
    module: nn.Module, kind: type
) -> None:
    style = style_of(module)
    assert type(style) is kind


def test_an_lm_head_gathers_its_logits_and_an_embedding_takes_whole_ids() -> None:
    head = style_of(CutLinear(W, None, Cut("h", "gathered", Shard(0), None)))
    assert isinstance(head, ColwiseParallel) and head.output_layouts == (Replicate(),)
    lookup = style_of(CutEmbedding(W, None, Cut("e", "vocab", Shard(0), None)))
    assert isinstance(lookup, RowwiseParallel) and lookup.input_layouts == (Replicate(),)


def test_a_module_no_local_program_made_has_no_style() -> None:
    with pytest.raises(TypeError, match="not a module a local program generates"):
        style_of(nn.Linear(2, 2))
