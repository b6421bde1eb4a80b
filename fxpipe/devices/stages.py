"""The devices of a pipeline's stages as planning needs them, worked out once: each stage's
device, its memory budget and its relative speed."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from fxpipe.devices.budgets import (
    MaxMemory,
    Speed,
    parse_max_memory,
    parse_speed,
    stage_budgets,
    stage_speeds,
)
from fxpipe.devices.targets import device_capacity, normalize_devices

__all__ = ["StageDevices", "stage_devices"]


@dataclass(frozen=True)
class StageDevices:
    """One entry per stage, in pipeline order."""

    #: The device each stage runs on (parsed: ``"cuda:1"``, ``1`` and ``torch.device`` alike).
    targets: tuple[torch.device, ...]
    #: The bytes each stage's device may use, shared by the stages on one device (None: not
    #: known, a device absent from this machine).
    budgets: tuple[int | None, ...]
    #: The relative speed of each stage's device, where the user gave them (None: all 1, or
    #: measured per kind of device when the stages span several).
    speeds: tuple[float, ...] | None

    def __len__(self) -> int:
        return len(self.targets)


def stage_devices(
    devices: Any,
    *,
    max_memory: MaxMemory = None,
    speed: Speed = None,
    present: bool = True,
) -> StageDevices:
    """``devices`` parsed (each must exist here where ``present``), with the budgets
    ``max_memory`` gives them (else each present device's capacity) and the speeds ``speed``
    gives them (in any form :mod:`fxpipe.devices.budgets` takes, or its checked form)."""
    targets = normalize_devices(devices, require_present=present)
    budgets = stage_budgets(parse_max_memory(max_memory), targets, device_capacity(targets))
    return StageDevices(targets, tuple(budgets), stage_speeds(parse_speed(speed), targets))
