"""Runs a graph as the ranks of a tensor-parallel plan would, on one process and without
torch.distributed: the oracle of the tensor-parallel planner's tests.

A value the plan cuts is a list of tp pieces. A column-wise product computes each rank's
output features from its slice of the weight; a row-wise product sums the ranks' partial
products (the all-reduce) and adds its bias once; an LM head concatenates the ranks' logits
(the all-gather); a vocabulary-parallel embedding sums each rank's lookups of its own rows,
zero elsewhere. Every other node the plan cuts runs once per rank on that rank's pieces
and the whole values of its other inputs, with the sizes it is given (a view's shape, a
split's sizes) divided by tp along the cut dimension; a node the plan leaves whole runs
once. The products are computed here from their parameters (``x @ W.T + b`` or
``x @ W + b``), not by the graph's own ops, and the weights are sliced by the plan's
:class:`Shard` of each parameter, so a wrong cut, a wrong part count or an op the plan
wrongly calls local shows up as a wrong output or gradient.
"""

from __future__ import annotations

from collections.abc import Sequence
from operator import attrgetter
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F

from fxpipe.passes.ops import is_check, op_name
from fxpipe.passes.tensor.products import find_embeddings, find_products
from fxpipe.passes.tensor.records import Shard, TensorPlan

__all__ = ["emulate", "Pieces"]

_SIZED = frozenset({"view", "reshape", "_unsafe_view", "expand"})
_SPLIT = frozenset({"split", "split_with_sizes"})
_READS_SIZE = frozenset({"sym_size", "size", "getattr", "dim", "numel"})


class Pieces(list[Any]):
    """The tp pieces of a cut value, rank by rank."""


def emulate(gm: fx.GraphModule, plan: TensorPlan, example_values: Sequence[Any]) -> Any:
    """The output of ``gm`` run on ``example_values`` as ``plan``'s ranks would compute it."""
    whole = _Whole(gm)
    with torch.no_grad():
        whole.run(*example_values)
    return _Ranks(gm, plan, whole.values).run(*example_values)


class _Whole(fx.Interpreter):
    """An ordinary run that keeps every node's value (their sizes are the whole sizes)."""

    def __init__(self, gm: fx.GraphModule) -> None:
        super().__init__(gm)
        self.values: dict[str, Any] = {}

    def run_node(self, n: fx.Node) -> Any:
        out = super().run_node(n)
        self.values[n.name] = out
        return out


class _Ranks(fx.Interpreter):
    def __init__(self, gm: fx.GraphModule, plan: TensorPlan, whole: dict[str, Any]) -> None:
        super().__init__(gm)
        self.plan, self.whole, self.tp = plan, whole, plan.tp
        self.products = find_products(gm)
        self.embeddings = find_embeddings(gm)
        self.nodes = {n.name: n for n in gm.graph.nodes}

    def run_node(self, n: fx.Node) -> Any:
        style = self.plan.node_styles.get(n.name)
        if style == "vocab":
            return self._vocab(n)
        if style is not None:
            return self._product(n, style)
        layout = self.plan.layouts.get(n.name)
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        cut = any(isinstance(v, Pieces) for v in [*args, *kwargs.values()] + _flat(args))
        if layout is not None:
            return Pieces(self._on_rank(n, layout, args, kwargs, r) for r in range(self.tp))
        if not cut:
            return super().run_node(n)
        if is_check(n):
            return None
        if op_name(n) in _READS_SIZE:
            return self.whole[n.name]  # sizes read off a cut value are the whole sizes
        raise AssertionError(f"{n.format_node()} reads a cut value but the plan keeps it whole")

    def _on_rank(
        self, n: fx.Node, layout: Any, args: tuple[Any, ...], kwargs: dict[str, Any], r: int
    ) -> Any:
        local_args = _pick(args, r)
        local_kwargs = _pick(kwargs, r)
        name = op_name(n)
        if name in _SIZED and isinstance(layout, Shard):
            size = list(self.whole[n.name].shape)
            size[layout.dim] //= self.tp
            local_args = (local_args[0], *size) if n.op == "call_method" else (local_args[0], size)
            local_kwargs = {}
        elif name in _SPLIT:
            dim = int(n.args[2] if len(n.args) > 2 else n.kwargs.get("dim", 0))
            source = self.plan.layouts[n.args[0].name]  # type: ignore[union-attr]
            if isinstance(source, Shard) and dim % self.whole[n.args[0].name].dim() == source.dim:  # type: ignore[union-attr]
                sizes = local_args[1]
                local = (
                    [s // self.tp for s in sizes] if isinstance(sizes, list) else sizes // self.tp
                )
                local_args = (local_args[0], local, *local_args[2:])
        return getattr(self, n.op)(n.target, local_args, local_kwargs)

    def _param(self, name: str | None) -> torch.Tensor | None:
        return None if name is None else attrgetter(name)(self.module)

    def _piece(self, name: str | None, r: int) -> torch.Tensor | None:
        value = self._param(name)
        if value is None or name is None:
            return None
        shard = self.plan.params[name].shard
        return value if shard is None else shard.take(value, self.tp, r)

    def _product(self, n: fx.Node, style: str) -> Any:
        p = self.products[n.name]
        x = self._value_of(p.x)
        if style == "rowwise":
            assert isinstance(x, Pieces), f"{n.name}: row-wise, but its input is whole"
            partial = [
                _apply(x[r], self._piece(p.weight, r), None, p.out_dim) for r in range(self.tp)
            ]
            total = torch.stack(partial).sum(0)
            bias = self._param(p.bias)
            return total if bias is None else total + bias
        assert not isinstance(x, Pieces), f"{n.name}: column-wise, but its input is cut"
        pieces = Pieces(
            _apply(x, self._piece(p.weight, r), self._piece(p.bias, r), p.out_dim)
            for r in range(self.tp)
        )
        if style == "gathered":
            return torch.cat(list(pieces), dim=-1)
        return pieces

    def _vocab(self, n: fx.Node) -> torch.Tensor:
        e = self.embeddings[n.name]
        ids, weight = self._value_of(e.ids), self._param(e.weight)
        assert weight is not None
        rows = e.rows // self.tp
        total = 0
        for r in range(self.tp):
            mine = (ids >= r * rows) & (ids < (r + 1) * rows)
            local = F.embedding((ids - r * rows) * mine, Shard(0).take(weight, self.tp, r))
            total = total + local * mine.unsqueeze(-1).to(local.dtype)
        assert isinstance(total, torch.Tensor)
        return total

    def _value_of(self, name: str) -> Any:
        return self.env[self.nodes[name]]


def _apply(
    x: torch.Tensor, w: torch.Tensor | None, b: torch.Tensor | None, out_dim: int
) -> torch.Tensor:
    assert w is not None
    y = x @ (w.t() if out_dim == 0 else w)
    return y if b is None else y + b


def _pick(value: Any, r: int) -> Any:
    if isinstance(value, Pieces):
        return value[r]
    if isinstance(value, tuple):
        return tuple(_pick(v, r) for v in value)
    if isinstance(value, list):
        return [_pick(v, r) for v in value]
    if isinstance(value, dict):
        return {k: _pick(v, r) for k, v in value.items()}
    return value


def _flat(value: Any) -> list[Any]:
    if isinstance(value, (tuple, list)) and not isinstance(value, Pieces):
        return [x for v in value for x in [v, *_flat(v)]]
    return []
