"""Which values of a traced graph grow with the batch, which reduce it away, which never see it.

Every node gets one of three roles, from the graph's values at the example's batch size and
at one more (the sizes ``torch.export`` recorded in terms of the batch where it did, else
two runs on fake tensors):

- ``"batched"``: its value changes with the batch size: a tensor with a dimension that
  grows with it (the rows of the batch, perhaps merged with other dimensions), or a
  number that does (``x.shape[0]``). Micro-batches each compute their own part of it.
- ``"reduced"``: a tensor that reads batched data but whose shape does not change with the
  batch: a sum, a mean or a loss over the batch, or a sample picked out of it. It depends on
  the whole batch, so micro-batches cannot compute it each alone.
- ``"static"``: everything else: parameters, constants, inputs without a batch dimension,
  and what is computed from them alone (also sizes, dtypes and devices read from batched
  tensors, which do not change with the batch).

Inside a ``torch.vmap`` region the values are one sample's: there a node is batched when it
reads anything that is not static.

The roles are what :mod:`fxpipe.passes.batch.reductions` needs to compute a reduction inside the
model exactly over micro-batches, and to refuse a graph that mixes a reduction over the
batch back into per-sample values.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._pytree import tree_flatten, tree_map

from fxpipe.passes.ops import op_name, stateful_regions
from fxpipe.passes.price.recorded import recorded_at
from fxpipe.passes.shape_only import same_shape_output

__all__ = ["Role", "BatchRoles", "batch_roles", "SHAPE_ONLY_OPS"]

Role = Literal["batched", "reduced", "static"]

#: Ops whose output takes only the shape, dtype and device of their tensor input, not its
#: values: ``zeros_like(loss)`` is as static as ``zeros(())``.
SHAPE_ONLY_OPS = frozenset(
    "zeros_like ones_like empty_like full_like rand_like randn_like randint_like new_zeros "
    "new_ones new_empty new_full new_empty_strided".split()
)


@dataclass(frozen=True)
class BatchRoles:
    """Each node's role, and its value at the two batch sizes it was told by."""

    #: Node name -> role, for every node but the output.
    roles: Mapping[str, Role]
    #: Node name -> (value at ``batch``, value at ``batch + 1``): ``(True, shape)`` for a
    #: tensor, ``(False, value)`` for anything else (a tuple of tensors: a tuple of those).
    seen: Mapping[str, tuple[Any, Any]]
    batch: int

    def of(self, node: fx.Node) -> Role:
        """The role of ``node``."""
        return self.roles[node.name]

    def grows(self, node: fx.Node) -> bool:
        """Whether ``node`` is a number proportional to the batch size (the batch's rows,
        or rows times a fixed size): it adds up over micro-batches."""
        a, b = self.seen[node.name]
        if a[0] or b[0] or not _number(a[1]) or not _number(b[1]):
            return False
        return bool(a[1] * (self.batch + 1) == b[1] * self.batch) and a[1] != 0


def batch_roles(
    gm: fx.GraphModule, example_values: Sequence[Any], batch: int
) -> BatchRoles | None:
    """The role of every node of ``gm`` (see the module docstring); None when the graph's
    values at a second batch size cannot be told (a value export did not record in a graph
    that does not run on fake tensors, or a batch size fixed inside the model)."""
    runs = recorded_at(gm, example_values, batch) or _fake_runs(gm, example_values, batch)
    if runs is None:
        return None
    at, more = runs
    seen: dict[str, tuple[Any, Any]] = {}
    roles: dict[str, Role] = {}
    mapped = {n for region in stateful_regions(gm.graph) for n in region}
    values = iter(example_values)
    for node in gm.graph.nodes:
        if node.op == "output":
            continue
        if node.op == "placeholder":
            roles[node.name] = "batched" if _has_rows(next(values)) else "static"
            if node.name in at and node.name in more:
                seen[node.name] = (at[node.name], more[node.name])
            continue
        if node.name not in at or node.name not in more:
            return None
        seen[node.name] = (at[node.name], more[node.name])
        if node in mapped:  # inside torch.vmap: values are one sample's, by data flow
            reads = any(roles.get(x.name) != "static" for x in node.all_input_nodes)
            roles[node.name] = "batched" if reads else "static"
        else:
            roles[node.name] = _role(node, seen[node.name], roles)
    return BatchRoles(roles, seen, batch)


