"""The gradients of the Parameters a rank shares (a tied weight's copies on several ranks, a
Parameter FSDP, or torch's ``replicate`` under tensor parallelism, leaves whole on each
replica), summed over the pipeline's ranks (and the whole ones averaged over ``"dp"``) once
per step: what ``sync_tied_gradients`` runs. Under FSDP x TP a shard is FSDP's ``1 / dp``
chunk of this ``"tp"`` rank's piece."""

from __future__ import annotations

import torch
import torch.distributed as dist

from fxpipe.distributed.parallel.mesh import Layout, comm_device
from fxpipe.distributed.parallel.ownership import Ownership, is_dtensor, local_tensor

__all__ = ["sum_tied_gradients", "all_reduce_flat"]


def sum_tied_gradients(own: Ownership, layout: Layout, device: torch.device) -> None:
    """Every gradient of ``own.replicated``: a Parameter several pipeline ranks hold summed
    over ``layout``'s ``"pp"`` group, one FSDP leaves whole averaged over its ``"dp"``
    group, in place (a rank without the gradient, or without the Parameter, adds zeros).
    A collective on every rank of the pipeline, which all pass the same entries."""
    entries = own.replicated
    comm = comm_device(layout.pp_group, device)
    whole_keys = own.whole_keys
    grads = []
    for key, shape, t in entries:
        g = None if t is None else t.grad
        if g is None:  # under FSDP, this replica's shard of it (unless left whole)
            local = tuple(shape) if key in whole_keys else _local_shape(layout, shape)
            grads.append(torch.zeros(local, device=comm))
        else:
            grads.append(local_tensor(g).to(comm))
    # held by several ranks: summed over the pipeline ranks (the same list on each)
    shared = [i for i, (key, _, _) in enumerate(entries) if key in own.shared_keys]
    all_reduce_flat(grads, shared, layout.pp_group)
    if layout.dp_group is not None:  # left whole by FSDP: averaged, as FSDP does
        whole = [i for i, (k, _, t) in enumerate(entries) if k in whole_keys and t is not None]
        all_reduce_flat(grads, whole, layout.dp_group, divide=layout.dp_size)
    for (_, _, t), total in zip(entries, grads, strict=True):
        if t is not None:
            if t.grad is None:
                t.grad = _like_param(t, total)
            else:
                local_tensor(t.grad).copy_(total)


def _local_shape(layout: Layout, shape: torch.Size) -> tuple[int, ...]:
    """This rank's part of a parameter of ``shape``: all of it, or its FSDP shard."""
    if not layout.sharded:
        return tuple(shape)
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    local, _ = compute_local_shape_and_global_offset(shape, layout.dp_mesh, [Shard(0)])
    return tuple(local)


def all_reduce_flat(
    grads: list[torch.Tensor], chosen: list[int], group: dist.ProcessGroup | None, divide: int = 1
) -> None:
    """``grads[i]`` for each ``i`` of ``chosen`` summed over ``group`` (one collective, in
    float64, so that every dtype comes back as exact as it can be) and divided by
    ``divide``, in place in the list. Every rank of ``group`` passes the same ``chosen``."""
    if not chosen:
        return
    flat = torch.cat([grads[i].reshape(-1).to(torch.float64) for i in chosen])
    dist.all_reduce(flat, group=group)
    if divide != 1:
        flat /= divide
    done = 0
    for i in chosen:
        n = grads[i].numel()
        grads[i] = flat.narrow(0, done, n).view(grads[i].shape)
        done += n


def _like_param(param: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """``local`` (this rank's part) as a gradient of ``param``: a DTensor like it under FSDP."""
    local = local.to(local_tensor(param).device, param.dtype)
    if not is_dtensor(param):
        return local
    from torch.distributed.tensor import DTensor

    spec = param  # a DTensor: same mesh, placements and global shape
    return DTensor.from_local(
        local,
        spec.device_mesh,  # type: ignore[attr-defined]
        spec.placements,  # type: ignore[attr-defined]
        shape=spec.shape,
        stride=spec.stride(),
        run_check=False,
    )
