"""Fake runs leave modules whose output is shaped like their input unrun: the costs do not
change, and a module that would raise on the values (BatchNorm on one row) is run."""

from __future__ import annotations

import pytest
import torch
from models import ZOO, Case
from torch import nn

from fxpipe.passes.price import estimate as cost_model
from fxpipe.passes.price.estimate import estimate_costs
from fxpipe.passes.shape_only import same_shape_output
from fxpipe.trace.tracing import trace

pytestmark = pytest.mark.usefixtures("one_thread")

FX_CASES = [c for c in ZOO.values() if c.tracer != "export"]


@pytest.mark.parametrize("case", FX_CASES, ids=lambda c: c.name)
def test_leaving_same_shape_modules_unrun_changes_no_cost(
    case: Case, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Fake runs skip BatchNorm, LayerNorm, activations (their output is shaped like their
    input); every mode prices every node exactly as when they run."""
    model = case.build().train()
    args, kwargs = case.example(case.batch)
    t = trace(model, args, kwargs, tracer="fx")
    for mode in ("flops", "roofline", "params"):
        fast = estimate_costs(t.graph_module, t.example_values, mode=mode)
        with monkeypatch.context() as patch:
            patch.setattr(cost_model, "same_shape_output", lambda *_: None)
            slow = estimate_costs(t.graph_module, t.example_values, mode=mode)
        assert fast == slow, mode


def test_a_batch_norm_that_would_raise_is_run() -> None:
    norm = nn.BatchNorm1d(4).train()
    one = torch.randn(1, 4)
    with pytest.raises(ValueError, match="more than 1 value per channel"):
        norm(one)
    assert same_shape_output(norm, (one,), {}) is None
    two = same_shape_output(norm, (torch.randn(2, 4),), {})
    assert two is not None and two.shape == (2, 4) and two.requires_grad
