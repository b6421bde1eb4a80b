"""The matrix products against a parameter and the embedding lookups of a graph, in every
form fxpipe's tracers leave them: ``nn.Linear`` calls, ``F.linear``, aten ``linear``,
``addmm``/``mm``/``matmul`` against a weight stored (in, out) (transformers' ``Conv1D``) or
transposed, ``nn.Embedding`` calls and ``embedding`` ops."""

from __future__ import annotations

from dataclasses import dataclass
from operator import attrgetter

import torch
import torch.fx as fx
from torch import nn

from fxpipe.passes.ops import op_name

__all__ = ["Product", "Embedding", "find_products", "find_embeddings", "param_readers"]


@dataclass(frozen=True, slots=True)
class Product:
    """``y = x @ W (+ b)`` at one node, ``W`` a parameter: the output's last dimension is
    W's ``out_dim``, the contracted one its ``in_dim``."""

    node: str
    #: The node of the activation ``x``.
    x: str
    weight: str
    bias: str | None
    out_dim: int
    in_features: int
    out_features: int

    @property
    def in_dim(self) -> int:
        return 1 - self.out_dim


@dataclass(frozen=True, slots=True)
class Embedding:
    """A lookup of rows of the parameter ``weight`` by the indices ``ids`` at one node."""

    node: str
    ids: str
    weight: str
    rows: int


_LINEAR = frozenset({"linear"})
_ADDMM = frozenset({"addmm"})
_MM = frozenset({"mm", "matmul"})


def find_products(gm: fx.GraphModule) -> dict[str, Product]:
    """Node name -> the product it computes, for every node that multiplies an activation
    by a 2-D parameter."""
    out: dict[str, Product] = {}
    for n in gm.graph.nodes:
        found = _product(gm, n)
        if found is not None:
            out[n.name] = found
    return out


def _product(gm: fx.GraphModule, n: fx.Node) -> Product | None:
    if n.op == "call_module":
        module = gm.get_submodule(str(n.target))
        if type(module).forward is not nn.Linear.forward or not n.args:
            return None
        assert isinstance(module, nn.Linear)
        held = f"{n.target}.bias" if module.bias is not None else None
        return _made(n, n.args[0], f"{n.target}.weight", False, held, module.weight.shape, 0)
    if n.op not in ("call_function", "call_method"):
        return None
    name, args = op_name(n), list(n.args)
    if name in _LINEAR and len(args) >= 2:
        x, w, b = args[0], args[1], args[2] if len(args) > 2 else n.kwargs.get("bias")
        out_dim = 0
    elif name in _ADDMM and len(args) == 3 and not n.kwargs:
        b, x, w = args
        out_dim = 1
    elif name in _MM and len(args) == 2 and not n.kwargs:
        x, w = args
        b, out_dim = None, 1
    else:
        return None
    behind = _param_behind(gm, w)
    bias = _param(gm, b) if isinstance(b, fx.Node) else None
    if behind is None or (b is not None and bias is None):
        return None
    fqn, transposed = behind
    shape = attrgetter(fqn)(gm).shape
    return _made(n, x, fqn, transposed, bias, shape, out_dim)


def _made(
    n: fx.Node,
    x: object,
    weight: str,
    transposed: bool,
    bias: str | None,
    shape: tuple[int, ...],
    out_dim: int,
) -> Product | None:
    if not isinstance(x, fx.Node) or len(shape) != 2:
        return None
    out_dim = 1 - out_dim if transposed else out_dim
    return Product(n.name, x.name, weight, bias, out_dim, shape[1 - out_dim], shape[out_dim])


def _param(gm: fx.GraphModule, node: fx.Node) -> str | None:
    """The name of the parameter a ``get_attr`` node reads, else None."""
    if node.op != "get_attr":
        return None
    value = attrgetter(str(node.target))(gm)
    return str(node.target) if isinstance(value, nn.Parameter) else None


def _param_behind(gm: fx.GraphModule, node: object) -> tuple[str, bool] | None:
    """(parameter name, whether the node transposes it) for a 2-D parameter read directly
    or through one transpose (``t``, ``transpose(0, 1)``, ``permute(1, 0)``, ``.T``)."""
    if not isinstance(node, fx.Node):
        return None
    direct = _param(gm, node)
    if direct is not None:
        return direct, False
    if node.op not in ("call_function", "call_method") or not node.args:
        return None
    inner = node.args[0]
    if not isinstance(inner, fx.Node) or _param(gm, inner) is None:
        return None
    name, rest = op_name(node), [a for a in node.args[1:]]
    flat = rest[0] if len(rest) == 1 and isinstance(rest[0], (list, tuple)) else rest
    axes = sorted(int(a) % 2 for a in rest if isinstance(a, int))
    swaps = (
        (name == "t" and not rest)
        or (name == "transpose" and axes == [0, 1])
        or (name == "permute" and list(flat) == [1, 0])
        or (name == "getattr" and rest == ["T"])
    )
    return (str(_param(gm, inner)), True) if swaps else None


def find_embeddings(gm: fx.GraphModule) -> dict[str, Embedding]:
    """Node name -> the lookup it makes, for every embedding of a parameter (not those that
    renormalise rows in place, ``max_norm``)."""
    out: dict[str, Embedding] = {}
    for n in gm.graph.nodes:
        if n.op == "call_module":
            module = gm.get_submodule(str(n.target))
            if type(module) is nn.Embedding and module.max_norm is None and n.args:
                ids, weight = n.args[0], f"{n.target}.weight"
            else:
                continue
        elif n.op == "call_function" and op_name(n) == "embedding":
            aten = isinstance(n.target, torch._ops.OpOverload)  # embedding(weight, indices)
            ids, w = (n.args[1], n.args[0]) if aten else (n.args[0], n.args[1])
            if n.kwargs.get("max_norm") is not None or not isinstance(w, fx.Node):
                continue
            found = _param(gm, w)
            if found is None:
                continue
            weight = found
        else:
            continue
        if isinstance(ids, fx.Node):
            rows = int(attrgetter(weight)(gm).shape[0])
            out[n.name] = Embedding(n.name, ids.name, weight, rows)
    return out


def param_readers(gm: fx.GraphModule) -> dict[str, list[str]]:
    """Parameter name -> the nodes that read it: a ``get_attr``'s users (through the
    transposes a product reads a weight by), and the calls of the modules that hold it."""
    out: dict[str, list[str]] = {}
    for n in gm.graph.nodes:
        if n.op == "get_attr":
            name = _param(gm, n)
            if name is None:
                continue
            for user in n.users:
                through = [u.name for u in user.users] if _param_behind(gm, user) else []
                out.setdefault(name, []).extend(through or [user.name])
        elif n.op == "call_module":
            module = gm.get_submodule(str(n.target))
            for local, _ in module.named_parameters():
                out.setdefault(f"{n.target}.{local}", []).append(n.name)
    return out
