"""fxpipe.distributed on Hugging Face decoders (Llama, Mistral, a Mixture of Experts, XLM) against
eager PyTorch: two processes on the CPU, gloo on loopback, cost="flops" and cost="time".

The models are tiny configs built in float64 (no download). Two ranks start once per cost
(the launcher of ``ranks.py``: a fork server, a hard time limit, results read back) and
pipeline every model in turn, each for one 1F1B step with a sum-reduced LM loss; each test
compares one model's loss and every parameter gradient with the eager model's on the whole
batch. One Llama makes its rotary tables with autocast off, as transformers 4.x writes it:
torch.export records that region as a higher-order op whose body module each stage reads.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from operator import attrgetter
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F
from models import ResidualMLP
from oracle import no_further_than_eager
from torch import nn

import fxpipe.distributed as fd
from fxpipe.errors import ConfigError, FxPipeError
from tests.distributed.ranks import launch, results

# In the ``test`` extra; .ci/run fails when it does not import, so this never skips there.
transformers = pytest.importorskip("transformers")

# Every test starts two ranks (each imports torch and transformers): all slow.
pytestmark = pytest.mark.slow

VOCAB = 61
BATCH, LENGTH, N_MB = 4, 8, 2
COMMON: dict[str, Any] = dict(
    num_hidden_layers=2, hidden_size=32, intermediate_size=48, num_attention_heads=4,
    num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=32, use_cache=False,
    bos_token_id=0, eos_token_id=0, pad_token_id=0,
)  # fmt: skip


def llama() -> nn.Module:
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**COMMON))


def mistral() -> nn.Module:
    config = transformers.MistralConfig(**COMMON, sliding_window=4)
    return transformers.MistralForCausalLM(config)


def mixtral() -> nn.Module:
    """Mixtral's sparse MoE; experts run as batched matmuls ("batched_mm"), which export
    traces (the default grouped-matmul kernel is a custom op the tracer refuses)."""
    config = transformers.MixtralConfig(
        **COMMON, num_local_experts=4, num_experts_per_tok=2, experts_implementation="batched_mm"
    )
    return transformers.MixtralForCausalLM(config)


def llama_autocast_rope() -> nn.Module:
    """Llama whose rotary tables are made with autocast off (transformers 4.x does so)."""
    model = llama()
    rotary = model.model.rotary_emb
    tables = rotary.forward

    def autocast_off(x: torch.Tensor, position_ids: torch.Tensor) -> Any:
        with torch.autocast(device_type=x.device.type, enabled=False):
            return tables(x, position_ids)

    rotary.forward = autocast_off
    return model


def xlm() -> nn.Module:
    """XLM checks its lengths with ``.item()``: a stage's shapes cannot be found on fake
    tensors, so they are found on the example's micro-batch."""
    config = transformers.XLMConfig(
        vocab_size=VOCAB, emb_dim=32, n_layers=2, n_heads=4, dropout=0.0,
        attention_dropout=0.0, max_position_embeddings=32, pad_index=0,
    )  # fmt: skip
    return transformers.XLMWithLMHeadModel(config)


MODELS: dict[str, Callable[[], nn.Module]] = {
    "llama": llama,
    "llama_autocast_rope": llama_autocast_rope,
    "mistral": mistral,
    "mixtral": mixtral,
    "xlm": xlm,
}


