"""fxpipe.distributed.rank.split_backward: the weight part of a zero-bubble stage's backward,
against eager autograd on the same stage, after torch's own input part."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from models import ZOO
from torch import nn
from torch.distributed.pipelining._backward import stage_backward_input

from fxpipe.distributed.rank.split_backward import (
    disjoint_param_groups,
    stage_graph,
    weight_gradients,
    weight_side,
)
from fxpipe.errors import StageError


def split_backward(module: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, list[Any]]:
    """One stage's backward as a zero-bubble schedule runs it: torch's input part, then
    fxpipe's weight part. Returns the input's gradient and the groups the weight part ran."""
    x = x.detach().requires_grad_()
    params = list(module.parameters())
    for p in params:
        p.grad = None
    out = [module(x).square().sum()]
    graph = stage_graph(out, [x])
    (dx,), groups = stage_backward_input(out, None, [x], iter(params))
    groups = weight_side(disjoint_param_groups(groups), graph)
    ran = [set(g["params"]) for g in groups]
    weight_gradients(iter(params), groups)
    return dx, ran


def assert_eager(module: nn.Module, x: torch.Tensor) -> list[Any]:
    """The split backward's input and Parameter gradients equal eager's."""
    xr = x.detach().requires_grad_()
    params = list(module.parameters())
    want = torch.autograd.grad(module(xr).square().sum(), [xr, *params])
    dx, groups = split_backward(module, x)
    torch.testing.assert_close(dx, want[0], rtol=1e-12, atol=1e-12)
    for (name, p), w in zip(module.named_parameters(), want[1:], strict=True):
        assert p.grad is not None, name
        torch.testing.assert_close(p.grad, w, rtol=1e-12, atol=1e-12, msg=name)
    return groups


class ThreeOffsets(nn.Module):
    """``a`` and ``b`` each meet the input at their own node, ``p`` at both: torch's input
    part groups them as {a, p} and {b, a, p}, so a and p were counted twice."""

    def __init__(self, op: Callable[..., torch.Tensor]) -> None:
        super().__init__()
        self.op = op
        self.a, self.b, self.p = (nn.Parameter(torch.randn(3, dtype=torch.double)) for _ in "abp")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        u, v = self.op(x, self.a + self.p), self.op(x, self.b + self.p)
        return u * 1.5 + v * v


@pytest.mark.parametrize("op", [torch.add, torch.mul], ids=["add", "mul"])
def test_groups_sharing_a_parameter_are_merged_and_count_it_once(op: Callable[..., Any]) -> None:
    """Addition saves no tensor, so torch's weight part added a's and p's gradients twice,
    silently; multiplication saves some, so it crashed. Both equal eager here."""
    torch.manual_seed(0)
    groups = assert_eager(ThreeOffsets(op), torch.randn(4, 3, dtype=torch.double))
    seen: set[Any] = set()
    for params in groups:
        assert not params & seen
        seen |= params


class Twice(nn.Module):
    """One weight used twice in a row: its two nodes lie on one path."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(3, 3, dtype=torch.double) / 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.w @ self.w


class Counted(torch.autograd.Function):
    """Identity that counts how often its backward runs."""

    calls = 0

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        Counted.calls += 1
        return grad


class CountedBlocks(nn.Module):
    """``shared_offsets``' pattern with an activation between blocks that counts its
    backward runs: torch's weight part ran backward from block 2's offset node down through
    block 1 to the shared offset's other node."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.ModuleList(nn.Linear(4, 4, dtype=torch.double) for _ in range(3))
        self.offsets = nn.ParameterList(
            nn.Parameter(torch.randn(4, dtype=torch.double)) for _ in range(3)
        )
        self.shared = nn.Parameter(torch.randn(4, dtype=torch.double))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for fc, offset in zip(self.fc, self.offsets, strict=True):
            x = torch.tanh(Counted.apply(fc(x) + (offset + self.shared)))  # type: ignore[no-untyped-call]
        return x


def test_a_weight_used_twice_in_a_row_gets_eagers_gradient() -> None:
    torch.manual_seed(0)
    assert_eager(Twice(), torch.randn(5, 3, dtype=torch.double))


def test_the_weight_part_runs_no_activation_backward_again() -> None:
    torch.manual_seed(0)
    model, x = CountedBlocks(), torch.randn(5, 4, dtype=torch.double)
    Counted.calls = 0
    dx, _ = split_backward(model, x)
    assert Counted.calls == 3  # the input part's, once per block
    Counted.calls = 0
    assert_eager(model, x)


@pytest.mark.parametrize("name", ["shared_offsets", "shared_module", "routed_experts"])
def test_zoo_stages_get_eagers_gradients(name: str) -> None:
    """Whole zoo models as one stage: a Parameter shared by every block, a block called at
    two depths, gates gathered from a Parameter by a routing index."""
    case = ZOO[name]
    model = case.build().double()
    (x,), _ = case.example(case.batch)
    assert_eager(model, x.double())


class NonTensorArgument(torch.autograd.Function):
    """``scale * x + y`` with ``scale`` a float between the two tensors."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, scale: float, y: torch.Tensor) -> torch.Tensor:
        ctx.scale = scale
        return x * scale + y

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        return grad * ctx.scale, None, grad


class WithFunction(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(3, dtype=torch.double))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.w * 3  # used twice: the weight part calls the Function's node itself
        return NonTensorArgument.apply(x, 2.0, y) * y  # type: ignore[no-untyped-call]


class WithFunctionOnce(WithFunction):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return NonTensorArgument.apply(x, 2.0, self.w * 3)  # type: ignore[no-untyped-call]


class AmbiguousFunction(torch.autograd.Function):
    """A backward that returns None for a tensor input as well as for the float: which of
    its results goes to which input cannot be told from the results alone (this matters
    only where the weight part calls the node itself: a value it reads is used twice)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, scale: float, y: torch.Tensor) -> torch.Tensor:
        return x.detach() * scale + y

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        return None, None, grad


class WithAmbiguousFunction(WithFunction):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.w * 3
        return AmbiguousFunction.apply(x, 2.0, y) * y  # type: ignore[no-untyped-call]


@pytest.mark.parametrize("model_type", [WithFunction, WithFunctionOnce])
def test_a_custom_function_with_a_non_tensor_argument_lines_up(model_type: type) -> None:
    torch.manual_seed(0)
    assert_eager(model_type(), torch.randn(4, 3, dtype=torch.double))


def test_a_custom_function_that_cannot_be_lined_up_is_refused_by_name() -> None:
    torch.manual_seed(0)
    with pytest.raises(StageError, match=r"AmbiguousFunctionBackward.*'1f1b'"):
        split_backward(WithAmbiguousFunction(), torch.randn(4, 3, dtype=torch.double))
