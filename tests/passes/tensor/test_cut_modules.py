"""The modules a local program calls at cut products compute what the model's own layers do
on the same Parameters: transformers' Conv1D, nn.Linear, nn.Embedding with a padding row."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fxpipe.passes.tensor.cut_modules import Cut, CutEmbedding, CutInOut, CutLinear, cut_of
from fxpipe.passes.tensor.records import Shard

transformers = pytest.importorskip("transformers")

CUT = Cut("node", "colwise", Shard(0), None)


def test_the_in_out_module_is_transformers_conv1d_on_the_same_parameters() -> None:
    conv = transformers.pytorch_utils.Conv1D(12, 8)  # nf=12 outputs, nx=8 inputs: (8, 12)
    nn.init.normal_(conv.bias)
    ours = CutInOut(conv.weight, conv.bias, CUT)
    x = torch.randn(2, 3, 8)
    torch.testing.assert_close(ours(x), conv(x))
    assert ours.weight is conv.weight and cut_of(ours) == CUT


def test_the_linear_module_is_nn_linear_on_the_same_parameters() -> None:
    linear = nn.Linear(8, 6)
    ours = CutLinear(linear.weight, None, CUT)
    x = torch.randn(4, 8)
    torch.testing.assert_close(ours(x), x @ linear.weight.T)
    assert (ours.in_features, ours.out_features) == (8, 6) and ours.bias is None


def test_the_embedding_keeps_its_padding_row_out_of_the_gradient() -> None:
    table = nn.Parameter(torch.randn(10, 4))
    ours = CutEmbedding(table, 0, Cut("lookup", "vocab", Shard(0), None))
    ids = torch.tensor([[0, 3, 0, 9]])
    out = ours(ids)
    torch.testing.assert_close(out, F.embedding(ids, table))
    out.sum().backward()
    assert table.grad is not None
    assert table.grad[0].abs().sum() == 0 and table.grad[3].abs().sum() > 0


def test_other_modules_carry_no_cut() -> None:
    assert cut_of(nn.Linear(2, 2)) is None
