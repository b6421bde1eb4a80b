"""Computations along the batch's rows that only group them, told from those that mix them.

A Mixture-of-Experts layer with token-choice routing (transformers' grouped experts) sorts
the batch's tokens by the expert each chose, counts them per expert (``histc``), takes the
offsets of each expert's rows (``cumsum``), runs one grouped matrix product over the sorted
rows (``grouped_mm``: rows ``offs[e-1]:offs[e]`` times expert ``e``'s weight) and puts the
rows back in their places (the inverse permutation). The counts and offsets depend on the
whole batch, yet each token's result depends on its own row alone: the rows of expert ``e``
in the sorted order are exactly those whose key is ``e``, so the grouped product computes
``x[j] @ W[key[j]]`` for every row ``j``, and the inverse permutation undoes the sort.

:func:`row_grouping` proves this on the graph, sort by sort. From a sort along a dimension
that grows with the batch, it follows every value in the sorted order (tags below) through
the ops it knows, and accepts the sort when every such value is computed row by row from
values in the same order and whole values (parameters), the offsets come from a histogram
of the sorted keys themselves over exactly the keys' range (indices of a top-k over that
many experts), every grouped product reads rows in that order with those offsets, and every
sorted value is put back in place by the sort's inverse permutation before anything else
reads it. Anything else that reads a value of the sort (the graph's output, an op not
listed) leaves the sort unproven.

What is not proven mixes the rows: an unproven sort, and a scan, flip or roll along a
dimension that grows with the batch (``cumsum`` over the tokens of a whole batch, as a
capacity-limited router counts each expert's tokens to drop those over its capacity).
Micro-batches each compute their own; :mod:`fxpipe.passes.batch.reductions` lists them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch.fx as fx

from fxpipe.passes.batch.roles import BatchRoles
from fxpipe.passes.ops import is_check, op_name

__all__ = ["RowGrouping", "row_grouping", "GROUPED_OPS"]

#: Grouped matrix products: ``(input rows, weight per group, offsets of each group's rows)``.
GROUPED_OPS = frozenset({"_grouped_mm", "grouped_mm", "grouped_mm_fallback"})
#: Scans whose output at a position depends on every position before it along ``dim``.
_SCANS = frozenset({"cumsum", "cumprod", "cummax", "cummin", "logcumsumexp"})
_SORTS = frozenset({"sort", "argsort", "msort"})
#: Ops whose output at a row is a function of the same row of each input (and of whole
#: values broadcast against it).
_ROW_WISE = frozenset(
    "add sub mul div true_divide neg silu gelu relu sigmoid tanh exp log sqrt rsqrt pow "
    "square clamp clamp_min clamp_max masked_fill where to _to_copy type_as float half "
    "bfloat16 double clone contiguous alias detach abs erf softplus maximum minimum "
    "reciprocal sin cos lerp addcmul dropout".split()
)
_SIZE_READS = frozenset({"sym_size", "size", "dim", "numel", "sym_numel", "sym_stride", "stride"})
#: Reading a value's metadata reads none of its data.
_METADATA = frozenset({"shape", "dtype", "device", "ndim"})
_CASTS = frozenset({"to", "_to_copy", "type_as", "float", "int", "long", "clone", "contiguous"})
_FLAT_VIEWS = frozenset({"view", "reshape", "_unsafe_view", "flatten", "alias"})


@dataclass(frozen=True)
class RowGrouping:
    """What the sorts and scans along the batch's rows of a graph do."""

    #: Nodes of proven groupings whose value depends on the whole batch without mixing it:
    #: the sort, its keys, permutation, counts and offsets.
    grouping: frozenset[str] = frozenset()
    #: Grouped products proven to compute each row from its own row and key alone.
    grouped: frozenset[str] = frozenset()
    #: Node -> why it mixes the batch's rows: unproven sorts, scans, flips and rolls.
    mixing: Mapping[str, str] = field(default_factory=dict)


