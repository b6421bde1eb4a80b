"""Which of the model's tensors a rank keeps, under which keys; releasing the others.

A tensor belongs to every rank whose stage modules hold it. A weight several stages read
(a tied embedding and head, a module called at several depths) is named by each of them, so
it belongs to each of their ranks (its gradients are then summed by
``sync_tied_gradients``). Tensors no stage reads stay with stage 0's rank, so that the
shards together hold the whole state dict.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from typing import Any

import torch
from torch import nn

from fxpipe.distributed.parallel.dtensors import (
    full_tensor,
    is_dtensor,
    local_part,
    local_tensor,
    strided,
)
from fxpipe.ir import StageProgram

__all__ = [
    "Ownership", "full_tensor", "is_dtensor", "local_tensor", "merge_state_dicts",
    "replace_tensors",
]  # fmt: skip


def merge_state_dicts(shards: Iterable[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """One state dict from every rank's :meth:`DistributedPipeline.state_dict`, in any order.

    It loads (strict) into the unpipelined model. A key held by several ranks is taken from
    the first shard that has it; the copies are equal when ``sync_tied_gradients`` runs
    before every optimizer step.
    """
    merged: dict[str, torch.Tensor] = {}
    for shard in shards:
        for key, value in shard.items():
            merged.setdefault(key, value)
    return merged


class Ownership:
    """This rank's share of the model's parameters and buffers.

    ``tensors``: model key -> tensor, for every key (tied names included) of the tensors
    this rank keeps; ``persistent``: the keys of ``model.state_dict()``; ``replicated``:
    ``(key, shape, tensor or None)`` for each Parameter held by several ranks
    (``shared_keys``) or left whole by FSDP (``whole``: their ids; ``whole_keys``: their
    keys), whose gradients ``sync_tied_gradients`` sums, in the same order on every rank;
    ``uninitialised``: keys materialised from ``meta`` and not loaded.
    """

    def __init__(
        self,
        model: nn.Module,
        program: StageProgram,
        ranks: tuple[int, ...],
        rank: int,
        whole: Collection[int] = (),
    ) -> None:
        keys: dict[int, list[str]] = {}
        objects: dict[int, torch.Tensor] = {}
        named = list(model.named_parameters(remove_duplicate=False))
        for key, t in named + list(model.named_buffers(remove_duplicate=False)):
            keys.setdefault(id(t), []).append(key)
            objects[id(t)] = t
        holders: dict[int, set[int]] = {}
        for j, gm in enumerate(program.modules):
            for t in list(gm.parameters()) + list(gm.buffers()):
                holders.setdefault(id(t), set()).add(ranks[j])
        owners = {i: holders.get(i, {ranks[0]}) for i in objects}
        self.persistent = frozenset(model.state_dict().keys())
        self.tensors = {k: objects[i] for i, ks in keys.items() if rank in owners[i] for k in ks}
        self.released = [objects[i] for i in objects if rank not in owners[i]]
        self.uninitialised: set[str] = set()
        self.replicated: list[tuple[str, torch.Size, torch.Tensor | None]] = [
            (ks[0], objects[i].shape, objects[i] if rank in owners[i] else None)
            for i, ks in sorted(keys.items(), key=lambda item: item[1][0])
            if isinstance(objects[i], nn.Parameter) and (len(owners[i]) > 1 or i in whole)
        ]
        self.whole_keys = frozenset(keys[i][0] for i in whole if i in keys)
        self.shared_keys = frozenset(ks[0] for i, ks in keys.items() if len(owners[i]) > 1)
        self._aliases = {ks[0]: tuple(ks) for ks in keys.values()}  # every key of a tensor

    def cut_shapes(self, cuts: Mapping[str, tuple[int, int]]) -> None:
        """Each entry of ``replicated`` under the shape of one rank's piece where tensor
        parallelism cuts it (``cuts``: a key of the Parameter, any of its tied names ->
        (the dimension cut, the ranks it is cut over)): what every pipeline rank adds for
        it, zeros on a rank that does not hold it."""
        out = []
        for key, shape, t in self.replicated:
            names = [n for n in self._aliases.get(key, (key,)) if n in cuts]
            if names:
                dim, ranks = cuts[names[0]]
                sizes = list(shape)
                sizes[dim] //= ranks
                shape = torch.Size(sizes)
            out.append((key, shape, t))
        self.replicated = out

    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """Each kept Parameter once, under its first key."""
        seen: dict[int, tuple[str, nn.Parameter]] = {}
        for key, t in self.tensors.items():
            if isinstance(t, nn.Parameter):
                seen.setdefault(id(t), (key, t))
        return list(seen.values())

    def place(self, device: torch.device, roots: Iterable[nn.Module]) -> None:
        """Release the other ranks' tensors to ``meta``; move (or materialise) this rank's.

        Released and materialised tensors are new objects, put in place of the old ones in
        every module under ``roots`` (the model, the traced graph, the stage modules).
        """
        new: dict[int, torch.Tensor] = {id(t): _like(t, "meta") for t in self.released}
        for key, t in self.tensors.items():
            if t.is_meta:
                self.uninitialised.add(key)
                new.setdefault(id(t), _like(t, device))
            elif t.device != device:
                t.data = t.data.to(device)
        replace_tensors(roots, new)
        self.tensors = {k: new.get(id(t), t) for k, t in self.tensors.items()}
        self.replicated = [
            (k, s, None if t is None else new.get(id(t), t)) for k, s, t in self.replicated
        ]
        self.released.clear()

    def adopt(self, new: Mapping[int, torch.Tensor], roots: Iterable[nn.Module]) -> None:
        """Put ``new[id(t)]`` (the DTensor Parameters ``fully_shard`` made) in place of the
        kept tensors ``t``, here and in every module under ``roots``."""
        replace_tensors(roots, new)
        self.tensors = {k: new.get(id(t), t) for k, t in self.tensors.items()}
        self.replicated = [
            (k, s, None if t is None else new.get(id(t), t)) for k, s, t in self.replicated
        ]

    def load(self, full_state_dict: Mapping[str, torch.Tensor]) -> list[str]:
        """Copy the kept entries from a full state dict; returns the keys it lacks (and
        copies nothing then)."""
        missing = [k for k in self.tensors if k in self.persistent and k not in full_state_dict]
        missing += [k for k in sorted(self.uninitialised) if k not in full_state_dict]
        if missing:
            return missing
        with torch.no_grad():
            for key, tensor in self.tensors.items():
                if key in full_state_dict:
                    _copy_into(tensor, full_state_dict[key])
        self.uninitialised.clear()
        return []


def _copy_into(tensor: torch.Tensor, full: torch.Tensor) -> None:
    """Copy ``full`` into ``tensor``, or into this rank's part of it when it is a DTensor
    (FSDP, tensor parallelism): the slice its placements give, with no communication."""
    if not is_dtensor(tensor):
        tensor.copy_(full)
        return
    if strided(tensor):  # in parts: cut as the placements say (dtensors.py)
        tensor.to_local().copy_(local_part(full, tensor))  # type: ignore[attr-defined]
        return
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    mesh, placements = tensor.device_mesh, tensor.placements  # type: ignore[attr-defined]
    shape, offset = compute_local_shape_and_global_offset(full.shape, mesh, placements)
    part = full[tuple(slice(o, o + n) for o, n in zip(offset, shape))]
    tensor.to_local().copy_(part)  # type: ignore[attr-defined]


def _like(t: torch.Tensor, device: Any) -> torch.Tensor:
    empty = torch.empty_like(t, device=device)
    return nn.Parameter(empty, t.requires_grad) if isinstance(t, nn.Parameter) else empty


def replace_tensors(roots: Iterable[nn.Module], new: Mapping[int, torch.Tensor]) -> None:
    """Put ``new[id(t)]`` in place of every parameter or buffer ``t`` of the modules."""
    seen: set[int] = set()
    for root in roots:
        for module in root.modules():
            if id(module) in seen:
                continue
            seen.add(id(module))
            for table in (module._parameters, module._buffers):
                for name, t in table.items():
                    if t is not None and id(t) in new:
                        table[name] = new[id(t)]  # type: ignore[assignment]
