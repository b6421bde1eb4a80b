"""The weight part of a split backward (the zero-bubble schedules' input and weight parts),
computed so that each Parameter gets its eager gradient exactly once.

torch's input part records, per group of Parameters, the autograd nodes (intermediates)
where the Parameters' uses meet what the stage's inputs reach, and the gradients those
nodes received. Its weight part then runs backward from those nodes to each group's
Parameters, one group at a time, freeing the graph as it goes. Two faults, found on real
models and measured on torch 2.13:

- Its grouping is not transitive: a Parameter whose uses meet the nodes of two groups is
  merged into the first, then the first into the second, and the first is kept too. Two
  groups then share Parameters, whose gradient is added twice, silently where the shared
  part of the graph saved no tensors (``u = x + (a + p); v = x + (b + p)``: ``a`` and ``p``
  get twice eager's) and else with a crash. :func:`disjoint_param_groups` merges groups
  that share a Parameter or a node.
- Where a group's nodes lie on one path (a weight used in every block of a stage, or twice
  in a row), backward from the later node runs through the activations down to the
  earlier one, all the stage's backward again, freeing what other groups still need:
  "Trying to backward through the graph a second time" (a per-block offset added to a
  shared one; Hugging Face ProphetNet). Older releases also add what flows down that path
  to what the earlier node recorded (torch's issue 180952).

fxpipe's :func:`weight_gradients` therefore goes from each recorded node only into its
inputs that no stage input reaches (the Parameters' side, found by :func:`weight_side`
during the input part), and from there to the Parameters: no activation is run twice, and
each node's recorded gradient counts once. The engine computes that first step where the
node alone feeds those inputs (it then computes no activation gradient); where a value is
used twice (``x @ w @ w``) the node is called itself, which also recomputes its
activations' gradient.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.autograd.graph import GradientEdge, Node

from fxpipe.errors import StageError

__all__ = [
    "StageGraph",
    "autograd_nodes",
    "disjoint_param_groups",
    "stage_graph",
    "weight_gradients",
    "weight_side",
]

ParamGroup = dict[str, Any]


def disjoint_param_groups(groups: list[ParamGroup]) -> list[ParamGroup]:
    """``groups`` (torch's input part's, after it ran) with every two that share a Parameter
    or an intermediate merged, so that each Parameter and each node is in one group. Each
    merged group's ``grads`` stay aligned with its ``intermediates``; a group torch made
    without ``grads`` (no node it records received a gradient) keeps none."""
    parent = list(range(len(groups)))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    first_seen: dict[int, int] = {}
    for i, group in enumerate(groups):
        for node in (*group["params"], *group["intermediates"]):
            j = first_seen.setdefault(id(node), i)
            parent[root(i)] = root(j)
    members: dict[int, list[int]] = {}
    for i in range(len(groups)):
        members.setdefault(root(i), []).append(i)
    if all(len(m) == 1 for m in members.values()):
        return groups
    return [_merged([groups[i] for i in m]) for m in members.values()]


def _merged(parts: list[ParamGroup]) -> ParamGroup:
    """One group holding the Parameters and intermediates of ``parts``, each node once,
    with the gradient one of the parts recorded for it."""
    if len(parts) == 1:
        return parts[0]
    params: set[Any] = set().union(*(p["params"] for p in parts))
    intermediates: list[Any] = []
    grads: list[Any] = []
    index: dict[int, int] = {}
    for part in parts:
        recorded = part.get("grads") or [None] * len(part["intermediates"])
        for node, grad in zip(part["intermediates"], recorded, strict=True):
            if id(node) not in index:
                index[id(node)] = len(intermediates)
                intermediates.append(node)
                grads.append(grad)
            elif grads[index[id(node)]] is None:
                grads[index[id(node)]] = grad
    group: ParamGroup = {"params": params, "intermediates": intermediates}
    if any("grads" in p for p in parts):
        group["grads"] = grads
    return group


@dataclass(frozen=True)
class StageGraph:
    """What the weight part needs to know of a stage's autograd graph, taken before
    torch's input part detaches the stage's outputs."""

    #: Nodes whose backward reaches one of the stage's inputs.
    reaching: frozenset[Node]
    #: Inputs ``(node, index)`` of nodes that several edges feed (a value used twice).
    fed_twice: frozenset[tuple[Node, int]]


def stage_graph(outputs: Sequence[Any], inputs: Sequence[Any]) -> StageGraph:
    """The :class:`StageGraph` under a stage's ``outputs``, for its ``inputs``."""
    order = autograd_nodes(outputs, stop_at=inputs)
    reaching = set(_nodes(inputs))
    feeds: dict[tuple[Node, int], int] = {}
    for node in order:
        edges = [(fn, nr) for fn, nr in node.next_functions if fn is not None]
        for edge in edges:
            feeds[edge] = feeds.get(edge, 0) + 1
        if any(fn in reaching for fn, _ in edges):
            reaching.add(node)
    twice = frozenset(edge for edge, n in feeds.items() if n > 1)
    return StageGraph(frozenset(reaching), twice)