def row_grouping(gm: fx.GraphModule, roles: BatchRoles) -> RowGrouping:
    """The groupings of ``gm``'s batch rows proven exact, and the ops that mix them."""
    grouping: set[str] = set()
    grouped: set[str] = set()
    mixing: dict[str, str] = {}
    for n in gm.graph.nodes:
        name = op_name(n)
        if n.name in grouping:  # a proven grouping's own (the inverse permutation's argsort)
            continue
        if name in _SORTS and _along_rows(n, roles, _dim(n, 1, "dim", -1)):
            proof = _SortProof(gm, roles, n)
            why = proof.run()
            if why is None:
                grouping |= proof.grouping
                grouped |= proof.grouped
            else:
                mixing[n.name] = f"sorts the batch's rows ({why})"
        elif name in _SCANS and _along_rows(n, roles, _dim(n, 1, "dim", None)):
            mixing[n.name] = f"takes a running {name.removeprefix('cum')} along the batch's rows"
        elif name in ("flip", "roll") and _reorders_rows(n, roles):
            mixing[n.name] = f"{name}s the batch's rows"
    return RowGrouping(frozenset(grouping), frozenset(grouped), mixing)


# ------------------------------------------------------------------------------ rows


def _shapes(roles: BatchRoles, node: Any) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """The tensor's shapes at the two batch sizes, or None for anything else."""
    if not isinstance(node, fx.Node) or node.name not in roles.seen:
        return None
    a, b = roles.seen[node.name]
    if not (a[0] and b[0]):
        return None
    return tuple(a[1]), tuple(b[1])


def _growing(roles: BatchRoles, node: Any) -> set[int]:
    """The dimensions of a tensor value that grow with the batch (non-negative)."""
    shapes = _shapes(roles, node)
    if shapes is None or len(shapes[0]) != len(shapes[1]):
        return set()
    return {d for d, (x, y) in enumerate(zip(*shapes)) if x != y}


def _dim(n: fx.Node, index: int, key: str, default: Any) -> Any:
    return n.args[index] if len(n.args) > index else n.kwargs.get(key, default)


def _along_rows(n: fx.Node, roles: BatchRoles, dim: Any) -> bool:
    """Whether ``n`` runs along a dimension of its input that grows with the batch."""
    x = n.args[0] if n.args else None
    grows = _growing(roles, x)
    shapes = _shapes(roles, x)
    if not grows or shapes is None or not isinstance(dim, int):
        return bool(grows) and not isinstance(dim, int)  # every dimension, or unknown
    return dim % max(len(shapes[0]), 1) in grows


def _reorders_rows(n: fx.Node, roles: BatchRoles) -> bool:
    dims = _dim(n, 1 if op_name(n) == "flip" else 2, "dims", None)
    if op_name(n) == "roll" and dims in (None, [], ()):
        return bool(_growing(roles, n.args[0]))  # rolled flat: every element moves
    dims = [dims] if isinstance(dims, int) else list(dims or [])
    return any(_along_rows(n, roles, d) for d in dims)


# ------------------------------------------------------------------------- the proof