def _role(node: fx.Node, seen: tuple[Any, Any], roles: Mapping[str, Role]) -> Role:
    if node.op == "get_attr":
        return "static"
    a, b = seen
    if a != b:
        return "batched"
    if not _holds_tensor(a) or op_name(node) in SHAPE_ONLY_OPS:
        return "static"  # a size, dtype or device: the same at any batch size
    reads_batch = any(roles.get(x.name) in ("batched", "reduced") for x in node.all_input_nodes)
    return "reduced" if reads_batch else "static"


def _holds_tensor(value: tuple[bool, Any]) -> bool:
    is_tensor, inner = value
    if is_tensor:
        return True
    return isinstance(inner, tuple) and any(
        isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], bool) and _holds_tensor(x)
        for x in inner
    )


def _has_rows(value: Any) -> bool:
    return any(isinstance(t, torch.Tensor) and t.ndim > 0 for t in tree_flatten(value)[0])


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _fake_runs(
    gm: fx.GraphModule, example_values: Sequence[Any], batch: int
) -> list[dict[str, tuple[bool, Any]]] | None:
    """Every node's value (as :attr:`BatchRoles.seen` writes it) from runs on fake tensors
    of ``batch`` and ``batch + 1`` rows; None when the graph does not run on them."""
    runs = []
    for size in (batch, batch + 1):
        runner = _Recording(gm)
        try:
            runner.outputs(tuple(example_values), size)
        except Exception:
            return None
        runs.append(runner.seen)
    return runs


class _Recording(fx.Interpreter):
    """Runs a graph on fake tensors with another batch size and keeps every node's value as
    a shape (tensors) or the value itself. Leaf modules whose output is shaped like their
    input are not run (:mod:`fxpipe.passes.shape_only`)."""

    def __init__(self, gm: fx.GraphModule) -> None:
        super().__init__(gm, garbage_collect_values=False)
        self.seen: dict[str, tuple[bool, Any]] = {}

    def run_node(self, n: fx.Node) -> Any:
        out = None
        if n.op == "call_module":
            args, kwargs = self.fetch_args_kwargs_from_env(n)
            out = same_shape_output(self.module.get_submodule(str(n.target)), args, kwargs)
        if out is None:
            out = super().run_node(n)
        if n.op != "output":
            self.seen[n.name] = _summary(out)
        return out

    def outputs(self, values: tuple[Any, ...], batch: int) -> None:
        mode = FakeTensorMode(allow_non_fake_inputs=True)

        def fake(t: Any) -> Any:
            if not isinstance(t, torch.Tensor) or t.ndim == 0:
                return t
            return torch.zeros((batch, *t.shape[1:]), dtype=t.dtype, device=t.device)

        with mode, torch.no_grad():
            self.run(*tree_map(fake, values))


def _summary(value: Any) -> tuple[bool, Any]:
    if isinstance(value, torch.Tensor):
        return True, tuple(int(d) for d in value.shape)
    if isinstance(value, (tuple, list)) and any(isinstance(x, torch.Tensor) for x in value):
        return False, tuple(_summary(x) for x in value)
    if isinstance(value, torch.Size):
        return False, tuple(int(d) for d in value)
    leaves, _ = tree_flatten(value)
    if any(isinstance(x, torch.Tensor) for x in leaves):  # a dict of tensors, say
        return False, tuple(_summary(x) for x in leaves)
    return False, value
