"""fxpipe.distributed.planning.staleness: each stage's staleness is the most the rule's
sequential simulation gives any micro-batch; the versions each mitigation keeps, and their
bytes."""

from __future__ import annotations

import pytest
import torch

from fxpipe.distributed.planning.staleness import staleness_of
from tests.distributed.rank.async_oracle import simulate


@pytest.mark.parametrize(("stages", "every"), [(2, 1), (3, 1), (3, 2), (4, 3)])
def test_the_staleness_is_the_most_the_simulation_gives(stages: int, every: int) -> None:
    fns = [lambda w, x: x * w["w"] for _ in range(stages)]
    params = [{"w": torch.ones((), dtype=torch.float64)} for _ in range(stages)]
    batches = [(torch.ones((), dtype=torch.float64), torch.zeros((), dtype=torch.float64))] * 12
    run = simulate(
        fns, params, batches, lambda y, t: (y - t) ** 2, lambda ps: torch.optim.SGD(ps, lr=0.01),
        mitigation="stash", step_every=every,
    )  # fmt: skip
    plan = staleness_of("stash", every, (8,) * stages)
    assert [s.stale for s in plan.stages] == [max(d) for d in run.staleness]
    assert [s.in_flight for s in plan.stages] == list(range(stages, 0, -1))


def test_versions_kept_by_each_mitigation_and_their_bytes() -> None:
    stash = staleness_of("stash", 1, (100, 10))
    assert [(s.versions, s.extra_bytes) for s in stash.stages] == [(2, 200), (0, 0)]
    predict = staleness_of("predict", 2, (100, 10))
    assert predict.stages[0].versions >= 1 and predict.stages[1].versions == 0
    none = staleness_of("none", 1, (100, 10))
    assert all(s.versions == 0 and s.extra_bytes == 0 for s in none.stages)
    assert "stale (updates)" in stash.summary() and "staleness='stash'" in stash.summary()
