"""Compiled stages over the test zoo: every model, pipelined over 2 stages with
``compile=`` (torch's ``aot_eager`` backend: dynamo and AOTAutograd, the whole compile path
but inductor's code generation), in float64, equal to eager: outputs and every gradient.
Dropout at p=0 and BatchNorm models in eval mode, as in test_transparency.py."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from models import ZOO, Case
from oracle import relative_error
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

import fxpipe

QUICK = "multi_io_dict"


def _prepared(case: Case) -> nn.Module:
    model = case.build().double()
    model.train("batchnorm" not in case.tags)
    for m in model.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0
    return model


def _example(case: Case) -> tuple[Any, Any]:
    def double(t: Any) -> Any:
        return t.double() if isinstance(t, torch.Tensor) and t.is_floating_point() else t

    return tree_map(double, case.example(case.batch))


def _loss(out: Any) -> torch.Tensor:
    total = torch.zeros((), dtype=torch.float64)
    for t in tree_flatten(out)[0]:
        if isinstance(t, torch.Tensor) and t.is_floating_point():
            total = total + (t * torch.linspace(-1, 1, t.numel(), dtype=t.dtype).view_as(t)).sum()
    return total


def _run(model: nn.Module, args: Any, kwargs: Any) -> tuple[list[Any], dict[str, Any]]:
    for p in model.parameters():
        p.grad = None
    out = model(*args, **kwargs)
    _loss(out).backward()
    owner = model.module if isinstance(model, fxpipe.Pipeline) else model
    leaves = [t.detach() if isinstance(t, torch.Tensor) else t for t in tree_flatten(out)[0]]
    return leaves, {n: p.grad for n, p in owner.named_parameters()}


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=() if n == QUICK else pytest.mark.slow) for n in ZOO]
)
def test_compiled_zoo_model_equals_eager(name: str) -> None:
    case = ZOO[name]
    model, twin = _prepared(case), _prepared(case)
    args, kwargs = _example(case)
    pipe = fxpipe.pipeline(
        model, args, ["cpu", "cpu"], example_kwargs=kwargs, chunks=2, cost="flops",
        tracer=case.tracer, compile={"backend": "aot_eager"},
    )  # fmt: skip
    for _ in range(2):  # the second call runs the graphs the first compiled
        got, got_grads = _run(pipe, args, kwargs)
        want, want_grads = _run(twin, args, kwargs)
        for g, w in zip(got, want, strict=True):
            if isinstance(w, torch.Tensor) and w.is_floating_point():
                assert relative_error(g, w) < 1e-10
            else:
                assert torch.equal(g, w) if isinstance(w, torch.Tensor) else g == w
        for n, w in want_grads.items():
            if w is None:
                assert got_grads[n] is None, n
            else:
                assert relative_error(got_grads[n], w) < 1e-10, n
    assert all(c.compiled for c in pipe.compilation), pipe.compilation
