"""Where a pipeline's tensors live: every Parameter and buffer a stage holds moved in place to
that stage's device (one on ``meta`` made there), all or nothing."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from fxpipe.devices.targets import same_device
from fxpipe.errors import PlanError
from fxpipe.ir import StageProgram
from fxpipe.weights.materialise import Materialised

__all__ = ["place_parameters"]


def place_parameters(
    model: nn.Module, program: StageProgram, devices: tuple[torch.device, ...]
) -> Materialised:
    """Move every parameter and buffer a stage holds to that stage's device, in place
    (``.data`` is replaced, the objects stay); one on ``meta`` is made there, uninitialised
    (:mod:`fxpipe.weights.materialise`); all or nothing."""
    _check_one_device_each(model, program, devices)
    moved: list[tuple[torch.Tensor, torch.Tensor]] = []
    made = Materialised(model)
    try:
        for module, device in zip(program.modules, devices):
            for tensor in _held_tensors(module):
                if tensor.is_meta and device.type != "meta":
                    made.make(tensor, device)
                elif not same_device(tensor.device, device):
                    moved.append((tensor, tensor.data))
                    tensor.data = tensor.data.to(device)
        made.finish(devices)
    except BaseException:
        for tensor, old in reversed(moved):
            tensor.data = old
        made.undo()
        raise
    return made


def _check_one_device_each(
    model: nn.Module, program: StageProgram, devices: tuple[torch.device, ...]
) -> None:
    """A Parameter or buffer two stages on different devices hold cannot live on both; the
    planner passes such a tensor on from one stage, so this is a planning fault, refused
    before anything moves."""
    home: dict[int, int] = {}
    for j, module in enumerate(program.modules):
        for tensor in _held_tensors(module):
            i = home.setdefault(id(tensor), j)
            if i != j and not same_device(devices[i], devices[j]):
                names = [n for n, t in _named_tensors(model) if t is tensor] or ["a tensor"]
                raise PlanError(
                    f"{names[0]} is held by stage {i} (on {devices[i]}) and stage {j} (on "
                    f"{devices[j]}), so it cannot be placed; this is an fxpipe planning fault: "
                    "report it with the model, and meanwhile pass tracer='export' or put the "
                    "two stages on one device"
                )


def _named_tensors(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    yield from model.named_parameters(remove_duplicate=False)
    yield from model.named_buffers(remove_duplicate=False)


def _held_tensors(module: nn.Module) -> Iterator[torch.Tensor]:
    seen: set[int] = set()
    for t in [*module.parameters(), *module.buffers()]:
        if id(t) not in seen:
            seen.add(id(t))
            yield t
