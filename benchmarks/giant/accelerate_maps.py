"""Hugging Face Accelerate's device maps of a giant (sequential and balanced), priced as
fxpipe's splits are."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch.fx as fx

from benchmarks.giant.graph import Graph
from benchmarks.giant.settings import STAGES
from fxpipe.passes.ops import COMPUTE_OPS, module_path


def load_accelerate() -> tuple[Callable[..., Any], Callable[..., Any], str]:
    """Accelerate's two map functions and its version, or exit saying how to install it."""
    try:
        import accelerate
        from accelerate import infer_auto_device_map
        from accelerate.utils import get_balanced_memory
    except ImportError:
        raise SystemExit(
            "benchmarks.giant compares fxpipe with Hugging Face Accelerate, which fxpipe "
            "does not depend on; install it to run this benchmark: pip install accelerate"
        ) from None
    # "Device i is not available": the maps are for GPUs this machine does not have.
    logging.getLogger("accelerate").setLevel(logging.ERROR)
    return infer_auto_device_map, get_balanced_memory, accelerate.__version__


@dataclass(frozen=True)
class AccelMap:
    #: Nothing on "cpu" or "disk": every module on one of the 4 devices.
    fits: bool
    #: The inference estimate of each device's stage fits the budget too.
    fits_activations: bool
    bottleneck: float | None
    #: Inference estimate per device, bytes (None when the map does not fit).
    memory: list[float] | None
    devices_used: int


def map_stages(gm: fx.GraphModule, device_map: Mapping[str, Any]) -> dict[str, int]:
    """A stage per node from an Accelerate device map (module name -> device index)."""
    names = sorted(device_map, key=len, reverse=True)

    def device_of(path: str) -> int | None:
        for name in names:
            if name == "" or path == name or path.startswith(name + "."):
                return int(device_map[name])
        return None

    out: dict[str, int] = {}
    previous = 0
    nodes = list(gm.graph.nodes)
    for node in nodes:
        if node.op in COMPUTE_OPS or node.op == "output":
            found = device_of(module_path(node)) if node.op != "output" else None
            previous = found if found is not None else previous
            out[node.name] = previous
    for node in nodes:
        if node.op == "get_attr":
            found = device_of(module_path(node))
            readers = [out[u.name] for u in node.users]
            out[node.name] = found if found is not None else min(readers, default=0)
        elif node.op == "placeholder":
            out[node.name] = min((out[u.name] for u in node.users), default=0)
    return out


def price_map(graph: Graph, device_map: Mapping[str, Any], budget: int) -> AccelMap:
    if any(not isinstance(d, int) for d in device_map.values()):
        return AccelMap(False, False, None, None, len(set(device_map.values())))
    stage_of = map_stages(graph.gm, device_map)
    memory = graph.estimate.stage_bytes(stage_of, STAGES, training=False)
    return AccelMap(
        fits=True,
        fits_activations=bool(memory.max() <= budget),
        bottleneck=float(graph.stage_costs(stage_of).max()),
        memory=[float(m) for m in memory],
        devices_used=len(set(device_map.values())),
    )


@dataclass(frozen=True)
class Accelerate:
    infer: Callable[..., Any]
    balanced: Callable[..., Any]
    #: (model, budget) -> its maps, priced.
    made: dict[tuple[str, int], dict[str, AccelMap]] = field(default_factory=dict)

    def maps(self, graph: Graph, budget: int) -> dict[str, AccelMap]:
        """Accelerate's sequential and balanced maps at ``budget`` bytes per device."""
        key = (graph.name, budget)
        if key not in self.made:
            self.made[key] = self._maps(graph, budget)
        return self.made[key]

    def _maps(self, graph: Graph, budget: int) -> dict[str, AccelMap]:
        blocks = [graph.giant.block_class]
        max_memory = dict.fromkeys(range(STAGES), budget)
        sequential = self.infer(
            graph.model, max_memory=dict(max_memory), no_split_module_classes=blocks
        )
        shares = self.balanced(
            graph.model, max_memory=dict(max_memory), no_split_module_classes=blocks
        )
        balanced = self.infer(graph.model, max_memory=shares, no_split_module_classes=blocks)
        return {
            "sequential": price_map(graph, sequential, budget),
            "balanced": price_map(graph, balanced, budget),
        }
