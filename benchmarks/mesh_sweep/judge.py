"""The mesh sweep's verdict on what the ranks handed back, step by step: in float64 within
1e-7 of eager; in a narrower dtype no further from float64 eager than eager in that dtype."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

import fxpipe.distributed as fd
from benchmarks.harness.compare import TOLERANCE, compare_tensors
from benchmarks.harness.precision import FACTOR, Against, no_further, sum_floor
from benchmarks.harness.rows import Row
from benchmarks.mesh_sweep.oracle import Step

__all__ = ["losses", "copies", "judge_exact", "judge_narrow", "step_noise"]

Copy = tuple[str, dict[str, Any], dict[str, Any]]


def losses(ranks: list[Row], s: int, dp: int) -> dict[int, float] | str:
    """Step ``s``'s loss summed over the replicas, per "tp" coordinate (each runs a copy of
    every replica's last stage); why not, where a coordinate has not ``dp`` of them."""
    per: dict[int, list[float]] = {}
    for r in ranks:
        loss = r["steps"][s]["loss"]
        if loss is not None:
            per.setdefault(r.get("tp", 0), []).append(loss)
    wrong = {t: len(got) for t, got in per.items() if len(got) != dp}
    if not per or wrong:
        return f"ranks report {wrong or 0} losses per tp coordinate, not {dp}"
    return {t: sum(got) for t, got in sorted(per.items())}


def copies(ranks: list[Row], s: int, want: Step) -> Iterator[Copy]:
    """Per copy of the model (a replica on a "tp" coordinate): its name, its gradients and
    its parameters after step ``s``'s update (its ranks' parts merged), keyed as ``want``."""
    keys = sorted({(r["replica"], r.get("tp", 0)) for r in ranks})
    for replica, t in keys:
        mine = [r for r in ranks if (r["replica"], r.get("tp", 0)) == (replica, t)]
        grads: dict[str, Any] = {k: None for k in want.grads}
        for r in mine:
            grads.update(r["steps"][s]["grads"])
        merged = fd.merge_state_dicts([r["steps"][s]["state"] for r in mine])
        where = f"replica {replica}" + (f", tp {t}" if len(keys) > 1 and t else "")
        yield where, grads, {k: merged.get(k) for k in want.params}


def judge_exact(ranks: list[Row], s: int, dp: int, want: Step) -> Row:
    """equal or wrong: the loss, every gradient (each copy's) and every parameter after the
    update against eager in float64, each within ``TOLERANCE``."""
    got = losses(ranks, s, dp)
    if isinstance(got, str):
        return {"status": "wrong", "reason": got}
    worst = {"loss": max(abs(v - want.loss) / max(abs(want.loss), 1e-30) for v in got.values())}
    if not worst["loss"] < TOLERANCE:
        reason = f"loss {list(got.values())!r}, eager {want.loss!r}: err {worst['loss']:.2e}"
        return {"status": "wrong", "reason": reason, "max_err": worst}
    first: str | None = None
    for where, grads, params in copies(ranks, s, want):
        for kind, mine, ref in (("grad", grads, want.grads), ("param", params, want.params)):
            problem, err = compare_tensors(f"{where}: {kind}", mine, ref)
            worst[kind] = max(worst.get(kind, 0.0), err)
            first = first or problem
    if first:
        return {"status": "wrong", "reason": first, "max_err": worst}
    return {"status": "equal", "reason": "", "max_err": worst}


def _scalar(value: float) -> dict[str, torch.Tensor | None]:
    return {"loss": torch.tensor(value, dtype=torch.float64)}


def judge_narrow(
    ranks: list[Row], s: int, dp: int, eager: Step, reference: Step, dtype: torch.dtype
) -> Row:
    """equal or wrong: the loss, every gradient and every parameter after the update no
    further from eager in float64 (``reference``) than ``FACTOR`` x eager's in ``dtype``."""
    got = losses(ranks, s, dp)
    if isinstance(got, str):
        return {"status": "wrong", "reason": got}
    verdicts: dict[str, list[Against]] = {"loss": [], "grad": [], "param": []}
    want, ref = _scalar(eager.loss), _scalar(reference.loss)
    least = sum_floor(eager.terms, reference.terms, dtype)
    for t, value in got.items():
        what = f"tp {t}: loss" if t else "loss"
        verdicts["loss"].append(no_further(what, _scalar(value), want, ref, dtype, least))
    for where, grads, params in copies(ranks, s, reference):
        verdicts["grad"].append(no_further(f"{where}: grad", grads, eager.grads, reference.grads))
        verdicts["param"].append(
            no_further(f"{where}: param", params, eager.params, reference.params)
        )
    row: Row = {
        "max_err": {k: max(a.err for a in v) for k, v in verdicts.items()},
        "eager_err": {k: max(a.eager for a in v) for k, v in verdicts.items()},
        "ratio": {k: max(a.ratio for a in v) for k, v in verdicts.items()},
    }
    first = next((a.problem for v in verdicts.values() for a in v if a.problem), None)
    if first:
        return {"status": "wrong", "reason": f"{first} (over {FACTOR:g}x)", **row}
    return {"status": "equal", "reason": "", **row}


def step_noise(one: Step, other: Step) -> dict[str, float]:
    """How far apart two eager runs of one step are, per kind (loss, grad, param): the same
    model and batch on other micro-batches, which a float64 model's own float32 work rounds
    otherwise."""
    loss = abs(one.loss - other.loss) / max(abs(other.loss), 1e-30)
    _, grad = compare_tensors("grad", one.grads, other.grads)
    _, param = compare_tensors("param", one.params, other.params)
    return {"loss": loss, "grad": grad, "param": param}
