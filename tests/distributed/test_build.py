"""fxpipe.distributed.build: pipeline_schedule on two and four ranks against eager PyTorch,
what it plans, and what it refuses when the pipeline is built."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from models import ZOO, FixedRows, ResidualMLP
from torch import nn

import fxpipe.distributed as fd
from fxpipe.errors import ConfigError, FxPipeError, PlanError
from tests.distributed.ranks import (
    BATCH,
    N_MB,
    check_against_eager,
    launch,
    preload,
    problem,
    results,
    step,
    sum_sq,
    tiny_gpt,
    train,
    train_cases,
)

preload(__name__)


def _batch_checks(rank: int, world: int) -> dict[str, Any]:
    """What splitting the batch changes, on each rank: a batch size written into the model is
    refused when the pipeline is built (the model untouched), and BatchNorm in training
    mode is warned about once, at the first step (none in eval mode)."""
    import warnings

    from fxpipe.errors import BatchStatisticsWarning

    fixed = FixedRows(rows=8, width=16, out=4)  # fits batches of 8 rows only
    try:
        fd.pipeline_schedule(fixed, torch.randn(BATCH, 16), n_microbatches=N_MB, loss_fn=sum_sq)
        refused = ""
    except PlanError as e:
        refused = str(e)
    build, args, kwargs, loss_fn, target = problem("resnet")
    seen = {}
    for mode in ("train", "eval"):
        model = build().train(mode == "train")
        pipe = fd.pipeline_schedule(model, args, n_microbatches=N_MB, loss_fn=loss_fn)
        counts = []
        for _ in range(2):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                step(pipe, args, kwargs, target)
            found = [w for w in caught if issubclass(w.category, BatchStatisticsWarning)]
            counts.append(len(found))
            seen[f"{mode}_text"] = seen.get(f"{mode}_text", "") + "".join(
                str(w.message) for w in found
            )
        seen[mode] = counts
    return {
        "refused": refused,
        "untouched": all(not p.is_meta for p in fixed.parameters()),
        **seen,
    }


def _disagree(rank: int, world: int) -> dict[str, Any]:
    """The ranks build different models; each must refuse, after the one collective."""
    _, args, _, loss_fn, _ = problem("mlp_residual")
    model = ResidualMLP(depth=6 if rank == 0 else 5)
    try:
        fd.pipeline_schedule(model, args, n_microbatches=N_MB, loss_fn=loss_fn)
        error = ""
    except FxPipeError as e:
        error = str(e)
    return {"error": error, "untouched": all(not p.is_meta for p in model.parameters())}


@pytest.mark.slow
def test_two_ranks_match_eager(tmp_path: Path) -> None:
    """Long skips (unet) under GPipe and 1F1B, dict inputs and outputs, a Llama decoder."""
    cases = [("unet", "gpipe", 1), ("unet", "1f1b", 1), ("multi_io_dict", "1f1b", 1)]
    cases.append(("llama", "1f1b", 1))
    runs = launch(train_cases, 2, tmp_path, cases=cases)
    for (name, _, _), *per_case in zip(cases, *results(runs)):
        assert [r["stages"] for r in per_case] == [(0,), (1,)], name
        check_against_eager(name, per_case)


@pytest.mark.slow
def test_compiled_stages_on_two_ranks_match_eager(tmp_path: Path) -> None:
    """compile= on every rank (torch's aot_eager backend): long skips under 1F1B, a Llama
    decoder under GPipe; losses, gradients and the merged state dict as without it."""
    cases = [("unet", "1f1b", 1), ("llama", "gpipe", 1)]
    runs = launch(train_cases, 2, tmp_path, cases=cases, compile={"backend": "aot_eager"})
    for (name, _, _), *per_case in zip(cases, *results(runs)):
        assert [r["stages"] for r in per_case] == [(0,), (1,)], name
        for r in per_case:  # each rank's one stage compiled, none left eager
            assert len(r["compiled"]) == 1 and all(ok and n > 0 for ok, n in r["compiled"])
        check_against_eager(name, per_case)


@pytest.mark.slow
def test_four_ranks_match_eager(tmp_path: Path) -> None:
    per_rank = results(launch(train, 4, tmp_path, name="unet", schedule="1f1b"))
    assert [r["stages"] for r in per_rank] == [(0,), (1,), (2,), (3,)]
    check_against_eager("unet", per_rank)


@pytest.mark.slow
@pytest.mark.parametrize(
    "schedule, stages",
    [
        ("interleaved1f1b", [(0, 2), (1, 3)]),
        ("zbvzerobubble", [(0, 3), (1, 2)]),
        ("dualpipev", [(0, 3), (1, 2)]),
    ],
)
def test_two_stages_per_rank(tmp_path: Path, schedule: str, stages: list[Any]) -> None:
    runs = launch(train, 2, tmp_path, name="unet", schedule=schedule, spr=2, scale_grads=True)
    per_rank = results(runs)
    assert [r["stages"] for r in per_rank] == stages
    check_against_eager("unet", per_rank, divide=N_MB)


@pytest.mark.slow
def test_what_splitting_the_batch_changes_is_refused_or_warned_on_every_rank(
    tmp_path: Path,
) -> None:
    for r in results(launch(_batch_checks, 2, tmp_path)):
        assert "n_microbatches=4" in r["refused"] and "reshape" in r["refused"], r["refused"]
        assert "pass n_microbatches=1" in r["refused"] and r["untouched"]
        assert r["train"] == [1, 0] and r["eval"] == [0, 0], (r["train"], r["eval"])
        assert "BatchNorm" in r["train_text"] and "pass n_microbatches=1" in r["train_text"]
        assert "deferred_batch_norm" not in r["train_text"]  # not an option here


@pytest.mark.slow
def test_ranks_that_plan_differently_all_refuse(tmp_path: Path) -> None:
    for result in results(launch(_disagree, 2, tmp_path, pg_timeout=20)):
        assert "rank(s) [1] computed a different plan" in result["error"]
        assert result["untouched"]


def test_one_process_per_stage_plans_a_tied_weight_held_by_each_stage_not_sent() -> None:
    """What pipeline_schedule plans (replicate_weights): the tied weight is in both stages'
    parameters and memory and on no border; the single-process plan sends it whole once
    per batch, and its summary counts it so."""
    from fxpipe.compiler import compile_model
    from fxpipe.options import PlanOptions

    args, kwargs = ZOO["transformer"].example(BATCH)
    weight = 64 * 32 * 4  # TinyGPT's vocab x width, float32
    plans = {}
    for replicate in (False, True):
        options = PlanOptions(cost="flops", chunks=N_MB, traffic="relay",
                              replicate_weights=replicate)  # fmt: skip
        plans[replicate] = compile_model(
            tiny_gpt(), args, ["cpu", "cpu"], options, example_kwargs=kwargs, present=False
        ).plan
    sent, held = plans[False], plans[True]
    (edge,) = [e for e in sent.edges if e.value == "tok_weight"]
    assert edge.bytes == weight and edge.consumers == (1,)
    assert "tok_weight" not in {e.value for e in held.edges}
    assert all(s.param_bytes >= weight for s in held.stages)
    assert "replicated:  tok.weight (stages 0, 1)" in str(held)
    assert "replicated:" not in str(sent)
    (line,) = [line for line in str(sent).splitlines() if line.startswith("boundaries:")]
    activations = sum(e.bytes for e in sent.edges if e.value != "tok_weight")
    assert f"{fxpipe_bytes(weight + activations)} per batch" in line
    assert f"({fxpipe_bytes(activations / N_MB)} per micro-batch, " in line
    assert f"{fxpipe_bytes(weight)} of it once per batch" in line


def fxpipe_bytes(size: float) -> str:
    from fxpipe.views.report import format_bytes

    return format_bytes(size)


def test_zero_bubble_refuses_a_stage_whose_inputs_need_no_gradient() -> None:
    """torch starts a later stage's weight part from its inputs: a stage with Parameters
    and no input that needs a gradient would get none, so it is refused; a schedule with a
    whole backward, or an input that needs one, or frozen Parameters, is fine."""
    from types import SimpleNamespace

    from fxpipe.distributed.build import check_weight_part

    def meta(dtype: torch.dtype, grad: bool) -> torch.Tensor:
        return torch.empty(2, 3, dtype=dtype, device="meta").requires_grad_(grad)

    program: Any = SimpleNamespace(modules=[nn.Linear(3, 3), nn.Linear(3, 3)])
    ids: Any = [((meta(torch.float32, True),), ()), ((torch.zeros(2, 3, dtype=torch.long),), ())]
    with pytest.raises(ConfigError, match=r"stage 1 trains Parameters \(weight, bias\)"):
        check_weight_part("zbvzerobubble", program, ids)
    with pytest.raises(ConfigError, match="'1f1b'"):
        check_weight_part("interleavedzerobubble", program, ids)
    check_weight_part("1f1b", program, ids)
    floats = [ids[0], ((meta(torch.float32, False), meta(torch.float32, True)), ())]
    check_weight_part("zbvzerobubble", program, floats)
    program.modules[1].requires_grad_(False)
    check_weight_part("zbvzerobubble", program, ids)
