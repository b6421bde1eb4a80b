"""Deferred BatchNorm: mini-batch running statistics, user module untouched, eval equivalence."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import checkpoint_stage
from torch import nn

from fxpipe.errors import ConfigError
from fxpipe.runtime.batchnorm import DeferredBatchNorm, convert_deferred_batch_norm


def _tilted(batch: int) -> torch.Tensor:
    """Channels with very different means and scales, so statistics errors show."""
    x = torch.randn(batch, 3, 4, 4)
    return x * torch.tensor([1.0, 5.0, 0.1]).view(1, 3, 1, 1) + torch.tensor([0, 10, -3.0]).view(
        1, 3, 1, 1
    )


@pytest.mark.parametrize("momentum", [0.1, None])
def test_running_stats_match_full_batch(momentum: float | None) -> None:
    bn = nn.BatchNorm2d(3, momentum=momentum)
    reference = copy.deepcopy(bn)
    deferred = DeferredBatchNorm(bn, chunks=4)
    for _ in range(3):
        x = _tilted(16)
        for part in x.chunk(4):
            deferred(part)
        reference(x)
    assert torch.allclose(bn.running_mean, reference.running_mean, rtol=1e-5, atol=1e-6)
    assert torch.allclose(bn.running_var, reference.running_var, rtol=1e-5, atol=1e-6)
    assert bn.num_batches_tracked.item() == reference.num_batches_tracked.item() == 3
    # A plain BatchNorm fed micro-batches would not match: the check is meaningful.
    naive = copy.deepcopy(reference)
    naive.reset_running_stats()
    for part in _tilted(16).chunk(4):
        naive(part)
    assert not torch.allclose(naive.running_var, reference.running_var, rtol=1e-5)


def test_normalises_each_micro_batch_with_its_own_statistics() -> None:
    bn = nn.BatchNorm2d(3)
    reference = copy.deepcopy(bn)
    deferred = DeferredBatchNorm(bn, chunks=2)
    x = _tilted(8).requires_grad_()
    out = torch.cat([deferred(part) for part in x.chunk(2)])
    expected = torch.cat([reference(part) for part in x.chunk(2)])
    assert torch.allclose(out, expected, atol=1e-6)
    out.sum().backward()
    assert bn.weight.grad is not None


def test_begin_step_sets_the_real_micro_batch_count() -> None:
    bn = nn.BatchNorm2d(3)
    reference = copy.deepcopy(bn)
    deferred = DeferredBatchNorm(bn, chunks=4)
    deferred.begin_step(3)  # a short batch: three micro-batches
    x = _tilted(3)
    for part in x.chunk(3):
        deferred(part)
    reference(x)
    assert bn.num_batches_tracked.item() == 1
    assert torch.allclose(bn.running_var, reference.running_var, rtol=1e-5)


def test_shares_parameters_and_buffers_by_identity() -> None:
    bn = nn.BatchNorm2d(3)
    state = {k: v.clone() for k, v in bn.state_dict().items()}
    deferred = DeferredBatchNorm(bn)
    assert deferred.weight is bn.weight and deferred.bias is bn.bias
    assert deferred.running_mean is bn.running_mean
    assert list(deferred.state_dict()) == list(bn.state_dict())
    assert [id(p) for p in deferred.parameters()] == [id(p) for p in bn.parameters()]
    assert type(bn) is nn.BatchNorm2d
    assert all(torch.equal(v, state[k]) for k, v in bn.state_dict().items())
    deferred.double()
    assert bn.running_mean.dtype == torch.float64 and deferred.running_mean is bn.running_mean


def test_eval_matches_the_wrapped_module() -> None:
    bn = nn.BatchNorm2d(3)
    deferred = DeferredBatchNorm(bn, chunks=2)
    for part in _tilted(8).chunk(2):
        deferred(part)
    deferred.eval()
    bn.eval()
    x = _tilted(5)
    assert torch.equal(deferred(x), bn(x))


def test_recompute_does_not_count_twice() -> None:
    bn = nn.BatchNorm2d(3)
    reference = copy.deepcopy(bn)
    deferred = DeferredBatchNorm(bn, chunks=2)
    x = _tilted(8).requires_grad_()
    outs = [checkpoint_stage(lambda p: (deferred(p),), part)[0] for part in x.chunk(2)]
    torch.cat(outs).sum().backward()
    reference(x.detach())
    assert bn.num_batches_tracked.item() == 1
    assert torch.allclose(bn.running_mean, reference.running_mean, rtol=1e-5, atol=1e-6)


def test_untracked_batch_norm_is_rejected() -> None:
    with pytest.raises(ConfigError):
        DeferredBatchNorm(nn.BatchNorm2d(3, track_running_stats=False))


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = nn.Sequential(nn.Conv2d(3, 3, 1), nn.BatchNorm2d(3))
        self.free = nn.BatchNorm2d(3, track_running_stats=False)
        self.top = nn.BatchNorm2d(3)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor]:
        return (self.top(self.free(self.block(x))),)


@pytest.mark.parametrize("share_containers", [False, True])
def test_convert_leaves_the_user_model_untouched(share_containers: bool) -> None:
    model = _Net()
    gm = torch.fx.symbolic_trace(model)
    if share_containers:  # stage modules may hold the user's own containers
        gm.block = model.block
    before = {name: type(m) for name, m in model.named_modules()}
    wrappers = convert_deferred_batch_norm(gm)
    assert [w.module for w in wrappers] == [model.block[1], model.top]
    assert {name: type(m) for name, m in model.named_modules()} == before
    assert isinstance(gm.get_submodule("block.1"), DeferredBatchNorm)
    assert isinstance(gm.get_submodule("top"), DeferredBatchNorm)
    assert type(gm.get_submodule("free")) is nn.BatchNorm2d
    assert {id(p) for p in gm.parameters()} == {id(p) for p in model.parameters()}
    x = _tilted(4)
    assert torch.allclose(gm(x)[0], model(x)[0], atol=1e-5)
    assert convert_deferred_batch_norm(gm) == []  # idempotent
