"""The shape of every node's output for an example, and which outputs carry a gradient, from
one run of the graph on fake tensors (the graph and the modules it calls are left as they
were)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from operator import attrgetter
from typing import Any, TypeAlias

import torch
import torch.fx as fx
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._pytree import tree_map

from fxpipe.errors import PlanError
from fxpipe.model_state import preserved

__all__ = ["Shape", "NodeValues", "node_shapes", "node_values"]

#: A node's output as the planner sees it: a tensor's sizes, a tuple of such (None for an
#: item that is not a tensor) where the node returns several values, or None.
Shape: TypeAlias = torch.Size | tuple[torch.Size | None, ...] | None


@dataclass(frozen=True)
class NodeValues:
    """What one run of a graph on fake tensors says of each node's output."""

    #: Node name -> the shape of its output.
    shapes: dict[str, Shape]
    #: The nodes whose output carries a gradient: read from a Parameter (whether it requires
    #: one now or not: a user may unfreeze it later) or from a floating-point input, through
    #: ops autograd follows.
    grads: frozenset[str]


def node_shapes(gm: fx.GraphModule, example_values: Sequence[Any]) -> dict[str, Shape]:
    """Node name -> the shape of its output when the graph runs on ``example_values`` (one
    value per placeholder), found on fake tensors, so nothing is computed."""
    return node_values(gm, example_values).shapes


def node_values(gm: fx.GraphModule, example_values: Sequence[Any]) -> NodeValues:
    """The shapes of every node's output when the graph runs on ``example_values`` (one
    value per placeholder), and which carry a gradient, found on fake tensors, so nothing
    is computed."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(example_values):
        raise PlanError(
            f"the graph takes {len(placeholders)} inputs but {len(example_values)} example "
            "values were given; pass one value per placeholder, in order"
        )
    recorder = _Recorder(gm)
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with preserved(gm, structure=False), mode, torch.enable_grad():
        fakes = tree_map(lambda v: _fake(mode, v), list(example_values))
        recorder.mode = mode
        try:
            recorder.run(*fakes)
        except Exception as e:
            raise PlanError(
                f"the tensor-parallel planner runs the graph on fake tensors to read its "
                f"shapes, and node {recorder.current!r} failed there ({type(e).__name__}: "
                f"{e}); a node whose output shape depends on tensor values cannot be planned"
            ) from e
    return NodeValues(recorder.shapes, frozenset(recorder.grads))


class _Recorder(fx.Interpreter):
    """Runs the graph and keeps each node's output shape and whether it carries a gradient
    (every Parameter and floating-point input taken as requiring one)."""

    def __init__(self, gm: fx.GraphModule) -> None:
        super().__init__(gm, garbage_collect_values=True)
        self.shapes: dict[str, Shape] = {}
        self.grads: set[str] = set()
        self.current = ""
        self.mode: FakeTensorMode | None = None

    def run_node(self, n: fx.Node) -> Any:
        self.current = n.name
        out = super().run_node(n)
        self.shapes[n.name] = _shape_of(out)
        if _requires_grad(out) or (n.op == "call_module" and _holds_parameters(self.module, n)):
            self.grads.add(n.name)
        return out

    def placeholder(self, target: Any, args: Any, kwargs: Any) -> Any:
        value = super().placeholder(target, args, kwargs)
        return _needing_grad(value)

    def get_attr(self, target: Any, args: Any, kwargs: Any) -> Any:
        value = attrgetter(str(target))(self.module)
        if isinstance(value, nn.Parameter) and self.mode is not None:
            return _needing_grad(self.mode.from_tensor(value.detach()))
        return super().get_attr(target, args, kwargs)


def _needing_grad(value: Any) -> Any:
    """A floating-point fake tensor as one that requires a gradient (not a leaf: the graph may
    write to it in place); anything else as it is."""
    if isinstance(value, torch.Tensor) and value.is_floating_point() and not value.requires_grad:
        return value.detach().requires_grad_(True).clone()
    return value


def _requires_grad(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return value.requires_grad
    return isinstance(value, (tuple, list)) and any(_requires_grad(v) for v in value)


def _holds_parameters(gm: torch.nn.Module, n: fx.Node) -> bool:
    return any(True for _ in gm.get_submodule(str(n.target)).parameters())


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
