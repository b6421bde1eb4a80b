"""The GPU benchmark's run: results so far, the time budget, guarded sections, the watchdog."""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import platform
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

import fxpipe
from benchmarks.gpu.device import Device, device_name
from benchmarks.gpu.table import print_table
from benchmarks.harness.output import command_line


class Run:
    """Results so far, the time budget, and what to print and write at any moment."""

    def __init__(self, args: argparse.Namespace, dev: Device) -> None:
        self.args = args
        self.dev = dev
        self.start = time.perf_counter()
        self.sections: dict[str, dict[str, Any]] = {}
        self.lock = threading.Lock()
        self.finished = False

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    @contextmanager
    def section(self, name: str) -> Iterator[dict[str, Any]]:
        """Run a section's block guarded; its ``status`` is "run" inside the block unless
        the budget is spent (then the caller must not run it)."""
        record: dict[str, Any] = {"status": "run"}
        with self.lock:
            self.sections[name] = record
        if self.elapsed() > self.args.budget_s:
            record["status"] = f"skipped: past the {self.args.budget_s:.0f} s budget"
            print(f"[{name}] {record['status']}", flush=True)
            yield record
            return
        t0 = time.perf_counter()
        print(f"[{name}] start at {self.elapsed():.0f} s", flush=True)
        try:
            yield record
            record["status"] = "ok"
        except Exception as e:  # one section's failure must not stop the others
            record["status"] = f"error: {type(e).__name__}: {e}"
            record["traceback"] = traceback.format_exc(limit=8)
            print(f"[{name}] ERROR {type(e).__name__}: {e}", flush=True)
        finally:
            record["seconds"] = time.perf_counter() - t0
            self.dev.free()
            print(f"[{name}] {record['status']} ({record['seconds']:.1f} s)", flush=True)
            self.write()

    def write(self) -> None:
        out: Path = self.args.out
        try:
            self._write(out)
        except Exception as e:  # writing must never be what fails the run
            print(f"could not write {out}: {e}", flush=True)

    def _write(self, out: Path) -> None:
        record = {
            "command": command_line(),
            "dry_run": self.args.dry_run,
            "device": device_name(self.dev),
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "fxpipe": fxpipe.__version__,
            "python": platform.python_version(),
            "cores": os.cpu_count(),
            "float32_matmul_precision": torch.get_float32_matmul_precision(),
            "seconds": self.elapsed(),
            "finished": self.finished,
            "sections": self.sections,
        }
        out.parent.mkdir(parents=True, exist_ok=True)
        with self.lock:
            text = json.dumps(record, indent=2, default=str)
        out.write_text(text + "\n")


def start_watchdog(run: Run, limit_s: float) -> None:
    """After ``limit_s`` seconds: print the thread stacks and the results so far, write
    them, and end the process (code 0: the results are what this run is for)."""

    def fire() -> None:
        if run.finished:
            return
        print(f"\nwatchdog: still running after {limit_s:.0f} s; stopping", flush=True)
        faulthandler.dump_traceback(all_threads=True)
        with run.lock:
            for rec in run.sections.values():
                if rec.get("status") == "run":
                    rec["status"] = "stopped by the watchdog while running"
        try:
            print_table(run.dev, run.sections)
        finally:
            run.write()
            sys.stdout.flush()
            os._exit(0)

    timer = threading.Timer(limit_s, fire)
    timer.daemon = True
    timer.start()
