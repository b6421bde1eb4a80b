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

import inspect
import math
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn
from torch.nn import _reduction as legacy

from fxpipe.errors import PlanError
from fxpipe.ir import Finalize, Join
from fxpipe.passes.batch.grouping import RowGrouping, row_grouping
from fxpipe.passes.batch.roles import SHAPE_ONLY_OPS, BatchRoles
from fxpipe.passes.ops import op_name
from fxpipe.passes.split.placement import retarget

__all__ = ["split_reductions", "check_no_batch_mixing", "class_count", "element_count"]


# ------------------------------------------------------------------ counts the stages compute


def reduced_count(x: torch.Tensor, dim: Any = None) -> int:
    """How many elements of ``x`` a mean over ``dim`` (None or []: all) averages."""
    return int(math.prod(x.shape[d] for d in _dims(x, dim)))


def _dims(x: torch.Tensor, dim: Any) -> list[int]:
    if dim is None or (isinstance(dim, (list, tuple)) and len(dim) == 0):
        return list(range(x.ndim))
    return [dim] if isinstance(dim, int) else list(dim)


def class_count(
    input: torch.Tensor, target: torch.Tensor, weight: torch.Tensor | None, ignore_index: int
) -> torch.Tensor:
    """What ``cross_entropy``'s and ``nll_loss``'s mean divides by: the summed class weight
    of the targets not ignored (their number without weights); for targets given as
    probabilities, the number of samples (every position but the class dimension)."""
    if target.is_floating_point():
        classes = input.shape[1] if input.ndim > 1 else input.shape[0]
        return torch.tensor(input.numel() // classes, dtype=input.dtype, device=input.device)
    keep = target != ignore_index
    if weight is None:
        return keep.sum().to(input.dtype)
    picked = weight.to(input.dtype)[torch.where(keep, target, 0)]
    return (picked * keep).sum()


def element_count(input: torch.Tensor, target: torch.Tensor) -> int:
    """What an element-wise loss's mean divides by: the elements of input and target
    broadcast together."""
    return int(math.prod(_broadcast(input.shape, target.shape)))


def _broadcast(a: Sequence[Any], b: Sequence[Any]) -> list[Any]:
    """The shape ``a`` and ``b`` broadcast to (sizes may be symbolic)."""
    n = max(len(a), len(b))
    a, b = [1] * (n - len(a)) + list(a), [1] * (n - len(b)) + list(b)
    return [y if x == 1 else x for x, y in zip(a, b, strict=True)]


def batch_rows(input: torch.Tensor) -> int:
    """What ``kl_div(..., reduction="batchmean")`` divides by: the input's first size."""
    return int(input.shape[0]) if input.ndim else 1


# ------------------------------------------------------------------ which reductions are known

#: aten loss ops (torch.export) and torch.nn.functional losses (torch.fx), by name.
_CLASS_LOSSES = frozenset({"cross_entropy_loss", "nll_loss_nd", "cross_entropy", "nll_loss"})
_ELEMENT_LOSSES = frozenset(
    "mse_loss l1_loss smooth_l1_loss huber_loss binary_cross_entropy "
    "binary_cross_entropy_with_logits kl_div soft_margin_loss".split()
)
#: Loss modules (torch.fx leaves) -> the functional they compute.
_LOSS_MODULES: dict[type[nn.Module], Callable[..., Any]] = {
    nn.CrossEntropyLoss: F.cross_entropy,
    nn.NLLLoss: F.nll_loss,
    nn.MSELoss: F.mse_loss,
    nn.L1Loss: F.l1_loss,
    nn.SmoothL1Loss: F.smooth_l1_loss,
    nn.HuberLoss: F.huber_loss,
    nn.BCELoss: F.binary_cross_entropy,
    nn.BCEWithLogitsLoss: F.binary_cross_entropy_with_logits,
    nn.KLDivLoss: F.kl_div,
    nn.SoftMarginLoss: F.soft_margin_loss,
}
_ENUM = {"none": 0, "mean": 1, "sum": 2}


@dataclass(frozen=True)
class _Loss:
    """A loss node's arguments by name, and how its reduction is written."""

    name: str
    args: dict[str, Any]
    #: "enum" (aten: 0/1/2), "string" (torch.nn.functional), "module" (a loss module).
    style: str
    reduction: str


def _loss(gm: fx.GraphModule, node: fx.Node) -> _Loss | None:
    """The loss ``node`` computes, with its arguments by name; None for anything else."""
    args: dict[str, Any]
    if node.op == "call_module":
        module = gm.get_submodule(str(node.target))
        functional = _LOSS_MODULES.get(type(module))
        if functional is None:
            return None
        params = list(inspect.signature(type(module).forward).parameters)[1:]
        args = dict(zip(params, node.args))
        args.update(node.kwargs)
        for extra in ("weight", "ignore_index", "label_smoothing", "pos_weight"):
            if hasattr(module, extra):
                args[extra] = getattr(module, extra)
        return _Loss(functional.__name__, args, "module", str(module.reduction))
    name = op_name(node)
    if node.op != "call_function" or name not in _CLASS_LOSSES | _ELEMENT_LOSSES:
        return None
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        schema = list(target._schema.arguments)
        args = {a.name: a.default_value for a in schema if a.has_default_value()}
        args.update(zip((a.name for a in schema), node.args))
        args.update(node.kwargs)
        args["input"] = args.pop("self")
        reduction = {v: k for k, v in _ENUM.items()}.get(int(args["reduction"]), "?")
        return _Loss(name, args, "enum", reduction)
    try:
        bound = inspect.signature(target).bind(*node.args, **node.kwargs)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None
    bound.apply_defaults()
    args = dict(bound.arguments)
    if args.get("size_average") is not None or args.get("reduce") is not None:
        reduction = legacy.legacy_get_string(args.get("size_average"), args.get("reduce"))
    else:
        reduction = str(args.get("reduction", "mean"))
    return _Loss(name, args, "string", reduction)


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
    :func:`check_no_batch_mixing`'s to refuse, first.
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


def check_no_batch_mixing(gm: fx.GraphModule, roles: BatchRoles) -> RowGrouping:
    """PlanError where a per-sample value is computed from a reduction over the batch
    (``x - x.mean(0)``, ``h + x[0]``) or scaled by the batch size (``x / x.shape[0]``):
    each micro-batch would use its own, so the result would differ from the model's. A
    grouped product reading the offsets of the rows it groups is not such a value
    (:mod:`fxpipe.passes.batch.grouping`). Returns what the grouping analysis found: the ops
    along the batch's rows that mix it (a router's capacity over the whole batch), which
    micro-batches each compute on their own rows."""
    grouping = row_grouping(gm, roles)
    for node in gm.graph.nodes:
        if node.op in ("output", "placeholder", "get_attr") or roles.of(node) != "batched":
            continue
        if op_name(node) in SHAPE_ONLY_OPS or not roles.seen[node.name][0][0]:
            continue
        for arg in node.all_input_nodes:
            if node.name in grouping.grouped and arg.name in grouping.grouping:
                continue  # the offsets of the rows it groups: each row by its own key
            if roles.of(arg) == "reduced":
                raise PlanError(
                    f"{_where(node)} computes per-sample values from {arg.name!r} "
                    f"({_where(arg)}), which depends on the whole batch: each micro-batch "
                    "would use its own; compute it outside the model, or pass chunks=1 to "
                    "run whole batches"
                )
        if op_name(node) in _SCALING and _scaled_by_batch(node, roles):
            raise PlanError(
                f"{_where(node)} scales per-sample values by the batch size: each "
                "micro-batch would use its own size; compute it outside the model, or pass "
                "chunks=1 to run whole batches"
            )
    return grouping


_SCALING = frozenset({"mul", "div", "true_divide", "truediv", "floordiv", "floor_divide"})


def _scaled_by_batch(node: fx.Node, roles: BatchRoles) -> bool:
    return any(
        not roles.seen[a.name][0][0] and roles.grows(a)
        for a in node.all_input_nodes
        if roles.of(a) == "batched"
    )


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
                    f"output {output} reads {_where(node)} whole, a per-sample value; "
                    "return it batch-first, or pass chunks=1 to run whole batches"
                )
            inputs.add(node)
        elif role == "batched":
            if not roles.grows(node):
                raise PlanError(
                    f"output {output} depends on {_where(node)}, a number that changes "
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
                    f"{_where(node)} reduces over the batch and is read both by the model's "
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
    if node.op in ("call_function", "call_method") and _counts(node):
        return "sum"
    loss = _loss(gm, node)
    if loss is not None and loss.reduction in ("sum", "mean", "batchmean"):
        return "sum" if loss.reduction == "sum" else "loss"
    why = (
        f"a {loss.name} with reduction={loss.reduction!r}"
        if loss is not None
        else f"{_where(node)}, an op whose result over a batch micro-batches cannot add up to"
    )
    outputs = ", ".join(_outputs_of(gm, node, names)) or "an output"
    raise PlanError(
        f"output {outputs} reduces over the batch through {node.name!r}: {why}; fxpipe "
        "computes sums, means and losses with reduction 'mean' or 'sum' over micro-batches "
        "exactly; return per-sample values (batch first) and reduce outside the model, or "
        "pass chunks=1 to run whole batches"
    )


#: Ops that add a batch's rows into bins of a fixed table (a router's tokens per expert).
_ADDS_INTO = frozenset({"scatter_add", "scatter_add_", "index_add", "index_add_"})
#: Ops that make a table of zeros.
_ZEROS = frozenset({"zeros", "zeros_like", "new_zeros"})


def _counts(node: fx.Node) -> bool:
    """Whether ``node`` is a histogram of the batch over a fixed range (``histc`` with
    ``min < max``: each micro-batch's counts add up to the batch's), or adds the batch's rows
    into a table of zeros (``zeros(E).scatter_add_(0, expert, weight)``: the same sum)."""
    name = op_name(node)
    if name == "histc":
        low = node.args[2] if len(node.args) > 2 else node.kwargs.get("min", 0)
        high = node.args[3] if len(node.args) > 3 else node.kwargs.get("max", 0)
        if isinstance(low, int | float) and isinstance(high, int | float):
            return bool(low < high)
        return False
    if name in _ADDS_INTO:
        table = node.args[0] if node.args else node.kwargs.get("input")
        return isinstance(table, fx.Node) and op_name(table) in _ZEROS
    return False


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
        _set_val(count, lambda v, d: math.prod(v.shape[k] for k in _dims(v, d)), x, dim)
        return "ratio", [node, count]
    loss = _loss(gm, node)
    assert loss is not None
    _to_summed_loss(gm, node, loss)
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


def _to_summed_loss(gm: fx.GraphModule, node: fx.Node, loss: _Loss) -> None:
    """A loss node made to sum instead of average (same arguments otherwise)."""
    if loss.style == "enum":
        target = node.target
        assert isinstance(target, torch._ops.OpOverload)
        position = [a.name for a in target._schema.arguments].index("reduction")
        args = list(node.args)
        if position < len(args):
            args[position] = _ENUM["sum"]
            node.args = tuple(args)
        else:
            node.kwargs = {**node.kwargs, "reduction": _ENUM["sum"]}
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


def _count_node(gm: fx.GraphModule, node: fx.Node, loss: _Loss) -> fx.Node:
    """A node computing what ``loss``'s mean divides by, from ``node``'s own inputs."""
    graph = gm.graph
    x, target = _arg(node, loss, "input", 0), _arg(node, loss, "target", 1)
    if loss.reduction == "batchmean":
        count = graph.call_function(batch_rows, (x,))
        _set_val(count, lambda v: v.shape[0], x)
        return count
    if loss.name in _CLASS_LOSSES:
        weight = loss.args.get("weight")
        if isinstance(weight, torch.Tensor):  # a loss module's weight buffer
            weight = graph.get_attr(f"{node.target}.weight")
        ignore = int(loss.args.get("ignore_index", -100))
        count = graph.call_function(class_count, (x, target, weight, ignore))
        _set_val(count, lambda v: v.new_empty(()), x)
        return count
    count = graph.call_function(element_count, (x, target))
    _set_val(count, lambda v, t: math.prod(_broadcast(v.shape, t.shape)), x, target)
    return count


def _arg(node: fx.Node, loss: _Loss, name: str, position: int) -> Any:
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


def _where(node: fx.Node) -> str:
    """``'mean_1' (aten.mean.dim in module 'head')``: a node as a message names it."""
    stack = node.meta.get("nn_module_stack")
    module = str(list(stack.values())[-1][0]) if stack else ""
    if node.op == "call_module":
        module = str(node.target)
    what = op_name(node)
    return f"{node.name!r} ({what}{f' in module {module!r}' if module else ''})"
