"""Whole values with a gradient read by cut computations (:mod:`fxpipe.passes.tensor.partial`):
a per-head norm's weight (a module), a per-head scale (a Parameter read as it is) and a gain
read as ``1 + g`` (Gemma's norm), which the plan finds and says, and whose gradients, summed
over the tp ranks, equal eager's at tp=2 and tp=4; after an SGD step every tp rank holds the
same copy of each. (Qwen3 and Gemma3, whose per-head q and k norms were wrong before, are
in ``tests/distributed/planning/test_tensor_parallel.py``.)"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F
from helpers import logits_of
from torch import nn

from fxpipe.passes.tensor.cut_modules import ReplicatedRead
from fxpipe.passes.tensor.local import local_program
from fxpipe.passes.tensor.partial import PARTIAL_REASON
from fxpipe.passes.tensor.plan import tensor_plan
from fxpipe.trace.tracing import trace
from tests.distributed.ranks import launch, preload, results

pytestmark = pytest.mark.usefixtures("one_thread")

preload(__name__)

VOCAB, WIDTH, HEADS = 32, 32, 4


class PerHeadNormed(nn.Module):
    """An attention whose heads are normalised each with one weight of ``head_dim`` entries
    (q: a LayerNorm module; k: a scale Parameter; v: ``1 + gain``), then an MLP. The scale
    is also read whole (``+ k_scale.sum()``), a use whose gradient each rank computes in
    full: summing it over the ranks would count it tp times."""

    def __init__(self) -> None:
        super().__init__()
        d = WIDTH // HEADS
        self.tok = nn.Embedding(VOCAB, WIDTH)
        self.q, self.k, self.v, self.o = (nn.Linear(WIDTH, WIDTH) for _ in range(4))
        self.q_norm = nn.LayerNorm(d)
        self.k_scale = nn.Parameter(torch.randn(d))
        self.v_gain = nn.Parameter(0.1 * torch.randn(d))
        self.fc1, self.fc2 = nn.Linear(WIDTH, 2 * WIDTH), nn.Linear(2 * WIDTH, WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tok(ids)
        b, t, _ = x.shape
        q = self.q_norm(self.q(x).view(b, t, HEADS, -1)).transpose(1, 2)
        k = (self.k(x).view(b, t, HEADS, -1) * self.k_scale).transpose(1, 2)
        v = (self.v(x).view(b, t, HEADS, -1) * (1.0 + self.v_gain)).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(y.transpose(1, 2).reshape(b, t, WIDTH))
        x = x + self.fc2(F.gelu(self.fc1(x)))
        return self.head(x) + self.k_scale.sum()


def _model() -> tuple[PerHeadNormed, torch.Tensor]:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = PerHeadNormed().double()
        ids = torch.randint(0, VOCAB, (2, 6))
    return model, ids


def _planned(tp: int) -> tuple[fx.GraphModule, Any, Any]:
    model, ids = _model()
    traced = trace(model, (ids,))
    gm, example = traced.graph_module, tuple(traced.example_values)
    return gm, example, tensor_plan(gm, tp, example, sequence_parallel=False)


def test_the_plan_finds_each_whole_value_a_cut_computation_reads_with_a_gradient() -> None:
    gm, _, plan = _planned(2)
    nodes = {n.name: n for n in gm.graph.nodes}
    read = {str(nodes[v].target) if nodes[v].op == "get_attr" else nodes[v].name
            for v in plan.partial_reads}  # fmt: skip
    assert "k_scale" in read  # the scale as it is
    gains = [v for v in plan.partial_reads if nodes[v].op != "get_attr"]
    assert len(gains) == 1 and any(
        a.op == "get_attr" and a.target == "v_gain" for a in nodes[gains[0]].all_input_nodes
    )  # 1 + gain, the value computed from it
    assert [str(nodes[r].target) for r in plan.partial_modules] == ["q_norm"]
    assert plan.partial_modules[next(iter(plan.partial_modules))] == (
        "q_norm.weight",
        "q_norm.bias",
    )
    for name in ("k_scale", "v_gain", "q_norm.weight", "q_norm.bias"):
        assert plan.params[name].reason == PARTIAL_REASON, name
    # no position table, mask or input with no gradient is counted
    assert all(nodes[v].op != "placeholder" for v in plan.partial_reads)
    assert "its gradient summed over the tp ranks" in " ".join(plan.summary().split())


def test_the_local_program_reads_them_once_each_through_a_replicated_read() -> None:
    gm, _, plan = _planned(2)
    local = local_program(gm, plan)
    reads = [n for n in local.graph.nodes if n.target == "_replicated_read"]
    assert isinstance(local.get_submodule("_replicated_read"), ReplicatedRead)
    # k_scale, 1 + v_gain, and the norm's weight and bias (the norm now its function)
    assert len(reads) == 4
    whole_sum = next(n for n in local.graph.nodes if n.name.startswith("sum"))
    assert all(a.op == "get_attr" for a in whole_sum.all_input_nodes)  # the whole use: direct
    assert not any(
        n.op == "call_module" and n.target == "q_norm" for n in local.graph.nodes
    )  # run as F.layer_norm on its weights, read through the replicated read


def _step(rank: int, world: int) -> dict[str, Any]:
    """The model cut over ``world`` tp ranks: its gradients (gathered whole) beside eager's,
    then one SGD step: every parameter as this rank holds it."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from fxpipe.passes.tensor.parallelize import parallelize_stage

    model, ids = _model()
    reference = copy.deepcopy(model)
    traced = trace(model, (ids,))
    gm, example = traced.graph_module, tuple(traced.example_values)
    plan = tensor_plan(gm, world, example, sequence_parallel=False)
    stage = parallelize_stage(gm, plan, init_device_mesh("cpu", (world,)))
    got, want = logits_of(stage(*example)), reference(ids)
    weights = torch.linspace(-1.0, 1.0, want.numel(), dtype=torch.float64).reshape(want.shape)
    (got * weights).sum().backward()
    (want * weights).sum().backward()
    expected = dict(reference.named_parameters())
    grads = {}
    for key, p in stage.named_parameters():
        grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        grads[key] = (grad, expected[key].grad)
    torch.optim.SGD(stage.parameters(), lr=0.1).step()
    after = {
        k: (p.to_local() if isinstance(p, DTensor) else p).detach().clone()
        for k, p in stage.named_parameters()
    }
    return {"out": (got.detach(), want.detach()), "grads": grads, "after": after}


@pytest.mark.parametrize("tp", [2, 4])
def test_their_gradients_equal_eager_and_every_rank_steps_to_the_same_copy(
    tmp_path: Path, tp: int
) -> None:
    runs = results(launch(_step, tp, tmp_path))
    for res in runs:
        torch.testing.assert_close(*res["out"], rtol=1e-10, atol=1e-12)
        for key, (grad, eager) in res["grads"].items():
            torch.testing.assert_close(grad, eager, rtol=1e-9, atol=1e-12, msg=key)
    for key in ("k_scale", "v_gain", "q_norm.weight", "q_norm.bias"):
        assert key in runs[0]["grads"], key
        for res in runs[1:]:
            torch.testing.assert_close(res["after"][key], runs[0]["after"][key], msg=key)
