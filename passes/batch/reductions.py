"""Reductions over the batch inside the model (a loss from ``labels=``), computed exactly
over micro-batches: each micro-batch gives its partial sum and its count, one step joins them.

A model that returns ``loss = cross_entropy(logits, labels)`` returns one number for the
whole batch, which the micro-batches' numbers cannot be concatenated into. But every such
number the model computes from a sum over the batch is exact from partial sums: a mean is
a sum over a count, a loss with ``reduction="mean"`` is the same loss summed over the
weight of the targets it counts, and a size of the batch adds up over micro-batches.

:func:`split_reductions` cuts the graph there. The reductions that feed the model's
outputs (the *frontier*: a node that reads per-sample values and returns a value that does
not grow with the batch, :mod:`fxpipe.passes.batch.roles`) are rewritten into their partial
form and stay in the graph the stages run; their partial sums become extra outputs, joined
by summing. What the model computes after them (the division by the count, a weighted sum
of two losses, the division by a ``num_items_in_batch`` input) moves into a small graph,
:class:`fxpipe.ir.Finalize`, that runs once per call on the joined values.

A reduction whose partial form is not known here (a median, a product over the batch, a
sample picked out of it), and a graph that mixes a reduction over the batch back into
per-sample values (``x - x.mean(0)``), are refused: micro-batches could not give the
model's result.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from fxpipe.errors import PlanError
from fxpipe.ir import Finalize, Join
from fxpipe.passes.batch.losses import (
    CLASS_LOSSES,
    ENUM,
    Loss,
    batch_rows,
    broadcast,
    class_count,
    counts,
    dims_of,
    element_count,
    loss_of,
    reduced_count,
    where,
)
from fxpipe.passes.batch.roles import BatchRoles
from fxpipe.passes.ops import op_name
from fxpipe.passes.split.placement import retarget

__all__ = ["split_reductions"]


# ------------------------------------------------------------------ the pass


@dataclass
class _Cut:
    """The frontier of the reductions that feed the model's outputs, found on ``gm``."""

    #: Reductions over the batch, in graph order.
    frontier: list[fx.Node]
    #: Sizes of the batch the finishing step reads (they add up over micro-batches).
    sizes: list[fx.Node]
    #: Values read off per-sample ones that do not change with the batch (a dtype, a
    #: sequence length): every micro-batch gives the same.
    same: list[fx.Node]
    #: Nodes the finishing step recomputes (what follows the frontier, and what it reads
    #: that does not depend on the batch), in graph order.
    finish: list[fx.Node]
    #: Model inputs it reads (placeholders without a batch).
    inputs: list[fx.Node]


def split_reductions(
    gm: fx.GraphModule, roles: BatchRoles, names: Sequence[str]
) -> tuple[fx.GraphModule, Finalize | None]:
    """Cut ``gm`` where its outputs reduce over the batch (see the module docstring).

    ``names``: how the model names each output leaf, for messages. Returns ``gm`` itself and
    None when every output grows with the batch; else a new GraphModule whose outputs are
    the per-sample outputs, then the partial sums and counts, and the Finalize that joins
    them into the model's outputs. Raises PlanError for a reduction that micro-batches
    cannot give exactly. ``gm`` is not modified. What mixes the batch's samples is
    :func:`fxpipe.passes.batch.mixing.check_no_batch_mixing`'s to refuse, first.
    """
    output = _output(gm)
    leaves: list[Any] = list(output.args[0])  # type: ignore[arg-type]
    reduced = [
        i
        for i, leaf in enumerate(leaves)
        if not isinstance(leaf, fx.Node) or roles.of(leaf) != "batched" or roles.grows(leaf)
    ]
    if not any(isinstance(leaves[i], fx.Node) for i in reduced):
        return gm, None
    cut = _find_cut(gm, roles, [leaves[i] for i in reduced], names, reduced)
    for node in cut.frontier:
        _partial_kind(gm, node, names)  # refuse an unknown reduction before building
    return _build(gm, cut, leaves, reduced, names)


