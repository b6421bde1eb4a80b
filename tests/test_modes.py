"""A pipeline runs the model in the mode its modules are in at each call, whatever tracer made
its graphs: train and eval outputs and gradients equal the eager model's in the same mode.

torch.export fixes the mode it traced in (dropout's flag, BatchNorm's statistics, every
``if self.training:``), and torch.fx fixes Python branches on ``self.training``: before
pipelines traced the model again per mode, ``pipe.eval()`` was silently ignored there.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from oracle import relative_error
from torch import nn

import fxpipe

pytestmark = pytest.mark.usefixtures("one_thread")

CPU2 = ["cpu", "cpu"]
TRACERS = ["fx", "export"]


class ModeDependent(nn.Module):
    """Three things that differ between train and eval: a Python branch on
    ``self.training``, BatchNorm (batch or running statistics), and functional dropout."""

    def __init__(self, p: float = 0.5) -> None:
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.bn = nn.BatchNorm1d(16)
        self.b = nn.Linear(16, 16)
        self.c = nn.Linear(16, 4)
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        if self.training:
            h = h * 2
        h = self.bn(torch.tanh(h))
        h = F.dropout(torch.relu(self.b(h)), self.p, self.training)
        return self.c(h)


def _model(p: float = 0.5) -> nn.Module:
    torch.manual_seed(0)
    model = ModeDependent(p)
    model.bn.running_mean.uniform_(-0.5, 0.5)  # not the defaults: eval differs visibly
    model.bn.running_var.uniform_(0.5, 2.0)
    return model


def _x(rows: int = 12) -> torch.Tensor:
    return torch.randn(rows, 8, generator=torch.Generator().manual_seed(1))


def _seeded(fn: Any, seed: int = 7) -> Any:
    torch.manual_seed(seed)
    return fn()


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("tracer", TRACERS)
@pytest.mark.parametrize("built_in", ["train", "eval"])
def test_each_call_runs_in_the_mode_the_model_is_in(tracer: str, built_in: str) -> None:
    """Built in one mode, called in both, in turn: every call equals eager in that mode
    (one micro-batch, so BatchNorm's batch statistics and dropout's draws are eager's)."""
    model = _model()
    eager = copy.deepcopy(model)
    model.train(built_in == "train")
    x = _x()
    pipe = fxpipe.pipeline(model, x, CPU2, chunks=1, tracer=tracer, cost="flops")
    for mode in ["eval", "train", "eval", "train"]:
        pipe.train(mode == "train")
        eager.train(mode == "train")
        got = _seeded(lambda: pipe(x))
        want = _seeded(lambda: eager(x))
        assert relative_error(got, want) < 1e-6, mode
        got.pow(2).sum().backward()
        want.pow(2).sum().backward()
        mine, theirs = _grads(model), _grads(eager)
        assert mine.keys() == theirs.keys()
        for name in theirs:
            assert relative_error(mine[name], theirs[name]) < 1e-5, (mode, name)
        model.zero_grad()
        eager.zero_grad()
    for name, buffer in eager.named_buffers():  # running statistics updated alike
        torch.testing.assert_close(dict(model.named_buffers())[name], buffer)
    assert len({id(v.program) for v in pipe.variants}) == 2


@pytest.mark.parametrize("tracer", TRACERS)
def test_eval_mode_set_on_the_model_itself_is_honoured(tracer: str) -> None:
    """``model.eval()`` rather than ``pipe.eval()``: the call still runs in eval mode."""
    model = _model()
    eager = copy.deepcopy(model).eval()
    x = _x()
    pipe = fxpipe.pipeline(model, x, CPU2, chunks=3, tracer=tracer, cost="flops")
    model.eval()
    with torch.no_grad():
        first, second = pipe(x), pipe(x)
        torch.testing.assert_close(first, eager(x))
    assert torch.equal(first, second)  # no dropout drawn


@pytest.mark.parametrize("tracer", TRACERS)
def test_modules_in_mixed_modes_run_as_they_are(tracer: str) -> None:
    """``model.train(); model.bn.eval()`` (BatchNorm frozen while fine-tuning): the pipeline
    runs the model with exactly these modes, over several micro-batches."""
    model = _model(p=0.0)
    eager = copy.deepcopy(model)
    x = _x()
    pipe = fxpipe.pipeline(model, x, CPU2, chunks=3, tracer=tracer, cost="flops")
    for module in (model, eager):
        module.train()
        module.bn.eval()
    got, want = pipe(x), eager(x)
    assert relative_error(got, want) < 1e-6
    got.sum().backward()
    want.sum().backward()
    for name, grad in _grads(eager).items():
        assert relative_error(_grads(model)[name], grad) < 1e-5, name


def test_dropout_drops_in_training_and_not_in_eval_whatever_mode_it_was_built_in() -> None:
    """torch.export built in eval mode: training calls still drop about half the values,
    eval calls none."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.Dropout(0.5)).eval()
    x = torch.randn(32, 16)
    pipe = fxpipe.pipeline(model, x, CPU2, chunks=4, tracer="export", cost="flops")
    with torch.no_grad():
        kept = pipe(x)
        torch.testing.assert_close(kept, model(x))
        pipe.train()
        dropped = pipe(x)
    zeros = (dropped == 0).float().mean().item()
    assert 0.4 < zeros < 0.6
    survivors = dropped != 0
    torch.testing.assert_close(dropped[survivors], 2 * kept[survivors])


def test_every_mode_holds_the_same_parameters_in_the_same_stages() -> None:
    """The graph traced for the other mode is split along the first one's borders: stage
    ``j`` holds the same Parameter objects in both, so nothing moved."""
    model = _model()
    x = _x()
    pipe = fxpipe.pipeline(model, x, ["cpu"] * 3, chunks=2, tracer="export", cost="flops")
    pipe.eval()
    with torch.no_grad():
        pipe(x)
    first, other = pipe.variants
    assert first.program is not other.program
    for j in range(3):
        held = {id(p) for p in first.program.modules[j].parameters()}
        assert held == {id(p) for p in other.program.modules[j].parameters()}, j
    assert other.plan.num_stages == 3 and other.plan.info["method"] == "follow"


def test_an_fx_graph_that_follows_eval_by_itself_is_not_split_again() -> None:
    """An fx graph whose mode-dependent layers are modules (``nn.Dropout``) is the same in
    both modes: the eval call reuses the stages."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.3), nn.Linear(8, 2))
    x = torch.randn(6, 8)
    pipe = fxpipe.pipeline(model, x, CPU2, chunks=2, tracer="fx", cost="flops")
    pipe.eval()
    with torch.no_grad():
        torch.testing.assert_close(pipe(x), model(x))
    first, other = pipe.variants
    assert other.program is first.program and other.modes != first.modes


transformers = pytest.importorskip("transformers")


def test_gpt2_with_dropout_evaluates_as_eager() -> None:
    """The issue's case: a 4-layer GPT-2 with its default dropout (0.1), traced by
    torch.export in training mode; under ``pipe.eval()`` and ``no_grad`` two calls agree
    with each other and with the eager model in eval mode."""
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=4, n_embd=32, n_head=4, vocab_size=97, n_positions=64, use_cache=False,
        bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    model = transformers.GPT2LMHeadModel(config)
    eager = copy.deepcopy(model).eval()
    ids = torch.randint(0, 97, (4, 12), generator=torch.Generator().manual_seed(2))
    pipe = fxpipe.pipeline(model, ids, CPU2)
    pipe.eval()
    with torch.no_grad():
        first, second = pipe(ids).logits, pipe(ids).logits
        assert torch.equal(first, second)
        assert relative_error(first, eager(ids).logits) < 1e-6


class ReadsAValue(nn.Module):
    """A Python branch on ``self.training`` and a scalar read off a tensor (``.item()``, as
    XLM's length check and DeBERTa's attention span do): an fx graph that cannot be priced
    without running it, which the eval variant, traced on ``meta``, cannot."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.a(x))
        if self.training:
            h = F.dropout(h, 0.5)
        scale = self.a.weight.abs().max().item()  # a Python float from a tensor's value
        return self.b(h) / scale


def test_the_other_mode_of_a_graph_that_reads_a_tensor_value_runs_as_eager() -> None:
    torch.manual_seed(0)
    model = ReadsAValue()
    x = torch.randn(8, 8)
    pipe = fxpipe.pipeline(model, x, CPU2, chunks=2, cost="flops", tracer="fx")
    pipe(x).sum().backward()
    pipe.eval()
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(pipe(x), model(x))
    assert len(pipe.variants) == 2
    assert pipe.variants[1].plan.stage_of.keys() >= {"item"}  # split, priced as the first


class MakesAConstant(nn.Module):
    """Dropout, and a tensor made in forward from a Python number, which torch.export keeps
    as a constant of the graph (XLM's attention does this)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.dropout(torch.relu(self.a(x)), 0.5, self.training)
        return self.b(h) * torch.tensor([0.5, 1.0, 2.0, 4.0], device=x.device)


def test_another_mode_whose_trace_makes_a_constant_takes_its_values(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The other mode, traced on meta views (as where the weights live on several devices),
    takes the values of a constant made in forward from the first trace: equal to eager."""
    import fxpipe.compiler.retrace

    monkeypatch.setattr(fxpipe.compiler.retrace, "model_device", lambda model: None)
    torch.manual_seed(0)
    model = MakesAConstant()
    x = torch.randn(8, 8)
    pipe = fxpipe.pipeline(model, x, CPU2, chunks=2, tracer="export")
    pipe(x)
    pipe.eval()
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(pipe(x), model(x))
