"""A model's state as a pipeline hands it out: its state dict with each tensor it holds under
several names copied under the later ones (a file holds them so), and the identity of its
modules and tensors (a change after the pipeline was built is refused)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["unshared", "module_ids"]


def unshared(state: Any, prefix: str) -> Any:
    """``state`` with the entries under ``prefix`` whose memory an earlier entry holds
    replaced by copies (in place; ``state`` is returned)."""
    seen: set[tuple[int, int, tuple[int, ...], tuple[int, ...]]] = set()
    for key in [k for k in state if str(k).startswith(prefix)]:
        value = state[key]
        if not isinstance(value, torch.Tensor) or value.is_meta or value.numel() == 0:
            continue
        where = (
            value.untyped_storage().data_ptr(),
            int(value.storage_offset()),
            tuple(value.shape),
            tuple(value.stride()),
        )
        if where in seen:
            state[key] = value.clone()
        seen.add(where)
    return state


def module_ids(model: nn.Module) -> list[int]:
    """The identity of every module of the model and of each one's parameters and buffers,
    in module order (cheap enough to compare on every call)."""
    return [
        id(x)
        for m in model.modules()
        for x in (m, *m._modules.values(), *m._parameters.values(), *m._buffers.values())
    ]
