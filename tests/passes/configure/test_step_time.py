"""The predicted step: the clock-cycle replay against closed forms it must reduce to."""

from __future__ import annotations

import pytest

from fxpipe.passes.configure.step_time import (
    FORWARD_SHARE,
    Overheads,
    StageTimes,
    predict_step,
)

FREE = Overheads(cell=0.0, checkpointed=0.0, step=0.0, bandwidth=float("inf"))


@pytest.mark.parametrize(("m", "n"), [(1, 1), (1, 4), (4, 4), (8, 3), (32, 2)])
def test_distinct_devices_and_equal_stages_give_gpipes_makespan(m: int, n: int) -> None:
    """n equal stages on n devices: (m + n - 1) ticks of one micro-batch's work each."""
    c = 0.3
    stages = StageTimes((c,) * n, tuple(f"cuda:{j}" for j in range(n)), (0.0,) * n)
    got = predict_step(stages, m, ("never",) * n, training=True, overheads=FREE)
    assert got.step == pytest.approx((m + n - 1) * c / m)
    bubble = 1 - n * c / n / got.step  # a device busy for its stage's cost out of the step
    assert bubble == pytest.approx((n - 1) / (m + n - 1))
    assert got.compute == pytest.approx(c) and got.recompute == 0.0


def test_stages_sharing_a_device_run_one_after_another() -> None:
    costs = (0.1, 0.4, 0.2)
    over = Overheads(cell=1e-3, checkpointed=2e-3, step=5e-3, bandwidth=float("inf"))
    stages = StageTimes(costs, ("cpu",) * 3, (0.0,) * 3)
    m = 4
    modes = ("always", "never", "except_last")
    got = predict_step(stages, m, modes, training=True, overheads=over)
    recomputed = costs[0] * FORWARD_SHARE + costs[2] * FORWARD_SHARE * (m - 1) / m
    overhead = 3 * m * over.cell + (m + (m - 1)) * over.checkpointed + over.step
    assert got.step == pytest.approx(sum(costs) + recomputed + overhead)
    assert got.recompute == pytest.approx(recomputed)
    assert got.idle == 0.0


def test_inference_runs_the_forward_share_only() -> None:
    stages = StageTimes((0.3, 0.3), ("cpu", "cpu"), (0.0, 0.0))
    got = predict_step(stages, 2, ("always", "always"), training=False, overheads=FREE)
    assert got.step == pytest.approx(0.6 * FORWARD_SHARE)
    assert got.recompute == 0.0


def test_transfers_between_devices_are_counted_both_ways() -> None:
    over = Overheads(cell=0.0, checkpointed=0.0, step=0.0, bandwidth=1e9)
    stages = StageTimes((0.0, 0.0), ("cuda:0", "cuda:1"), (0.0, 2e9))
    got = predict_step(stages, 1, ("never", "never"), training=True, overheads=over)
    assert got.step == pytest.approx(4.0)  # 2 s forward, 2 s for the gradient back
