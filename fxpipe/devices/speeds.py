"""How fast each stage's device is, relative to the first stage's: measured per kind of device.

``speed=`` declares it (:mod:`fxpipe.devices.budgets` parses it). Otherwise, when the stages span
more than one kind of device (two GPU models, or a GPU and the CPU) and the cost mode
prices a device (``"time"`` profiles on it, ``"roofline"`` prices its roofline), the model
is priced once per kind and each device's speed is the first stage's kind's total over its
own kind's total. A stage's cost is then its nodes' cost on the first kind over that speed:
its time on its own device, up to how differently the two kinds run each node.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

__all__ = ["device_kind", "kind_speeds"]


def device_kind(device: torch.device) -> str:
    """What runs a device's work at one speed: its type, and for a CUDA device present here
    its model name (two devices of one model are one kind)."""
    index = device.index if device.index is not None else 0
    if device.type == "cuda" and torch.cuda.is_available() and index < torch.cuda.device_count():
        return f"cuda ({torch.cuda.get_device_name(index)})"
    return device.type


def kind_speeds(
    devices: Sequence[torch.device],
    total: Callable[[torch.device], float],
    first_total: float,
) -> tuple[float, ...] | None:
    """The relative speed of each entry of ``devices``: ``first_total`` (the model priced
    on ``devices[0]``) over ``total(d)`` for one device ``d`` of each other kind; None when
    every entry is one kind (nothing to scale)."""
    kinds = [device_kind(d) for d in devices]
    if len(set(kinds)) == 1:
        return None
    totals = {kinds[0]: first_total}
    for device, kind in zip(devices, kinds):
        if kind not in totals:
            totals[kind] = total(device)
    if first_total <= 0 or any(t <= 0 for t in totals.values()):
        return None  # nothing measured: the costs say nothing about speed
    return tuple(first_total / totals[k] for k in kinds)
