"""Giant models under memory budgets: fxpipe's budgeted partitioner against the device maps
of Hugging Face Accelerate (``infer_auto_device_map``, "sequential" and "balanced").

Run from the repository root (transformers is in the ``test`` extra; Accelerate is needed by
this benchmark only, not by fxpipe: ``pip install accelerate``)::

    python -m benchmarks.giant [--out PATH] [--models llama-7b gpt2-xl] [--ratios 4 2 ...]

Llama-7B's and GPT-2 XL's shapes (``benchmarks/harness/models/giants.py``, float32) are built
under ``torch.device("meta")`` (no weights, no memory) and put in eval mode; the example is
a batch of 16 sequences of 1,024 tokens, run as 16 micro-batches of one sequence
(``chunks=16``) over 4 devices ``cuda:0``..``cuda:3`` (planned only: they need not be
present). Each model is traced once and priced once in FLOP on fake tensors
(``cost="flops"``, forward and backward of every node, as ``hf_plan.py`` prices); every split
below, fxpipe's, the brute force's and Accelerate's, is priced on that one cost table, so
only ratios of costs are reported.

Memory is fxpipe's inference estimate (``training=False``; what Accelerate's maps are for):
per stage, its weights once, plus one micro-batch's activations: the bytes all its nodes
keep for backward and the values it receives from other stages, over ``chunks``. (That sums
the whole stage's activations of one sequence, more than a forward holds at its peak.) The
*floor* is the least per-device budget (the same for the 4 devices) at which any split fits.
It is found twice: by bisection on the budget with fxpipe's search (to 0.1%), and by a brute
force over every split of the model into 4 contiguous runs of its unit order (fxpipe's
indivisible groups of nodes, numbered in a topological order close to the fx order) whose 3
cuts lie at decoder-block boundaries (before each block, or after the last: C(33, 3) = 5,456
splits for Llama's 32 blocks, C(49, 3) = 18,424 for GPT-2 XL's 48), each priced from
interval tables built here from the cost table, independently of fxpipe's search, and
checked against ``build_plan``'s stage memory on sampled splits. The floor is the smaller of
the two. Beside it, a lower bound no split can beat: every parameter is in some stage and
every node's kept bytes in one, so the busiest of 4 stages needs at least a quarter of
(copies x parameter bytes + the smallest kept-bytes multiple x kept bytes).

Budgets are ratios of the floor, from 4x (where everything fits) down to the floor, and one
below it. At each budget:

- fxpipe: ``partition_graph(g, 4, memory=memory_model(..., training=False))``, timed alone
  (tracing and pricing excluded), then ``build_plan``; whether it fits, its bottleneck over
  LB0 = max(total / 4, heaviest unit), and over the best block-boundary split that fits
  (the brute force's; fxpipe may cut inside a block, so it may do better);
- Accelerate, sequential: ``infer_auto_device_map(model, max_memory={0: B, .., 3: B},
  no_split_module_classes=[the decoder block])``; balanced: the same on
  ``get_balanced_memory(model, max_memory, no_split_module_classes)``, as ``from_pretrained``
  does for ``device_map="balanced"``. Accelerate counts parameter and buffer bytes only, and
  keeps room for the largest layer on device 0. Int keys are CUDA indices; Accelerate
  accepts them without a GPU (it logs that each is not available, silenced here) and
  appends ``"disk"`` for what does not fit, so its map *fits* when no module lands on
  ``"cpu"`` or ``"disk"``. The map becomes a stage per node: the device of the longest
  module name in the map that prefixes the node's module path; a compute node without one
  takes the previous compute node's, a parameter its module's, a placeholder its first
  reader's. That assignment (not a pipeline: Llama's rotary embedding sits on the last
  device Accelerate fills, and GPT-2's LM head with the tied embedding on the first) is
  priced like fxpipe's: its bottleneck (the busiest device), and its memory under the same
  estimate: does the map still fit once activations are counted? Accelerate runs the whole
  batch at once; counting one sequence's activations is in its favour;
- fxpipe's training estimate (``training=True``: weights, gradients and Adam state, the
  activations of the micro-batches in flight, ``checkpoint="except_last"``): does a split
  fit? Below the training lower bound nothing is searched (``no*``);
- predicted step time: fxpipe's pipeline, GPipe's makespan sum(c)/M + (M - 1) max(c)/M with
  M = 16 over its stage costs c, against Accelerate's run, which uses one device after the
  other on the whole batch: the sum of all costs, whatever its map.

Targets: fxpipe fits at every budget at which any split fits (down to the floor); its
bottleneck is within 1% of the best block-boundary split that fits; the step time predicted
with chunks=16 is at least 2.5x lower than the sequential run's; a search takes under 2 s,
wall clock (processor seconds are recorded too: the machine may be shared), judged apart for
searches that find a split and for refusals. A refusal's time is the search's, up to the
MemoryPlanError's diagnosis (the least-memory split and the remedies its message names:
work beyond the search, whose time is printed beside it, timed apart by wrapping
``fxpipe.passes.budgeted._no_fit_error`` in this process). Summary lines give the
smallest budget at which each tool's map fits (bisection to 0.1%, taking a map that fits
to fit at every larger budget) and fxpipe's training floor (to 1%) over the inference
floor. Results, with the machine, the
command and every timed search: ``benchmarks/results/giant.json``.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import logging
import math
import os
import platform
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.fx as fx
import transformers
from torch import nn

from benchmarks.harness.models.giants import gpt2_xl, llama_7b
from benchmarks.harness.output import command_line, format_table, result_path, save_json
from fxpipe.devices import normalize_devices
from fxpipe.errors import MemoryPlanError
from fxpipe.ir import CheckpointMode, CostTable, PipelinePlan
from fxpipe.passes import budgeted
from fxpipe.passes.cost_model import estimate_costs
from fxpipe.passes.memory import memory_model, memory_terms, param_copies, whole_coef
from fxpipe.passes.nx_graph import batched_nodes, replicated_attrs, to_networkx
from fxpipe.passes.ops import COMPUTE_OPS, held_parameters, is_check, module_path
from fxpipe.passes.partition import Partition, node_stages, partition_graph
from fxpipe.passes.plan import build_plan
from fxpipe.passes.units import Units, build_units
from fxpipe.trace.tracing import trace

BATCH, TOKENS = 16, 1024
CHUNKS = 16
STAGES = 4
CHECKPOINT: CheckpointMode = "except_last"
DEVICE_NAMES = [f"cuda:{i}" for i in range(STAGES)]
RATIOS = (4.0, 2.0, 1.5, 1.25, 1.1, 1.05, 1.0, 0.98)
#: Relative precision of the bisections on the budget (the training floor's: 1%).
TOLERANCE = 1e-3
TRAINING_TOLERANCE = 1e-2
TARGET_BOTTLENECK = 1.01
TARGET_SPEEDUP = 2.5
TARGET_SEARCH_S = 2.0
GIB = 2.0**30


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


def _accelerate() -> tuple[Callable[..., Any], Callable[..., Any], str]:
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


# ---------------------------------------------------------------------- the memory estimate


class Estimate:
    """fxpipe's stage memory (``passes/plan.py``'s ``stage_memory``: parameters held, bytes
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


