"""``pipeline_schedule``: makes its options record (every option checked), plans the model
(from costs one rank measured, with ``cost="time"``: ``agreement.py``), fixes the activation
shapes and checks that every rank planned alike, then hands over to
:class:`DistributedPipeline`.

Activation shapes are found from the example, as torch's static stage metadata: the example
is one step's full batch, split into ``n_microbatches`` equal micro-batches, and the stage
program runs once on fake tensors of one micro-batch (no memory, no device time) to give
each stage's input and output shapes (``shapes.py``). No stage runs on real data before the
first step. A step with other sizes (a sequence length) re-sizes them (``step_shapes.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx
from torch import nn
from torch.distributed.pipelining.microbatch import split_args_kwargs_into_chunks
from torch.utils._pytree import tree_map

from fxpipe.compiler import Compiled, traced_once
from fxpipe.devices.targets import parse_device
from fxpipe.distributed.options import (
    SCHEDULES,
    SPLIT_BACKWARD,
    V_SHAPED,
    ScheduleOptions,
    stage_ranks,
)
from fxpipe.distributed.parallel.mesh import check_sharding, comm_device, mesh_layout
from fxpipe.distributed.planning.agreement import MeasuredCost, check_agreement, measured_costs
from fxpipe.distributed.planning.auto import AUTO, choose_schedule
from fxpipe.distributed.planning.tensor_parallel import plan_tensor_parallel, rank_costs
from fxpipe.distributed.rank.asynchronous import batch_statistics
from fxpipe.distributed.rank.runner import DistributedPipeline
from fxpipe.distributed.rank.shapes import Metas, example_shapes, meta_like, shapes_at, tensors
from fxpipe.distributed.rank.step_shapes import StepShapes
from fxpipe.errors import ConfigError, InputError, PlanError
from fxpipe.ir import CostMode, StageProgram, TracerName
from fxpipe.options import CompileChoice, PlanOptions
from fxpipe.passes.tensor.given import GivenPlan
from fxpipe.passes.tensor.sequence import SequenceChoice
from fxpipe.trace.batch_checks import check_micro_batches

__all__ = ["pipeline_schedule", "SCHEDULES", "check_weight_part"]


def pipeline_schedule(
    model: nn.Module,
    example_input: Any,
    *,
    n_microbatches: int | str,
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
    compile: CompileChoice = False,
    tensor_parallel: Any = None,
    sequence_parallel: SequenceChoice = "auto",
    staleness: str = "stash",
    step_every: int | None = None,
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

    ``n_microbatches="auto"`` and/or ``schedule="auto"``: the schedule (with its stages per
    rank, 2 or 4 for a looped one unless ``stages_per_rank`` says) and the micro-batch count
    (a divisor of the batch's rows) with the least step time fxpipe predicts for these
    pipeline ranks (:mod:`fxpipe.distributed.planning.auto`, ``fd.suggest_layout``'s model, priced
    by the roofline of the ranks' device, alike on every rank); what was chosen and from
    what is ``pipe.schedule_choice``, what runs is ``pipe.options``.

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

    ``compile``: each of this rank's stages runs its forward through ``torch.compile``, as
    :func:`fxpipe.pipeline`'s ``compile=`` does (``pipe.compilation`` counts and times it;
    a stage that does not compile runs eagerly with a ``CompileWarning``); with GPipe,
    1F1B, Interleaved1F1B and LoopedBFS, and DDP over a mesh's ``"dp"`` (refused with a
    zero-bubble schedule, whose split backward a compiled stage cannot give, and with FSDP).

    ``tensor_parallel="auto"``: with a 3-D ``mesh`` named ``("pp", "dp", "tp")``, the
    whole graph is planned over the ``"tp"`` dimension
    (:func:`fxpipe.passes.tensor.plan.tensor_plan`, no cut value crossing a stage border;
    ``pipe.tensor_plan.summary()`` says what is cut how) and each stage's local program is
    cut over ``mesh["tp"]`` by torch's tensor parallelism
    (:func:`fxpipe.passes.tensor.parallelize.parallelize_stage`): the Parameters it cuts
    become DTensors (in the model too; ``full_tensor()`` gathers one), and the ranks of one
    ``"tp"`` group hold the same stage and exchange whole activations over their ``"pp"``
    groups. With ``dp`` > 1, ``"fsdp"`` shards the cut Parameters over ``"dp"`` too
    (DTensors on the 2-D ``("dp", "tp")`` mesh), and ``"ddp"`` replicates them with torch's
    ``replicate`` (``DistributedDataParallel`` takes no DTensor Parameters). With
    ``compile=`` each rank's cut program is compiled (its DTensor products traced
    through); the zero-bubble schedules split each rank's backward through its
    tensor-parallel collectives (every rank of a ``"tp"`` group runs the same schedule, so
    they meet alike). A plan in torch's ``parallelize_module``
    form (``{"model.layers.*.mlp.up_proj": ColwiseParallel(), ...}``) overrides the search:
    only the cuts it names are made, each proved as the search proves its own, and one that
    cannot be is refused with the reason (:mod:`fxpipe.passes.tensor.given`). None: no
    tensor parallelism. ``sequence_parallel`` (under ``"auto"``): hold the values between
    row-wise and column-wise products (norms, residual adds, dropouts) cut along the
    sequence where that pays (``"auto"``: a region with a norm that communicates no more
    than the all-reduces it replaces, and one stage output), wherever it can (True), or
    nowhere (False) (:mod:`fxpipe.passes.tensor.sequence`).

    ``schedule="Async1F1B"`` (or ``"async"``): fxpipe's asynchronous pipeline, 1F1B with no
    flush between steps, each stage updating its own weights every ``step_every``
    micro-batches with the optimizer given to ``pipe.schedule.attach``; ``staleness``:
    ``"stash"`` (a micro-batch's backward meets the weights its forward ran with),
    ``"predict"`` (both run with the weights the stage's optimizer is predicted to reach by
    the backward) or ``"none"`` (the backward recomputes the forward with the weights of its
    time). See :mod:`fxpipe.distributed.rank.asynchronous` for the rule and what it refuses.

    Every option is checked on every rank before any communication; a collective then
    checks that all ranks made the same plan (with ``cost="time"``, after the broadcast).
    """
    _check_initialised()
    asked = (n_microbatches, schedule)
    stand_in = "gpipe" if stages_per_rank == 1 else "loopedbfs"  # takes any stages per rank
    options = ScheduleOptions(  # "auto" stands in as one micro-batch, a schedule, until chosen
        n_microbatches=1 if n_microbatches == AUTO else n_microbatches,  # type: ignore[arg-type]
        schedule=stand_in if schedule == AUTO else schedule,
        stages_per_rank=stages_per_rank,
        num_stages=num_stages,
        cost=cost,
        tracer=tracer,
        scale_grads=scale_grads,
        slack=slack,
        data_parallel=data_parallel,
        compile=compile,
        tensor_parallel=tensor_parallel,
        sequence_parallel=sequence_parallel,
        staleness=staleness,
        step_every=step_every,
    )
    example = example_input if isinstance(example_input, tuple) else (example_input,)
    return _build(
        model, (example, dict(example_kwargs or {})), options, loss_fn, group, device, mesh,
        asked,
    )  # fmt: skip


