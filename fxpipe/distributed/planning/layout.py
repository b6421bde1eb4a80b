"""Ranks the pipeline x data-parallel layouts of a model over ``world_size`` ranks by the step
time and the memory per rank fxpipe predicts (:mod:`fxpipe.distributed.planning.estimate`: the
estimate of one layout, and its formulas): :func:`suggest_layout`, the layouts a world size,
a batch and the schedules allow, fitting ones first. ``format_layouts``
(:mod:`fxpipe.distributed.planning.table`) prints them.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace
from typing import Any, cast

import torch
from torch import nn

from fxpipe.devices.budgets import parse_amount
from fxpipe.devices.targets import parse_device
from fxpipe.distributed.options import (
    ASYNC,
    SCHEDULES,
    V_SHAPED,
    check_count,
    check_data_parallel,
    check_each,
    check_schedule,
    micro_batch_problem,
)
from fxpipe.distributed.planning.estimate import (
    NO_RUNTIME_COSTS,
    RUNTIME_COSTS,
    LayoutEstimate,
    RuntimeCosts,
    estimate,
    runs,
    runtime_costs_for,
)
from fxpipe.distributed.planning.priced import Priced, Split, priced_model, stage_split
from fxpipe.distributed.planning.table import format_layouts
from fxpipe.distributed.planning.tensor_costs import DEFAULT_TP_BANDWIDTH, tensor_costs
from fxpipe.errors import ConfigError
from fxpipe.ir import CHECKPOINT_MODES, TRACERS, CheckpointMode, PricingMode, TracerName
from fxpipe.options import check_choice, check_slack
from fxpipe.passes.partition.cost_graph import to_networkx

__all__ = [
    "LayoutEstimate",
    "RuntimeCosts",
    "RUNTIME_COSTS",
    "NO_RUNTIME_COSTS",
    "suggest_layout",
    "format_layouts",
    "LAYOUT_SCHEDULES",
    "A100_BF16_FLOPS",
    "DEFAULT_MFU",
    "DEFAULT_DEVICE_FLOPS",
    "DEFAULT_LINK_BANDWIDTH",
    "DEFAULT_DP_BANDWIDTH",
    "DEFAULT_TP_BANDWIDTH",
]

#: Schedules ranked: ``fd.pipeline_schedule``'s, in lower case.
LAYOUT_SCHEDULES = tuple(s.lower() for s in SCHEDULES)
#: Several stages per rank, rank r holding r, r + pp, ... (torch's looped placement).
_LOOPED = frozenset({"interleaved1f1b", "loopedbfs", "interleavedzerobubble"})
#: Peak dense 16-bit FLOP/s of an A100 (Narayanan et al. 2021, §5: 312 teraFLOP/s).
A100_BF16_FLOPS = 312e12
#: Fraction of peak reached; Megatron-LM's Table 1 reports 44-52% (46% for its 7.5B GPT).
DEFAULT_MFU = 0.5
#: FLOP/s that turn ``cost="flops"`` into seconds.
DEFAULT_DEVICE_FLOPS = A100_BF16_FLOPS * DEFAULT_MFU
#: Bytes/s of one 200 Gb/s HDR InfiniBand card, one per GPU in the paper's DGX A100 nodes.
DEFAULT_LINK_BANDWIDTH = 25e9
DEFAULT_DP_BANDWIDTH = 25e9
#: The cost modes ranked (their pricing mode): prices that are times, or FLOP.
_PRICING: dict[str, PricingMode] = {
    "auto": "roofline",
    "flops": "flops",
    "roofline": "roofline",
    "time": "time",
}


def suggest_layout(
    model: nn.Module,
    example_input: Any,
    world_size: int,
    *,
    max_memory: int | str | None = None,
    example_kwargs: Mapping[str, Any] | None = None,
    cost: str = "flops",
    tracer: str = "auto",
    schedules: Sequence[str] = ("1f1b", "interleaved1f1b"),
    virtual: Sequence[int] = (2, 4),
    data_parallel: str | Sequence[str] = ("ddp",),
    chunks: int | Sequence[int] | None = None,
    checkpoint: CheckpointMode = "never",
    slack: float = 0.0,
    device_flops: float = DEFAULT_DEVICE_FLOPS,
    link_bandwidth: float = DEFAULT_LINK_BANDWIDTH,
    dp_bandwidth: float = DEFAULT_DP_BANDWIDTH,
    device: str | torch.device = "cuda",
    runtime_costs: RuntimeCosts | None = None,
    tensor_parallel: int | Sequence[int] = 1,
    tp_bandwidth: float = DEFAULT_TP_BANDWIDTH,
) -> list[LayoutEstimate]:
    """Rank the (pp, dp, tp, virtual, chunks, schedule) layouts of ``model`` over
    ``world_size`` ranks by the step time fxpipe predicts and by memory per rank (the
    formulas are in the docstrings of :mod:`fxpipe.distributed.planning.estimate` and, for
    ``tp``, :mod:`fxpipe.distributed.planning.tensor_costs`). Compile only: nothing runs on a
    device; a model on ``meta`` works.

    Args:
        model, example_input, example_kwargs, tracer: as for :func:`fxpipe.plan`, but
            ``example_input`` is the global batch (dim 0), which the replicas share.
        world_size: ranks in all, ``pp * dp``.
        max_memory: the memory of every rank, one amount (bytes, or a string such as
            ``"80GiB"``); None: not checked, every layout fits.
        cost: ``"flops"`` (analytic FLOP over ``device_flops``), ``"roofline"`` or
            ``"auto"`` (seconds on a reference device of ``device``'s kind) or ``"time"``
            (profiled on ``device``, which must be here; not for a model on ``meta``).
        schedules: names from :data:`LAYOUT_SCHEDULES`; the looped ones (interleaved 1F1B,
            looped BFS, interleaved zero bubble) are tried with each of ``virtual`` stages
            per rank, 2 or more; ZBV and DualPipeV always have 2.
        data_parallel: ``"ddp"``, ``"fsdp"`` or both: how the replicas of layouts with
            ``dp > 1`` share the gradients, as ``fd.pipeline_schedule`` takes it.
        chunks: micro-batch counts per replica to try (default: every count that divides a
            replica's rows); counts that do not divide them are left out.
        checkpoint: which micro-batches keep only their stage inputs (memory only; the
            default, ``"never"``, is what ``fd.pipeline_schedule`` runs).
        slack: as for :func:`fxpipe.plan` (pass the same to ``fd.pipeline_schedule``): the
            bottleneck may grow by this fraction where that sends fewer bytes.
        device_flops: FLOP/s of one rank for ``cost="flops"`` (default: an A100's 312
            TFLOP/s at :data:`DEFAULT_MFU`).
        link_bandwidth, dp_bandwidth: bytes/s between pipeline neighbours, and per rank in
            the data-parallel ring (default: one 200 Gb/s InfiniBand card each).
        device: the kind of device the ranks are (``"cuda"``, ``"cpu"``), for
            ``"roofline"`` and ``"time"``, and for the runtime's fixed costs.
        tensor_parallel: the tensor-parallel sizes ``tp`` to try (each dividing
            ``world_size``; ``pp * dp * tp`` ranks): the model's own plan over ``tp`` ranks
            (:func:`fxpipe.passes.tensor.plan.tensor_plan`) divides what it cuts.
        tp_bandwidth: bytes/s each rank moves to the others of its ``tp`` group (default:
            an A100's NVLink, 300 GB/s each way).
        runtime_costs: the runtime's seconds per stage pass and per message between ranks
            (default: those measured for ``device``'s kind, :data:`RUNTIME_COSTS`;
            ``NO_RUNTIME_COSTS`` prices the formulas alone).

    Returns:
        One :class:`LayoutEstimate` per layout: those that fit ``max_memory`` by step time,
        then the others by memory (none fitting is not an error: the list says what each
        needs). Layouts whose replicas cannot share the batch, or whose stage count the
        graph cannot be cut into, are left out.

    Raises:
        ConfigError: for a bad option, or when no layout at all is left, naming the value
            and the remedy (``DeviceError`` for a ``device`` that is malformed or, with
            ``cost="time"``, absent).
    """
    why = ": the ranks in all, pipeline ranks x data-parallel replicas x tensor-parallel ranks"
    check_count("world_size", world_size, why=why)
    names = check_each("schedules", schedules, check_schedule)
    if ASYNC in names:
        raise ConfigError(
            "suggest_layout ranks the synchronous schedules by their predicted step; "
            "schedule='Async1F1B' has no flush to price (its figures are "
            "pipe.schedule.plan()'s and benchmarks/async_pipeline.py's); leave it out"
        )
    kinds = check_each("data_parallel", data_parallel, _data_parallel)
    loops = _counts("virtual", virtual, least=2)
    wanted = None if chunks is None else _counts("chunks", chunks, least=1)
    tps = _counts("tensor_parallel", tensor_parallel, least=1)
    if any(world_size % t for t in tps):
        raise ConfigError(
            f"tensor_parallel={tensor_parallel!r}: each size must divide world_size="
            f"{world_size} (pp x dp x tp ranks); give divisors of {world_size}"
        )
    check_choice("checkpoint", checkpoint, CHECKPOINT_MODES)
    check_choice("tracer", tracer, TRACERS)
    check_choice("cost", cost, tuple(_PRICING))
    check_slack(slack)
    for name, value in (
        ("device_flops", device_flops),
        ("link_bandwidth", link_bandwidth),
        ("dp_bandwidth", dp_bandwidth),
        ("tp_bandwidth", tp_bandwidth),
    ):
        _check_rate(name, value)
    budget = None if max_memory is None else _budget(max_memory)
    target = parse_device(device, require_present=cost == "time")
    mode = _PRICING[cost]
    asked = cast(TracerName, tracer)  # checked above
    priced = priced_model(model, example_input, example_kwargs, mode, asked, target, device_flops)
    rates = (float(link_bandwidth), float(dp_bandwidth))
    costs = runtime_costs if runtime_costs is not None else runtime_costs_for(target.type)
    splits: dict[tuple[int, int], Split | None] = {}
    out = []
    refused: dict[tuple[str, str], None] = {}  # (schedule, data_parallel) left out, in order
    for tp in tps:
        per = _tensor_parallel(priced, tp, float(tp_bandwidth))
        layouts = _candidates(world_size // tp, priced.batch, names, loops, wanted)
        for pp, dp, v, m, schedule in layouts:
            k = pp * v
            if (tp, k) not in splits:
                splits[(tp, k)] = stage_split(per, k, checkpoint, slack)
            found = splits[(tp, k)]
            for kind in kinds if dp > 1 else ("ddp",):
                if found is None:
                    continue
                if not runs(found, schedule, pp, v, dp, kind):
                    refused[(schedule, kind)] = None
                    continue
                shape = (pp, dp, v, m)
                one = estimate(found, per, shape, schedule, checkpoint, rates, kind, costs)
                out.append(replace(one, tp=tp))
    if not out:
        by_count = {k: s for (t, k), s in splits.items() if t == tps[0]}
        raise ConfigError(_none_found(world_size, priced.batch, by_count, chunks, tuple(refused)))
    return _ranked(out, budget)


def _tensor_parallel(priced: Priced, tp: int, bandwidth: float) -> Priced:
    """``priced`` as one rank of ``tp`` runs it (itself for ``tp == 1``)."""
    if tp == 1:
        return priced
    traced = priced.traced
    costs, _ = tensor_costs(traced.graph_module, traced.example_values, priced.costs, tp,
                            bandwidth=bandwidth, seconds=priced.seconds)  # fmt: skip
    return replace(priced, costs=costs, graph=to_networkx(traced.graph_module, costs))


# ---------------------------------------------------------------------------- options


def _data_parallel(name: str, value: object) -> str:
    """``value`` in lower case, one of :data:`~fxpipe.distributed.options.DATA_PARALLEL`."""
    return check_data_parallel(name, str(value).lower())


def _counts(name: str, value: Any, *, least: int) -> tuple[int, ...]:
    """Micro-batch or stage counts: one, or a sequence, each a whole number >= ``least``;
    sorted, each once."""
    return tuple(sorted(check_each(name, value, lambda n, c: check_count(n, c, least=least))))


def _check_rate(name: str, value: Any) -> None:
    number = isinstance(value, int | float) and not isinstance(value, bool)
    if not number or not math.isfinite(value) or value <= 0:
        raise ConfigError(
            f"{name}={value!r} must be a positive number per second (FLOP/s for "
            "device_flops, bytes/s for the bandwidths: 25e9 is one 200 Gb/s InfiniBand card)"
        )


def _budget(max_memory: Any) -> int:
    if isinstance(max_memory, Mapping) or isinstance(max_memory, list | tuple):
        raise ConfigError(
            f"max_memory={max_memory!r} gives several amounts, but every rank of a layout "
            "has the same budget; pass one amount, e.g. '80GiB'"
        )
    return parse_amount(max_memory, "max_memory")


# ---------------------------------------------------------------------------- layouts


def _candidates(
    world: int,
    batch: int,
    schedules: tuple[str, ...],
    loops: tuple[int, ...],
    wanted: tuple[int, ...] | None,
) -> Iterable[tuple[int, int, int, int, str]]:
    """(pp, dp, v, m, schedule) for every layout the batch and the schedules allow."""
    for pp in _divisors(world):
        dp = world // pp
        if batch % dp:
            continue
        replica = batch // dp
        counts = [m for m in (wanted or _divisors(replica)) if replica % m == 0]
        for schedule in schedules:
            looped, v_shaped = schedule in _LOOPED, schedule in V_SHAPED
            if (looped or v_shaped) and pp == 1:
                continue
            for v in loops if looped else (2,) if v_shaped else (1,):
                for m in counts:
                    if micro_batch_problem(schedule, m, pp, pp * v) is not None:
                        continue  # pipeline_schedule (and torch) would refuse it
                    if looped and m < pp:
                        continue  # the loop would stall
                    if v_shaped and m < 2 * pp - (schedule == "zbvzerobubble"):
                        continue  # ZBV's V needs 2 pp - 1 to fill, DualPipeV one per stage
                    yield pp, dp, v, m, schedule


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _ranked(layouts: list[LayoutEstimate], budget: int | None) -> list[LayoutEstimate]:
    """Fitting layouts by step time, then the others by memory (ties: fewer ranks of pipeline,
    fewer micro-batches)."""
    marked = [
        e if budget is None or e.memory_bytes <= budget else replace(e, fits=False)
        for e in layouts
    ]
    fit = [e for e in marked if e.fits]
    rest = [e for e in marked if not e.fits]
    fit.sort(key=lambda e: (e.step_s, e.memory_bytes, _tie(e)))
    rest.sort(key=lambda e: (e.memory_bytes, e.step_s, _tie(e)))
    return fit + rest


def _tie(e: LayoutEstimate) -> tuple[int, int, int, int, str, str]:
    return e.tp, e.pp, e.virtual, e.chunks, e.schedule, e.data_parallel


def _none_found(
    world: int,
    batch: int,
    splits: Mapping[int, Split | None],
    chunks: Any,
    refused: tuple[tuple[str, str], ...],
) -> str:
    if refused:  # the graph was cut, but fd.pipeline_schedule would refuse every layout
        shown = ", ".join(f"{schedule} with {kind}" for schedule, kind in refused)
        fsdp = any(kind == "fsdp" for _, kind in refused)
        why = (
            ", and this torch's FSDP cannot leave whole a Parameter that two stages of one "
            "rank read"
            if fsdp
            else ""
        )
        return (
            f"no layout of world_size={world} for a global batch of {batch} that "
            f"fd.pipeline_schedule would run: it refuses each one left ({shown}) with "
            f"replicas, as zero-bubble schedules split the backward DDP does not follow{why}; "
            "pass data_parallel='fsdp' for zero bubble, a schedule that places the stages "
            "otherwise (loopedbfs, interleaved1f1b, 1f1b), or chunks that allow pipelines "
            "without replicas"
        )
    if not splits:
        return (
            f"no layout of world_size={world} fits a global batch of {batch} with "
            f"chunks={chunks!r}: each of dp replicas needs batch / dp rows in whole "
            "micro-batches; pass a batch that world_size's divisors divide, or other chunks"
        )
    return (
        f"no layout of world_size={world} for a global batch of {batch}: the replica counts "
        f"that divide the batch leave pipelines of {sorted(splits)} stages, more than the "
        "graph can be cut into; use a batch that more replicas can share (a multiple of "
        "world_size), fewer virtual stages, or fewer ranks"
    )