# ---------------------------------------------------------------------- fxpipe


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
class FxRun:
    search: Search
    plan: PipelinePlan | None


#: Seconds of each MemoryPlanError diagnosis made since the list was last emptied.
DIAGNOSES: list[float] = []


def _timed_diagnosis() -> None:
    """Time fxpipe's diagnosis of a refusal apart from the search before it: wraps
    ``budgeted._no_fit_error`` in this process (fxpipe itself is not changed)."""
    diagnose = budgeted._no_fit_error

    def timed(*args: Any, **kwargs: Any) -> MemoryPlanError:
        started = time.perf_counter()
        try:
            return diagnose(*args, **kwargs)
        finally:
            DIAGNOSES.append(time.perf_counter() - started)

    budgeted._no_fit_error = timed


def run_fxpipe(graph: Graph, budget: float, *, training: bool) -> FxRun:
    """fxpipe's split under ``budget`` bytes per device; the search alone is timed."""
    size = int(math.ceil(budget))
    budgets = [size] * STAGES
    memory = memory_model(
        graph.gm,
        graph.costs,
        graph.devices,
        budgets,
        chunks=CHUNKS,
        checkpoint=CHECKPOINT,
        training=training,
    )
    gc.collect()  # collect what earlier calls left, outside the timed search
    DIAGNOSES.clear()
    started, cpu = time.perf_counter(), time.process_time()
    try:
        part = partition_graph(graph.g, STAGES, memory=memory)
    except MemoryPlanError:
        part = None
    seconds, cpu = time.perf_counter() - started, time.process_time() - cpu
    search = Search(size, training, part is not None, seconds, cpu, sum(DIAGNOSES))
    graph.searches.append(search)
    if part is None:
        return FxRun(search, None)
    # raises MemoryPlanError if the estimate of the plan disagrees with the search's
    plan = plan_of(graph, part, training=training, capacity=budgets)
    check_memory(graph, plan.stage_of, [s.memory_bytes for s in plan.stages], training)
    return FxRun(search, plan)


