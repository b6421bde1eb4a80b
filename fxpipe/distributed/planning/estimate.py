"""What fxpipe's cost model predicts for one pipeline x data-parallel layout of a model: its
step time and its memory per rank (:class:`LayoutEstimate`), and the formulas.

A layout is ``pp`` pipeline ranks x ``dp`` replicas (``pp * dp == world_size``), ``v``
stages per rank (rank r holds stages r, r + pp, ...: torch's looped placement; for ZBV and
DualPipeV, a V, below), ``m`` micro-batches per replica and a schedule. ``example_input`` is
the global batch: each replica gets ``batch / dp`` rows in ``m`` equal micro-batches (``dp``
must divide the batch, ``m`` the replica's rows). The model is traced and priced once, for
the whole batch; each stage count ``pp * v`` is split once by fxpipe's own search, with
relayed boundary values, as ``fd.pipeline_schedule`` plans it (pass it the same ``slack``).

Step time. A stage's cost (FLOP / ``device_flops``, or roofline or profiled seconds) is for
the whole batch, so one micro-batch takes ``t_j = cost_j / (dp m)`` (the roofline's
per-kernel and per-weight cost, found by pricing at one and two micro-batches, is added once
per micro-batch), and so is the runtime's own cost per stage pass (:class:`RuntimeCosts`,
measured per kind of device: 2 passes, forward and backward, and where the backward is split
a cost per Parameter for its weight part computed apart). ``T_r`` sums rank r's stages;
``C_r`` moves the values entering them from another rank (activations forward, gradients
back, relayed ones included) over ``link_bandwidth``, and pays the runtime's cost per
message on each side of every border between ranks: one per value crossing it per
micro-batch, one more where its gradient comes back; ``G_r`` is the bytes of its gradients::

    compute   = m * max_r T_r                              busy time of the busiest rank
    bubble    = z (sum_r T_r - max_r T_r) / v              fill and drain
    pipeline  = m * max_r U_r + z (sum_r U_r - max_r U_r) / v,   U_r = T_r + C_r
    p2p       = pipeline - compute - bubble                sends the critical path waits for
    allreduce = 2 (dp - 1) / dp * max_r G_r / dp_bandwidth ring all-reduce, not overlapped
    step      = pipeline + allreduce

where ``z`` is 1 but for the zero-bubble schedules (below). With equal ranks,
``bubble / compute`` is Narayanan et al.'s bubble time fraction (SC'21,
"Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM", §2.2):
``(p - 1) / m`` for GPipe and 1F1B ("the time spent in the bubble is the same"), and
``(1 / v) (p - 1) / m`` for the interleaved schedule, whose stage passes take ``t / v``;
unequal ranks run at the busiest one's pace and pay the others' once, in the fill. Sends
are not overlapped with compute, so v stages per rank send v times as much (the paper:
"the amount of communication also increases by v"). Looped schedules need ``m >= pp``
(the paper asks for a multiple of ``pp``; torch's interleaved 1F1B, a multiple of its
rounds, ``max(1, m // pp)``). Looped BFS (Lamy-Poirier, MLSys 2023, "Breadth-First Pipeline
Parallelism") loops the stages over the ranks as interleaving does and gets the same fill
here; what it gains, reducing gradients (and FSDP's gathers) while later stages compute, is
not modelled.

Zero bubble (Qi et al., ICLR 2024, "Zero Bubble Pipeline Parallelism") splits each backward
into an input-gradient and a weight-gradient pass and fills the bubble with the latter. With
forward, input and weight passes of equal time its authors give 1F1B a bubble rate of
``(p - 1) / m`` and ZB1P ``(p - 1) / (3 m)``. torch's orders, played out pass by pass with
equal passes (``tests/distributed/planning/test_layout.py`` does it for every schedule here), leave
the same third for all three zero-bubble schedules: interleaved zero bubble (ZB1P looped
over ``v`` stages per rank), ZBV and DualPipeV idle only while the first micro-batch's
forward reaches the last rank, ``p - 1`` forward passes of the ``3 v m`` a rank runs (the
authors' comparison lists ZBV with no bubble; torch's ZBV order idles that fill too). So the
fill term above is multiplied by ``z = 1/3`` for them where every pass is a matrix product;
where element-wise work has no weight part to fill the bubble with,
``z = (F + B - W) / (F + B + W)``, the authors' ZB-H1 bubble over 1F1B's, ``W`` the weight
parts' share of the cost (a third of every node that multiplies by a weight matrix;
:func:`idle_fill`). ZBV and DualPipeV place ``2 pp`` stages in a V (rank r holds r and
``2 pp - 1 - r``: the border at the V's tip sends nothing); ZBV needs ``m >= 2 pp - 1``
micro-batches (its count to fill the V), DualPipeV ``m >= 2 pp`` (one per stage, torch's
check). DualPipeV runs a forward and a backward of the V's two stages together
(DeepSeek-V3's overlap of computation with communication), which this model does not price:
its passes run one after the other, as on one CPU thread. A backward computed in two passes
costs more than in one where its kernels run apart (on one CPU thread here, 4-15% more time
for a rank's work under ZBV than under GPipe: ``benchmarks/distributed.py``); that is not
priced either. With replicas the zero-bubble schedules run under FSDP only, as
``fd.pipeline_schedule`` decides: the others are left out. FSDP leaves a weight two stages
of one rank read (a tied embedding and head on a V's first rank) whole on each replica (on a
torch whose ``fully_shard`` cannot, such layouts are left out too).

Memory per rank, in training: :func:`fxpipe.passes.split.plan.stage_memory` of each of its
stages (weights, gradients and two Adam moments, and the activations fxpipe estimates the
stage keeps for backward), its activations scaled to the micro-batches in flight at the
rank's peak, plus one more copy of the gradients when ``dp > 1`` (DDP's buckets: torch's
``gradient_as_bucket_view=False`` default; under tensor parallelism ``"ddp"`` is torch's
``replicate``, whose all-reduce runs on one flat copy of a stage's gradients, the same
size). With ``data_parallel="fsdp"`` (FSDP2, as
``fd.pipeline_schedule`` runs it: gathered from a step's first forward to its last
backward) a rank holds its stages' whole weights and gradients while the step runs, and
``1 / dp`` of the weights, gradients and Adam moments in between: ``2 + 4 / dp`` copies of
the parameters instead of DDP's ``4 + 1``. Its gather of the weights and reduce-scatter of
the gradients move what DDP's all-reduce moves, ``2 (dp - 1) / dp`` of the gradients,
priced alike. In flight: all ``m`` for GPipe; ``min(m, pp - r)``
for 1F1B ("activations to be stashed for p or fewer microbatches", ibid.); for interleaved
1F1B torch's warm-up count plus one, ``(v - 1) * (m // rounds) + 2 (pp - 1 - r) + 1`` stage
passes (at most ``m v``), spread evenly over the rank's stages and rounded up to whole
micro-batches; for interleaved zero bubble ``(v - 1) * (m // rounds) + pp`` (a shorter
warm-up, and the weight passes ``r`` behind, whose activations stay until they run); for
ZBV and DualPipeV ``2 pp - r`` on rank r's first stage and ``r + 1`` on its second (each
at most ``m``);
for looped BFS, which runs every forward of a stage before the next, all ``m`` of every
stage. These are the peaks of torch's own orders (its schedule classes' action lists).
``fd.pipeline_schedule`` checkpoints nothing: ``checkpoint="never"``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from fxpipe.distributed.options import (
    SPLIT_BACKWARD,
    V_SHAPED,
    ScheduleOptions,
    rounds,
    stage_ranks,
)
from fxpipe.distributed.parallel.mesh import can_leave_whole, shared_on_a_rank
from fxpipe.distributed.planning.priced import Priced, Split
from fxpipe.ir import PricingMode, TracerName
from fxpipe.passes.partition.memory import param_copies
from fxpipe.passes.split.plan import stage_memory

__all__ = [
    "LayoutEstimate",
    "ranks_of",
    "placement",
    "runs",
    "whole_parameters",
    "estimate",
    "in_flight",
    "idle_fill",
    "RuntimeCosts",
    "RUNTIME_COSTS",
    "NO_RUNTIME_COSTS",
    "runtime_costs_for",
]


def idle_fill(schedule: str, weight_share: float) -> float:
    """The part of the fill and drain ``schedule`` leaves idle: 1 for the schedules that do
    not split backward; for the zero-bubble ones, what the weight passes cannot fill,
    ``(F + B - W) / (F + B + W)`` (the authors' ZB-H1 bubble, (p - 1)(T_F + T_B - T_W),
    over 1F1B's), with ``W`` the weight-gradient share of a pass's forward + backward
    (``weight_share``): a third, the ZB1P ``(p - 1) / 3m`` against ``(p - 1) / m``, where
    every node is a matrix product (forward, input and weight parts of equal time), more
    where element-wise work has no weight part to fill with."""
    if schedule not in SPLIT_BACKWARD:
        return 1.0
    return min(max(1.0 - 2.0 * weight_share, 1.0 / 3.0), 1.0)


@dataclass(frozen=True)
class RuntimeCosts:
    """The distributed runtime's fixed costs on one kind of device, in seconds."""

    #: Per stage pass: a forward, a backward, or either half of a split backward (torch's
    #: schedule running one action, fxpipe's stage wrapper around the stage's graph).
    pass_s: float
    #: Per point-to-point message: a send or a receive of one border's values for one
    #: micro-batch (posting it and waiting for it, besides its bytes over the link).
    message_s: float
    #: Per Parameter of a stage whose backward is split, per micro-batch: the weight part
    #: computed apart (torch's weight pass calls autograd once per group of Parameters).
    weight_s: float = 0.0


#: Per kind of device. CPU (gloo): ``python -m benchmarks.autoconfig_distributed
#: --calibrate`` on a 2-core x86 machine, 2 processes, stages of tiny products, fitted to
#: GPipe's, interleaved 1F1B's, interleaved zero bubble's and ZBV's added time per
#: micro-batch (1.54, 4.10, 5.18 and 4.20 ms, fitted within 1%): 284 us per pass, 493 us
#: per message, 136 us per Parameter of a split backward (two runs; the split between pass
#: and message moved by a third between them, their sum much less). CUDA (NCCL), not
#: measured: a pass and a weight part are the same host work, and a message NCCL's
#: small-message latency with the posting and the wait around it, some tens of
#: microseconds.
RUNTIME_COSTS: Mapping[str, RuntimeCosts] = {
    "cpu": RuntimeCosts(pass_s=280e-6, message_s=490e-6, weight_s=135e-6),
    "cuda": RuntimeCosts(pass_s=280e-6, message_s=50e-6, weight_s=135e-6),
}
#: No fixed costs: the formulas alone (what :func:`estimate` defaults to).
NO_RUNTIME_COSTS = RuntimeCosts(pass_s=0.0, message_s=0.0)


def runtime_costs_for(device_type: str) -> RuntimeCosts:
    """The distributed runtime's costs on a kind of device (a GPU's for any kind but the
    CPU)."""
    return RUNTIME_COSTS.get(device_type, RUNTIME_COSTS["cuda"])


@dataclass(frozen=True)
class LayoutEstimate:
    """One layout and what fxpipe's cost model predicts for one training step of it."""

    #: Pipeline ranks, data-parallel replicas (``pp * dp * tp`` is the world size).
    pp: int
    dp: int
    #: Stages per pipeline rank (1 for GPipe and 1F1B).
    virtual: int
    #: Micro-batches per replica per step, and the rows in each.
    chunks: int
    micro_batch: int
    schedule: str
    #: Predicted seconds per step: ``compute_s + bubble_s + p2p_s + allreduce_s``.
    step_s: float
    #: Busy time of the busiest rank: ``chunks * max(rank_s)``.
    compute_s: float
    #: Fill and drain: ``(sum(rank_s) - max(rank_s)) / virtual``.
    bubble_s: float
    #: ``bubble_s / compute_s``: Megatron-LM's bubble time fraction, (pp - 1) / (v m) at most.
    bubble: float
    #: Point-to-point sends the critical path waits for.
    p2p_s: float
    #: Ring all-reduce of the busiest rank's gradients over the replicas.
    allreduce_s: float
    #: Estimated peak bytes of the rank that needs most.
    memory_bytes: int
    #: ``memory_bytes <= max_memory`` (True when no ``max_memory`` was given).
    fits: bool
    #: Forward + backward seconds of one micro-batch on each pipeline rank (its stages summed).
    rank_s: tuple[float, ...]
    #: How the replicas share a stage's gradients: ``"ddp"`` (each holds every parameter;
    #: also the value when ``dp == 1``) or ``"fsdp"`` (each holds a ``1 / dp`` shard).
    data_parallel: str = "ddp"
    #: How the nodes were priced for the split, the tracer asked for and the slack the split
    #: was made with: what ``fd.pipeline_schedule`` is passed to split the stages alike.
    cost: PricingMode = "flops"
    tracer: TracerName = "auto"
    slack: float = 0.0
    #: The part of the fill and drain left idle: 1, less for the zero-bubble schedules
    #: (:func:`idle_fill`).
    fill: float = 1.0
    #: Tensor-parallel ranks each stage's work is cut over (``tensor_parallel="auto"`` on a
    #: mesh with a ``"tp"`` dimension of this size; the step and memory are one rank's).
    tp: int = 1

    @property
    def stages(self) -> int:
        """Stages of the pipeline: ``pp * virtual``."""
        return self.pp * self.virtual

    @property
    def options(self) -> ScheduleOptions:
        """This layout as ``fd.pipeline_schedule``'s options: its schedule, ``chunks``
        micro-batches, ``virtual`` stages per rank and ``pp * virtual`` in all, its
        ``data_parallel``, and the pricing, tracer and slack its stages were split with. On
        every rank, with a ``(pp, dp)`` mesh when ``dp > 1`` and the rank's replica's rows
        (``chunks * micro_batch`` of them) as ``x``::

            pipe = fd.pipeline_schedule(model, x, loss_fn=loss_fn, mesh=mesh,
                                        **estimate.options.keywords())

        ``pipeline_schedule`` checks that the ranks make ``num_stages``; every layout
        ``suggest_layout`` ranks has micro-batches its schedule runs. With ``tp > 1``:
        ``tensor_parallel="auto"`` on a ``("pp", "dp", "tp")`` mesh."""
        return ScheduleOptions(
            n_microbatches=self.chunks,
            schedule=self.schedule,
            stages_per_rank=self.virtual,
            num_stages=self.stages,
            cost=self.cost,
            tracer=self.tracer,
            slack=self.slack,
            data_parallel=self.data_parallel,
            tensor_parallel="auto" if self.tp > 1 else None,
        )


def ranks_of(schedule: str, pp: int, v: int) -> tuple[int, ...]:
    """The pipeline rank of every stage, as ``fd.pipeline_schedule`` places them (looped:
    r, r + pp, ...; a V: r and 2 pp - 1 - r)."""
    return stage_ranks(pp, pp * v, v_shaped=schedule in V_SHAPED)


def placement(schedule: str, pp: int, v: int) -> list[tuple[int, ...]]:
    """The stages of each pipeline rank, in order (:func:`ranks_of` by rank)."""
    ranks = ranks_of(schedule, pp, v)
    return [tuple(j for j, rank in enumerate(ranks) if rank == r) for r in range(pp)]


def runs(split: Split, schedule: str, pp: int, v: int, dp: int, data_parallel: str) -> bool:
    """Whether ``fd.pipeline_schedule`` runs the layout: with replicas, a zero-bubble
    schedule only under FSDP (DDP's all-reduce misses the weight parts), and FSDP where a
    Parameter is read by two stages of one rank only on a torch whose ``fully_shard`` can
    leave it whole."""
    if dp == 1:
        return True
    if data_parallel == "ddp":
        return schedule not in SPLIT_BACKWARD
    return can_leave_whole() or not whole_parameters(split, schedule, pp, v)


def whole_parameters(split: Split, schedule: str, pp: int, v: int) -> frozenset[int]:
    """The Parameters FSDP leaves whole in this placement: read by two stages of one rank."""
    return frozenset(shared_on_a_rank(split.params, ranks_of(schedule, pp, v)))


def estimate(
    split: Split,
    priced: Priced,
    shape: tuple[int, int, int, int],
    schedule: str,
    checkpoint: str,
    rates: tuple[float, float],
    data_parallel: str = "ddp",
    costs: RuntimeCosts = NO_RUNTIME_COSTS,
) -> LayoutEstimate:
    pp, dp, v, m = shape
    ranks = placement(schedule, pp, v)
    rank_of = ranks_of(schedule, pp, v)
    share = 1.0 / (dp * m)  # of the global batch, per micro-batch
    apart = costs.weight_s if schedule in SPLIT_BACKWARD else 0.0  # per Parameter
    t = [
        s * share + f + 2 * costs.pass_s + apart * len(held)
        for s, f, held in zip(split.scaled_s, split.fixed_s, split.params, strict=True)
    ]
    k = len(rank_of)
    crosses = [j > 0 and rank_of[j] != rank_of[j - 1] for j in range(k)]  # border j-1 | j
    # messages per micro-batch over the border before each stage (each value forward, each
    # gradient back), paid on both sides; nothing crosses a border inside one rank
    inbound = [n if crosses[j] else 0 for j, n in enumerate(split.messages)]
    outbound = [*inbound[1:], 0]
    sends = [
        (b * share / rates[0] if crosses[j] else 0.0)  # bytes: on the receiving side
        + costs.message_s * (inbound[j] + outbound[j])
        for j, b in enumerate(split.received)
    ]
    busy = [sum(t[j] for j in js) for js in ranks]
    with_sends = [b + sum(sends[j] for j in js) for b, js in zip(busy, ranks, strict=True)]
    fill = idle_fill(schedule, split.weight_share)
    idle = fill / v
    compute = m * max(busy)
    bubble = idle * (sum(busy) - max(busy))
    pipeline = m * max(with_sends) + idle * (sum(with_sends) - max(with_sends))
    grads = max(sum(split.plan.stages[j].param_bytes for j in js) for js in ranks)
    allreduce = 2 * (dp - 1) / dp * grads / rates[1]
    sharded = dp > 1 and data_parallel == "fsdp"
    whole = whole_parameters(split, schedule, pp, v) if sharded else frozenset()
    memory = max(_rank_memory(split, priced, js, r, shape, schedule, checkpoint, data_parallel,
                              whole) for r, js in enumerate(ranks))  # fmt: skip
    return LayoutEstimate(
        pp=pp,
        dp=dp,
        virtual=v,
        chunks=m,
        micro_batch=priced.batch // (dp * m),
        schedule=schedule,
        step_s=pipeline + allreduce,
        compute_s=compute,
        bubble_s=bubble,
        bubble=bubble / compute if compute > 0 else 0.0,
        p2p_s=pipeline - compute - bubble,
        allreduce_s=allreduce,
        memory_bytes=memory,
        fits=True,
        rank_s=tuple(busy),
        data_parallel=data_parallel,
        cost=priced.mode,
        tracer=priced.tracer,
        slack=split.slack,
        fill=fill,
    )


def in_flight(schedule: str, pp: int, v: int, m: int, r: int) -> tuple[int, ...]:
    """Micro-batches whose activations each stage of rank ``r`` holds (in the order of
    :func:`placement`) at the rank's peak, in torch's orders. Looped: the rank's stage
    passes, its warm-up count plus the one running, spread evenly over its stages."""
    if schedule in V_SHAPED:  # warm-up: 2 pp - 1 - r passes of r's first stage, r + 1 of
        return min(m, 2 * pp - r), min(m, r + 1)  # its second; then one in, one out of each
    if schedule == "gpipe":
        passes = m
    elif schedule == "1f1b":
        passes = min(m, pp - r)
    elif schedule == "loopedbfs":
        passes = m * v
    else:  # interleaved 1F1B: 2 (pp - 1 - r) + 1 ahead; zero bubble: pp - 1 - r + 1 ahead,
        per_round = m // rounds(m, pp)  # and its weight parts r passes late, holding theirs
        ahead = pp if schedule == "interleavedzerobubble" else 2 * (pp - 1 - r) + 1
        passes = min(m * v, (v - 1) * per_round + ahead)
    return (max(1, math.ceil(passes / v)),) * v


def _rank_memory(
    split: Split,
    priced: Priced,
    stages: Sequence[int],
    r: int,
    shape: tuple[int, int, int, int],
    schedule: str,
    checkpoint: str,
    data_parallel: str = "ddp",
    whole: frozenset[int] = frozenset(),
) -> int:
    """Peak bytes of rank ``r``: each stage's training estimate with ``f`` micro-batches in
    flight (``stage_memory`` prices ``f`` pieces of the whole batch; the activations are
    scaled to ``f`` micro-batches of ``batch / (dp m)`` rows), plus DDP's gradient buckets,
    or with FSDP the whole weights and gradients and a ``1 / dp`` shard of the rest (all
    of a Parameter it leaves whole, ``whole``, once on the rank)."""
    pp, dp, v, m = shape
    k = split.plan.num_stages
    copies = param_copies(True)
    kept = whole & frozenset().union(*(split.params[j] for j in stages))
    total = float(copies * sum(split.sizes[i] for i in kept))  # whole, once on the rank
    for j, f in zip(stages, in_flight(schedule, pp, v, m, r), strict=True):
        stage = split.plan.stages[j]
        everything = stage_memory(stage, priced.costs, chunks=f, checkpoint=checkpoint,
                                  last=j == k - 1)  # fmt: skip
        weights = copies * stage.param_bytes
        total += (everything - weights) * f / (dp * m)
        if dp == 1:
            total += weights
        elif data_parallel == "fsdp":  # gathered weights and gradients, and the shards
            own = stage.param_bytes - sum(split.sizes[i] for i in split.params[j] & kept)
            sharded = max(own, 0)
            total += (2 + copies / dp) * sharded
        else:  # DDP: every copy, and the gradient buckets
            total += weights + stage.param_bytes
    return int(total)
