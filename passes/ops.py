"""What the passes know about individual ops: names, views, in-place writes."""

from __future__ import annotations

import operator
from operator import attrgetter

import torch
import torch.fx as fx

__all__ = [
    "COMPUTE_OPS",
    "VIEW_OPS",
    "is_check",
    "held_parameters",
    "OPERATOR_IN_PLACE",
    "op_name",
    "module_path",
    "is_view",
    "viewed_input",
    "ALIASES",
    "WRITES",
    "mutated_input",
    "state_change",
    "stateful_regions",
]

#: ``node.meta`` keys set by a run on fake tensors (``fxpipe.trace.aliasing``): the position in
#: ``node.all_input_nodes`` of an input the node's output shares memory with, and of an
#: input the node writes into.
ALIASES = "fxpipe_aliases"
WRITES = "fxpipe_writes"

#: fx opcodes that do work; placeholders, get_attr and output only name values.
COMPUTE_OPS = frozenset({"call_function", "call_method", "call_module"})

#: Ops whose output may share memory with their first input (or only reads metadata).
VIEW_OPS = frozenset(
    "view reshape flatten unflatten permute transpose t unsqueeze squeeze expand expand_as "
    "view_as getitem size dim chunk split unbind narrow select slice alias detach "
    "_unsafe_view sym_size numel getattr split_with_sizes movedim as_strided contiguous".split()
)


#: The operator module's in-place functions (``x += y`` on a tensor); its ``and_``, ``or_``
#: and ``not_`` end in an underscore but write nothing.
OPERATOR_IN_PLACE = frozenset(
    getattr(operator, name)
    for name in (
        "iadd", "isub", "imul", "imatmul", "itruediv", "ifloordiv", "imod", "ipow",
        "ilshift", "irshift", "iand", "ior", "ixor", "iconcat",
    )
)  # fmt: skip


#: Calls torch.export records that change interpreter-wide state (functorch transform
#: levels, autocast): each opens or closes a region that must run in one stage, in order.
_OPENS = ("_increment_nesting", "_enter_autocast")
_CLOSES = ("_decrement_nesting", "_exit_autocast")
#: ``torch._C._set_grad_enabled(mode)``: the first of a pair opens, the next one closes.
_TOGGLES = ("_set_grad_enabled",)


def state_change(n: fx.Node) -> str | None:
    """``"open"``, ``"close"`` or ``"toggle"`` when ``n`` changes interpreter-wide state
    (running it twice, or in another stage than the nodes after it, changes the result)."""
    if n.op != "call_function" or isinstance(n.target, torch._ops.OpOverload):
        return None
    name = str(getattr(n.target, "__name__", ""))
    if name.endswith(_OPENS):
        return "open"
    if name.endswith(_CLOSES):
        return "close"
    if name in _TOGGLES:
        return "toggle"
    return None


def stateful_regions(graph: fx.Graph) -> list[list[fx.Node]]:
    """Runs of nodes, in graph order, from a state change that opens a region to the one
    that closes it (nested regions join the outer one): every node between them runs under
    that state, so a region may not be split between stages."""
    regions: list[list[fx.Node]] = []
    current: list[fx.Node] = []
    depth, toggled = 0, False
    for node in graph.nodes:
        inside_before = depth > 0 or toggled
        change = state_change(node)
        if change == "open":
            depth += 1
        elif change == "close":
            depth = max(depth - 1, 0)
        elif change == "toggle":
            toggled = not toggled
        inside_after = depth > 0 or toggled
        if inside_before or inside_after:
            current.append(node)
        if current and not inside_after:
            regions.append(current)
            current = []
    if current:
        regions.append(current)
    return regions


def op_name(n: fx.Node) -> str:
    """A short name for what a node does: ``"linear"``, ``"view"``, ``"module"``."""
    target = n.target
    if isinstance(target, str):
        return target.rsplit(".", 1)[-1] if n.op != "call_module" else "module"
    if isinstance(target, torch._ops.OpOverload):
        return str(target._opname)
    return str(getattr(target, "__name__", target))


def module_path(node: fx.Node) -> str:
    """The module a node belongs to: its target for module calls, the owner of the attribute
    for ``get_attr``, else the innermost entry of ``nn_module_stack``; ``""`` at the root."""
    if node.op == "call_module":
        return str(node.target)
    if node.op == "get_attr":
        owner, _, _ = str(node.target).rpartition(".")
        return owner
    stack = node.meta.get("nn_module_stack")
    if stack and node.op in ("call_function", "call_method"):
        return str(list(stack.values())[-1][0])
    return ""


def is_view(n: fx.Node) -> bool:
    """Whether ``n``'s output may alias an input (so writes to one reach the other): by its
    op's name, or as a run on fake tensors saw it (a module that returns its input)."""
    if ALIASES in n.meta:
        return True
    return n.op in ("call_function", "call_method") and op_name(n) in VIEW_OPS


def viewed_input(n: fx.Node) -> fx.Node | None:
    """The input a view ``n`` may share memory with (its first argument, unless a run on
    fake tensors saw another)."""
    if ALIASES in n.meta:
        return n.all_input_nodes[int(n.meta[ALIASES])]
    first = n.args[0] if n.args else None
    return first if isinstance(first, fx.Node) else None


def mutated_input(gm: fx.GraphModule, node: fx.Node) -> fx.Node | None:
    """The input ``node`` modifies in place, if any (``x.relu_()``, ``inplace=True``,
    mutable aten overloads, ``x[i] = v``, and any call whose result nothing reads: a call
    kept only for its effect, such as a leaf function that adds into its argument, is taken
    to write into its first argument)."""
    if WRITES in node.meta:
        return node.all_input_nodes[int(node.meta[WRITES])]
    first = node.args[0] if node.args and isinstance(node.args[0], fx.Node) else None
    if first is None or node.op not in COMPUTE_OPS:
        return None
    if node.kwargs.get("inplace") is True or node.target is operator.setitem:
        return first
    if not node.users and not is_check(node):
        return first
    if node.op == "call_module":
        return first if getattr(gm.get_submodule(str(node.target)), "inplace", False) else None
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        for arg, value in zip(target._schema.arguments, node.args):
            if arg.alias_info is not None and arg.alias_info.is_write:
                return value if isinstance(value, fx.Node) else None
        return None
    if target in OPERATOR_IN_PLACE:
        return first
    if getattr(target, "__module__", None) in ("_operator", "operator"):
        return None  # and_, or_: named like in-place methods, but pure
    name = target if isinstance(target, str) else getattr(target, "__name__", "")
    if name.endswith("_") and not name.startswith("_"):
        return first
    return None


def is_check(node: fx.Node) -> bool:
    """An assertion fx records (``torch._assert``): it reads its argument, writes nothing."""
    return node.target is torch._assert or "assert" in op_name(node)


def held_parameters(gm: fx.GraphModule, node: fx.Node) -> list[torch.nn.Parameter]:
    """The Parameters ``node`` holds: a ``call_module``'s, or the one a ``get_attr`` reads."""
    if node.op == "call_module":
        return list(gm.get_submodule(str(node.target)).parameters())
    if node.op == "get_attr":
        value = attrgetter(str(node.target))(gm)
        return [value] if isinstance(value, torch.nn.Parameter) else []
    return []