def check_memory(
    graph: Graph, stage_of: Mapping[str, int], planned: Sequence[int], training: bool
) -> None:
    """The estimate computed here equals the plan's (bytes, up to int truncation)."""
    mine = graph.estimate.stage_bytes(stage_of, STAGES, training=training)
    if np.abs(mine - np.asarray(planned, dtype=np.float64)).max() > STAGES:
        raise AssertionError(f"{graph.name}: memory {mine} here, {list(planned)} in the plan")


def smallest_budget(
    fits: Callable[[float], bool], start: float, *, step: float, tolerance: float = TOLERANCE
) -> float:
    """The smallest budget at which ``fits`` holds, to a relative ``tolerance``, bracketed
    from ``start`` by factors of ``step`` (``fits`` is taken to be monotone)."""
    hi = start
    while not fits(hi):
        hi *= step
    lo = hi / step
    while fits(lo):
        hi, lo = lo, lo / step
    while hi - lo > tolerance * hi:
        mid = (lo + hi) / 2
        if fits(mid):
            hi = mid
        else:
            lo = mid
    return hi


# ---------------------------------------------------------------------- brute force


@dataclass(frozen=True)
class BlockSplits:
    """Every split into 4 contiguous runs of the unit order cut at block boundaries."""

    #: Candidate cut positions in the unit order, with 0 first and the unit count last.
    bounds: np.ndarray
    #: (splits, 5) indices into ``bounds``: 0, three cuts, len(bounds) - 1.
    index: np.ndarray
    bottleneck: np.ndarray
    #: Largest stage memory of each split, inference (False) and training (True).
    memory: dict[bool, np.ndarray]
    seconds: float

    def floor(self, training: bool) -> float:
        return float(self.memory[training].min())

    def best(self, budget: float, *, training: bool = False) -> int | None:
        """The split with the smallest bottleneck that fits ``budget``; None if none does."""
        fits = self.memory[training] <= budget
        if not fits.any():
            return None
        candidates = np.flatnonzero(fits)
        return int(candidates[np.argmin(self.bottleneck[candidates])])

    def unit_stage(self, i: int, num_units: int) -> np.ndarray:
        cuts = self.bounds[self.index[i]]
        out = np.empty(num_units, dtype=np.int64)
        for j in range(STAGES):
            out[cuts[j] : cuts[j + 1]] = j
        return out


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


def block_bounds(graph: Graph) -> np.ndarray:
    """0, the first unit of each decoder block, the unit after the last block, the unit
    count: where a block-boundary split may cut the unit order."""
    pattern = re.compile(re.escape(graph.giant.blocks) + r"\.(\d+)(\.|$)")
    first: dict[int, int] = {}
    last: dict[int, int] = {}
    by_name = {n.name: n for n in graph.gm.graph.nodes}
    for u, members in enumerate(graph.units.members):
        for name in members:
            if is_check(by_name[name]):  # an assertion sits with what it checks
                continue
            match = pattern.match(module_path(by_name[name]))
            if match:
                b = int(match.group(1))
                first.setdefault(b, u)
                last[b] = u
    blocks = sorted(first)
    if blocks != list(range(len(blocks))):
        raise AssertionError(f"{graph.name}: blocks {blocks} are not 0..N-1")
    for b in blocks[1:]:
        if first[b] <= last[b - 1]:
            raise AssertionError(f"{graph.name}: block {b} starts inside block {b - 1}")
    count = graph.units.num_units
    cuts = [first[b] for b in blocks] + [last[blocks[-1]] + 1]
    if not (0 < cuts[0] and cuts[-1] < count):
        raise AssertionError(f"{graph.name}: nothing before the first block or after the last")
    if graph.units.pinned_first and max(graph.units.pinned_first) >= cuts[0]:
        raise AssertionError(f"{graph.name}: units pinned to stage 0 inside the blocks")
    return np.array([0, *cuts, count], dtype=np.int64)


