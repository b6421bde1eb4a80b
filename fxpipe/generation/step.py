"""One step of generation as a stage program on the pipeline's borders: the model traced by
torch.export with its key/value cache as inputs that its attention writes in place, then
split as the pipeline's plan splits the model, so each stage holds its own layers' cache.

A step takes ``input_ids`` and ``position_ids`` of ``(rows, tokens)``, an ``attention_mask``
of ``(rows, length)`` over the whole cache (1 where a position holds a token of the row), the
step's absolute positions ``cache_position`` of ``(tokens,)`` and every layer's keys and
values; it returns the logits of each row's last position. Two variants share one split:
*prefill* (a prompt of several tokens) and *decode* (one token per row), and each exists once
for a lane of one row (torch.export fixes a size of one into the graph). An encoder-decoder
has three: *encode* (its encoder over the prompts), *prefill* (the decoder's first token,
whose cross-attention layers write their keys and values from the encoder's output into
their caches) and *decode* (which reads them there). No weight and no cache moves between
variants: their stages follow the first plan's borders (:mod:`fxpipe.passes.split.follow`).
"""

from __future__ import annotations

import contextlib
import io
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import chain
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from fxpipe.devices.targets import model_device
from fxpipe.errors import ConfigError
from fxpipe.generation.cache import CacheLayout, error_line
from fxpipe.generation.forms import KINDS, SEQ2SEQ_INPUTS, STEP_INPUTS, StepKind, step_form
from fxpipe.ir import PipelinePlan, StageProgram
from fxpipe.model_state import preserved
from fxpipe.passes.partition.cost_graph import REPLICATED, replicate_shared_weights, to_networkx
from fxpipe.passes.partition.search import Partition
from fxpipe.passes.price.estimate import ValueDependentError, borrowed_costs, estimate_costs
from fxpipe.passes.split.codegen import split_stages
from fxpipe.passes.split.follow import follow_borders
from fxpipe.passes.split.plan import build_plan
from fxpipe.trace.constants import fill_meta_constants, place_constants
from fxpipe.trace.shapes import replicate_shape_queries
from fxpipe.trace.tracing import merge_aliased_attributes
from fxpipe.weights.materialise import placed_view

__all__ = ["StepKind", "KINDS", "StepVariant", "trace_step", "STEP_INPUTS", "SEQ2SEQ_INPUTS"]


@dataclass(frozen=True)
class StepVariant:
    """A generation step split into the pipeline's stages."""

    kind: StepKind
    #: Traced for lanes of one row (torch.export fixes a size of one), else of several.
    one_row: bool
    plan: PipelinePlan
    program: StageProgram
    #: The stage whose module writes each cache tensor (keys, values of layer 0, ...).
    cache_stage: tuple[int, ...]
    #: The step's inputs before its cache tensors (the encoder's step has no cache).
    inputs: int = len(STEP_INPUTS)

    @property
    def layer_stages(self) -> tuple[int, ...]:
        """The stage holding each layer's cache (its keys and values sit together)."""
        return self.cache_stage[0::2]

    def sizes(self, values: list[Any]) -> tuple[int, int, int]:
        """(rows, cache length, encoder's length) of a step over ``values`` (this variant's
        inputs): the encoder's step holds no cache; a decoder-only model's reads no
        encoder's output."""
        rows = int(values[0].shape[0])
        if self.kind == "encode":
            return rows, 0, 0
        source = int(values[4].shape[1]) if self.inputs == len(SEQ2SEQ_INPUTS) else 0
        return rows, int(values[1].shape[1]), source

    def fits(self, kind: StepKind, rows: int) -> bool:
        """Whether this variant runs a step of ``kind`` over ``rows`` rows."""
        return self.kind == kind and self.one_row == (rows == 1)