def _build(
    model: nn.Module,
    example: tuple[tuple[Any, ...], dict[str, Any]],
    options: ScheduleOptions,
    loss_fn: Callable[..., torch.Tensor] | None,
    group: dist.ProcessGroup | None,
    device: Any,
    mesh: Any,
    asked: tuple[Any, Any] = (None, None),
) -> DistributedPipeline:
    """:func:`pipeline_schedule` once its options are a checked record: the checks that need
    the group (still before any communication), the choice of what was asked as ``"auto"``
    (``asked``: the ``n_microbatches`` and ``schedule`` given), the plan, the shapes and
    the agreement."""
    layout = mesh_layout(mesh, group, options)
    target = _default_device(layout.pp_group) if device is None else parse_device(device)
    choice = None
    if AUTO in asked:
        pp = dist.get_world_size(layout.pp_group)
        choice = choose_schedule(model, example, options, pp=pp, n_microbatches=asked[0],
                                 schedule=asked[1], device=target)  # fmt: skip
        options = replace(
            options,
            schedule=choice.schedule,
            stages_per_rank=choice.stages_per_rank,
            n_microbatches=choice.n_microbatches,
        )
        layout = mesh_layout(mesh, group, options)
    group = layout.pp_group
    world = dist.get_world_size(group)
    total = options.stage_count(world, mesh=mesh is not None)
    args, kwargs = example
    if _model_device(model).type == "meta":
        _check_not_timed(options.cost)
        args, kwargs = _to_meta((args, kwargs))
    mb_args, mb_kwargs = _first_microbatch(args, kwargs, options.n_microbatches)
    given = options.tensor_parallel if isinstance(options.tensor_parallel, GivenPlan) else None
    # the model traced once (by the first plan) for every plan below: the profile of
    # cost="time" (rank 0's alone: its failure reaches every rank), the plan, the plan again
    # for stages cut over tp
    with traced_once(
        model, args, [target] * total, options.plan_options(), example_kwargs=kwargs,
        present=False,
    ) as planner:  # fmt: skip
        planning = _Planning(planner, model, target, total)
        # with a mesh, cost="time" is measured once for every replica
        compiled = planning.plan(options, group if mesh is None else None)
        if layout.tp_mesh is not None:  # balanced by what one "tp" rank of each stage runs
            compiled = _plan_cut(planning, options, compiled, layout.tp_mesh.size(), given)
    plan, program, binder = compiled.plan, compiled.program, compiled.traced.binder
    values = binder.bind(mb_args, mb_kwargs)
    if target.type != "meta" and any(t.is_meta for t in tensors(values)):
        # a model on meta: its program runs on the rank's device (the trace asserts it)
        found = shapes_at(program, values, target)
    else:
        found = example_shapes(model, program, values)
    metas = list(found.metas)
    metas[0] = (tuple(meta_like(t) for t in tensors(mb_args)), metas[0][1])
    check_weight_part(options.schedule, program, metas)
    ranks = stage_ranks(world, total, v_shaped=options.schedule in V_SHAPED)
    whole = check_sharding(layout, program.modules, ranks)  # what FSDP leaves unsharded
    agreed = (options.schedule, options.n_microbatches, options.stages_per_rank)
    config = (*agreed, options.scale_grads, options.data_parallel, options.staleness,
              options.step_every, _shapes(values))  # fmt: skip
    check_agreement(plan, program, config, group, target)
    if layout.dp_group is not None:  # and every replica alike
        check_agreement(plan, program, config, layout.dp_group, target)
    cut = None
    if layout.tp_mesh is not None:  # every rank plans alike, from the same example
        cut = plan_tensor_parallel(
            plan, values, layout.tp_mesh.size(), given, options.sequence_parallel
        )
    sizes = StepShapes(
        program, binder, found, args, kwargs, n_microbatches=options.n_microbatches,
        group=group, device=target, comm=comm_device(group, target),
    )  # fmt: skip
    built = DistributedPipeline(
        model,
        plan,
        program,
        binder,
        replace(found, metas=tuple(metas)),
        ranks,
        layout,
        target,
        options,
        loss_fn=loss_fn,
        statistics=batch_statistics(compiled.traced, options.schedule),
        step_shapes=sizes,
        whole=whole,
        tensor_plan=cut,
    )
    built.schedule_choice = choice
    return built


