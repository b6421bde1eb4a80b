"""Constructs of real models that once gave silently wrong numbers or needless refusals.

Each is checked against eager PyTorch on both tracers and in every checkpoint mode: a custom
``torch.autograd.Function`` keeps its own backward (or is refused), a tensor that requires
grad without being a Parameter gets eager's gradient, a training-mode BatchNorm with
``momentum=None`` whose output is the model's output builds and matches eager micro-batch by
micro-batch, and an ``OrderedDict`` output comes back as an ``OrderedDict``.
"""

from __future__ import annotations

import collections
import copy
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

from oracle import relative_error  # noqa: E402

import fxpipe  # noqa: E402
from fxpipe.errors import TraceError  # noqa: E402

CHECKPOINTS = ("never", "except_last", "always")
TRACERS = ("fx", "export")


class GradReverse(torch.autograd.Function):
    """Identity forward, negated gradient (domain-adversarial training)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return -grad


class StraightThrough(torch.autograd.Function):
    """Rounds in forward, passes the gradient through unchanged (quantisation-aware)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, scale: float) -> torch.Tensor:
        return torch.round(x * scale) / scale

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


@torch.library.custom_op("fxpipe_trust::cube", mutates_args=())
def cube(x: torch.Tensor) -> torch.Tensor:
    """x ** 3, a custom op whose backward torch.library registers (not an fxpipe concern)."""
    return x * x * x


@cube.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


def _cube_setup(ctx: Any, inputs: tuple[torch.Tensor], output: torch.Tensor) -> None:
    ctx.save_for_backward(inputs[0])


def _cube_backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
    (x,) = ctx.saved_tensors
    return 3 * x * x * grad


cube.register_autograd(_cube_backward, setup_context=_cube_setup)


