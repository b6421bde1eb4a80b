"""fxpipe.distributed.planning: layout, priced, estimate and table: the layouts suggest_layout
ranks, their step-time terms against the formulas written out again here, memory against
budgets, meta models, bad options and the table."""

from __future__ import annotations

from collections import Counter
from functools import cache
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from models import ZOO, ResidualMLP
from torch import nn
from torch.distributed.pipelining import schedules as torch_schedules

import fxpipe
import fxpipe.distributed as fd
from fxpipe.distributed.planning import estimate as layout_estimate
from fxpipe.distributed.planning.estimate import in_flight, placement
from fxpipe.distributed.planning.layout import (
    DEFAULT_DP_BANDWIDTH,
    LAYOUT_SCHEDULES,
    format_layouts,
)
from fxpipe.errors import ConfigError

pytestmark = pytest.mark.usefixtures("one_thread")

BATCH, WORLD = 32, 8
ALL = LAYOUT_SCHEDULES
LOOPED = ("interleaved1f1b", "loopedbfs", "interleavedzerobubble")
ZERO_BUBBLE = ("interleavedzerobubble", "zbvzerobubble", "dualpipev")
V_SHAPED = ("zbvzerobubble", "dualpipev")
#: The idle part of the fill and drain, forward, input- and weight-gradient passes taking
#: equal time (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024: ZB1P (p - 1) / 3m
#: against 1F1B's (p - 1) / m); torch's ZBV and DualPipeV orders leave the same third
#: (test_the_fill_is_what_torchs_orders_leave_idle plays them out).
IDLE = dict.fromkeys(ZERO_BUBBLE, 1 / 3)


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return ResidualMLP(depth=8)


def _chain(n: int = 8) -> nn.Module:
    """``n`` equal layers: every split into stages of as many layers each is balanced."""
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(64, 64) for _ in range(n)])


@cache
def _layouts(world: int = WORLD, budget: int | None = None) -> tuple[fd.LayoutEstimate, ...]:
    x = torch.randn(BATCH, 32)
    return tuple(fd.suggest_layout(_mlp(), x, world, max_memory=budget, schedules=ALL))


