"""Leaf modules whose output is a new tensor shaped like their input: fake runs skip them.

On fake tensors a training-mode BatchNorm is decomposed into some thirty ops (about 20 ms
each time); a pass that needs only the output's shape, dtype and ``requires_grad`` gets it
from the input instead. Nothing else about the module is read or changed.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["SAME_SHAPE_MODULES", "same_shape_output"]

#: Module types that return one new tensor of their input's shape, dtype and layout
#: (not dropout, which returns its input itself in eval mode or at p=0).
SAME_SHAPE_MODULES: tuple[type[nn.Module], ...] = (
    nn.modules.batchnorm._BatchNorm,
    nn.modules.instancenorm._InstanceNorm,
    nn.LayerNorm,
    nn.GroupNorm,
    nn.ReLU,
    nn.ReLU6,
    nn.LeakyReLU,
    nn.GELU,
    nn.SiLU,
    nn.Tanh,
    nn.Sigmoid,
    nn.Hardswish,
    nn.Hardsigmoid,
    nn.Mish,
    nn.ELU,
)


def same_shape_output(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """An empty tensor like the module's output (in the active fake mode, when called in
    one), or None unless ``module`` is one of :data:`SAME_SHAPE_MODULES` itself (not a
    subclass, which may compute something else) called out of place on one floating-point
    tensor, and would not raise (a training BatchNorm given one value per channel does:
    it is run, so that the error is the module's own)."""
    torch_class = type(module).__module__.startswith("torch.nn.modules")
    if not (torch_class and isinstance(module, SAME_SHAPE_MODULES)):
        return None
    if kwargs or len(args) != 1 or not isinstance(args[0], torch.Tensor):
        return None
    x = args[0]
    if getattr(module, "inplace", False) or not x.is_floating_point():
        return None
    if isinstance(module, nn.modules.batchnorm._BatchNorm) and module.training:
        if x.ndim < 2 or x.numel() <= x.shape[1]:  # one value per channel: it raises
            return None
    grad = x.requires_grad or any(p.requires_grad for p in module.parameters())
    if not (grad and torch.is_grad_enabled()):
        return torch.empty_like(x)
    return torch.empty_like(x, requires_grad=True).clone()  # not a leaf, as a result is
