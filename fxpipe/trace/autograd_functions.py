"""Custom ``torch.autograd.Function`` calls: one whole graph node under fx, refused under export.

Both tracers run a Function's ``forward`` as plain code and record the ops it performs, so
the graph would differentiate those ops and never call the Function's own ``backward``: a
gradient reversal layer would give gradients of the wrong sign, a straight-through
estimator zero gradients. Under torch.fx, :func:`functions_kept_whole` records each call
as one ``call_function`` node that calls ``Function.apply`` at run time (forward and
backward whole, and one node, so no stage border splits it). Under torch.export,
:func:`functions_recorded` notes every call that could need a backward, and
:func:`backward_is_derivative` probes each on random values: a Function whose backward is
just the derivative of its forward (a hand-written GELU) is safe to record as its ops; any
other makes tracing refuse the graph instead of returning wrong gradients.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch.utils._pytree import tree_leaves, tree_map

__all__ = [
    "FunctionCall",
    "functions_kept_whole",
    "functions_recorded",
    "backward_is_derivative",
    "describe_function",
]

_Apply = Callable[..., Any]
#: Where torch.library makes the Function behind a custom op's registered backward; export
#: keeps such an op as one node, backward and all, so its Function is not refused.
_CUSTOM_OP_AUTOGRAD = "torch._library"
#: One run-time target per Function class, so that repeated calls share a target.
_TARGETS: dict[type, _Apply] = {}


def _original_apply() -> Any:
    """The ``apply`` descriptor as torch defines it (a Python classmethod in some torch
    versions, a C ``classmethod_descriptor`` in others)."""
    return torch.autograd.Function.__dict__["apply"]


def _call_original(original: Any, cls: type, args: Any, kwargs: Any) -> Any:
    return original.__get__(None, cls)(*args, **kwargs)


@contextmanager
def _apply_replaced(replacement: Callable[..., Any]) -> Iterator[None]:
    """``torch.autograd.Function.apply`` is ``replacement(cls, *args, **kwargs)`` inside."""
    original = _original_apply()
    torch.autograd.Function.apply = classmethod(replacement)  # type: ignore[assignment,method-assign]
    try:
        yield
    finally:
        torch.autograd.Function.apply = original  # type: ignore[method-assign]


def _run_target(cls: type) -> _Apply:
    """A plain function that calls ``cls.apply``; fx records it as the node's target."""
    target = _TARGETS.get(cls)
    if target is None:

        def target(*args: Any, **kwargs: Any) -> Any:
            return cls.apply(*args, **kwargs)  # type: ignore[attr-defined]

        target.__name__ = target.__qualname__ = f"{cls.__name__}_apply"
        target.__module__ = cls.__module__
        _TARGETS[cls] = target
    return target


@contextmanager
def functions_kept_whole() -> Iterator[None]:
    """While fx traces, a Function applied to traced values becomes one graph node."""
    original = _original_apply()

    def apply(cls: type, *args: Any, **kwargs: Any) -> Any:
        proxies = [x for x in tree_leaves((args, kwargs)) if isinstance(x, fx.Proxy)]
        if not proxies:
            return _call_original(original, cls, args, kwargs)
        tracer = proxies[0].tracer
        return tracer.create_proxy("call_function", _run_target(cls), args, kwargs)

    with _apply_replaced(apply):
        yield


@dataclass(frozen=True)
class FunctionCall:
    """A Function applied while tracing: its class and its arguments, tensors described by
    shape, dtype and whether they required grad (enough to probe it on random values)."""

    cls: type
    args: tuple[Any, ...]


@dataclass(frozen=True)
class _TensorSpec:
    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool


@contextmanager
def functions_recorded(found: list[FunctionCall]) -> Iterator[None]:
    """Append to ``found`` every Function applied, with grad enabled, to a tensor that
    requires grad (the calls whose backward a traced graph would lose)."""
    original = _original_apply()

    def apply(cls: type, *args: Any, **kwargs: Any) -> Any:
        tensors = [x for x in tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
        generated = cls.__module__.startswith(_CUSTOM_OP_AUTOGRAD)
        if torch.is_grad_enabled() and not generated and any(t.requires_grad for t in tensors):
            found.append(FunctionCall(cls, tree_map(_spec, args) if not kwargs else ()))
        return _call_original(original, cls, args, kwargs)

    with _apply_replaced(apply):
        yield


def _spec(value: Any) -> Any:
    if not isinstance(value, torch.Tensor):
        return value
    return _TensorSpec(tuple(map(_size, value.shape)), value.dtype, value.requires_grad)


def _size(dim: Any) -> int:
    """A dimension's example value (export traces the batch as a symbol)."""
    if isinstance(dim, int):
        return dim
    try:
        hint = dim.node.hint
    except Exception:
        hint = None
    return hint if isinstance(hint, int) else 2


def backward_is_derivative(call: FunctionCall) -> bool:
    """Whether the Function's own backward gives the gradients autograd finds through the
    ops of its forward, on random float64 values of the recorded shapes: then a graph that
    records those ops (as torch.export does) differentiates it correctly. Any doubt (a call
    with keyword arguments, a forward that cannot run outside ``apply``) is a no."""
    if not call.args:
        return False
    generator = torch.Generator().manual_seed(0)
    try:
        inputs = tree_map(lambda v: _probe_value(v, generator), call.args)
        with torch.enable_grad():
            own = _gradients(call.cls.apply(*inputs), inputs)  # type: ignore[attr-defined]
            inlined = _gradients(_forward_alone(call.cls, inputs), inputs)
    except Exception:
        return False
    return len(own) == len(inlined) and all(
        (a is None and b is None)
        or (a is not None and b is not None and torch.allclose(a, b, rtol=1e-6, atol=1e-9))
        for a, b in zip(own, inlined)
    )


def _probe_value(value: Any, generator: torch.Generator) -> Any:
    if not isinstance(value, _TensorSpec):
        return value
    if not value.dtype.is_floating_point:
        return torch.zeros(value.shape, dtype=value.dtype)
    t = torch.randn(value.shape, generator=generator, dtype=torch.float64)
    return t.requires_grad_(value.requires_grad)


def _forward_alone(cls: type, inputs: tuple[Any, ...]) -> Any:
    """``cls.forward`` run as plain code (what a tracer records), with a stand-in context."""
    forward: Any = cls.forward  # type: ignore[attr-defined]
    if "setup_context" in vars(cls):
        return forward(*inputs)
    return forward(_Context(), *inputs)


class _Context:
    """Enough of an autograd context for a forward to run outside ``apply``."""

    needs_input_grad: tuple[bool, ...] = ()

    def save_for_backward(self, *tensors: Any) -> None:
        self.saved_tensors = tensors

    def mark_dirty(self, *tensors: Any) -> None:
        pass

    def mark_non_differentiable(self, *tensors: Any) -> None:
        pass

    def set_materialize_grads(self, value: bool) -> None:
        pass


def _gradients(output: Any, inputs: tuple[Any, ...]) -> list[torch.Tensor | None]:
    """Gradients of a fixed random weighting of ``output`` with respect to ``inputs``."""
    outs = [y for y in tree_leaves(output) if isinstance(y, torch.Tensor) and y.requires_grad]
    wrt = [x for x in tree_leaves(inputs) if isinstance(x, torch.Tensor) and x.requires_grad]
    generator = torch.Generator().manual_seed(1)
    total = sum((y * torch.randn(y.shape, generator=generator, dtype=y.dtype)).sum() for y in outs)
    if not isinstance(total, torch.Tensor):
        return [None for _ in wrt]
    return list(torch.autograd.grad(total, wrt, allow_unused=True))


def describe_function(cls: type) -> str:
    """``Name (file.py:line)`` of a Function class, for messages."""
    try:
        path = inspect.getsourcefile(cls) or "?"
        line = inspect.getsourcelines(cls)[1]
    except (OSError, TypeError):
        return cls.__qualname__
    return f"{cls.__qualname__} ({path.rsplit('/', 1)[-1]}:{line})"
