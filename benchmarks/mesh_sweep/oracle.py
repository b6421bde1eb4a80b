"""The mesh sweep's oracle: eager on every micro-batch of every replica, step after step (an
SGD update between, or each step from the pipeline's own parameters), in float64 and in the
run's dtype."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch
from torch import nn

from benchmarks.harness.failures import first_line
from benchmarks.harness.models.spec import Args, Kwargs
from benchmarks.harness.precision import NarrowOps
from benchmarks.harness.prepare import fresh
from benchmarks.mesh_sweep.batch import (
    LR,
    micro_batches,
    prepared,
    projection_loss,
    projection_terms,
)
from benchmarks.mesh_sweep.configs import Config

__all__ = ["Params", "Step", "Trajectory", "trajectory"]

Params = dict[str, torch.Tensor]


@dataclass
class Step:
    """Eager's step on every micro-batch of every replica: the summed loss and its terms
    (:func:`projection_terms`), the gradients averaged over the replicas, and the parameters
    after one SGD step with them."""

    loss: float
    terms: torch.Tensor
    grads: dict[str, torch.Tensor | None]
    params: dict[str, torch.Tensor]


@dataclass
class Trajectory:
    """Eager's steps in ``dtype``, each a :class:`Step` or why eager failed there (a
    string; no step follows it); in float64, the ops of its first step whose outputs are
    narrower (the model's own float32 work, :class:`NarrowOps`)."""

    dtype: torch.dtype
    steps: list[Step | str]
    narrow: dict[str, int] = field(default_factory=dict)


def _step(model: nn.Module, args: Args, kwargs: Kwargs, config: Config) -> Step:
    """Eager on every micro-batch of every replica, the gradients averaged over them."""
    total, terms = torch.zeros((), dtype=torch.float64), []
    for replica in micro_batches(args, kwargs, config.n_microbatches, config.dp):
        for a, k, index in replica:
            output = model(*fresh(a), **fresh(k))
            terms.append(projection_terms(output, index))
            loss = projection_loss(output, index)
            total = total + loss.detach()
            if loss.requires_grad:
                loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p.grad.div_(config.dp)  # DDP and FSDP average over the replicas
    grads = {
        n: None if p.grad is None else p.grad.detach().clone() for n, p in model.named_parameters()
    }
    return Step(float(total), torch.cat(terms), grads, {})


def _narrow(model: nn.Module, args: Args, kwargs: Kwargs) -> dict[str, int]:
    """The ops of a forward of a copy of ``model`` whose outputs are narrower than float64
    (:class:`NarrowOps`); a copy, without gradients, since a dispatch mode may change what
    an op computes (Gemma 2's attention in float64 gives NaN under one)."""
    watch = NarrowOps(torch.float64)
    try:
        with torch.no_grad(), watch:
            copy.deepcopy(model)(*fresh(args), **fresh(kwargs))
    except Exception:  # the oracle itself says why eager fails
        pass
    return watch.ops


def _load(model: nn.Module, params: Params) -> None:
    """``params`` copied into ``model``'s Parameters of those names (in its dtype)."""
    with torch.no_grad():
        for n, p in model.named_parameters():
            if params.get(n) is not None:
                p.copy_(params[n])


def trajectory(
    name: str, config: Config, dtype: torch.dtype, starts: dict[int, Params] | None = None
) -> Trajectory:
    """Eager in ``dtype`` (the model built in float64, then cast) over ``config``'s steps,
    one SGD update after each, as the ranks take them; with ``starts``, step ``s`` from the
    parameters ``starts[s]`` (the pipeline's own after its step before, so that a step is
    judged from where the pipeline stood: no drift of earlier rounding carried into it)."""
    got = prepared(name, config, dtype)
    model = got.model
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    steps: list[Step | str] = []
    narrow = _narrow(model, *got.batches[0]) if dtype == torch.float64 and not starts else {}
    for s, (args, kwargs) in enumerate(got.batches):
        if starts and s in starts:
            _load(model, starts[s])
        try:
            step = _step(model, args, kwargs, config)
        except Exception as exc:
            steps.append(f"eager failed: {first_line(repr(exc))}")
            break
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step.params = {n: p.detach().clone() for n, p in model.named_parameters()}
        steps.append(step)
    return Trajectory(dtype, steps, narrow)
