"""One ``torch.distributed.checkpoint`` for a whole distributed pipeline: each rank's shard
and its optimizer's state under the model's own keys (each tensor once, whatever the layout),
and a checkpoint checked against what a rank needs before anything is read."""

from __future__ import annotations

from collections.abc import Mapping
from os import PathLike
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map

from fxpipe.distributed.parallel.dtensors import full_tensor, local_part, local_tensor, strided
from fxpipe.errors import CheckpointError

__all__ = ["optimizer_state", "set_optimizer_state", "save_state", "load_state"]


def optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The state of ``optimizer`` (over ``model``'s Parameters this rank holds) under the
    model's own keys, one entry per parameter and setting, as
    ``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict`` makes it (zero
    state first for an optimizer that has not stepped)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
    )

    flat = StateDictOptions(flatten_optimizer_state_dict=True)  # one entry per key
    return get_optimizer_state_dict(model, optimizer, options=flat)


def set_optimizer_state(
    model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]
) -> None:
    """Put ``state`` (from :func:`optimizer_state`, of this or another layout) into
    ``optimizer``."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_optimizer_state_dict,
    )

    flat = StateDictOptions(flatten_optimizer_state_dict=True)
    set_optimizer_state_dict(model, optimizer, state, options=flat)


def save_state(state: dict[str, Any], path: str | PathLike[str]) -> None:
    """``state`` written with ``torch.distributed.checkpoint.save`` (a collective). A fused
    q, k, v cut over tensor-parallel ranks in parts (a ``_StridedShard`` DTensor, which this
    torch's checkpoint writes as overlapping chunks) is written whole, gathered first."""
    from torch.distributed.checkpoint.state_dict_saver import save

    save(tree_map(_whole_if_strided, state), checkpoint_id=str(path))


def load_state(state: dict[str, Any], path: str | PathLike[str], stages: tuple[int, ...]) -> None:
    """``state`` filled in place from the checkpoint at ``path`` (a collective), once this
    rank has checked, alone, that the checkpoint holds every tensor of ``state`` with its
    shape (``stages``: this rank's, named in the error)."""
    from torch.distributed.checkpoint.state_dict_loader import load

    _check_checkpoint(path, state, stages)
    parted: list[tuple[torch.Tensor, torch.Tensor]] = []
    load(tree_map(lambda t: _whole_stand_in(t, parted), state), checkpoint_id=str(path))
    for tensor, whole in parted:  # this rank's parts of each, from the whole read
        _copy_strided(tensor, whole)


def _whole_if_strided(t: Any) -> Any:
    return full_tensor(t) if strided(t) else t


def _whole_stand_in(t: Any, parted: list[tuple[torch.Tensor, torch.Tensor]]) -> Any:
    """An empty whole tensor for the checkpoint to fill in place of a strided DTensor (noted
    in ``parted``), else ``t``."""
    if not strided(t):
        return t
    whole = torch.empty(t.shape, dtype=t.dtype, device=local_tensor(t).device)
    parted.append((t, whole))
    return whole


def _copy_strided(tensor: torch.Tensor, whole: torch.Tensor) -> None:
    """Copy this rank's parts of ``whole`` into the strided DTensor ``tensor``, as its
    placements cut it (``dtensors.local_part``)."""
    with torch.no_grad():
        local_tensor(tensor).copy_(local_part(whole, tensor))


def _check_checkpoint(
    path: str | PathLike[str], state: Mapping[str, Any], stages: tuple[int, ...]
) -> None:
    """CheckpointError unless the checkpoint at ``path`` has every tensor of ``state`` (as
    torch.distributed.checkpoint flattens it) with the same shape; reads its metadata only."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict
    from torch.distributed.checkpoint.filesystem import FileSystemReader

    where = Path(path)
    if not (where / ".metadata").is_file():
        raise CheckpointError(
            f"{str(path)!r} is not a torch.distributed.checkpoint folder (no .metadata "
            "file); pass the folder save_checkpoint or torch.distributed.checkpoint.save "
            "wrote"
        )
    stored = FileSystemReader(str(where)).read_metadata().state_dict_metadata
    flat, _ = flatten_state_dict(dict(state))
    missing, shapes = [], []
    for key, value in flat.items():
        if not isinstance(value, torch.Tensor):
            continue
        meta = stored.get(key)
        size = getattr(meta, "size", None)
        if meta is None:
            missing.append(key)
        elif size is not None and tuple(size) != tuple(value.shape):
            shapes.append(f"{key}: {tuple(size)} in the checkpoint, {tuple(value.shape)} here")
    if missing or shapes:
        raise CheckpointError(
            f"the checkpoint {str(path)!r} does not match stage(s) {list(stages)}: "
            + (f"it lacks {missing[:5]} ({len(missing)} in all)" if missing else "")
            + ("; " if missing and shapes else "")
            + (f"shapes differ: {shapes[:5]}" if shapes else "")
            + "; load a checkpoint of this model (and pass optimizer only when the "
            "checkpoint has its state)"
        )
