"""What one node reads, writes and computes, in the terms the roofline prices.

Built from the values a run produced (real or fake tensors) or from the shapes
``torch.export`` recorded; either way every size is a concrete number.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._pytree import tree_flatten

from fxpipe.ir import NodeCost
from fxpipe.passes.ops import VIEW_OPS, mutated_input, op_name
from fxpipe.passes.price.roofline import Operand, Work, attribute_work, node_work

__all__ = [
    "Facts",
    "attribute",
    "aliases",
    "describe",
    "node_cost",
    "tensors",
    "attention_flops",
    "module_op",
]

_LOW_PRECISION = (torch.float16, torch.bfloat16)
#: Module classes whose op name is not their class name in snake case.
_MODULE_OPS = {
    "BatchNorm1d": "batch_norm",
    "BatchNorm2d": "batch_norm",
    "BatchNorm3d": "batch_norm",
    "SyncBatchNorm": "batch_norm",
    "LayerNorm": "layer_norm",
    "GroupNorm": "group_norm",
    "InstanceNorm1d": "instance_norm",
    "InstanceNorm2d": "instance_norm",
    "InstanceNorm3d": "instance_norm",
    "RMSNorm": "rms_norm",
    "GELU": "gelu",
    "SiLU": "silu",
    "Tanh": "tanh",
    "Sigmoid": "sigmoid",
    "Softmax": "softmax",
    "LogSoftmax": "log_softmax",
    "Dropout": "dropout",
    "Dropout1d": "dropout",
    "Dropout2d": "dropout",
    "Embedding": "embedding",
    "EmbeddingBag": "embedding_bag",
    "CrossEntropyLoss": "cross_entropy",
}
#: Size of a tensor: (elements, bytes).
Sizer = Callable[[torch.Tensor], tuple[int, int]]


@dataclass(frozen=True)
class Facts:
    """One node's reads and writes, forward; :meth:`work` adds the backward."""

    name: str
    #: Forward FLOP per unit ("matmul", "conv", "attention"), as counted.
    counted: Mapping[str, float]
    operands: tuple[Operand, ...]
    out_bytes: int
    out_numel: int
    #: Whether the output requires grad (a backward runs).
    backward: bool
    #: Whether every output aliases an input and nothing is written.
    view: bool
    low_precision: bool
    batched: bool
    #: Output positions per image, for a convolution (0 otherwise).
    pixels: int = 0

    def work(self) -> Work:
        """Forward and backward work of the node."""
        return node_work(
            self.name,
            self.counted,
            self.operands,
            self.out_bytes,
            self.out_numel,
            backward=self.backward,
            view=self.view,
            low_precision=self.low_precision,
            batched=self.batched,
            pixels=self.pixels,
        )

    @classmethod
    def of_node(
        cls,
        gm: fx.GraphModule,
        n: fx.Node,
        *,
        inputs: Sequence[tuple[fx.Node, Any]],
        out: Any,
        module: nn.Module | None,
        counted: Mapping[Any, int],
        batched: Callable[[fx.Node], bool] | bool,
        grad: Callable[[fx.Node, torch.Tensor], bool] | None = None,
        size: Sizer | None = None,
        alias: bool | None = None,
    ) -> Facts:
        """Facts of ``n`` given the values of its input nodes and its output. ``counted``:
        forward FLOP per aten op (FlopCounterMode's counts); ``batched(node)``: whether a
        value depends on the model input; ``grad(node, tensor)`` and ``size(tensor)``
        override ``tensor.requires_grad`` and its real size (for recorded shapes);
        ``alias`` whether the output aliases an input, where known better than from the
        tensors given."""
        sizer = size or _real_size
        needs_grad = grad or (lambda _, t: bool(t.requires_grad))
        is_batched = batched if callable(batched) else (lambda _: bool(batched))
        operands, reads = _operands(inputs, module, sizer, needs_grad, is_batched)
        written = tensors(out)
        out_numel, out_bytes = _total(written, sizer)
        units = _by_unit(n, counted, inputs, sizer)
        return cls(
            name=module_op(module) if module is not None else op_name(n),
            counted=units,
            operands=tuple(operands),
            out_bytes=out_bytes,
            out_numel=out_numel,
            backward=any(needs_grad(n, t) for t in written),
            view=(aliases(written, reads) if alias is None else alias or not written)
            and mutated_input(gm, n) is None,
            low_precision=any(t.dtype in _LOW_PRECISION for t in [*reads, *written]),
            batched=n.op == "placeholder" or any(is_batched(a) for a, _ in inputs),
            pixels=_pixels(written, sizer) if "conv" in units else 0,
        )


def attribute(value: Any, readers: int) -> Work:
    """The work of a ``get_attr`` of ``value`` read by ``readers`` nodes: gradients of the
    tensors in it that require grad are added to their ``.grad`` where it lives."""
    found = [t for t in tensors(value) if t.requires_grad]
    return attribute_work(sum(_real_size(t)[1] for t in found), bool(found), readers)


def module_op(module: nn.Module) -> str:
    """The op a leaf module does: ``BatchNorm2d`` -> ``"batch_norm"``, ``ReLU`` -> ``"relu"``."""
    kind = type(module).__name__
    return _MODULE_OPS.get(kind, kind.lower())


