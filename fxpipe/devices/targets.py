"""Parses the ``devices`` argument and tells how much memory each device has."""

from __future__ import annotations

import os
from collections.abc import Sequence
from itertools import chain
from typing import Any

import torch
from torch import nn

from fxpipe.errors import DeviceError

__all__ = ["normalize_devices", "parse_device", "device_capacity", "same_device", "model_device"]


def parse_device(value: Any, *, require_present: bool = True) -> torch.device:
    """``"cuda:1"``, ``1`` (a CUDA index) or a ``torch.device`` as a ``torch.device``."""
    try:
        if isinstance(value, bool):
            raise TypeError("a bool is not a device")
        if isinstance(value, int):
            device = torch.device("cuda", value)
        elif isinstance(value, (str, torch.device)):
            device = torch.device(value)
        else:
            raise TypeError(f"{type(value).__name__} is not a device")
    except (RuntimeError, TypeError, ValueError) as e:
        raise DeviceError(
            f"device {value!r} is not a device ({e}); use a string such as 'cpu' or "
            "'cuda:0', a CUDA index, or a torch.device"
        ) from e
    if device.type == "cpu" and device.index not in (None, 0):
        raise DeviceError(
            f"device {value!r} names CPU {device.index}, but the CPU is one device (index 0); "
            "write 'cpu', and repeat it for several stages on the CPU: ['cpu', 'cpu']"
        )
    if device.type == "cuda" and require_present:
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        index = device.index if device.index is not None else 0
        if index >= count:
            raise DeviceError(
                f"device {value!r} is not present: this machine has {count} CUDA device(s); "
                "pick from those, or use 'cpu' stages"
            )
        device = torch.device("cuda", index)
    elif device.type not in ("cpu", "cuda", "meta") and require_present:
        raise DeviceError(f"device {value!r} ({device.type}) is not supported; use cpu or cuda")
    return device


def normalize_devices(devices: Any, *, require_present: bool = True) -> tuple[torch.device, ...]:
    """One ``torch.device`` per stage; raises DeviceError for an empty or malformed list."""
    _refuse_one_value(devices)
    try:
        items = list(devices)
    except TypeError as e:
        raise DeviceError(
            f"devices={devices!r} is not a list of devices; pass one device per stage, "
            "e.g. ['cpu', 'cpu'] or ['cuda:0', 'cuda:1']"
        ) from e
    if not items:
        raise DeviceError("devices=[] is empty; pass one device per stage, e.g. ['cpu', 'cpu']")
    return tuple(parse_device(d, require_present=require_present) for d in items)


def _refuse_one_value(devices: Any) -> None:
    """A DeviceError for a single string, index or device where a list of them belongs."""
    if isinstance(devices, str) and "," in devices:
        items = [d.strip() for d in devices.split(",") if d.strip()]
        raise DeviceError(
            f"devices={devices!r} is one string; pass a list with one device per stage: {items!r}"
        )
    if isinstance(devices, int) and not isinstance(devices, bool) and devices > 0:
        raise DeviceError(
            f"devices={devices!r} is one CUDA index, not a count; pass one device per stage: "
            f"{list(range(devices))!r} for the first {devices} GPUs, or ['cpu'] * {devices}"
        )
    if isinstance(devices, (str, int, torch.device)) and not isinstance(devices, bool):
        raise DeviceError(
            f"devices={devices!r} is one device; pass a list with one device per stage, "
            f"e.g. [{devices!r}, {devices!r}]"
        )


def same_device(a: torch.device, b: torch.device) -> bool:
    """``cpu`` equals ``cpu:0``; CUDA devices compare by index."""
    if a.type != b.type:
        return False
    if a.type == "cpu":
        return True
    return (a.index or 0) == (b.index or 0)


def device_capacity(devices: Sequence[torch.device]) -> list[int | None]:
    """Bytes of memory of each device (``None`` when unknown, e.g. ``meta``, or a GPU this
    machine does not have)."""
    out: list[int | None] = []
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for d in devices:
        if d.type == "cuda" and (d.index or 0) < count:
            out.append(int(torch.cuda.get_device_properties(d).total_memory))
        elif d.type == "cpu":
            out.append(_physical_memory())
        else:
            out.append(None)
    return out


def _physical_memory() -> int | None:
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return None


def model_device(model: nn.Module) -> torch.device | None:
    """The device every parameter and buffer of ``model`` lives on; None where they live on
    several, or on ``meta``."""
    found = {t.device for t in chain(model.parameters(), model.buffers())}
    if len(found) != 1:
        return None
    (device,) = found
    return None if device.type == "meta" else device
