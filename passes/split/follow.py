"""Splits another trace of the same model along a plan's borders, so that stage ``j`` holds the
same Parameters in both: the model in its other mode, or called with other arguments.

A pipeline is planned on one trace of the model (say in training mode, without ``labels``).
Another call may need another graph: torch.export fixes the train/eval mode it traced in,
and a call that passes ``labels`` adds the loss. The Parameters already live on their
stages' devices, so the new graph cannot be partitioned afresh; it *follows* the first:

- a node that reads a weight (a ``get_attr``, a module call) goes to the stage that holds
  that weight in the first plan;
- any other node goes to the stage of the node that matches it in the first plan: the same
  op in the same module, counted in order within that module (so a dropout that the other
  mode leaves out does not shift what follows), else to the stage of its inputs;
- then every node moves, where it must, to the latest stage of its inputs, so values only
  flow forward; groups no border may split (:mod:`fxpipe.passes.partition.units`) move whole.

The result is a stage for every node, which :func:`fxpipe.passes.split.plan.build_plan` and
:func:`fxpipe.passes.split.codegen.split_stages` turn into a program as for any plan.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from operator import attrgetter
from typing import Any

import networkx as nx
import numpy as np
import torch
import torch.fx as fx

from fxpipe.ir import PipelinePlan
from fxpipe.passes.ops import module_path, op_name
from fxpipe.passes.partition.search import node_stages
from fxpipe.passes.partition.units import build_units

__all__ = ["follow_borders"]

#: Shape queries: they follow their reader, never another trace's node (see ``_keys``).
SHAPE_QUERIES = frozenset({torch.ops.aten.sym_size.int, torch.ops.aten.sym_numel.default})


def follow_borders(leader: PipelinePlan, gm: fx.GraphModule, g: nx.DiGraph) -> dict[str, int]:
    """A stage for every node of ``gm`` (whose cost graph is ``g``) along ``leader``'s
    borders (see the module docstring). Nothing is modified."""
    anchors = _anchors(leader, gm)
    units = build_units(g)
    floor = np.zeros(units.num_units, dtype=np.int64)
    for node in gm.graph.nodes:
        if node.name in units.unit_of:
            reads = [anchors.get(a.name, 0) for a in node.all_input_nodes if a.op == "get_attr"]
            u = units.unit_of[node.name]
            floor[u] = max([int(floor[u]), anchors.get(node.name, 0), *reads])
    stage = np.zeros(units.num_units, dtype=np.int64)
    for u in nx.topological_sort(units.dag):
        before = [int(stage[p]) for p in units.dag.predecessors(u)]
        stage[u] = max([int(floor[u]), *before])
    stage_of = node_stages(g, units, stage, leader.num_stages)
    for node in gm.graph.nodes:  # a weight stays where the leader holds it
        if node.op == "get_attr" and node.name in anchors:
            stage_of[node.name] = min(stage_of[node.name], anchors[node.name])
    return stage_of


def _anchors(leader: PipelinePlan, gm: fx.GraphModule) -> dict[str, int]:
    """The leader's stage for each node of ``gm`` that reads a weight or matches one of its
    nodes."""
    lead = leader.graph_module
    holder = _weight_stages(leader)
    by_key = {key: leader.stage_of[n.name] for key, n in _keys(lead.graph.nodes)}
    anchors: dict[str, int] = {}
    for key, node in _keys(gm.graph.nodes):
        if node.op == "get_attr":
            found = holder.get(id(_attribute(gm, node)))
            if found is not None:
                anchors[node.name] = found
        elif key in by_key:
            anchors[node.name] = by_key[key]
    return anchors


def _weight_stages(leader: PipelinePlan) -> dict[int, int]:
    """id of each tensor a ``get_attr`` of the leader reads -> the stage holding it."""
    gm = leader.graph_module
    out: dict[int, int] = {}
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            out.setdefault(id(_attribute(gm, node)), leader.stage_of[node.name])
    return out


def _keys(nodes: Iterable[fx.Node]) -> Iterable[tuple[tuple[Any, ...], fx.Node]]:
    """Each compute node with a key that names what it does where: (op, module path, its
    target, how many such nodes came before it in that module). Not a shape query: copied
    once per reader, often outside any module, its count matches another trace's queries
    of other values, and it goes with the node that reads it."""
    seen: Counter[tuple[Any, ...]] = Counter()
    for node in nodes:
        if node.op in ("placeholder", "output") or node.target in SHAPE_QUERIES:
            continue
        what = (node.op, module_path(node), op_name(node), _target(node))
        seen[what] += 1
        yield (*what, seen[what]), node


def _target(node: fx.Node) -> str:
    return str(node.target) if node.op in ("call_module", "get_attr") else ""


def _attribute(gm: fx.GraphModule, node: fx.Node) -> Any:
    try:
        return attrgetter(str(node.target))(gm)
    except AttributeError:
        return None
