"""What looks like bad input but is not: batches smaller than ``chunks``, in-place writes next
to stage borders, outputs that are not all tensors, frozen parameters, BatchNorm in a
recomputed stage; each must equal eager, outputs and every gradient (in float64)."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from error_models import Net, Outputs
from helpers import sweep
from torch import nn
from torch.utils._pytree import tree_flatten

import fxpipe
from fxpipe.api import pipeline_of
from fxpipe.compiler import compile_model
from fxpipe.options import PlanOptions, RunOptions


def assert_equals_eager(
    pipe: fxpipe.Pipeline, model: nn.Module, twin: nn.Module, *args: Any, **kwargs: Any
) -> None:
    """Outputs, and every parameter gradient (float64: to 1e-10), equal the eager twin's."""
    for p in [*model.parameters(), *twin.parameters()]:
        p.grad = None
    got = pipe(*copy.deepcopy(args), **kwargs)
    want = twin(*copy.deepcopy(args), **kwargs)
    got_leaves, got_spec = tree_flatten(got)
    want_leaves, want_spec = tree_flatten(want)
    assert got_spec == want_spec
    loss_got, loss_want = (
        torch.zeros((), dtype=torch.float64),
        torch.zeros((), dtype=torch.float64),
    )
    for g, w in zip(got_leaves, want_leaves, strict=True):
        if isinstance(w, torch.Tensor):
            torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12)
            weights = torch.linspace(-1, 1, w.numel(), dtype=w.dtype).reshape(w.shape)
            loss_got, loss_want = loss_got + (g * weights).sum(), loss_want + (w * weights).sum()
        else:
            assert g == w
    loss_got.backward()
    loss_want.backward()
    for (name, p), q in zip(model.named_parameters(), twin.parameters(), strict=True):
        if q.grad is None:
            assert p.grad is None, name
        else:
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-12, msg=name)


def _twins(factory: Callable[[], nn.Module]) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    model = factory().double()
    return model, copy.deepcopy(model)


@pytest.mark.parametrize("batch", [1, 3, 7])
@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
def test_a_batch_smaller_than_chunks_works_and_equals_eager(batch: int, checkpoint: str) -> None:
    model, twin = _twins(Net)
    x = torch.randn(8, 4, dtype=torch.float64)
    pipe = fxpipe.pipeline(model, x, ["cpu"] * 3, chunks=8, checkpoint=checkpoint, cost="flops")
    assert_equals_eager(pipe, model, twin, x[:batch])


def _layers(n: int) -> nn.ModuleList:
    return nn.ModuleList(nn.Linear(6, 6) for _ in range(n))


