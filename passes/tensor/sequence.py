"""Sequence parallelism: the values of a graph a tensor-parallel plan may hold cut along the
sequence (each tp rank its share of the tokens) between a row-wise product and the next
column-wise one, so that the norms, residual adds and dropouts there run on ``1 / tp`` of
the tokens and their activations take ``1 / tp`` of the memory.

A region starts at the output of a row-wise product or a vocabulary-parallel embedding
(reduce-scattered along the sequence instead of all-reduced) and follows the ops that
compute each token from the same token alone (element-wise ops, casts, norms and
reductions over the features, views that keep the batch and sequence dimensions); a
product that reads the tokens flattened (transformers' ``Conv1D``) is taken as reading
them unflattened, which its local program then does (:class:`Flattened`). A value
read outside it (by column-wise products, by anything else, by another stage) is
all-gathered once for all its readers. A reduce-scatter and an all-gather cost the
all-reduce they replace, so a region that gathers no more values than it scatters costs no
more communication than none. A region is kept where it pays (``"auto"``): it holds a norm,
whose work and activations then divide by tp, and gathers at most one value more than it
scatters (a stage's output); every region found with ``True``; none with ``False``. Whole
values a region op reads (a position table, a norm's weight, the residual sent from
another stage) enter it as replicated DTensors, which torch slices where they meet a cut
value (no communication). The region lives in each rank's local program as DTensors
(:mod:`fxpipe.passes.tensor.local`), so torch's DTensor computes every op in it and its
gradients; fxpipe only chooses where it starts and ends."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Literal, TypeAlias

import torch
import torch.fx as fx
from torch import nn

from fxpipe.errors import ConfigError
from fxpipe.passes.ops import is_check, op_name
from fxpipe.passes.tensor.cuts import (
    CASTS,
    ELEMENTWISE,
    ELEMENTWISE_MODULES,
    NORMS,
    REDUCTIONS,
    SIZE_QUERIES,
    VIEWS,
    Rules,
    arg,
    base_name,
)
from fxpipe.passes.tensor.records import Layout, NodeStyle

__all__ = [
    "SequenceChoice",
    "SEQUENCE_CHOICES",
    "SequenceRegions",
    "sequence_regions",
    "check_sequence_choice",
    "whole_readers",
    "flattened_products",
    "Flattened",
    "NORM_MODULES",
]

#: ``sequence_parallel=``: regions that hold a norm (``"auto"``), every region, or none.
SequenceChoice: TypeAlias = Literal["auto"] | bool
SEQUENCE_CHOICES: tuple[SequenceChoice, ...] = ("auto", True, False)
#: Norm modules a region runs as their functions, their weights entering as replicated.
NORM_MODULES: tuple[type[nn.Module], ...] = (nn.LayerNorm, nn.RMSNorm)
#: Attributes of a tensor that say what it is, not what it holds (a DTensor answers them
#: for the whole value, as the graph was written for).
METADATA = frozenset("shape dtype device ndim is_cuda requires_grad layout".split())
#: Ops a norm is made of, where a model writes one out (RMSNorm: ``x * rsqrt(mean(x^2))``).
_NORM_OPS = NORMS | {"rsqrt"}
#: The dimension of a region value that holds the sequence: (batch, sequence, ...).
_SEQ_DIM = 1
#: The ops a product that reads the tokens flattened flattens and restores them with.
_RESHAPES = frozenset({"view", "reshape", "_unsafe_view"})


@dataclass(frozen=True, slots=True)
class Flattened:
    """A product that reads the tokens flattened (transformers' ``Conv1D``: ``x.view(-1,
    nx)``, the product, then a view back to ``(batch, sequence, features)``): run on the
    unflattened ``source`` it computes the same, its output laid out by sequence."""

    #: The view that flattens the tokens, the value it flattens, the view that restores them.
    flat: str
    source: str
    unflat: str
    #: The product's output sizes unflattened.
    shape: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class SequenceRegions:
    """The values a plan holds cut along the sequence, and where they are gathered whole."""

    #: Node name -> the dimension its output is cut along (the sequence), for every value
    #: held so.
    dims: Mapping[str, int]
    #: Region value -> the nodes that read it whole (it is all-gathered once for them).
    gathers: Mapping[str, tuple[str, ...]]
    #: Why each region found is not cut, one line each.
    declined: tuple[str, ...] = ()


def sequence_regions(
    gm: fx.GraphModule,
    rules: Rules,
    layouts: Mapping[str, Layout],
    node_styles: Mapping[str, NodeStyle],
    stage_of: Mapping[str, int],
    choice: SequenceChoice,
    flattened: Mapping[str, Flattened] | None = None,
) -> SequenceRegions:
    """The sequence-parallel regions of ``gm`` under a plan that cuts values by features as
    ``layouts`` says and whose products compute as ``node_styles`` says; ``stage_of``: node
    -> stage, where the graph is a pipeline's (a region stays in its stage);
    ``flattened``: the products that read the tokens flattened (a row-wise one among them
    starts a region as if it read them unflattened)."""
    check_sequence_choice(choice)
    if choice is False or rules.tp == 1:
        return SequenceRegions({}, {}, ("sequence_parallel=False",) if choice is False else ())
    finder = _Finder(gm, rules, layouts, node_styles, stage_of, flattened)
    dims = finder.regions(paying=choice == "auto")
    gathers = whole_readers(gm.graph, dims, stage_of)
    return SequenceRegions(dims, gathers, tuple(finder.declined))


def check_sequence_choice(value: object) -> None:
    """ConfigError unless ``value`` is one of :data:`SEQUENCE_CHOICES` (not a 1 or 0 that
    compares equal to True or False)."""
    if value not in SEQUENCE_CHOICES or not isinstance(value, (bool, str)):
        raise ConfigError(
            f"sequence_parallel={value!r} is not one of {SEQUENCE_CHOICES}; pass 'auto' "
            "(where it pays), True (every region found) or False (none)"
        )


def whole_readers(
    graph: fx.Graph, dims: Collection[str], stage_of: Mapping[str, int] | None = None
) -> dict[str, tuple[str, ...]]:
    """Region value (of ``dims``, the names of the values cut along the sequence) -> the
    nodes that read it whole, all-gathered once for them: every reader outside the regions
    (or in another stage), but for size and dtype queries and checks, which read what the
    value is, not what it holds."""
    stages = stage_of or {}
    out: dict[str, tuple[str, ...]] = {}
    for n in graph.nodes:
        if n.name not in dims or n.op == "placeholder":
            continue
        readers = tuple(
            user.name
            for user in n.users
            if not (user.name in dims and stages.get(user.name, 0) == stages.get(n.name, 0))
            and not reads_metadata(user)
            and not is_check(user)
        )
        if readers:
            out[n.name] = readers
    return out


def flattened_products(
    gm: fx.GraphModule, rules: Rules, products_x: Mapping[str, str]
) -> dict[str, Flattened]:
    """Product node -> how it reads the tokens flattened, for every product whose input is
    a view of a (batch, sequence, features) value as (batch x sequence, features) and whose
    only reader is a view back to (batch, sequence, its features)."""
    nodes = {n.name: n for n in gm.graph.nodes}
    out: dict[str, Flattened] = {}
    for name, x in products_x.items():
        flat, product = nodes[x], nodes[name]
        if base_name(op_name(flat)) not in _RESHAPES:
            continue
        source = flat.args[0] if flat.args else None
        users = list(product.users)
        if not isinstance(source, fx.Node) or len(users) != 1 or len(flat.users) != 1:
            continue
        unflat = users[0]
        if base_name(op_name(unflat)) not in _RESHAPES:
            continue
        whole, flat_size = rules.size(source), rules.size(flat)
        out_size, back = rules.size(product), rules.size(unflat)
        if whole is None or flat_size is None or out_size is None or back is None:
            continue
        tokens = tuple(whole[:-1])
        if len(whole) != 3 or tuple(flat_size) != (tokens[0] * tokens[1], whole[-1]):
            continue
        if len(out_size) != 2 or tuple(back) != (*tokens, out_size[-1]):
            continue
        out[name] = Flattened(flat.name, source.name, unflat.name, tuple(back))
    return out


def reads_metadata(n: fx.Node) -> bool:
    """Whether ``n`` reads only what a tensor is (its sizes, dtype, device), not what it
    holds."""
    if op_name(n) in SIZE_QUERIES:
        return True
    return n.op == "call_function" and n.target is getattr and n.args[1] in METADATA


class _Finder:
    def __init__(
        self,
        gm: fx.GraphModule,
        rules: Rules,
        layouts: Mapping[str, Layout],
        node_styles: Mapping[str, NodeStyle],
        stage_of: Mapping[str, int],
        flattened: Mapping[str, Flattened] | None,
    ) -> None:
        self.gm, self.rules, self.layouts, self.styles = gm, rules, layouts, node_styles
        self.stage_of = stage_of
        #: A row-wise product reading the tokens flattened: its output unflattened.
        self.unflat = {
            name: torch.Size(f.shape)
            for name, f in (flattened or {}).items()
            if node_styles.get(name) == "rowwise"
        }
        self.nodes = {n.name: n for n in gm.graph.nodes}
        self.declined: list[str] = []

    def regions(self, *, paying: bool) -> dict[str, int]:
        """Node -> cut dimension, for the regions kept (``paying``: those that pay)."""
        seeds = [
            n
            for n in self.gm.graph.nodes
            if self.styles.get(n.name) in ("rowwise", "vocab") and self._cuttable(n)
        ]
        parent: dict[str, str] = {}

        def root(name: str) -> str:
            while parent[name] != name:
                parent[name] = parent[parent[name]]
                name = parent[name]
            return name

        for s in seeds:
            parent[s.name] = s.name
        for n in self.gm.graph.nodes:  # topological: a node's region inputs come first
            if n.name in parent or not self._joins(n, parent):
                continue
            parent[n.name] = n.name
            for a in n.all_input_nodes:
                if a.name in parent and self._same_stage(a, n):
                    parent[root(a.name)] = root(n.name)
        members: dict[str, list[str]] = {}
        for name in parent:
            members.setdefault(root(name), []).append(name)
        kept = [names for names in members.values() if not paying or self._pays(names)]
        return {name: _SEQ_DIM for names in kept for name in names}

    def _pays(self, names: list[str]) -> bool:
        """A region pays where it holds a norm (whose work and activations divide by tp)
        and all-gathers at most one value more than it reduce-scatters (each
        reduce-scatter and all-gather together cost the all-reduce they replace; one more
        gathers a stage's output)."""
        scattered = [x for x in names if x in self.styles]
        region = f"the region from {', '.join(scattered)} ({len(names)} values)"
        if not any(self._is_norm(self.nodes[x]) for x in names):
            self.declined.append(f"{region} holds no norm")
            return False
        gathers = whole_readers(self.gm.graph, set(names), self.stage_of)
        if len(gathers) <= len(scattered) + 1:
            return True
        self.declined.append(
            f"{region} would all-gather {len(gathers)} values ({', '.join(gathers)}) for "
            f"{len(scattered)} reduce-scatters: more communication than the all-reduces it "
            "replaces (sequence_parallel=True cuts it still)"
        )
        return False

    # ------------------------------------------------------------------------- rules

    def _size(self, n: fx.Node) -> torch.Size | None:
        """``n``'s output sizes (a row-wise product's unflattened)."""
        return self.unflat.get(n.name) or self.rules.size(n)

    def _cuttable(self, n: fx.Node) -> bool:
        """Whether ``n``'s output is (batch, sequence, ...) with a sequence to cut."""
        size = self._size(n)
        return size is not None and len(size) > _SEQ_DIM + 1 and size[_SEQ_DIM] > 1

    def _same_stage(self, a: fx.Node, b: fx.Node) -> bool:
        return self.stage_of.get(a.name, 0) == self.stage_of.get(b.name, 0)

    def _joins(self, n: fx.Node, region: Mapping[str, str]) -> bool:
        """Whether ``n`` computes each token from the same token alone, reading at least
        one region value of its own stage, with its output laid out as that value."""
        inputs = [a for a in n.all_input_nodes if a.name in region and self._same_stage(a, n)]
        if not inputs or n.op not in ("call_function", "call_method", "call_module"):
            return False
        if is_check(n) or reads_metadata(n) or not self._cuttable(n):
            return False
        if any(a.name in self.layouts for a in n.all_input_nodes):
            return False  # a value cut by features meets it
        out = self._size(n)
        assert out is not None
        for a in inputs:
            size = self._size(a)
            if size is None or len(size) != len(out) or size[_SEQ_DIM] != out[_SEQ_DIM]:
                return False
            if size[:_SEQ_DIM] != out[:_SEQ_DIM]:
                return False
        if n.op == "call_module":
            module = self.gm.get_submodule(str(n.target))
            return isinstance(module, ELEMENTWISE_MODULES) or _plain_norm(module)
        name = base_name(op_name(n))
        if name in ELEMENTWISE or name in CASTS or name in NORMS:
            return True
        if name in VIEWS:
            return name not in ("flatten", "unflatten", "squeeze", "unsqueeze")
        if name in REDUCTIONS:
            return self._over_features(n, len(self._size(inputs[0]) or ()))
        return False

    def _over_features(self, n: fx.Node, ndim: int) -> bool:
        """A reduction over named dims, none of them the batch or the sequence."""
        dim = arg(n, 1, "dim")
        dims = (
            [dim] if isinstance(dim, int) else list(dim) if isinstance(dim, (list, tuple)) else []
        )
        return bool(dims) and all(isinstance(d, int) and d % ndim > _SEQ_DIM for d in dims)

    def _is_norm(self, n: fx.Node) -> bool:
        if n.op == "call_module":
            return _plain_norm(self.gm.get_submodule(str(n.target)))
        return base_name(op_name(n)) in _NORM_OPS


def _plain_norm(module: nn.Module) -> bool:
    """A torch norm module over the last dimensions (run as its function in a region)."""
    return isinstance(module, NORM_MODULES)
