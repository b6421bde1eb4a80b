"""The predicted time of one step of a plan: the clock-cycle schedule replayed on its costs.

The single-process runtime runs micro-batch ``i`` of stage ``j`` at clock tick ``i + j``
(:func:`fxpipe.runtime.schedule.clock_cycles`), every cell of a tick before any cell of the
next, and backward in the reverse order. A tick lasts as long as its busiest device: cells
on distinct devices overlap, cells whose stages share a device run one after another. A
cell of stage ``j`` takes

- forward: ``FORWARD_SHARE`` of the stage's cost, over ``chunks`` (the cost is for the whole
  batch cut into ``chunks`` micro-batches, so the per-kernel costs of small micro-batches
  are in it), plus the receipt of its inputs from another device at ``bandwidth``;
- backward: the rest of the cost, plus the forward again when the cell is checkpointed
  (``checkpoint`` of the stage: all of its micro-batches, all but the last, or none);
- the runtime's own costs: ``cell`` seconds per cell (fence, fork and join, the call of a
  stage module), ``checkpointed`` more for a checkpointed one (saving and restoring the
  random state, a second graph), and ``step`` seconds per step (cutting and joining).

The runtime's costs are constants per kind of device (:data:`OVERHEADS`), measured on the
runtime itself (``python -m benchmarks.autoconfig --calibrate``): stages of tiny products,
so that their compute is negligible, 1 and 4 stages, 1 and 32 micro-batches; the CUDA ones
the same way on a GPU (``--device cuda``). The stage costs at each count are priced by
:data:`fxpipe.passes.price.roofline.STEP_ROOFLINES`, whose per-kernel cost is measured the
same way.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from fxpipe.ir import CheckpointMode, Configuration, CostTable, PipelinePlan
from fxpipe.passes.partition.memory import checkpointed

__all__ = [
    "FORWARD_SHARE",
    "Overheads",
    "OVERHEADS",
    "overheads_for",
    "StageTimes",
    "predict_step",
    "predict_plan",
    "device_memory",
]

#: Share of a node's forward + backward cost its forward takes (a product's backward does
#: two products for one forward): what a recomputation costs again.
FORWARD_SHARE = 1.0 / 3.0


@dataclass(frozen=True)
class Overheads:
    """The runtime's fixed costs on one kind of device, in seconds."""

    #: Per cell (one micro-batch through one stage, forward and backward).
    cell: float
    #: More per checkpointed cell.
    checkpointed: float
    #: Per step.
    step: float
    #: Bytes per second between two devices (infinite: stages on one device share memory).
    bandwidth: float


#: Per kind of device. CPU: ``python -m benchmarks.autoconfig --calibrate`` on a 2-core x86
#: machine gave 58 us per cell, 285 us per checkpointed cell and 133 us per step, with 17 us
#: per node and micro-batch, the step roofline's kernel cost. CUDA: the same with
#: ``--device cuda`` on one H200 behind a sandboxed host
#: (``benchmarks/results/autoconfig_calibration_cuda.json``) gave 74 us per cell, 698 us
#: per checkpointed cell (the CUDA generator's state saved and restored, events recorded)
#: and 550 us per step, with 78 us per node and micro-batch: host-bound launches, which a
#: bare-metal host makes cheaper; the figures err towards fewer micro-batches there.
OVERHEADS: dict[str, Overheads] = {
    "cpu": Overheads(cell=60e-6, checkpointed=285e-6, step=130e-6, bandwidth=float("inf")),
    "cuda": Overheads(cell=75e-6, checkpointed=700e-6, step=550e-6, bandwidth=20e9),
}


def overheads_for(device_type: str) -> Overheads:
    """The runtime's costs on a kind of device (a GPU's for any kind but the CPU)."""
    return OVERHEADS.get(device_type, OVERHEADS["cuda"])


@dataclass(frozen=True)
class StageTimes:
    """What the replay needs of each stage, in stage order."""

    #: Forward + backward seconds of the whole batch.
    cost: tuple[float, ...]
    #: The device each stage runs on (stages with equal text share it).
    device: tuple[str, ...]
    #: Bytes per batch each stage receives from a stage on another device.
    received: tuple[float, ...]


