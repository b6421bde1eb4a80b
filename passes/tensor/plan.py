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
head and embedding alike), and every other parameter (norms) is whole on every rank.
Between a row-wise product and the next column-wise one, the values may be held cut along
the sequence (:mod:`fxpipe.passes.tensor.sequence`: sequence parallelism, where a region
holds a norm). A plan the user gives (:mod:`fxpipe.passes.tensor.given`) limits the search
to the cuts it names, and each of them must hold; it takes no sequence parallelism.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

import torch.fx as fx

from fxpipe.errors import ConfigError
from fxpipe.passes.tensor.assembly import Assembly
from fxpipe.passes.tensor.cuts import Rules
from fxpipe.passes.tensor.given import GivenPlan, check_given
from fxpipe.passes.tensor.partial import PARTIAL_REASON, params_behind, partial_reads
from fxpipe.passes.tensor.products import find_embeddings, find_products, param_readers
from fxpipe.passes.tensor.records import ParamShard, TensorPlan
from fxpipe.passes.tensor.search import Search
from fxpipe.passes.tensor.sequence import (
    Flattened,
    SequenceChoice,
    SequenceRegions,
    flattened_products,
    sequence_regions,
)
from fxpipe.passes.tensor.values import node_values

__all__ = ["tensor_plan", "cut_regions"]


def tensor_plan(
    gm: fx.GraphModule,
    tp: int,
    example_values: Sequence[Any],
    *,
    stage_of: Mapping[str, int] | None = None,
    given: GivenPlan | None = None,
    sequence_parallel: SequenceChoice = "auto",
) -> TensorPlan:
    """How ``gm`` runs over ``tp`` ranks. ``example_values``: one value per placeholder
    (shapes are read from a run on fake tensors). ``stage_of``: node name -> stage, where
    the graph is a pipeline's whole graph; no cut value then crosses a stage border.
    ``given``: the user's plan (:func:`fxpipe.passes.tensor.given.given_plan`): only the
    cuts it names are made, and ConfigError names one it names that cannot be.
    ``sequence_parallel``: hold the values between row-wise and column-wise products cut
    along the sequence where a region holds a norm (``"auto"``), wherever it can (True), or
    nowhere (False); a given plan takes none."""
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ConfigError(f"tp={tp!r} must be a positive int: the ranks of the 'tp' dimension")
    values = node_values(gm, example_values)
    rules = Rules(gm, tp, values.shapes, values.grads)
    products, embeddings = find_products(gm), find_embeddings(gm)
    search = Search(gm, rules, products, param_readers(gm), dict(stage_of or {}), given)
    flow = search.run()
    plan = Assembly(search, flow, embeddings).plan()
    if given is not None:
        made = {
            name: (p.weight, False, plan.node_styles.get(name, "whole"),
                   plan.replicated.get(name, ""))
            for name, p in products.items()
        }  # fmt: skip
        for name, e in embeddings.items():
            why = plan.params[e.weight].reason if e.weight in plan.params else ""
            made[name] = (e.weight, True, plan.node_styles.get(name, "whole"), why)
        assert search.allowed_of is not None
        check_given(given, gm, made, search.allowed_of)
        return _with_partial_reads(gm, rules, plan)
    flattened = flattened_products(gm, rules, {name: p.x for name, p in products.items()})
    regions = sequence_regions(
        gm, rules, plan.layouts, plan.node_styles, plan.stage_of, sequence_parallel, flattened
    )
    return _with_partial_reads(gm, rules, _with_sequence(plan, regions, flattened))


def _with_partial_reads(gm: fx.GraphModule, rules: Rules, plan: TensorPlan) -> TensorPlan:
    """``plan`` with the whole values its cut computations read whose gradients are summed
    over the ranks; a parameter behind one says so."""
    reads = partial_reads(gm, rules, plan.layouts, plan.node_styles, plan.sequence)
    params = dict(plan.params)
    for name in params_behind(gm, reads):
        p = params.get(name)
        if p is not None and p.style == "replicated":
            params[name] = replace(p, reason=PARTIAL_REASON)
    return replace(
        plan, params=params, partial_reads=dict(reads.values),
        partial_modules=dict(reads.modules),
    )  # fmt: skip


def _with_sequence(
    plan: TensorPlan, regions: SequenceRegions, flattened: Mapping[str, Flattened]
) -> TensorPlan:
    """``plan`` holding ``regions`` cut along the sequence; a parameter only they read says
    so."""
    if not regions.dims:
        return replace(plan, sequence_declined=regions.declined)
    params = dict(plan.params)
    for name, p in plan.params.items():
        if p.style == "replicated" and p.readers and all(r in regions.dims for r in p.readers):
            why = "whole; read on each rank's share of the sequence (sequence parallel)"
            params[name] = ParamShard(p.name, p.style, None, why, p.shape, p.product, p.readers)
    unflattened = {
        name: f.source
        for name, f in flattened.items()
        if name in regions.dims or (f.source in regions.dims and name in plan.node_styles)
    }
    return replace(
        plan, params=params, sequence=dict(regions.dims), sequence_gathers=dict(regions.gathers),
        sequence_declined=regions.declined, unflattened=unflattened,
    )  # fmt: skip


def cut_regions(gm: fx.GraphModule, plan: TensorPlan) -> tuple[frozenset[str], ...]:
    """The nodes of each region ``plan`` cuts (from its column-wise products through the
    values cut by features or heads to the row-wise products that contract them), one set
    per region of more than one node: a stage border inside one would leave it whole."""
    cut = {*plan.layouts, *plan.node_styles}
    parent = {name: name for name in cut}

    def root(name: str) -> str:
        while parent[name] != name:
            parent[name] = parent[parent[name]]
            name = parent[name]
        return name

    for n in gm.graph.nodes:
        if n.name not in cut:
            continue
        for a in n.all_input_nodes:
            if a.name in plan.layouts:
                parent[root(a.name)] = root(n.name)
    groups: dict[str, set[str]] = {}
    for name in cut:
        groups.setdefault(root(name), set()).add(name)
    return tuple(frozenset(g) for g in groups.values() if len(g) > 1)