def trace_step(
    model: nn.Module,
    leader: PipelinePlan,
    leader_program: StageProgram,
    layout: CacheLayout,
    argument: str,
    *,
    kind: StepKind,
    rows: int,
    floor: tuple[int, ...] = (),
) -> StepVariant:
    """The step of ``kind`` over lanes of ``rows`` rows traced and split along ``leader``'s
    borders. The model is traced on its own tensors where they share one device; on the CPU
    where they lie on the CPU and ``meta`` (a rank's model: the other stages' weights on
    ``meta`` get CPU storage for the trace, so code that asks the device runs its CPU
    branch); else on ``meta`` views of them. The model is left as it was."""
    place = model_device(model)
    view, traced_on = placed_view(model, place)
    form = step_form(model, layout, argument, kind, rows, traced_on)
    example = form.example
    with preserved(model), view, _quiet():
        try:
            program = torch.export.export(
                form.module, example, strict=False, dynamic_shapes=form.dynamic
            )
        except Exception as e:
            raise ConfigError(
                f"pipelined generate() could not trace {type(model).__name__}'s {kind} step "
                f"with a static cache as stage state: torch.export said {error_line(e)} (a "
                "model whose attention slices its cache by the positions written so far, "
                "for one, needs a cache that grows); call the model's own generate() on one "
                "device"
            ) from e
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*not properly registered")
            unlifted = program.module()
    gm = _flat(unlifted, form.inputs, form.small)
    if place is None:
        fill_meta_constants(gm, [leader.graph_module], model)
    if any(n.meta.get(REPLICATED, False) for n in leader.graph_module.graph.nodes):
        replicate_shared_weights(gm)  # each process holds its copy: no weight is ever sent
    caches = example[form.inputs] if len(example) > form.inputs else []
    example_values = tuple(chain(example[: form.inputs], caches))
    try:
        costs = estimate_costs(gm, example_values, mode="roofline", device=leader.devices[0])
    except ValueDependentError:
        costs = borrowed_costs(gm, leader.costs)
    g = to_networkx(gm, costs)
    stage_of = _caches_beside_attention(gm, follow_borders(leader, gm, g), form.inputs)
    if floor:
        stage_of = _caches_at(gm, stage_of, form.inputs, floor)
    plan = build_plan(
        gm, costs, g,
        Partition(stage_of, 0.0, "follow", 0.0, "direct"),  # caches go to their stage only
        leader.devices, chunks=1, checkpoint="never", training=False,
    )  # fmt: skip
    split = split_stages(plan, unlifted._out_spec, traffic="direct")
    place_constants(split.modules, plan.devices, model)
    names = [n.name for n in gm.graph.nodes if n.op == "placeholder"][form.inputs :]
    cache_stage = tuple(_reader(split, name) for name in names)
    return StepVariant(kind, rows == 1, plan, split, cache_stage, form.inputs)


def _caches_beside_attention(
    gm: fx.GraphModule, stage_of: dict[str, int], inputs: int
) -> dict[str, int]:
    """``stage_of`` with what a layer computes from its keys' cache alone, or from its
    values' alone (the in-place write, its views, a copy repeating heads), moved to the stage
    of the first nodes that read both (the attention): a border of the first plan between a
    layer's key and value projections would otherwise send the whole cache over it every
    step, where now the step's new keys or values cross it."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    caches = placeholders[inputs:]
    out = dict(stage_of)
    for keys, values in zip(caches[0::2], caches[1::2], strict=True):
        from_keys, from_values = _downstream(keys), _downstream(values)
        both = from_keys & from_values
        alone = (from_keys | from_values) - both
        readers = [n for n in both if any(a in alone for a in n.all_input_nodes)]
        if not readers:
            continue
        target = min(out[n.name] for n in readers)
        for n in alone:
            out[n.name] = max(out[n.name], target)
    return out


def _caches_at(gm: fx.GraphModule, stage_of: dict[str, int], inputs: int,
               floor: tuple[int, ...]) -> dict[str, int]:  # fmt: skip
    """``stage_of`` with each cache tensor's readers on stage ``floor[i]`` at least (the
    stage an earlier variant keeps it on) and every later node no earlier than its inputs:
    where the first plan's border cuts a cross-attention between its query and its key and
    value projections, the step that computes the keys and values from the encoder's output
    runs the attention on the projections' stage, and the steps that read them from the
    cache must too. ConfigError where that would move a node away from a weight it reads."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    out = dict(stage_of)
    for cache, stage in zip(placeholders[inputs:], floor, strict=True):
        for n in _downstream(cache):
            out[n.name] = max(out[n.name], stage)
    for n in gm.graph.nodes:
        if n.op in ("placeholder", "get_attr", "output"):
            continue
        before = [out[a.name] for a in n.all_input_nodes if a.op != "get_attr"]
        out[n.name] = max([out[n.name], *before])
        weights = [
            a for a in n.all_input_nodes if a.op == "get_attr" and out[a.name] != out[n.name]
        ]
        if weights and out[n.name] != stage_of[n.name]:
            raise ConfigError(
                f"pipelined generate() would run {n.name} on stage {out[n.name]}, away from "
                f"the weight {weights[0].target} on stage {out[weights[0].name]}, to keep a "
                "cache where another step keeps it; call the model's own generate() on one "
                "device"
            )
    return out