class CustomOp(nn.Module):
    """A custom op with a registered backward between two layers."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 6)
        self.b = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(cube(torch.tanh(self.a(x))))


class Softsign(torch.autograd.Function):
    """x / (1 + |x|) with its derivative written by hand (a fused kernel's usual shape)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return x / (1 + x.abs())

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        return grad / (1 + x.abs()) ** 2


class HandWritten(nn.Module):
    """A Function whose backward is the derivative of its forward, between two layers."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 6)
        self.b = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(Softsign.apply(self.a(x)))


class Adversarial(nn.Module):
    """A feature extractor, a gradient reversal layer, then a head; quantised in between."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8))
        self.head = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = StraightThrough.apply(self.features(x), 4.0)
        return self.head(GradReverse.apply(h))


class PlainScale(nn.Module):
    """A learnable scale held as a plain tensor attribute, used in a stage with no Parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = torch.full((1,), 2.0, requires_grad=True)
        self.a = nn.Linear(6, 6)
        self.b = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(torch.tanh(x * self.scale) * self.scale))


#: A learnable tensor the model closes over, neither a Parameter nor an attribute.
_SHIFT = torch.full((6,), 0.5, dtype=torch.float64, requires_grad=True)


class HeldTensors(nn.Module):
    """A buffer that requires grad and a closed-over tensor, each in a stage of its own."""

    def __init__(self) -> None:
        super().__init__()
        gain = torch.full((6,), 1.5, dtype=torch.float64, requires_grad=True)
        self.register_buffer("gain", gain)
        self.a = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.sin(x * self.gain)
        return self.a(torch.cos(h + _SHIFT) * self.gain)


@torch.fx.wrap
def add_into(x: torch.Tensor, shortcut: torch.Tensor) -> None:
    """Adds ``shortcut`` into ``x`` in place and returns nothing (torchvision's MViT writes
    its residual this way, from a function fx keeps as one call)."""
    x[:, 1:] += shortcut[:, 1:]


class WritesInPlace(nn.Module):
    """A leaf function writes into values other nodes read later."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 6)
        self.b = nn.Linear(6, 6)
        self.c = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        g = torch.tanh(h)
        add_into(h, g)
        k = torch.sin(h) * 2
        add_into(k, torch.cos(g))
        return self.c(self.b(k) + torch.cos(k) + h)


class ReturnsItsInput(nn.Module):
    """Identity modules (a drop-path at rate 0 returns its input as it is) whose output is
    then written in place: a ReLU(inplace=True), and an addition that is not idempotent."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 6)
        self.keep = nn.Identity()
        self.act = nn.ReLU(inplace=True)
        self.b = nn.Linear(6, 6)
        self.same = nn.Identity()
        self.c = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act(self.keep(self.a(x)))
        g = self.same(self.b(h))
        g.add_(torch.tanh(h))
        return self.c(g)


class CumulativeNorm(nn.Module):
    """A BatchNorm with ``momentum=None`` (cumulative average) as the model's output."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 6)
        self.norm = nn.BatchNorm1d(6, momentum=None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.a(x))


class Segmenter(nn.Module):
    """Returns an OrderedDict, as torchvision's segmentation models do."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(6, 6)
        self.out = nn.Linear(6, 3)
        self.aux = nn.Linear(6, 2)

    def forward(self, x: torch.Tensor) -> collections.OrderedDict[str, torch.Tensor]:
        h = torch.relu(self.body(x))
        return collections.OrderedDict(out=self.out(h), aux=self.aux(h))


def _loss(out: Any) -> torch.Tensor:
    leaves = list(out.values()) if isinstance(out, dict) else [out]
    weights = torch.Generator().manual_seed(3)
    total = torch.zeros((), dtype=leaves[0].dtype)
    for y in leaves:
        total = total + (y * torch.randn(y.shape, generator=weights, dtype=y.dtype)).sum()
    return total


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    tensors = dict(model.named_parameters())
    tensors.update(model.named_buffers())
    tensors.update({k: v for k, v in vars(model).items() if isinstance(v, torch.Tensor)})
    tensors["<closed over>"] = _SHIFT
    grads = {k: v.grad.clone() for k, v in tensors.items() if v.grad is not None}
    _SHIFT.grad = None
    return grads


def _eager(model: nn.Module, x: torch.Tensor, chunks: int = 1) -> tuple[Any, dict[str, Any]]:
    """Eager outputs and gradients, micro-batch by micro-batch where ``chunks`` > 1."""
    outs = [model(part) for part in x.tensor_split(chunks)]
    if isinstance(outs[0], dict):
        out: Any = type(outs[0])((k, torch.cat([o[k] for o in outs])) for k in outs[0])
    else:
        out = torch.cat(outs)
    _loss(out).backward()
    return out, _grads(model)


def _pipelined(
    model: nn.Module, x: torch.Tensor, tracer: str, checkpoint: str, stages: int
) -> tuple[Any, dict[str, Any]]:
    # Stages with the cheap elementwise ops priced high, so that a stage holds no
    # Parameter and the learnable attribute or the Function sit on a border.
    cost: Callable[[torch.fx.Node], float] = lambda n: 1.0 if n.op == "call_module" else 5.0
    pipe = fxpipe.pipeline(
        model, x, ["cpu"] * stages, chunks=4, checkpoint=checkpoint, tracer=tracer, cost=cost
    )
    out = pipe(x)
    _loss(out).backward()
    return out, _grads(model)


def _assert_equal(got: tuple[Any, dict[str, Any]], want: tuple[Any, dict[str, Any]]) -> None:
    out, grads = got
    want_out, want_grads = want
    assert type(out) is type(want_out)
    if isinstance(want_out, dict):
        assert list(out) == list(want_out)
        pairs = [(out[k], want_out[k]) for k in want_out]
    else:
        pairs = [(out, want_out)]
    for a, b in pairs:
        assert relative_error(a, b) < 1e-6
    assert set(grads) == set(want_grads)
    for name, g in want_grads.items():
        assert relative_error(grads[name], g) < 1e-6, name


def _compare(
    factory: type[nn.Module], tracer: str, checkpoint: str, chunks: int = 1, stages: int = 3
) -> None:
    torch.manual_seed(0)
    model = factory().double()
    twin = copy.deepcopy(model)
    x = torch.randn(8, 6, dtype=torch.float64)
    want = _eager(twin, x, chunks)
    _assert_equal(_pipelined(model, x, tracer, checkpoint, stages), want)


@pytest.mark.parametrize("checkpoint", CHECKPOINTS)
def test_custom_function_keeps_its_backward_under_fx(checkpoint: str) -> None:
    _compare(Adversarial, "fx", checkpoint)


def test_custom_function_is_one_node() -> None:
    torch.manual_seed(0)
    plan = fxpipe.plan(Adversarial(), torch.randn(8, 6), ["cpu"] * 2, tracer="fx", cost="flops")
    targets = [str(n.target) for n in plan.graph_module.graph.nodes if n.op == "call_function"]
    assert any("GradReverse_apply" in t for t in targets), targets
    assert not any("view_as" in t for t in targets), targets


def test_custom_function_is_refused_by_export() -> None:
    model = Adversarial()
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(TraceError, match="StraightThrough.*lose its backward.*tracer='fx'"):
        fxpipe.pipeline(model, torch.randn(8, 6), ["cpu"] * 2, tracer="export")
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("tracer", TRACERS)
def test_function_whose_backward_is_its_derivative_is_accepted(tracer: str) -> None:
    # Export records its forward's ops; probed on random values, their derivative is the
    # Function's own backward, so the graph's gradients are eager's.
    _compare(HandWritten, tracer, "except_last")


@pytest.mark.parametrize("tracer", TRACERS)
def test_custom_op_with_registered_backward_is_kept(tracer: str) -> None:
    # torch.library runs the op's backward through a Function of its own: not refused.
    _compare(CustomOp, tracer, "except_last")


@pytest.mark.parametrize("tracer", TRACERS)
@pytest.mark.parametrize("checkpoint", CHECKPOINTS)
def test_plain_tensor_that_requires_grad(tracer: str, checkpoint: str) -> None:
    _compare(PlainScale, tracer, checkpoint)


@pytest.mark.parametrize("tracer", TRACERS)
@pytest.mark.parametrize("checkpoint", CHECKPOINTS)
def test_buffer_and_closed_over_tensor_that_require_grad(tracer: str, checkpoint: str) -> None:
    _compare(HeldTensors, tracer, checkpoint)


def test_tracing_adds_no_attribute_to_the_model() -> None:
    model = HeldTensors().double()
    before = set(vars(model))
    fxpipe.plan(model, torch.randn(4, 6, dtype=torch.float64), ["cpu"] * 2, tracer="fx")
    assert set(vars(model)) == before


@pytest.mark.parametrize("stages", (2, 3, 4, 5))
def test_writes_in_place_stay_before_later_readers(stages: int) -> None:
    # Every node priced alike: across these stage counts the borders fall between the
    # writes and the nodes that read the written values afterwards.
    torch.manual_seed(0)
    model = WritesInPlace().double()
    x = torch.randn(8, 6, dtype=torch.float64)
    want = _eager(copy.deepcopy(model), x)
    pipe = fxpipe.pipeline(model, x, ["cpu"] * stages, chunks=2, tracer="fx", cost=lambda n: 1.0)
    out = pipe(x)
    _loss(out).backward()
    _assert_equal((out, _grads(model)), want)


@pytest.mark.parametrize("stages", (2, 3, 4))
@pytest.mark.parametrize("checkpoint", ("always", "except_last"))
def test_writes_into_what_a_module_returned_as_it_was(stages: int, checkpoint: str) -> None:
    # A border between an identity module and the in-place op after it would hand the op
    # a stage input: a leaf under recompute, and a saved input written twice.
    torch.manual_seed(0)
    model = ReturnsItsInput().double()
    x = torch.randn(8, 6, dtype=torch.float64)
    want = _eager(copy.deepcopy(model), x)
    pipe = fxpipe.pipeline(
        model,
        x,
        ["cpu"] * stages,
        chunks=2,
        checkpoint=checkpoint,
        tracer="fx",
        cost=lambda n: 1.0,
    )
    out = pipe(x)
    _loss(out).backward()
    _assert_equal((out, _grads(model)), want)


@pytest.mark.parametrize("checkpoint", CHECKPOINTS)
def test_cumulative_batch_norm_output_matches_micro_batches(checkpoint: str) -> None:
    # GPipe normalises each micro-batch on its own: the oracle is eager on the same 4 parts.
    _compare(CumulativeNorm, "fx", checkpoint, chunks=4, stages=2)


def test_cumulative_batch_norm_running_stats_with_deferred_batch_norm() -> None:
    torch.manual_seed(0)
    model = CumulativeNorm().double()
    twin = copy.deepcopy(model)
    x = torch.randn(8, 6, dtype=torch.float64)
    twin(x)
    pipe = fxpipe.pipeline(model, x, ["cpu"] * 2, chunks=4, deferred_batch_norm=True)
    pipe(x)
    for name in ("running_mean", "running_var", "num_batches_tracked"):
        got, want = getattr(model.norm, name), getattr(twin.norm, name)
        assert relative_error(got.double(), want.double()) < 1e-6, name


@pytest.mark.parametrize("tracer", TRACERS)
@pytest.mark.parametrize("checkpoint", ("never", "except_last"))
def test_ordered_dict_output_stays_ordered_dict(tracer: str, checkpoint: str) -> None:
    _compare(Segmenter, tracer, checkpoint)