def node_positions(graph: Graph) -> dict[str, int]:
    """Each node's place in the unit order, as fxpipe assigns stages on a contiguous split:
    a compute node at its unit; a ``get_attr`` at its first reader (the last unit when only
    the output reads it); a placeholder at 0 (the first stage); the output at the end."""
    unit_of = graph.units.unit_of
    end = graph.units.num_units - 1
    out: dict[str, int] = {}
    for node in graph.gm.graph.nodes:
        if node.op in COMPUTE_OPS:
            out[node.name] = unit_of[node.name]
        elif node.op == "get_attr":
            readers = [unit_of[u.name] for u in node.users if u.name in unit_of]
            out[node.name] = min(readers) if readers else (end if node.users else 0)
        elif node.op == "placeholder":
            out[node.name] = 0
        else:
            out[node.name] = end
    return out


def _within(positions: Sequence[int], bounds: np.ndarray) -> np.ndarray:
    """``[a, b]``: whether any of ``positions`` lies in ``[bounds[a], bounds[b])``."""
    x = np.append(np.sort(np.asarray(positions, dtype=np.float64)), np.inf)
    after = x[np.searchsorted(x[:-1], bounds, side="left")]
    return np.asarray(after[:, None] < bounds[None, :])


def interval_tables(graph: Graph, bounds: np.ndarray) -> dict[str, np.ndarray]:
    """``[a, b]``: cost, parameter, kept and received bytes of the stage of units
    ``[bounds[a], bounds[b])`` of a contiguous split (the stage holds a parameter when one
    of its holders is in it, and receives a value made before it and read in it)."""
    pos = node_positions(graph)
    size = len(bounds)
    count = graph.units.num_units

    def prefix(weights: Mapping[str, float]) -> np.ndarray:
        per_unit = np.zeros(count + 1)
        for n, w in weights.items():
            per_unit[pos[n] + 1] += w
        total = np.cumsum(per_unit)[bounds]
        return np.asarray(total[None, :] - total[:, None])

    cost = prefix({n: c.cost for n, c in graph.costs.nodes.items()})
    saved = prefix({n: float(b) for n, b in graph.estimate.saved.items()})
    params = np.zeros((size, size))
    for nbytes, names in graph.estimate.params:
        params += nbytes * _within([pos[n] for n in names], bounds)
    received, whole = np.zeros((size, size)), np.zeros((size, size))
    for n, nbytes, users, cut in graph.estimate.values:
        if nbytes and users:
            made_before = (pos[n] < bounds)[:, None]
            table = received if cut else whole
            table += nbytes * (_within([pos[u] for u in users], bounds) & made_before)
    return {"cost": cost, "params": params, "saved": saved, "received": received, "whole": whole}


def brute_force(graph: Graph) -> BlockSplits:
    started = time.perf_counter()
    bounds = block_bounds(graph)
    tables = interval_tables(graph, bounds)
    last = len(bounds) - 1
    cuts = np.array(list(itertools.combinations(range(1, last), STAGES - 1)), dtype=np.int64)
    count = len(cuts)
    index = np.column_stack([np.zeros(count, np.int64), cuts, np.full(count, last)])
    starts, stops = index[:, :-1], index[:, 1:]
    bottleneck = tables["cost"][starts, stops].max(axis=1)
    memory = {}
    for training in (False, True):
        coef = coefficients(STAGES, training)
        stage = (
            param_copies(training) * tables["params"][starts, stops]
            + coef[None, :, 0] * tables["saved"][starts, stops]
            + coef[None, :, 1] * tables["received"][starts, stops]
            + whole_coef(training) * tables["whole"][starts, stops]
        )
        memory[training] = stage.max(axis=1)
    seconds = time.perf_counter() - started
    return BlockSplits(bounds, index, bottleneck, memory, seconds)