def weight_side(groups: list[ParamGroup], graph: StageGraph) -> list[ParamGroup]:
    """``groups`` (disjoint, each as torch's input part left it) with, per intermediate,
    the indices of its inputs (``next_functions``) no stage input reaches (where the
    Parameters' gradients leave the activations' backward), and whether it alone feeds
    them. Keeps no reference to the rest of the graph, which the input part frees."""
    for group in groups:
        sides = []
        for node in group["intermediates"]:
            side = tuple(
                k
                for k, (fn, _) in enumerate(node.next_functions)
                if fn is not None and fn not in graph.reaching
            )
            alone = not any(node.next_functions[k] in graph.fed_twice for k in side)
            sides.append((side, alone))
        group[WEIGHT_SIDE] = sides
    return groups


def weight_gradients(weights: Iterable[torch.Tensor], groups: list[ParamGroup]) -> None:
    """The weight part for ``groups`` (made by :func:`weight_side`): each Parameter's
    gradient added to its ``.grad``, as torch's weight part adds it. Each group's part of
    the graph is freed as it is run (the groups share no node)."""
    by_node = {node: w for w in weights if (node := _node_of(w)) is not None}
    for group in groups:
        found = _group_gradients(group, by_node)
        with torch.no_grad():
            for node, dw in found.items():
                weight = by_node[node]
                if weight.grad is None:  # a copy: dw may be a recorded gradient itself
                    weight.grad = dw.clone(memory_format=torch.contiguous_format)
                else:
                    weight.grad += dw
        group.pop("intermediates", None)
        group.pop("grads", None)


def _group_gradients(
    group: ParamGroup, by_node: dict[Node, torch.Tensor]
) -> dict[Node, torch.Tensor]:
    """One group's Parameter gradients, by accumulator node: each recorded node's backward
    into its weight side, then the engine from there to the Parameters."""
    direct: dict[Node, torch.Tensor] = {}  # weight-side inputs that are Parameters
    roots: dict[tuple[int, int], tuple[GradientEdge, torch.Tensor]] = {}
    recorded = group.get("grads") or [None] * len(group["intermediates"])
    for node, saved, (side, alone) in zip(
        group["intermediates"], recorded, group[WEIGHT_SIDE], strict=True
    ):
        if saved is None or not side:
            continue
        weight_edges = [node.next_functions[k] for k in side]
        for (fn, nr), grad in zip(
            weight_edges, _weight_side_gradients(node, saved, side, alone), strict=True
        ):
            if grad is None:
                continue
            if fn in by_node:
                direct[fn] = grad if fn not in direct else direct[fn] + grad
                continue
            edge, before = roots.get((id(fn), nr), (GradientEdge(fn, nr), None))
            roots[(id(fn), nr)] = (edge, grad if before is None else before + grad)
    found = dict(direct)
    params = [p for p in group["params"] if p in by_node]
    if roots and params:
        starts, grads = zip(*roots.values(), strict=True)
        dws = torch.autograd.grad(
            list(starts),
            [GradientEdge(p, 0) for p in params],
            grad_outputs=list(grads),
            allow_unused=True,
        )
        for p, dw in zip(params, dws, strict=True):
            if dw is not None:
                found[p] = dw if p not in found else found[p] + dw
    return found