def _find_cut(
    gm: fx.GraphModule,
    roles: BatchRoles,
    starts: list[Any],
    names: Sequence[str],
    positions: list[int],
) -> _Cut:
    frontier: set[fx.Node] = set()
    sizes: set[fx.Node] = set()
    same: set[fx.Node] = set()
    finish: set[fx.Node] = set()
    inputs: set[fx.Node] = set()
    owner = {id(s): names[i] for s, i in zip(starts, positions, strict=True)}
    stack = [(s, owner[id(s)]) for s in starts if isinstance(s, fx.Node)]
    while stack:
        node, output = stack.pop()
        if any(node in group for group in (frontier, sizes, same, finish, inputs)):
            continue
        role = roles.of(node)
        tensor = roles.seen[node.name][0][0] if node.name in roles.seen else False
        reads_batch = any(roles.of(a) == "batched" for a in node.all_input_nodes)
        if node.op == "placeholder" or (role == "batched" and tensor):
            if role == "batched":  # only a reduction reads rows; it stops the walk first
                raise PlanError(
                    f"output {output} reads {where(node)} whole, a per-sample value; "
                    "return it batch-first, or pass chunks=1 to run whole batches"
                )
            inputs.add(node)
        elif role == "batched":
            if not roles.grows(node):
                raise PlanError(
                    f"output {output} depends on {where(node)}, a number that changes "
                    "with the batch size but is not proportional to it, so micro-batches "
                    "cannot add up to it; compute it outside the model, or pass chunks=1 "
                    "to run whole batches"
                )
            sizes.add(node)
        elif role == "reduced" and _reads_rows(node, roles):
            frontier.add(node)
        elif role == "static" and reads_batch:  # a dtype or a size read off a batch
            same.add(node)
        else:
            finish.add(node)
            stack.extend((a, output) for a in node.all_input_nodes)
    order = {n: k for k, n in enumerate(gm.graph.nodes)}

    def ordered(nodes: set[fx.Node]) -> list[fx.Node]:
        return sorted(nodes, key=order.__getitem__)

    cut = _Cut(ordered(frontier), ordered(sizes), ordered(same), ordered(finish), ordered(inputs))
    for node in cut.frontier:
        for user in node.users:
            if user.op != "output" and user not in finish:
                raise PlanError(
                    f"{where(node)} reduces over the batch and is read both by the model's "
                    f"outputs and by {user.name!r}; compute it outside the model, or pass "
                    "chunks=1 to run whole batches"
                )
    return cut


def _reads_rows(node: fx.Node, roles: BatchRoles) -> bool:
    """Whether ``node`` reads a per-sample tensor (it is where the batch is reduced away)."""
    return any(roles.of(a) == "batched" and roles.seen[a.name][0][0] for a in node.all_input_nodes)


def _partial_kind(gm: fx.GraphModule, node: fx.Node, names: Sequence[str]) -> str:
    """ "sum" (the node adds up over micro-batches as it is), "mean" or "loss" (rewritten
    into a sum and a count); PlanError for anything else."""
    name = op_name(node)
    if node.op in ("call_function", "call_method") and name in ("sum", "mean"):
        return name
    if node.op in ("call_function", "call_method") and counts(node):
        return "sum"
    loss = loss_of(gm, node)
    if loss is not None and loss.reduction in ("sum", "mean", "batchmean"):
        return "sum" if loss.reduction == "sum" else "loss"
    why = (
        f"a {loss.name} with reduction={loss.reduction!r}"
        if loss is not None
        else f"{where(node)}, an op whose result over a batch micro-batches cannot add up to"
    )
    outputs = ", ".join(_outputs_of(gm, node, names)) or "an output"
    raise PlanError(
        f"output {outputs} reduces over the batch through {node.name!r}: {why}; fxpipe "
        "computes sums, means and losses with reduction 'mean' or 'sum' over micro-batches "
        "exactly; return per-sample values (batch first) and reduce outside the model, or "
        "pass chunks=1 to run whole batches"
    )


def _outputs_of(gm: fx.GraphModule, node: fx.Node, names: Sequence[str]) -> list[str]:
    """The names of the model outputs that depend on ``node``."""
    output = _output(gm)
    reach: set[fx.Node] = set()
    stack = [node]
    while stack:
        n = stack.pop()
        if n not in reach:
            reach.add(n)
            stack.extend(n.users)
    leaves: list[Any] = list(output.args[0])  # type: ignore[arg-type]
    return [names[i] for i, leaf in enumerate(leaves) if leaf in reach]


