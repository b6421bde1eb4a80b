"""tests.distributed.rank.async_oracle: the sequential simulation of async1f1b's update rule,
checked against eager PyTorch, plain training, torch's own optimizers and hand arithmetic
(float64)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from tests.distributed.rank.async_oracle import (
    MITIGATIONS,
    _predict,
    _snapshot_states,
    simulate,
)

F64 = torch.float64
Make = Callable[[list[torch.Tensor]], torch.optim.Optimizer]


def _scalar(value: float) -> torch.Tensor:
    return torch.tensor(value, dtype=F64)


def _sgd(lr: float, **kwargs: Any) -> Make:
    return lambda leaves: torch.optim.SGD(leaves, lr=lr, **kwargs)


def _adamw(leaves: list[torch.Tensor]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(leaves, lr=0.01, weight_decay=0.1)


def _mse(y: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return ((y - t) ** 2).sum()


def _close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], **tol: float) -> None:
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], **tol)


# --- a 3-stage MLP and a 1-stage model, against eager -------------------------------------


def _f0(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x @ p["a"] + p["b"])


def _f1(p: dict[str, torch.Tensor], h: torch.Tensor) -> torch.Tensor:
    return torch.tanh(h @ p["c"])


def _f2(p: dict[str, torch.Tensor], h: torch.Tensor) -> torch.Tensor:
    return h @ p["d"]


def _mlp(n: int) -> tuple[list, list[dict[str, torch.Tensor]], list]:
    """Three stages, their weights, ``n`` micro-batches of 2 rows."""
    g = torch.Generator().manual_seed(0)

    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, dtype=F64)

    params = [{"a": r(3, 4) * 0.5, "b": r(4) * 0.1}, {"c": r(4, 4) * 0.5}, {"d": r(4, 2) * 0.5}]
    return [_f0, _f1, _f2], params, [(r(2, 3), r(2, 2)) for _ in range(n)]


def _one_stage(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    return _f2({"d": p["d"]}, _f1({"c": p["c"]}, _f0(p, x)))


@pytest.mark.parametrize(
    "make, max_norm",
    [(_sgd(0.1, momentum=0.9, weight_decay=0.01), None), (_adamw, 0.5)],
    ids=["sgd", "adamw-clip"],
)
@pytest.mark.parametrize("step_every", [4, 9])
@pytest.mark.parametrize("mitigation", MITIGATIONS)
def test_one_update_is_one_eager_step(
    mitigation: str, step_every: int, make: Make, max_norm: float | None
) -> None:
    """step_every >= the number of micro-batches: one update, at the final flush, equal to one
    step (per stage, clipped per stage) of the eager composed model on the summed loss; the
    caller's params are left as they were."""
    stages, params, batches = _mlp(4)
    before = [{k: v.clone() for k, v in p.items()} for p in params]
    got = simulate(
        stages, params, batches, _mse, make,
        mitigation=mitigation, step_every=step_every, max_grad_norm=max_norm,
    )  # fmt: skip
    leaves = [{k: v.clone().requires_grad_() for k, v in p.items()} for p in params]
    losses = []
    for x, t in batches:
        h = x
        for f, p in zip(stages, leaves):
            h = f(p, h)
        losses.append(_mse(h, t))
    torch.stack(losses).sum().backward()
    for p in leaves:
        if max_norm is not None:
            torch.nn.utils.clip_grad_norm_(list(p.values()), max_norm)
        make(list(p.values())).step()
    for s in range(3):
        _close(got.params[s], {k: v.detach() for k, v in leaves[s].items()})
        _close(params[s], before[s], rtol=0, atol=0)
    assert got.losses == pytest.approx([float(v.detach()) for v in losses], rel=1e-12)
    assert got.staleness == ((0,) * 4,) * 3
    assert got.updates == (1, 1, 1)


