"""On a CUDA device: every zoo model pipelined over CUDA stages (and CPU and CUDA stages
mixed) gives eager PyTorch's outputs and gradients, with "time" costs profiled on the GPU.

Skipped without CUDA (the ``cuda`` marker). Everything runs in float64 so that a value read
before its copy or its producing kernel finished (a missing stream wait) shows up as an
error far above rounding; the eager twin stays on the CPU, an independent oracle.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from models import ZOO, Case
from oracle import relative_error
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

import fxpipe
from fxpipe.api import pipeline_of
from fxpipe.compiler import compile_model
from fxpipe.options import PlanOptions, RunOptions

pytestmark = pytest.mark.cuda

LAYOUTS = {
    "cuda x2": ["cuda:0"] * 2,
    "cuda x4": ["cuda:0"] * 4,
    "cpu, cuda": ["cpu", "cuda:0"],
    "cuda, cpu, cuda": ["cuda:0", "cpu", "cuda:0"],
}


def _example(case: Case) -> tuple[Any, Any]:
    return tree_map(
        lambda t: t.double() if isinstance(t, torch.Tensor) and t.is_floating_point() else t,
        case.example(case.batch),
    )


def _model(case: Case) -> nn.Module:
    model = case.build().double()
    for m in model.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0
    model.train("batchnorm" not in case.tags)
    return model


def _loss(out: Any) -> torch.Tensor:
    total = torch.zeros((), dtype=torch.float64)
    for t in tree_flatten(out)[0]:
        if isinstance(t, torch.Tensor) and t.is_floating_point():
            weights = torch.linspace(-1.0, 1.0, t.numel(), dtype=t.dtype, device=t.device)
            total = total + (t * weights.reshape(t.shape)).sum().cpu()
    return total


def _cases() -> list[tuple[str, str]]:
    return [
        (name, layout)
        for name, case in ZOO.items()
        for layout, devices in LAYOUTS.items()
        if len(devices) <= case.max_stages
    ]


@pytest.mark.parametrize("name,layout", _cases())
def test_zoo_on_cuda_stages_equals_eager_on_cpu(name: str, layout: str) -> None:
    case = ZOO[name]
    model, twin = _model(case), _model(case)
    args, kwargs = _example(case)
    compiled = compile_model(
        model,
        args,
        LAYOUTS[layout],
        PlanOptions(cost="flops", tracer=case.tracer),
        example_kwargs=kwargs,
    )
    want = twin(*args, **kwargs)
    _loss(want).backward()
    twin_params = dict(twin.named_parameters())
    for checkpoint in ("except_last", "never"):
        pipe = pipeline_of(
            model,
            compiled,
            RunOptions(chunks=4, checkpoint=checkpoint, output_device=torch.device("cpu")),
        )
        for p in model.parameters():
            p.grad = None
        got = pipe(*args, **kwargs)
        got_leaves, want_leaves = tree_flatten(got)[0], tree_flatten(want)[0]
        for g, w in zip(got_leaves, want_leaves, strict=True):
            if isinstance(w, torch.Tensor) and w.is_floating_point():
                assert g.device == torch.device("cpu")
                assert relative_error(g, w) < 1e-9, (checkpoint, "output")
        _loss(got).backward()
        for pname, p in model.named_parameters():
            ref = twin_params[pname].grad
            if ref is None:
                continue
            assert p.grad is not None, (checkpoint, pname)
            assert relative_error(p.grad.cpu(), ref) < 1e-9, (checkpoint, pname)


def test_parameters_live_on_their_stage_devices() -> None:
    case = ZOO["mlp_residual"]
    model = _model(case)
    args, _ = _example(case)
    fxpipe.pipeline(model, args, ["cpu", "cuda:0"], chunks=2, cost="flops")
    assert {p.device.type for p in model.parameters()} == {"cpu", "cuda"}


def test_time_costs_are_profiled_on_the_gpu() -> None:
    case = ZOO["transformer"]
    model = _model(case).float()
    args, kwargs = case.example(case.batch)
    plan = fxpipe.plan(model, args, ["cuda:0"] * 2, example_kwargs=kwargs, cost="time")
    assert all(stage.cost > 0 for stage in plan.stages)
    assert len(plan.stages) == 2


def test_time_costs_are_profiled_on_each_kind_of_device() -> None:
    """A GPU stage and a CPU stage: "time" profiles the model on both, the CPU's speed is
    the ratio of the totals, and it gets the smaller share of the work."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(512, 512) for _ in range(16)])
    x = torch.randn(256, 512)
    plan = fxpipe.plan(model, x, ["cuda:0", "cpu"], cost="time")
    assert plan.speeds[0] == 1.0 and 0.0 < plan.speeds[1] < 1.0
    gpu, cpu = (sum(plan.node_cost[n] for n in s.nodes) for s in plan.stages)
    assert cpu < gpu
    assert plan.stages[1].cost == pytest.approx(cpu / plan.speeds[1])
