"""The whole values a tensor-parallel plan's cut computations read that carry a gradient: each
rank computes their gradient from its own pieces only (a partial sum), so the ranks' parts
must be added.

A value cut over the tp ranks (q's heads, an MLP's hidden features) is computed on each rank
from its pieces and from whole values every rank holds alike: a per-head norm's weight (Qwen3,
Gemma3), a scale, a bias added to the cut features' pieces, a value another stage sent. Where
such a whole value carries a gradient, its gradient through that read is the sum over the
ranks' pieces, and each rank holds only its own part. The local program
(:mod:`fxpipe.passes.tensor.local`) reads it there through a
:class:`~fxpipe.passes.tensor.cut_modules.ReplicatedRead`: a DTensor replicated over the tp
mesh whose gradient comes back partial, which torch's DTensor all-reduces (as its own
tensor-parallel styles treat a replicated input). Readers in a region cut along the sequence
are not counted: their whole operands enter that region as replicated DTensors already.

Found from the graph: which values carry a gradient is read off one run on fake tensors
(:mod:`fxpipe.passes.tensor.values`, Parameters and floating-point inputs requiring it), and
every node whose output the plan cuts, but for the products and embeddings its generated
modules compute, is a reader. A norm module such a node calls holds its weights itself: it
is listed apart, to be run as its function with its weights read alike.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from operator import attrgetter

import torch.fx as fx
from torch import nn

from fxpipe.passes.ops import is_check
from fxpipe.passes.tensor.cuts import Rules
from fxpipe.passes.tensor.records import Layout

__all__ = ["PartialReads", "partial_reads", "params_behind", "PARTIAL_REASON"]

#: Why a whole parameter some cut computation reads is whole, as the plan prints it.
PARTIAL_REASON = "whole; read with cut values, its gradient summed over the tp ranks"


@dataclass(frozen=True)
class PartialReads:
    """Where a cut computation reads a whole value that carries a gradient."""

    #: Whole value (node name) -> the cut nodes that read it, in graph order.
    values: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    #: Cut node calling a norm module -> the module's parameters (by their full names).
    modules: Mapping[str, tuple[str, ...]] = field(default_factory=dict)


def partial_reads(
    gm: fx.GraphModule,
    rules: Rules,
    layouts: Mapping[str, Layout],
    generated: Collection[str],
    sequence: Collection[str] = (),
) -> PartialReads:
    """The whole values with a gradient that the nodes ``layouts`` cuts read. ``generated``:
    the product and embedding nodes the plan computes by generated modules (torch's styles
    handle their inputs); ``sequence``: the nodes held cut along the sequence."""
    values: dict[str, list[str]] = {}
    modules: dict[str, tuple[str, ...]] = {}
    for n in gm.graph.nodes:
        if n.name not in layouts or n.name in generated or n.name in sequence:
            continue
        for a in n.all_input_nodes:
            if a.name in layouts or a.name not in rules.grads or is_check(a):
                continue
            values.setdefault(a.name, []).append(n.name)
        if n.op == "call_module":
            owned = [
                f"{n.target}.{name}"
                for name, p in gm.get_submodule(str(n.target)).named_parameters()
                if p.requires_grad
            ]
            if owned:
                modules[n.name] = tuple(owned)
    return PartialReads({k: tuple(v) for k, v in values.items()}, modules)


def params_behind(gm: fx.GraphModule, reads: PartialReads) -> dict[str, tuple[str, ...]]:
    """Parameter name -> the cut nodes whose partial gradient reaches it: through the values
    of ``reads`` (a weight read as it is, or a value computed from it, Gemma's ``1 +
    weight``) and the norm modules it lists."""
    nodes = {n.name: n for n in gm.graph.nodes}
    out: dict[str, list[str]] = {}
    for value, readers in reads.values.items():
        seen: set[str] = set()
        stack = [nodes[value]]
        while stack:
            n = stack.pop()
            if n.name in seen:
                continue
            seen.add(n.name)
            if n.op == "get_attr" and isinstance(attrgetter(str(n.target))(gm), nn.Parameter):
                out.setdefault(str(n.target), []).extend(readers)
            stack.extend(n.all_input_nodes)
    for reader, params in reads.modules.items():
        for name in params:
            out.setdefault(name, []).append(reader)
    return {k: tuple(dict.fromkeys(v)) for k, v in out.items()}
