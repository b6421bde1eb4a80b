"""Split a mini-batch of pytree values into micro-batches along dim 0, and join outputs back."""

from __future__ import annotations

import functools
import operator
from collections.abc import Sequence
from typing import Any

import torch
from torch.utils._pytree import (
    KeyPath,
    keystr,
    tree_flatten,
    tree_flatten_with_path,
    tree_unflatten,
)

from fxpipe.errors import ConfigError, InputError
from fxpipe.ir import Join

__all__ = ["scatter", "gather", "batch_size"]


def _leaf_name(path: KeyPath, names: Sequence[str] | None) -> str:
    """``names[0]['key'][1]``-style name of a leaf of the top-level tuple of values."""
    if names is None or not path:
        return f"values{keystr(path)}"
    head = path[0]
    index = getattr(head, "idx", None)
    if isinstance(index, int) and index < len(names):
        return names[index] + keystr(path[1:])
    return f"values{keystr(path)}"


def batch_size(values: tuple[Any, ...], names: Sequence[str] | None = None) -> int | None:
    """The dim-0 size every tensor leaf of ``values`` shares (None when there is no tensor
    with a dimension; a 0-dim tensor is a whole value, as ``num_items_in_batch`` is).

    Raises :class:`InputError` for an empty batch or mismatched sizes.
    """
    size: int | None = None
    first = ""
    for path, leaf in tree_flatten_with_path(values)[0]:
        if not isinstance(leaf, torch.Tensor) or leaf.dim() == 0:
            continue
        name = _leaf_name(path, names)
        if size is None:
            size, first = leaf.size(0), name
            if size == 0:
                raise InputError(f"{name} has an empty batch (shape {tuple(leaf.shape)})")
        elif leaf.size(0) != size:
            raise InputError(
                f"{name} has shape {tuple(leaf.shape)} but the batch size is {size} "
                f"(from {first}); dim 0 of every tensor input must be the batch dimension"
            )
    return size


def scatter(
    values: tuple[Any, ...], chunks: int, names: Sequence[str] | None = None
) -> list[tuple[Any, ...]]:
    """Split every tensor leaf of ``values`` on dim 0 into ``min(chunks, batch)`` parts.

    Parts differ in size by at most one (``Tensor.tensor_split``), so a batch that does not
    divide evenly, or one smaller than ``chunks``, still works and no micro-batch is empty.
    Non-tensor leaves and 0-dim tensors go unchanged to every micro-batch. ``names`` (one
    per value) only serves error messages. Returns one tuple of values per micro-batch.
    """
    if chunks < 1:
        raise ConfigError(f"chunks must be a positive integer (got {chunks})")
    size = batch_size(values, names)
    if size is None:
        return [values]
    parts = min(chunks, size)
    leaves, spec = tree_flatten(values)
    split = [
        leaf.tensor_split(parts) if isinstance(leaf, torch.Tensor) and leaf.dim() else None
        for leaf in leaves
    ]
    batches: list[tuple[Any, ...]] = []
    for i in range(parts):
        mine = [leaf if s is None else s[i] for leaf, s in zip(leaves, split, strict=True)]
        batches.append(tree_unflatten(mine, spec))
    return batches


def _equal(a: Any, b: Any) -> bool:
    if a is b:
        return True
    try:
        return bool(a == b)
    except Exception:
        return False


def _gather_leaf(parts: list[Any], where: str, device: torch.device | None, join: Join) -> Any:
    first = parts[0]
    if isinstance(first, torch.Tensor):
        if not all(isinstance(p, torch.Tensor) for p in parts):
            raise InputError(f"{where} is a tensor in some micro-batches but not in others")
        target = first.device if device is None else device
        if join == "sum":  # partial sums and counts: the batch's is their sum
            return functools.reduce(operator.add, [p.to(target) for p in parts])
        if join == "same":
            return first.to(target)
        if first.dim() == 0:
            raise InputError(
                f"{where} is a 0-dim tensor (shape ()), so micro-batches cannot be concatenated "
                "along the batch dimension; return it with a leading batch dimension"
            )
        if len(parts) == 1:
            return first.to(target)
        return torch.cat([p.to(target) for p in parts], dim=0)
    if join == "sum":
        return sum(parts)
    for p in parts[1:]:
        if not _equal(first, p):
            raise InputError(
                f"{where} differs between micro-batches ({first!r} != {p!r}); a value that is "
                "not a tensor must not depend on the batch"
            )
    return first


def gather(
    outputs: list[list[Any]],
    device: torch.device | None = None,
    joins: Sequence[Join] | None = None,
) -> list[Any]:
    """Join per-micro-batch outputs: ``outputs[i][p]`` is value ``p`` of micro-batch ``i``.

    ``joins[p]`` says how (default: all ``"cat"``): ``"cat"`` concatenates tensor leaves on
    dim 0 and checks that other leaves are equal across micro-batches; ``"sum"`` adds them
    (partial sums and counts); ``"same"`` keeps micro-batch 0's (a value every micro-batch
    gives alike). Tensors go onto ``device`` (by default the first micro-batch's device).
    """
    if not outputs:
        raise InputError("there are no micro-batches to gather")
    kinds: Sequence[Join] = joins if joins is not None else ["cat"] * len(outputs[0])
    joined: list[Any] = []
    for p in range(len(outputs[0])):
        flat = [tree_flatten(out[p]) for out in outputs]
        spec = flat[0][1]
        for i, (_, other) in enumerate(flat):
            if other != spec:
                raise InputError(
                    f"output {p} of micro-batch {i} has structure {other}, but micro-batch 0 "
                    f"has {spec}"
                )
        paths = [keystr(path) for path, _ in tree_flatten_with_path(outputs[0][p])[0]]
        leaves = [
            _gather_leaf([f[0][x] for f in flat], f"output {p}{paths[x]}", device, kinds[p])
            for x in range(len(paths))
        ]
        joined.append(tree_unflatten(leaves, spec))
    return joined
