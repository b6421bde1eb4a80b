"""The reference for async1f1b: a plain sequential simulation of its update rule, per stage."""

from __future__ import annotations

import copy
from collections import deque
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any

import torch

Params = dict[str, torch.Tensor]
Grads = dict[str, torch.Tensor | None]
StageFn = Callable[[Params, Any], Any]
# One parameter's optimizer at a version: its param group's hyper-parameters and its state.
ParamState = tuple[dict[str, Any], dict[str, Any]]

MITIGATIONS = ("stash", "predict", "none")


@dataclass(frozen=True)
class Simulated:
    """What the rule gives for a stream: each stage's final weights, the loss of each
    micro-batch (stream order), each stage's staleness d per micro-batch ([stage][m]) and the
    number of updates each stage made."""

    params: tuple[Params, ...]
    losses: tuple[float, ...]
    staleness: tuple[tuple[int, ...], ...]
    updates: tuple[int, ...]


@dataclass(frozen=True)
class _Order:
    """One stage's events under its local rule: the number of updates made before its forward
    (vF) and its backward (vB) of each micro-batch, and the micro-batches whose backward an
    update follows."""

    v_forward: tuple[int, ...]
    v_backward: tuple[int, ...]
    update_after: frozenset[int]


@dataclass
class _Run:
    """One stage during the simulation: its function, current weights (the optimizer's leaves),
    the versions W(v) (and optimizer states O(v) for "predict") still needed, the gradient
    accumulated since its last update, and its own generator state."""

    fn: StageFn
    names: tuple[str, ...]
    leaves: list[torch.Tensor]
    optimizer: torch.optim.Optimizer
    scheduler: Any
    order: _Order
    weights: dict[int, Params]
    states: dict[int, list[ParamState]] | None
    grads: Grads
    rng: torch.Tensor | None
    updates: int = 0


@dataclass(frozen=True)
class _Record:
    """A stage's forward of one micro-batch: its input (leaves), the weights it ran at (leaves),
    its output and the generator state before it."""

    x: Any
    leaves: Params
    y: Any
    rng: torch.Tensor | None


# --- the local rule: event order, versions ------------------------------------------------


def _stage_order(warmup: int, n: int, every: int, flushes: frozenset[int]) -> _Order:
    """Run one stage's local rule (warm-up ``warmup``, update every ``every`` backwards,
    flushes after the counts in ``flushes``) over ``n`` micro-batches."""
    v_forward, v_backward = [0] * n, [0] * n
    update_after: set[int] = set()
    in_flight: deque[int] = deque()
    updates = since = 0

    def backward(m: int) -> None:
        nonlocal updates, since
        v_backward[m] = updates
        since += 1
        if since == every:
            updates, since = updates + 1, 0
            update_after.add(m)

    for m in range(n):
        v_forward[m] = updates
        in_flight.append(m)
        while len(in_flight) > warmup:
            backward(in_flight.popleft())
        if m + 1 in flushes:
            while in_flight:
                backward(in_flight.popleft())
            if since:  # the partial update follows the last backward, B(m)
                updates, since = updates + 1, 0
                update_after.add(m)
    return _Order(tuple(v_forward), tuple(v_backward), frozenset(update_after))


# --- values passed between stages ---------------------------------------------------------


def _tensors(obj: Any) -> list[torch.Tensor]:
    """The tensors in a nested tuple / list / dict, in traversal order."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (tuple, list)):
        return [t for o in obj for t in _tensors(o)]
    if isinstance(obj, dict):
        return [t for o in obj.values() for t in _tensors(o)]
    return []


def _detach(obj: Any, grad: bool) -> Any:
    """``obj`` with each tensor detached into a new leaf; with ``grad``, floating ones require
    grad (a stage's input, whose gradient goes back to the stage before)."""
    if isinstance(obj, torch.Tensor):
        leaf = obj.detach()
        return leaf.requires_grad_() if grad and leaf.is_floating_point() else leaf
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(_detach(o, grad) for o in obj))
    if isinstance(obj, (tuple, list)):
        return type(obj)(_detach(o, grad) for o in obj)
    if isinstance(obj, dict):
        return {k: _detach(v, grad) for k, v in obj.items()}
    return obj


