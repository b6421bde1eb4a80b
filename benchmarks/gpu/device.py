"""Timing, synchronisation and peak memory on a CUDA device, with CPU stand-ins for a dry run."""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from typing import Any

import torch

from benchmarks.harness.memory import reset_peak, status_kib


class Device:
    """Timing, synchronisation and peak memory on CUDA, with CPU stand-ins for a dry run."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def mark(self) -> Any:
        """A point on the current stream's timeline (an event) or on the host clock."""
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def ms(self, start: Any, end: Any) -> float:
        if self.cuda:
            end.synchronize()
            return float(start.elapsed_time(end))
        return 1e3 * float(end - start)

    def time_ms(self, fn: Callable[[], Any]) -> float:
        start = self.mark()
        fn()
        return self.ms(start, self.mark())

    def start_peak(self) -> int:
        """Reset the peak counter; return the bytes allocated now."""
        gc.collect()
        self.sync()
        if self.cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)
            return int(torch.cuda.memory_allocated(self.device))
        return reset_rss_peak()

    def peak_since(self, base: int) -> int | None:
        self.sync()
        if self.cuda:
            return int(torch.cuda.max_memory_allocated(self.device)) - base
        peak = status_bytes("VmHWM")
        return None if peak is None or base < 0 else peak - base

    def free(self) -> None:
        gc.collect()
        if self.cuda:
            try:
                torch.cuda.empty_cache()
            except Exception as e:  # a broken context already failed its section
                print(f"  (empty_cache failed: {e})", flush=True)


def status_bytes(field: str) -> int | None:
    """A ``/proc/self/status`` field in bytes (None where missing)."""
    kib = status_kib(field)
    return None if kib is None else 1024 * kib


def reset_rss_peak() -> int:
    """CPU stand-in: reset the resident high-water mark; the resident bytes now, -1 if the
    kernel does not let us (then no CPU peak is reported)."""
    if not reset_peak():
        return -1
    return status_bytes("VmRSS") or -1


def device_name(dev: Device) -> str:
    if not dev.cuda:
        return "cpu (dry run)"
    try:
        return f"{dev.device} {torch.cuda.get_device_name(dev.device)}"
    except Exception:
        return str(dev.device)
