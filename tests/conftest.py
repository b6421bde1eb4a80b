"""Shared test set-up: a fixed seed per test, the ``cuda`` and ``slow`` markers, the zoo on
sys.path, the cores shared out among ``pytest -n``'s workers."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

# Tests import the shared model zoo as ``models`` (tests/ has no __init__.py by design); the
# zoo's models shared with the benchmarks come from the ``benchmarks`` package at the root,
# found after the installed fxpipe (appended, so ./fxpipe never shadows it).
sys.path.insert(0, str(Path(__file__).parent))
sys.path.append(str(Path(__file__).parents[1]))

from models import QUICK_MODELS, ZOO, Case  # noqa: E402


def pytest_configure(config: pytest.Config) -> None:
    """Under ``pytest -n``, each worker computes on its share of the cores (one intra-op
    thread each with ``-n auto``), and so do the fresh interpreters its tests start (where
    ``OMP_NUM_THREADS`` is not set already): two workers of two threads each on 2 cores
    ran tests/test_transparency.py in 226 s, of one thread each in 63 s (``-n 2``)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers and "PYTEST_XDIST_WORKER" in os.environ:
        share = max(1, (os.cpu_count() or 1) // workers)
        if torch.get_num_threads() > share:
            torch.set_num_threads(share)
        os.environ.setdefault("OMP_NUM_THREADS", str(share))


def pytest_report_header() -> str:
    cuda = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return f"torch {torch.__version__}, CUDA devices: {cuda}"


def _slow_model(value: object) -> bool:
    name = value.name if isinstance(value, Case) else value
    return isinstance(name, str) and name in ZOO and name not in QUICK_MODELS


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:  # zoo sweeps: the models outside QUICK_MODELS are slow
        callspec = getattr(item, "callspec", None)
        if callspec is not None and any(_slow_model(v) for v in callspec.params.values()):
            item.add_marker(pytest.mark.slow)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.fixture
def one_thread() -> Iterator[None]:
    """Tiny models run faster on one intra-op thread than on two contending for the cores;
    modules of such tests use it with ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