def _clone(weights: Params) -> Params:
    """Detached copies of weights."""
    return {name: w.detach().clone() for name, w in weights.items()}


# --- optimizer states and the prediction ----------------------------------------------------


def _predict_kind(optimizer: torch.optim.Optimizer) -> str:
    """The prediction formulas an optimizer takes: "sgd" (SGD) or "adam" (Adam, AdamW);
    ValueError for any other optimizer, and for amsgrad."""
    if type(optimizer) is torch.optim.SGD:
        return "sgd"
    if type(optimizer) in (torch.optim.Adam, torch.optim.AdamW):
        if any(group.get("amsgrad", False) for group in optimizer.param_groups):
            raise ValueError("predict: amsgrad has no prediction formula")
        return "adam"
    raise ValueError(f"predict: no prediction formula for {type(optimizer).__name__}")


def _snapshot_states(
    optimizer: torch.optim.Optimizer, leaves: Sequence[torch.Tensor]
) -> list[ParamState]:
    """Each leaf's optimizer as it is now: a copy of its group's hyper-parameters (with
    ``kind`` and ``decoupled_weight_decay`` filled in) and of its state."""
    kind = _predict_kind(optimizer)
    decoupled = isinstance(optimizer, torch.optim.AdamW)
    groups = {id(p): g for g in optimizer.param_groups for p in g["params"]}
    out = []
    for leaf in leaves:
        hyper = copy.deepcopy({k: v for k, v in groups[id(leaf)].items() if k != "params"})
        hyper["kind"] = kind
        hyper["decoupled_weight_decay"] = decoupled or bool(
            hyper.get("decoupled_weight_decay", False)
        )
        state = {
            k: v.detach().clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v)
            for k, v in optimizer.state.get(leaf, {}).items()
        }
        out.append((hyper, state))
    return out


def _predict_sgd(
    w: torch.Tensor, hyper: dict[str, Any], state: dict[str, Any], d: int
) -> torch.Tensor:
    """SGD's weights after ``d`` steps with a zero loss gradient (weight decay, momentum,
    dampening, nesterov as torch.optim.SGD does them)."""
    lr, mu = float(hyper["lr"]), float(hyper["momentum"])
    damp, wd = float(hyper["dampening"]), float(hyper["weight_decay"])
    buf: torch.Tensor | None = state.get("momentum_buffer")
    if mu != 0 and buf is None:  # this parameter has no state yet
        return w
    for _ in range(d):
        grad = w * wd if wd != 0 else torch.zeros_like(w)
        if mu != 0:
            assert buf is not None
            buf = buf * mu + grad * (1 - damp)
            grad = grad + buf * mu if hyper["nesterov"] else buf
        w = w - lr * grad
    return w


def _predict_adam(
    w: torch.Tensor, hyper: dict[str, Any], state: dict[str, Any], d: int
) -> torch.Tensor:
    """Adam's (AdamW's) weights after ``d`` steps with a zero loss gradient (L2 weight decay
    feeds weight_decay * W into the moments; decoupled decay scales W first)."""
    if "step" not in state:  # this parameter has no state yet
        return w
    lr, eps, wd = float(hyper["lr"]), float(hyper["eps"]), float(hyper["weight_decay"])
    beta1, beta2 = (float(b) for b in hyper["betas"])
    m, v, t = state["exp_avg"], state["exp_avg_sq"], float(state["step"])
    for _ in range(d):
        t += 1
        grad = torch.zeros_like(w)
        if wd != 0 and hyper["decoupled_weight_decay"]:
            w = w * (1 - lr * wd)
        elif wd != 0:
            grad = w * wd
        m = m * beta1 + grad * (1 - beta1)
        v = v * beta2 + grad * grad * (1 - beta2)
        w = w - lr * (m / (1 - beta1**t)) / ((v / (1 - beta2**t)).sqrt() + eps)
    return w


