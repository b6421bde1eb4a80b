"""Reads ``max_memory`` and ``speed``: one value for every device, one per entry, or by device.

Both options take the same forms, in the spelling of Hugging Face Accelerate's
``max_memory``:

- one value for every device: ``"20GiB"`` or ``2 * 2**30`` (bytes), ``speed=2.0``;
- a sequence aligned with ``devices``: ``["20GiB", "20GiB", "60GiB"]``, ``speed=[1, 3]``;
- a mapping device -> value: ``{0: "20GiB", "cuda:1": "40GB", "cpu": "60GiB"}`` (an int key
  is a CUDA index, a string key a device such as ``"cuda:1"`` or ``"cpu"``).

Amounts are bytes (an int) or a string: a number, an optional space and a unit, ``B``,
``KB``/``MB``/``GB``/``TB`` (powers of 10) or ``KiB``/``MiB``/``GiB``/``TiB`` (powers of 2),
in any case. A device's budget is shared by every stage placed on it.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias

import torch

from fxpipe.devices.targets import same_device
from fxpipe.errors import ConfigError

__all__ = [
    "DeviceValues",
    "MaxMemory",
    "Speed",
    "parse_amount",
    "parse_max_memory",
    "parse_speed",
    "stage_budgets",
    "stage_speeds",
]


_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_AMOUNT = re.compile(r"\s*(-?(?:\d+(?:\.\d*)?|\.\d+))\s*([a-zA-Z]*)\s*")
_AMOUNT_HELP = (
    "an int of bytes or a string such as '20GiB' (units B, KB, MB, GB, TB in powers of "
    "10, KiB, MiB, GiB, TiB in powers of 2)"
)


@dataclass(frozen=True)
class DeviceValues:
    """A value per device, checked and frozen: one for all, one per entry, or by device."""

    #: The option it came from (``"max_memory"`` or ``"speed"``), for error messages.
    name: str
    #: How the user wrote it, for error messages.
    given: str
    #: The value of every device (when one value was given).
    every: float | None = None
    #: One value per entry of ``devices`` (None: not given for that entry).
    entries: tuple[float | None, ...] | None = None
    #: (device, value) pairs (when a mapping was given).
    by_device: tuple[tuple[torch.device, float], ...] | None = None

    def per_entry(self, devices: Sequence[torch.device]) -> tuple[float | None, ...]:
        """The value of each entry of ``devices`` (None where none was given); raises
        ConfigError when the values do not line up with the devices."""
        if self.every is not None:
            return (self.every,) * len(devices)
        if self.entries is not None:
            return self._aligned(devices, self.entries)
        pairs = self.by_device or ()
        shown = [str(d) for d in devices]
        for key, _ in pairs:
            if not any(same_device(key, d) for d in devices):
                raise ConfigError(
                    f"{self.name}={self.given} gives a value for {str(key)!r}, which is not "
                    f"among devices {shown}; key it by one of those devices"
                )
        out: list[float | None] = []
        for d in devices:
            out.append(next((v for key, v in pairs if same_device(key, d)), None))
        return tuple(out)

    def _aligned(
        self, devices: Sequence[torch.device], entries: tuple[float | None, ...]
    ) -> tuple[float | None, ...]:
        if len(entries) != len(devices):
            raise ConfigError(
                f"{self.name}={self.given} has {len(entries)} entries for {len(devices)} "
                f"devices {[str(d) for d in devices]}; give one per device, in order, or a "
                "mapping device -> value"
            )
        if self.name == "max_memory":  # a device's stages share one budget: it is one number
            for i, (d, a) in enumerate(zip(devices, entries)):
                for j in range(i):
                    if same_device(devices[j], d) and entries[j] != a:
                        raise ConfigError(
                            f"max_memory={self.given} gives devices[{j}] and devices[{i}] "
                            f"(both {d}) different budgets, but the stages on one device "
                            "share its memory; give both entries that device's budget"
                        )
        return entries


DeviceKey: TypeAlias = int | str | torch.device
Amount: TypeAlias = int | str
#: What ``max_memory=`` accepts (see the module docstring).
MaxMemory: TypeAlias = (
    Amount | Sequence[Amount | None] | Mapping[DeviceKey, Amount] | DeviceValues | None
)
#: What ``speed=`` accepts: positive relative throughputs, in the same forms.
Speed: TypeAlias = float | Sequence[float] | Mapping[DeviceKey, float] | DeviceValues | None


def parse_amount(value: Any, name: str = "max_memory") -> int:
    """Bytes of an amount: an int, or a string such as ``"20GiB"``, ``"20 GB"``, ``"512mib"``."""
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise ConfigError(f"{name} amount {value!r} is not {_AMOUNT_HELP}; pass one of those")
    if isinstance(value, int):
        number = value
    else:
        match = _AMOUNT.fullmatch(value)
        unit = match.group(2).lower() if match else ""
        if match is None or unit not in _UNITS:
            raise ConfigError(f"{name} amount {value!r} is not {_AMOUNT_HELP}; write it so")
        number = int(float(match.group(1)) * _UNITS[unit])
    if number <= 0:
        raise ConfigError(
            f"{name} amount {value!r} is not a positive number of bytes; give each device "
            "the memory its stages may use, e.g. '20GiB'"
        )
    return number


def _parse_speed(value: Any, name: str = "speed") -> float:
    number = isinstance(value, int | float) and not isinstance(value, bool)
    if not number or not math.isfinite(value) or value <= 0:
        raise ConfigError(
            f"{name} value {value!r} is not a positive number; give each device its relative "
            "throughput (1 for the reference, 2 for a device twice as fast)"
        )
    return float(value)


def _parse_key(key: Any, name: str, given: str) -> torch.device:
    try:
        if isinstance(key, bool):
            raise TypeError("a bool")
        if isinstance(key, int):
            return torch.device("cuda", key)
        if isinstance(key, str | torch.device):
            return torch.device(key)
        raise TypeError(type(key).__name__)
    except (RuntimeError, TypeError, ValueError) as e:
        raise ConfigError(
            f"{name}={given} has the key {key!r}, which is not a device ({e}); key by a CUDA "
            "index (0), a device string ('cuda:1', 'cpu') or a torch.device"
        ) from e


def _parse(value: Any, name: str, one: Any) -> DeviceValues | None:
    """The checked form of ``value`` (one of the forms of the module docstring)."""
    if value is None or isinstance(value, DeviceValues):
        return value
    given = repr(value)
    if isinstance(value, Mapping):
        pairs: list[tuple[torch.device, float]] = []
        for key, item in value.items():
            device = _parse_key(key, name, given)
            if any(same_device(device, seen) for seen, _ in pairs):
                raise ConfigError(
                    f"{name}={given} names device {device} twice; give each device one value"
                )
            pairs.append((device, float(one(item, name))))
        return DeviceValues(name, given, by_device=tuple(pairs))
    if isinstance(value, str | int | float) and not isinstance(value, bool):
        return DeviceValues(name, given, every=float(one(value, name)))
    if isinstance(value, Sequence):
        entries = tuple(
            None if item is None and name == "max_memory" else float(one(item, name))
            for item in value
        )
        return DeviceValues(name, given, entries=entries)
    raise ConfigError(
        f"{name}={given} is not a value, a sequence with one value per device, or a mapping "
        "device -> value; pass one of those"
    )


def parse_max_memory(value: Any) -> DeviceValues | None:
    """``max_memory`` checked (ConfigError naming the bad value), or None when not given."""
    return _parse(value, "max_memory", parse_amount)


def parse_speed(value: Any) -> DeviceValues | None:
    """``speed`` checked (ConfigError naming the bad value), or None when not given."""
    return _parse(value, "speed", _parse_speed)


def stage_budgets(
    max_memory: DeviceValues | None,
    devices: Sequence[torch.device],
    capacity: Sequence[int | None],
) -> tuple[int | None, ...]:
    """Bytes each entry of ``devices`` may use: its ``max_memory`` budget, else its capacity
    (``None``, not checked, for a device that is not present and has no budget)."""
    given = max_memory.per_entry(devices) if max_memory is not None else (None,) * len(devices)
    return tuple(int(g) if g is not None else c for g, c in zip(given, capacity))


def stage_speeds(
    speed: DeviceValues | None, devices: Sequence[torch.device]
) -> tuple[float, ...] | None:
    """The relative speed of each entry of ``devices``; None when none was given."""
    if speed is None:
        return None
    values = speed.per_entry(devices)
    missing = [str(d) for d, v in zip(devices, values) if v is None]
    if missing:
        raise ConfigError(
            f"speed={speed.given} gives no speed for {missing}; give every device one "
            "(1.0 for the reference)"
        )
    return tuple(float(v) for v in values if v is not None)
