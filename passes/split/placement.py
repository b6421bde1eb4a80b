"""Points the device constants a traced graph holds at the device that runs it.

torch.export records where the example ran: ``torch.arange(t, device=x.device)`` becomes
``aten.arange(t, device=cpu)``, ``x.to(x.device)`` a copy to ``cpu``. A stage of that graph
on ``cuda:0`` would make its position table on the CPU and fail on the first op that mixes
the two. Every device constant a node passes (a ``torch.device`` anywhere in its arguments,
a ``device=`` keyword, the device of a ``Tensor.to`` call) is replaced by the device the
node runs on; values do not change, only where they are made.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx
from torch.utils._pytree import tree_map

__all__ = ["retarget", "place_graph"]


def retarget(
    node: fx.Node,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    device: torch.device | fx.Node,
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``node``'s arguments with every device constant replaced by ``device`` (a device, or
    a node of the same graph whose value is one)."""
    if node.op not in ("call_function", "call_method"):
        return args, kwargs

    def swap(value: Any) -> Any:
        return device if isinstance(value, torch.device) else value

    new_args = tree_map(swap, args)
    new_kwargs = tree_map(swap, dict(kwargs))
    if isinstance(new_kwargs.get("device"), str):
        new_kwargs["device"] = device
    if node.op == "call_method" and node.target == "to":
        new_args = tuple(
            device if i > 0 and isinstance(a, str) and _is_device_name(a) else a
            for i, a in enumerate(new_args)
        )
    return new_args, new_kwargs


def place_graph(graph: fx.Graph, device: torch.device) -> None:
    """Point every device constant of ``graph``'s nodes at ``device``, in place: for graphs
    fxpipe built itself (stage modules), never the user's."""
    for node in graph.nodes:
        node.args, node.kwargs = retarget(node, node.args, dict(node.kwargs), device)


def _is_device_name(text: str) -> bool:
    try:
        torch.device(text)
    except (RuntimeError, ValueError):
        return False
    return True