def check_brute_force(graph: Graph, splits: BlockSplits, picks: Sequence[int]) -> int:
    """The brute force's memory and bottleneck of the splits ``picks`` against the plan
    ``build_plan`` makes of each; returns how many were checked."""
    for i in picks:
        unit_stage = splits.unit_stage(i, graph.units.num_units)
        stage_of = node_stages(graph.g, graph.units, unit_stage, STAGES)
        part = Partition(stage_of, float(splits.bottleneck[i]), "block boundaries", 0.0)
        for training in (False, True):
            plan = plan_of(graph, part, training=training)
            planned = max(s.memory_bytes for s in plan.stages)
            if abs(planned - splits.memory[training][i]) > STAGES:
                raise AssertionError(
                    f"{graph.name}: split {i} needs {planned} bytes in the plan, "
                    f"{splits.memory[training][i]:.0f} in the brute force (training={training})"
                )
            if not math.isclose(plan.bottleneck, splits.bottleneck[i], rel_tol=1e-9):
                raise AssertionError(f"{graph.name}: split {i} bottleneck differs from the plan's")
            check_memory(graph, stage_of, [s.memory_bytes for s in plan.stages], training)
    return len(picks)


# ---------------------------------------------------------------------- Accelerate


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


# ---------------------------------------------------------------------- one model


def makespan(stage_costs: Sequence[float], chunks: int) -> float:
    """GPipe's predicted step: sum(c)/M + (M - 1) max(c)/M."""
    return sum(stage_costs) / chunks + (chunks - 1) * max(stage_costs) / chunks


def rows_for(graph: Graph, accel: Accelerate, ratios: Sequence[float]) -> dict[str, Any]:
    splits = brute_force(graph)
    bf_floor = splits.floor(False)
    print(
        f"  brute force: {len(splits.index):,} block-boundary splits in {splits.seconds:.2f} s, "
        f"the least memory {bf_floor / GIB:.3f} GiB",
        flush=True,
    )
    started = time.perf_counter()
    fx_budget = smallest_budget(
        lambda b: run_fxpipe(graph, b, training=False).plan is not None, bf_floor, step=1.03
    )
    at_floor = run_fxpipe(graph, fx_budget, training=False).plan
    assert at_floor is not None
    fx_least = max(s.memory_bytes for s in at_floor.stages)
    floor = min(float(fx_least), bf_floor)
    print(
        f"  fxpipe: smallest budget {fx_budget / GIB:.3f} GiB (its split needs "
        f"{fx_least / GIB:.3f}); floor {floor / GIB:.3f} GiB; "
        f"{time.perf_counter() - started:.0f} s",
        flush=True,
    )
    started = time.perf_counter()
    train_floor = smallest_budget(
        lambda b: run_fxpipe(graph, b, training=True).plan is not None,
        splits.floor(True),
        step=1.03,
        tolerance=TRAINING_TOLERANCE,
    )
    print(
        f"  fxpipe's training floor {train_floor / GIB:.2f} GiB "
        f"({time.perf_counter() - started:.0f} s)",
        flush=True,
    )
    started = time.perf_counter()
    rows = []
    picks = {int(np.argmin(splits.memory[False])), int(np.argmin(splits.memory[True]))}
    for ratio in ratios:
        budget = int(math.ceil(ratio * floor))
        rows.append(row_at(graph, accel, splits, ratio, budget, picks))
    rng = np.random.default_rng(0)
    picks.update(int(i) for i in rng.choice(len(splits.index), size=6, replace=False))
    checked = check_brute_force(graph, splits, sorted(picks))
    print(f"  budgets: {time.perf_counter() - started:.0f} s", flush=True)

    def accel_fits(kind: str, activations: bool) -> Callable[[float], bool]:
        def fits(b: float) -> bool:
            m = accel.maps(graph, int(math.ceil(b)))[kind]
            return m.fits_activations if activations else m.fits

        return fits

    started = time.perf_counter()
    smallest = {
        "fxpipe": fx_budget / floor,
        "block_boundary_brute_force": bf_floor / floor,
        **{
            f"accelerate_{kind}{'_with_activations' if act else ''}": smallest_budget(
                accel_fits(kind, act), floor, step=1.1
            )
            / floor
            for kind in ("sequential", "balanced")
            for act in (False, True)
        },
    }
    print(f"  Accelerate's smallest budgets: {time.perf_counter() - started:.0f} s", flush=True)
    found = [s for s in graph.searches if s.fits]
    refused = [s for s in graph.searches if not s.fits]
    return {
        "model": graph.name,
        "nodes": len(graph.gm.graph.nodes),
        "units": graph.units.num_units,
        "param_gib": sum(size for size, _ in graph.estimate.params) / GIB,
        "trace_and_price_s": graph.front_s,
        "lb0": graph.lb0,
        "memory_bound_gib": graph.memory_bound(training=False) / GIB,
        "training_memory_bound_gib": graph.memory_bound(training=True) / GIB,
        "floor_gib": floor / GIB,
        "fx_least_gib": fx_least / GIB,
        "brute_force_floor_gib": bf_floor / GIB,
        "brute_force_splits": len(splits.index),
        "brute_force_s": splits.seconds,
        "brute_force_checked_against_build_plan": checked,
        "training_floor_ratio": train_floor / floor,
        "training_floor_gib": train_floor / GIB,
        "brute_force_training_floor_gib": splits.floor(True) / GIB,
        "smallest_fitting_ratio": smallest,
        "max_search_found_s": max((s.seconds for s in found), default=None),
        "max_search_found_cpu_s": max((s.cpu_s for s in found), default=None),
        "max_search_found_inference_s": max(
            (s.seconds for s in found if not s.training), default=None
        ),
        "max_search_refused_s": max((s.seconds for s in refused), default=None),
        "max_search_refused_before_diagnosis_s": max(
            (s.seconds - s.diagnosis_s for s in refused), default=None
        ),
        "searches": [vars(s) for s in graph.searches],
        "rows": rows,
    }


