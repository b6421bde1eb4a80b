"""Trace errors say the reason that matters first and stay informative where torch raised an
exception with no message."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import fxpipe
from fxpipe.errors import TraceError

pytestmark = pytest.mark.usefixtures("one_thread")

HERE = __file__.rsplit("/", 1)[-1]


def passes_through(forward: Callable[..., Any]) -> Callable[..., Any]:
    """A decorator as Hugging Face's ``can_return_tuple``: a ``(self, *args, **kwargs)``
    wrapper of forward."""

    @functools.wraps(forward)
    def wrapper(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        return forward(self, *args, **kwargs)

    return wrapper


class Decorated(nn.Module):
    """A decorated forward (torch.fx cannot bind it) that branches on a tensor's value
    (torch.export cannot trace it)."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(4, 4)

    @passes_through
    def forward(self, x: torch.Tensor, mask: Any = None, **kwargs: Any) -> torch.Tensor:
        h = self.gate(x)
        if h.sum() > 0:  # the branch
            return h * 2
        return h


def _line_of(function: Callable[..., Any], text: str) -> int:
    lines, start = inspect.getsourcelines(function)
    return start + next(i for i, line in enumerate(lines) if text in line)


def test_auto_says_exports_reason_first_where_fx_cannot_bind_the_forward() -> None:
    with pytest.raises(TraceError) as info:
        fxpipe.plan(Decorated(), torch.randn(4, 4), ["cpu"] * 2, cost="flops")
    lines = str(info.value).splitlines()
    branch = _line_of(Decorated.forward.__wrapped__, "# the branch")
    assert lines[1].startswith("  export: ") and f"{HERE}:{branch}" in lines[1]
    assert lines[2].startswith("  fx: torch.fx cannot trace Decorated.forward")
    assert "passes_through.<locals>.wrapper(self, *args, **kwargs)" in lines[2]
    assert "co_varnames is too small" in lines[2]  # fx's own words, after the reason
    assert "control flow" in lines[3] and "tracer='fx' is no alternative" in lines[3]


def test_fx_alone_that_cannot_bind_the_forward_points_to_export() -> None:
    with pytest.raises(TraceError, match=r"remedy: pass tracer='export'"):
        fxpipe.plan(Decorated(), torch.randn(4, 4), ["cpu"] * 2, cost="flops", tracer="fx")


def test_the_remedy_for_a_forward_fx_cannot_bind_works() -> None:
    """tracer='export' traces the decorated forward once its branch is on shapes."""

    class Fixed(Decorated):
        @passes_through
        def forward(self, x: torch.Tensor, mask: Any = None, **kwargs: Any) -> torch.Tensor:
            h = self.gate(x)
            return torch.where(h.sum(-1, keepdim=True) > 0, h * 2, h)  # per sample

    model = Fixed()
    x = torch.randn(6, 4)
    pipe = fxpipe.pipeline(model, x, ["cpu"] * 2, cost="flops", tracer="export", chunks=2)
    torch.testing.assert_close(pipe(x), model(x))


# ------------------------------------------------ an exception with no message, inside torch


@torch.library.custom_op("fxpipe_tests::silent", mutates_args=())
def silent(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@silent.register_fake
def _silent_fake(x: torch.Tensor) -> torch.Tensor:
    raise RuntimeError()


def fails_silently(x: torch.Tensor) -> torch.Tensor:
    raise RuntimeError()


class Inner(nn.Module):
    def __init__(self, body: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.body = body

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(self.lin(x))  # the call


class Outer(nn.Module):
    def __init__(self, body: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.pre = nn.Linear(4, 4)
        self.inner = Inner(body)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(self.pre(x))


def _checkpointed(x: torch.Tensor) -> torch.Tensor:
    return checkpoint(fails_silently, x, use_reentrant=False)  # type: ignore[no-any-return]


def _reasons(body: Callable[[torch.Tensor], torch.Tensor], tracer: str) -> dict[str, str]:
    """Each tracer's line of the TraceError, and its remedy (under "remedy")."""
    with pytest.raises(TraceError) as info:
        fxpipe.plan(Outer(body), torch.randn(4, 4), ["cpu"] * 2, cost="flops", tracer=tracer)
    lines = str(info.value).splitlines()[1:]
    return {line.split(":")[0].strip(): line for line in lines}


def test_an_op_that_raises_no_message_under_export_is_named_with_module_and_line() -> None:
    reasons = _reasons(silent, "export")
    line = reasons["export"]
    assert "RuntimeError with no message" in line
    assert f"raised in {HERE}:{_line_of(_silent_fake, 'raise RuntimeError()')}" in line
    assert "while torch.export ran op torch.ops.fxpipe_tests.silent" in line
    call = _line_of(Inner.forward, "# the call")
    assert f"(in module 'inner', {HERE}:{call} in forward: return self.body(" in line
    assert "a fake kernel (torch.library.register_fake)" in reasons["remedy"]


def test_a_function_that_raises_no_message_inside_torch_is_described_for_both_tracers() -> None:
    reasons = _reasons(_checkpointed, "auto")
    assert list(reasons) == ["fx", "export", "remedy"]
    raised = f"raised in {HERE}:{_line_of(fails_silently, 'raise RuntimeError()')} in fails"
    for line in (reasons["fx"], reasons["export"]):
        assert "RuntimeError with no message" in line and raised in line
        assert "inside torch.utils.checkpoint.checkpoint" in line
        assert "(in module 'inner'" in line
    assert "after node 'inner_lin' (call_module inner.lin)" in reasons["fx"]