# ------------------------------------------------------------------ building the two graphs


def _build(
    gm: fx.GraphModule,
    cut: _Cut,
    leaves: list[Any],
    reduced: list[int],
    names: Sequence[str],
) -> tuple[fx.GraphModule, Finalize]:
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    graph.graph_copy(gm.graph, env)
    batch_gm = fx.GraphModule(gm, graph, gm.__class__.__name__)
    kept = [i for i in range(len(leaves)) if i not in reduced]
    outputs: list[fx.Node] = [env[leaves[i]] for i in kept]
    joins: list[Join] = ["cat"] * len(kept)
    parts: dict[fx.Node, tuple[str, list[int]]] = {}
    for node in cut.frontier:
        kind, made = _rewrite(batch_gm, env[node], _partial_kind(gm, node, names))
        parts[node] = (kind, list(range(len(outputs), len(outputs) + len(made))))
        outputs += made
        joins += ["sum"] * len(made)
    for node in cut.sizes:
        parts[node] = ("sum", [len(outputs)])
        outputs.append(env[node])
        joins.append("sum")
    for node in cut.same:
        parts[node] = ("same", [len(outputs)])
        outputs.append(env[node])
        joins.append("same")
    graph.output(tuple(outputs))
    _drop_unused(graph, {env[n] for n in cut.finish})
    graph.lint()
    batch_gm.recompile()
    finish = _finish_graph(gm, cut, leaves, kept, parts, len(outputs))
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    return batch_gm, Finalize(
        graph_module=finish,
        joins=tuple(joins),
        inputs=tuple(placeholders.index(p) for p in cut.inputs),
        names=tuple(names),
        reduced=tuple(reduced),
    )


def _rewrite(gm: fx.GraphModule, node: fx.Node, kind: str) -> tuple[str, list[fx.Node]]:
    """``node`` in its partial form: ("sum", [node]) as it is; ("ratio", [sum, count]) for a
    mean or a mean loss, rewritten in place into the sum and followed by its count."""
    if kind == "sum":
        return "sum", [node]
    graph = gm.graph
    if kind == "mean":
        x = node.args[0] if node.args else node.kwargs["input"]
        dim = None
        if node.target is not torch.ops.aten.mean.default:
            dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
        _to_sum(node)
        with graph.inserting_before(node.next):
            count = graph.call_function(reduced_count, (x, dim))
        _set_val(count, lambda v, d: math.prod(v.shape[k] for k in dims_of(v, d)), x, dim)
        return "ratio", [node, count]
    loss = loss_of(gm, node)
    assert loss is not None
    _to_summedloss_of(gm, node, loss)
    with graph.inserting_before(node.next):
        count = _count_node(gm, node, loss)
    return "ratio", [node, count]


def _to_sum(node: fx.Node) -> None:
    """A mean node made the sum over the same dims (same keepdim and dtype)."""
    target = node.target
    if target is torch.ops.aten.mean.default:
        node.target = torch.ops.aten.sum.default
    elif target is torch.ops.aten.mean.dim:
        node.target = torch.ops.aten.sum.dim_IntList
    elif node.op == "call_method":
        node.target = "sum"
    else:
        node.target = torch.sum


def _to_summedloss_of(gm: fx.GraphModule, node: fx.Node, loss: Loss) -> None:
    """A loss node made to sum instead of average (same arguments otherwise)."""
    if loss.style == "enum":
        target = node.target
        assert isinstance(target, torch._ops.OpOverload)
        position = [a.name for a in target._schema.arguments].index("reduction")
        args = list(node.args)
        if position < len(args):
            args[position] = ENUM["sum"]
            node.args = tuple(args)
        else:
            node.kwargs = {**node.kwargs, "reduction": ENUM["sum"]}
    elif loss.style == "string":  # every torch.nn.functional loss takes keywords
        named = {**loss.args, "reduction": "sum"}
        named.update({k: None for k in ("size_average", "reduce") if k in named})
        node.args, node.kwargs = (), named
    else:  # a loss module: a copy that sums, holding the same weights
        module = gm.get_submodule(str(node.target))
        summing = type(module).__new__(type(module))
        summing.__dict__ = dict(module.__dict__)
        summing.__dict__["reduction"] = "sum"
        name = _free_name(gm, str(node.target).replace(".", "_") + "_summed")
        gm.add_submodule(name, summing)
        node.target = name


