"""Memory budgets and speeds as options: the forms ``max_memory`` and ``speed`` take, what is
refused with the value named, the frozen record, and the budgets a plan keeps."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
from torch import nn

import fxpipe
from fxpipe.devices.budgets import parse_amount, parse_max_memory, parse_speed
from fxpipe.errors import ConfigError
from fxpipe.options import PlanOptions

pytestmark = pytest.mark.usefixtures("one_thread")

GPUS = [f"cuda:{j}" for j in range(4)]


@pytest.mark.parametrize(
    "text, size",
    [
        ("20GiB", 20 * 2**30),
        ("20GB", 20 * 10**9),
        ("20 gib", 20 * 2**30),
        ("1.5MiB", 3 * 2**19),
        ("512 kb", 512_000),
        ("3KiB", 3072),
        ("2TB", 2 * 10**12),
        ("1tib", 2**40),
        ("4096", 4096),
        ("100 B", 100),
        (123, 123),
    ],
)
def test_amounts_in_accelerate_spelling(text: Any, size: int) -> None:
    assert parse_amount(text) == size


@pytest.mark.parametrize(
    "bad", ["20 gigs", "-3GiB", "0GB", "GiB", "", "1e9", -1, 0, 2.5, True, None, [1]]
)
def test_bad_amounts_are_refused_with_the_value_named(bad: Any) -> None:
    with pytest.raises(ConfigError, match=re.escape(repr(bad))):
        parse_amount(bad)


CUDA4 = [torch.device("cuda", j) for j in range(4)]


def test_one_amount_a_sequence_or_a_mapping() -> None:
    every = parse_max_memory("1GiB")
    assert every is not None and every.per_entry(CUDA4) == (2.0**30,) * 4
    listed = parse_max_memory(["1GB", 2, "3 KiB", None])
    assert listed is not None and listed.per_entry(CUDA4) == (1e9, 2.0, 3072.0, None)
    mapped = parse_max_memory({0: "1GiB", "cuda:2": "2GiB", torch.device("cuda", 3): 7})
    assert mapped is not None
    assert mapped.per_entry(CUDA4) == (2.0**30, None, 2.0 * 2**30, 7.0)
    mixed = [torch.device("cuda", 0), torch.device("cpu"), torch.device("cpu")]
    shared = parse_max_memory({0: "20GiB", "cpu": "60GiB"})
    assert shared is not None
    assert shared.per_entry(mixed) == (20.0 * 2**30, 60.0 * 2**30, 60.0 * 2**30)
    speeds = parse_speed({"cuda:0": 1, 1: 3.5, 2: 2, 3: 1})
    assert speeds is not None and speeds.per_entry(CUDA4) == (1.0, 3.5, 2.0, 1.0)


BAD_OPTIONS: dict[str, tuple[dict[str, Any], list[str], str]] = {
    "unit": ({"max_memory": "20 gigs"}, GPUS, r"'20 gigs'.*'20GiB'"),
    "negative": ({"max_memory": -5}, GPUS, r"-5 is not a positive number of bytes"),
    "key not a device": ({"max_memory": {"gpu0": "1GB"}}, GPUS, r"'gpu0'.*not a device"),
    "key not among devices": (
        {"max_memory": {5: "1GB"}},
        GPUS,
        r"'cuda:5', which is not among devices \['cuda:0'.*key it by one of those",
    ),
    "length": ({"max_memory": ["1GB"] * 3}, GPUS, r"3 entries for 4 devices.*one per device"),
    "one device, two budgets": (
        {"max_memory": ["1GB", "2GB"]},
        ["cpu", "cpu"],
        r"devices\[0\] and devices\[1\] \(both cpu\) different budgets",
    ),
    "form": ({"max_memory": object()}, GPUS, r"max_memory=<object.*is not a value"),
    "speed zero": ({"speed": [1, 0, 1, 1]}, GPUS, r"speed value 0 is not a positive number"),
    "speed bool": ({"speed": True}, GPUS, r"speed=True is not a value"),
    "speed string": ({"speed": "fast"}, GPUS, r"speed value 'fast'"),
    "speed nan": ({"speed": float("nan")}, GPUS, r"speed value nan"),
    "speed length": ({"speed": [1, 2]}, GPUS, r"speed=\[1, 2\] has 2 entries for 4 devices"),
    "speed missing device": (
        {"speed": {0: 1.0}},
        GPUS,
        r"gives no speed for \['cuda:1', 'cuda:2', 'cuda:3'\]",
    ),
}


@pytest.mark.parametrize("case", list(BAD_OPTIONS), ids=list(BAD_OPTIONS))
def test_bad_budgets_and_speeds_are_refused(case: str) -> None:
    keywords, devices, message = BAD_OPTIONS[case]
    with pytest.raises(ConfigError, match=message):
        fxpipe.plan(nn.Linear(4, 4), torch.randn(2, 4), devices, **keywords)


def test_the_record_checks_the_forms_and_stays_frozen() -> None:
    with pytest.raises(ConfigError, match="'20 gigs'"):
        PlanOptions(max_memory="20 gigs")
    with pytest.raises(ConfigError, match="speed value -1"):
        PlanOptions(speed=-1)
    budgets = ["1GiB", "2GiB"]
    options = PlanOptions(max_memory=budgets, speed={"cpu": 2})
    budgets.append("3GiB")  # the record keeps what it checked
    held = parse_max_memory(options.max_memory)
    assert held is not None and held.entries == (2.0**30, 2.0 * 2**30)
    assert hash(options) == hash(PlanOptions(max_memory=["1GiB", "2GiB"], speed={"cpu": 2}))


def _mlp(widths: list[int]) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(a, b) for a, b in zip(widths, widths[1:])])


def test_the_plan_keeps_the_budgets_it_was_made_for() -> None:
    model, x = _mlp([16] * 7), torch.randn(8, 16)
    plan = fxpipe.plan(model, x, GPUS, cost="flops", max_memory={0: "1GiB", "cuda:3": 5 * 2**20})
    assert plan.capacities == (2**30, None, None, 5 * 2**20)  # absent GPUs: unchecked
    assert fxpipe.plan(model, x, GPUS, cost="flops").capacities == (None,) * 4
    assert fxpipe.plan(model, x, ["meta"] * 2, max_memory="1MB").capacities == (10**6,) * 2
    text = str(plan)
    assert "1.0 GiB (stage 0" in text and "5.0 MiB (stage 3" in text