def _predict(weights: Params, states: Sequence[ParamState], d: int) -> Params:
    """P: the weights the optimizer would reach from ``weights`` with ``states`` (one per
    weight, in order) after ``d`` steps that each see a zero loss gradient."""
    out = {}
    for (name, w), (hyper, state) in zip(weights.items(), states, strict=True):
        predict = _predict_sgd if hyper["kind"] == "sgd" else _predict_adam
        out[name] = predict(w, hyper, state, d)
    return out


# --- one stage's forward, backward and update ---------------------------------------------


def _snapshot(run: _Run) -> None:
    """Keep W(v) (and O(v)) for the stage's current version v = run.updates."""
    run.weights[run.updates] = _clone(dict(zip(run.names, run.leaves)))
    if run.states is not None:
        run.states[run.updates] = _snapshot_states(run.optimizer, run.leaves)


def _new_run(
    fn: StageFn,
    params: Params,
    order: _Order,
    make_optimizer: Callable[[list[torch.Tensor]], torch.optim.Optimizer],
    make_scheduler: Callable[[torch.optim.Optimizer], Any] | None,
    rng: torch.Tensor | None,
    predict: bool,
) -> _Run:
    """A stage at version 0: fresh leaves (copies of ``params``) and its optimizer."""
    names = tuple(params)
    leaves = [params[n].detach().clone().requires_grad_() for n in names]
    optimizer = make_optimizer(leaves)
    if predict:
        _predict_kind(optimizer)
    scheduler = make_scheduler(optimizer) if make_scheduler is not None else None
    run = _Run(
        fn=fn,
        names=names,
        leaves=leaves,
        optimizer=optimizer,
        scheduler=scheduler,
        order=order,
        weights={},
        states={} if predict else None,
        grads=dict.fromkeys(names),
        rng=None if rng is None else rng.clone(),
    )
    _snapshot(run)
    return run


def _forward_weights(run: _Run, m: int, mitigation: str) -> Params:
    """The weights F(m) runs at: W(vF), or for "predict" P from W(vF) and O(vF) over d."""
    v_f = run.order.v_forward[m]
    d = run.order.v_backward[m] - v_f
    if mitigation != "predict" or d == 0 or v_f == 0:
        return run.weights[v_f]
    assert run.states is not None
    return _predict(run.weights[v_f], run.states[v_f], d)


def _forward(fn: StageFn, weights: Params, x: Any, rng: torch.Tensor | None) -> _Record:
    """f(weights, x) at fresh leaves of ``weights``, from generator state ``rng`` if given."""
    leaves = {name: w.detach().requires_grad_() for name, w in weights.items()}
    if rng is not None:
        torch.set_rng_state(rng)
    return _Record(x=x, leaves=leaves, y=fn(leaves, x), rng=rng)


