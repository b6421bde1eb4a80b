"""Pipeline x tensor parallel on gloo ranks: the hand-written decoder LM (a tied embedding and
head, a fused q, k, v) on a ("pp", "dp", "tp") mesh with ``tensor_parallel="auto"``, one stage
cut over two ranks (1 x 1 x 2) and two stages each cut over two ranks (2 x 1 x 2), then two
stages per rank and the zoo's Llama; two replicas of each under FSDP and DDP (1 x 2 x 2,
2 x 2 x 2): the loss, every gradient (gathered whole) and the merged state dict after one
SGD step equal eager PyTorch's on the global batch, on every "tp" coordinate. Then
transformers' GPT-2, Llama and Qwen2 on each mesh, a plan given in torch's form, compiled
stages, checkpoints across layouts; and what is refused."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.tensor.parallel import SequenceParallel

import fxpipe
import fxpipe.distributed as fd
from fxpipe.distributed.options import ScheduleOptions
from fxpipe.distributed.parallel.mesh import mesh_layout
from fxpipe.distributed.parallel.ownership import is_dtensor
from fxpipe.distributed.planning.layout import DEFAULT_DEVICE_FLOPS
from fxpipe.errors import ConfigError
from tests.distributed.rank.test_checkpoint import _eager_steps as eager_steps
from tests.distributed.rank.test_checkpoint import _lm_mean as lm_mean
from tests.distributed.rank.test_checkpoint import _optimizer as sgd
from tests.distributed.rank.test_checkpoint import _train_steps as train_steps
from tests.distributed.ranks import (
    BATCH,
    N_MB,
    check_against_eager,
    close,
    launch,
    preload,
    problem,
    results,
    step,
    tiny_gpt,
    train,
    train_cases,
    whole,
)

preload(__name__)

FAMILIES = ("qwen3", "gemma3", "mistral", "phi3", "olmo2")


def _check(runs: list[dict[str, Any]], tp: int, name: str = "transformer", dp: int = 1) -> None:
    for t in range(tp):  # each "tp" coordinate runs one copy of each pipeline replica
        check_against_eager(name, [r for r in runs if r["tp_rank"] == t], replicas=dp)


def test_one_stage_cut_over_two_ranks_equals_eager(tmp_path: Path) -> None:
    runs = results(launch(train, 2, tmp_path, name="transformer", schedule="gpipe", tp=2))
    _check(runs, 2)
    for r in runs:
        assert r["stages"] == (0,)
        assert "tok.weight" in r["sharded"]  # the tied embedding and head, one DTensor
        assert "blocks.0.attn.qkv.weight" in r["sharded"]
        assert "ln_f.weight" not in r["sharded"]  # whole on every rank


def test_two_stages_each_cut_over_two_ranks_equal_eager(tmp_path: Path) -> None:
    runs = results(launch(train, 4, tmp_path, name="transformer", schedule="1f1b", tp=2))
    _check(runs, 2)
    # the stages were balanced by one "tp" rank's costs in seconds (FLOP at the layout
    # model's rate, pipeline_schedule's default cost): a column-wise product half its own
    build, args, _, _, _ = problem("transformer", BATCH)
    whole = fxpipe.plan(build(), args, ["cpu"] * 2, cost="flops").costs.nodes
    columns = [n for n, s in runs[0]["cut_styles"].items() if s == "colwise"]
    assert columns
    for n in columns:
        seconds = whole[n].cost / DEFAULT_DEVICE_FLOPS
        assert runs[0]["node_costs"][n] == pytest.approx(seconds / 2, rel=1e-9)
    by_stage = {r["stages"]: r for r in runs}
    assert set(by_stage) == {(0,), (1,)}
    for r in runs:  # the tied weight lives on both stages' ranks, its gradients summed
        assert r["replicated"] == ("tok.weight",)
        assert "tok.weight" in r["sharded"]


@pytest.mark.parametrize("data_parallel", ["fsdp", "ddp"])
def test_two_replicas_of_stages_cut_over_two_ranks_equal_eager(
    tmp_path: Path, data_parallel: str
) -> None:
    """1 x 2 x 2: FSDP shards (or DDP's replicas, torch's replicate) over "dp" of Parameters
    cut over "tp", each replica fed half the global batch; one stage, then two on the one
    pipeline rank (the tied embedding and head on both: left whole by either wrapper, its
    gradient averaged over "dp" by sync_tied_gradients). One launch for both."""
    cases = [("transformer", "gpipe", 1), ("transformer", "loopedbfs", 2)]
    runs = launch(train_cases, 4, tmp_path, cases=cases, tp=2, dp=2,
                  data_parallel=data_parallel)  # fmt: skip
    one, two = zip(*results(runs), strict=True)
    for per_rank, whole_keys in ((one, ()), (two, ("tok.weight",))):
        _check(list(per_rank), 2, dp=2)
        for r in per_rank:  # every Parameter a DTensor: on ("dp", "tp"), "dp" or "tp"
            assert r["sharded"] == sorted(r["grads"]), r["sharded"]
            assert r["replicated"] == whole_keys


@pytest.mark.slow
def test_two_replicas_of_two_stages_cut_over_two_ranks_equal_eager(tmp_path: Path) -> None:
    """2 x 2 x 2 under FSDP: two replicas of a pipeline of two stages, each cut over two
    ranks; the tied weight's pieces (FSDP's shards of them) summed over "pp" (DDP's
    replicas at 2 x 2 x 2 run the transformers models below)."""
    runs = launch(train, 8, tmp_path, name="transformer", schedule="1f1b", tp=2, dp=2,
                  data_parallel="fsdp")  # fmt: skip
    per_rank = results(runs)
    _check(per_rank, 2, dp=2)
    assert sorted(r["stages"] for r in per_rank) == [(0,)] * 4 + [(1,)] * 4
    for r in per_rank:
        assert r["replicated"] == ("tok.weight",)
        assert r["sharded"] == sorted(r["grads"]), r["sharded"]


@pytest.mark.slow
def test_zero_bubble_split_backward_through_tp_under_fsdp_equals_eager(tmp_path: Path) -> None:
    """1 x 2 x 2, ZBV (two stages on the rank, each backward split into input and weight
    parts through the tensor-parallel collectives) under FSDP's replicas: equal to eager."""
    runs = launch(train, 4, tmp_path, name="transformer", schedule="zbvzerobubble", spr=2,
                  tp=2, dp=2, data_parallel="fsdp")  # fmt: skip
    _check(results(runs), 2, dp=2)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "world", "schedule", "spr"),
    [
        ("transformer", 2, "loopedbfs", 2),  # both stages on one rank: one tied DTensor
        ("transformer", 4, "interleaved1f1b", 2),
        ("transformer", 6, "gpipe", 1),  # 3 x 1 x 2: the middle ranks hold no tied piece
    ],
)
def test_more_layouts_equal_eager(
    tmp_path: Path, name: str, world: int, schedule: str, spr: int
) -> None:
    runs = launch(train, world, tmp_path, name=name, schedule=schedule, spr=spr, tp=2)
    _check(results(runs), 2, name)


