"""The check that refuses what mixes the batch's samples back into per-sample values (a
reduction over the batch read per sample, a size of the batch scaling samples) and hands on
what the grouping analysis found."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from fxpipe.errors import PlanError
from fxpipe.passes.batch.mixing import check_no_batch_mixing
from fxpipe.passes.batch.roles import batch_roles
from fxpipe.trace.tracing import trace

pytestmark = pytest.mark.usefixtures("one_thread")


class _Fn(nn.Module):
    def __init__(self, fn: Any) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(x)  # type: ignore[no-any-return]


def _check(fn: Any) -> Any:
    x = torch.randn(6, 4)
    traced = trace(_Fn(fn), (x,), tracer="fx")
    roles = batch_roles(traced.graph_module, traced.example_values, 6)
    assert roles is not None
    return check_no_batch_mixing(traced.graph_module, roles)


@pytest.mark.parametrize(
    ("fn", "said"),
    [
        (lambda x: x - x.mean(0), "depends on the whole batch"),
        (lambda x: x / x.shape[0], "scales per-sample values by the batch size"),
    ],
    ids=["mean back", "batch size"],
)
def test_what_mixes_samples_is_refused_naming_the_remedy(fn: Any, said: str) -> None:
    with pytest.raises(PlanError, match=rf"{said}.*chunks=1"):
        _check(fn)


def test_per_sample_work_passes_and_a_running_sum_over_the_rows_is_handed_on() -> None:
    assert not _check(lambda x: (x * 2).relu()).mixing
    (why,) = _check(lambda x: x.cumsum(0)).mixing.values()
    assert why == "takes a running sum along the batch's rows"