class _SortProof:
    """Follows the values of one sort (see the module docstring). Tags: ``keys`` (the sorted
    keys), ``perm`` (the sort's indices), ``pidx`` (those floor-divided by a constant: rows of
    a table with one row per several keys), ``hist`` (the keys counted per group), ``offs``
    (their running sum), ``sorted`` (a value whose rows follow the sorted order), ``blank``
    (a value shaped like the permutation, holding nothing yet), ``inv`` (the inverse
    permutation)."""

    def __init__(self, gm: fx.GraphModule, roles: BatchRoles, sort: fx.Node) -> None:
        self.gm, self.roles, self.sort = gm, roles, sort
        self.tags: dict[str, str] = {}
        self.grouping: set[str] = {sort.name}
        self.grouped: set[str] = set()
        self.groups = _key_range(sort.args[0], roles)
        self.restored = False

    def run(self) -> str | None:
        """None when the sort only groups the rows; else why it is not proven to."""
        if op_name(self.sort) == "argsort":
            self.tags[self.sort.name] = "perm"
        else:
            self.tags[self.sort.name] = "pair"
        for n in self.gm.graph.nodes:
            if n is self.sort:
                continue
            tagged = [a for a in n.all_input_nodes if a.name in self.tags]
            if not tagged:
                continue
            if n.op == "output":
                return f"{tagged[0].name}, in the sorted order, is an output of the graph"
            if _reads_no_data(n):
                continue
            why = self._step(n, tagged)
            if why is not None:
                return why
        if not self.restored:
            return "no value in the sorted order is put back in its place"
        return None

    def _tag(self, node: Any) -> str | None:
        return self.tags.get(node.name) if isinstance(node, fx.Node) else None

    def _static(self, node: Any) -> bool:
        return not isinstance(node, fx.Node) or self.roles.of(node) == "static"

    def _step(self, n: fx.Node, tagged: list[fx.Node]) -> str | None:
        """Tag ``n`` from its tagged inputs, or say why it reads them in a way not known."""
        name, tags = op_name(n), {self.tags[a.name] for a in tagged}
        rule = _RULES.get(name)
        if rule is None and name.endswith("_") and name[:-1] in _ROW_WISE:
            rule = _row_wise  # in place (out.add_(bias)): written row by row as well
        tag = rule(self, n, tags) if rule is not None else None
        if tag is None:
            shown = ", ".join(a.name for a in tagged)
            return f"{n.name} ({name}) reads {shown} in the sorted order in a way not known"
        if tag != "restored":
            self.tags[n.name] = tag
        if tag in ("keys", "perm", "pidx", "hist", "offs", "blank", "inv"):
            self.grouping.add(n.name)
        return None


# ------------------------------------------------------------------------- the rules


def _getitem(p: _SortProof, n: fx.Node, tags: set[str]) -> str | None:
    index = n.args[1] if len(n.args) > 1 else None
    if tags == {"pair"} and index in (0, 1):
        return "keys" if index == 0 else "perm"
    if tags == {"sorted"} and isinstance(index, int):  # a piece of a chunk or split
        return "sorted"
    if tags <= {"sorted", "keys"} and _keeps_rows(index):  # x[..., ::2], x[:, 0]
        return "sorted"
    return _index(p, n, tags)


def _keeps_rows(index: Any) -> bool:
    """Whether an index of constants leaves dimension 0 whole and in place."""
    if not isinstance(index, tuple) or len(index) < 2:
        return False
    if any(isinstance(i, fx.Node) for i in index):
        return False
    first = index[0]
    return first is Ellipsis or (isinstance(first, slice) and first == slice(None))


def _floor_divide(p: _SortProof, n: fx.Node, tags: set[str]) -> str | None:
    by = n.args[1] if len(n.args) > 1 else None
    if op_name(n) == "div" and n.kwargs.get("rounding_mode") != "floor":
        return _row_wise(p, n, tags)
    if tags == {"perm"} and isinstance(by, int) and by > 0 and n.args[0] is not None:
        return "pidx"
    return _row_wise(p, n, tags)


def _index(p: _SortProof, n: fx.Node, tags: set[str]) -> str | None:
    """``x[i]`` along the rows: a value in its own order taken by the permutation (sorted),
    a whole table taken by the sorted keys (sorted), or a sorted value taken by the inverse
    permutation (back in place)."""
    x = n.args[0]
    index = n.args[1] if len(n.args) > 1 else None
    items = list(index) if isinstance(index, (list, tuple)) else [index]
    if len(items) != 1 or not isinstance(items[0], fx.Node):
        return None
    i, x_tag = p._tag(items[0]), p._tag(x)
    if i in ("perm", "pidx") and x_tag is None and 0 in _growing(p.roles, x):
        return "sorted"
    if i == "keys" and x_tag is None and p._static(x):
        return "sorted"
    if i == "inv" and x_tag in ("sorted", "keys"):
        p.restored = True
        return "restored"
    return None