def _plan_cut(
    planning: _Planning,
    options: ScheduleOptions,
    compiled: Compiled,
    tp: int,
    given: GivenPlan | None,
) -> Compiled:
    """The plan again for stages cut over ``tp`` ranks: balanced by what one rank of each
    stage runs (where the costs are times), with no border inside a region the
    tensor-parallel plan cuts (a border there would leave the region whole), unless the
    graph then has fewer groups than stages: the borders are then free, and the plan's
    ``tensor_plan.summary()`` names each product a border leaves whole."""
    cost, regions = rank_costs(compiled, tp, given, options.sequence_parallel)
    timed = options if cost is None else replace(options, cost=cost)
    try:
        return planning.plan(timed, None, together=regions)
    except PlanError:
        if cost is None:
            return compiled
        return planning.plan(timed, None)


@dataclass(frozen=True)
class _Planning:
    """How every rank plans one model traced once (``planner``:
    :func:`fxpipe.compiler.traced_once`'s), into ``stages`` stages on ``device``."""

    planner: Callable[[PlanOptions], Compiled]
    model: nn.Module
    device: torch.device
    stages: int

    def plan(
        self,
        options: ScheduleOptions,
        group: dist.ProcessGroup | None,
        together: tuple[frozenset[str], ...] = (),
    ) -> Compiled:
        """The plan every rank makes alike: from the costs group rank 0 of ``group``
        measured (``cost="time"``), else from the record's own cost, with no border inside
        a group of ``together``; ConfigError for an example the micro-batches would change
        the model's results on."""
        planning = replace(options.plan_options(), together=together)
        if options.cost == "time":
            timed = planning
            measured = measured_costs(lambda: self._compile(timed), group, self.device)
            planning = replace(planning, cost=measured)
        compiled = self._compile(planning)
        check_micro_batches(
            compiled.traced, options.n_microbatches, self.model, option="n_microbatches"
        )
        return compiled

    def _compile(self, options: PlanOptions) -> Compiled:
        """The relay-mode plan and stage program, with exactly :attr:`stages` stages."""
        compiled = self.planner(options)
        if compiled.plan.num_stages != self.stages:
            raise PlanError(
                f"the plan has {compiled.plan.num_stages} stages but {self.stages} were asked "
                "for; use fewer processes or a smaller stages_per_rank"
            )
        if isinstance(options.cost, MeasuredCost):  # measured seconds, not a user's function
            costs = replace(compiled.plan.costs, mode="time", unit="s")
            compiled = replace(compiled, plan=replace(compiled.plan, costs=costs))
        return compiled


def _check_not_timed(cost: Any) -> None:
    if cost == "time":
        raise ConfigError(
            "cost='time' profiles the model by running it, but its parameters are on the "
            "'meta' device, which holds no data; pass cost='flops' (analytic, runs nothing)"
        )


def _check_initialised() -> None:
    """ConfigError unless torch.distributed is initialised on this rank."""
    if not (dist.is_available() and dist.is_initialized()):
        raise ConfigError(
            "torch.distributed is not initialised; call torch.distributed."
            "init_process_group(backend='gloo' or 'nccl', ...) on every rank first (under "
            "torchrun, init_process_group() reads the rank and world size it sets)"
        )


def check_weight_part(kind: str, program: StageProgram, metas: list[Metas]) -> None:
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
