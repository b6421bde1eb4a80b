"""One giant model traced and priced once, and fxpipe's memory estimate for any assignment of
its nodes to stages."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.fx as fx
from torch import nn

from benchmarks.giant.settings import BATCH, CHECKPOINT, CHUNKS, DEVICE_NAMES, STAGES, TOKENS
from benchmarks.harness.models.giants import gpt2_xl, llama_7b
from fxpipe.devices.targets import normalize_devices
from fxpipe.ir import CostTable, PipelinePlan
from fxpipe.passes.ops import held_parameters
from fxpipe.passes.partition.cost_graph import batched_nodes, replicated_attrs, to_networkx
from fxpipe.passes.partition.memory import memory_terms, param_copies, whole_coef
from fxpipe.passes.partition.search import Partition
from fxpipe.passes.partition.units import Units, build_units
from fxpipe.passes.price.estimate import estimate_costs
from fxpipe.passes.split.plan import build_plan
from fxpipe.trace.tracing import trace


@dataclass(frozen=True)
class Search:
    """One timed ``partition_graph`` call."""

    budget: int
    training: bool
    fits: bool
    seconds: float
    #: Processor seconds of this process in that time (the machine may be shared).
    cpu_s: float
    #: Of which (wall), when nothing fits, the MemoryPlanError's diagnosis (the least-memory
    #: split and the remedies its message names).
    diagnosis_s: float


@dataclass(frozen=True)
class Giant:
    """A model of the benchmark: how to build it and where its decoder blocks are."""

    build: Callable[[], nn.Module]
    vocab: int
    #: Module path of the decoder blocks' ModuleList, and the blocks' class.
    blocks: str
    block_class: str


GIANTS: dict[str, Giant] = {
    "llama-7b": Giant(llama_7b, 32000, "model.layers", "LlamaDecoderLayer"),
    "gpt2-xl": Giant(gpt2_xl, 50257, "transformer.h", "GPT2Block"),
}


# ---------------------------------------------------------------------- the memory estimate


class Estimate:
    """fxpipe's stage memory (``passes/split/plan.py``'s ``stage_memory``: parameters held, bytes
    kept, values received) for any node -> stage assignment, also one that is not a
    pipeline (an Accelerate map may send values back to an earlier device)."""

    def __init__(self, gm: fx.GraphModule, costs: CostTable) -> None:
        holders: dict[int, tuple[int, list[str]]] = {}
        for node in gm.graph.nodes:
            for p in held_parameters(gm, node):
                holders.setdefault(id(p), (p.numel() * p.element_size(), []))[1].append(node.name)
        #: (bytes, nodes that hold it), one entry per parameter tensor.
        self.params = [(size, names) for size, names in holders.values()]
        self.saved = {n: c.saved_bytes for n, c in costs.nodes.items() if c.saved_bytes}
        shared = replicated_attrs(gm)
        batched = batched_nodes(gm)
        #: (node, bytes of its value, the nodes that read it (the output node left out: the
        #: stage that makes a model output returns it), whether it is cut with the batch
        #: (else the same whole value for every micro-batch, received once per step)).
        self.values = [
            (
                n.name,
                costs.nodes[n.name].output_bytes,
                [u.name for u in n.users if u.op != "output"],
                n.name in batched,
            )
            for n in gm.graph.nodes
            if n.op != "output" and n.name not in shared
        ]

    def parts(self, stage_of: Mapping[str, int], k: int) -> tuple[np.ndarray, ...]:
        """(parameter bytes, kept bytes, received bytes, received whole bytes) of each of
        the ``k`` stages."""
        params, saved, received, whole = np.zeros(k), np.zeros(k), np.zeros(k), np.zeros(k)
        for size, names in self.params:
            for j in {stage_of[n] for n in names}:
                params[j] += size
        for n, size in self.saved.items():
            saved[stage_of[n]] += size
        for n, size, users, cut in self.values:
            made = stage_of[n]
            for j in {stage_of[u] for u in users} - {made}:
                (received if cut else whole)[j] += size
        return params, saved, received, whole

    def stage_bytes(self, stage_of: Mapping[str, int], k: int, *, training: bool) -> np.ndarray:
        params, saved, received, whole = self.parts(stage_of, k)
        coef = coefficients(k, training)
        return np.asarray(
            param_copies(training) * params
            + coef[:, 0] * saved
            + coef[:, 1] * received
            + whole_coef(training) * whole
        )


def coefficients(k: int, training: bool) -> np.ndarray:
    """[j] = (kept, received) multiples of stage j's bytes, as fxpipe's estimate has them."""
    return np.array(
        [memory_terms(CHUNKS, CHECKPOINT, last=j == k - 1, training=training) for j in range(k)]
    )


# ---------------------------------------------------------------------- one priced model


@dataclass
class Graph:
    """One model traced and priced once, and what every split is measured against."""

    name: str
    model: nn.Module
    giant: Giant
    gm: fx.GraphModule
    costs: CostTable
    g: Any
    units: Units
    devices: tuple[torch.device, ...]
    estimate: Estimate
    total: float
    lb0: float
    front_s: float
    #: Every partition_graph call made for this model (:class:`Search`).
    searches: list[Search] = field(default_factory=list)

    def memory_bound(self, *, training: bool) -> float:
        """No split's busiest stage needs less: every parameter is in at least one stage
        and every node's kept bytes in exactly one, so the stages together need at least
        copies x parameters + the smallest kept-bytes multiple x kept bytes."""
        params = sum(size for size, _ in self.estimate.params)
        saved = sum(self.estimate.saved.values())
        coef = coefficients(STAGES, training)
        return (param_copies(training) * params + float(coef[:, 0].min()) * saved) / STAGES

    def stage_costs(self, stage_of: Mapping[str, int]) -> np.ndarray:
        out = np.zeros(STAGES)
        for n, c in self.costs.nodes.items():
            out[stage_of[n]] += c.cost
        return out


def build_graph(name: str) -> Graph:
    giant = GIANTS[name]
    with torch.device("meta"):
        model = giant.build()
    model.eval()
    ids = torch.randint(0, giant.vocab, (BATCH, TOKENS), device="meta")
    started = time.perf_counter()
    traced = trace(model, (ids,), {})
    gm = traced.graph_module
    costs = estimate_costs(gm, traced.example_values, mode="flops", micro_batches=CHUNKS)
    g = to_networkx(gm, costs)
    front_s = time.perf_counter() - started
    units = build_units(g)
    total = sum(c.cost for c in costs.nodes.values())
    return Graph(
        name=name,
        model=model,
        giant=giant,
        gm=gm,
        costs=costs,
        g=g,
        units=units,
        devices=normalize_devices(DEVICE_NAMES, require_present=False),
        estimate=Estimate(gm, costs),
        total=total,
        lb0=max(total / STAGES, float(units.weight.max())),
        front_s=front_s,
    )


def plan_of(
    graph: Graph, part: Partition, *, training: bool, capacity: Sequence[int] | None = None
) -> PipelinePlan:
    """``build_plan`` of ``part`` at the benchmark's chunks and checkpoint mode."""
    return build_plan(
        graph.gm,
        graph.costs,
        graph.g,
        part,
        graph.devices,
        chunks=CHUNKS,
        checkpoint=CHECKPOINT,
        capacity=capacity,
        training=training,
    )