#: The key :func:`weight_side` adds to each group.
WEIGHT_SIDE = "fxpipe_weight_side"


def _weight_side_gradients(
    node: Node, saved: tuple[Any, ...], side: tuple[int, ...], alone: bool
) -> list[torch.Tensor | None]:
    """The gradients ``node``'s backward passes to its inputs ``side``. Through the engine,
    which computes those alone, where ``node`` alone feeds them (else the engine would also
    run every path from ``node`` to them through the activations); else by calling the
    node, which computes every input's gradient."""
    edges = [(fn, nr) for fn, nr in (node.next_functions[k] for k in side) if fn is not None]
    if alone:
        given = [(i, g) for i, g in enumerate(saved) if g is not None]
        got = torch.autograd.grad(
            [GradientEdge(node, i) for i, _ in given],
            [GradientEdge(fn, nr) for fn, nr in edges],
            grad_outputs=[g for _, g in given],
            allow_unused=True,
        )
        return list(got)
    with torch.no_grad():
        out = _backward(node, saved)
    return [
        None if out[k] is None else _as_input(out[k], fn, nr)
        for k, (fn, nr) in zip(side, edges, strict=True)
    ]


def _backward(node: Node, saved: tuple[Any, ...]) -> tuple[Any, ...]:
    """``node``'s backward on the gradients it recorded: one per entry of its
    ``next_functions``. A custom autograd Function's backward gives one per argument of
    its forward; those of non-tensor arguments (None) are dropped where that is
    unambiguous, else StageError."""
    if callable(node):
        out = node(*saved)
        return out if isinstance(out, tuple) else (out,)
    raw = node.apply(*saved)  # type: ignore[attr-defined]
    raw = raw if isinstance(raw, tuple) else (raw,)
    extra = len(raw) - len(node.next_functions)
    if extra == 0:
        return raw
    if sum(g is None for g in raw) == extra:
        return tuple(g for g in raw if g is not None)
    raise StageError(
        f"a zero-bubble schedule splits this stage's backward at {node.name()}, a custom "
        f"autograd Function with {extra} non-tensor argument(s) whose backward returns "
        f"{len(raw)} gradients for {len(node.next_functions)} inputs, which cannot be "
        "lined up; pass its non-tensor arguments another way (a closure, an attribute) "
        "or use a schedule that does not split backward ('1f1b', 'interleaved1f1b')"
    )


def _as_input(grad: torch.Tensor, fn: Node, nr: int) -> torch.Tensor:
    """``grad`` as the engine hands it to input ``nr`` of ``fn``: summed over broadcast
    dimensions and cast to its dtype."""
    meta = fn._input_metadata[nr]
    if tuple(grad.shape) != tuple(meta.shape):
        grad = grad.sum_to_size(meta.shape)
    return grad if grad.dtype == meta.dtype else grad.to(meta.dtype)


def _node_of(t: torch.Tensor) -> Node | None:
    """The autograd node a tensor's gradient enters: its grad_fn, or a leaf's accumulator."""
    if t.grad_fn is not None:
        return t.grad_fn
    if not t.requires_grad:
        return None
    return t.view_as(t).grad_fn.next_functions[0][0]  # type: ignore[union-attr]


def _nodes(values: Sequence[Any]) -> list[Node]:
    return [
        n for v in values if isinstance(v, torch.Tensor) for n in [_node_of(v)] if n is not None
    ]


def autograd_nodes(outputs: Sequence[Any], stop_at: Sequence[Any] = ()) -> list[Node]:
    """The autograd nodes under the tensors among ``outputs``, down to (without) those of
    the tensors among ``stop_at`` (a stage's inputs), each after every node under it (no
    recursion: graphs are deep)."""
    order: list[Node] = []
    seen: set[Node] = set(_nodes(stop_at))
    stack = [(n, False) for n in _nodes(outputs)]
    while stack:
        node, done = stack.pop()
        if done:
            order.append(node)
            continue
        if node in seen:
            continue
        seen.add(node)
        stack.append((node, True))
        stack.extend((fn, False) for fn, _ in node.next_functions if fn is not None)
    return order