def row_at(
    graph: Graph,
    accel: Accelerate,
    splits: BlockSplits,
    ratio: float,
    budget: int,
    picks: set[int],
) -> dict[str, Any]:
    """One budget: fxpipe (inference and training), the brute force, Accelerate's maps."""
    fx = run_fxpipe(graph, budget, training=False)
    below = budget < graph.memory_bound(training=True)  # no split can fit: no search
    train = None if below else run_fxpipe(graph, budget, training=True)
    best = splits.best(budget)
    row: dict[str, Any] = {
        "ratio": ratio,
        "budget_gib": budget / GIB,
        "fx_fits": fx.plan is not None,
        "search_s": fx.search.seconds,
        "train_fits": train is not None and train.plan is not None,
        "train_below_bound": below,
        "train_search_s": None if train is None else train.search.seconds,
        "bf_fits": best is not None,
    }
    if fx.plan is not None:
        costs = [s.cost for s in fx.plan.stages]
        row["fx_bottleneck"] = fx.plan.bottleneck
        row["fx_lb0"] = fx.plan.bottleneck / graph.lb0
        row["fx_memory_gib"] = [s.memory_bytes / GIB for s in fx.plan.stages]
        row["fx_how"] = fx.plan.info.get("memory")
        row["step_ratio"] = graph.total / makespan(costs, CHUNKS)
        _, speedup = fx.plan.gpipe_prediction(CHUNKS)
        if not math.isclose(speedup, row["step_ratio"], rel_tol=1e-9):
            raise AssertionError(f"{graph.name}: makespan {row['step_ratio']} != {speedup}")
    if best is not None:
        picks.add(best)
        row["bf_bottleneck"] = float(splits.bottleneck[best])
        row["bf_lb0"] = row["bf_bottleneck"] / graph.lb0
        row["bf_memory_gib"] = float(splits.memory[False][best]) / GIB
        if fx.plan is not None:
            row["fx_over_bf"] = fx.plan.bottleneck / row["bf_bottleneck"]
    for kind, m in accel.maps(graph, budget).items():
        row[f"{kind}_fits"] = m.fits
        row[f"{kind}_fits_act"] = m.fits_activations
        row[f"{kind}_devices"] = m.devices_used
        if m.memory is not None:
            row[f"{kind}_memory_gib"] = [x / GIB for x in m.memory]
        if m.bottleneck is not None:
            row[f"{kind}_lb0"] = m.bottleneck / graph.lb0
            if fx.plan is not None:
                row[f"{kind}_over_fx"] = m.bottleneck / fx.plan.bottleneck
    return row


