"""What the passes know about individual ops: names, views, in-place writes."""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

__all__ = ["COMPUTE_OPS", "VIEW_OPS", "OPERATOR_IN_PLACE", "op_name", "is_view", "mutated_input"]

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


def op_name(n: fx.Node) -> str:
    """A short name for what a node does: ``"linear"``, ``"view"``, ``"module"``."""
    target = n.target
    if isinstance(target, str):
        return target.rsplit(".", 1)[-1] if n.op != "call_module" else "module"
    if isinstance(target, torch._ops.OpOverload):
        return str(target._opname)
    return str(getattr(target, "__name__", target))


def is_view(n: fx.Node) -> bool:
    """Whether ``n``'s output may alias its first input (so writes to one reach the other)."""
    return n.op in ("call_function", "call_method") and op_name(n) in VIEW_OPS


def mutated_input(gm: fx.GraphModule, node: fx.Node) -> fx.Node | None:
    """The input ``node`` modifies in place, if any (``x.relu_()``, ``inplace=True``,
    mutable aten overloads)."""
    first = node.args[0] if node.args and isinstance(node.args[0], fx.Node) else None
    if first is None or node.op not in COMPUTE_OPS:
        return None
    if node.kwargs.get("inplace") is True:
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
