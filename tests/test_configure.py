"""A pipeline run with one checkpoint mode per stage, or configured by ``"auto"``: the same
outputs and gradients as eager, the modes it reports, and the modes it can be given."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import fxpipe
from fxpipe.errors import ConfigError

MODES = ["never", "always", "except_last", "always"]


class Net(nn.Module):
    """Residual blocks with dropout, so that recomputation must replay the same masks."""

    def __init__(self, p: float = 0.0) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(32, 32) for _ in range(8))
        self.drop = nn.Dropout(p)
        self.head = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + self.drop(torch.tanh(block(x)))
        return self.head(x)


def _net(p: float = 0.0) -> Net:
    torch.manual_seed(0)
    return Net(p).double()


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _step(run: nn.Module, model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, dict]:
    torch.manual_seed(7)
    out = run(x)
    (out * torch.arange(out.numel(), dtype=out.dtype).view_as(out)).sum().backward()
    return out.detach(), _grads(model)


def test_per_stage_modes_equal_eager() -> None:
    x = torch.randn(16, 32, dtype=torch.float64)
    eager = _net()
    want, want_grads = _step(eager, eager, x)
    model = _net()
    pipe = fxpipe.pipeline(model, x, ["cpu"] * 4, chunks=4, checkpoint=MODES)
    assert pipe.checkpoint == tuple(MODES) and pipe.plan.checkpoints == tuple(MODES)
    got, grads = _step(pipe, model, x)
    torch.testing.assert_close(got, want)
    assert grads.keys() == want_grads.keys()
    for name, g in grads.items():
        torch.testing.assert_close(g, want_grads[name], msg=name)


def test_per_stage_recomputation_replays_dropout_exactly() -> None:
    """With dropout on, per-stage modes give bit for bit what no checkpointing gives."""
    x = torch.randn(16, 32, dtype=torch.float64)
    results = []
    for modes in ("never", MODES):
        model = _net(p=0.3)
        pipe = fxpipe.pipeline(model, x, ["cpu"] * 4, chunks=4, checkpoint=modes)
        results.append(_step(pipe, model, x))
    (out0, g0), (out1, g1) = results
    assert torch.equal(out0, out1)
    assert all(torch.equal(g0[n], g1[n]) for n in g0)


def test_auto_pipeline_runs_its_plans_choice_and_equals_eager() -> None:
    x = torch.randn(32, 32, dtype=torch.float64)
    eager = _net()
    want, want_grads = _step(eager, eager, x)
    model = _net()
    never = fxpipe.plan(copy.deepcopy(model), x, ["cpu"] * 4, chunks=8, checkpoint="never")
    always = fxpipe.plan(copy.deepcopy(model), x, ["cpu"] * 4, chunks=8, checkpoint="always")
    budget = (sum(s.memory_bytes for s in never.stages) + sum(
        s.memory_bytes for s in always.stages)) // 2  # fmt: skip
    pipe = fxpipe.pipeline(
        model, x, ["cpu"] * 4, chunks="auto", checkpoint="auto", max_memory=budget
    )
    choice = pipe.plan.configurations().choice
    assert pipe.chunks == choice.chunks == pipe.plan.chunks
    assert pipe.checkpoint == choice.mode
    assert "never" != pipe.checkpoint  # the budget needs some recomputation
    got, grads = _step(pipe, model, x)
    torch.testing.assert_close(got, want)
    for name, g in grads.items():
        torch.testing.assert_close(g, want_grads[name], msg=name)


def test_checkpoint_can_be_set_per_stage_and_is_checked() -> None:
    x = torch.randn(8, 32, dtype=torch.float64)
    pipe = fxpipe.pipeline(_net(), x, ["cpu"] * 4, chunks=2)
    pipe.checkpoint = ["always", "never", "never", "never"]
    assert pipe.checkpoint == ("always", "never", "never", "never")
    pipe.checkpoint = ["never"] * 4
    assert pipe.checkpoint == "never"
    with pytest.raises(ConfigError, match="3 modes but there are 4 stages"):
        pipe.checkpoint = ["never"] * 3
    with pytest.raises(ConfigError, match="checkpoint='auto'"):
        pipe.checkpoint = "auto"  # type: ignore[assignment]
    assert pipe.checkpoint == "never"