# ---------------------------------------------------------------------- report


def _yes(value: bool) -> str:
    return "yes" if value else "no"


def _num(key: str, digits: int = 3) -> Callable[[dict[str, Any]], str]:
    return lambda r: "-" if r.get(key) is None else f"{r[key]:.{digits}f}"


COLUMNS: list[tuple[str, Callable[[dict[str, Any]], str]]] = [
    ("x floor", lambda r: f"{r['ratio']:.2f}"),
    ("GiB", _num("budget_gib", 2)),
    ("fx", lambda r: _yes(r["fx_fits"])),
    ("fx/LB0", _num("fx_lb0")),
    ("bf/LB0", _num("bf_lb0")),
    ("fx/bf", _num("fx_over_bf")),
    ("seq", lambda r: _yes(r["sequential_fits"])),
    ("seq+act", lambda r: _yes(r["sequential_fits_act"])),
    ("seq/fx", _num("sequential_over_fx", 2)),
    ("bal", lambda r: _yes(r["balanced_fits"])),
    ("bal+act", lambda r: _yes(r["balanced_fits_act"])),
    ("bal/fx", _num("balanced_over_fx", 2)),
    ("step x", _num("step_ratio", 2)),
    ("search s", _num("search_s", 2)),
    ("train", lambda r: "no*" if r["train_below_bound"] else _yes(r["train_fits"])),
    ("train s", _num("train_search_s", 2)),
]


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f} s"


