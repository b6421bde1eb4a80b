"""One TraceError from every failed tracer: the construct, module path, file:line, remedy."""

from __future__ import annotations

import os
import traceback
import types

import torch
from torch import nn

from fxpipe.errors import TraceError

__all__ = ["trace_error"]


def trace_error(model: nn.Module, failures: list[tuple[str, BaseException]]) -> TraceError:
    lines = []
    for name, e in failures:
        where = _where(model, e)
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        lines.append(f"  {name}: {type(e).__name__}: {first}{where}")
    return TraceError(
        f"could not trace {type(model).__name__}:\n"
        + "\n".join(lines)
        + "\nremedy: "
        + _remedy(failures)
    )


#: What a failure's text says when the model returns a key/value cache for generation.
_CACHE_WORDS = ("Cache'>", "Cache in output", "past_key_values")


def _remedy(failures: list[tuple[str, BaseException]]) -> str:
    """What to change, from what the tracers said."""
    text = " ".join(str(e) for _, e in failures)
    if any(word in text for word in _CACHE_WORDS):
        return (
            "the model returns a key/value cache for generation (a Hugging Face Cache "
            "object), which is not a batch of tensors a pipeline can join: build and call "
            "it without one, use_cache=False (model.config.use_cache = False, or "
            "use_cache=False in example_kwargs and in every call)"
        )
    return (
        "remove Python control flow that depends on tensor values from forward "
        "(use torch.where / torch.cond), or make the failing module a leaf; try "
        "tracer='export' for control flow on shapes"
    )


def _where(model: nn.Module, e: BaseException) -> str:
    """The innermost module of ``model`` whose forward was running when ``e`` was raised."""
    paths = {id(m): p for p, m in model.named_modules()}
    torch_dir = os.path.dirname(torch.__file__)
    found = None
    for frame, lineno in _frames(e):
        code = frame.f_code
        owner = frame.f_locals.get(code.co_varnames[0]) if code.co_argcount else None
        if code.co_filename.startswith(torch_dir):
            continue
        if isinstance(owner, nn.Module) and id(owner) in paths:
            path = paths[id(owner)] or "<root>"
            found = f" (in module '{path}', {_frame_text(frame, lineno)})"
    return found or ""


def _frames(e: BaseException) -> list[tuple[types.FrameType, int]]:
    """Frames of ``e``'s traceback and of the exceptions it was raised from."""
    frames: list[tuple[types.FrameType, int]] = []
    seen: set[int] = set()
    current: BaseException | None = e
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        frames[:0] = list(traceback.walk_tb(current.__traceback__))
        current = current.__cause__ or current.__context__
    return frames


def _frame_text(frame: types.FrameType, lineno: int) -> str:
    code = frame.f_code
    return f"{code.co_filename.rsplit('/', 1)[-1]}:{lineno} in {code.co_name}"