def _refusals(rank: int, world: int) -> list[str]:
    """The messages of the meshes tensor parallelism refuses, before any communication: no
    "tp" dimension, a "tp" dimension without tensor_parallel, and DDP's replicas over "dp"
    on a torch without ``replicate`` (its module hidden here); FSDP's are taken there."""
    import sys

    from torch.distributed.device_mesh import init_device_mesh

    auto = ScheduleOptions(n_microbatches=1, tensor_parallel="auto")
    plain = ScheduleOptions(n_microbatches=1)
    replicas = init_device_mesh("cpu", (1, 2, 1), mesh_dim_names=("pp", "dp", "tp"))
    cases = [
        (init_device_mesh("cpu", (1, 2), mesh_dim_names=("pp", "dp")), auto),
        (replicas, auto),
        (init_device_mesh("cpu", (1, 1, 2), mesh_dim_names=("pp", "dp", "tp")), plain),
    ]
    said = []
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(sys.modules, "torch.distributed._composable.replicate_with_fsdp", None)
        for mesh, options in cases:
            with pytest.raises(ConfigError) as caught:
                mesh_layout(mesh, None, options)
            said.append(str(caught.value))
        fsdp = replace(auto, data_parallel="fsdp")
        said.append(str(mesh_layout(replicas, None, fsdp).replaces_parameters))
    return said


def test_meshes_tensor_parallelism_cannot_run_on_are_refused(tmp_path: Path) -> None:
    for said in results(launch(_refusals, 2, tmp_path)):
        assert "tensor parallelism needs a 3-D mesh named ('pp', 'dp', 'tp')" in said[0]
        assert (
            "data_parallel='ddp' over a mesh of dp=2 and tp=1 needs torch's replicate" in (said[1])
        )
        assert "pass data_parallel='fsdp', or upgrade torch" in said[1]
        assert "(a 'tp' dimension needs tensor_parallel='auto')" in said[2]
        assert said[3] == "True"  # FSDP's replicas run


