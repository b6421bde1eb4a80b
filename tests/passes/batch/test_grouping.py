"""Grouping is not mixing (:mod:`fxpipe.passes.batch.grouping`): a Mixture-of-Experts layer
that sorts the batch's tokens by expert, counts them, runs a grouped product at the offsets
and puts them back is proven to compute each token from its own row (planned, and equal to
eager over micro-batches); what really mixes the rows is not: offsets of another order (a
reduction read per sample: refused), a sort whose order reaches the output, and a running
sum over the batch's rows (a router's capacity: run per micro-batch under a warning)."""

from __future__ import annotations

import copy
import warnings
from typing import Any

import pytest
import torch
from oracle import relative_error
from torch import nn

import fxpipe
from fxpipe.errors import BatchStatisticsWarning, PlanError
from fxpipe.passes.batch.grouping import row_grouping
from fxpipe.passes.batch.roles import batch_roles
from fxpipe.trace.tracing import trace

pytestmark = pytest.mark.usefixtures("one_thread")

E, D, TOP = 4, 8, 2


@torch.fx.wrap
def grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """A grouped product: rows ``offs[e-1]:offs[e]`` of ``x`` times ``w[e]`` (a leaf of the
    fx graph, named as torch's own)."""
    group = torch.bucketize(torch.arange(x.shape[0]), offs.to(torch.long), right=True)
    return (x.unsqueeze(1) @ w[group]).squeeze(1)


class Experts(nn.Module):
    """Token-choice routing over ``E`` experts, the tokens grouped by expert as transformers'
    grouped kernel does. ``offsets_of``: "own" (the sorted keys' counts), "other" (the
    counts of a second sort, of other keys: not the groups of these rows)."""

    def __init__(self, offsets_of: str = "own") -> None:
        super().__init__()
        self.router = nn.Linear(D, E)
        self.w = nn.Parameter(torch.randn(E, D, D) / D**0.5)
        self.offsets_of = offsets_of

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        x = h.reshape(-1, D)
        weights, chosen = self.router(x).softmax(-1).topk(TOP)
        keys, perm = torch.sort(chosen.reshape(-1))
        rows = x[perm // TOP]
        if self.offsets_of == "own":
            counted = keys
        else:  # the experts of the reversed slots: the same counts, another order of rows
            counted, _ = torch.sort(chosen.flip(-1).reshape(-1).flip(0))
        offsets = torch.histc(counted.float(), bins=E, min=0, max=E - 1).cumsum(0).int()
        out = grouped_mm(rows, self.w, offsets) * weights.reshape(-1)[perm].unsqueeze(-1)
        back = out[torch.argsort(perm)]
        return h + back.reshape(h.shape[0], -1, TOP, D).sum(2)


class SortedOut(nn.Module):
    """Returns the batch's rows sorted by a score: the order depends on every sample."""

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h[h.sum((1, 2)).argsort()] * 2.0


class Capacity(nn.Module):
    """Drops each token past an expert's capacity counted over the whole batch (a running
    count along the batch's rows, as NLLB-MoE's router keeps it)."""

    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(D, E)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        mask = nn.functional.one_hot(self.router(h).argmax(-1), E).to(h.dtype)
        kept = mask * (torch.cumsum(mask, dim=0) <= 3).to(h.dtype)
        return h * kept.sum(-1, keepdim=True)


def _rows(n: int = 6) -> torch.Tensor:
    return torch.randn(n, 5, D, dtype=torch.float64, generator=torch.Generator().manual_seed(1))


def _grouping(model: nn.Module, x: torch.Tensor) -> Any:
    traced = trace(model, (x,), tracer="fx")
    roles = batch_roles(traced.graph_module, traced.example_values, x.shape[0])
    assert roles is not None
    return row_grouping(traced.graph_module, roles)


def test_grouped_experts_are_proven_to_compute_each_row_from_its_own() -> None:
    found = _grouping(Experts().double(), _rows())
    assert not found.mixing
    assert len(found.grouped) == 1  # the grouped product
    ops = {n.rstrip("_0123456789") for n in found.grouping}
    assert {"sort", "histc", "cumsum", "argsort"} <= ops


def test_grouped_experts_run_over_micro_batches_equal_to_eager() -> None:
    model = Experts().double()
    eager = copy.deepcopy(model)
    x = _rows()
    pipe = fxpipe.pipeline(model, x, ["cpu"] * 2, chunks=3)
    got, want = pipe(x), eager(x)
    assert relative_error(got, want) < 1e-12
    got.square().sum().backward()
    want.square().sum().backward()
    for (name, p), q in zip(model.named_parameters(), eager.parameters(), strict=True):
        assert relative_error(p.grad, q.grad) < 1e-12, name


def test_offsets_of_another_order_are_a_reduction_read_per_sample() -> None:
    model = Experts("other").double()
    found = _grouping(model, _rows())
    assert "sort" in found.mixing or any(k.startswith("sort") for k in found.mixing)
    with pytest.raises(PlanError, match=r"grouped_mm.*depends on the whole batch.*chunks=1"):
        fxpipe.pipeline(model, _rows(), ["cpu"] * 2, chunks=2)


def test_a_sort_whose_order_reaches_the_output_mixes_the_rows() -> None:
    found = _grouping(SortedOut(), _rows())
    (why,) = found.mixing.values()
    assert "sorts the batch's rows" in why and "output" in why


def test_a_capacity_counted_over_the_batch_runs_per_micro_batch_under_a_warning() -> None:
    """GPipe's semantics for a router whose capacity spans the batch: each micro-batch routed
    on its own (as eager on the same micro-batches), said once; chunks=1 as the model."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = Capacity().double()
    x = _rows(8).reshape(-1, D)
    found = _grouping(model, x)
    assert [w for w in found.mixing.values()] == ["takes a running sum along the batch's rows"]
    pipe = fxpipe.pipeline(copy.deepcopy(model), x, ["cpu"] * 2, chunks=2)
    with pytest.warns(BatchStatisticsWarning, match=r"mix the batch's rows.*'cumsum'.*chunks=1"):
        got = pipe(x)
    parts = torch.cat([model(part) for part in x.tensor_split(2)])
    assert relative_error(got, parts) < 1e-12
    assert relative_error(got, model(x)) > 1e-3  # the whole batch routes otherwise here
    whole = fxpipe.pipeline(copy.deepcopy(model), x, ["cpu"] * 2, chunks=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error", BatchStatisticsWarning)
        assert relative_error(whole(x), model(x)) < 1e-12


class _MeanBack(nn.Module):
    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h - h.mean(0)


def test_the_remedy_of_a_value_mixed_back_into_samples_works_when_followed() -> None:
    x = _rows()
    with pytest.raises(PlanError, match="pass chunks=1 to run whole batches"):
        fxpipe.pipeline(_MeanBack(), x, ["cpu"] * 2, chunks=2)
    pipe = fxpipe.pipeline(_MeanBack(), x, ["cpu"] * 2, chunks=1)
    assert relative_error(pipe(x), _MeanBack()(x)) < 1e-12
