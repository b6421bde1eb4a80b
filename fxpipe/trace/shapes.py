"""Gives every reader of a shape query its own copy, so that shared sizes glue no stages.

Sizes are not tensors, so no stage border may fall between a size and the node that reads
it (:mod:`fxpipe.passes.partition.units` merges them). ``torch.export`` computes the batch
size once,
``sym_size(input_ids, 0)``, and every layer's ``view`` reads that one node: merged, the
whole network would become one indivisible unit. Shape queries are pure and cheap, so
each reader gets a private copy of the chain that computes its size (the query and any
integer arithmetic on it); the queried tensor (usually a model input) then reaches the
reader's stage like any other tensor, and the graph computes what it computed before.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from fxpipe.trace.private_chains import copy_per_reader

__all__ = ["replicate_shape_queries", "is_shape_query"]

_ATEN_QUERIES = frozenset(
    {
        torch.ops.aten.sym_size.int,
        torch.ops.aten.sym_size.default,
        torch.ops.aten.sym_numel.default,
        torch.ops.aten.sym_stride.int,
        torch.ops.aten.sym_stride.default,
        torch.ops.aten.sym_storage_offset.default,
    }
)
_METHOD_QUERIES = frozenset({"size", "dim", "numel", "stride"})
_INT_OPS = frozenset(
    {
        operator.add,
        operator.sub,
        operator.mul,
        operator.floordiv,
        operator.truediv,
        operator.mod,
        operator.neg,
        operator.pow,
        operator.getitem,
        torch.sym_int,
        torch.sym_float,
        torch.sym_max,
        torch.sym_min,
    }
)


def is_shape_query(node: fx.Node) -> bool:
    """Whether ``node`` only reads sizes: a size/shape query of a tensor, or integer
    arithmetic (and indexing) on shape queries and constants."""
    if node.op == "call_method":
        return node.target in _METHOD_QUERIES
    if node.op != "call_function":
        return False
    if node.target in _ATEN_QUERIES:
        return True
    if node.target is getattr:
        return len(node.args) == 2 and node.args[1] == "shape"
    if node.target in _INT_OPS:
        inputs = node.all_input_nodes
        return bool(inputs) and all(is_shape_query(n) for n in inputs)
    return False


def replicate_shape_queries(gm: fx.GraphModule) -> int:
    """Rewrite ``gm`` in place so that every shape query with several readers becomes one
    copy per reader; returns how many readers got a copy (0: the graph is unchanged)."""
    queries = {n for n in gm.graph.nodes if is_shape_query(n)}
    if not any(len(n.users) > 1 for n in queries):
        return 0
    return copy_per_reader(gm, queries, queries)
