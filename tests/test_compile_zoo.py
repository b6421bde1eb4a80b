"""Compiled stages over the test zoo: every model but four (NOT_COMPILED), pipelined over 2
stages with ``compile=`` (torch's ``aot_eager`` backend: dynamo and AOTAutograd, the whole
compile path but inductor's code generation), in float64, equal to eager: outputs and every
gradient.
Dropout at p=0 and BatchNorm models in eval mode, as in test_transparency.py. No stage is
checkpointed (each would compile once more, for its forward without gradients): compiled
stages under each checkpoint mode are tests/runtime/test_compiled.py's."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from models import ZOO
from oracle import example_in, prepared, relative_error, weighted_loss
from torch import nn
from torch.utils._pytree import tree_flatten

import fxpipe

QUICK = "multi_io_dict"
#: Left out here for the suite's time (about a minute and a half of CPU): a deeper chain of
#: the residual MLP's blocks and two more CNNs of the kinds resnet and transformer compile
#: already; each runs uncompiled in test_transparency.py; and the Llama decoder, whose
#: stages compiled the same way (aot_eager) equal eager on two ranks
#: (tests/distributed/test_build.py).
NOT_COMPILED = ("deep_mlp", "unet", "inception", "llama")


def _run(model: nn.Module, args: Any, kwargs: Any) -> tuple[list[Any], dict[str, Any]]:
    for p in model.parameters():
        p.grad = None
    out = model(*args, **kwargs)
    weighted_loss(out).backward()
    owner = model.module if isinstance(model, fxpipe.Pipeline) else model
    leaves = [t.detach() if isinstance(t, torch.Tensor) else t for t in tree_flatten(out)[0]]
    return leaves, {n: p.grad for n, p in owner.named_parameters()}


@pytest.mark.parametrize(
    "name",
    [
        pytest.param(n, marks=() if n == QUICK else pytest.mark.slow)
        for n in ZOO
        if n not in NOT_COMPILED
    ],
)
def test_compiled_zoo_model_equals_eager(name: str) -> None:
    case = ZOO[name]
    train = "batchnorm" not in case.tags
    model, twin = prepared(case, train, torch.float64), prepared(case, train, torch.float64)
    args, kwargs = example_in(case, torch.float64)
    pipe = fxpipe.pipeline(
        model, args, ["cpu", "cpu"], example_kwargs=kwargs, chunks=2, cost="flops",
        checkpoint="never", tracer=case.tracer, compile={"backend": "aot_eager"},
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
