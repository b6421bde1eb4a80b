"""The whole of a DTensor and one rank's part of a whole tensor, as FSDP and tensor parallelism
place them: torch's own placements, except where FSDP shards a weight tensor parallelism cut
in parts.

A fused q, k, v cut over ``"tp"`` is a ``_StridedShard(dim, split_factor=3)`` DTensor (each
rank its piece of q, of k and of v). FSDP2 over ``"dp"`` shards what each ``"tp"`` rank holds
along the same dimension (one contiguous chunk per ``"dp"`` rank, which training needs) and
labels it ``_StridedShard(dim, split_factor=tp)`` on ``"dp"``; no placement on ``"dp"`` says
what the chunk holds (it runs across the parts), so torch's ``full_tensor`` and
``distribute_tensor`` misplace it. Here such a tensor is gathered (and cut) one mesh
dimension at a time: over ``"dp"`` into its ``"tp"`` rank's piece, then over ``"tp"``.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["is_dtensor", "local_tensor", "full_tensor", "local_part", "strided"]


def is_dtensor(t: object) -> bool:
    """Whether ``t`` is a DTensor (FSDP's sharded Parameters and their gradients); False on a
    torch that has no public DTensor, where fxpipe offers no FSDP to make one."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:
        return False
    return isinstance(t, DTensor)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (FSDP), or ``t`` itself."""
    return t.to_local() if is_dtensor(t) else t  # type: ignore[attr-defined]


def strided(t: object) -> bool:
    """Whether ``t`` is a DTensor placed in parts on some mesh dimension (``_StridedShard``:
    a fused q, k, v cut over tensor-parallel ranks, or FSDP's shards of a cut weight)."""
    if not is_dtensor(t):
        return False
    from torch.distributed.tensor.placement_types import _StridedShard

    return any(isinstance(p, _StridedShard) for p in t.placements)  # type: ignore[attr-defined]


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole of a DTensor (a collective over its mesh), or ``t`` itself."""
    if not is_dtensor(t):
        return t
    split = _sharded_parts(t)
    if split is None:
        return t.full_tensor()  # type: ignore[attr-defined,no-any-return]
    from torch.distributed.tensor import DTensor, Shard

    dp, tp, dim = split
    shape = _piece_shape(t, tp.size(), dim)
    piece = DTensor.from_local(
        t.to_local(),  # type: ignore[attr-defined]
        dp,
        [Shard(dim)],
        run_check=False,
        shape=shape,
        stride=_contiguous(shape),
    ).full_tensor()
    cut = t.placements[1]  # type: ignore[attr-defined]
    whole = DTensor.from_local(piece, tp, [cut], run_check=False, shape=t.shape, stride=t.stride())
    return whole.full_tensor()


def local_part(whole: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``whole`` as the DTensor ``like`` places it, with no
    communication."""
    from torch.distributed.tensor import Shard, distribute_tensor

    split = _sharded_parts(like)
    if split is None:
        mesh, placements = like.device_mesh, like.placements  # type: ignore[attr-defined]
        return distribute_tensor(whole.detach(), mesh, placements, src_data_rank=None).to_local()
    dp, tp, dim = split
    cut = like.placements[1]  # type: ignore[attr-defined]
    piece = distribute_tensor(whole.detach(), tp, [cut], src_data_rank=None).to_local()
    return distribute_tensor(piece, dp, [Shard(dim)], src_data_rank=None).to_local()


def _sharded_parts(t: torch.Tensor) -> tuple[Any, Any, int] | None:
    """``(the "dp" mesh, the "tp" mesh, the dimension)`` where ``t`` is FSDP's shard of a
    weight cut in parts along the dimension FSDP shards; else None."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    placements = t.placements  # type: ignore[attr-defined]
    if len(placements) != 2:
        return None
    outer, inner = placements
    if not isinstance(inner, _StridedShard) or not isinstance(outer, Shard | _StridedShard):
        return None
    if outer.dim != inner.dim:
        return None
    mesh = t.device_mesh  # type: ignore[attr-defined]
    names = mesh.mesh_dim_names
    return mesh[names[0]], mesh[names[1]], inner.dim


def _piece_shape(t: torch.Tensor, tp: int, dim: int) -> torch.Size:
    sizes = list(t.shape)
    sizes[dim] //= tp
    return torch.Size(sizes)


def _contiguous(shape: torch.Size) -> tuple[int, ...]:
    return torch.empty(shape, device="meta").stride()