def predict_step(
    stages: StageTimes,
    chunks: int,
    checkpoint: Sequence[CheckpointMode],
    *,
    training: bool,
    overheads: Overheads,
) -> Configuration:
    """The predicted step of ``stages`` run as ``chunks`` micro-batches with ``checkpoint``
    (one mode per stage), in parts; the memory of the configuration is not filled in."""
    m, n = max(chunks, 1), len(stages.cost)
    forward = [c * FORWARD_SHARE / m for c in stages.cost]
    backward = [c / m - f for c, f in zip(stages.cost, forward, strict=True)]
    moved = [b / m / overheads.bandwidth for b in stages.received]
    stops = [checkpointed(m, mode, last=j == n - 1) if training else 0
             for j, mode in enumerate(checkpoint)]  # fmt: skip
    half = overheads.cell / 2 if training else overheads.cell
    ticks = [[(k - j, j) for j in range(max(1 + k - m, 0), min(1 + k, n))]
             for k in range(m + n - 1)]  # fmt: skip

    def phase(cell_time: dict[tuple[int, int], float]) -> float:
        total = 0.0
        for cells in ticks:
            busy: dict[str, float] = {}
            for cell in cells:
                device = stages.device[cell[1]]
                busy[device] = busy.get(device, 0.0) + cell_time[cell]
            total += max(busy.values())
        return total

    cells = [(i, j) for i in range(m) for j in range(n)]
    step = phase({(i, j): forward[j] + moved[j] + half for i, j in cells})
    recompute = overhead = 0.0
    if training:
        again = {
            (i, j): (forward[j] + overheads.checkpointed) if i < stops[j] else 0.0
            for i, j in cells
        }
        step += phase({(i, j): backward[j] + moved[j] + half + again[i, j] for i, j in cells})
        recompute = sum(forward[j] * stops[j] for j in range(n))
        overhead = sum(overheads.checkpointed * s for s in stops)
    step += overheads.step
    overhead += overheads.cell * m * n + overheads.step
    devices = max(len(set(stages.device)), 1)
    compute = sum(stages.cost) if training else sum(forward) * m
    transfer = sum(moved) * m * (2 if training else 1)
    busy = (compute + recompute + overhead + transfer) / devices
    return Configuration(
        chunks=m,
        checkpoint=tuple(checkpoint),
        step=step,
        compute=compute / devices,
        recompute=recompute / devices,
        idle=max(step - busy, 0.0) if step - busy > 1e-9 * step else 0.0,
        overhead=overhead / devices,
    )


def stage_times(plan: PipelinePlan, costs: CostTable | None = None) -> StageTimes:
    """The replay's view of ``plan``: stage costs (its own, or its nodes' in ``costs`` over
    their device's speed), devices, bytes received across devices."""
    device = tuple(str(s.device) for s in plan.stages)
    cost = tuple(s.cost for s in plan.stages)
    if costs is not None:
        speeds = plan.speeds or (1.0,) * plan.num_stages
        cost = tuple(
            sum(costs.nodes[n].cost for n in s.nodes) / speeds[s.index] for s in plan.stages
        )
    received = [0.0] * plan.num_stages
    for e in plan.edges:
        for j in e.consumers:
            if device[j] != device[e.producer]:
                received[j] += e.bytes
    return StageTimes(cost, device, tuple(received))


def device_memory(plan: PipelinePlan) -> tuple[tuple[str, int], ...]:
    """Estimated bytes per device of ``plan`` (stages sharing a device add up), in order."""
    used: dict[str, int] = {}
    for s in plan.stages:
        used[str(s.device)] = used.get(str(s.device), 0) + s.memory_bytes
    return tuple(used.items())


def predict_plan(
    plan: PipelinePlan, costs: CostTable | None = None, *, kind: str = "global"
) -> Configuration:
    """The predicted step of ``plan`` as it was planned (its chunks and checkpoint modes;
    ``except_last`` where it recorded none), with its memory per device; ``costs``: the
    node costs that time a step (``fxpipe.passes.price.roofline.STEP_ROOFLINES``' prices at
    the plan's chunks), where the plan's own were made for the split."""
    found = predict_step(
        stage_times(plan, costs),
        plan.chunks,
        plan.checkpoint_modes,
        training=plan.training,
        overheads=overheads_for(plan.devices[0].type),
    )
    return replace(found, memory=device_memory(plan), kind=kind)
