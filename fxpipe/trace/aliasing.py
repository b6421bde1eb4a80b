"""Marks, by one run on fake tensors, the nodes whose output shares memory with an input and
the nodes that write into an input: what no op name tells (a module that returns its input
as it is, such as ``nn.Identity`` or a drop-path at rate 0, or a leaf function that adds
into its argument), and what :func:`fxpipe.passes.ops.is_view` and
:func:`fxpipe.passes.ops.mutated_input` then read, so that no stage border separates an
in-place write from the value it writes.

Each mark is the position of that input in ``node.all_input_nodes`` (so it survives
``Graph.node_copy``): ``node.meta["fxpipe_aliases"]`` and ``node.meta["fxpipe_writes"]``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._pytree import tree_leaves, tree_map

from fxpipe.passes.ops import ALIASES, WRITES

__all__ = ["mark_aliasing"]


def mark_aliasing(gm: fx.GraphModule, values: Sequence[Any]) -> None:
    """Run ``gm`` once on fake copies of ``values`` and mark its nodes. Marks only add
    constraints: a run that stops early (a graph that does not run on fake tensors) leaves
    the nodes after it to the op-name rules, and a second run (in the other train/eval mode,
    where modules may alias differently) adds its marks to the first's."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    try:
        with mode, torch.no_grad():
            fakes = tree_map(lambda v: mode.from_tensor(v) if _is_tensor(v) else v, values)
            _Marker(gm).run(*fakes)
    except Exception:
        return


def _is_tensor(value: Any) -> bool:
    return isinstance(value, torch.Tensor)


class _Marker(fx.Interpreter):
    def run_node(self, n: fx.Node) -> Any:
        inputs = [tree_leaves(self.env.get(a)) for a in n.all_input_nodes]
        before = [[(t, t._version) for t in leaves if _is_tensor(t)] for leaves in inputs]
        result = super().run_node(n)
        if n.op not in ("call_function", "call_method", "call_module"):
            return result
        for k, tensors in enumerate(before):
            if any(t._version != version for t, version in tensors):
                n.meta.setdefault(WRITES, k)
        storages = {_storage(t) for t in tree_leaves(result) if _is_tensor(t)}
        for k, tensors in enumerate(before):
            if any(_storage(t) in storages for t, _ in tensors):
                n.meta.setdefault(ALIASES, k)
        return result


def _storage(t: torch.Tensor) -> StorageWeakRef:
    return StorageWeakRef(t.untyped_storage())  # type: ignore[no-untyped-call]
