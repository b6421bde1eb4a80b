"""fxpipe.distributed.parallel.mesh: pipeline x data parallel over a (pp, dp) DeviceMesh
against eager PyTorch on the global batch (DDP and FSDP2), and what each stage's wrapping
leaves whole or unwrapped."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import sweep
from models import ZOO
from torch import nn

from fxpipe.errors import ConfigError
from tests.distributed.ranks import (
    BATCH,
    N_MB,
    check_against_eager,
    launch,
    preload,
    results,
    train_cases,
)

preload(__name__)

#: (model, schedule, stages per rank): long skips (unet) and a tied embedding (transformer),
#: under GPipe, 1F1B and looped BFS (breadth-first, two stages per rank); interleaved 1F1B
#: with the skips.
MESH_CASES = [
    (name, schedule, spr)
    for name in ("unet", "transformer")
    for schedule, spr in (("gpipe", 1), ("1f1b", 1), ("loopedbfs", 2))
] + [
    ("unet", "interleaved1f1b", 2),
    ("shared_module", "loopedbfs", 2),
    ("weight_for_dtype", "gpipe", 1),
]
#: Zero-bubble schedules (backward split into input and weight parts), FSDP only: the
#: V-shaped ZBV and DualPipeV (stages r and 3 - r on rank r: the tied embedding and head
#: both on rank 0) and interleaved zero bubble; routed_experts sends gates gathered from a
#: Parameter alone out of stage 2; shared_offsets adds one Parameter to each block's own
#: (torch's split backward grouped them so that their gradients counted several times).
ZERO_BUBBLE_CASES = [
    ("unet", "zbvzerobubble", 2),
    ("unet", "dualpipev", 2),
    ("transformer", "interleavedzerobubble", 2),
    ("transformer", "zbvzerobubble", 2),
    ("routed_experts", "zbvzerobubble", 2),
    ("shared_offsets", "zbvzerobubble", 2),
]
#: Under FSDP, the Parameters left whole (read by two stages of one rank), by case and
#: the rank's stages: the tied embedding on ZBV's rank 0, the block called at two depths.
WHOLE = {
    ("transformer", "zbvzerobubble"): {(0, 3): ["tok.weight"]},
    ("shared_offsets", "zbvzerobubble"): {(0, 3): ["shared"], (1, 2): ["shared"]},
    ("shared_module", "loopedbfs"): {
        (0, 2): [f"shared.{m}.{p}" for m in ("fc1", "fc2", "norm") for p in ("bias", "weight")]
    },
}


@pytest.mark.parametrize("data_parallel", sweep(["fsdp", "ddp"]))
def test_two_stages_by_two_replicas_match_eager_on_the_global_batch(
    tmp_path: Path, data_parallel: str
) -> None:
    """A 2 x 2 mesh: two pipeline replicas (DDP, or FSDP2 shards, over "dp"), each fed half
    the batch, for every case of MESH_CASES (and, with FSDP, ZERO_BUBBLE_CASES): losses and
    every gradient equal eager's."""
    cases = MESH_CASES + (ZERO_BUBBLE_CASES if data_parallel == "fsdp" else [])
    runs = launch(train_cases, 4, tmp_path, cases=cases, dp=2, data_parallel=data_parallel)
    for case, *per_case in zip(cases, *results(runs), strict=True):
        name, schedule, spr = case
        per_rank = list(per_case)
        stages_of = [tuple(range(j, 2 * spr, 2)) for j in range(2)]
        if schedule in ("zbvzerobubble", "dualpipev"):
            stages_of = [(0, 3), (1, 2)]
        stages = [stages_of[0], stages_of[0], stages_of[1], stages_of[1]]
        assert [r["stages"] for r in per_rank] == stages, case
        assert [r["replica"] for r in per_rank] == [0, 1, 0, 1], case
        for r in per_rank:  # FSDP: every parameter a DTensor shard but those left whole
            own = sorted(set(r["grads"]) | set(r["sharded"]))
            whole = WHOLE.get((name, schedule), {}).get(r["stages"], [])
            sharded = sorted(set(own) - set(whole)) if data_parallel == "fsdp" else []
            assert r["sharded"] == sharded, (case, r["stages"])
            assert r["view_warnings"] == [], (case, r["view_warnings"][:1])
        check_against_eager(name, per_rank, replicas=2)


