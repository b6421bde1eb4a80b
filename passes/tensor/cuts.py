"""What the rules of :mod:`fxpipe.passes.tensor.layouts` share: the op families they know,
what they read (:class:`Rules`), what they answer (a layout, :class:`Blocked` or None) and
how they read a node's arguments."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from fxpipe.passes.ops import op_name
from fxpipe.passes.tensor.records import Layout, Shard
from fxpipe.passes.tensor.values import Shape

__all__ = [
    "ELEMENTWISE",
    "CASTS",
    "VIEWS",
    "TRANSPOSES",
    "SPLITS",
    "SOFTMAX",
    "REDUCTIONS",
    "NORMS",
    "MATMULS",
    "ATTENTION_OPS",
    "SIZE_QUERIES",
    "ELEMENTWISE_MODULES",
    "Blocked",
    "Rules",
    "Result",
    "Rule",
    "base_name",
    "reads_attribute",
    "what",
    "cut_inputs",
    "shard_of",
    "arg",
    "dims_of",
]

#: Ops whose output is the same function of each element of their (broadcast) inputs.
ELEMENTWISE = frozenset(
    "add sub mul div true_divide truediv floordiv neg pow tanh silu gelu relu sigmoid exp "
    "log rsqrt sqrt abs erf sin cos square clamp clamp_min clamp_max where masked_fill "
    "dropout float half bfloat16 double clone contiguous alias "
    "detach maximum minimum rsub reciprocal softplus leaky_relu hardtanh elu mish hardswish "
    "hardsigmoid eq ne lt gt le ge and_ or_ invert bitwise_not logical_not logical_and "
    "__and__ __or__ __invert__ relu6 log1p expm1 lerp addcmul addcdiv fill".split()
)
#: Ops that change only the dtype or device of their first input.
CASTS = frozenset("to _to_copy type type_as".split())
VIEWS = frozenset(
    "view reshape _unsafe_view flatten unflatten view_as reshape_as unsqueeze squeeze".split()
)
TRANSPOSES = frozenset("transpose swapaxes permute t movedim".split())
SPLITS = frozenset("split split_with_sizes chunk unbind".split())
SOFTMAX = frozenset("softmax log_softmax _softmax _log_softmax".split())
REDUCTIONS = frozenset("sum mean amax amin max min var std norm logsumexp prod all any".split())
NORMS = frozenset("layer_norm rms_norm".split())
MATMULS = frozenset("matmul bmm mm".split())
#: Ops that compute attention from q, k, v cut along their heads.
ATTENTION_OPS = frozenset({"scaled_dot_product_attention"})
SIZE_QUERIES = frozenset("sym_size sym_numel sym_stride size dim numel stride".split())
ELEMENTWISE_MODULES: tuple[type[nn.Module], ...] = (
    nn.Dropout,
    nn.Dropout1d,
    nn.Dropout2d,
    nn.Identity,
    nn.GELU,
    nn.ReLU,
    nn.ReLU6,
    nn.SiLU,
    nn.Tanh,
    nn.Sigmoid,
    nn.LeakyReLU,
    nn.Mish,
    nn.ELU,
    nn.Hardswish,
    nn.Hardsigmoid,
    nn.Softplus,
)


@dataclass(frozen=True, slots=True)
class Blocked:
    """The op cannot compute its output from the pieces: ``reason`` says why."""

    reason: str


@dataclass(frozen=True)
class Rules:
    """What the rules read: the graph, tp, every node's output shape, and which outputs
    carry a gradient."""

    gm: fx.GraphModule
    tp: int
    shapes: Mapping[str, Shape]
    grads: frozenset[str] = frozenset()

    def size(self, node: object) -> torch.Size | None:
        """The sizes of a tensor-valued node, else None."""
        if not isinstance(node, fx.Node):
            return None
        shape = self.shapes.get(node.name)
        return shape if isinstance(shape, torch.Size) else None


#: A rule's answer: the output's layout, Blocked, or None (the node reads only sizes).
Result = Layout | Blocked | None
#: A rule: (node, the layouts of the cut values, what the rules read) -> its answer.
Rule = Callable[[fx.Node, Mapping[str, Layout], Rules], Result]


def base_name(name: str) -> str:
    """``relu`` for the in-place ``relu_`` (a piece is written in place as the whole is)."""
    return name[:-1] if name.endswith("_") and not name.startswith("_") else name


def reads_attribute(n: fx.Node) -> bool:
    return n.op == "call_function" and n.target is getattr


def what(n: fx.Node) -> str:
    op = op_name(n) if n.op != "call_module" else str(n.target)
    return n.name if n.name.startswith(op) else f"{n.name} ({op})"


def cut_inputs(n: fx.Node, layouts: Mapping[str, Layout]) -> str:
    return ", ".join(a.name for a in n.all_input_nodes if a.name in layouts) or "?"


def shard_of(node: object, layouts: Mapping[str, Layout]) -> Shard | None:
    if not isinstance(node, fx.Node):
        return None
    layout = layouts.get(node.name)
    return layout if isinstance(layout, Shard) else None


def arg(n: fx.Node, index: int, key: str, default: Any = None) -> Any:
    """Argument ``index`` (counting ``self`` of a method) or keyword ``key``."""
    if len(n.args) > index:
        return n.args[index]
    return n.kwargs.get(key, default)


def dims_of(n: fx.Node, start: int) -> list[Any]:
    """The dims of a ``permute``-like call, given as varargs or as one list."""
    rest: list[Any] = list(n.args[start:])
    if len(rest) == 1 and isinstance(rest[0], (list, tuple)):
        return list(rest[0])
    dims = n.kwargs.get("dims", ())
    return rest or (list(dims) if isinstance(dims, (list, tuple)) else [])