def _build(name: str) -> nn.Module:
    """The same float64 weights on every call (and on every rank)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return MODELS[name]().double()


def _batch() -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
    """Token ids, an attention mask with one padded sequence, next-token targets."""
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(1, VOCAB, (BATCH, LENGTH), generator=gen)
    mask = torch.ones(BATCH, LENGTH, dtype=torch.long)
    mask[1, 6:] = 0
    target = torch.randint(0, VOCAB, (BATCH, LENGTH), generator=gen)
    return ids, {"attention_mask": mask}, target


def _loss(out: Any, target: torch.Tensor) -> torch.Tensor:
    logits = out["logits"]
    return F.cross_entropy(logits.flatten(0, 1), target.flatten(), reduction="sum")


def _eager(name: str) -> tuple[float, dict[str, torch.Tensor]]:
    model = _build(name)
    ids, kwargs, target = _batch()
    loss = _loss(model(ids, **kwargs), target)
    loss.backward()
    return loss.item(), {k: p.grad for k, p in model.named_parameters() if p.grad is not None}


def _bodies(gm: fx.GraphModule) -> list[str]:
    """Targets of the get_attr nodes of ``gm`` that name a module (a higher-order op body)."""
    return [
        str(n.target)
        for n in gm.graph.nodes
        if n.op == "get_attr" and isinstance(attrgetter(str(n.target))(gm), nn.Module)
    ]


#: Zero-bubble schedules of two stages per rank, with the micro-batches each needs: Mixtral's
#: batched experts gather each token's expert weights in one stage and send them on.
ZERO_BUBBLE = {"zbvzerobubble": BATCH, "interleavedzerobubble": N_MB}


def _pipelined(
    name: str, cost: str, schedule: str = "1f1b", *, meta: bool = False
) -> dict[str, Any]:
    """One pipelined step of model ``name`` (1F1B, or a zero-bubble schedule over two stages
    per rank): this rank's loss (last stage), gradients and what it planned. ``meta``: the
    model built on ``meta``, then its stage loaded (with the non-persistent buffers)."""
    ids, kwargs, target = _batch()
    if meta:
        with torch.device("meta"):
            model = MODELS[name]().double()
    else:
        model = _build(name)
    pipe = fd.pipeline_schedule(
        model,
        ids,
        example_kwargs=kwargs,
        schedule=schedule,
        n_microbatches=ZERO_BUBBLE.get(schedule, N_MB),
        loss_fn=_loss,
        scale_grads=False,  # a sum-reduced loss: the gradients are eager's on the batch
        cost=cost,
        stages_per_rank=2 if schedule in ZERO_BUBBLE else 1,
    )
    refused = None
    if meta:
        try:  # before any communication, on every rank: nothing runs on empty memory
            pipe.generate(ids, max_new_tokens=2)
        except ConfigError as e:
            refused = str(e)
        full = _build(name)
        pipe.load_stage_state_dict({**full.state_dict(), **dict(full.named_buffers())})
    losses: list[Any] = []
    pipe.step(
        *((ids,) if pipe.is_first else ()),
        target=target if pipe.is_last else None,
        losses=losses,
        **(kwargs if pipe.is_first else {}),
    )
    pipe.sync_tied_gradients()
    return {
        "stages": pipe.stage_indices,
        "loss": float(sum(losses).detach()) if losses else None,
        "grads": {k: p.grad.clone() for k, p in pipe.named_parameters() if p.grad is not None},
        "replicated": pipe.replicated_keys,
        "unit": pipe.plan.costs.unit,
        "cost": dict(pipe.plan.node_cost),
        "stage_of": dict(pipe.plan.stage_of),
        "sent": [e.value for e in pipe.plan.edges],
        "bodies": [b for m in pipe.stage_modules for b in _bodies(m)],
        "all_bodies": _bodies(pipe.plan.graph_module),
        "refused": refused,
    }


def _train(rank: int, world: int, *, cost: str) -> dict[str, Any]:
    """Every model in turn, then (planned by flops) Mixtral under each zero-bubble schedule,
    on the same two ranks (one start-up for them all)."""
    runs = {name: _pipelined(name, cost) for name in MODELS}
    for schedule in ZERO_BUBBLE if cost == "flops" else ():  # the schedule, not the costs
        runs[f"mixtral/{schedule}"] = _pipelined("mixtral", cost, schedule)
    if cost == "flops":  # cost="time" cannot run a model on meta (refused: below)
        runs["mixtral/meta"] = _pipelined("mixtral", cost, meta=True)
    return runs


@pytest.fixture(scope="module", params=["flops", "time"])
def ranks(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """``(cost, per-rank results by model)``: two ranks started once per cost."""
    cost = request.param
    tmp = tmp_path_factory.mktemp(f"hf_{cost}")
    return cost, results(launch(_train, 2, tmp, cost=cost))


@pytest.mark.parametrize("name", list(MODELS))
def test_hf_decoder_on_two_ranks_matches_eager(ranks: Any, name: str) -> None:
    cost, by_rank = ranks
    results = [r[name] for r in by_rank]
    assert [r["stages"] for r in results] == [(0,), (1,)]
    # Both ranks planned with one cost table (under "time": measured once, on rank 0).
    assert all(r["unit"] == {"flops": "flop", "time": "s"}[cost] for r in results)
    assert results[0]["cost"] == results[1]["cost"]
    assert results[0]["stage_of"] == results[1]["stage_of"]
    assert len(set(results[0]["stage_of"].values())) == 2
    for r in results:  # a higher-order op's body is named in each stage, never sent
        assert not set(r["sent"]) & set(r["all_bodies"]), r["sent"]
    if name == "llama_autocast_rope":  # replication across stages: test_split_stages.py
        assert any(r["bodies"] for r in results), "the rotary region is no higher-order op"
    _check_against_eager(name, results)


@pytest.mark.parametrize("ranks", ["flops"], indirect=True)  # measured costs: above
@pytest.mark.parametrize("schedule", list(ZERO_BUBBLE))
def test_hf_mixtral_under_zero_bubble_matches_eager(ranks: Any, schedule: str) -> None:
    """torch's weight part of backward starts where a stage's Parameters meet its inputs:
    the expert weights Mixtral gathers in one stage and sends on kept no gradient before
    fxpipe joined such outputs to the stage's inputs."""
    _, by_rank = ranks
    results = [r[f"mixtral/{schedule}"] for r in by_rank]
    assert sorted(j for r in results for j in r["stages"]) == [0, 1, 2, 3]
    _check_against_eager("mixtral", results)