@pytest.mark.parametrize("flush_after", [(), (1,), (3,)])
@pytest.mark.parametrize("mitigation", MITIGATIONS)
def test_one_stage_is_plain_training(mitigation: str, flush_after: tuple[int, ...]) -> None:
    """K = 1: plain sequential training, gradients summed over step_every micro-batches, an
    update every step_every backwards and a partial one at each flush (scheduler and clipping
    included)."""
    _, parts, batches = _mlp(5)
    params = {**parts[0], **parts[1], **parts[2]}
    make = _sgd(0.1, momentum=0.9, nesterov=True, weight_decay=0.01)

    def schedule(opt: torch.optim.Optimizer) -> Any:
        return torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 0.5**k)

    got = simulate(
        [_one_stage], [params], batches, _mse, make, mitigation=mitigation, step_every=2,
        flush_after=flush_after, make_scheduler=schedule, max_grad_norm=1.0,
    )  # fmt: skip
    leaves = {k: v.clone().requires_grad_() for k, v in params.items()}
    opt = make(list(leaves.values()))
    sched = schedule(opt)
    losses, since, updates = [], 0, 0
    for m, (x, t) in enumerate(batches):
        loss = _mse(_one_stage(leaves, x), t)
        loss.backward()
        losses.append(float(loss.detach()))
        since += 1
        if since == 2 or m + 1 in flush_after or m + 1 == len(batches):
            torch.nn.utils.clip_grad_norm_(list(leaves.values()), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            sched.step()
            since, updates = 0, updates + 1
    _close(got.params[0], {k: v.detach() for k, v in leaves.items()})
    assert got.losses == pytest.approx(losses, rel=1e-12)
    assert got.updates == (updates,)
    assert got.staleness == ((0,) * 5,)


# --- two scalar stages by hand --------------------------------------------------------------
# Orders for K = 2, step_every = 1, 3 micro-batches (the end flushes):
#   stage 0 (warm-up 1): F0 F1 B0 U1 F2 B1 U2 | flush: B2 U3   vF = 0 0 1, vB = 0 1 2, d = 0 1 1
#   stage 1 (warm-up 0): F0 B0 U1 F1 B1 U2 F2 B2 U3            vF = vB = 0 1 2,        d = 0 0 0
# Stage s's weight after v updates is written a<v> (stage 0) and b<v> (stage 1).

X, T = (1.0, 2.0, -1.0), (1.0, 0.0, 2.0)


def _batches(xs: tuple[float, ...], ts: tuple[float, ...]) -> list:
    return [(_scalar(x), _scalar(t)) for x, t in zip(xs, ts)]


def _square(y: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return (y - t) ** 2


def _times(p: dict[str, torch.Tensor], h: torch.Tensor) -> torch.Tensor:
    return p["w"] * h


def _squared_times(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    return p["w"] ** 2 * x


def _two_stage(f0: Callable, mitigation: str, make: Make, **kwargs: Any) -> Any:
    params = [{"w": _scalar(1.0)}, {"w": _scalar(0.5)}]
    return simulate(
        [f0, _times], params, _batches(X, T), _square, make,
        mitigation=mitigation, step_every=1, **kwargs,
    )  # fmt: skip


def _by_hand_quadratic(mitigation: str) -> tuple[float, float]:
    """a3, b3 for f0 = a^2 x, f1 = b h, L = (y - t)^2, SGD lr 0.1: r = dL/dy = 2 (y - t),
    dL/db = r h, dL/dh = r b, dL/da = r b * 2 a x with a at W(vF) ("stash") or at the
    recomputation's W(vB) ("none"). F runs at W(vF) in both, so the outputs are the same."""
    lr = 0.1
    a0, b0 = 1.0, 0.5
    # m = 0 (d = 0 everywhere): h = 1*1 = 1, y = 0.5, r = 2 (0.5 - 1) = -1
    h, r = a0**2 * X[0], 2 * (b0 * a0**2 * X[0] - T[0])
    b1 = b0 - lr * r * h  # 0.5 - 0.1 * (-1) = 0.6
    a1 = a0 - lr * r * b0 * 2 * a0 * X[0]  # 1 - 0.1 * (-1 * 0.5 * 2) = 1.1
    # m = 1: F0 at a0 (vF = 0): h = 1 * 2 = 2; stage 1 at b1: y = 1.2, r = 2.4, dL/dh = 1.44
    h = a0**2 * X[1]
    r = 2 * (b1 * h - T[1])
    b2 = b1 - lr * r * h  # 0.6 - 0.48 = 0.12
    a_b = a0 if mitigation == "stash" else a1  # B(1) on stage 0: vF = 0, vB = 1
    a2 = a1 - lr * r * b1 * 2 * a_b * X[1]  # stash: 1.1 - 0.576 = 0.524; none: 1.1 - 0.6336
    # m = 2: F0 at a1 (vF = 1): h = 1.21 * -1 = -1.21; at b2: y = -0.1452, r = -4.2904
    h = a1**2 * X[2]
    r = 2 * (b2 * h - T[2])
    b3 = b2 - lr * r * h  # 0.12 - 0.1 * 5.191384 = -0.3991384
    a_b = a1 if mitigation == "stash" else a2  # B(2) on stage 0: vF = 1, vB = 2
    # stash: 0.524 - 0.11326656; none: 0.4664 - 0.04802502144
    a3 = a2 - lr * r * b2 * 2 * a_b * X[2]
    return a3, b3


@pytest.mark.parametrize(
    "mitigation, a3", [("stash", 0.41073344), ("none", 0.41837497856)]
)  # fmt: skip
def test_two_stages_by_hand(mitigation: str, a3: float) -> None:
    """Staleness on stage 0: "stash" takes B(m)'s gradient at W(vF), "none" at W(vB); stage 0
    squares its weight so that the two differ."""
    got = _two_stage(_squared_times, mitigation, _sgd(0.1))
    want_a3, b3 = _by_hand_quadratic(mitigation)
    assert want_a3 == pytest.approx(a3, rel=1e-12)
    assert b3 == pytest.approx(-0.3991384, rel=1e-12)
    assert float(got.params[0]["w"]) == pytest.approx(a3, rel=1e-12)
    assert float(got.params[1]["w"]) == pytest.approx(b3, rel=1e-12)
    assert got.losses == pytest.approx([0.25, 1.44, 2.1452**2], rel=1e-12)
    assert got.staleness == ((0, 1, 1), (0, 0, 0))
    assert got.updates == (3, 3)


def test_stash_and_none_differ_but_not_for_a_linear_first_stage() -> None:
    """The two quadratic runs differ on stage 0 only; with f0 = a x (the gradient x * dL/dh
    does not depend on a, and stage 0 sends nothing back) they coincide."""
    stash = _two_stage(_squared_times, "stash", _sgd(0.1))
    none = _two_stage(_squared_times, "none", _sgd(0.1))
    assert abs(float(stash.params[0]["w"]) - float(none.params[0]["w"])) > 1e-3
    assert float(stash.params[1]["w"]) == float(none.params[1]["w"])
    stash = _two_stage(_times, "stash", _sgd(0.1))
    none = _two_stage(_times, "none", _sgd(0.1))
    for s in range(2):
        _close(stash.params[s], none.params[s], rtol=0, atol=1e-15)


def test_predict_sgd_momentum_by_hand() -> None:
    """f0 = a x, f1 = b h, SGD lr 0.1 momentum 0.9: F(1) on stage 0 (vF = 0, no state yet)
    runs at a0; F(2) (vF = 1, d = 1) at P = a1 - lr * mu * buf(1)."""
    got = _two_stage(_times, "predict", _sgd(0.1, momentum=0.9))
    lr, mu = 0.1, 0.9
    a0, b0 = 1.0, 0.5
    # m = 0: h = 1, y = 0.5, r = -1: dL/db = -1, dL/da = r b x = -0.5; first step: buf = grad
    r = 2 * (b0 * a0 * X[0] - T[0])
    buf_b, buf_a = r * a0 * X[0], r * b0 * X[0]  # -1, -0.5
    b1, a1 = b0 - lr * buf_b, a0 - lr * buf_a  # 0.6, 1.05
    # m = 1: P = a0 (no optimizer state at vF = 0): h = 2, y = 1.2, r = 2.4
    h = a0 * X[1]
    r = 2 * (b1 * h - T[1])
    buf_b, buf_a = mu * buf_b + r * h, mu * buf_a + r * b1 * X[1]  # 3.9, 2.43
    b2, a2 = b1 - lr * buf_b, a1 - lr * buf_a  # 0.21, 0.807
    # m = 2: P = a1 - lr * mu * buf_a(1) = 1.05 - 0.1 * 0.9 * (-0.5) = 1.095
    p = a1 - lr * mu * (-0.5)
    h = p * X[2]  # -1.095
    y = b2 * h  # -0.22995
    r = 2 * (y - T[2])  # -4.4599
    buf_b, buf_a = mu * buf_b + r * h, mu * buf_a + r * b2 * X[2]  # 8.3935905, 3.123579
    b3, a3 = b2 - lr * buf_b, a2 - lr * buf_a
    assert (a3, b3) == pytest.approx((0.4946421, -0.62935905), rel=1e-12)
    assert float(got.params[0]["w"]) == pytest.approx(a3, rel=1e-12)
    assert float(got.params[1]["w"]) == pytest.approx(b3, rel=1e-12)
    assert got.losses[2] == pytest.approx((y - T[2]) ** 2, rel=1e-12)
    assert got.losses[2] == pytest.approx(2.22995**2, rel=1e-12)


def test_predict_is_stash_without_momentum_or_decay() -> None:
    """Zero-gradient SGD steps without momentum or weight decay move nothing: "predict" is
    "stash" exactly; with momentum it is not."""
    stages, params, batches = _mlp(5)
    runs = {
        (mitigation, mu): simulate(
            stages,
            params,
            batches,
            _mse,
            _sgd(0.1, momentum=mu),
            mitigation=mitigation,
            step_every=1,
        )  # fmt: skip
        for mitigation in ("stash", "predict")
        for mu in (0.0, 0.9)
    }
    assert runs["stash", 0.0].staleness == ((0, 1, 2, 2, 2), (0, 1, 1, 1, 1), (0,) * 5)
    for s in range(3):
        _close(runs["predict", 0.0].params[s], runs["stash", 0.0].params[s], rtol=0, atol=0)
    assert runs["predict", 0.0].losses == runs["stash", 0.0].losses
    assert runs["predict", 0.9].losses[2:] != runs["stash", 0.9].losses[2:]


@pytest.mark.parametrize(
    "make",
    [
        _sgd(0.1, momentum=0.9),
        _sgd(0.1, momentum=0.9, dampening=0.3, weight_decay=0.05),
        _sgd(0.1, momentum=0.8, nesterov=True, weight_decay=0.05),
        _sgd(0.1, weight_decay=0.05),
        lambda leaves: torch.optim.Adam(leaves, lr=0.01, betas=(0.8, 0.9)),
        lambda leaves: torch.optim.Adam(leaves, lr=0.01, weight_decay=0.1),
        _adamw,
    ],
    ids=["momentum", "dampening-decay", "nesterov-decay", "decay", "adam", "adam-l2", "adamw"],
)
def test_prediction_formulas_are_zero_gradient_steps(make: Make) -> None:
    """The hand-written prediction equals torch's own optimizer stepping d = 3 times on zero
    gradients from the same state."""
    g = torch.Generator().manual_seed(1)
    w = torch.randn(5, generator=g, dtype=F64).requires_grad_()
    opt = make([w])
    for _ in range(2):
        w.grad = torch.randn(5, generator=g, dtype=F64)
        opt.step()
    predicted = _predict({"w": w.detach().clone()}, _snapshot_states(opt, [w]), 3)
    for _ in range(3):
        w.grad = torch.zeros_like(w)
        opt.step()
    torch.testing.assert_close(predicted["w"], w.detach(), rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize(
    "make",
    [
        lambda leaves: torch.optim.RMSprop(leaves, lr=0.1),
        lambda leaves: torch.optim.Adam(leaves, lr=0.1, amsgrad=True),
    ],
    ids=["rmsprop", "amsgrad"],
)
def test_predict_refuses_other_optimizers(make: Make) -> None:
    with pytest.raises(ValueError):
        _two_stage(_times, "predict", make)


# --- tied weights, flushes, dropout -----------------------------------------------------------


@pytest.mark.parametrize("mitigation", MITIGATIONS)
def test_tied_copies_by_hand(mitigation: str) -> None:
    """f0 = a x and f1 = a h with one weight a held by both stages (SGD lr 0.1, step_every 1,
    2 micro-batches): each update applies the sum of both copies' gradients to both. Stage 0 is
    linear in a and SGD has no momentum, so all mitigations agree."""
    params = [{"emb": _scalar(0.5)}, {"head": _scalar(0.5)}]
    got = simulate(
        [lambda p, x: p["emb"] * x, lambda p, h: p["head"] * h], params,
        _batches((1.0, 2.0), (1.0, -1.0)), _square, _sgd(0.1),
        mitigation=mitigation, step_every=1, tied=[{(0, "emb"), (1, "head")}],
    )  # fmt: skip
    # m = 0: h = 0.5, y = 0.25, r = 2 (0.25 - 1) = -1.5; head: r h = -0.75, emb: r a x = -0.75
    a1 = 0.5 - 0.1 * (-1.5 * 0.5 + -1.5 * 0.5 * 1.0)  # 0.65
    # m = 1: stage 0 at a0 = 0.5 (vF = 0): h = 1.0; stage 1 at a1: y = 0.65, r = 3.3;
    # head: r h = 3.3, emb: r a1 x = 3.3 * 0.65 * 2 = 4.29
    a2 = a1 - 0.1 * (3.3 * 1.0 + 3.3 * 0.65 * 2.0)  # 0.65 - 0.759
    assert a2 == pytest.approx(-0.109, rel=1e-12)
    assert torch.equal(got.params[0]["emb"], got.params[1]["head"])
    assert float(got.params[0]["emb"]) == pytest.approx(a2, rel=1e-12)
    assert got.staleness == ((0, 1), (0, 0))


def test_flush_restarts_the_warm_up() -> None:
    """K = 2, step_every = 1, 4 micro-batches, a flush after 2: stage 0's d is 1 except right
    after the start and after the flush; stage 1's is 0."""
    xs, ts = (1.0, 2.0, -1.0, 0.5), (1.0, 0.0, 2.0, 1.0)
    params = [{"w": _scalar(1.0)}, {"w": _scalar(0.5)}]
    kwargs = {"mitigation": "stash", "step_every": 1}
    flushed = simulate(
        [_times, _times], params, _batches(xs, ts), _square, _sgd(0.1), flush_after={2}, **kwargs
    )
    assert flushed.staleness == ((0, 1, 0, 1), (0, 0, 0, 0))
    assert flushed.updates == (4, 4)
    plain = simulate([_times, _times], params, _batches(xs, ts), _square, _sgd(0.1), **kwargs)
    assert plain.staleness == ((0, 1, 1, 1), (0, 0, 0, 0))
    assert plain.losses[:2] == flushed.losses[:2]  # F(2) on stage 0: vF = 1 plain, 2 flushed
    assert plain.losses[2] != flushed.losses[2]


def _dropped(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    mask = (torch.rand(x.shape, dtype=F64) < 0.5).to(F64) * 2
    return p["w"] * x * mask


def _dropped_sum(p: dict[str, torch.Tensor], h: torch.Tensor) -> torch.Tensor:
    return _dropped(p, h).sum()


def _dropout_run(mitigation: str, lr: float) -> tuple[Any, list, list[torch.Tensor]]:
    xs = [torch.linspace(-1, 1, 6, dtype=F64) + m for m in range(3)]
    batches = [(x, _scalar(1.0)) for x in xs]
    params = [{"w": _scalar(0.7)}, {"w": _scalar(-0.4)}]
    states = [torch.Generator().manual_seed(seed).get_state() for seed in (11, 22)]
    got = simulate(
        [_dropped, _dropped_sum], params, batches, _square, _sgd(lr),
        mitigation=mitigation, step_every=1, rng_states=states,
    )  # fmt: skip
    return got, batches, states


@pytest.mark.parametrize("mitigation", MITIGATIONS)
def test_dropout_masks_follow_each_stage_generator(mitigation: str) -> None:
    """With rng_states each stage draws from its own generator, F(0), F(1), ... in order; with
    lr = 0 the losses are those of the masks a generator stepped here gives; the caller's
    generator state is put back."""
    before = torch.get_rng_state()
    got, batches, states = _dropout_run(mitigation, lr=0.0)
    assert torch.equal(torch.get_rng_state(), before)
    gens = [torch.Generator(), torch.Generator()]
    for gen, state in zip(gens, states):
        gen.set_state(state)
    want = []
    for x, t in batches:
        m0, m1 = ((torch.rand(6, generator=g, dtype=F64) < 0.5).to(F64) * 2 for g in gens)
        want.append(float((-0.4 * (0.7 * x * m0) * m1).sum() - t) ** 2)
    assert got.losses == pytest.approx(want, rel=1e-12)
    assert len(set(got.losses)) == 3


def test_none_recompute_replays_the_forward_draws() -> None:
    """Stage 0 is linear in its weight and first: "none" recomputes B(m) at W(vB), which gives
    "stash"'s gradient only if it replays F(m)'s mask."""
    stash, _, _ = _dropout_run("stash", lr=0.1)
    none, _, _ = _dropout_run("none", lr=0.1)
    assert stash.staleness[0] == (0, 1, 1)
    assert stash.losses == none.losses
    for s in range(2):
        _close(none.params[s], stash.params[s], rtol=1e-13, atol=1e-15)
