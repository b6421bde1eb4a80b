"""``chunks="auto"`` / ``checkpoint="auto"``: the choice against the explicit planner and a
brute force over every per-stage combination."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch
from torch import nn

import fxpipe
from fxpipe.errors import ConfigError, MemoryPlanError
from fxpipe.ir import CHECKPOINT_MODES, PipelinePlan
from fxpipe.passes.configure.choose import chunk_counts, least_recompute
from fxpipe.passes.configure.step_time import FORWARD_SHARE, overheads_for
from fxpipe.passes.partition.cost_graph import batched_nodes
from fxpipe.passes.partition.memory import checkpointed
from fxpipe.passes.split.plan import stage_memory

MiB = 2**20


class Tower(nn.Module):
    """Residual blocks whose activations grow toward the head, so stages differ in memory."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(64, 64) for _ in range(6))
        self.up = nn.Linear(64, 512)
        self.wide = nn.ModuleList(nn.Linear(512, 512) for _ in range(2))
        self.head = nn.Linear(512, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.relu(block(x)) + x
        x = self.up(x)
        for block in self.wide:
            x = torch.tanh(block(x)) + x
        return self.head(x)


def _plan(**kw: object) -> PipelinePlan:
    torch.manual_seed(0)
    return fxpipe.plan(Tower(), torch.randn(64, 64), ["cpu"] * 4, **kw)  # type: ignore[arg-type]


def _device_bytes(plan: PipelinePlan) -> int:
    return sum(s.memory_bytes for s in plan.stages)


def test_counts_are_powers_of_two_and_the_default_capped_at_the_batch() -> None:
    assert chunk_counts(64, 4, 16) == [1, 2, 4, 8, 16, 32]
    assert chunk_counts(12, 4, 12) == [1, 2, 4, 8, 12]
    assert chunk_counts(64, 12, 48) == [1, 2, 4, 8, 16, 32, 48]


def test_without_a_budget_nothing_is_recomputed_and_the_fastest_is_chosen() -> None:
    plan = _plan(chunks="auto", checkpoint="auto")
    table = plan.configurations()
    assert table.choice.checkpoint == ("never",) * 4
    assert plan.checkpoints == ("never",) * 4 and plan.chunks == table.choice.chunks
    steps = [r.step for r in table.rows if r.step is not None]
    assert table.choice.step == min(steps)
    assert {r.chunks for r in table.rows} == set(chunk_counts(64, 4, 16))


def _tight() -> int:
    """A budget between what 'always' and what 'never' need at 8 chunks."""
    never = _device_bytes(_plan(chunks=8, checkpoint="never"))
    always = _device_bytes(_plan(chunks=8, checkpoint="always"))
    assert always < never
    return (always + never) // 2


def test_under_a_budget_every_row_agrees_with_the_explicit_planner() -> None:
    budget = _tight()
    plan = _plan(chunks="auto", checkpoint="auto", max_memory=budget)
    table = plan.configurations()
    assert _device_bytes(plan) <= budget
    assert any(not r.fits for r in table.rows) and table.choice.fits
    for row in table.rows:
        if row.kind != "global":
            continue
        if row.fits:  # the same configuration asked for explicitly fits, with that memory
            alone = _plan(chunks=row.chunks, checkpoint=list(row.checkpoint), max_memory=budget)
            assert dict(row.memory) == {"cpu": _device_bytes(alone)}
        else:
            with pytest.raises(MemoryPlanError):
                _plan(chunks=row.chunks, checkpoint=list(row.checkpoint), max_memory=budget)
    fitting = [r.step for r in table.rows if r.step is not None]
    assert table.choice.step == min(fitting)


def test_per_stage_modes_are_the_least_recomputation_that_fits() -> None:
    """A brute force over all 81 per-stage combinations on the chosen split."""
    budget = _tight()
    plan = _plan(chunks=8, checkpoint="always", max_memory=budget)
    modes = least_recompute(plan)
    k, m = plan.num_stages, plan.chunks
    batched = batched_nodes(plan.graph_module)
    again = overheads_for("cpu").checkpointed

    def memory(combo: tuple[str, ...]) -> int:
        return sum(
            stage_memory(s, plan.costs, chunks=m, checkpoint=x, last=s.index == k - 1,
                         batched=batched)
            for s, x in zip(plan.stages, combo, strict=True)
        )  # fmt: skip

    def seconds(combo: tuple[str, ...]) -> float:
        return sum(
            checkpointed(m, x, last=j == k - 1) * (s.cost * FORWARD_SHARE / m + again)
            for j, (s, x) in enumerate(zip(plan.stages, combo, strict=True))
        )

    combos = [c for c in itertools.product(CHECKPOINT_MODES, repeat=k) if memory(c) <= budget]
    best = min(seconds(c) for c in combos)
    assert memory(modes) <= budget
    assert seconds(modes) == pytest.approx(best)
    assert seconds(modes) < seconds(("always",) * k)  # better than the global mode here


def test_the_chosen_per_stage_plan_holds_its_modes_and_says_so() -> None:
    budget = _tight()
    plan = _plan(chunks="auto", checkpoint="auto", max_memory=budget)
    choice = plan.configurations().choice
    assert plan.checkpoints == choice.checkpoint
    text = plan.summary()
    assert "chosen from" in text and "plan.configurations()" in text
    assert "do not fit" in text
    shown = str(plan.configurations())
    assert shown.count("\n") == len(plan.configurations().rows) + 2


def test_nothing_fits_raises_the_least_memory_configurations_error() -> None:
    with pytest.raises(MemoryPlanError, match="chunks=32, checkpoint='always'"):
        _plan(chunks="auto", checkpoint="auto", max_memory=64 * 1024)


def test_a_given_configuration_is_its_own_one_row_table() -> None:
    plan = _plan(chunks=4, checkpoint="except_last")
    table = plan.configurations()
    assert len(table.rows) == 1 and table.searched == "given"
    assert table.choice.chunks == 4 and table.choice.checkpoint == ("except_last",) * 4
    assert table.choice.step is not None and table.choice.step > 0


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"chunks": "auto", "cost": "flops"}, "cost='flops'.*seconds"),
        ({"checkpoint": "auto", "cost": lambda n: 1.0}, "not in seconds"),
        ({"checkpoint": ["never", "always"]}, "2 modes but there are 4 stages"),
        ({"checkpoint": ["never", "sometimes", "never", "never"]}, r"checkpoint\[1\]='sometimes'"),
        ({"checkpoint": []}, "non-empty list"),
        ({"chunks": "many"}, "chunks='many'.*'auto'"),
    ],
)
def test_bad_configurations_are_refused_naming_the_value(kw: dict[str, Any], match: str) -> None:
    model = Tower()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ConfigError, match=match):
        fxpipe.plan(model, torch.randn(8, 64), ["cpu"] * 4, **kw)  # type: ignore[arg-type]
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
