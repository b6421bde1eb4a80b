"""fxpipe.distributed.rank.gradients: the gradients of a Parameter several ranks hold, summed once
per step by ``sync_tied_gradients`` into eager's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import fxpipe.distributed as fd
from tests.distributed.ranks import N_MB, launch, preload, problem, results, step

preload(__name__)


def _bits(rank: int, world: int, *, name: str, n_mbs: tuple[int, ...]) -> dict[int, Any]:
    """The eager model's gradients on this rank (one thread, as the stages run), and, for a
    pipeline of each number of micro-batches, which of its gradients (tied copies summed)
    have exactly eager's bits."""
    build, args, kwargs, loss_fn, target = problem(name)
    eager = build()
    loss_fn(eager(*args, **kwargs), target).backward()
    want = dict(eager.named_parameters())
    out = {}
    for n_mb in n_mbs:
        pipe = fd.pipeline_schedule(
            build(), args, example_kwargs=kwargs, n_microbatches=n_mb, loss_fn=loss_fn,
            scale_grads=False,
        )  # fmt: skip
        step(pipe, args, kwargs, target)
        pipe.sync_tied_gradients()
        out[n_mb] = {
            "equal": {k: torch.equal(p.grad, want[k].grad) for k, p in pipe.named_parameters()},
            "replicated": pipe.replicated_keys,
        }
    return out


def _sync(rank: int, world: int) -> dict[str, Any]:
    """``sync_tied_gradients`` sums the copies of a Parameter held on several ranks. fxpipe's
    tracer gives every Parameter one home stage, so the copies here are made up: one held by
    both ranks, one by rank 0 only."""
    build, args, _, loss_fn, _ = problem("mlp_residual")
    pipe = fd.pipeline_schedule(build(), args, n_microbatches=N_MB, loss_fn=loss_fn)
    assert pipe.replicated_keys == ()
    pipe.sync_tied_gradients()  # nothing to sum: no communication
    both, mine = nn.Parameter(torch.zeros(3)), nn.Parameter(torch.zeros(2, 2))
    both.grad, mine.grad = torch.full((3,), rank + 1.0), torch.ones(2, 2)
    shapes = (both.shape, mine.shape)
    pipe._own.replicated = [
        ("both", shapes[0], both),
        ("mine", shapes[1], mine if rank == 0 else None),
    ]
    pipe._own.shared_keys = frozenset({"both", "mine"})
    pipe.sync_tied_gradients()
    return {"both": both.grad, "mine": mine.grad}


@pytest.mark.slow
def test_a_tied_weights_summed_copies_have_eagers_bits_at_one_micro_batch(
    tmp_path: Path,
) -> None:
    """The copies' gradients summed once per step are the eager gradient to the bit when
    the step is one micro-batch (eager's autograd adds the same two terms); with several,
    no gradient (tied or not) is: each is a sum over micro-batches, rounded otherwise than
    the whole batch's (the other tests compare those within float32 rounding)."""
    runs = results(launch(_bits, 2, tmp_path, name="transformer", n_mbs=(1, N_MB)))
    for n_mb, exact in ((1, True), (N_MB, False)):
        per_rank = [r[n_mb] for r in runs]
        assert all(r["replicated"] == ("tok.weight",) for r in per_rank)
        equal = {k: v for r in per_rank for k, v in r["equal"].items()}
        assert len(equal) > 10 and "tok.weight" in equal
        if exact:
            assert all(equal.values()), [k for k, v in equal.items() if not v]
        else:
            assert not all(equal.values()), "micro-batched sums round otherwise"


@pytest.mark.slow
def test_sync_tied_gradients_sums_copies(tmp_path: Path) -> None:
    per_rank = results(launch(_sync, 2, tmp_path))
    for r in per_rank:
        assert torch.equal(r["both"], torch.full((3,), 3.0))
    assert torch.equal(per_rank[0]["mine"], torch.ones(2, 2))
