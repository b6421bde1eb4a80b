"""A model and its inputs made ready for an exact comparison: float64, no dropout, fresh
copies of the inputs for every call."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

__all__ = ["zero_dropout", "has_dropout", "to_double", "fresh", "map_tensors"]

DROP_ATTRS = ("p", "drop_prob", "drop_rate", "drop_path_prob")


def _dropout_like(module: nn.Module) -> bool:
    name = type(module).__name__.lower()
    return (
        isinstance(module, nn.modules.dropout._DropoutNd)
        or "drop" in name
        or ("stochasticdepth" in name)
    )


def _dropout_fields(model: nn.Module) -> list[tuple[nn.Module, str]]:
    """Every positive float field of a module that sets a dropout-like probability: ``p`` and
    the like on dropout-like modules, ``*dropout*``, ``*drop_path*``, ``*layerdrop*``."""
    fields = []
    for module in model.modules():
        dropish = _dropout_like(module)
        for key, value in list(vars(module).items()):
            if not isinstance(value, float) or value <= 0:
                continue
            named = "dropout" in key or "drop_path" in key or "layerdrop" in key
            if named or (dropish and key in DROP_ATTRS):
                fields.append((module, key))
    return fields


def zero_dropout(model: nn.Module) -> None:
    """``p = 0`` on every dropout-like module; every float ``*dropout*`` attribute to 0."""
    for module, key in _dropout_fields(model):
        setattr(module, key, 0.0)


def has_dropout(model: nn.Module) -> bool:
    """Does any module of ``model`` have a dropout-like probability above 0?"""
    return bool(_dropout_fields(model))


def map_tensors(tree: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``tree`` with ``fn`` applied to every tensor leaf."""
    leaves, spec = tree_flatten(tree)
    return tree_unflatten([fn(x) if isinstance(x, torch.Tensor) else x for x in leaves], spec)


def to_double(tree: Any) -> Any:
    """Every floating-point tensor of ``tree`` in float64."""
    return map_tensors(tree, lambda x: x.double() if x.is_floating_point() else x)


def fresh(tree: Any) -> Any:
    """A clone of every tensor of ``tree``: a call that writes into its inputs changes none
    the next call gets."""
    return map_tensors(tree, lambda x: x.clone())