def test_tensor_parallel_without_a_mesh_is_refused() -> None:
    options = ScheduleOptions(n_microbatches=1, tensor_parallel="auto")
    with pytest.raises(ConfigError, match=r"tensor_parallel='auto' needs a mesh with a 'tp'"):
        mesh_layout(None, None, options)


@pytest.mark.parametrize(
    ("keywords", "said"),
    [
        ({"tensor_parallel": "yes"}, r"tensor_parallel='yes' is not one of \('auto', None\)"),
        ({"tensor_parallel": {}}, r"tensor_parallel=\{\} is not a plan"),
        ({"tensor_parallel": {"model.norm": SequenceParallel()}}, r"model.norm.\] = .* not run"),
    ],
)
def test_what_tensor_parallelism_does_not_run_with_is_refused(
    keywords: dict[str, Any], said: str
) -> None:
    with pytest.raises(ConfigError, match=said):
        ScheduleOptions(**{"n_microbatches": 2, "tensor_parallel": "auto", **keywords})


def _hf_loss(out: Any, target: torch.Tensor) -> torch.Tensor:
    logits = out["logits"]
    return torch.nn.functional.cross_entropy(
        logits.flatten(0, 1), target.flatten(), reduction="sum"
    )


def _hf_pipelined(
    rank: int,
    world: int,
    *,
    name: str,
    dp: int = 1,
    data_parallel: str = "ddp",
    given: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """transformers' ``name`` (export-traced) on a (world / (2 dp)) x dp x 2 mesh, each
    replica fed its slice of the batch, one GPipe step (cut as fxpipe finds, or as ``given``
    says); the loss and every gradient (gathered whole) beside the eager model's on the
    whole batch (over ``dp``: the replicas average their sums)."""
    import copy

    from torch.distributed.device_mesh import init_device_mesh

    from tests.passes.tensor.test_plan import MODELS, VOCAB

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = MODELS[name]()
        ids = torch.randint(0, VOCAB, (4, 8))
        target = torch.randint(0, VOCAB, (4, 8))
    reference = copy.deepcopy(model)
    shape = (world // (2 * dp), dp, 2)
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("pp", "dp", "tp"))
    replica = mesh.get_local_rank("dp")
    mine, wanted = ids.chunk(dp)[replica], target.chunk(dp)[replica]
    pipe = fd.pipeline_schedule(
        model, (mine,), n_microbatches=2, loss_fn=_hf_loss, scale_grads=False, mesh=mesh,
        schedule="gpipe", tensor_parallel="auto" if given is None else given,
        data_parallel=data_parallel,
    )  # fmt: skip
    losses = step(pipe, (mine,), {}, wanted)
    pipe.sync_tied_gradients()
    grads = {k: whole(p.grad) for k, p in pipe.named_parameters() if p.grad is not None}
    with torch.no_grad():
        loss = _hf_loss(reference(mine), wanted)  # this replica's
    _hf_loss(reference(ids), target).backward()
    expected = dict(reference.named_parameters(remove_duplicate=False))
    assert pipe.tensor_plan is not None
    return {
        "loss": (float(sum(losses)) if losses else None, loss.item()),
        "grads": {k: (g, expected[k].grad / dp) for k, g in grads.items()},
        "cut": sorted(k for k, p in pipe.named_parameters() if is_dtensor(p)),
        "sequence": len(pipe.tensor_plan.sequence),
    }


@pytest.mark.slow
@pytest.mark.parametrize(
    ("world", "dp", "data_parallel"),
    [(2, 1, "ddp"), (4, 1, "ddp"), (4, 2, "fsdp"), (8, 2, "ddp")],
    ids=["1x1x2", "2x1x2", "1x2x2-fsdp", "2x2x2-ddp"],
)
def test_transformers_models_pipelined_and_cut_equal_eager(
    tmp_path: Path, world: int, dp: int, data_parallel: str
) -> None:
    """GPT-2 (Conv1D, a fused q, k, v), Llama and Qwen2 at 1 x 1 x 2, one launch a mesh;
    on the larger meshes fewer (what differs there is the mesh, not the family's cut): GPT-2
    and Llama under FSDP, Llama alone at 2 x 1 x 2 (where
    test_more_families_cut_at_2x1x2_equal_eager_and_say_what_they_leave_whole runs five
    more families) and on the 8 ranks of 2 x 2 x 2."""
    names = {2: ["gpt2", "llama", "qwen2"], 4: ["llama"] if dp == 1 else ["gpt2", "llama"]}.get(
        world, ["llama"]
    )
    per_rank = results(launch(_hf_cases, world, tmp_path, names=names, dp=dp,
                              data_parallel=data_parallel))  # fmt: skip
    for name, runs in zip(names, zip(*per_rank, strict=True), strict=True):
        _hf_equal(list(runs), dp)
        assert all(r["cut"] for r in runs)  # each stage holds DTensors
        assert len({k for r in runs for k in r["grads"]}) >= 2 * 7  # every block's products
        # every family's norms run cut along the sequence (GPT-2's Conv1D products reading
        # the tokens unflattened)
        assert all(r["sequence"] > 0 for r in runs), name


def _steps_against_eager(pipe: Any, reference: torch.nn.Module, batches: Any) -> list[Any]:
    """Each (ids, target) batch stepped through ``pipe`` and through ``reference`` (eager):
    per step, (pipeline's loss, eager's) and, per parameter, (its whole gradient, eager's)."""
    out = []
    for ids, target in batches:
        for p in pipe.parameters():
            p.grad = None
        reference.zero_grad()
        losses = step(pipe, (ids,), {}, target)
        pipe.sync_tied_gradients()
        grads = {k: whole(p.grad) for k, p in pipe.named_parameters() if p.grad is not None}
        loss = _hf_loss(reference(ids), target)
        loss.backward()
        expected = dict(reference.named_parameters(remove_duplicate=False))
        out.append({
            "loss": (float(sum(losses)) if losses else None, loss.item()),
            "grads": {k: (g, expected[k].grad.clone()) for k, g in grads.items()},
        })  # fmt: skip
    return out


def _hf_lengths(rank: int, world: int, *, lengths: list[int]) -> list[dict[str, Any]]:
    """Llama on a (world / 2) x 1 x 2 mesh, its norms cut along the sequence, one GPipe step
    per length (padded batches of varying, odd lengths: uneven shares of the tokens); each
    step's loss and gradients beside eager's on the same batch."""
    import copy

    from torch.distributed.device_mesh import init_device_mesh

    from tests.passes.tensor.test_plan import MODELS, VOCAB

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = MODELS["llama"]()
        batches = [
            (torch.randint(0, VOCAB, (4, n)), torch.randint(0, VOCAB, (4, n))) for n in lengths
        ]
    reference = copy.deepcopy(model)
    mesh = init_device_mesh("cpu", (world // 2, 1, 2), mesh_dim_names=("pp", "dp", "tp"))
    pipe = fd.pipeline_schedule(
        model, (batches[0][0],), n_microbatches=2, loss_fn=_hf_loss, scale_grads=False,
        mesh=mesh, schedule="gpipe", tensor_parallel="auto",
    )  # fmt: skip
    assert pipe.tensor_plan is not None and pipe.tensor_plan.sequence
    return _steps_against_eager(pipe, reference, batches)


@pytest.mark.parametrize("world", [2, 4], ids=["1x1x2", "2x1x2"])
def test_steps_of_varying_odd_lengths_cut_along_the_sequence_equal_eager(
    tmp_path: Path, world: int
) -> None:
    """7 tokens (shares of 4 and 3), then 1 (rank 1's share empty), then 5."""
    per_rank = results(launch(_hf_lengths, world, tmp_path, lengths=[7, 1, 5]))
    for runs in zip(*per_rank, strict=True):
        _hf_equal(list(runs), 1)


def _families(rank: int, world: int, *, names: list[str]) -> list[dict[str, Any]]:
    """Each family of :data:`tests.passes.tensor.test_plan.FAMILIES` on a 2 x 1 x 2 mesh,
    1F1B over 2 micro-batches, one step at 8 tokens then one at 5 (a window of 4 shorter
    than both); each step's loss and every gradient beside eager's, and the share of this
    rank's block matrices the plan cuts, with the reasons of what it leaves whole."""
    import copy

    from torch.distributed.device_mesh import init_device_mesh

    from tests.passes.tensor.test_plan import FAMILIES, VOCAB

    mesh = init_device_mesh("cpu", (world // 2, 1, 2), mesh_dim_names=("pp", "dp", "tp"))
    out = []
    for name in names:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            model = FAMILIES[name]().double()
            batches = [
                (torch.randint(0, VOCAB, (4, n)), torch.randint(0, VOCAB, (4, n))) for n in (8, 5)
            ]
        reference = copy.deepcopy(model)
        pipe = fd.pipeline_schedule(
            model, (batches[0][0],), n_microbatches=2, loss_fn=_hf_loss, scale_grads=False,
            mesh=mesh, schedule="1f1b", tensor_parallel="auto",
        )  # fmt: skip
        steps = _steps_against_eager(pipe, reference, batches)
        plan = pipe.tensor_plan
        assert plan is not None
        held = {k for k, _ in pipe.named_parameters()}
        fractions = plan.block_fractions(held)
        out.append({"steps": steps, "share": min(fractions.values()), "plan": plan.summary()})
    return out


@pytest.mark.slow
def test_more_families_cut_at_2x1x2_equal_eager_and_say_what_they_leave_whole(
    tmp_path: Path,
) -> None:
    """Qwen3 and Gemma3 (a weight per head of q and k: each tp rank's gradient of it was its
    own heads' part until the ranks' parts were summed), Mistral and Gemma3 with a window
    shorter than the sequence, Phi-3 (q, k, v fused in unequal parts: whole, and said) and
    OLMo2 (q and k normalised over all heads: whole, and said), at 8 and 5 tokens. No stage
    border falls inside a region the plan cuts, so every block of the first three is cut
    whole."""
    names = list(FAMILIES)
    per_rank = results(launch(_families, 4, tmp_path, names=names))
    for k, name in enumerate(names):
        runs = [r[k] for r in per_rank]
        for steps in zip(*(r["steps"] for r in runs), strict=True):
            _hf_equal(list(steps), 1)
        shares = [r["share"] for r in runs]
        if name in ("qwen3", "gemma3", "mistral"):
            assert min(shares) == 1.0, (name, shares)
        else:
            assert min(shares) < 0.8, (name, shares)
            why = " ".join(runs[0]["plan"].split())
            said = "unequal parts" if name == "phi3" else "normalises over the cut features"
            assert said in why, (name, why)


def _hf_cases(rank: int, world: int, *, names: list[str], **options: Any) -> list[dict[str, Any]]:
    """:func:`_hf_pipelined` for each model in turn, in one launch of the ranks."""
    return [_hf_pipelined(rank, world, name=name, **options) for name in names]


@pytest.mark.slow
def test_a_plan_given_in_torchs_form_cuts_what_it_names_and_equals_eager(
    tmp_path: Path,
) -> None:
    """Llama with a plan of its MLPs alone: the MLPs' products are DTensors, the attention
    and the embedding stay whole, and the step equals eager's."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    given = {
        "model.layers.*.mlp.gate_proj": ColwiseParallel(),
        "model.layers.*.mlp.up_proj": ColwiseParallel(),
        "model.layers.*.mlp.down_proj": RowwiseParallel(),
    }
    runs = results(launch(_hf_pipelined, 4, tmp_path, name="llama", given=given))
    _hf_equal(runs, 1)
    cut = {k for r in runs for k in r["cut"]}
    assert cut == {
        f"model.layers.{i}.mlp.{p}.weight" for i in range(2)
        for p in ("gate_proj", "up_proj", "down_proj")
    }  # fmt: skip


def _hf_equal(runs: list[dict[str, Any]], dp: int) -> None:
    """The runs' losses and gradients equal eager's."""
    last = [r["loss"] for r in runs if r["loss"][0] is not None]
    assert len(last) == 2 * dp  # each "tp" rank of the last stage, in each replica
    for got, want in last:
        assert got == pytest.approx(want, rel=1e-5)
    for r in runs:
        for key, (grad, eager) in r["grads"].items():
            close(grad, eager, f"grad of {key}")


# ---------------------------------------------------------------------------- checkpoints


def _save_cut_load_whole(
    rank: int, world: int, *, folder: str, dp: int, data_parallel: str
) -> dict[str, Any]:
    """One step at (2 / dp) x dp x 2 (the stages cut over "tp": DTensors, the fused q, k, v
    placed strided; with dp = 2 under ``data_parallel`` too, each replica fed half the
    batch), saved with torch.distributed.checkpoint; then loaded at 4 x 1 without tensor
    parallelism and at 1 x 1 x 4 (one stage cut over 4 ranks), each taking two more steps."""
    from torch.distributed.device_mesh import init_device_mesh

    _, args, _, _, target = problem("transformer", BATCH)
    out: dict[str, Any] = {}
    layouts = {
        "save": ((2 // dp, dp, 2), ("pp", "dp", "tp")),
        "whole": ((4, 1), ("pp", "dp")),
        "cut": ((1, 1, 4), ("pp", "dp", "tp")),
    }
    for layout, (shape, names) in layouts.items():
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
        mine, wanted = args, target
        if layout == "save":  # this replica's half
            replica = mesh.get_local_rank("dp")
            mine, wanted = (args[0].chunk(dp)[replica],), target.chunk(dp)[replica]
        pipe = fd.pipeline_schedule(
            tiny_gpt(), mine, n_microbatches=N_MB, loss_fn=lm_mean, scale_grads=True,
            mesh=mesh, schedule="1f1b", tensor_parallel="auto" if "tp" in names else None,
            data_parallel=data_parallel if layout == "save" else "ddp",
        )  # fmt: skip
        optimizer = sgd(pipe.parameters())
        if layout == "save":
            out["losses"] = train_steps(pipe, optimizer, mine, wanted, 1)
            pipe.save_checkpoint(folder, optimizer)
            continue
        pipe.load_checkpoint(folder, optimizer)
        # cloned: a replicated DTensor's full_tensor() is its own storage, which steps change
        out[layout] = {k: whole(v).clone() for k, v in pipe.state_dict().items()}
        out[f"{layout} resumed"] = train_steps(pipe, optimizer, args, target, 2)
    return out


@pytest.mark.slow
@pytest.mark.parametrize(("dp", "data_parallel"), [(1, "ddp"), (2, "fsdp")])
def test_a_checkpoint_saved_cut_over_tp_resumes_uncut_and_in_eager(
    tmp_path: Path, dp: int, data_parallel: str
) -> None:
    """Saved from 2 x 1 x 2, or from 1 x 2 x 2 under FSDP (the shards of a weight cut in
    parts, and of its momentum, gathered as fxpipe places them)."""
    import torch.distributed.checkpoint as dcp

    folder = tmp_path / "checkpoint"
    runs = launch(_save_cut_load_whole, 4, tmp_path, folder=str(folder), dp=dp,
                  data_parallel=data_parallel)  # fmt: skip
    per_rank = results(runs)
    _, args, _, _, target = problem("transformer", BATCH)
    losses, after_first = eager_steps(args, target)
    first = [r["losses"][0] for r in per_rank if r["losses"][0] == r["losses"][0]]
    assert len(first) == 2 * dp  # each "tp" coordinate's, in each replica
    assert sum(first) / len(first) == pytest.approx(losses[0], rel=1e-5)  # halves' means
    for layout, last in (("whole", 1), ("cut", 4)):  # ranks whose (last) stage has the loss
        loaded = fd.merge_state_dicts(r[layout] for r in per_rank)
        assert loaded.keys() == after_first.keys()
        for key, value in loaded.items():
            _same(value, after_first[key], f"{key} after one step, saved cut, loaded {layout}")
        resumed = [r[f"{layout} resumed"] for r in per_rank]
        resumed = [losses for losses in resumed if losses[0] == losses[0]]
        assert len(resumed) == last
        for got in resumed:
            assert got == pytest.approx(losses[1:], rel=1e-4), layout
    state = tiny_gpt().state_dict()
    dcp.load({"model": state}, checkpoint_id=str(folder))  # one process: the eager model
    for key, value in state.items():
        _same(value, after_first[key], f"{key} read by the eager model")


def _same(value: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    if value.is_floating_point():
        close(value, expected, what)
    else:
        assert torch.equal(value, expected), what


@pytest.mark.slow
def test_compiled_stages_cut_over_two_ranks_equal_eager(tmp_path: Path) -> None:
    """compile= with tensor parallelism: each rank's cut program (its DTensor products)
    through torch.compile, at 1 x 1 x 2; the step equals eager's, every stage compiled.
    Dynamo and AOT autograd over the DTensors, without inductor's C++ (48 s of the suite's
    time); inductor on ranks is test_build's compiled case."""
    runs = results(launch(train, 2, tmp_path, name="transformer", schedule="gpipe", tp=2,
                          compile={"backend": "aot_eager"}))  # fmt: skip
    _check(runs, 2)
    for r in runs:  # (compiled, graphs) per stage of the rank: each compiled, no fallback
        assert r["compiled"] and all(ok and graphs > 0 for ok, graphs in r["compiled"])
