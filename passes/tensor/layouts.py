"""How a cut travels through one op: the layout of a node's output from the layouts of its
inputs, or why the op cannot run on each rank's pieces alone.

An op keeps a cut local when each rank can compute its piece of the output from its pieces
of the inputs and the whole values of the others, with no communication: element-wise ops
(a whole operand must broadcast along the cut dimension), views that keep the cut whole in
one dimension (a head split: the head count must divide by tp), transposes, splits and
concatenations along another dimension, softmax and reductions over another dimension,
norms over trailing dimensions, batched matrix products with the cut in a batch dimension
or a free one, and scaled-dot-product attention cut along its heads. Anything else is
blocked: the planner then leaves the products that feed it whole.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch.fx as fx
from torch import nn

from fxpipe.passes.ops import is_check, op_name
from fxpipe.passes.tensor.cuts import (
    ATTENTION_OPS,
    CASTS,
    ELEMENTWISE,
    ELEMENTWISE_MODULES,
    MATMULS,
    NORMS,
    REDUCTIONS,
    SIZE_QUERIES,
    SOFTMAX,
    Blocked,
    Result,
    Rule,
    Rules,
    arg,
    base_name,
    cut_inputs,
    reads_attribute,
    shard_of,
    what,
)
from fxpipe.passes.tensor.records import Layout, Shard
from fxpipe.passes.tensor.reshapes import RESHAPE_RULES

__all__ = ["follow"]


def follow(n: fx.Node, layouts: Mapping[str, Layout], rules: Rules) -> Result:
    """The layout of ``n``'s output when the inputs named in ``layouts`` are cut as said
    there (the others whole): a Layout, Blocked, or None where ``n`` reads only sizes,
    dtypes or checks (it computes nothing from the pieces)."""
    name = op_name(n)
    if is_check(n) or name in SIZE_QUERIES or reads_attribute(n):
        return None
    if n.op == "output" or n.op not in ("call_function", "call_method", "call_module"):
        return Blocked(f"the cut value {cut_inputs(n, layouts)} leaves the graph whole")
    rule = _module_rule(n, rules) if n.op == "call_module" else _RULES.get(base_name(name))
    if rule is None:
        return Blocked(f"{what(n)} is not known to keep a cut local")
    return rule(n, layouts, rules)


def _elementwise(n: fx.Node, layouts: Mapping[str, Layout], rules: Rules) -> Result:
    out = rules.size(n)
    if out is None:
        return Blocked(f"{what(n)} has no tensor output")
    target: Shard | None = None
    inputs = [(a, rules.size(a)) for a in n.all_input_nodes]
    for a, size in inputs:
        shard = shard_of(a, layouts)
        if shard is None or size is None:
            continue
        here = Shard(shard.dim + len(out) - len(size), shard.blocks)
        if target is not None and here != target:
            return Blocked(f"{what(n)} combines values cut along different dimensions")
        target = here
    if target is None:
        return Blocked(f"{what(n)} reads a cut value it cannot combine")
    for a, size in inputs:
        if size is None or a.name in layouts:
            continue
        d = target.dim - (len(out) - len(size))
        if d >= 0 and size[d] != 1:
            return Blocked(
                f"{what(n)} combines the cut features with {a.name}, which is whole along "
                f"that dimension ({size[d]}): it would need the whole value"
            )
    return target


def _cast(n: fx.Node, layouts: Mapping[str, Layout], rules: Rules) -> Result:
    shard = shard_of(n.args[0], layouts)
    return shard if shard is not None else Blocked(f"{what(n)} casts a value it cannot follow")


def _softmax(n: fx.Node, layouts: Mapping[str, Layout], rules: Rules) -> Result:
    shard, a = shard_of(n.args[0], layouts), rules.size(n.args[0])
    dim = arg(n, 1, "dim")
    if shard is None or a is None or not isinstance(dim, int):
        return Blocked(f"{what(n)}: dimension not understood")
    if dim % len(a) == shard.dim:
        return Blocked(f"{what(n)} normalises over the cut dimension")
    return shard


def _reduction(n: fx.Node, layouts: Mapping[str, Layout], rules: Rules) -> Result:
    shard, a = shard_of(n.args[0], layouts), rules.size(n.args[0])
    dim = arg(n, 1, "dim")
    if shard is None or a is None or dim is None or isinstance(dim, fx.Node):
        return Blocked(f"{what(n)} reduces over every dimension, the cut one included")
    dims = {int(d) % len(a) for d in (dim if isinstance(dim, (list, tuple)) else [dim])}
    if shard.dim in dims and _norm_statistic(n):
        return Blocked(
            f"{what(n)} normalises over the cut features (a norm over every head, as OLMo2's "
            "q and k norms): its statistic would need every rank's part"
        )
    if shard.dim in dims:
        return Blocked(f"{what(n)} reduces over the cut dimension (a partial result)")
    out = rules.size(n)
    if out is None:
        return Blocked(f"{what(n)} returns several values")
    keep = len(out) == len(a)
    return shard if keep else Shard(shard.dim - sum(d < shard.dim for d in dims), shard.blocks)


def _norm_statistic(n: fx.Node, depth: int = 3) -> bool:
    """Whether reduction ``n`` is a norm's statistic: a root of it is taken within ``depth``
    ops (``x * rsqrt(mean(x^2) + eps)``, as a model writes a norm out)."""
    if depth == 0:
        return False
    return any(op_name(u) in ("rsqrt", "sqrt") or _norm_statistic(u, depth - 1) for u in n.users)


def _norm(n: fx.Node, layouts: Mapping[str, Layout], rules: Rules) -> Result:
    shard, a = shard_of(n.args[0], layouts), rules.size(n.args[0])
    shape = arg(n, 1, "normalized_shape")
    if shard is None or a is None or not isinstance(shape, (list, tuple)):
        return Blocked(f"{what(n)}: normalised shape not understood")
    if shard.dim >= len(a) - len(shape):
        return Blocked(f"{what(n)} normalises over the cut features")
    return _elementwise(n, layouts, rules)


def _matmul(n: fx.Node, layouts: Mapping[str, Layout], rules: Rules) -> Result:
    x, y = n.args[0], n.args[1]
    a, b, out = rules.size(x), rules.size(y), rules.size(n)
    if a is None or b is None or out is None or len(a) < 2 or len(b) < 2:
        return Blocked(f"{what(n)}: operands not understood")
    found: list[Shard] = []
    for node, size, free, contracted in ((x, a, -2, -1), (y, b, -1, -2)):
        shard = shard_of(node, layouts)
        if shard is None:
            continue
        if shard.dim == len(size) + contracted:
            return Blocked(f"{what(n)} contracts the cut dimension (a partial sum)")
        at = len(out) + free if shard.dim == len(size) + free else shard.dim + len(out) - len(size)
        found.append(Shard(at, shard.blocks))
    if not found or any(s != found[0] for s in found):
        return Blocked(f"{what(n)} multiplies values cut along different dimensions")
    target = found[0]
    if target.dim < len(out) - 2:  # a batch dimension: a whole operand must broadcast
        for node, size in ((x, a), (y, b)):
            d = target.dim - (len(out) - len(size))
            if shard_of(node, layouts) is None and d >= 0 and size[d] != 1:
                return Blocked(f"{what(n)} multiplies the cut heads by {node}, whole there")
    elif len(found) > 1:
        return Blocked(f"{what(n)} would cut both of its free dimensions")
    return target


def _attention(n: fx.Node, layouts: Mapping[str, Layout], rules: Rules) -> Result:
    names = ("query", "key", "value")
    qkv = [arg(n, i, key) for i, key in enumerate(names)]
    shards = [shard_of(v, layouts) for v in qkv]
    sizes = [rules.size(v) for v in qkv]
    for value, shard, size, key in zip(qkv, shards, sizes, names):
        if shard is None or size is None or shard.dim != len(size) - 3:
            return Blocked(
                f"{what(n)}: its {key} ({value}) is not cut along its heads as the others are"
            )
    blocks = [s.blocks for s in shards if s is not None]
    if len(set(blocks)) != 1:
        return Blocked(
            f"{what(n)}: query, key and value come from a fused product in unequal parts "
            f"({', '.join(map(str, blocks))} of its {sum(blocks)}, grouped key/value heads): "
            "no placement of its weight gives each rank its query heads beside their key and "
            "value heads"
        )
    first = shards[0]
    assert first is not None
    mask = arg(n, 3, "attn_mask")
    size = rules.size(mask)
    if size is not None and mask.name not in layouts:
        d = len(size) - 3
        if d >= 0 and size[d] != 1:
            return Blocked(f"{what(n)}: its mask {mask} holds every head whole")
    elif size is not None and shard_of(mask, layouts) != first:
        return Blocked(f"{what(n)}: its mask is cut otherwise than its heads")
    return first


def _module_rule(n: fx.Node, rules: Rules) -> Rule | None:
    module = rules.gm.get_submodule(str(n.target))
    if isinstance(module, ELEMENTWISE_MODULES):
        return _elementwise
    if isinstance(module, nn.Softmax):
        dim = module.dim
        return lambda m, layouts, r: _softmax_dim(m, layouts, r, dim)
    if isinstance(module, (nn.LayerNorm, nn.RMSNorm)):
        shape = tuple(module.normalized_shape)
        return lambda m, layouts, r: _norm_shape(m, layouts, r, shape)
    return None


def _softmax_dim(n: fx.Node, layouts: Mapping[str, Layout], rules: Rules, dim: Any) -> Result:
    shard, a = shard_of(n.args[0], layouts), rules.size(n.args[0])
    if shard is None or a is None or not isinstance(dim, int) or dim % len(a) == shard.dim:
        return Blocked(f"{what(n)} normalises over the cut dimension")
    return shard


def _norm_shape(
    n: fx.Node, layouts: Mapping[str, Layout], rules: Rules, shape: tuple[int, ...]
) -> Result:
    shard, a = shard_of(n.args[0], layouts), rules.size(n.args[0])
    if shard is None or a is None or shard.dim >= len(a) - len(shape):
        return Blocked(f"{what(n)} normalises over the cut features")
    return shard


_RULES: dict[str, Rule] = {
    **RESHAPE_RULES,
    **dict.fromkeys(ELEMENTWISE, _elementwise),
    **dict.fromkeys(CASTS, _cast),
    **dict.fromkeys(SOFTMAX, _softmax),
    **dict.fromkeys(REDUCTIONS, _reduction),
    **dict.fromkeys(NORMS, _norm),
    **dict.fromkeys(MATMULS, _matmul),
    **dict.fromkeys(ATTENTION_OPS, _attention),
}