def _cast(p: _SortProof, n: fx.Node, tags: set[str]) -> str | None:
    if len(tags) == 1 and len([a for a in n.all_input_nodes if a.name in p.tags]) == 1:
        tag = next(iter(tags))
        if tag not in ("pair", "blank"):
            return tag
    return _row_wise(p, n, tags)


def _flat_view(p: _SortProof, n: fx.Node, tags: set[str]) -> str | None:
    """A view that keeps the rows (dim 0 the same size at both batch sizes)."""
    before, after = _shapes(p.roles, n.args[0]), _shapes(p.roles, n)
    if before is None or after is None or not after[0] or not before[0]:
        return None
    if before[0][0] == after[0][0] and before[1][0] == after[1][0] and tags <= {"sorted", "keys"}:
        return "sorted" if "sorted" in tags else "keys"
    return None


def _histc(p: _SortProof, n: fx.Node, tags: set[str]) -> str | None:
    """Counts of the sorted keys per group, over exactly the keys' range."""
    if tags != {"keys"} or p.groups is None:
        return None
    if op_name(n) == "bincount":
        size = _dim(n, 2, "minlength", 0)
        return "hist" if size == p.groups and _dim(n, 1, "weights", None) is None else None
    bins, low, high = _dim(n, 1, "bins", 100), _dim(n, 2, "min", 0), _dim(n, 3, "max", 0)
    return "hist" if (bins, low, high) == (p.groups, 0, p.groups - 1) else None


def _cumsum(p: _SortProof, n: fx.Node, tags: set[str]) -> str | None:
    return "offs" if tags == {"hist"} and _dim(n, 1, "dim", None) in (0, -1) else None


def _grouped(p: _SortProof, n: fx.Node, tags: set[str]) -> str | None:
    """A grouped product of rows in the sorted order by their groups' weights, at the
    offsets of the sorted keys: row by row, each by its own key's weight."""
    x, w = n.args[0], n.args[1] if len(n.args) > 1 else n.kwargs.get("mat_b")
    offs = _dim(n, 2, "offs", None)
    if p._tag(x) not in ("sorted",) or p._tag(offs) != "offs" or not p._static(w):
        return None
    if p._tag(w) is not None:
        return None
    p.grouped.add(n.name)
    return "sorted"


def _row_wise(p: _SortProof, n: fx.Node, tags: set[str]) -> str | None:
    """An op row by row: its inputs in the sorted order (values and keys) or whole."""
    if not tags <= {"sorted", "keys"}:
        return None
    for a in n.all_input_nodes:
        if a.name not in p.tags and not p._static(a):
            return None  # a value in the batch's own order beside the sorted ones
    return "sorted"


def _split_along_features(p: _SortProof, n: fx.Node, tags: set[str]) -> str | None:
    dim = _dim(n, 2, "dim", 0)
    shapes = _shapes(p.roles, n.args[0])
    if tags == {"sorted"} and shapes is not None and isinstance(dim, int):
        return "sorted" if dim % len(shapes[0]) != 0 else None
    return None


def _slice_features(p: _SortProof, n: fx.Node, tags: set[str]) -> str | None:
    """A slice, narrowing or selection along a dimension that is not the rows'."""
    dim = _dim(n, 1, "dim", 0)
    shapes = _shapes(p.roles, n.args[0])
    if tags <= {"sorted", "keys"} and shapes is not None and isinstance(dim, int):
        return "sorted" if dim % len(shapes[0]) != 0 else None
    return None


def _unsqueeze(p: _SortProof, n: fx.Node, tags: set[str]) -> str | None:
    dim = _dim(n, 1, "dim", 0)
    return "sorted" if tags <= {"sorted", "keys"} and isinstance(dim, int) and dim != 0 else None


def _empty_like(p: _SortProof, n: fx.Node, tags: set[str]) -> str | None:
    return "blank" if tags == {"perm"} else None


