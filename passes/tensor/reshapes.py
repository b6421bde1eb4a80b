"""How a cut travels through the ops that move elements around: views (a head split keeps
the cut on the heads, and the head count must divide by tp), transposes, expands, slices and
indexing that leave the cut dimension whole, splits and concatenations; and the part counts
worth trying for a product's output features (a fused q, k, v: three)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
import torch.fx as fx

from fxpipe.passes.ops import op_name
from fxpipe.passes.tensor.cuts import (
    CASTS,
    ELEMENTWISE,
    ELEMENTWISE_MODULES,
    SPLITS,
    TRANSPOSES,
    VIEWS,
    Blocked,
    Result,
    Rule,
    Rules,
    arg,
    base_name,
    dims_of,
    shard_of,
    what,
)
from fxpipe.passes.tensor.records import Layout, Shard

__all__ = ["RESHAPE_RULES", "feature_parts", "slice_bounds"]


def _view(n: fx.Node, layouts: Mapping[str, Layout], rules: Rules) -> Result:
    x = n.args[0]
    shard, a, b = shard_of(x, layouts), rules.size(x), rules.size(n)
    if shard is None or a is None or b is None:
        return Blocked(f"{what(n)} views a value it cannot follow")
    outer = math.prod(a[: shard.dim]) * shard.blocks  # whole parts before the tp cut
    p = 1
    for j, s in enumerate(b):
        if outer % p == 0 and (p * s) % (outer * rules.tp) == 0:
            return Shard(j, outer // p)
        p *= s
    p, j = 1, 0
    while j < len(b) - 1 and p * b[j] <= outer:
        p *= b[j]
        j += 1
    before = math.prod(a[: shard.dim])
    parts = _covering(b, before, before * a[shard.dim])
    return Blocked(
        f"{what(n)} views the cut features ({a[shard.dim]}) as {parts}: {b[j]} (the head "
        f"count, in attention) does not divide by tp={rules.tp}"
    )


def _covering(b: torch.Size, start: int, end: int) -> tuple[int, ...]:
    """The dims of ``b`` spanning flat positions ``start`` to ``end`` (prefix products)."""
    p, out = 1, []
    for s in b:
        if p * s > start and p < end:
            out.append(int(s))
        p *= s
    return tuple(out)


def _transpose(n: fx.Node, layouts: Mapping[str, Layout], rules: Rules) -> Result:
    x = n.args[0]
    shard, a = shard_of(x, layouts), rules.size(x)
    if shard is None or a is None:
        return Blocked(f"{what(n)} transposes a value it cannot follow")
    rank, name = len(a), op_name(n)
    order = list(range(rank))
    if name == "permute":
        order = [int(d) % rank for d in dims_of(n, 1)]
    elif name == "movedim":
        src, dst = int(arg(n, 1, "source")) % rank, int(arg(n, 2, "destination")) % rank
        order.remove(src)
        order.insert(dst, src)
    else:
        ends: list[Any] = [0, 1] if name == "t" else [n.args[1], n.args[2]]
        d0, d1 = int(ends[0]) % rank, int(ends[1]) % rank
        order[d0], order[d1] = order[d1], order[d0]
    return Shard(order.index(shard.dim), shard.blocks)


def _expand(n: fx.Node, layouts: Mapping[str, Layout], rules: Rules) -> Result:
    x = n.args[0]
    shard, a, b = shard_of(x, layouts), rules.size(x), rules.size(n)
    if shard is None or a is None or b is None:
        return Blocked(f"{what(n)} expands a value it cannot follow")
    d = shard.dim + len(b) - len(a)
    return Shard(d, shard.blocks) if b[d] == a[shard.dim] else Blocked(f"{what(n)} grows it")


def _full(start: Any, stop: Any, step: Any, size: int) -> bool:
    whole_stop = stop is None or (isinstance(stop, int) and stop >= size)
    return start in (None, 0) and whole_stop and step in (None, 1)


def _slice(n: fx.Node, layouts: Mapping[str, Layout], rules: Rules) -> Result:
    x = n.args[0]
    shard, a = shard_of(x, layouts), rules.size(x)
    if shard is None or a is None:
        return Blocked(f"{what(n)} slices a value it cannot follow")
    name = op_name(n)
    dim = int(arg(n, 1, "dim", 0)) % len(a)
    if name == "select":
        if dim == shard.dim:
            return Blocked(f"{what(n)} picks one entry of the cut dimension")
        return Shard(shard.dim - (dim < shard.dim), shard.blocks)
    if dim != shard.dim:
        return shard
    if name == "narrow":
        start, length = arg(n, 2, "start"), arg(n, 3, "length")
        whole = start == 0 and isinstance(length, int) and length >= a[dim]
        bounds = slice_bounds(start, start + length if _ints(start, length) else None, 1, a[dim])
    else:
        start, stop, step = arg(n, 2, "start"), arg(n, 3, "end"), arg(n, 4, "step", 1)
        whole = _full(start, stop, step, a[dim])
        bounds = slice_bounds(start, stop, step, a[dim])
    return shard if whole else _parts_taken(n, shard, a[dim], bounds)


def _ints(*values: Any) -> bool:
    return all(isinstance(v, int) for v in values)


def slice_bounds(start: Any, stop: Any, step: Any, size: int) -> tuple[int, int] | None:
    """A unit-step slice's ``[start, stop)`` within ``size`` entries, where its bounds are
    ints (None: stop at the end); None for any other slice."""
    start = 0 if start is None else start
    stop = size if stop is None else stop
    if step not in (None, 1) or not _ints(start, stop):
        return None
    start, stop = (v + size if v < 0 else v for v in (start, stop))
    return max(0, min(start, size)), max(0, min(stop, size))


def _parts_taken(n: fx.Node, shard: Shard, size: int, bounds: tuple[int, int] | None) -> Result:
    """A slice of the cut dimension that takes whole parts of it (q of a fused q, k, v cut
    in three parts: each rank its piece of each part) is cut as the parts it takes."""
    part = size // shard.blocks
    if bounds is not None and bounds[0] % part == 0 and bounds[1] % part == 0:
        taken = (bounds[1] - bounds[0]) // part
        if taken > 0:
            return Shard(shard.dim, taken)
    return Blocked(
        f"{what(n)} takes part of the cut dimension ({size}), not whole parts of its "
        f"{shard.blocks}"
    )


def _getitem(n: fx.Node, layouts: Mapping[str, Layout], rules: Rules) -> Result:
    x, index = n.args[0], n.args[1]
    layout = layouts.get(x.name) if isinstance(x, fx.Node) else None
    if isinstance(layout, tuple):
        return layout[index] if isinstance(index, int) else Blocked(f"{what(n)}: bad index")
    shard, a = shard_of(x, layouts), rules.size(x)
    if shard is None or a is None:
        return Blocked(f"{what(n)} indexes a value it cannot follow")
    items = list(index) if isinstance(index, tuple) else [index]
    if any(i is Ellipsis for i in items):
        at = items.index(Ellipsis)
        used = sum(1 for i in items if i is not None and i is not Ellipsis)
        items[at : at + 1] = [slice(None)] * (len(a) - used)
    items += [slice(None)] * (len(a) - sum(1 for i in items if i is not None))
    dim_in = dim_out = 0
    for item in items:
        if item is None:
            dim_out += 1
            continue
        cut = dim_in == shard.dim
        if isinstance(item, slice):
            if cut and not _full(item.start, item.stop, item.step, a[dim_in]):
                bounds = slice_bounds(item.start, item.stop, item.step, a[dim_in])
                taken = _parts_taken(n, shard, a[dim_in], bounds)
                return Shard(dim_out, taken.blocks) if isinstance(taken, Shard) else taken
            if cut:
                return Shard(dim_out, shard.blocks)
            dim_in, dim_out = dim_in + 1, dim_out + 1
        elif isinstance(item, int) and not cut:
            dim_in += 1
        else:
            return Blocked(f"{what(n)} indexes the cut dimension, or by a tensor")
    return Blocked(f"{what(n)}: index not understood")


def _split(n: fx.Node, layouts: Mapping[str, Layout], rules: Rules) -> Result:
    x = n.args[0]
    shard, a, out = shard_of(x, layouts), rules.size(x), rules.shapes.get(n.name)
    if shard is None or a is None or not isinstance(out, tuple) or not out:
        return Blocked(f"{what(n)} splits a value it cannot follow")
    default = 0
    dim = int(arg(n, 1 if op_name(n) == "unbind" else 2, "dim", default)) % len(a)
    if op_name(n) == "unbind":
        if dim == shard.dim:
            return Blocked(f"{what(n)} unbinds the cut dimension")
        return tuple(Shard(shard.dim - (dim < shard.dim), shard.blocks) for _ in out)
    if dim != shard.dim:
        return tuple(shard for _ in out)
    part = a[dim] // shard.blocks  # a piece must hold whole parts: each is cut alike
    sizes = [int(s[dim]) if isinstance(s, torch.Size) else 0 for s in out]
    if any(s % part for s in sizes):
        return Blocked(
            f"{what(n)} splits the cut dimension ({a[dim]}) into pieces of {sizes}, which "
            f"do not follow its {shard.blocks} part(s): cut it as as many parts as pieces"
        )
    return tuple(Shard(dim, s // part) for s in sizes)


def _cat(n: fx.Node, layouts: Mapping[str, Layout], rules: Rules) -> Result:
    tensors = n.args[0] if n.args else n.kwargs.get("tensors")
    if not isinstance(tensors, (list, tuple)):
        return Blocked(f"{what(n)}: inputs not understood")
    shards = [shard_of(t, layouts) for t in tensors]
    first = shards[0]
    if first is None or any(s != first for s in shards):
        return Blocked(f"{what(n)} joins cut values with whole ones, or cut otherwise")
    rank = len(rules.size(tensors[0]) or ())
    dim = int(arg(n, 1, "dim", 0))
    if op_name(n) == "stack":
        dim %= rank + 1
        return Shard(first.dim + (dim <= first.dim), first.blocks)
    if dim % rank == first.dim:
        return Blocked(f"{what(n)} joins along the cut dimension")
    return first


#: Op name -> its rule, for the ops that move elements around.
RESHAPE_RULES: dict[str, Rule] = {
    **dict.fromkeys(VIEWS, _view),
    **dict.fromkeys(TRANSPOSES, _transpose),
    **dict.fromkeys(("expand", "expand_as", "broadcast_to"), _expand),
    **dict.fromkeys(("slice", "narrow", "select"), _slice),
    "getitem": _getitem,
    **dict.fromkeys(SPLITS, _split),
    **dict.fromkeys(("cat", "concat", "concatenate", "stack"), _cat),
}


def feature_parts(n: fx.Node, rules: Rules) -> list[int]:
    """The ways of cutting the output features of product ``n`` worth trying, as numbers of
    parts (see :class:`Shard`), fewest first: 1, and where the features are later cut apart
    (a fused q, k, v split in three, or viewed as (3, heads, head_dim)) the parts that keep
    each piece whole; never parts that would cut a head's own dimension."""
    size = rules.size(n)
    if size is None:
        return [1]
    features, found = size[-1], {1}
    todo, seen = [n], {n}
    slices: list[tuple[int, int] | None] = []
    while todo:
        node = todo.pop()
        for user in node.users:
            name = base_name(op_name(user))
            out = rules.size(user)
            if user in seen:
                continue
            seen.add(user)
            if name in VIEWS and out is not None and out and out[-1] == features:
                todo.append(user)
            elif name in VIEWS and out is not None:
                found |= _prefixes(_trailing(out, features))
            elif name in SPLITS and name != "unbind":
                pieces, here = rules.shapes.get(user.name), rules.size(node)
                dim = int(arg(user, 2, "dim", 0))
                if isinstance(pieces, tuple) and here and dim % len(here) == len(here) - 1:
                    found.add(len(pieces))
            elif name in ("slice", "getitem"):  # q, k and v sliced off fused features
                bounds = _last_slice(user, len(rules.size(node) or ()), features)
                if bounds != ():
                    slices.append(bounds)  # type: ignore[arg-type]
            elif name in ELEMENTWISE or name in CASTS or _passes_through(user, rules):
                todo.append(user)
    if slices and None not in slices:  # parts as large as every slice's bounds allow
        part = math.gcd(features, *(b for bounds in slices if bounds for b in bounds))
        found.add(features // part)
    return sorted(found)


def _last_slice(n: fx.Node, rank: int, size: int) -> tuple[int, int] | tuple[()] | None:
    """The bounds a ``slice`` op or an index takes of the last of ``rank`` dimensions (of
    ``size`` entries): () where it leaves that dimension whole or is not a slice of it, None
    where they are not ints."""
    if op_name(n) == "slice":
        if rank == 0 or int(arg(n, 1, "dim", 0)) % rank != rank - 1:
            return ()
        return slice_bounds(arg(n, 2, "start"), arg(n, 3, "end"), arg(n, 4, "step", 1), size)
    index = n.args[1] if len(n.args) > 1 else None
    items = list(index) if isinstance(index, tuple) else [index]
    if Ellipsis in items:
        items = items[items.index(Ellipsis) + 1 :]
        last = items[-1] if len(items) == 1 else None
    else:
        last = items[rank - 1] if len(items) == rank else None
    if not isinstance(last, slice) or _full(last.start, last.stop, last.step, size):
        return ()
    return slice_bounds(last.start, last.stop, last.step, size)


def _passes_through(n: fx.Node, rules: Rules) -> bool:
    if n.op != "call_module":
        return False
    return isinstance(rules.gm.get_submodule(str(n.target)), ELEMENTWISE_MODULES)


def _trailing(shape: torch.Size, features: int) -> tuple[int, ...]:
    """The trailing sizes of ``shape`` whose product is ``features`` (empty if none)."""
    p, k = 1, len(shape)
    while k > 0 and p < features:
        k -= 1
        p *= shape[k]
    return tuple(int(s) for s in shape[k:]) if p == features else ()


def _prefixes(factors: tuple[int, ...]) -> set[int]:
    """Products of the leading factors that leave at least the last two whole: the
    (3, heads, head_dim) of a fused q, k, v gives {1, 3}."""
    return {math.prod(factors[:k]) for k in range(max(len(factors) - 1, 1))}
