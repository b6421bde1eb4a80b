"""The plan is a function of the model, the example and the cost mode: the same stage of every
node and the same stage costs on every run, in this process and in a fresh one (with another
hash seed, so that no set or dict order leaks into the partition)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import fxpipe

# Each test plans six zoo models (and in a fresh process): slow.
pytestmark = pytest.mark.slow

#: Branchy and chain-like zoo models, with keyword inputs and tied weights among them.
MODELS = ("resnet", "unet", "inception", "transformer", "multi_io_dict", "shared_module")
#: One cost mode: pricing by parameters leaves the most nodes of equal cost, so the most
#: ties for an order to break (flops was run too until the suite's time was trimmed).
MODES = ("params",)
#: One number of stages: an order leaking into the partition shows at any (3 and 4 were
#: both run until the suite's time was trimmed; 4 has the more borders).
STAGES = (4,)
TESTS = Path(__file__).resolve().parent


def plan_hashes() -> dict[str, str]:
    """``model/mode/K`` -> a hash of ``sorted(plan.stage_of.items())`` and the stage costs."""
    from models import ZOO

    out = {}
    for name in MODELS:
        case = ZOO[name]
        args, kwargs = case.example(case.batch)
        for mode in MODES:
            for k in STAGES:
                plan = fxpipe.plan(
                    case.build(),
                    args,
                    ["cpu"] * k,
                    example_kwargs=kwargs,
                    cost=mode,
                    tracer=case.tracer,
                )
                text = repr((sorted(plan.stage_of.items()), [s.cost for s in plan.stages]))
                out[f"{name}/{mode}/{k}"] = hashlib.sha256(text.encode()).hexdigest()
    return out


_SCRIPT = f"""
import json, sys
sys.path.insert(0, {str(TESTS)!r})
from test_determinism import plan_hashes
print(json.dumps(plan_hashes()))
"""


def _in_fresh_processes(*hash_seeds: str) -> list[dict[str, str]]:
    """``plan_hashes()`` of one fresh interpreter per seed, run side by side."""
    runs = [
        subprocess.Popen(
            [sys.executable, "-c", _SCRIPT],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=dict(os.environ, PYTHONHASHSEED=seed),
        )
        for seed in hash_seeds
    ]
    results = []
    for run in runs:
        out, err = run.communicate(timeout=300)
        assert run.returncode == 0, err[-3000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    return results


def test_the_plan_is_the_same_here_and_in_a_fresh_process_of_another_hash_seed() -> None:
    """In this process (after other tests: whatever state they left) and in a fresh one
    with another hash seed (one test, so that the plans made here are made once, on one
    worker of ``pytest -n``)."""
    here = plan_hashes()
    assert len(here) == len(MODELS) * len(MODES) * len(STAGES)
    seed = "2024" if os.environ.get("PYTHONHASHSEED") != "2024" else "1"
    (fresh,) = _in_fresh_processes(seed)  # a seed other than this process's
    assert fresh == here
