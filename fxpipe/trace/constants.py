"""Constants a model makes in forward: their values in a trace on ``meta``, copies per device."""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from fxpipe.devices.targets import same_device

__all__ = ["fill_meta_constants", "place_constants"]

#: The innermost ``File "...", line N, in f`` of a node's recorded stack trace.
_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\S+)')


def fill_meta_constants(
    gm: fx.GraphModule, sources: Sequence[fx.GraphModule], model: nn.Module
) -> None:
    """Give each constant of ``gm`` that was made on ``meta`` (a tensor the model's code makes
    in forward, which a trace on ``meta`` keeps without values) the values of the same
    constant in a real-valued trace of the same model among ``sources``: the one of the same
    module, shape and dtype read by a node from the same source line, in the same order
    among such. A constant no source has stays on ``meta`` (refused before it runs:
    :func:`fxpipe.runtime.variants.check_placement`)."""
    state = _state_ids(model)
    known: dict[tuple[Any, ...], list[torch.Tensor]] = {}
    for source in sources:
        found: dict[tuple[Any, ...], list[torch.Tensor]] = {}
        for key, _, value in _constants(source, state):
            found.setdefault(key, []).append(value)
        for key, values in found.items():
            if all(not v.is_meta for v in values):
                known.setdefault(key, values)
    wanted: dict[tuple[Any, ...], list[tuple[str, torch.Tensor]]] = {}
    for key, name, value in _constants(gm, state):
        wanted.setdefault(key, []).append((name, value))
    for key, constants in wanted.items():
        values = known.get(key, [])
        for i, (name, value) in enumerate(constants):
            # another count of such constants: not the same ones, so none is taken
            if value.is_meta and len(values) == len(constants):
                _assign(gm, name, values[i])


def place_constants(
    program_modules: Sequence[nn.Module], devices: Sequence[torch.device], model: nn.Module
) -> None:
    """Give each stage a copy on its device of every constant it reads that lives on another
    (one made in forward, whose values a trace on another device holds); the model's own
    tensors, and tensors that require grad (which the model owns), stay as they are."""
    state = _state_ids(model)
    for module, device in zip(program_modules, devices, strict=True):
        if not isinstance(module, fx.GraphModule):
            continue
        for node in module.graph.nodes:
            if node.op != "get_attr":
                continue
            value = _attribute(module, str(node.target))
            if not _is_constant(value, state) or value.is_meta or device.type == "meta":
                continue
            if not same_device(value.device, device):
                _assign(module, str(node.target), value.to(device))


def _constants(
    gm: fx.GraphModule, state: set[int]
) -> Iterator[tuple[tuple[Any, ...], str, torch.Tensor]]:
    """(key, name, value) of every constant ``gm`` reads, in graph order; the key is what a
    constant is matched by: its module, shape, dtype and the source line that reads it."""
    seen: set[str] = set()
    for node in gm.graph.nodes:
        name = str(node.target)
        if node.op != "get_attr" or name in seen:
            continue
        seen.add(name)
        value = _attribute(gm, name)
        if not _is_constant(value, state):
            continue
        owner = name.rpartition(".")[0]
        key = (owner, tuple(value.shape), value.dtype, _read_at(node))
        yield key, name, value


def _read_at(node: fx.Node) -> tuple[str, ...]:
    """The source lines (file, line, function) of the nodes that read ``node``, as the trace
    recorded them; empty where it recorded none."""
    places = []
    for user in node.users:
        frames = _FRAME.findall(str(user.meta.get("stack_trace") or ""))
        if frames:
            places.append(":".join(frames[-1]))
    return tuple(sorted(set(places)))


def _is_constant(value: Any, state: set[int]) -> bool:
    return isinstance(value, torch.Tensor) and id(value) not in state and not value.requires_grad


def _state_ids(model: nn.Module) -> set[int]:
    tensors = [
        *model.named_parameters(remove_duplicate=False),
        *model.named_buffers(remove_duplicate=False),
    ]
    return {id(t) for _, t in tensors}


def _attribute(module: nn.Module, name: str) -> Any:
    value: Any = module
    for part in name.split("."):
        value = getattr(value, part, None)
    return value


def _assign(module: nn.Module, name: str, value: torch.Tensor) -> None:
    """Point ``module``'s attribute ``name`` (a dotted path; a buffer or a plain attribute)
    at ``value``."""
    owner_path, _, attr = name.rpartition(".")
    owner = module.get_submodule(owner_path)
    if attr in owner._buffers:
        owner._buffers[attr] = value
    else:
        setattr(owner, attr, value)
