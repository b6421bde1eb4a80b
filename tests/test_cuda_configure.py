"""On a CUDA device: checkpointing per stage, the automatic configuration and compiled
stages give eager PyTorch's outputs and gradients, and recomputation on the GPU replays
dropout's masks exactly.

Skipped without CUDA (the ``cuda`` marker). The eager twin runs on the CPU in float64 (an
independent oracle) except for compiled stages, which run in float32 on the GPU and are
compared with the uncompiled pipeline on the same device at torch's float32 tolerance.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import fxpipe

pytestmark = pytest.mark.cuda

GPU = torch.device("cuda:0")
MODES = ["never", "always", "except_last", "always"]


class Net(nn.Module):
    """Residual blocks with dropout and a LayerNorm, so that recomputation must replay the
    same masks and the compiler has element-wise chains to fuse."""

    def __init__(self, p: float = 0.0, width: int = 64) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(width, width) for _ in range(8))
        self.norm = nn.LayerNorm(width)
        self.drop = nn.Dropout(p)
        self.head = nn.Linear(width, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + self.drop(torch.tanh(block(x)))
        return self.head(self.norm(x))


def _net(p: float = 0.0) -> Net:
    torch.manual_seed(0)
    return Net(p).double()


def _step(run: nn.Module, model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """Output (on the CPU) and gradients (on the CPU) of one backward of a weighted sum."""
    for p in model.parameters():
        p.grad = None
    torch.manual_seed(7)
    out = run(x)
    weights = torch.arange(out.numel(), dtype=out.dtype, device=out.device).view_as(out)
    (out * weights).sum().backward()
    grads = {n: p.grad.cpu() for n, p in model.named_parameters() if p.grad is not None}
    return out.detach().cpu(), grads


def _assert_equal(got: tuple, want: tuple, **tolerance: float) -> None:
    (out, grads), (want_out, want_grads) = got, want
    torch.testing.assert_close(out, want_out, **tolerance)
    assert grads.keys() == want_grads.keys()
    for name, g in grads.items():
        torch.testing.assert_close(g, want_grads[name], msg=name, **tolerance)


@pytest.mark.parametrize("devices", [["cuda:0"] * 4, ["cuda:0", "cpu", "cuda:0", "cuda:0"]])
def test_per_stage_modes_on_cuda_equal_eager_on_cpu(devices: list[str]) -> None:
    x = torch.randn(16, 64, dtype=torch.float64)
    eager = _net()
    want = _step(eager, eager, x)
    model = _net()
    pipe = fxpipe.pipeline(model, x, devices, chunks=4, checkpoint=MODES, cost="flops")
    assert pipe.checkpoint == tuple(MODES)
    _assert_equal(_step(pipe, model, x.to(devices[0])), want)


def test_per_stage_recomputation_on_cuda_replays_dropout_exactly() -> None:
    """Dropout drawn on the GPU: recomputing stages give bit for bit what no recomputation
    gives (the CUDA generator's state is saved and restored per checkpointed cell)."""
    x = torch.randn(16, 64, dtype=torch.float64)  # planned on the CPU, where the model is
    results = []
    for modes in ("never", MODES):
        model = _net(p=0.3)
        pipe = fxpipe.pipeline(model, x, ["cuda:0"] * 4, chunks=4, checkpoint=modes)
        results.append(_step(pipe, model, x.to(GPU)))
    (out0, g0), (out1, g1) = results
    assert torch.equal(out0, out1)
    assert all(torch.equal(g0[n], g1[n]) for n in g0)


def test_auto_configuration_on_cuda_fits_the_budget_and_equals_eager() -> None:
    x = torch.randn(64, 64, dtype=torch.float64)
    eager = _net()
    want = _step(eager, eager, x)
    devices = ["cuda:0"] * 4
    plans = {
        mode: fxpipe.plan(_net(), x, devices, chunks=8, checkpoint=mode, cost="flops")
        for mode in ("never", "always")
    }
    budget = sum(sum(s.memory_bytes for s in p.stages) for p in plans.values()) // 2
    model = _net()
    pipe = fxpipe.pipeline(
        model, x, devices, chunks="auto", checkpoint="auto", max_memory=budget
    )  # priced by the GPU's roofline
    choice = pipe.plan.configurations().choice
    assert pipe.chunks == choice.chunks
    assert pipe.checkpoint == choice.mode
    assert sum(s.memory_bytes for s in pipe.plan.stages) <= budget
    _assert_equal(_step(pipe, model, x.to(GPU)), want)


@pytest.mark.parametrize("checkpoint", ["never", "except_last"])
def test_compiled_stages_on_cuda_equal_the_uncompiled_pipeline(checkpoint: str) -> None:
    """Inductor on the GPU (Triton kernels), the last micro-batch shorter: outputs and
    gradients within torch's float32 tolerance of the uncompiled pipeline, and no graph
    compiled after the first two steps."""
    torch.manual_seed(0)
    model = Net().to(GPU)
    plain = copy.deepcopy(model)
    x = torch.randn(30, 64, device=GPU)  # chunks=4: micro-batches of 8, 8, 8 and 6
    pipe = fxpipe.pipeline(model, x, ["cuda:0"] * 2, chunks=4, checkpoint=checkpoint,
                           compile=True)  # fmt: skip
    reference = fxpipe.pipeline(plain, x, ["cuda:0"] * 2, chunks=4, checkpoint=checkpoint)
    counts = []
    for _ in range(4):
        x = torch.randn(30, 64, device=GPU)
        _assert_equal(_step(pipe, model, x), _step(reference, plain, x), rtol=1e-4, atol=1e-4)
        assert all(c.compiled for c in pipe.compilation), pipe.compilation
        counts.append([c.graphs for c in pipe.compilation])
    assert all(n > 0 for n in counts[0])
    assert counts[1] == counts[2] == counts[3], counts
