"""Shared test set-up: a fixed seed per test, the ``cuda`` marker, the zoo on sys.path."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

# Tests import the shared model zoo as ``models`` (tests/ has no __init__.py by design).
sys.path.insert(0, str(Path(__file__).parent))


def pytest_report_header() -> str:
    cuda = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return f"torch {torch.__version__}, CUDA devices: {cuda}"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)
