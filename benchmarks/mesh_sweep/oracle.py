"""The mesh sweep's oracle (eager on every micro-batch of both replicas) and its verdict on
what the ranks handed back."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

import fxpipe.distributed as fd
from benchmarks.harness.compare import TOLERANCE, compare_tensors
from benchmarks.harness.prepare import fresh
from benchmarks.harness.rows import Row
from benchmarks.mesh_sweep.batch import DP, LR, micro_batches, prepared, projection_loss

__all__ = ["Oracle", "oracle", "judge"]


@dataclass
class Oracle:
    """Eager on every micro-batch of both replicas: the summed loss, the gradients averaged
    over the replicas, and the parameters after one SGD step with them."""

    loss: float
    grads: dict[str, torch.Tensor | None]
    params: dict[str, torch.Tensor]


def oracle(name: str, m: int) -> Oracle:
    model, args, kwargs = prepared(name, m)
    total = torch.zeros((), dtype=torch.float64)
    for replica in micro_batches(args, kwargs, m):
        for a, k, index in replica:
            loss = projection_loss(model(*fresh(a), **fresh(k)), index)
            total = total + loss.detach()
            if loss.requires_grad:
                loss.backward()
    grads = {
        n: None if p.grad is None else p.grad.detach() / DP for n, p in model.named_parameters()
    }
    with torch.no_grad():
        params = {
            n: p.detach() - LR * grads[n] if grads[n] is not None else p.detach().clone()
            for n, p in model.named_parameters()
        }
    return Oracle(float(total), grads, params)


def judge(results: list[Row], want: Oracle) -> Row:
    """equal or wrong: the loss, every gradient (each replica's, each once) and every
    parameter after the update (each replica's merged shards) against the oracle."""
    worst: dict[str, float] = {}
    losses = [r["loss"] for r in results if r["loss"] is not None]
    if len(losses) != DP:
        return {"status": "wrong", "reason": f"{len(losses)} ranks report a loss, not {DP}"}
    got_loss = sum(losses)
    worst["loss"] = abs(got_loss - want.loss) / max(abs(want.loss), 1e-30)
    if not worst["loss"] < TOLERANCE:
        reason = f"loss {got_loss!r}, eager {want.loss!r}: err {worst['loss']:.2e}"
        return {"status": "wrong", "reason": reason, "max_err": worst}
    first: str | None = None
    for replica in range(DP):
        mine = [r for r in results if r["replica"] == replica]
        grads: dict[str, Any] = {k: None for k in want.grads}
        for r in mine:
            grads.update(r["grads"])
        params = fd.merge_state_dicts([r["state"] for r in mine])
        params = {k: params.get(k) for k in want.params}
        for kind, got, ref in (("grad", grads, want.grads), ("param", params, want.params)):
            problem, err = compare_tensors(f"replica {replica}: {kind}", got, ref)
            worst[kind] = max(worst.get(kind, 0.0), err)
            first = first or problem
    if first:
        return {"status": "wrong", "reason": first, "max_err": worst}
    return {"status": "equal", "reason": "", "max_err": worst}
