"""A constant the model makes in forward keeps its values in a variant traced again: traced on
the model itself where its tensors live on one device, on ``meta`` (taking the values of the
first trace's constant) where they live on several, which these tests stand in for by making
``fxpipe.compiler.retrace`` see no single device."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import fxpipe
from fxpipe.errors import PlanError

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(params=["one device", "several devices"])
def devices(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Where the model's tensors seem to live when a variant is traced: on one device (the
    variant traced on them), or on several (traced on ``meta``)."""
    if request.param == "several devices":
        import fxpipe.compiler.retrace

        monkeypatch.setattr(fxpipe.compiler.retrace, "model_device", lambda model: None)
    return str(request.param)


CPU2 = ["cpu", "cpu"]


class MakesConstants(nn.Module):
    """Dropout (its graph differs between modes under torch.export) and tensors made in
    forward from Python numbers, which torch.export keeps as constants of the graph."""

    def __init__(self, eval_only: bool = False) -> None:
        super().__init__()
        self.a = nn.Linear(4, 8)
        self.b = nn.Linear(8, 4)
        self.drop = nn.Dropout(0.0)
        self.eval_only = eval_only

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.drop(torch.tanh(self.a(x)))
        h = h * torch.tensor([0.5, 1.0, 2.0, 4.0, 1.5, 3.0, 0.25, 1.0], device=h.device)
        if self.eval_only and not self.training:
            h = h + torch.tensor(-2.0, device=h.device)
        return self.b(h) * torch.tensor(3.0, device=h.device)


def test_eval_after_a_training_step_equals_eager_with_the_constants_values(devices: str) -> None:
    model = MakesConstants()
    eager = copy.deepcopy(model)
    x, target = torch.randn(8, 4), torch.randn(8, 4)
    pipe = fxpipe.pipeline(model, x, CPU2, chunks=2, tracer="export", cost="flops")
    got, want = pipe(x), eager(x)
    torch.testing.assert_close(got, want)
    ((got - target) ** 2).mean().backward()
    ((want - target) ** 2).mean().backward()
    for (name, p), q in zip(model.named_parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, msg=name)
    for module in (model, eager):
        torch.optim.SGD(module.parameters(), lr=0.1).step()

    pipe.eval()
    eager.eval()
    with torch.no_grad():
        torch.testing.assert_close(pipe(x), eager(x))
    assert len(pipe.variants) == 2  # the eval form was traced again


def test_a_constant_only_the_other_mode_makes_is_refused_naming_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On several devices no real-valued trace made that constant: refused, and the remedy
    works."""
    import fxpipe.compiler.retrace

    monkeypatch.setattr(fxpipe.compiler.retrace, "model_device", lambda model: None)
    model = MakesConstants(eval_only=True)
    x = torch.randn(8, 4)
    pipe = fxpipe.pipeline(model, x, CPU2, chunks=2, tracer="export", cost="flops")
    pipe(x)
    pipe.eval()
    model.eval()
    with pytest.raises(PlanError, match=r"made a constant tensor .*first trace made none like"):
        pipe(x)
    evaluating = fxpipe.pipeline(model, x, CPU2, chunks=2, tracer="export", cost="flops")
    with torch.no_grad():
        torch.testing.assert_close(evaluating(x), model(x))


def test_on_one_device_the_other_mode_is_traced_on_the_model_itself() -> None:
    """Its own constant, and code that branches on the device, as on that device."""
    model = MakesConstants(eval_only=True)
    x = torch.randn(8, 4)
    pipe = fxpipe.pipeline(model, x, CPU2, chunks=2, tracer="export", cost="flops")
    pipe(x)
    pipe.eval()
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(pipe(x), model(x))
