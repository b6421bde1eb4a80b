"""One TraceError from every failed tracer: the construct, module path, file:line, remedy."""

from __future__ import annotations

import inspect
import linecache
import os
import traceback
import types
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from fxpipe.errors import TraceError

__all__ = ["trace_error"]

_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__))
_FXPIPE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: torch.fx's functions that bind the root forward's arguments, before any of it is traced.
_FX_BINDING = ("create_args_for_root", "_patch_function")


def trace_error(model: nn.Module, failures: list[tuple[str, BaseException]]) -> TraceError:
    """The TraceError for ``failures`` (tracer name, what it raised), in the order tried;
    where torch.fx could not even bind the model's forward (a decorator's wrapper), the
    fallback's failure is the one that matters and comes first."""
    unbindable = any(name == "fx" and _fx_cannot_bind(e) for name, e in failures)
    if unbindable:
        failures = sorted(failures, key=lambda f: f[0] == "fx")
    lines = []
    for name, e in failures:
        if name == "fx" and unbindable:
            lines.append(f"  fx: {_unbound(model, e)}")
        else:
            lines.append(f"  {name}: {_reason(name, e)}{_where(model, e)}")
    return TraceError(
        f"could not trace {type(model).__name__}:\n"
        + "\n".join(lines)
        + "\nremedy: "
        + _remedy(failures, fx_usable=not unbindable)
    )


#: What a failure's text says when the model returns a key/value cache for generation.
_CACHE_WORDS = ("Cache'>", "Cache in output", "past_key_values")


def _remedy(failures: list[tuple[str, BaseException]], *, fx_usable: bool = True) -> str:
    """What to change, from what the tracers said (``fx_usable``: torch.fx could bind the
    forward's arguments, so changing the model can make fx trace it)."""
    text = " ".join(str(e) for _, e in failures)
    if any(word in text for word in _CACHE_WORDS):
        return (
            "the model returns a key/value cache for generation (a Hugging Face Cache "
            "object), which is not a batch of tensors a pipeline can join: build and call "
            "it without one, use_cache=False (model.config.use_cache = False, or "
            "use_cache=False in example_kwargs and in every call)"
        )
    if all(not _first_line(e) for _, e in failures):
        return (
            "make the call named above run on traced values: the tracers run forward on "
            "stand-ins that hold shapes and no values (torch.export's fake tensors, torch.fx's "
            "Proxies); a custom op needs a fake kernel (torch.library.register_fake) that "
            "makes its output from its inputs' shapes"
        )
    if fx_usable:
        return (
            "remove Python control flow that depends on tensor values from forward "
            "(use torch.where / torch.cond), or make the failing module a leaf; try "
            "tracer='export' for control flow on shapes"
        )
    if all(name == "fx" for name, _ in failures):
        return (
            "pass tracer='export' (or 'auto', which falls back to it): torch.export binds "
            "the arguments of such a forward"
        )
    if "would lose its backward" in text:
        return (
            "only torch.fx keeps a custom autograd Function whole, and it cannot trace this "
            "forward (its reason above); for inference, build the pipeline under "
            "torch.no_grad(), where no backward is lost and torch.export traces the model"
        )
    return (
        "change what torch.export names above in forward (Python control flow that depends "
        "on tensor values: use torch.where / torch.cond); torch.fx cannot trace this "
        "forward (its reason above), so tracer='fx' is no alternative"
    )


def _fx_cannot_bind(e: BaseException) -> bool:
    """Whether torch.fx failed while binding the root forward's arguments, before tracing
    any of it: it cannot trace such a forward, whatever its body does."""
    return any(_in_torch(frame) and frame.f_code.co_name in _FX_BINDING for frame, _ in _frames(e))


def _unbound(model: nn.Module, e: BaseException) -> str:
    """Why torch.fx could not bind ``model``'s forward, with what it raised."""
    raised = f"{type(e).__name__}: {_first_line(e) or 'no message'}"
    forward: Any = getattr(type(model), "forward", None)
    code = getattr(forward, "__code__", None)
    if getattr(forward, "__wrapped__", None) is not None and code is not None:
        wrapper = getattr(code, "co_qualname", code.co_name)
        signature = inspect.signature(forward, follow_wrapped=False)
        takes = signature.replace(
            parameters=[p.replace(annotation=p.empty) for p in signature.parameters.values()],
            return_annotation=signature.empty,
        )
        return (
            f"torch.fx cannot trace {type(model).__name__}.forward, which a decorator wraps "
            f"in {wrapper}{takes}: fx reads the parameters of the forward inside but binds "
            f"them to the wrapper's code ({raised})"
        )
    return f"torch.fx could not bind the arguments of {type(model).__name__}.forward ({raised})"


