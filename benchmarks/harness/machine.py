"""What a result records about the machine and the libraries it ran on."""

from __future__ import annotations

import os
import platform
from pathlib import Path
from typing import Any

__all__ = [
    "cpu_model",
    "load_average",
    "library_versions",
    "usable_cores",
    "machine_record",
    "device_record",
]


def cpu_model() -> str:
    """The processor's model name (Linux ``/proc/cpuinfo``; ``platform.processor()`` else)."""
    model = platform.processor() or "?"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return model


def load_average() -> tuple[float, float, float] | None:
    """The 1, 5 and 15 minute load averages, where the system has them."""
    return os.getloadavg() if hasattr(os, "getloadavg") else None


def usable_cores() -> int | None:
    """Cores this process may run on (its affinity), where the system says."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None


def library_versions(names: tuple[str, ...]) -> dict[str, str | None]:
    """The version of each library in ``names`` (None: not installed)."""
    versions: dict[str, str | None] = {}
    for lib in names:
        try:
            versions[lib] = __import__(lib).__version__
        except ImportError:
            versions[lib] = None
    return versions


def machine_record(libraries: tuple[str, ...] = ("torch", "transformers")) -> dict[str, Any]:
    """What a result records of its machine: the platform, the usable cores, the versions
    of ``libraries``."""
    return {"platform": platform.platform(), "cores": usable_cores(),
            **library_versions(libraries)}  # fmt: skip


def device_record(device: Any) -> dict[str, Any]:
    """What a result timed on ``device`` (a torch.device) records: the GPU's name or
    "cpu", the usable cores, Python's version and torch's and transformers'."""
    import torch

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return {"device": name, "cores": usable_cores(), "python": platform.python_version(),
            **library_versions(("torch", "transformers"))}  # fmt: skip
