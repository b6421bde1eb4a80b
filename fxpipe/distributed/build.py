"""``pipeline_schedule``: checks the options, plans the model (from costs one rank measured,
with ``cost="time"``), fixes the activation shapes and checks that every rank planned alike,
then hands over to :class:`DistributedPipeline`.

Activation shapes are found from the example, as torch's static stage metadata: the example
is one step's full batch, split into ``n_microbatches`` equal micro-batches, and the stage
program runs once on fake tensors of one micro-batch (no memory, no device time) to give
each stage's input and output shapes (``shapes.py``). No stage runs on real data before the
first step. A step with other sizes (a sequence length) re-sizes them (``step_shapes.py``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx
from torch import nn
from torch.distributed.pipelining.microbatch import split_args_kwargs_into_chunks
from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class
from torch.utils._pytree import tree_map

from fxpipe.api import Compiled, compile_model
from fxpipe.devices.targets import parse_device
from fxpipe.distributed.mesh import SPLIT_BACKWARD, check_sharding, mesh_layout
from fxpipe.distributed.runner import DistributedPipeline
from fxpipe.distributed.shapes import Metas, example_shapes, meta_like, tensors
from fxpipe.distributed.step_shapes import StepShapes
from fxpipe.errors import ConfigError, FxPipeError, InputError, PlanError
from fxpipe.ir import PRICING_MODES, CostMode, PipelinePlan, StageProgram, TracerName
from fxpipe.options import PlanOptions
from fxpipe.trace.batch_checks import BatchStatistics, check_micro_batches

__all__ = ["pipeline_schedule", "SCHEDULES", "V_SHAPED", "stage_ranks"]

#: Schedule names accepted (case-insensitive), spelled as torch's ``get_schedule_class`` does.
SCHEDULES = (
    "GPipe",
    "1F1B",
    "Interleaved1F1B",
    "LoopedBFS",
    "InterleavedZeroBubble",
    "ZBVZeroBubble",
    "DualPipeV",
)
#: Schedules whose 2 stages per rank sit in a V: rank r holds stages r and 2W - 1 - r.
V_SHAPED = frozenset({"zbvzerobubble", "dualpipev"})
_INTERLEAVED = frozenset({"interleaved1f1b", "interleavedzerobubble"})


def pipeline_schedule(
    model: nn.Module,
    example_input: Any,
    *,
    n_microbatches: int,
    loss_fn: Callable[..., torch.Tensor] | None,
    schedule: str = "gpipe",
    example_kwargs: Mapping[str, Any] | None = None,
    group: dist.ProcessGroup | None = None,
    device: Any = None,
    stages_per_rank: int = 1,
    num_stages: int | None = None,
    cost: CostMode | Callable[[fx.Node], float] = "flops",
    tracer: TracerName = "auto",
    scale_grads: bool = True,
    slack: float = 0.0,
    mesh: Any = None,
    data_parallel: str = "ddp",
) -> DistributedPipeline:
    """Plan ``model`` into ``world_size * stages_per_rank`` stages; build this rank's part.

    Call it on every rank of ``group`` (default: the world) with the same arguments.
    ``example_input`` is one step's batch (a tensor or a tuple of positional arguments;
    keyword arguments in ``example_kwargs``) and must split into ``n_microbatches`` equal
    micro-batches; every ``step`` then gets batches of that many rows, whose other sizes
    (a sequence length) may change from step to step, except where the traced graph fixes
    them (refused on every rank, naming the size). ``loss_fn(output, target)`` sees each
    micro-batch's output in the model's own structure. ``scale_grads`` defaults to True,
    as in torch's schedules: each step's gradients are divided by ``n_microbatches``,
    right for a mean-reduced loss (fxpipe divides each micro-batch loss's gradient, so
    that steps accumulated before an update each count once; torch divides the whole
    ``.grad`` at the end of a step, what earlier steps left in it too). False: the sums
    over the micro-batches, right for a sum-reduced loss; it was the default before, so
    pass it to keep that behaviour. Rank ``r`` holds stages ``r, r + W, ...`` (``r`` and
    ``2W - 1 - r`` for V-shaped schedules).
    ``device`` defaults to the current CUDA device under NCCL, else the CPU. ``num_stages``,
    when given, must equal ``world_size * stages_per_rank``. A model built on the ``meta``
    device is planned as it is; its rank's stages are then materialised (uninitialised)
    for :meth:`DistributedPipeline.load_stage_state_dict`.

    ``cost`` prices the nodes for the split: ``"flops"`` (the default, analytic),
    ``"params"``, a callable ``(node) -> float`` that answers alike on every rank, or
    ``"time"``: group rank 0 profiles every node (forward and backward) on its device and
    broadcasts the measured costs, and every rank plans with them (``"auto"`` is
    ``"flops"``).

    ``mesh``: a 2-D ``DeviceMesh`` with dimensions ``("pp", "dp")`` spanning every rank:
    each ``"dp"`` coordinate is one pipeline replica over its ``"pp"`` group (``group``
    is then not given), every replica makes the same plan, and each stage's replicas
    average their gradients: ``data_parallel="ddp"``, torch's DistributedDataParallel (each
    replica holds its stages' whole parameters), or ``"fsdp"``, FSDP2's ``fully_shard``
    (each holds a ``1 / dp`` shard of every parameter, a ``DTensor``; its optimizer steps
    on the shards; the gathered parameters live from a step's first forward to its last
    backward; a parameter two stages of one rank read stays whole, its gradient averaged
    over ``"dp"`` by ``sync_tied_gradients``). ``example_input`` and every step's batch
    are one replica's; with a mean-reduced loss and ``scale_grads=True`` the gradients are
    those of the mean loss over the global batch.

    Every option is checked on every rank before any communication; a collective then
    checks that all ranks made the same plan (with ``cost="time"``, after the broadcast).
    """
    kind = _check_options(schedule, n_microbatches, stages_per_rank, scale_grads)
    layout = mesh_layout(mesh, group, data_parallel, kind)
    group = layout.pp_group
    options = PlanOptions(
        cost="flops" if cost == "auto" else cost,
        tracer=tracer,
        chunks=n_microbatches,
        slack=slack,
        traffic="relay",
        replicate_weights=True,  # each rank its copy; sync_tied_gradients sums them
        reductions=False,  # torch's schedules give each micro-batch's output to loss_fn
    )
    world = dist.get_world_size(group)
    total = _stage_count(world, stages_per_rank, num_stages, mesh=mesh is not None)
    _check_micro_batches(kind, n_microbatches, world, total)
    target = _default_device(group) if device is None else parse_device(device)
    args = example_input if isinstance(example_input, tuple) else (example_input,)
    kwargs = dict(example_kwargs or {})
    if _model_device(model).type == "meta":
        _check_not_timed(cost)
        args, kwargs = _to_meta((args, kwargs))
    mb_args, mb_kwargs = _first_microbatch(args, kwargs, n_microbatches)
    devices = [target] * total
    if cost == "time":
        timed = options
        measured = _measured_costs(  # with a mesh: one measurement for every replica
            lambda: _compile(model, args, kwargs, devices, timed),
            group if mesh is None else None,
            target,
        )
        options = replace(options, cost=measured)
    compiled = _compile(model, args, kwargs, devices, options)
    plan, program = compiled.plan, compiled.program
    check_micro_batches(compiled.traced, n_microbatches, model, option="n_microbatches")
    binder = compiled.traced.binder
    values = binder.bind(mb_args, mb_kwargs)
    found = example_shapes(model, program, values)
    metas = list(found.metas)
    metas[0] = (tuple(meta_like(t) for t in tensors(mb_args)), metas[0][1])
    _check_weight_part(kind, program, metas)
    ranks = stage_ranks(world, total, v_shaped=kind in V_SHAPED)
    whole = check_sharding(layout, program.modules, ranks)  # what FSDP leaves unsharded
    config = (kind, n_microbatches, stages_per_rank, scale_grads, data_parallel, _shapes(values))
    _check_agreement(plan, program, config, group, target)
    if layout.dp_group is not None:  # and every replica alike
        _check_agreement(plan, program, config, layout.dp_group, target)
    sizes = StepShapes(
        program,
        binder,
        found,
        args,
        kwargs,
        n_microbatches=n_microbatches,
        group=group,
        device=target,
        comm=_comm_device(group, target),
    )
    return DistributedPipeline(
        model,
        plan,
        program,
        binder,
        metas,
        ranks,
        group,
        target,
        kind=kind,
        n_microbatches=n_microbatches,
        loss_fn=loss_fn,
        scale_grads=scale_grads,
        layout=layout,
        idle=found.idle,
        layouts=found.layouts,
        statistics=BatchStatistics.of(compiled.traced, option="n_microbatches"),
        step_shapes=sizes,
        whole=whole,
    )


def _stage_count(
    world: int, stages_per_rank: int, num_stages: int | None, *, mesh: bool = False
) -> int:
    """``world * stages_per_rank``; ConfigError when ``num_stages`` says otherwise."""
    total = world * stages_per_rank
    if num_stages is not None and num_stages != total:
        if mesh:
            raise ConfigError(
                f"num_stages={num_stages} but the mesh's 'pp' dimension has {world} rank(s) "
                f"x stages_per_rank={stages_per_rank} = {total} stages; make the mesh with "
                "pp * stages_per_rank == num_stages"
            )
        raise ConfigError(
            f"num_stages={num_stages} but the group has {world} rank(s) x stages_per_rank="
            f"{stages_per_rank} = {total} stages; launch num_stages / stages_per_rank "
            "processes (torchrun --nproc-per-node) or set stages_per_rank so that "
            "world_size * stages_per_rank == num_stages"
        )
    return total


def _compile(
    model: nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    devices: list[torch.device],
    options: PlanOptions,
) -> Compiled:
    """The relay-mode plan and stage program, with exactly ``len(devices)`` stages."""
    compiled = compile_model(model, args, devices, options, example_kwargs=kwargs, present=False)
    if compiled.plan.num_stages != len(devices):
        raise PlanError(
            f"the plan has {compiled.plan.num_stages} stages but {len(devices)} were asked "
            "for; use fewer processes or a smaller stages_per_rank"
        )
    if isinstance(options.cost, _MeasuredCost):  # measured seconds, not a user's cost function
        costs = replace(compiled.plan.costs, mode="time", unit="s")
        compiled = replace(compiled, plan=replace(compiled.plan, costs=costs))
    return compiled


def _measured_costs(
    profile: Callable[[], Compiled], group: dist.ProcessGroup | None, device: torch.device
) -> _MeasuredCost:
    """``cost="time"`` across processes: group rank 0 profiles every node once (``profile``)
    and broadcasts the table; every rank, rank 0 too, then plans with that one table as a
    callable cost, so the plans agree by construction. When rank 0 fails, every rank
    raises (rank 0 its own error), instead of the others waiting for it."""
    box: list[Any] = [None]
    failure: Exception | None = None
    if dist.get_rank(group) == 0:
        try:
            box[0] = dict(profile().plan.node_cost)
        except Exception as e:
            failure, box[0] = e, f"{type(e).__name__}: {e}"
    src = 0 if group is None else dist.get_global_rank(group, 0)
    dist.broadcast_object_list(box, src=src, group=group, device=_comm_device(group, device))
    if failure is not None:
        raise failure
    if not isinstance(box[0], dict):
        raise FxPipeError(
            f"group rank 0 could not profile the model for cost='time': {box[0]}; fix the "
            "error rank 0 reports, or pass cost='flops'"
        )
    return _MeasuredCost(box[0])


class _MeasuredCost:
    """``(node) -> float``: the cost group rank 0 measured for the node of that name. A name
    rank 0 did not price costs 0: that rank traced another graph, which the agreement
    check then reports on every rank."""

    def __init__(self, table: dict[str, float]) -> None:
        self.table = table

    def __call__(self, node: fx.Node) -> float:
        return float(self.table.get(node.name, 0.0))


def _check_not_timed(cost: Any) -> None:
    if cost == "time":
        raise ConfigError(
            "cost='time' profiles the model by running it, but its parameters are on the "
            "'meta' device, which holds no data; pass cost='flops' (analytic, runs nothing)"
        )


def _comm_device(group: dist.ProcessGroup | None, device: torch.device) -> torch.device:
    """Where collectives of ``group`` put their tensors: the stage device under NCCL."""
    return device if dist.get_backend(group) == "nccl" else torch.device("cpu")


def _check_options(
    schedule: str, n_microbatches: int, stages_per_rank: int, scale_grads: bool
) -> str:
    """The schedule's lower-case name, once every option that needs no peer is checked."""
    if not (dist.is_available() and dist.is_initialized()):
        raise ConfigError(
            "torch.distributed is not initialised; call torch.distributed."
            "init_process_group(backend='gloo' or 'nccl', ...) on every rank first (under "
            "torchrun, init_process_group() reads the rank and world size it sets)"
        )
    kind = str(schedule).lower()
    if kind not in {s.lower() for s in SCHEDULES}:
        raise ConfigError(f"schedule={schedule!r} is not one of {SCHEDULES}; pick one of them")
    for name, value in (("n_microbatches", n_microbatches), ("stages_per_rank", stages_per_rank)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{name}={value!r} must be a whole number >= 1")
    if issubclass(get_schedule_class(kind), PipelineScheduleSingle) and stages_per_rank != 1:
        raise ConfigError(
            f"schedule={schedule!r} runs one stage per rank but stages_per_rank="
            f"{stages_per_rank}; pass stages_per_rank=1, or use a schedule for several "
            "stages per rank such as 'interleaved1f1b'"
        )
    if kind in _INTERLEAVED and stages_per_rank < 2:
        raise ConfigError(
            f"schedule={schedule!r} interleaves several stages per rank but stages_per_rank="
            f"{stages_per_rank}; pass stages_per_rank=2 (or more), or use 'gpipe' or '1f1b'"
        )
    if kind in V_SHAPED and stages_per_rank != 2:
        raise ConfigError(
            f"schedule={schedule!r} places two stages per rank in a V; pass stages_per_rank=2"
        )
    if not isinstance(scale_grads, bool):
        raise ConfigError(f"scale_grads={scale_grads!r} must be True or False")
    return kind


def _check_micro_batches(kind: str, n_microbatches: int, world: int, total: int) -> None:
    """ConfigError for a micro-batch count torch's schedule class refuses when it is built,
    which is after this rank's stages have taken their Parameters from the model: 1F1B and
    DualPipeV need at least one micro-batch per stage, the interleaved schedules rounds of
    equal size (``n_microbatches // world`` of them)."""
    if kind in ("1f1b", "dualpipev") and n_microbatches < total:
        raise ConfigError(
            f"schedule={kind!r} needs at least one micro-batch per stage, but "
            f"n_microbatches={n_microbatches} < {total} stages; pass n_microbatches >= "
            f"{total}, or schedule='gpipe', which runs any number"
        )
    rounds = max(1, n_microbatches // world)
    if kind in _INTERLEAVED and n_microbatches % rounds:
        fit = max(world, n_microbatches - n_microbatches % world)
        raise ConfigError(
            f"schedule={kind!r} runs the micro-batches in {rounds} equal rounds "
            f"(n_microbatches // {world} pipeline ranks), which n_microbatches="
            f"{n_microbatches} does not divide into; pass a multiple of {world}, such as "
            f"n_microbatches={fit}"
        )


def _check_weight_part(kind: str, program: StageProgram, metas: list[Metas]) -> None:
    """ConfigError when a zero-bubble schedule would lose a stage's weight gradients: torch
    runs a stage's weight part (every stage but the first) from where its Parameters' uses
    meet what its inputs reach, and a stage none of whose inputs needs a gradient has no
    such place. Every rank plans alike, so every rank refuses alike."""
    if kind not in SPLIT_BACKWARD:
        return
    for j in range(1, len(program.modules)):
        trained = [n for n, p in program.modules[j].named_parameters() if p.requires_grad]
        if trained and not any(t.requires_grad for t in metas[j][0]):
            raise ConfigError(
                f"stage {j} trains Parameters ({', '.join(trained[:3])}) but none of its "
                f"inputs needs a gradient; schedule={kind!r} splits the backward, and torch "
                "starts a stage's weight part from its inputs, so their gradients would be "
                "lost; use a schedule with a whole backward ('gpipe', '1f1b', "
                "'interleaved1f1b', 'loopedbfs'), or another number of stages"
            )


def _default_device(group: dist.ProcessGroup | None) -> torch.device:
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _model_device(model: nn.Module) -> torch.device:
    for t in list(model.parameters()) + list(model.buffers()):
        return t.device
    return torch.device("cpu")


def _to_meta(value: Any) -> Any:
    return tree_map(lambda t: t.to("meta") if isinstance(t, torch.Tensor) else t, value)


def _first_microbatch(
    args: tuple[Any, ...], kwargs: dict[str, Any], n: int
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The example's first micro-batch; all micro-batches must have the same shape."""
    given = tensors((args, kwargs))
    batch = given[0].shape[0] if given and given[0].ndim else 0
    if batch == 0 or batch % n:
        raise InputError(
            f"the example batch ({batch} rows) does not split into n_microbatches={n} equal "
            "micro-batches; pass one step's full batch as example_input, a multiple of "
            "n_microbatches (torch.distributed.pipelining needs fixed shapes)"
        )
    mb_args, mb_kwargs = split_args_kwargs_into_chunks(args, kwargs, n)
    return mb_args[0], mb_kwargs[0]


def _shapes(values: Any) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(t.shape) for t in tensors(values))


def stage_ranks(world: int, total: int, *, v_shaped: bool) -> tuple[int, ...]:
    """Group rank of every stage: looped (``j mod W``) or V-shaped (there and back)."""
    out = []
    for j in range(total):
        lap, pos = divmod(j, world)
        out.append(world - 1 - pos if v_shaped and lap % 2 else pos)
    return tuple(out)


def _check_agreement(
    plan: PipelinePlan,
    program: StageProgram,
    config: Any,
    group: dist.ProcessGroup | None,
    device: torch.device,
) -> None:
    """All-gather digests of the plan and of the options; FxPipeError on every rank when a
    rank differs from rank 0."""
    split = repr((sorted(plan.stage_of.items()), program.inputs, program.outputs))
    comm = _comm_device(group, device)
    mine = torch.tensor([_digest(split), _digest(repr(config))], dtype=torch.int64, device=comm)
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(everyone, mine, group=group)
    for index, what in enumerate(("plan (stage of every node)", "options or example shapes")):
        odd = [r for r, d in enumerate(everyone) if int(d[index]) != int(everyone[0][index])]
        if odd:
            raise FxPipeError(
                f"rank(s) {odd} computed a different {what} than rank 0; call "
                "pipeline_schedule on every rank with the same model (same construction and "
                "seed), the same example and the same options, with a cost that is the same "
                f"on every rank (one of {PRICING_MODES} or a deterministic callable)"
            )


def _digest(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little", signed=True)