def test_every_layout_spans_the_world_and_splits_the_batch() -> None:
    layouts = _layouts()
    assert layouts
    shapes = {(e.pp, e.dp) for e in layouts}
    assert shapes == {(1, 8), (2, 4), (4, 2), (8, 1)}
    for e in layouts:
        assert e.pp * e.dp == WORLD
        assert e.micro_batch * e.chunks * e.dp == BATCH and e.micro_batch >= 1
        assert e.schedule in ALL and e.stages == e.pp * e.virtual
        if e.schedule in LOOPED:  # looped: v >= 2, m >= pp
            assert e.virtual >= 2 and e.pp >= 2 and e.chunks >= e.pp
        elif e.schedule in V_SHAPED:  # a V: 2 stages per rank; ZBV 2 pp - 1 micro-batches,
            least = 2 * e.pp - (e.schedule == "zbvzerobubble")  # DualPipeV one per stage
            assert e.virtual == 2 and e.pp >= 2 and e.chunks >= least
        else:
            assert e.virtual == 1
        if e.schedule.startswith("interleaved"):  # torch's rounds divide the micro-batches
            assert e.chunks % max(1, e.chunks // e.pp) == 0
        if e.schedule in ZERO_BUBBLE:  # DDP's all-reduce misses the weight parts: refused
            assert e.dp == 1
    assert len({(e.pp, e.virtual, e.chunks, e.schedule) for e in layouts}) == len(layouts)


def test_sorted_fitting_by_step_time_then_the_rest_by_memory() -> None:
    memories = sorted(e.memory_bytes for e in _layouts())
    budget = memories[len(memories) // 2]
    layouts = _layouts(budget=budget)
    fits = [e.fits for e in layouts]
    assert fits == sorted(fits, reverse=True) and any(fits) and not all(fits)
    assert all(e.fits == (e.memory_bytes <= budget) for e in layouts)
    steps = [e.step_s for e in layouts if e.fits]
    assert steps == sorted(steps)
    memory = [e.memory_bytes for e in layouts if not e.fits]
    assert memory == sorted(memory)


def test_terms_match_the_formulas() -> None:
    for e in _layouts():
        busiest, total = max(e.rank_s), sum(e.rank_s)
        assert len(e.rank_s) == e.pp
        assert e.compute_s == pytest.approx(e.chunks * busiest, rel=1e-12)
        assert e.fill == layout_estimate.idle_fill(e.schedule, _weight_share())
        idle = e.fill / e.virtual
        assert e.bubble_s == pytest.approx(idle * (total - busiest), rel=1e-12, abs=1e-18)
        assert e.bubble == pytest.approx(e.bubble_s / e.compute_s, rel=1e-12)
        # unequal ranks: the others take less than the busiest, so at most (p - 1) / (v m)
        assert e.bubble <= idle * (e.pp - 1) / e.chunks + 1e-12
        parts = e.compute_s + e.bubble_s + e.p2p_s + e.allreduce_s
        assert e.step_s == pytest.approx(parts, rel=1e-12)
        assert e.p2p_s >= 0 and e.allreduce_s >= 0
        assert (e.p2p_s == 0) == (e.pp == 1)
        assert (e.allreduce_s == 0) == (e.dp == 1)


@cache
def _weight_share() -> float:
    """The MLP's weight-gradient share, written out: a third of its Linear layers' cost (its
    LayerNorms' scales have element-wise gradients)."""
    x = torch.randn(BATCH, 32)
    plan = fxpipe.plan(_mlp(), x, ["meta"], cost="flops", tracer="fx")
    costs = plan.node_cost
    linear = sum(c for n, c in costs.items() if n in _linear_nodes())
    return linear / 3 / sum(costs.values())


@cache
def _linear_nodes() -> frozenset[str]:
    gm = torch.fx.symbolic_trace(_mlp())
    modules = dict(gm.named_modules())
    return frozenset(
        n.name for n in gm.graph.nodes
        if n.op == "call_module" and isinstance(modules[n.target], nn.Linear)
    )  # fmt: skip


def test_zero_bubble_fill_is_what_the_weight_parts_cannot_cover() -> None:
    """ZB-H1's bubble (Qi et al. 2024), (p - 1)(F + B - W) over 1F1B's (p - 1)(F + B + W):
    a third where every node is a product, more where element-wise nodes leave the weight
    parts less to fill with; 1 for the schedules that do not split backward."""
    assert layout_estimate.idle_fill("zbvzerobubble", 1 / 3) == pytest.approx(1 / 3)
    assert layout_estimate.idle_fill("dualpipev", 0.2) == pytest.approx(0.6)
    assert layout_estimate.idle_fill("interleavedzerobubble", 0.0) == 1.0
    assert layout_estimate.idle_fill("1f1b", 1 / 3) == 1.0
    mlp = {e.fill for e in _layouts() if e.schedule in ZERO_BUBBLE}
    assert len(mlp) == 1 and 1 / 3 < mlp.pop() < 1  # LayerNorm, GELU, residual adds


def test_balanced_stages_give_megatrons_bubble() -> None:
    """Equal ranks: the bubble fraction is (p - 1) / (v m) (Narayanan et al. 2021, §2.2), a
    third of it for the zero-bubble schedules (Qi et al. 2024, ZB1P)."""
    x = torch.randn(16, 64)
    layouts = fd.suggest_layout(_chain(), x, 4, schedules=ALL, virtual=2)
    assert {e.pp for e in layouts} == {1, 2, 4}
    assert {e.schedule for e in layouts} == set(ALL)
    for e in layouts:
        expected = IDLE.get(e.schedule, 1.0) * (e.pp - 1) / (e.virtual * e.chunks)
        assert e.bubble == pytest.approx(expected, rel=1e-9, abs=1e-12)


@pytest.mark.parametrize("schedule", ["gpipe", "loopedbfs", "zbvzerobubble"])
def test_runtime_costs_add_per_pass_message_and_split_parameter(schedule: str) -> None:
    """Balanced ranks of a chain of 8 Linear layers, costs of 1 ms per stage pass, 10 ms
    per message and 100 ms per Parameter of a split backward: each rank's micro-batch takes
    ``passes x 1 ms + messages x 10 ms + parameters x 100 ms`` more (GPipe 2 passes and 2
    messages, looped BFS at 2 stages per rank 4 and 6, ZBV 4 and 4 and its 8 Parameters:
    the counts its calibration fits), paid ``m`` times plus once in the fill's idle share."""
    x = torch.randn(16, 64)
    costs = layout_estimate.RuntimeCosts(pass_s=1e-3, message_s=10e-3, weight_s=100e-3)
    free, priced = (
        {(e.schedule, e.chunks): e for e in fd.suggest_layout(
            _chain(), x, 2, schedules=[schedule], virtual=[2], runtime_costs=c) if e.pp == 2}
        for c in (layout_estimate.NO_RUNTIME_COSTS, costs)
    )  # fmt: skip
    passes, messages, params = {
        "gpipe": (2, 2, 0), "loopedbfs": (4, 6, 0), "zbvzerobubble": (4, 4, 8)
    }[schedule]  # fmt: skip
    per = passes * 1e-3 + messages * 10e-3 + params * 100e-3
    assert free.keys() == priced.keys() and free
    for key, e in priced.items():
        idle = e.fill / e.virtual
        added = e.chunks * per + idle * per  # two ranks: the fill pays the other one once
        assert e.step_s - free[key].step_s == pytest.approx(added, rel=1e-9)
        busy = passes * 1e-3 + params * 100e-3
        assert e.rank_s[0] - free[key].rank_s[0] == pytest.approx(busy, rel=1e-9)


def test_the_default_runtime_costs_are_the_devices_kinds() -> None:
    x = torch.randn(16, 64)
    kinds = {
        device: fd.suggest_layout(
            _chain(), x, 2, schedules=["gpipe"], device=device, cost="flops"
        )  # fmt: skip
        for device in ("cpu", "cuda")
    }
    for device, layouts in kinds.items():
        given = fd.suggest_layout(
            _chain(), x, 2, schedules=["gpipe"], device=device, cost="flops",
            runtime_costs=layout_estimate.runtime_costs_for(device),
        )  # fmt: skip
        assert [e.step_s for e in layouts] == [e.step_s for e in given]
    cpu = {(e.pp, e.chunks): e.step_s for e in kinds["cpu"]}
    cuda = {(e.pp, e.chunks): e.step_s for e in kinds["cuda"]}
    assert all(cpu[k] > cuda[k] for k in cpu if k[0] == 2)  # gloo's messages cost more


def test_more_memory_fits_at_least_as_many_layouts() -> None:
    memories = sorted(e.memory_bytes for e in _layouts())
    budgets = (1, memories[len(memories) // 2], memories[-1])
    counts = [sum(e.fits for e in _layouts(budget=b)) for b in budgets]
    assert counts == sorted(counts) and counts[0] == 0 and counts[-1] == len(_layouts())
    assert all(e.fits for e in _layouts(budget=None))  # no budget: nothing is checked


def test_budget_below_every_layout_ranks_all_by_memory() -> None:
    layouts = _layouts(budget=1)
    assert len(layouts) == len(_layouts()) and not any(e.fits for e in layouts)
    memory = [e.memory_bytes for e in layouts]
    assert memory == sorted(memory)


def test_allreduce_grows_as_a_ring_with_dp() -> None:
    """2 (dp - 1) / dp x the busiest rank's gradient bytes / dp_bandwidth: all of them for
    pure data parallel, and the same two stages' at 2 and 8 replicas."""
    grads = sum(p.numel() * p.element_size() for p in _mlp().parameters())
    for world in (4, 8):
        plain = next(e for e in _layouts(world) if e.pp == 1)
        ring = 2 * (world - 1) / world
        assert plain.allreduce_s == pytest.approx(ring * grads / DEFAULT_DP_BANDWIDTH)
    two, eight = (
        next(e for e in _layouts(w) if e.pp == 2 and e.schedule == "1f1b" and e.chunks == 2)
        for w in (4, 16)
    )
    assert eight.allreduce_s / two.allreduce_s == pytest.approx((7 / 8) / (1 / 2))


def test_schedules_hold_the_micro_batches_they_keep_in_flight() -> None:
    by_key = {(e.pp, e.virtual, e.chunks, e.schedule): e for e in _layouts()}
    gpipe = [e for e in _layouts() if e.schedule == "gpipe"]
    for e in gpipe:  # all micro-batches in flight: the same activations whatever m
        same = [g.memory_bytes for g in gpipe if g.pp == e.pp]
        assert max(same) - min(same) <= e.pp * e.virtual  # int rounding per stage
        if e.chunks < e.pp:  # 1F1B needs a micro-batch per stage: not ranked
            assert (e.pp, 1, e.chunks, "1f1b") not in by_key
            continue
        one = by_key[(e.pp, 1, e.chunks, "1f1b")]
        assert one.memory_bytes <= e.memory_bytes and one.step_s == e.step_s
    for e in _layouts():
        if e.schedule == "loopedbfs":
            inter = by_key.get((e.pp, e.virtual, e.chunks, "interleaved1f1b"))
            if inter is not None:
                assert inter.memory_bytes <= e.memory_bytes
                assert inter.step_s == pytest.approx(e.step_s)


def _torch_order(schedule: str, pp: int, v: int, m: int, r: int) -> list[object]:
    """Rank ``r``'s actions as torch's schedule class orders them (its own method, on a
    stand-in for the stages it would be built with)."""
    cls = {
        "loopedbfs": torch_schedules.ScheduleLoopedBFS,
        "interleaved1f1b": torch_schedules.ScheduleInterleaved1F1B,
        "interleavedzerobubble": torch_schedules.ScheduleInterleavedZeroBubble,
        "zbvzerobubble": torch_schedules.ScheduleZBVZeroBubble,
        "dualpipev": torch_schedules.ScheduleDualPipeV,
    }[schedule]
    rounds = max(1, m // pp)
    stand_in = SimpleNamespace(_n_microbatches=m, pp_group_size=pp, n_local_stages=v,
                               microbatches_per_round=m // rounds, num_stages=pp * v,
                               _stages=[None] * v)  # fmt: skip
    kinds = torch_schedules._ComputationType
    out: list[object] = []
    for a in cls._calculate_single_rank_operations(stand_in, r):
        if a is not None and a.computation_type == kinds.OVERLAP_F_B:  # DualPipeV's pairs
            out.extend(a.sub_actions)
        elif a is not None:
            out.append(a)
    return out


def _torch_peaks(actions: list[object], stages: tuple[int, ...]) -> tuple[tuple[int, ...], int]:
    """Per stage, the most micro-batches whose activations it holds at once (a forward
    adds one; a whole backward, or a weight part, frees one), and the most for all."""
    kinds = torch_schedules._ComputationType
    live: Counter[int] = Counter()
    most: Counter[int] = Counter()
    total = 0
    for a in actions:
        if a.computation_type == kinds.FORWARD:  # type: ignore[attr-defined]
            live[a.stage_index] += 1  # type: ignore[attr-defined]
        elif a.computation_type in (kinds.FULL_BACKWARD, kinds.BACKWARD_WEIGHT):  # type: ignore[attr-defined]
            live[a.stage_index] -= 1  # type: ignore[attr-defined]
        for j in stages:
            most[j] = max(most[j], live[j])
        total = max(total, sum(live.values()))
    return tuple(most[j] for j in stages), total


@pytest.mark.parametrize("schedule", ["loopedbfs", "interleaved1f1b", *ZERO_BUBBLE])
def test_micro_batches_in_flight_follow_torchs_own_orders(schedule: str) -> None:
    """The activations each rank is priced to hold are what torch's order keeps at once:
    ZBV and DualPipeV exactly per stage (the V's first stage 2 pp - r, its second r + 1),
    the looped schedules' rank peak spread evenly over the rank's stages (rounded up per
    stage)."""
    checked = 0
    for pp in (2, 3, 4, 8):
        for v in (2,) if schedule in V_SHAPED else (2, 3, 4):
            for m in sorted({pp, 2 * pp - 1, 2 * pp, 3 * pp, 16, 32}):
                if schedule in V_SHAPED and m < 2 * pp - (schedule == "zbvzerobubble"):
                    continue
                if schedule.startswith("interleaved") and m % max(1, m // pp):
                    continue
                for r in range(pp):
                    stages = placement(schedule, pp, v)[r]
                    per_stage, peak = _torch_peaks(_torch_order(schedule, pp, v, m, r), stages)
                    priced = in_flight(schedule, pp, v, m, r)
                    if schedule in V_SHAPED:
                        assert priced == per_stage, (pp, m, r)
                    else:
                        assert peak <= sum(priced) < peak + v, (pp, v, m, r)
                    checked += 1
    assert checked > 50


def _played_out(schedule: str, pp: int, v: int, m: int) -> float:
    """The idle fraction of a step when every rank runs torch's order for it with forward,
    input-gradient and weight-gradient passes of one unit each (a whole backward two), each
    pass starting once its rank is free and what it reads is computed: the forward of the
    stage before, the input gradient of the stage after. Sends take no time."""
    kinds = torch_schedules._ComputationType
    last = pp * v - 1
    orders = [_torch_order(schedule, pp, v, m, r) for r in range(pp)]
    done: dict[tuple[str, int, int], float] = {}  # (pass, stage, micro-batch) -> end
    clock, at = [0.0] * pp, [0] * pp
    while any(at[r] < len(orders[r]) for r in range(pp)):
        moved = False
        for r in range(pp):
            while at[r] < len(orders[r]):
                a: Any = orders[r][at[r]]
                j, i, kind = a.stage_index, a.microbatch_index, a.computation_type
                if kind == kinds.FORWARD:
                    key, units, needs = "F", 1, [("F", j - 1, i)] if j else []
                elif kind in (kinds.FULL_BACKWARD, kinds.BACKWARD_INPUT):
                    key, units = "I", 2 if kind == kinds.FULL_BACKWARD else 1
                    needs = [("F", j, i)] + ([("I", j + 1, i)] if j < last else [])
                else:
                    assert kind == kinds.BACKWARD_WEIGHT, kind
                    key, units, needs = "W", 1, [("I", j, i)]
                if any(n not in done for n in needs):
                    break
                clock[r] = max([clock[r]] + [done[n] for n in needs]) + units
                done[(key, j, i)] = clock[r]
                at[r] += 1
                moved = True
        assert moved, f"torch's {schedule} order stalls at pp={pp}, v={v}, m={m}"
    busy = 3 * v * m  # every rank: a forward, an input and a weight pass per stage and mb
    return (max(clock) - busy) / busy


@pytest.mark.parametrize("schedule", ["loopedbfs", "interleaved1f1b", *ZERO_BUBBLE])
def test_the_fill_is_what_torchs_orders_leave_idle(schedule: str) -> None:
    """suggest_layout's bubble for equal stages is the idle time torch's own orders leave,
    played out pass by pass with passes of equal time: Megatron's (p - 1) / (v m) for the
    looped schedules, a third of it for the zero-bubble ones (only the first forward's way
    to the last rank: ZBV and DualPipeV too, not none)."""
    x = torch.randn(48, 64)
    layouts = fd.suggest_layout(_chain(12), x, 3, schedules=(schedule,), virtual=2)
    layouts += fd.suggest_layout(_chain(8), torch.randn(16, 64), 4, schedules=(schedule,),
                                 virtual=2)  # fmt: skip
    checked = 0
    for e in layouts:
        if e.pp > 1:
            played = _played_out(schedule, e.pp, e.virtual, e.chunks)
            assert e.bubble == pytest.approx(played, rel=1e-9), (e.pp, e.chunks)
            checked += 1
    assert checked >= 4


def test_zbv_places_a_v_and_sends_nothing_at_its_tip() -> None:
    """ZBV on pp ranks: 2 pp stages, rank r holding r and 2 pp - 1 - r, so the border between
    stages pp - 1 and pp stays on one rank: it sends 2 pp - 2 borders' values where 1F1B
    over the same 2 pp stages (interleaved, v = 2) sends 2 pp - 1."""
    assert placement("zbvzerobubble", 4, 2) == [(0, 7), (1, 6), (2, 5), (3, 4)]
    assert placement("interleaved1f1b", 4, 2) == [(0, 4), (1, 5), (2, 6), (3, 7)]
    x = torch.randn(16, 64)
    slow = fd.suggest_layout(_chain(), x, 2, schedules=ZERO_BUBBLE, virtual=2, chunks=4,
                             link_bandwidth=1e3,
                             runtime_costs=layout_estimate.NO_RUNTIME_COSTS)  # fmt: skip
    sent = {e.schedule: e.p2p_s for e in slow}
    assert set(sent) == set(ZERO_BUBBLE)
    # each border of the chain carries one micro-batch of 4 rows x 64 float32 each way
    border = 4 * 64 * 4 * 2 / 1e3
    # the V: ranks 0 (stages 0, 3) and 1 (stages 1, 2) each receive over one border per
    # micro-batch, and the fill pays the other rank's one border at the idle share 1 / (3 v)
    for v_shaped in V_SHAPED:
        assert sent[v_shaped] == pytest.approx(4 * border + border / 6, rel=1e-6)
    # interleaved (0, 2 and 1, 3): rank 1 receives over 2 borders per micro-batch, and the
    # fill pays rank 0's one border at ZB1P's idle share, 1 / (3 v)
    assert sent["interleavedzerobubble"] == pytest.approx(4 * 2 * border + border / 6, rel=1e-6)


def test_fsdp_is_ranked_where_two_stages_of_a_rank_share_a_parameter_it_can_leave_whole(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A tied embedding and head: ZBV puts the first and the last stage on rank 0, where
    FSDP leaves the weight whole (``fd.pipeline_schedule`` runs it), so its FSDP layouts are
    ranked; on a torch whose fully_shard cannot leave it whole they are left out, and the
    looped schedules, which put them on different ranks, keep theirs. A module shared by
    stages 0 and 2: the other way round."""
    case = ZOO["transformer"]
    args, kwargs = case.example(8)
    options: dict[str, Any] = dict(
        example_kwargs=kwargs, schedules=("interleavedzerobubble", "zbvzerobubble", "1f1b"),
        data_parallel="fsdp", chunks=(4, 8),
    )  # fmt: skip
    shared = ZOO["shared_module"]
    shared_args, shared_kwargs = shared.example(8)
    shared_options: dict[str, Any] = dict(
        example_kwargs=shared_kwargs, virtual=2, schedules=("loopedbfs", "zbvzerobubble"),
        chunks=4, data_parallel=("ddp", "fsdp"),
    )  # fmt: skip

    def replicated(model: nn.Module, inputs: Any, opts: dict[str, Any]) -> set[Any]:
        layouts = fd.suggest_layout(model, inputs, 4, **opts)
        return {(e.schedule, e.data_parallel) for e in layouts if e.dp == 2}

    assert ("zbvzerobubble", "fsdp") in replicated(case.build(), args, options)
    every = {(s, k) for s in ("loopedbfs", "zbvzerobubble") for k in ("ddp", "fsdp")}
    every.discard(("zbvzerobubble", "ddp"))  # zero bubble with DDP: never
    assert replicated(shared.build(), shared_args, shared_options) == every
    monkeypatch.setattr(layout_estimate, "can_leave_whole", lambda: False)
    layouts = fd.suggest_layout(case.build(), args, 4, **options)
    zbv = [e for e in layouts if e.schedule == "zbvzerobubble"]
    assert zbv and all(e.dp == 1 for e in zbv)  # (2, 2) would be FSDP: left out
    looped = [e for e in layouts if e.schedule == "interleavedzerobubble" and e.dp == 2]
    assert looped and all(e.data_parallel == "fsdp" for e in looped)
    # the module called twice, its calls in stages 0 and 2 of 4: the loop puts both on
    # rank 0, the V does not
    assert replicated(shared.build(), shared_args, shared_options) == {
        ("loopedbfs", "ddp"),
        ("zbvzerobubble", "fsdp"),
    }


def test_fsdp_shards_weights_gradients_and_adam_state_over_the_replicas() -> None:
    """FSDP's twin of every layout with replicas: the same step (its gather and
    reduce-scatter move what DDP's all-reduce moves), less memory; with one stage per rank
    (pp = 1), (4 + 1) - (2 + 4 / dp) parameter copies less, exactly."""
    x = torch.randn(BATCH, 32)
    both = fd.suggest_layout(_mlp(), x, WORLD, schedules=ALL, data_parallel=("ddp", "fsdp"))
    assert len({e.data_parallel for e in both if e.dp == 1}) == 1  # no replicas, no twin
    by_key = {(e.pp, e.dp, e.virtual, e.chunks, e.schedule, e.data_parallel): e for e in both}
    ddp_only = {(e.pp, e.dp, e.virtual, e.chunks, e.schedule) for e in _layouts()}
    assert {k[:5] for k in by_key if k[5] == "ddp"} == ddp_only
    # zero bubble with replicas: under FSDP only (DDP's all-reduce misses the weight parts)
    split = {k[:5] for k in by_key if k[4] in ZERO_BUBBLE and k[1] > 1}
    assert split and all(k[5] == "fsdp" for k in by_key if k[:5] in split)
    params = sum(p.numel() * p.element_size() for p in _mlp().parameters())
    twins = [(e, by_key[(*k[:5], "ddp")]) for k, e in by_key.items() if k[5] == "fsdp"
             and k[:5] not in split]  # fmt: skip
    assert len(twins) == sum(e.dp > 1 for e in _layouts()) and all(f.dp > 1 for f, _ in twins)
    for fsdp, ddp in twins:
        assert fsdp.step_s == ddp.step_s and fsdp.allreduce_s == ddp.allreduce_s
        assert fsdp.memory_bytes < ddp.memory_bytes
        if fsdp.pp == 1:
            saved = (3 - 4 / fsdp.dp) * params
            assert ddp.memory_bytes - fsdp.memory_bytes == pytest.approx(saved, abs=2)


def test_a_model_built_on_meta_is_ranked_like_the_real_one() -> None:
    x = torch.randn(BATCH, 32)
    with torch.device("meta"):
        model = ResidualMLP(depth=8)
    on_meta = fd.suggest_layout(model, x, WORLD, schedules=ALL)
    assert [(e.pp, e.virtual, e.chunks, e.schedule) for e in on_meta] == [
        (e.pp, e.virtual, e.chunks, e.schedule) for e in _layouts()
    ]
    assert [e.memory_bytes for e in on_meta] == [e.memory_bytes for e in _layouts()]
    assert all(p.is_meta for p in model.parameters())
    with pytest.raises(ConfigError, match="cost='time'.*meta"):
        fd.suggest_layout(model, x, WORLD, cost="time", device="cpu")


def test_every_layout_gives_pipeline_schedules_options_for_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``estimate.options``: the layout's schedule, micro-batches, stages per rank and in all,
    data parallelism, pricing and slack, as a record pipeline_schedule's checks accept for
    its pipeline ranks (no layout ranked that pipeline_schedule or torch would refuse), and
    that a call with its keywords passes on."""
    for e in _layouts():
        record = e.options
        assert (record.schedule, record.n_microbatches, record.stages_per_rank) == (
            e.schedule,
            e.chunks,
            e.virtual,
        )
        assert (record.num_stages, record.data_parallel) == (e.stages, e.data_parallel)
        assert (record.cost, record.tracer, record.slack) == ("flops", "auto", 0.0)
        assert record.stage_count(e.pp, mesh=e.dp > 1) == e.stages
    x = torch.randn(BATCH, 32)
    (e, *_) = fd.suggest_layout(_mlp(), x, 2, cost="auto", tracer="fx", slack=0.05)
    assert (e.options.cost, e.options.tracer, e.options.slack) == ("roofline", "fx", 0.05)
    from fxpipe.distributed import build

    seen: list[fd.ScheduleOptions] = []
    monkeypatch.setattr(build, "_check_initialised", lambda: None)
    monkeypatch.setattr(build, "_build", lambda model, example, options, *_: seen.append(options))
    fd.pipeline_schedule(_mlp(), x, loss_fn=None, **e.options.keywords())
    assert seen == [e.options]


def test_roofline_prices_with_keyword_inputs() -> None:
    case = ZOO["transformer"]
    args, kwargs = case.example(8)
    layouts = fd.suggest_layout(case.build(), args, 2, example_kwargs=kwargs, cost="auto")
    assert layouts and all(e.step_s > 0 for e in layouts)
    assert {(e.pp, e.dp) for e in layouts} == {(1, 2), (2, 1)}
    table = format_layouts(layouts, limit=3)
    assert len(table.splitlines()) == 5 and "schedule" in table


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"world_size": 0}, "world_size=0"),
        ({"world_size": 2.0}, "world_size=2.0"),
        ({"world_size": True}, "world_size=True"),
        ({"link_bandwidth": 0}, "link_bandwidth=0"),
        ({"dp_bandwidth": float("nan")}, "dp_bandwidth=nan"),
        ({"device_flops": "fast"}, "device_flops='fast'"),
        ({"max_memory": "lots"}, "'lots'"),
        ({"max_memory": 0}, "max_memory amount 0"),
        ({"max_memory": {0: "1GiB"}}, "max_memory={0: '1GiB'}"),
        ({"schedules": ("chimera",)}, "'chimera'"),
        ({"virtual": 1}, "virtual=1"),
        ({"chunks": 0}, "chunks=0"),
        ({"chunks": 5}, "chunks=5"),
        ({"cost": "params"}, "cost='params'"),
        ({"checkpoint": "sometimes"}, "checkpoint='sometimes'"),
        ({"slack": -1}, "slack=-1"),
        ({"data_parallel": "zero3"}, "data_parallel='zero3'"),
        ({"schedules": ("1f1b", "chimera")}, "schedules[1]='chimera' is not one of"),
        ({"schedules": ("1f1b", "async")}, "schedule='Async1F1B' has no flush to price"),
        ({"schedules": ()}, "schedules=() is empty"),
        ({"virtual": (2, 1)}, "virtual[1]=1 must be a whole number >= 2"),
        ({"data_parallel": ("ddp", "zero3")}, "data_parallel[1]='zero3'"),
    ],
)
def test_bad_options_are_refused_naming_the_value(options: dict[str, object], named: str) -> None:
    kwargs: dict[str, object] = {"world_size": 4, **options}
    world = kwargs.pop("world_size")
    with pytest.raises(ConfigError) as raised:
        fd.suggest_layout(_mlp(), torch.randn(BATCH, 32), world, **kwargs)  # type: ignore[arg-type]
    assert named in str(raised.value)


def test_every_layout_left_out_is_refused_naming_why(monkeypatch: pytest.MonkeyPatch) -> None:
    """When layouts exist but fd.pipeline_schedule would refuse each (zero bubble under DDP
    replicas; FSDP where one rank's two stages read a tied weight, on a torch that cannot
    leave it whole), the error says so and names what was left out, not that the graph
    cannot be cut."""
    x = torch.randn(8, 64)
    with pytest.raises(ConfigError, match="dualpipev with ddp.*data_parallel='fsdp'") as raised:
        fd.suggest_layout(_chain(), x, 4, schedules=("dualpipev",), chunks=(4,))
    assert "cut into" not in str(raised.value) and "leave whole" not in str(raised.value)
    case = ZOO["transformer"]
    args, kwargs = case.example(8)
    options: dict[str, Any] = dict(
        example_kwargs=kwargs, chunks=(4,), schedules=("zbvzerobubble",), data_parallel="fsdp"
    )
    assert fd.suggest_layout(case.build(), args, 4, **options)  # the tied weight left whole
    monkeypatch.setattr(layout_estimate, "can_leave_whole", lambda: False)
    with pytest.raises(ConfigError, match="zbvzerobubble with fsdp.*two stages of one rank"):
        fd.suggest_layout(case.build(), args, 4, **options)


def test_fsdp_prices_a_weight_it_leaves_whole_in_full(monkeypatch: pytest.MonkeyPatch) -> None:
    """ZBV puts the tied embedding's two stages on rank 0, where FSDP leaves it whole: that
    rank holds all of its weights, gradients and two Adam moments once (4 copies), not
    each stage's gathered copy, gradient and 1 / dp shards of the three (2 + 4 / dp copies,
    twice)."""
    case = ZOO["transformer"]
    args, kwargs = case.example(16)
    model = case.build()
    options: dict[str, Any] = dict(
        example_kwargs=kwargs, chunks=(4,), schedules=("zbvzerobubble",), data_parallel="fsdp"
    )

    def two_by_two() -> int:
        found = [e for e in fd.suggest_layout(model, args, 4, **options) if e.dp == 2]
        return found[0].memory_bytes

    whole = two_by_two()
    monkeypatch.setattr(layout_estimate, "whole_parameters", lambda *_: frozenset())
    sharded = two_by_two()
    weight = model.tok.weight.numel() * model.tok.weight.element_size()
    assert whole - sharded == 4 * weight - 2 * (2 + 4 / 2) * weight


def test_no_layout_at_all_is_refused() -> None:
    """Three rows over four ranks: no replica count divides them and one Linear cannot be
    pipelined."""
    with pytest.raises(ConfigError, match="world_size=4.*batch of 3"):
        fd.suggest_layout(nn.Linear(4, 4), torch.randn(3, 4), 4)
