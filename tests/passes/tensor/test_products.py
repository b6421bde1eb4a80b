"""The products against a parameter and the embeddings, in each form the tracers leave them:
module calls, functional calls, weights stored (in, out) or read transposed; and who reads
each parameter."""

from __future__ import annotations

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from fxpipe.passes.tensor.products import (
    Embedding,
    Product,
    find_embeddings,
    find_products,
    param_readers,
)


class Forms(nn.Module):
    """One product of each form, and a tied embedding and head."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 16)
        self.w = nn.Parameter(torch.randn(16, 12))  # (in, out), as transformers' Conv1D
        self.b = nn.Parameter(torch.randn(12))
        self.v = nn.Parameter(torch.randn(6, 12))  # (out, in), read transposed
        self.emb = nn.Embedding(10, 8)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        h = self.linear(x)
        h = torch.addmm(self.b, h.view(-1, 16), self.w)
        h = torch.matmul(h, self.v.t())
        return F.linear(h @ self.v, self.emb.weight)  # h @ v: v is (6, 12), 6 in, 12 out


def _gm() -> fx.GraphModule:
    return fx.symbolic_trace(Forms())


def test_every_form_of_product_is_found_with_its_output_dimension() -> None:
    found = {p.weight: p for p in find_products(_gm()).values()}
    assert found["linear.weight"] == Product(
        "linear", "emb", "linear.weight", "linear.bias", 0, 8, 16
    )
    assert found["w"].out_dim == 1 and found["w"].bias == "b"  # addmm(b, x, w): (in, out)
    assert (found["w"].in_features, found["w"].out_features) == (16, 12)
    v = [p for p in find_products(_gm()).values() if p.weight == "v"]
    assert sorted(p.out_dim for p in v) == [0, 1]  # v.t() then v itself
    head = found["emb.weight"]
    assert (head.out_dim, head.out_features) == (0, 10)


def test_embeddings_and_their_readers() -> None:
    gm = _gm()
    assert find_embeddings(gm) == {"emb": Embedding("emb", "ids", "emb.weight", 10)}
    readers = param_readers(gm)
    assert sorted(readers["emb.weight"]) == ["emb", "linear_1"]  # the lookup and the tied head
    assert len(readers["v"]) == 2  # the transpose is looked through: its reader counts
    assert readers["linear.bias"] == ["linear"]


def test_a_product_by_a_computed_weight_is_not_a_parameter_product() -> None:
    def fn(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return F.linear(x, w * 2)

    assert find_products(fx.symbolic_trace(fn)) == {}