def _operands(
    inputs: Sequence[tuple[fx.Node, Any]],
    module: nn.Module | None,
    size: Sizer,
    grad: Callable[[fx.Node, torch.Tensor], bool],
    batched: Callable[[fx.Node], bool],
) -> tuple[list[Operand], list[torch.Tensor]]:
    seen: set[int] = set()
    operands: list[Operand] = []
    reads: list[torch.Tensor] = []
    for node, value in inputs:
        for t in tensors(value):
            if id(t) in seen:
                continue
            seen.add(id(t))
            reads.append(t)
            _, nbytes = size(t)
            fixed = not batched(node)
            operands.append(Operand(nbytes, grad(node, t), fixed, t.ndim >= 2))
    if module is not None:
        for t in [*module.parameters(), *module.buffers()]:
            nbytes = _real_size(t)[1]
            operands.append(Operand(nbytes, t.requires_grad, True, t.ndim >= 2, owned=True))
    return operands, reads


def _by_unit(
    n: fx.Node, counted: Mapping[Any, int], inputs: Sequence[tuple[fx.Node, Any]], size: Sizer
) -> dict[str, float]:
    """Forward FLOP per unit; attention by formula (FlopCounterMode misses it on CPU)."""
    if "scaled_dot_product" in op_name(n):
        qkv = [t for _, v in inputs for t in tensors(v)][:3]
        if len(qkv) == 3:
            return {"attention": float(attention_flops(qkv, size))}
    units: dict[str, float] = {}
    for op, flops in counted.items():
        label = str(op)
        unit = "conv" if "conv" in label else "attention" if "attention" in label else "matmul"
        units[unit] = units.get(unit, 0.0) + float(flops)
    return units


def _pixels(written: list[torch.Tensor], size: Sizer) -> int:
    """Positions per image and channel of a convolution's output (batch, channels, *map)."""
    if not written or written[0].ndim < 3:
        return 0
    return math.prod(_concrete_shape(written[0], size)[2:])


def aliases(written: list[torch.Tensor], reads: list[torch.Tensor]) -> bool:
    """Whether every tensor written shares memory with one read; True when nothing is
    written (a size query, a check): such a node costs what a view does."""
    if not written:
        return True
    if not reads:
        return False
    read = {_storage(t) for t in reads}
    return all(_storage(t) in read for t in written)


def _storage(t: torch.Tensor) -> Any:
    try:
        return StorageWeakRef(t.untyped_storage())  # type: ignore[no-untyped-call]
    except (NotImplementedError, RuntimeError):  # tensors without storage
        return id(t)


def _real_size(t: torch.Tensor) -> tuple[int, int]:
    numel = t.numel()
    return numel, numel * t.element_size()


def _total(found: Iterable[torch.Tensor], size: Sizer) -> tuple[int, int]:
    numel = nbytes = 0
    for t in found:
        e, b = size(t)
        numel, nbytes = numel + e, nbytes + b
    return numel, nbytes


def attention_flops(qkv: Sequence[Any], size: Sizer | None = None) -> int:
    """Forward FLOP of attention over ``q, k, v`` (two matrix products)."""
    q, k, v = qkv[0], qkv[1], qkv[2]
    sizer = size or _real_size
    shape = [int(d) for d in _concrete_shape(q, sizer)]
    keys = int(_concrete_shape(k, sizer)[-2])
    width_v = int(_concrete_shape(v, sizer)[-1])
    batch_heads = sizer(q)[0] // max(shape[-2] * shape[-1], 1)
    return int(2 * batch_heads * shape[-2] * keys * (shape[-1] + width_v))


def _concrete_shape(t: torch.Tensor, size: Sizer) -> list[int]:
    if size is _real_size:
        return [int(d) for d in t.shape]
    return [_hint(d) for d in t.shape]


def _hint(d: Any) -> int:
    if isinstance(d, torch.SymInt):
        return int(d.node.hint)
    return int(d)


def tensors(value: Any) -> list[torch.Tensor]:
    """The tensors in a (nested) value."""
    if isinstance(value, torch.Tensor):
        return [value]
    if value is None or isinstance(value, (int, float, bool, str, torch.SymInt)):
        return []
    leaves, _ = tree_flatten(value)
    return [x for x in leaves if isinstance(x, torch.Tensor)]


def describe(n: fx.Node, out: Any, cost: float, param_bytes: int) -> NodeCost:
    """The NodeCost of ``n`` from its output value."""
    found = tensors(out)
    return node_cost(
        n,
        cost,
        param_bytes,
        out_bytes=sum(t.numel() * t.element_size() for t in found),
        is_tensor=isinstance(out, torch.Tensor),
        grad=any(t.requires_grad for t in found),
    )


def node_cost(
    n: fx.Node, cost: float, param_bytes: int, *, out_bytes: int, is_tensor: bool, grad: bool
) -> NodeCost:
    """The NodeCost of ``n`` from the size and gradient of its output."""
    naming = n.op in ("get_attr", "placeholder", "output")
    saved = 0 if naming or op_name(n) in VIEW_OPS else out_bytes
    return NodeCost(
        cost=max(0.0, float(cost)),
        output_bytes=out_bytes,
        param_bytes=param_bytes,
        is_tensor=is_tensor,
        requires_grad=grad,
        saved_bytes=saved if grad else 0,
    )
