"""Every rank gets the same default plan: a fresh process with another hash seed and another
torch thread count, beside a competing load, makes the plan this process makes (one fresh
process: two, of two seeds, took about 15 s more of the suite; plans by parameters in a fresh
process of another seed: tests/test_determinism.py)."""

from __future__ import annotations

import functools
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import fxpipe

# Plans two zoo models in this process and in a fresh one under load: slow.
pytestmark = pytest.mark.slow

#: A CNN traced by fx, a language model traced by torch.export.
MODELS = ("resnet", "llama")
TESTS = Path(__file__).resolve().parent


def plan_hashes() -> dict[str, str]:
    """``model`` -> a hash of the default plan's stage of every node and its node costs."""
    from models import ZOO

    out = {}
    for name in MODELS:
        case = ZOO[name]
        args, kwargs = case.example(case.batch)
        plan = fxpipe.plan(case.build(), args, ["cpu"] * 3, example_kwargs=kwargs)
        assert plan.costs.mode == "roofline"
        text = repr((sorted(plan.stage_of.items()), sorted(plan.node_cost.items())))
        out[name] = hashlib.sha256(text.encode()).hexdigest()
    return out


_SCRIPT = f"""
import json, sys, torch
sys.path.insert(0, {str(TESTS)!r})
torch.set_num_threads(int(sys.argv[1]))
from test_default_cost import plan_hashes
print(json.dumps(plan_hashes()))
"""


@functools.cache
def _here() -> dict[str, str]:
    return plan_hashes()


def test_the_default_plan_is_the_same_in_fresh_processes_under_load() -> None:
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        threads = 2 if torch.get_num_threads() == 1 else 1  # not this process's count
        run = subprocess.run(
            [sys.executable, "-c", _SCRIPT, str(threads)],
            capture_output=True,
            text=True,
            env=dict(os.environ, PYTHONHASHSEED="2"),
            timeout=600,
        )
        assert run.returncode == 0, run.stderr[-3000:]
    finally:
        spinner.kill()
        spinner.wait()
    assert json.loads(run.stdout.strip().splitlines()[-1]) == _here()
