"""The shape of every node's output for an example, from one run of the graph on fake
tensors (the graph and the modules it calls are left as they were)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeAlias

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._pytree import tree_map

from fxpipe.errors import PlanError
from fxpipe.model_state import preserved

__all__ = ["Shape", "node_shapes"]

#: A node's output as the planner sees it: a tensor's sizes, a tuple of such (None for an
#: item that is not a tensor) where the node returns several values, or None.
Shape: TypeAlias = torch.Size | tuple[torch.Size | None, ...] | None


def node_shapes(gm: fx.GraphModule, example_values: Sequence[Any]) -> dict[str, Shape]:
    """Node name -> the shape of its output when the graph runs on ``example_values`` (one
    value per placeholder), found on fake tensors, so nothing is computed."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(example_values):
        raise PlanError(
            f"the graph takes {len(placeholders)} inputs but {len(example_values)} example "
            "values were given; pass one value per placeholder, in order"
        )
    recorder = _Recorder(gm)
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with preserved(gm, structure=False), mode:
        fakes = tree_map(lambda v: _fake(mode, v), list(example_values))
        try:
            recorder.run(*fakes)
        except Exception as e:
            raise PlanError(
                f"the tensor-parallel planner runs the graph on fake tensors to read its "
                f"shapes, and node {recorder.current!r} failed there ({type(e).__name__}: "
                f"{e}); a node whose output shape depends on tensor values cannot be planned"
            ) from e
    return recorder.shapes


class _Recorder(fx.Interpreter):
    """Runs the graph and keeps each node's output shape."""

    def __init__(self, gm: fx.GraphModule) -> None:
        super().__init__(gm, garbage_collect_values=True)
        self.shapes: dict[str, Shape] = {}
        self.current = ""

    def run_node(self, n: fx.Node) -> Any:
        self.current = n.name
        out = super().run_node(n)
        self.shapes[n.name] = _shape_of(out)
        return out


def _shape_of(value: Any) -> Shape:
    if isinstance(value, torch.Tensor):
        return value.shape
    if isinstance(value, (tuple, list)) and any(isinstance(v, torch.Tensor) for v in value):
        return tuple(v.shape if isinstance(v, torch.Tensor) else None for v in value)
    return None


def _fake(mode: FakeTensorMode, value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return mode.from_tensor(value)
    return value
