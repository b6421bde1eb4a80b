"""The options of a pipeline run one process per stage: one frozen record,
:class:`ScheduleOptions`, every option checked once, on every rank, before any communication;
the schedules' names and where each places the stages; and the checks ``suggest_layout``
shares with the record.

:func:`fxpipe.distributed.pipeline_schedule` keeps its keyword signature and builds the record
from its keywords; what it builds takes the record. What belongs to a run rather than to its
configuration (the model, the example, ``loss_fn``, ``group``, ``mesh``, ``device``) stays a
keyword of ``pipeline_schedule``; :meth:`ScheduleOptions.keywords` turns a record back into
``pipeline_schedule``'s keywords, as for the record a ranked layout gives
(:attr:`fxpipe.distributed.planning.estimate.LayoutEstimate.options`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, fields
from typing import Any, TypeVar

from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class

from fxpipe.errors import ConfigError
from fxpipe.ir import TRACERS, TracerName
from fxpipe.options import (
    CompileChoice,
    CompileOptions,
    CostChoice,
    PlanOptions,
    check_choice,
    check_cost,
    check_slack,
)
from fxpipe.passes.tensor.given import GivenPlan, given_plan
from fxpipe.passes.tensor.sequence import SequenceChoice, check_sequence_choice

__all__ = [
    "ScheduleOptions",
    "SCHEDULES",
    "V_SHAPED",
    "INTERLEAVED",
    "SPLIT_BACKWARD",
    "DATA_PARALLEL",
    "TENSOR_PARALLEL",
    "ASYNC",
    "STALENESS",
    "stage_ranks",
    "rounds",
    "micro_batch_problem",
    "as_items",
    "check_each",
    "check_count",
    "check_schedule",
    "check_data_parallel",
]

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
#: Schedules that interleave several stages per rank, in torch's rounds of micro-batches.
INTERLEAVED = frozenset({"interleaved1f1b", "interleavedzerobubble"})
#: Schedules that split backward into input and weight parts (zero bubble): DDP's hooks do
#: not follow them (its all-reduce misses the weight parts: wrong gradients, no error);
#: FSDP2's reduce-scatter runs once the schedule has run every weight part.
SPLIT_BACKWARD = frozenset({"interleavedzerobubble", "zbvzerobubble", "dualpipev"})
#: The asynchronous schedule (fxpipe's own, not torch's: 1F1B with no flush between steps,
#: each stage updating its weights itself; :mod:`fxpipe.distributed.rank.asynchronous`), and
#: the other name it is taken by.
ASYNC, _ASYNC_ALIAS = "async1f1b", "async"
#: ``staleness=`` values under it: weight stashing, weight prediction, none (recomputation).
STALENESS = ("stash", "predict", "none")
#: ``data_parallel=`` values: torch's DDP, or FSDP2's ``fully_shard``, over the ``"dp"`` group.
DATA_PARALLEL = ("ddp", "fsdp")

_NAMES = {s.lower() for s in SCHEDULES} | {ASYNC, _ASYNC_ALIAS}
_Checked = TypeVar("_Checked")


@dataclass(frozen=True)
class ScheduleOptions:
    """How a model is pipelined one process per stage: the settings of
    :func:`fxpipe.distributed.pipeline_schedule`, under its keywords' names and with its
    defaults. Checked when made, without any peer: ConfigError naming the value and the
    remedy. ``schedule`` is kept in lower case. What depends on the number of ranks
    (``num_stages``, the micro-batches a schedule needs per stage) is checked by
    :meth:`stage_count`."""

    #: Micro-batches per step: each step's batch splits into this many equal ones.
    n_microbatches: int
    #: One of :data:`SCHEDULES`, in any case.
    schedule: str = "gpipe"
    #: Stages on each pipeline rank: 1 for GPipe and 1F1B, 2 for the V-shaped schedules,
    #: 2 or more for the interleaved ones (looped BFS takes any).
    stages_per_rank: int = 1
    #: The stages in all, when given: must be the pipeline ranks x ``stages_per_rank``.
    num_stages: int | None = None
    #: How nodes are priced for the split: ``"flops"`` (``"auto"`` is ``"flops"`` here),
    #: ``"params"``, ``"roofline"``, ``"time"`` (measured by group rank 0, sent to every
    #: rank) or a callable ``(node) -> float`` that answers alike on every rank.
    cost: CostChoice = "flops"
    tracer: TracerName = "auto"
    #: Each micro-batch loss's gradient divided by ``n_microbatches`` (a mean-reduced loss);
    #: False: the sums (a sum-reduced loss).
    scale_grads: bool = True
    #: Fraction the bottleneck stage may grow where that sends fewer bytes between stages.
    slack: float = 0.0
    #: How replicas of a ``(pp, dp)`` mesh share a stage's gradients (one of
    #: :data:`DATA_PARALLEL`); unused without a mesh.
    data_parallel: str = "ddp"
    #: Each of this rank's stage forwards through ``torch.compile`` (``True``, a dict of its
    #: settings or a :class:`fxpipe.options.CompileOptions`; kept as that record, or None).
    compile: CompileChoice = False
    #: ``"auto"``: each stage cut over a mesh's ``"tp"`` dimension as
    #: :func:`fxpipe.passes.tensor.plan.tensor_plan` finds; a plan in torch's
    #: ``parallelize_module`` form (kept as a :class:`GivenPlan`): only the cuts it names;
    #: None: no tensor parallelism.
    tensor_parallel: str | GivenPlan | None = None
    #: Under ``tensor_parallel="auto"``, the values between row-wise and column-wise
    #: products held cut along the sequence where that pays (``"auto"``), wherever it can
    #: (True) or nowhere (False): :mod:`fxpipe.passes.tensor.sequence`.
    sequence_parallel: SequenceChoice = "auto"
    #: Under ``schedule="async1f1b"``: how a stage's backward meets the weights its forward
    #: ran with (one of :data:`STALENESS`).
    staleness: str = "stash"
    #: Under ``schedule="async1f1b"``: each stage updates its weights after this many
    #: micro-batches' backwards (None: ``n_microbatches``, one update per step's worth).
    step_every: int | None = None

    def __post_init__(self) -> None:
        kind = check_schedule("schedule", self.schedule)
        check_count("n_microbatches", self.n_microbatches)
        check_count("stages_per_rank", self.stages_per_rank)
        _check_placement(self.schedule, kind, self.stages_per_rank)
        if not isinstance(self.scale_grads, bool):
            raise ConfigError(f"scale_grads={self.scale_grads!r} must be True or False")
        check_data_parallel("data_parallel", self.data_parallel)
        check_cost(self.cost)
        check_choice("tracer", self.tracer, TRACERS)
        check_slack(self.slack)
        if self.num_stages is not None:
            why = " (or None: the pipeline ranks x stages_per_rank)"
            check_count("num_stages", self.num_stages, why=why)
        object.__setattr__(self, "schedule", kind)
        _check_async(self)
        compiled = CompileOptions.of(self.compile)
        object.__setattr__(self, "compile", compiled)
        if compiled is not None and kind in SPLIT_BACKWARD:
            raise ConfigError(
                f"compile= with schedule={self.schedule!r}: a zero-bubble schedule splits each "
                "stage's backward into its input and weight parts, which a compiled stage "
                "runs as one; use GPipe, 1F1B, Interleaved1F1B or LoopedBFS, or compile=False"
            )
        if isinstance(self.tensor_parallel, Mapping):
            object.__setattr__(self, "tensor_parallel", given_plan(self.tensor_parallel))
        _check_tensor_parallel(self.tensor_parallel)
        _check_sequence_parallel(self.sequence_parallel, self.tensor_parallel)
        if compiled is not None and self.data_parallel == "fsdp":
            raise ConfigError(
                "compile= with data_parallel='fsdp' is not supported (FSDP2 gathers and frees "
                "the stage's parameters around each call); use data_parallel='ddp' or "
                "compile=False"
            )

    def stage_count(self, world: int, *, mesh: bool = False) -> int:
        """The stages of a pipeline over ``world`` ranks, ``world * stages_per_rank``.
        ConfigError when ``num_stages`` says otherwise (``mesh``: the ranks are a mesh's
        ``"pp"`` dimension), or when torch's schedule class would refuse ``n_microbatches``
        for them: it refuses when it is built, which is after this rank's stages have taken
        their Parameters from the model."""
        total = world * self.stages_per_rank
        wanted = self.num_stages
        if wanted is not None and wanted != total:
            if mesh:
                raise ConfigError(
                    f"num_stages={wanted} but the mesh's 'pp' dimension has {world} rank(s) "
                    f"x stages_per_rank={self.stages_per_rank} = {total} stages; make the "
                    "mesh with pp * stages_per_rank == num_stages"
                )
            raise ConfigError(
                f"num_stages={wanted} but the group has {world} rank(s) x stages_per_rank="
                f"{self.stages_per_rank} = {total} stages; launch num_stages / "
                "stages_per_rank processes (torchrun --nproc-per-node) or set "
                "stages_per_rank so that world_size * stages_per_rank == num_stages"
            )
        problem = micro_batch_problem(self.schedule, self.n_microbatches, world, total)
        if problem is not None:
            raise ConfigError(problem)
        return total

    def plan_options(self) -> PlanOptions:
        """How every rank plans the model: boundary values relayed stage by stage (torch
        connects neighbouring stages only), a weight several stages read held by each of
        their ranks (``sync_tied_gradients`` sums the copies' gradients), no reductions
        over the batch inside the model (torch's schedules give each micro-batch's output
        to ``loss_fn``), and ``cost="auto"`` as ``"flops"``."""
        return PlanOptions(
            cost="flops" if self.cost == "auto" else self.cost,
            tracer=self.tracer,
            chunks=self.n_microbatches,
            slack=self.slack,
            traffic="relay",
            replicate_weights=True,
            reductions=False,
        )

    def keywords(self) -> dict[str, Any]:
        """The record as :func:`fxpipe.distributed.pipeline_schedule`'s keywords, so that
        ``pipeline_schedule(model, x, loss_fn=loss_fn, **options.keywords())`` builds the
        pipeline the record describes (the record is made again from them, equal)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


def stage_ranks(world: int, total: int, *, v_shaped: bool) -> tuple[int, ...]:
    """Group rank of every stage: looped (``j mod W``) or V-shaped (there and back)."""
    out = []
    for j in range(total):
        lap, pos = divmod(j, world)
        out.append(world - 1 - pos if v_shaped and lap % 2 else pos)
    return tuple(out)


def rounds(n_microbatches: int, world: int) -> int:
    """torch's rounds of an interleaved schedule: ``max(1, n_microbatches // world)``, which
    must divide ``n_microbatches``."""
    return max(1, n_microbatches // world)


def micro_batch_problem(schedule: str, n_microbatches: int, world: int, total: int) -> str | None:
    """Why torch's class for ``schedule`` (lower case) refuses ``n_microbatches`` over
    ``world`` pipeline ranks and ``total`` stages, with the remedy; None when it runs them.
    1F1B and DualPipeV need at least one micro-batch per stage, the interleaved schedules
    rounds of equal size (``n_microbatches // world`` of them)."""
    if schedule in ("1f1b", "dualpipev") and n_microbatches < total:
        return (
            f"schedule={schedule!r} needs at least one micro-batch per stage, but "
            f"n_microbatches={n_microbatches} < {total} stages; pass n_microbatches >= "
            f"{total}, or schedule='gpipe', which runs any number"
        )
    count = rounds(n_microbatches, world)
    if schedule in INTERLEAVED and n_microbatches % count:
        fit = max(world, n_microbatches - n_microbatches % world)
        return (
            f"schedule={schedule!r} runs the micro-batches in {count} equal rounds "
            f"(n_microbatches // {world} pipeline ranks), which n_microbatches="
            f"{n_microbatches} does not divide into; pass a multiple of {world}, such as "
            f"n_microbatches={fit}"
        )
    return None


#: ``tensor_parallel=`` values besides a plan in torch's form: the plan fxpipe finds, or none.
TENSOR_PARALLEL = ("auto", None)


def _check_tensor_parallel(value: object) -> None:
    """ConfigError unless ``value`` is one of :data:`TENSOR_PARALLEL` or a plan."""
    if not isinstance(value, GivenPlan) and value not in TENSOR_PARALLEL:
        raise ConfigError(
            f"tensor_parallel={value!r} is not one of {TENSOR_PARALLEL}; pass 'auto' (each "
            "stage cut over the mesh's 'tp' dimension as fxpipe plans it), a dict "
            "{module path: ColwiseParallel() | RowwiseParallel()} as parallelize_module "
            "takes, or None"
        )


def _check_sequence_parallel(value: object, tensor_parallel: object) -> None:
    """ConfigError unless ``value`` is one of :data:`SEQUENCE_CHOICES`, and True only where
    fxpipe plans the tensor parallelism."""
    check_sequence_choice(value)
    if value is True and tensor_parallel != "auto":
        raise ConfigError(
            f"sequence_parallel=True with tensor_parallel={tensor_parallel!r}: sequence "
            "parallelism is planned with fxpipe's own plan; pass tensor_parallel='auto', "
            "or leave sequence_parallel at 'auto'"
        )


def _check_placement(schedule: object, kind: str, stages_per_rank: int) -> None:
    """ConfigError unless the schedule ``kind`` (``schedule`` as the caller spelled it) runs
    ``stages_per_rank`` stages on each rank."""
    single = kind == ASYNC or issubclass(get_schedule_class(kind), PipelineScheduleSingle)
    if single and stages_per_rank != 1:
        raise ConfigError(
            f"schedule={schedule!r} runs one stage per rank but stages_per_rank="
            f"{stages_per_rank}; pass stages_per_rank=1, or use a schedule for several "
            "stages per rank such as 'interleaved1f1b'"
        )
    if kind in INTERLEAVED and stages_per_rank < 2:
        raise ConfigError(
            f"schedule={schedule!r} interleaves several stages per rank but stages_per_rank="
            f"{stages_per_rank}; pass stages_per_rank=2 (or more), or use 'gpipe' or '1f1b'"
        )
    if kind in V_SHAPED and stages_per_rank != 2:
        raise ConfigError(
            f"schedule={schedule!r} places two stages per rank in a V; pass stages_per_rank=2"
        )


# ---------------------------------------------------------------------------- checks


def check_schedule(name: str, value: object) -> str:
    """The lower-case name of schedule ``value``; ConfigError unless it is one of
    :data:`SCHEDULES` or :data:`ASYNC` (in any case; ``"async"`` is :data:`ASYNC`)."""
    kind = str(value).lower()
    if kind not in _NAMES:
        raise ConfigError(
            f"{name}={value!r} is not one of {(*SCHEDULES, 'Async1F1B')}; pick one of them"
        )
    return ASYNC if kind == _ASYNC_ALIAS else kind


def _check_async(options: ScheduleOptions) -> None:
    """ConfigError for ``staleness`` or ``step_every`` that are not valid, or given without
    the asynchronous schedule, and for what that schedule does not run with."""
    check_choice("staleness", options.staleness, STALENESS)
    if options.step_every is not None:
        check_count("step_every", options.step_every, why=" (or None: n_microbatches)")
    if options.schedule != ASYNC:
        if options.staleness != "stash" or options.step_every is not None:
            raise ConfigError(
                f"staleness= and step_every= set how schedule='Async1F1B' updates its "
                f"weights, but schedule={options.schedule!r} flushes every step and leaves "
                "the update to your optimizer; drop them, or pass schedule='Async1F1B'"
            )
        return
    refused = {
        "scale_grads=True": (
            options.scale_grads,
            "each stage updates after step_every micro-batches, not after a step's; pass "
            "scale_grads=False (the gradients are the sums over the micro-batches of an "
            "update; divide the loss by step_every for their mean)",
        ),
        f"compile={options.compile!r}": (
            options.compile not in (False, None),
            "its stages run under weight versions (torch.func.functional_call); pass "
            "compile=False",
        ),
        f"tensor_parallel={options.tensor_parallel!r}": (
            options.tensor_parallel is not None,
            "pass tensor_parallel=None",
        ),
        "data_parallel='fsdp'": (
            options.data_parallel == "fsdp",
            "FSDP gathers and frees a stage's weights each step, which the stashed weight "
            "versions would outlive; pass data_parallel='ddp' (each stage's update then "
            "averages its replicas' gradients)",
        ),
    }
    for what, (bad, remedy) in refused.items():
        if bad:
            raise ConfigError(f"schedule='Async1F1B' does not run with {what}: {remedy}")


def check_data_parallel(name: str, value: object) -> str:
    """``value``; ConfigError unless it is one of :data:`DATA_PARALLEL`."""
    if not isinstance(value, str) or value not in DATA_PARALLEL:
        raise ConfigError(
            f"{name}={value!r} is not one of {DATA_PARALLEL}; pass 'ddp' (torch's "
            "DistributedDataParallel over the mesh's 'dp' dimension) or 'fsdp' (FSDP2's "
            "fully_shard over it)"
        )
    return value


def check_count(name: str, value: object, *, least: int = 1, why: str = "") -> int:
    """``value``; ConfigError unless it is a whole number >= ``least`` (``why``: what the
    count is, appended to the message)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ConfigError(f"{name}={value!r} must be a whole number >= {least}{why}")
    return value


def as_items(value: object) -> list[Any]:
    """A sequence option as a list; one value (a string, a number) as a list of it."""
    if isinstance(value, str) or not isinstance(value, Iterable):
        return [value]
    return list(value)


def check_each(
    name: str, value: object, check: Callable[[str, Any], _Checked]
) -> tuple[_Checked, ...]:
    """An option that is one value or a sequence of them, each through ``check(name,
    item)`` (an item of a sequence named ``name[i]``): what ``check`` returns, in order,
    each once. ConfigError for an empty sequence."""
    items = as_items(value)
    if not items:
        raise ConfigError(f"{name}={value!r} is empty; pass one value or a sequence of them")
    if len(items) == 1 and items[0] is value:
        return (check(name, value),)
    return tuple(dict.fromkeys(check(f"{name}[{i}]", item) for i, item in enumerate(items)))