class ReluUnused(nn.Module):
    """``h.relu_()`` with its result unused; ``h`` is read before and after."""

    def __init__(self) -> None:
        super().__init__()
        self.l = _layers(6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.l[0](x) + 1
        a = self.l[1](h * 2)
        b = self.l[2](a)
        h.relu_()
        c = self.l[3](b)
        return self.l[5](self.l[4](c) + h)


class AddIntermediate(nn.Module):
    """``h.add_(1)`` on an intermediate a later stage reads."""

    def __init__(self) -> None:
        super().__init__()
        self.l = _layers(6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.l[0](x) + 1
        b = self.l[2](self.l[1](h * 2))
        h.add_(1)
        c = self.l[3](b)
        return self.l[5](self.l[4](c) * h)


class InplaceReluBeforeResidual(nn.Module):
    """``nn.ReLU(inplace=True)`` on a value a residual reads again later."""

    def __init__(self) -> None:
        super().__init__()
        self.l = _layers(6)
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.l[1](self.l[0](x)) + 0
        t = self.l[2](h * 1)
        u = self.relu(h)
        w = self.l[4](self.l[3](u)) + h + t
        return self.l[5](w)


class WritesItsInput(nn.Module):
    """Scales its input in place before using it twice (legal: the input needs no grad)."""

    def __init__(self) -> None:
        super().__init__()
        self.l = _layers(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x.mul_(2)
        g = self.l[1](self.l[0](x))
        return self.l[3](self.l[2](g) + x)


INPLACE = [ReluUnused, AddIntermediate, InplaceReluBeforeResidual, WritesItsInput]


@pytest.mark.parametrize("factory", INPLACE, ids=[f.__name__ for f in INPLACE])
@pytest.mark.parametrize("tracer", sweep(["fx", "export"]))
def test_in_place_writes_next_to_stage_borders_equal_eager(
    factory: Callable[[], nn.Module], tracer: str
) -> None:
    x = torch.randn(8, 6, dtype=torch.float64)
    for stages in (2, 3, 4):
        model, twin = _twins(factory)
        compiled = compile_model(
            model, x.clone(), ["cpu"] * stages, PlanOptions(cost="flops", tracer=tracer)
        )
        for checkpoint in ("always", "never"):
            pipe = pipeline_of(model, compiled, RunOptions(chunks=4, checkpoint=checkpoint))
            assert_equals_eager(pipe, model, twin, x)


def test_a_written_input_is_copied_so_the_callers_tensor_stays() -> None:
    """The eager model would scale the caller's tensor; the pipeline writes into a copy."""
    model, _ = _twins(WritesItsInput)
    x = torch.randn(8, 6, dtype=torch.float64)
    pipe = fxpipe.pipeline(model, x.clone(), ["cpu"] * 2, chunks=4, cost="flops")
    kept = x.clone()
    pipe(x)
    assert torch.equal(x, kept)


@pytest.mark.parametrize(
    "what",
    [lambda h: "label", lambda h: h.shape[1], lambda h: (None, 3.5), lambda h: {"n": 2}],
    ids=["str", "width", "none-and-float", "dict"],
)
def test_outputs_that_are_not_tensors_pass_through(what: Callable[[torch.Tensor], Any]) -> None:
    model, twin = _twins(lambda: Outputs(what))
    x = torch.randn(7, 4, dtype=torch.float64)
    pipe = fxpipe.pipeline(model, x, ["cpu"] * 2, chunks=3, cost="flops")
    assert_equals_eager(pipe, model, twin, x)


@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
def test_a_frozen_parameter_stays_without_gradient_and_the_others_equal_eager(
    checkpoint: str,
) -> None:
    model, twin = _twins(Net)
    for m in (model, twin):
        m.blocks[1][0].weight.requires_grad_(False)
    x = torch.randn(8, 4, dtype=torch.float64)
    pipe = fxpipe.pipeline(model, x, ["cpu"] * 3, chunks=4, checkpoint=checkpoint, cost="flops")
    stages = {pipe.plan.stage_of[n] for n in pipe.plan.stage_of if n.startswith("blocks_1")}
    assert len(pipe.plan.stages) == 3 and stages
    assert_equals_eager(pipe, model, twin, x)
    assert model.blocks[1][0].weight.grad is None


@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
def test_a_fully_frozen_model_gives_outputs_without_grad_as_eager(checkpoint: str) -> None:
    model, twin = _twins(Net)
    model.requires_grad_(False)
    twin.requires_grad_(False)
    x = torch.randn(8, 4, dtype=torch.float64)
    pipe = fxpipe.pipeline(model, x, ["cpu"] * 3, chunks=4, checkpoint=checkpoint, cost="flops")
    assert not pipe(x).requires_grad and not twin(x).requires_grad
    xg = x.clone().requires_grad_()
    pipe(xg).sum().backward()
    want = x.clone().requires_grad_()
    twin(want).sum().backward()
    torch.testing.assert_close(xg.grad, want.grad)


class BatchNormed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 6)
        self.bn = nn.BatchNorm1d(6)
        self.b = nn.Linear(6, 6)
        self.c = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.tanh(self.b(self.bn(self.a(x)))))


@pytest.mark.parametrize("tracer", ["fx", "export"])
def test_recomputing_a_stage_does_not_update_batch_norm_statistics_again(tracer: str) -> None:
    """torch.export turns BatchNorm into plain ops on the running buffers; recomputing a
    checkpointed stage must not apply their update a second time."""
    model, twin = _twins(BatchNormed)
    x = torch.randn(8, 6, dtype=torch.float64)
    pipe = fxpipe.pipeline(
        model, x, ["cpu"] * 2, chunks=1, checkpoint="always", cost="flops", tracer=tracer
    )
    for _ in range(2):
        assert_equals_eager(pipe, model, twin, x)
    for (name, a), b in zip(model.named_buffers(), twin.buffers(), strict=True):
        torch.testing.assert_close(a, b, msg=name)
