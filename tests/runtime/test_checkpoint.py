"""Checkpoint/Recompute: exact gradients (dropout included), flags, awkward inputs/outputs."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from helpers import checkpoint_stage, spawn_workers
from torch import nn

from fxpipe.runtime.checkpoint import Checkpointing, is_checkpointing, is_recomputing
from fxpipe.runtime.worker import Task


def _grads(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    grads = []
    for t in tensors:
        assert t.grad is not None
        grads.append(t.grad.clone())
        t.grad = None
    return grads


def _compare(
    stage: Callable[..., Any],
    args: tuple[Any, ...],
    loss: Callable[[Any], torch.Tensor],
    leaves: list[torch.Tensor],
) -> None:
    """Outputs and gradients of ``stage`` equal with and without checkpointing."""
    torch.manual_seed(1)
    eager = stage(*args)
    loss(eager).backward()
    expected = _grads(leaves)
    torch.manual_seed(1)
    checkpointed = checkpoint_stage(stage, *args)
    loss(checkpointed).backward()
    for a, b in zip(
        torch.utils._pytree.tree_leaves(eager),
        torch.utils._pytree.tree_leaves(checkpointed),
        strict=True,
    ):
        assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b
    for e, g in zip(expected, _grads(leaves), strict=True):
        assert torch.equal(e, g)


def test_dropout_gradients_are_exact() -> None:
    net = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.5), nn.ReLU(), nn.Linear(16, 4))
    x = torch.randn(6, 8, requires_grad=True)

    def stage(x: torch.Tensor) -> tuple[torch.Tensor]:
        return (net(x),)

    _compare(stage, (x,), lambda out: out[0].pow(2).sum(), [x, *net.parameters()])


def test_inputs_without_grad_and_tuple_outputs_with_an_int() -> None:
    lin = nn.Linear(4, 4)
    x = torch.randn(5, 4)  # no grad
    mask = torch.ones(5, 4, dtype=torch.bool)

    def stage(x: torch.Tensor, mask: torch.Tensor, scale: float) -> tuple[Any, ...]:
        h = torch.tanh(lin(x)) * scale
        return h, h.size(1), mask.sum(1), x * 2

    def loss(out: tuple[Any, ...]) -> torch.Tensor:
        assert out[1] == 4 and out[2].dtype == torch.int64
        return out[0].sum() * out[1]

    _compare(stage, (x, mask, 0.5), loss, list(lin.parameters()))
    out = checkpoint_stage(stage, x, mask, 0.5)
    assert not out[2].requires_grad


def test_parameter_and_pytree_inputs() -> None:
    weight = nn.Parameter(torch.randn(4, 3))
    lin = nn.Linear(4, 4)
    x = torch.randn(5, 4, requires_grad=True)

    def stage(inputs: dict[str, Any], w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = lin(inputs["x"]) + inputs["bias"][0]
        return h @ w, w  # the parameter also leaves the stage as it came

    def loss(out: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return out[0].sum() + (out[1] * 3).sum()

    args = ({"x": x, "bias": [torch.ones(4), "tag"]}, weight)
    _compare(stage, args, loss, [x, weight, *lin.parameters()])


def test_only_a_later_output_reaches_the_loss() -> None:
    lin = nn.Linear(3, 3)
    x = torch.randn(2, 3, requires_grad=True)

    def stage(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = lin(x)
        return h, h.exp()

    _compare(stage, (x,), lambda out: out[1].sum(), [x, *lin.parameters()])


def _node_names(root: Any) -> set[str]:
    names, stack = set(), [root]
    while stack:
        node = stack.pop()
        if node is not None and type(node).__name__ not in names:
            names.add(type(node).__name__)
            stack.extend(next_node for next_node, _ in node.next_functions)
    return names


def test_recompute_hangs_behind_the_output() -> None:
    lin = nn.Linear(2, 2)
    (y,) = checkpoint_stage(lambda x: (lin(x),), torch.randn(3, 2))
    assert type(y.grad_fn).__name__ == "JoinBackward"
    assert {"RecomputeBackward", "ForkBackward", "CheckpointBackward"} <= _node_names(y.grad_fn)


def test_batch_norm_statistics_are_updated_once() -> None:
    class Stage(nn.Module):  # stages are modules; the BatchNorms are found inside
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3))

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor]:
            return (self.net(x),)

    stage = Stage()
    net = stage.net
    reference = copy.deepcopy(net)
    x = torch.randn(8, 4, requires_grad=True)
    (y,) = checkpoint_stage(stage, x)
    y.pow(2).sum().backward()
    reference(x).pow(2).sum().backward()
    for a, b in zip(net.buffers(), reference.buffers(), strict=True):
        assert torch.equal(a, b)
    for a, b in zip(net.parameters(), reference.parameters(), strict=True):
        assert a.grad is not None and b.grad is not None
        assert torch.allclose(a.grad, b.grad, rtol=1e-5, atol=1e-6)


def test_flags() -> None:
    seen: list[tuple[bool, bool]] = []

    def stage(x: torch.Tensor) -> tuple[torch.Tensor]:
        seen.append((is_checkpointing(), is_recomputing()))
        return (x * 2,)

    x = torch.randn(2, requires_grad=True)
    stage(x)
    (y,) = checkpoint_stage(stage, x)
    assert seen == [(False, False), (True, False)]
    y.sum().backward()
    assert seen[-1] == (False, True)
    assert (is_checkpointing(), is_recomputing()) == (False, False)


def test_recompute_leaves_the_global_rng_alone() -> None:
    drop = nn.Dropout(0.5)
    x = torch.randn(100, requires_grad=True)
    (y,) = checkpoint_stage(lambda x: (drop(x),), x)
    state = torch.get_rng_state()
    y.sum().backward()
    assert torch.equal(torch.get_rng_state(), state)


def test_autocast_is_restored_in_recompute() -> None:
    lin = nn.Linear(8, 8)
    x = torch.randn(4, 8, requires_grad=True)

    def stage(x: torch.Tensor) -> tuple[torch.Tensor]:
        return (lin(x).float().relu(),)

    with torch.autocast("cpu", dtype=torch.bfloat16):
        (eager,) = stage(x)
    eager.sum().backward()
    expected = _grads([x, *lin.parameters()])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        (checkpointed,) = checkpoint_stage(stage, x)
    checkpointed.sum().backward()
    for e, g in zip(expected, _grads([x, *lin.parameters()]), strict=True):
        assert torch.equal(e, g)


def test_checkpoint_in_a_worker_then_recompute_in_the_caller() -> None:
    net = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.3))
    x = torch.randn(3, 4, requires_grad=True)
    torch.manual_seed(2)
    net(x).sum().backward()
    expected = _grads([x, *net.parameters()])
    torch.manual_seed(2)
    checkpointing = Checkpointing(lambda x: (net(x),), (x,), "cpu")
    with spawn_workers(["cpu"]) as (in_queues, out_queues):
        in_queues[0].put(Task(checkpointing.checkpoint))
        ok, outputs = out_queues[0].get()
    assert ok
    (y,) = checkpointing.recompute(outputs)
    y.sum().backward()
    for e, g in zip(expected, _grads([x, *net.parameters()]), strict=True):
        assert torch.equal(e, g)


@pytest.mark.cuda
def test_cuda_dropout_gradients_are_exact() -> None:
    net = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5)).cuda()
    x = torch.randn(4, 8, device="cuda", requires_grad=True)
    torch.manual_seed(3)
    net(x).sum().backward()
    expected = _grads([x, *net.parameters()])
    torch.manual_seed(3)
    (y,) = checkpoint_stage(lambda x: (net(x),), x, device=x.device)
    y.sum().backward()
    for e, g in zip(expected, _grads([x, *net.parameters()]), strict=True):
        assert torch.equal(e, g)


def _counted_stages(no_grad: frozenset[int]) -> torch.Tensor:
    """Two checkpointed stages: the first returns its output and a histogram of it (floating
    point, no gradient: histc is not differentiable), the second counts with it in integers
    (what MoE offsets do) and scales by the total."""
    x = torch.randn(6, 4, requires_grad=True)
    first = Checkpointing(
        lambda v: (v.tanh(), torch.histc(v.sum(-1), bins=4, min=-2, max=2)), (x,), "cpu", no_grad
    )
    y, counts = first.recompute(first.checkpoint())

    def second(h: torch.Tensor, c: torch.Tensor) -> tuple[torch.Tensor]:
        return (h * c.cumsum(0, dtype=torch.int32)[-1],)

    later = Checkpointing(second, (y, counts), "cpu")
    (out,) = later.recompute(later.checkpoint())
    out.sum().backward()
    assert x.grad is not None
    return x.grad


def test_an_output_without_a_gradient_stays_so_across_a_checkpointed_stage() -> None:
    """A run without grad cannot tell a float output no gradient reaches; marked as such
    (the program's ``no_grad``), the next stage's recompute reads it as a constant, where
    taken for differentiable it fails on an op of integers (the gradient equals eager's)."""
    torch.manual_seed(0)
    grad = _counted_stages(frozenset({1}))
    torch.manual_seed(0)
    x = torch.randn(6, 4, requires_grad=True)
    counts = torch.histc(x.sum(-1), bins=4, min=-2, max=2)
    (x.tanh() * counts.cumsum(0, dtype=torch.int32)[-1]).sum().backward()
    torch.testing.assert_close(grad, x.grad)
    with pytest.raises(RuntimeError, match="dtype: Int"):
        _counted_stages(frozenset())
