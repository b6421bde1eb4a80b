"""Custom ``torch.autograd.Function`` calls: one whole graph node under fx, refused under export.

Both tracers run a Function's ``forward`` as plain code and record the ops it performs, so
the graph would differentiate those ops and never call the Function's own ``backward``: a
gradient reversal layer would give gradients of the wrong sign, a straight-through
estimator zero gradients. Under torch.fx, :func:`functions_kept_whole` records each call
as one ``call_function`` node that calls ``Function.apply`` at run time (forward and
backward whole, and one node, so no stage border splits it). Under torch.export,
:func:`functions_recorded` notes every call that could need a backward so that tracing
can refuse the graph instead of returning wrong gradients.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.fx as fx
from torch.utils._pytree import tree_leaves

__all__ = ["functions_kept_whole", "functions_recorded", "describe_function"]

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


@contextmanager
def functions_recorded(found: list[type]) -> Iterator[None]:
    """Append to ``found`` every Function class applied, with grad enabled, to a tensor
    that requires grad (the calls whose backward a traced graph would lose)."""
    original = _original_apply()

    def apply(cls: type, *args: Any, **kwargs: Any) -> Any:
        tensors = [x for x in tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
        generated = cls.__module__.startswith(_CUSTOM_OP_AUTOGRAD)
        if torch.is_grad_enabled() and not generated and any(t.requires_grad for t in tensors):
            found.append(cls)
        return _call_original(original, cls, args, kwargs)

    with _apply_replaced(apply):
        yield


def describe_function(cls: type) -> str:
    """``Name (file.py:line)`` of a Function class, for messages."""
    try:
        path = inspect.getsourcefile(cls) or "?"
        line = inspect.getsourcelines(cls)[1]
    except (OSError, TypeError):
        return cls.__qualname__
    return f"{cls.__qualname__} ({path.rsplit('/', 1)[-1]}:{line})"