def summary(result: dict[str, Any]) -> tuple[list[str], dict[str, bool]]:
    """Lines to print and the PASS/FAIL of each target."""
    name = result["model"]
    rows = result["rows"]
    smallest = result["smallest_fitting_ratio"]
    lines = [
        f"smallest budget that fits, x floor: fxpipe {smallest['fxpipe']:.3f}, block-boundary "
        f"brute force {smallest['block_boundary_brute_force']:.3f}, Accelerate sequential "
        f"{smallest['accelerate_sequential']:.3f} as it counts / "
        f"{smallest['accelerate_sequential_with_activations']:.3f} with activations, balanced "
        f"{smallest['accelerate_balanced']:.3f} / "
        f"{smallest['accelerate_balanced_with_activations']:.3f}",
        f"fxpipe's training floor (chunks={CHUNKS}, checkpoint={CHECKPOINT!r}): "
        f"{result['training_floor_ratio']:.2f}x the inference floor "
        f"({result['training_floor_gib']:.2f} GiB)",
        f"lower bounds on any split's busiest stage: inference "
        f"{result['memory_bound_gib']:.2f} GiB (floor / bound "
        f"{result['floor_gib'] / result['memory_bound_gib']:.3f}), training "
        f"{result['training_memory_bound_gib']:.2f} GiB (floor / bound "
        f"{result['training_floor_gib'] / result['training_memory_bound_gib']:.3f})",
        f"searches: {len(result['searches'])}; the longest that found a split "
        f"{_seconds(result['max_search_found_s'])} (inference "
        f"{_seconds(result['max_search_found_inference_s'])}; the most processor time "
        f"{_seconds(result['max_search_found_cpu_s'])}); the longest refusal "
        f"{_seconds(result['max_search_refused_s'])}, of which the search before the "
        f"MemoryPlanError's diagnosis {_seconds(result['max_search_refused_before_diagnosis_s'])}",
    ]
    fitting = [r for r in rows if r["fx_fits"]]
    must_fit = [r for r in rows if r["ratio"] >= 1.0 or r["bf_fits"]]
    missed = [r["ratio"] for r in must_fit if not r["fx_fits"]]
    compared = [r["fx_over_bf"] for r in rows if r.get("fx_over_bf") is not None]
    speedups = [r["step_ratio"] for r in fitting]
    found_s = result["max_search_found_s"]
    refused_s = result["max_search_refused_before_diagnosis_s"]  # the search itself
    targets = {
        f"{name}: fxpipe fits at every budget >= the floor (missed: {missed or 'none'}); "
        f"its smallest budget {smallest['fxpipe']:.4f} x floor": not missed
        and smallest["fxpipe"] <= 1.0 + TOLERANCE,
        f"{name}: fxpipe bottleneck / best block-boundary split <= {TARGET_BOTTLENECK}: "
        f"max {max(compared, default=math.nan):.4f}": bool(compared)
        and max(compared) <= TARGET_BOTTLENECK,
        f"{name}: Accelerate sequential / fxpipe pipelined step (chunks={CHUNKS}) >= "
        f"{TARGET_SPEEDUP}: min {min(speedups, default=math.nan):.2f}": bool(speedups)
        and min(speedups) >= TARGET_SPEEDUP,
        f"{name}: a memory-constrained search that finds a split < {TARGET_SEARCH_S:.0f} s: "
        f"max {_seconds(found_s)}": found_s is not None and found_s < TARGET_SEARCH_S,
        f"{name}: a memory-constrained search that finds no split < {TARGET_SEARCH_S:.0f} s: "
        f"max {_seconds(refused_s)} (with the MemoryPlanError's diagnosis "
        f"{_seconds(result['max_search_refused_s'])})": refused_s is None
        or refused_s < TARGET_SEARCH_S,
    }
    return lines, targets


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--out",
        type=Path,
        default=result_path("giant"),
        help="where to write the JSON results (default: benchmarks/results/giant.json)",
    )
    parser.add_argument("--models", nargs="*", default=list(GIANTS), choices=list(GIANTS))
    parser.add_argument("--ratios", type=float, nargs="*", default=list(RATIOS))
    args = parser.parse_args(argv)
    infer, balanced, accelerate_version = _accelerate()
    accel = Accelerate(infer, balanced)
    _timed_diagnosis()
    torch.set_num_threads(1)
    started = time.perf_counter()
    command = command_line()
    load_before = os.getloadavg()[0]
    print(
        f"command: {command}\ntorch {torch.__version__}, transformers "
        f"{transformers.__version__}, accelerate {accelerate_version}, python "
        f"{platform.python_version()}; {os.cpu_count()} cores, load average {load_before:.2f}",
        flush=True,
    )
    results, verdicts = [], {}
    for name in args.models:
        print(f"\n{name}: tracing and pricing ...", flush=True)
        graph = build_graph(name)
        result = rows_for(graph, accel, args.ratios)
        results.append(result)
        lines, targets = summary(result)
        verdicts.update(targets)
        print(
            f"\n{name}: {result['nodes']:,} nodes, {result['units']:,} units, "
            f"{result['param_gib']:.2f} GiB of parameters; batch {BATCH} x {TOKENS:,} tokens, "
            f"chunks={CHUNKS}, {STAGES} devices; inference floor {result['floor_gib']:.3f} GiB "
            f"per device; trace and price {result['trace_and_price_s']:.1f} s\n"
        )
        print(format_table(result["rows"], COLUMNS))
        print()
        print("\n".join(lines))
    wall = time.perf_counter() - started
    print(
        "\nfx: fxpipe's split fits (inference estimate); /LB0: bottleneck over "
        "max(total/4, heaviest unit); bf: best block-boundary split that fits; seq, bal: "
        "Accelerate's map fits as it counts (weights), +act: with activations (fxpipe's "
        "estimate); seq/fx, bal/fx: bottleneck of Accelerate's map over fxpipe's; step x: "
        "Accelerate's sequential run over fxpipe's pipelined step (chunks=16); train: a split "
        "fits fxpipe's training estimate (no*: the budget is below a lower bound on any "
        "split's training memory, so nothing was searched).\n"
    )
    for text, ok in verdicts.items():
        print(f"{'PASS' if ok else 'FAIL'}  {text}")
    print(f"\nwall time {wall:.0f} s")
    payload = {
        "command": command,
        "date": time.strftime("%Y-%m-%d"),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "accelerate": accelerate_version,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cores": os.cpu_count(),
        "cuda": torch.cuda.is_available(),
        "load_average_before": load_before,
        "load_average_after": os.getloadavg()[0],
        "batch": BATCH,
        "tokens": TOKENS,
        "chunks": CHUNKS,
        "stages": STAGES,
        "checkpoint": CHECKPOINT,
        "targets": {text: ok for text, ok in verdicts.items()},
        "models": results,
        "wall_s": wall,
    }
    return save_json(args.out, payload)


if __name__ == "__main__":
    raise SystemExit(main())
