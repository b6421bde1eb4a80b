"""Finds the tensor-parallel plan of a graph: ``tensor_plan(gm, tp, example_values)``.

Every matrix product against a parameter is first taken as cut by output features
(column-wise), and each cut is followed forward through the ops that keep it local
(:mod:`fxpipe.passes.tensor.layouts`) until a product that contracts it (row-wise: its
partial sums all-reduced). The values a cut reaches form groups joined by the ops that read
several of them (attention reads q, k and v; SwiGLU multiplies gate by up). A group is kept
when every value in it ends in row-wise products; one that reaches anything else (the
graph's output, a norm over the cut features, a head count that tp does not divide, another
stage) is dropped, its column products left whole with the reason, and the search runs
again. Where a group's row-wise product is the column product of a later group, the earlier
group keeps it. A fused q, k, v product is tried cut in three parts when whole pieces do not
fit. Then an LM head (the last product before the output) is cut by vocabulary with its
logits all-gathered, an embedding indexed by the model's input ids is cut by rows (a tied
head and embedding alike), and every other parameter (norms; sequence parallelism is not
done) is whole on every rank.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch.fx as fx

from fxpipe.errors import ConfigError
from fxpipe.passes.tensor.assembly import Assembly
from fxpipe.passes.tensor.cuts import Rules
from fxpipe.passes.tensor.products import find_embeddings, find_products, param_readers
from fxpipe.passes.tensor.records import TensorPlan
from fxpipe.passes.tensor.search import Search
from fxpipe.passes.tensor.values import node_shapes

__all__ = ["tensor_plan"]


def tensor_plan(
    gm: fx.GraphModule,
    tp: int,
    example_values: Sequence[Any],
    *,
    stage_of: Mapping[str, int] | None = None,
) -> TensorPlan:
    """How ``gm`` runs over ``tp`` ranks. ``example_values``: one value per placeholder
    (shapes are read from a run on fake tensors). ``stage_of``: node name -> stage, where
    the graph is a pipeline's whole graph; no cut value then crosses a stage border."""
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ConfigError(f"tp={tp!r} must be a positive int: the ranks of the 'tp' dimension")
    rules = Rules(gm, tp, node_shapes(gm, example_values))
    search = Search(gm, rules, find_products(gm), param_readers(gm), dict(stage_of or {}))
    flow = search.run()
    return Assembly(search, flow, find_embeddings(gm)).plan()
