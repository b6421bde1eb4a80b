"""Deferred BatchNorm: running statistics over a whole mini-batch, normalisation per micro-batch.

A BatchNorm that sees micro-batches would update its running statistics once per micro-batch,
from micro-batch statistics. :class:`DeferredBatchNorm` wraps the user's BatchNorm instead:
it normalises each micro-batch with that micro-batch's statistics (as BatchNorm in training
does) but only accumulates them, and commits the running mean and the unbiased running
variance of the whole mini-batch once, after its last micro-batch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from fxpipe.errors import ConfigError
from fxpipe.runtime.checkpoint import is_recomputing

__all__ = ["DeferredBatchNorm", "convert_deferred_batch_norm"]

_SHARED_BUFFERS = ("running_mean", "running_var", "num_batches_tracked")


class DeferredBatchNorm(nn.Module):
    """Wraps a tracked-stats ``_BatchNorm``, sharing its parameters and buffers by identity.

    The wrapped module is never modified: its ``weight``/``bias`` Parameters and its running
    buffers are registered here under the same names, and commits update the buffers in
    place. :meth:`begin_step` tells the wrapper how many micro-batches the next mini-batch
    has. In eval mode it computes exactly what the wrapped module computes in eval mode.
    """

    running_mean: torch.Tensor
    running_var: torch.Tensor
    num_batches_tracked: torch.Tensor

    def __init__(self, module: _BatchNorm, chunks: int = 1) -> None:
        super().__init__()
        if not module.track_running_stats or module.running_mean is None:
            raise ConfigError(f"{module} does not track running statistics; nothing to defer")
        # Kept out of the module tree so that parameters() and state_dict() see each
        # tensor once, under the wrapped module's own names.
        self.__dict__["wrapped"] = module
        self.weight = module.weight
        self.bias = module.bias
        for name in _SHARED_BUFFERS:
            self.register_buffer(name, getattr(module, name))
        self.training = module.training
        self.chunks = 1
        self.begin_step(chunks)

    @property
    def module(self) -> _BatchNorm:
        """The wrapped BatchNorm."""
        wrapped: _BatchNorm = self.__dict__["wrapped"]
        return wrapped

    def begin_step(self, chunks: int) -> None:
        """Expect ``chunks`` micro-batches before the next commit; drop any partial sums."""
        if chunks < 1:
            raise ConfigError(f"chunks must be a positive integer (got {chunks})")
        self.chunks = chunks
        self._tracked = 0
        self._count = 0
        self._mean: torch.Tensor | None = None
        self._m2: torch.Tensor | None = None

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> Any:
        # Moves and casts go through the wrapped module, then the references are renewed,
        # so that the wrapper and the wrapped module keep sharing the same tensors.
        self.module._apply(fn, recurse)  # type: ignore[no-untyped-call]
        self.weight, self.bias = self.module.weight, self.module.bias
        for name in _SHARED_BUFFERS:
            self._buffers[name] = getattr(self.module, name)
        return self

    def _track(self, input: torch.Tensor) -> None:
        """Fold the statistics of one micro-batch into the running sums (Chan et al.)."""
        dims = [0, *range(2, input.dim())]
        x = input.detach().to(self.running_mean.dtype)
        count = x.numel() // x.size(1)
        mean = x.mean(dims)
        m2 = (x - mean.view(1, -1, *([1] * (x.dim() - 2)))).square().sum(dims)
        if self._mean is None or self._m2 is None:
            self._mean, self._m2, self._count = mean, m2, count
        else:
            total = self._count + count
            delta = mean - self._mean
            self._mean = self._mean + delta * (count / total)
            self._m2 = self._m2 + m2 + delta.square() * (self._count * count / total)
            self._count = total
        self._tracked += 1

    def _commit(self) -> None:
        """Update the running statistics from the whole mini-batch, as BatchNorm does."""
        assert self._mean is not None and self._m2 is not None
        self.num_batches_tracked.add_(1)
        momentum = self.module.momentum
        factor = 1.0 / float(self.num_batches_tracked) if momentum is None else momentum
        var = self._m2 / max(self._count - 1, 1)
        self.running_mean.mul_(1 - factor).add_(self._mean, alpha=factor)
        self.running_var.mul_(1 - factor).add_(var, alpha=factor)
        self.begin_step(self.chunks)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self.module._check_input_dim(input)  # type: ignore[no-untyped-call]
        eps = self.module.eps
        if not self.training:
            return F.batch_norm(
                input, self.running_mean, self.running_var, self.weight, self.bias, False, 0.0, eps
            )
        if not is_recomputing():
            with torch.no_grad():
                self._track(input)
            if self._tracked == self.chunks:
                with torch.no_grad():
                    self._commit()
        return F.batch_norm(input, None, None, self.weight, self.bias, True, 0.0, eps)

    def extra_repr(self) -> str:
        return f"{self.module!r}, chunks={self.chunks}"


def _owned_path(gm: nn.Module, target: str, owned: set[int]) -> nn.Module:
    """The parent of ``target`` inside ``gm``, cloning shared containers on the way.

    Containers on the path may be the user's own modules (GraphModules reference them), so
    each is replaced in its parent by a shallow clone before it is changed: the clone shares
    parameters and buffers, but has its own dict of children.
    """
    parent = gm
    for name in target.split(".")[:-1]:
        child = parent._modules[name]
        assert child is not None
        if id(child) not in owned:
            clone = object.__new__(type(child))
            clone.__dict__.update(child.__dict__)
            clone.__dict__["_modules"] = dict(child._modules)
            child = clone
            owned.add(id(child))
            parent._modules[name] = child
        parent = child
    return parent


def convert_deferred_batch_norm(gm: torch.fx.GraphModule) -> list[DeferredBatchNorm]:
    """Wrap every tracked-stats BatchNorm that ``gm``'s graph calls, inside ``gm`` only.

    The wrappers replace the BatchNorms in ``gm``'s attribute tree; the user's modules (which
    ``gm`` may share) are left as they were. Returns the wrappers in graph order.
    """
    wrappers: dict[str, DeferredBatchNorm] = {}
    owned: set[int] = {id(gm)}
    for node in gm.graph.nodes:
        if node.op != "call_module" or node.target in wrappers:
            continue
        target = str(node.target)
        module = gm.get_submodule(target)
        if isinstance(module, DeferredBatchNorm) or not isinstance(module, _BatchNorm):
            continue
        if not module.track_running_stats or module.running_mean is None:
            continue
        parent = _owned_path(gm, target, owned)
        wrapper = DeferredBatchNorm(module)
        parent._modules[target.split(".")[-1]] = wrapper
        wrappers[target] = wrapper
    return list(wrappers.values())