@pytest.mark.parametrize("ranks", ["flops"], indirect=True)
def test_hf_mixtral_built_on_meta_and_loaded_matches_eager(ranks: Any) -> None:
    """Built under ``torch.device("meta")``: the export trace asserts each activation's
    device, so the stages' shapes are found on fake tensors of the ranks' device (found on
    ``meta`` ones, the build failed with a device mismatch); generate() is refused until
    the stage is loaded, then the step equals eager's."""
    _, by_rank = ranks
    for r in by_rank:  # generate() before loading: refused with the remedy
        assert r["mixtral/meta"]["refused"] is not None, "generate ran on unloaded stages"
        assert "never loaded" in r["mixtral/meta"]["refused"]
        assert "load_stage_state_dict" in r["mixtral/meta"]["refused"]
    _check_against_eager("mixtral", [r["mixtral/meta"] for r in by_rank])


def _check_against_eager(name: str, results: list[dict[str, Any]]) -> None:
    """The loss and every gradient (each on one rank) equal the eager model's."""
    loss, expected = _eager(name)
    (rank_loss,) = [r["loss"] for r in results if r["loss"] is not None]
    assert rank_loss == pytest.approx(loss, rel=1e-10)
    got: dict[str, torch.Tensor] = {}
    for r in results:
        for key, grad in r["grads"].items():
            # on both ranks only as a tied weight's copies (XLM's), summed
            assert key not in got or key in r["replicated"], f"{key} has a gradient twice"
            scale = float(expected[key].abs().max())
            torch.testing.assert_close(
                grad, expected[key], rtol=1e-9, atol=1e-12 * max(scale, 1.0), msg=key
            )
            got[key] = grad
    assert set(got) == set(expected)


class _Broken(nn.Module):
    """A model that cannot run, so that no tracer captures it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("this model cannot run")


def _profile_fails(rank: int, world: int) -> dict[str, Any]:
    """cost="time" on a model on ``meta`` (refused on each rank alone), then on a model that
    rank 0 cannot profile while rank 1's could be (every rank must stop, none wait)."""
    x = torch.randn(BATCH, 32)
    out: dict[str, Any] = {}
    with torch.device("meta"):
        meta = ResidualMLP()
    try:
        fd.pipeline_schedule(meta, x, n_microbatches=N_MB, loss_fn=None, cost="time")
    except ConfigError as e:
        out["meta"] = str(e)
    model = _Broken() if rank == 0 else ResidualMLP()
    try:
        fd.pipeline_schedule(model, x, n_microbatches=N_MB, loss_fn=None, cost="time")
    except FxPipeError as e:
        out["error"] = (type(e).__name__, str(e))
    return out


def test_time_cost_failures_reach_every_rank(tmp_path: Path) -> None:
    first, second = results(launch(_profile_fails, 2, tmp_path, pg_timeout=20))
    for r in (first, second):
        assert "'meta'" in r["meta"] and "cost='flops'" in r["meta"]
    assert first["error"][0] == "TraceError" and "cannot run" in first["error"][1]
    kind, text = second["error"]
    assert kind == "FxPipeError" and "rank 0 could not profile" in text
    assert "cannot run" in text and "cost='flops'" in text


def _grouped(rank: int, world: int) -> dict[str, Any]:
    """Mixtral with the experts transformers picks in float32 and bfloat16 (tokens grouped
    by expert for one grouped product, its offsets counted over the micro-batch), one GPipe
    step on two ranks in each dtype; this rank's gradients beside eager's in that dtype and
    in float64."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        config = transformers.MixtralConfig(**COMMON, num_local_experts=4, num_experts_per_tok=2)
        model = transformers.MixtralForCausalLM(config)
    ids, kwargs, target = _batch()
    exact = copy.deepcopy(model).double()
    exact.set_experts_implementation("batched_mm")  # grouped products take no float64
    _loss(exact(ids, **kwargs), target).backward()
    out: dict[str, Any] = {}
    for dtype in (torch.float32, torch.bfloat16):
        ours, eager = copy.deepcopy(model).to(dtype), copy.deepcopy(model).to(dtype)
        _loss(eager(ids, **kwargs), target).backward()
        pipe = fd.pipeline_schedule(ours, ids, example_kwargs=kwargs, n_microbatches=N_MB,
                                    loss_fn=_loss, scale_grads=False)  # fmt: skip
        pipe.step(*((ids,) if pipe.is_first else ()), target=target if pipe.is_last else None,
                  **(kwargs if pipe.is_first else {}))  # fmt: skip
        grads = dict(eager.named_parameters())
        reference = dict(exact.named_parameters())
        out[str(dtype)] = {
            k: (p.grad.clone(), grads[k].grad.clone(), reference[k].grad.clone())
            for k, p in pipe.named_parameters()
            if p.grad is not None
        }
        assert ours.config._experts_implementation == "grouped_mm"
    return out


def test_grouped_experts_in_float32_and_bfloat16_on_two_ranks_are_no_further_than_eager(
    tmp_path: Path,
) -> None:
    by_rank = results(launch(_grouped, 2, tmp_path))
    for dtype in ("torch.float32", "torch.bfloat16"):
        grads = {k: v for r in by_rank for k, v in r[dtype].items()}
        assert len(grads) == len(list(mixtral().parameters()))  # the routers' included
        for key, (got, eager, exact) in grads.items():
            holds, ours, theirs = no_further_than_eager(got, eager, exact)
            assert holds, f"{dtype} grad {key}: {ours:.2e} against eager's {theirs:.2e}"