def _index_put(p: _SortProof, n: fx.Node, tags: set[str]) -> str | None:
    """``inv[perm] = arange(rows)``: the inverse permutation."""
    target, indices = n.args[0], n.args[1] if len(n.args) > 1 else None
    values = n.args[2] if len(n.args) > 2 else None
    items = list(indices) if isinstance(indices, (list, tuple)) else []
    if len(items) != 1 or p._tag(items[0]) != "perm" or p._tag(target) not in ("blank", None):
        return None
    if isinstance(values, fx.Node) and op_name(values) == "arange" and _counts_up(values):
        return "inv"
    return None


def _argsort(p: _SortProof, n: fx.Node, tags: set[str]) -> str | None:
    return "inv" if tags == {"perm"} else None


def _scatter_back(p: _SortProof, n: fx.Node, tags: set[str]) -> str | None:
    """``out.index_add(0, perm or pidx, sorted)`` (or index_copy): every sorted row added or
    copied back to its own place."""
    target, dim = n.args[0], _dim(n, 1, "dim", None)
    index = n.args[2] if len(n.args) > 2 else n.kwargs.get("index")
    source = n.args[3] if len(n.args) > 3 else n.kwargs.get("source")
    if dim != 0 or p._tag(target) is not None or p._tag(index) not in ("perm", "pidx"):
        return None
    if p._tag(source) not in ("sorted", "keys"):
        return None
    p.restored = True
    return "restored"


def _counts_up(n: fx.Node) -> bool:
    """``arange(n)`` or ``arange(0, n)`` with step 1."""
    args = list(n.args)
    if len(args) == 1:
        return True
    return len(args) in (2, 3) and bool(args[0] == 0) and (len(args) == 2 or bool(args[2] == 1))


_RULES: dict[str, Any] = {
    "getitem": _getitem,
    "index": _index,
    "floor_divide": _floor_divide,
    "floordiv": _floor_divide,
    "div": _floor_divide,
    "histc": _histc,
    "bincount": _histc,
    "cumsum": _cumsum,
    "chunk": _split_along_features,
    "split": _split_along_features,
    "split_with_sizes": _split_along_features,
    "unsqueeze": _unsqueeze,
    "slice": _slice_features,
    "narrow": _slice_features,
    "select": _slice_features,
    "empty_like": _empty_like,
    "index_put_": _index_put,
    "index_put": _index_put,
    "argsort": _argsort,
    "index_add": _scatter_back,
    "index_add_": _scatter_back,
    "index_copy": _scatter_back,
    "index_copy_": _scatter_back,
    **dict.fromkeys(GROUPED_OPS, _grouped),
    **dict.fromkeys(_CASTS, _cast),
    **dict.fromkeys(_FLAT_VIEWS, _flat_view),
    **dict.fromkeys(_ROW_WISE - _CASTS, _row_wise),
}


def _reads_no_data(n: fx.Node) -> bool:
    """Size queries, metadata reads and checks: they read what a value is, not its data."""
    if is_check(n) or op_name(n) in _SIZE_READS:
        return True
    return n.target is getattr and len(n.args) > 1 and n.args[1] in _METADATA


def _key_range(keys: Any, roles: BatchRoles) -> int | None:
    """How many values the keys take, where they are indices of a top-k (``topk(x, k)[1]``)
    over a last dimension of that size, seen through views and casts; None otherwise."""
    node = keys
    while isinstance(node, fx.Node) and op_name(node) in _FLAT_VIEWS | _CASTS:
        node = node.args[0]
    if not isinstance(node, fx.Node) or op_name(node) != "getitem" or node.args[1] != 1:
        return None
    top = node.args[0]
    if not isinstance(top, fx.Node) or op_name(top) != "topk":
        return None
    shapes = _shapes(roles, top.args[0])
    dim = _dim(top, 2, "dim", -1)
    if shapes is None or not shapes[0] or not isinstance(dim, int):
        return None
    if dim % len(shapes[0]) != len(shapes[0]) - 1 or shapes[0][-1] != shapes[1][-1]:
        return None
    return int(shapes[0][-1])