def _pairs(
    y: Any, grad_y: list[torch.Tensor | None]
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The outputs that carry a gradient back, and those gradients."""
    both = zip(_tensors(y), grad_y, strict=True)
    pairs = [(t, g) for t, g in both if t.requires_grad and g is not None]
    return [t for t, _ in pairs], [g for _, g in pairs]


def _backward(
    record: _Record, outputs: list[torch.Tensor], grad_outputs: list[torch.Tensor] | None
) -> tuple[Grads, list[torch.Tensor | None]]:
    """The gradients with respect to the record's weights and to its input's tensors (None
    where there is none)."""
    inputs = _tensors(record.x)
    wanted = [*record.leaves.values(), *(t for t in inputs if t.requires_grad)]
    got: list[torch.Tensor | None] = [None] * len(wanted)
    if outputs and wanted:
        got = list(torch.autograd.grad(outputs, wanted, grad_outputs, allow_unused=True))
    weight_grads: Grads = dict(zip(record.leaves, got[: len(record.leaves)], strict=True))
    rest = iter(got[len(record.leaves) :])
    return weight_grads, [next(rest) if t.requires_grad else None for t in inputs]


def _accumulate(run: _Run, grads: Grads) -> None:
    """Add one micro-batch's weight gradients to the stage's accumulated ones."""
    for name, g in grads.items():
        if g is not None:
            have = run.grads[name]
            run.grads[name] = g.detach().clone() if have is None else have + g


def _with_tied_sums(runs: Sequence[_Run], tied: Sequence[list[tuple[int, str]]]) -> list[Grads]:
    """Each stage's accumulated gradients, a tied weight's copies each given the sum of all
    copies' (summed in (stage, name) order)."""
    out = [dict(run.grads) for run in runs]
    for group in tied:
        total: torch.Tensor | None = None
        for s, n in group:
            part = runs[s].grads[n]
            if part is not None:
                total = part.clone() if total is None else total + part
        for s, n in group:
            out[s][n] = total
    return out


def _update(run: _Run, grads: Grads, max_grad_norm: float | None) -> None:
    """One UPDATE: set .grad, clip, step, zero_grad, scheduler step, keep the new version."""
    for name, leaf in zip(run.names, run.leaves, strict=True):
        g = grads[name]
        leaf.grad = None if g is None else g.clone()
    if max_grad_norm is not None:
        torch.nn.utils.clip_grad_norm_(run.leaves, max_grad_norm)
    run.optimizer.step()
    run.optimizer.zero_grad(set_to_none=True)
    if run.scheduler is not None:
        run.scheduler.step()
    run.updates += 1
    run.grads = dict.fromkeys(run.names)
    _snapshot(run)


def _prune(run: _Run, m: int) -> None:
    """Drop the versions no micro-batch after ``m`` runs at (vF is non-decreasing)."""
    v_forward = run.order.v_forward
    keep = v_forward[m + 1] if m + 1 < len(v_forward) else run.updates
    for v in [v for v in run.weights if v < keep]:
        del run.weights[v]
    for v in [v for v in run.states or {} if v < keep]:
        assert run.states is not None
        del run.states[v]


# --- one micro-batch through every stage --------------------------------------------------


def _forwards(runs: Sequence[_Run], m: int, x: Any, mitigation: str) -> list[_Record]:
    """F(m) on every stage in order, each at its version and from its own generator."""
    records = []
    for run in runs:
        record = _forward(run.fn, _forward_weights(run, m, mitigation), x, run.rng)
        if run.rng is not None:
            run.rng = torch.get_rng_state()
        records.append(record)
        x = _detach(record.y, grad=True)
    return records


def _backwards(
    runs: Sequence[_Run], m: int, records: list[_Record], loss: torch.Tensor, mitigation: str
) -> None:
    """B(m) on every stage, last first, each accumulating its weight gradients."""
    grad_y: list[torch.Tensor | None] = []
    for s in reversed(range(len(runs))):
        run, record = runs[s], records[s]
        assert run.order.v_backward[m] == run.updates, "B(m) must see the current weights"
        if mitigation == "none" and run.order.v_backward[m] != run.order.v_forward[m]:
            record = _forward(run.fn, run.weights[run.updates], record.x, record.rng)
        if s == len(runs) - 1:
            outputs, grad_outputs = ([loss] if loss.requires_grad else []), None
        else:
            outputs, grad_outputs = _pairs(record.y, grad_y)
        weight_grads, grad_y = _backward(record, outputs, grad_outputs)
        _accumulate(run, weight_grads)


def _microbatch(
    runs: Sequence[_Run],
    m: int,
    batch: tuple[Any, Any],
    loss_fn: Callable[[Any, Any], torch.Tensor],
    mitigation: str,
) -> float:
    """F(m) and B(m) on every stage; its loss."""
    records = _forwards(runs, m, _detach(batch[0], grad=False), mitigation)
    loss = loss_fn(records[-1].y, batch[1])
    _backwards(runs, m, records, loss, mitigation)
    return float(loss.detach())


# --- arguments ----------------------------------------------------------------------------


def _check(
    stages: Sequence[StageFn],
    params: Sequence[Params],
    n: int,
    mitigation: str,
    step_every: int,
    flush_after: Collection[int],
    rng_states: Sequence[torch.Tensor] | None,
) -> None:
    """ValueError for arguments the rule does not define."""
    if mitigation not in MITIGATIONS:
        raise ValueError(f"mitigation must be one of {MITIGATIONS}, not {mitigation!r}")
    if not stages or len(params) != len(stages):
        raise ValueError("need one params dict per stage, and at least one stage")
    if step_every < 1:
        raise ValueError("step_every must be >= 1")
    if any(not 0 <= c <= n for c in flush_after):
        raise ValueError(f"flush_after counts must lie in 0..{n}")
    if rng_states is not None and len(rng_states) != len(stages):
        raise ValueError("need one rng state per stage")


def _tied_groups(
    tied: Sequence[Collection[tuple[int, str]]], params: Sequence[Params]
) -> list[list[tuple[int, str]]]:
    """The tied groups sorted by (stage, name); ValueError for an unknown, repeated or
    unequal copy."""
    groups, seen = [], set()
    for group in tied:
        members = sorted(group)
        for s, name in members:
            if not 0 <= s < len(params) or name not in params[s] or (s, name) in seen:
                raise ValueError(f"tied copy {(s, name)} is unknown or in two groups")
            seen.add((s, name))
        first = params[members[0][0]][members[0][1]]
        if any(not torch.equal(params[s][n], first) for s, n in members):
            raise ValueError(f"tied copies {members} do not start equal")
        groups.append(members)
    return groups


# --- the simulation -----------------------------------------------------------------------


def simulate(
    stages: Sequence[StageFn],
    params: Sequence[Params],
    batches: Sequence[tuple[Any, Any]],
    loss_fn: Callable[[Any, Any], torch.Tensor],
    make_optimizer: Callable[[list[torch.Tensor]], torch.optim.Optimizer],
    *,
    mitigation: str,
    step_every: int,
    flush_after: Collection[int] = (),
    tied: Sequence[Collection[tuple[int, str]]] = (),
    rng_states: Sequence[torch.Tensor] | None = None,
    make_scheduler: Callable[[torch.optim.Optimizer], Any] | None = None,
    max_grad_norm: float | None = None,
) -> Simulated:
    """Run the async1f1b rule over the stream ``batches`` (stage s: ``stages[s](params, x)``;
    the last stage's output and the target go to ``loss_fn``), sequentially.

    Each stage's event order (F, B, UPDATE) comes from its local rule first; then the numbers
    are computed micro-batch by micro-batch (forward through the stages, backward back), and
    after B(m) every stage whose order puts an update there makes it (all stages update after
    the same micro-batches). ``params`` are copied, never modified; ``make_optimizer`` gets
    each stage's leaves in its params order; ``flush_after`` are counts of micro-batches after
    which the user flushes (the end always is). ``tied`` groups (stage, name) copies of one
    weight. ``rng_states`` (one torch.get_rng_state() per stage) gives each stage its own
    generator, used by its forwards in order (the caller's generator state is put back at the
    end); None leaves the generator alone (stages without randomness). Raises ValueError for
    "predict" with an optimizer other than SGD, Adam or AdamW (amsgrad refused).
    """
    n, k = len(batches), len(stages)
    _check(stages, params, n, mitigation, step_every, flush_after, rng_states)
    groups = _tied_groups(tied, params)
    flushes = frozenset(flush_after) | {n}
    orders = [_stage_order(k - 1 - s, n, step_every, flushes) for s in range(k)]
    assert len({o.update_after for o in orders}) == 1, "update k must cover the same batches"
    caller_rng = torch.get_rng_state() if rng_states is not None else None
    try:
        runs = [
            _new_run(
                stages[s],
                params[s],
                orders[s],
                make_optimizer,
                make_scheduler,
                None if rng_states is None else rng_states[s],
                mitigation == "predict",
            )
            for s in range(k)
        ]
        losses = []
        for m, batch in enumerate(batches):
            losses.append(_microbatch(runs, m, batch, loss_fn, mitigation))
            if m in orders[0].update_after:
                for run, grads in zip(runs, _with_tied_sums(runs, groups), strict=True):
                    _update(run, grads, max_grad_norm)
            for run in runs:
                _prune(run, m)
    finally:
        if caller_rng is not None:
            torch.set_rng_state(caller_rng)
    return Simulated(
        params=tuple(_clone(dict(zip(run.names, run.leaves))) for run in runs),
        losses=tuple(losses),
        staleness=tuple(
            tuple(b - f for f, b in zip(o.v_forward, o.v_backward, strict=True)) for o in orders
        ),
        updates=tuple(run.updates for run in runs),
    )