def test_fsdp_leaves_whole_a_parameter_read_by_two_stages_of_one_rank(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """fully_shard wraps each stage alone: a Parameter two stages of one rank read (a tied
    weight under a V or looped schedule) cannot be sharded for both, so it is left whole,
    on every rank (so too by replicate, DDP's replicas under tensor parallelism); DDP, or
    one replica, shard nothing. A torch whose fully_shard cannot
    leave a Parameter out is refused, naming the stages."""
    from dataclasses import replace

    from fxpipe.distributed.parallel import mesh
    from fxpipe.distributed.parallel.mesh import Layout, check_sharding

    shared = nn.Linear(2, 2)
    both = {id(shared.weight), id(shared.bias)}
    stages = [nn.Sequential(shared), nn.Sequential(nn.Linear(2, 2)), nn.Sequential(shared)]
    fsdp = Layout(None, dp_group=object(), dp_size=2, data_parallel="fsdp")  # type: ignore[arg-type]
    assert check_sharding(fsdp, stages, (0, 1, 0)) == both
    assert check_sharding(fsdp, stages, (0, 1, 2)) == set()  # on two ranks: each its own
    # Read by stages 0, 1 and 3 on ranks 0, 1, 1: the two on rank 1 share it.
    four = [stages[0], nn.Sequential(shared), nn.Sequential(nn.Linear(2, 2)), stages[2]]
    assert check_sharding(fsdp, four, (0, 1, 0, 1)) == both
    assert check_sharding(replace(fsdp, data_parallel="ddp"), stages, (0, 1, 0)) == set()
    # DDP's replicas under tensor parallelism are torch's replicate, which wraps alike
    replicated = replace(fsdp, data_parallel="ddp", tp_mesh=object())
    assert check_sharding(replicated, stages, (0, 1, 0)) == both
    assert check_sharding(replace(fsdp, dp_group=None), stages, (0, 1, 0)) == set()
    monkeypatch.setattr(mesh, "can_leave_whole", lambda: False)
    with pytest.raises(ConfigError, match=r"stages 0 and 2, which are both on pipeline rank 0"):
        check_sharding(fsdp, stages, (0, 1, 0))
    with pytest.raises(ConfigError, match=r"stages 1 and 3, which are both on pipeline rank 1"):
        check_sharding(fsdp, four, (0, 1, 0, 1))
    with pytest.raises(ConfigError, match="data_parallel='ddp'"):
        check_sharding(fsdp, stages, (0, 1, 0))
    assert check_sharding(fsdp, stages, (0, 1, 2)) == set()


def test_a_stage_without_parameters_is_not_wrapped_for_data_parallelism() -> None:
    """A stage of no Parameters (a split between Mixtral's layers left one with none) has
    nothing to average or shard: DDP would refuse it ("not needed when a module doesn't
    have any parameter"), so neither wraps it; a stage with Parameters is wrapped."""
    from dataclasses import replace

    from fxpipe.distributed.parallel.mesh import Layout

    ddp = Layout(None, dp_group=object(), dp_size=2, data_parallel="ddp")  # type: ignore[arg-type]
    bare = nn.Sequential(nn.ReLU())
    assert ddp.wrap(bare, torch.device("cpu")) is bare
    assert replace(ddp, data_parallel="fsdp").wrap(bare, torch.device("cpu")) is bare
    frozen = nn.Linear(2, 2).requires_grad_(False)
    assert ddp.wrap(frozen, torch.device("cpu")) is frozen
    with pytest.raises((AttributeError, TypeError, ValueError, RuntimeError)):
        ddp.wrap(nn.Linear(2, 2), torch.device("cpu"))  # wrapped: DDP reads the fake group


@pytest.mark.parametrize(
    "name, stages, idle",
    [
        ("weight_for_dtype", 2, (False, True)),
        ("mlp_residual", 3, (False, False, False)),
        ("transformer", 2, (False, False)),
    ],  # fmt: skip
)
def test_only_a_stage_holding_a_weight_it_reads_for_its_dtype_makes_ddp_search(
    name: str, stages: int, idle: tuple[bool, ...]
) -> None:
    """DDP searches each step for Parameters its stage gives no gradient only where the
    stage holds a trained one its outputs do not depend on (weight_for_dtype's last stage
    reads the first layer's weight for its dtype); elsewhere the search is skipped (and
    torch's warning that it found none)."""
    from fxpipe.compiler import compile_model
    from fxpipe.distributed.rank.shapes import example_shapes
    from fxpipe.options import PlanOptions

    case = ZOO[name]
    model = case.build()
    args, kwargs = case.example(BATCH)
    options = PlanOptions(cost="flops", chunks=N_MB, traffic="relay", replicate_weights=True)
    compiled = compile_model(model, args, ["cpu"] * stages, options, example_kwargs=kwargs)
    values = compiled.traced.binder.bind(args, kwargs)
    assert example_shapes(model, compiled.program, values).idle == idle