def _reason(tracer: str, e: BaseException) -> str:
    """``Type: first line of the message``; for an exception with no message, where it was
    raised, the op or node being traced then and the message of what it was raised from."""
    first = _first_line(e)
    if first:
        return f"{type(e).__name__}: {first}"
    frames = _frames(e)
    own = list(traceback.walk_tb(e.__traceback__))
    parts = [f"{type(e).__name__} with no message"]
    if own:
        parts.append(f"raised in {_frame_text(*own[-1])}")
    after = frames[_last_module_frame(frames) + 1 :]
    op = next((o for f, _ in after for o in _ops(f)), None)
    entered = min(  # the first torch function entered, past torch's private wrappers
        (f for f, _ in after if _in_torch(f)), key=_private, default=None
    )
    if op is not None:
        parts.append(f"while torch.{tracer} ran op {op}")
    elif entered is not None and (not own or entered is not own[-1][0]):
        module = entered.f_globals.get("__name__", "torch")
        parts.append(f"inside {module}.{entered.f_code.co_name}")
    node = next((n for f, _ in frames for n in _last_nodes(f)), None)
    if node is not None:
        parts.append(f"after node {node.name!r} ({_node_text(node)}) of the graph so far")
    cause = next((c for c in _chain(e)[1:] if _first_line(c)), None)
    if cause is not None:
        parts.append(f"from {type(cause).__name__}: {_first_line(cause)}")
    return ", ".join(parts)


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else ""


def _where(model: nn.Module, e: BaseException) -> str:
    """The innermost module of ``model`` whose forward was running when ``e`` was raised,
    and its line (quoted where ``e`` has no message to say what the model did)."""
    paths = {id(m): p for p, m in model.named_modules()}
    frames = _frames(e)
    index = _last_module_frame(frames, paths)
    if index < 0:
        return ""
    frame, lineno = frames[index]
    path = paths[id(_owner(frame))] or "<root>"
    text = f" (in module '{path}', {_frame_text(frame, lineno)}"
    source = linecache.getline(frame.f_code.co_filename, lineno).strip()
    if source and not _first_line(e):
        text += f": {source}"
    return text + ")"


def _last_module_frame(
    frames: list[tuple[types.FrameType, int]], paths: dict[int, str] | None = None
) -> int:
    """The index of the innermost frame that runs a module's own code (not torch's or
    fxpipe's), of ``model`` where ``paths`` names its modules; -1 where there is none."""
    found = -1
    for i, (frame, _) in enumerate(frames):
        if _in_torch(frame) or frame.f_code.co_filename.startswith(_FXPIPE_DIR):
            continue
        owner = _owner(frame)
        if isinstance(owner, nn.Module) and (paths is None or id(owner) in paths):
            found = i
    return found


def _owner(frame: types.FrameType) -> Any:
    """The frame's first argument (``self`` of a method), or None."""
    code = frame.f_code
    return frame.f_locals.get(code.co_varnames[0]) if code.co_argcount else None


def _ops(frame: types.FrameType) -> list[str]:
    """The torch operators a frame was running (``torch.ops.mylib.op``)."""
    return [
        f"torch.ops.{value}"
        for value in frame.f_locals.values()
        if isinstance(value, (torch._ops.OpOverload, torch._ops.OpOverloadPacket))
    ]


def _last_nodes(frame: types.FrameType) -> list[fx.Node]:
    """The last node of the graph a torch.fx Tracer in the frame was recording."""
    tracer = frame.f_locals.get("self")
    if not isinstance(tracer, fx.Tracer) or not hasattr(tracer, "graph"):
        return []
    nodes = list(tracer.graph.nodes)
    return nodes[-1:]


def _node_text(node: fx.Node) -> str:
    target = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", "")
    return f"{node.op} {target}" if target else node.op


def _private(frame: types.FrameType) -> bool:
    """Whether a frame runs a private function or one of a private module (sorts last)."""
    name = f"{frame.f_globals.get('__name__', '')}.{frame.f_code.co_name}"
    return any(part.startswith("_") for part in name.split("."))


def _in_torch(frame: types.FrameType) -> bool:
    return frame.f_code.co_filename.startswith(_TORCH_DIR)


def _chain(e: BaseException) -> list[BaseException]:
    """``e`` and the exceptions it was raised from, outermost first."""
    chain: list[BaseException] = []
    current: BaseException | None = e
    while current is not None and all(current is not c for c in chain):
        chain.append(current)
        current = current.__cause__ or current.__context__
    return chain


def _frames(e: BaseException) -> list[tuple[types.FrameType, int]]:
    """Frames of ``e``'s traceback and of the exceptions it was raised from."""
    frames: list[tuple[types.FrameType, int]] = []
    for current in _chain(e):
        frames[:0] = list(traceback.walk_tb(current.__traceback__))
    return frames


def _frame_text(frame: types.FrameType, lineno: int) -> str:
    """``file.py:12 in forward``; torch's files by their path in torch (``torch/fx/proxy.py``)."""
    code = frame.f_code
    if _in_torch(frame):
        where = "torch/" + os.path.relpath(code.co_filename, _TORCH_DIR).replace(os.sep, "/")
    else:
        where = code.co_filename.rsplit("/", 1)[-1]
    return f"{where}:{lineno} in {code.co_name}"