def _downstream(start: fx.Node) -> set[fx.Node]:
    """The nodes that read ``start``'s value, directly or through others (not the output)."""
    seen: set[fx.Node] = set()
    todo = [start]
    while todo:
        for user in todo.pop().users:
            if user.op != "output" and user not in seen:
                seen.add(user)
                todo.append(user)
    return seen


def _reader(program: StageProgram, name: str) -> int:
    """The one stage whose module takes input ``name``."""
    readers = [j for j, names in enumerate(program.inputs) if name in names]
    if len(readers) != 1:
        raise ConfigError(
            f"cache input {name} is read by stages {readers}, not one: its layer's attention "
            "is cut by a stage border; pipelined generate() cannot keep that cache on one device"
        )
    return readers[0]


def _flat(unlifted: nn.Module, inputs: int, small: tuple[int, ...]) -> fx.GraphModule:
    """The exported module with one placeholder per input leaf, its guard call dropped, one
    ``get_attr`` per tensor object (a tied head reads the embedding's) and every shape query
    read in several places copied per reader (so that one layer's cache length read by
    every layer ties no layers together)."""
    assert isinstance(unlifted, fx.GraphModule)
    graph = unlifted.graph
    graph._codegen = fx.graph.CodeGen()
    for node in list(graph.nodes):
        if node.op == "call_module" and str(node.target).startswith("_guards") and not node.users:
            graph.erase_node(node)
    gm = fx.GraphModule(unlifted, graph, "GenerationStep")
    merge_aliased_attributes(gm)
    _sizes_off_caches(gm, inputs, small)
    replicate_shape_queries(gm)
    gm.recompile()
    return gm


def _sizes_off_caches(gm: fx.GraphModule, inputs: int, small: tuple[int, ...]) -> None:
    """Read every size the step takes from a cache tensor (its rows, its length) or from
    the encoder's output off the ``small`` inputs instead (input_ids, the masks), where
    they have that size: torch.export reads a size shared by many inputs from any one of
    them, and a stage that read a later layer's cache for it would pull that cache onto
    its device (and a decode step that read the encoder's output would be sent it)."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    firsts = [placeholders[i] for i in small]
    caches = set(placeholders) - set(firsts)
    for node in gm.graph.nodes:
        if node.target is not torch.ops.aten.sym_size.int or node.args[0] not in caches:
            continue
        size = node.meta.get("val")
        for first in firsts:
            shape = getattr(first.meta.get("val"), "shape", ())
            found = [d for d, s in enumerate(shape) if _same_size(s, size)]
            if found:
                node.args = (first, found[0])
                break


def _same_size(a: Any, b: Any) -> bool:
    """Whether two sizes recorded by torch.export are the same symbol (a fixed size, an int,
    is never read from a placeholder)."""
    if isinstance(a, torch.SymInt) and isinstance(b, torch.SymInt):
        return bool(a.node.expr == b.node.expr)
    return False


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """torch.export prints partial graphs when it fails."""
    sink = io.StringIO()
    with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
        yield