def _count_node(gm: fx.GraphModule, node: fx.Node, loss: Loss) -> fx.Node:
    """A node computing what ``loss``'s mean divides by, from ``node``'s own inputs."""
    graph = gm.graph
    x, target = _arg(node, loss, "input", 0), _arg(node, loss, "target", 1)
    if loss.reduction == "batchmean":
        count = graph.call_function(batch_rows, (x,))
        _set_val(count, lambda v: v.shape[0], x)
        return count
    if loss.name in CLASS_LOSSES:
        weight = loss.args.get("weight")
        if isinstance(weight, torch.Tensor):  # a loss module's weight buffer
            weight = graph.get_attr(f"{node.target}.weight")
        ignore = int(loss.args.get("ignore_index", -100))
        count = graph.call_function(class_count, (x, target, weight, ignore))
        _set_val(count, lambda v: v.new_empty(()), x)
        return count
    count = graph.call_function(element_count, (x, target))
    _set_val(count, lambda v, t: math.prod(broadcast(v.shape, t.shape)), x, target)
    return count


def _arg(node: fx.Node, loss: Loss, name: str, position: int) -> Any:
    if loss.style == "module":
        return node.args[position] if len(node.args) > position else node.kwargs[name]
    return loss.args[name]


def _set_val(node: fx.Node, fn: Callable[..., Any], *args: Any) -> None:
    """Record the new node's value, ``fn`` of its inputs' recorded ones (torch.export
    graphs), so that pricing still reads sizes instead of running the graph; nothing where
    they are not recorded."""
    try:
        values = fx.node.map_arg(args, lambda a: a.meta["val"])
        node.meta["val"] = fn(*values)
    except Exception:
        return


def _finish_graph(
    gm: fx.GraphModule,
    cut: _Cut,
    leaves: list[Any],
    kept: list[int],
    parts: dict[fx.Node, tuple[str, list[int]]],
    joined_count: int,
) -> fx.GraphModule:
    graph = fx.Graph()
    joined = [graph.placeholder(f"joined_{k}") for k in range(joined_count)]
    env: dict[fx.Node, Any] = {}
    for node in cut.inputs:
        env[node] = graph.placeholder(node.name)
    device = graph.placeholder("device")
    for node, (kind, at) in parts.items():  # "sum" and "same" come joined as they are
        if kind == "ratio":
            env[node] = graph.call_function(operator.truediv, (joined[at[0]], joined[at[1]]))
        else:
            env[node] = joined[at[0]]
    for node in cut.finish:
        copy = graph.node_copy(node, lambda a: env[a])
        copy.args, copy.kwargs = retarget(copy, copy.args, dict(copy.kwargs), device)
        env[node] = copy
        if node.op == "get_attr" and isinstance(_attribute(gm, node), torch.Tensor):
            env[node] = graph.call_method("to", (copy, device))
    results: list[Any] = []
    passed = iter(joined[: len(kept)])
    for i, leaf in enumerate(leaves):
        if i in kept:
            results.append(next(passed))
        else:
            results.append(env[leaf] if isinstance(leaf, fx.Node) else leaf)
    graph.output(tuple(results))
    graph.lint()
    return fx.GraphModule(gm, graph, "Finalize")


def _drop_unused(graph: fx.Graph, nodes: set[fx.Node]) -> None:
    """Erase ``nodes`` that nothing reads any more (last first)."""
    for node in reversed(list(graph.nodes)):
        if node in nodes and not node.users:
            graph.erase_node(node)


def _attribute(gm: fx.GraphModule, node: fx.Node) -> Any:
    value: Any = gm
    for part in str(node.target).split("."):
        value = getattr(value, part)
    return value


def _free_name(gm: fx.GraphModule, base: str) -> str:
    name, k = base, 1
    while hasattr(gm, name):
        name, k = f"{base}_{k}", k + 1
    return name


def _output(gm: fx.GraphModule) -> fx.Node:
    node: fx.Node = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    return node
