"""This process's memory and threads as the kernel counts them (Linux ``/proc``)."""

from __future__ import annotations

import os
import re
import resource
import sys
import threading
import time
from pathlib import Path

__all__ = ["status_kib", "reset_peak", "maxrss_kib", "rss_bytes", "os_threads", "RssSampler"]


def status_kib(field: str) -> int | None:
    """A ``kB`` field of ``/proc/self/status`` (``VmRSS``, ``VmHWM``, ...); None where the
    file or the field is missing."""
    try:
        text = Path("/proc/self/status").read_text()
    except OSError:
        return None
    match = re.search(rf"^{field}:\s+(\d+)\s+kB", text, re.MULTILINE)
    return int(match.group(1)) if match else None


def reset_peak() -> bool:
    """Reset the kernel's resident high-water mark to the current size (Linux >= 4.0)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def maxrss_kib() -> int:
    """The peak resident size of the whole process so far, KiB (``getrusage``)."""
    scale = 1 if sys.platform != "darwin" else 1024  # bytes on macOS
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // scale


def rss_bytes() -> int:
    """Resident set size of this process (``/proc/self/statm``; peak RSS elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return maxrss_kib() * 1024


def os_threads() -> int:
    """Threads of this process as the OS counts them (-1 where ``/proc`` is missing)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Threads:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return -1


class RssSampler:
    """Polls the resident size every ``period`` seconds in a thread; keeps the largest."""

    def __init__(self, period: float = 0.0005) -> None:
        self.period = period
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, status_kib("VmRSS") or 0)
            time.sleep(self.period)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
