"""Mixture-of-Experts families of transformers (small configs, nothing downloaded) through
fxpipe.pipeline in the dtypes people train them in, float32 and bfloat16, with the experts
implementation transformers picks there (tokens grouped by expert for one grouped product),
the router's auxiliary loss on (where the family has one; DeepSeek-V3 has none) and
``labels=``: in train and then eval mode, the loss, the auxiliary loss, the logits and every
parameter's gradient (the router's included) no further from a float64 eager run than eager
itself in that dtype (times 4)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from helpers import SLOW
from oracle import no_further_than_eager
from torch import nn

import fxpipe

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB, BATCH, LENGTH = 99, 4, 12
DECODER: dict[str, Any] = dict(
    num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
    num_key_value_heads=2, head_dim=8, vocab_size=VOCAB, max_position_embeddings=64,
    use_cache=False, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    output_router_logits=True, router_aux_loss_coef=0.5,
)  # fmt: skip
#: name -> (model type, its options beside DECODER, stages, chunks).
FAMILIES: dict[str, tuple[str, dict[str, Any], int, int]] = {
    "mixtral": ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2), 2, 2),
    "qwen2_moe": ("qwen2_moe", dict(num_experts=4, num_experts_per_tok=2,
                                    moe_intermediate_size=32,
                                    shared_expert_intermediate_size=32), 3, 3),
    "qwen3_moe": ("qwen3_moe", dict(num_experts=4, num_experts_per_tok=2,
                                    moe_intermediate_size=32), 4, 4),
    "olmoe": ("olmoe", dict(num_experts=4, num_experts_per_tok=2), 2, 3),
    "gpt_oss": ("gpt_oss", dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=4),
                3, 4),
    "deepseek_v3": ("deepseek_v3", dict(n_routed_experts=4, n_shared_experts=1,
                                        num_experts_per_tok=2, moe_intermediate_size=32,
                                        first_k_dense_replace=1, q_lora_rank=16,
                                        kv_lora_rank=16, qk_rope_head_dim=4,
                                        qk_nope_head_dim=4, v_head_dim=8, n_group=1,
                                        topk_group=1, num_key_value_heads=4, head_dim=None),
                    2, 4),
    "granitemoe": ("granitemoe", dict(num_local_experts=4, num_experts_per_tok=2), 4, 2),
}  # fmt: skip


def build(name: str) -> nn.Module:
    kind, options, _, _ = FAMILIES[name]
    settings = {k: v for k, v in {**DECODER, **options}.items() if v is not None}
    config = transformers.AutoConfig.for_model(kind, **settings)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return transformers.AutoModelForCausalLM.from_config(config)


def batch() -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(3)
    ids = torch.randint(3, VOCAB, (BATCH, LENGTH), generator=generator)
    mask = torch.ones(BATCH, LENGTH, dtype=torch.long)
    mask[1, 8:] = 0  # one padded sequence: the auxiliary loss counts its tokens out
    return ids, {"attention_mask": mask, "labels": ids.clone()}


def run(model: nn.Module, ids: torch.Tensor, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The outputs compared, and every parameter's gradient (by the model's names)."""
    model.zero_grad()
    out = model(ids, **kwargs)
    out.loss.backward()
    own = model.module if isinstance(model, fxpipe.Pipeline) else model
    grads = {k: p.grad.detach().clone() for k, p in own.named_parameters() if p.grad is not None}
    outputs = {"loss": out.loss, "aux_loss": out.get("aux_loss"), "logits": out.logits}
    return {
        **{k: v.detach() for k, v in outputs.items() if v is not None}, "grads": grads,
    }  # fmt: skip


@pytest.mark.parametrize("name", [pytest.param(n, marks=SLOW if n != "mixtral" else ())
                                  for n in FAMILIES])  # fmt: skip
def test_a_moe_family_equals_eager_in_float32_and_bfloat16(name: str) -> None:
    model = build(name)
    exact = copy.deepcopy(model).double()
    exact.set_experts_implementation("batched_mm")  # grouped products take no float64
    ids, kwargs = batch()
    _, _, stages, chunks = FAMILIES[name]
    for dtype in (torch.float32, torch.bfloat16):
        ours, eager = copy.deepcopy(model).to(dtype), copy.deepcopy(model).to(dtype)
        assert ours.config._experts_implementation == "grouped_mm"  # transformers' default
        pipe = fxpipe.pipeline(ours, ids, ["cpu"] * stages, example_kwargs=kwargs, chunks=chunks)
        for train in (True, False):
            for m in (pipe, eager, exact):
                m.train(train)
            got, want = run(pipe, ids, kwargs), run(eager, ids, kwargs)
            ref = run(exact, ids, kwargs)
            where = f"{name} {dtype} {'train' if train else 'eval'}"
            assert set(got) == set(want), where  # DeepSeek-V3 returns no auxiliary loss
            for key in ("loss", "aux_loss", "logits"):
                if key not in want:
                    continue
                holds, e, e0 = no_further_than_eager(got[key], want[key], ref[key])
                assert holds, f"{where} {key}: {e:.2e} against eager's {e0:.2e}"
            assert set(got["grads"]) == set(ref["grads"]), where
            assert any("gate" in k or "router" in k for k in got["grads"])  # the router's too
            for key, grad in got["grads"].items():
                holds, e, e0 = no_further_than_eager(grad, want["grads"][key], ref["grads"][key])
                assert holds, f"{where} grad {key}: {e:.2e} against eager's {e0:.2e}"


def test_a_moe_model_built_on_meta_runs_on_cpu_stages_as_eager() -> None:
    """Built under ``torch.device("meta")`` and loaded after pipelining: the trace takes the
    experts' CPU branch (tokens per expert counted in float32), as the stages run it."""
    eager = build("mixtral").to(torch.bfloat16)
    exact = copy.deepcopy(eager).double()
    exact.set_experts_implementation("batched_mm")
    with torch.device("meta"):
        model = build("mixtral").to(torch.bfloat16)
    ids, kwargs = batch()
    pipe = fxpipe.pipeline(model, ids, ["cpu", "cpu"], example_kwargs=kwargs, chunks=2)
    pipe.load_state_dict(eager.state_dict())
    persistent = eager.state_dict()
    with torch.no_grad():  # the rotary tables no checkpoint holds
        for key, value in eager.named_buffers():
            if key not in persistent:
                pipe.module.get_buffer(key).copy_(value)
    got, want, ref = run(pipe, ids, kwargs), run(eager, ids, kwargs), run(exact, ids, kwargs)
    for key in ("loss", "aux_loss", "logits"):
        holds, e, e0 = no_further_than_eager(got[key], want[key], ref[key])
        assert holds, f"{key}: {e:.2e} against eager's {e0:.2e}"
    assert set(got["grads"]) == set(ref["grads"])
    for key, grad in got["grads"].items():
        holds, e, e0 = no_further_than_eager(grad, want["grads"][key], ref["grads"][key])
        assert holds, f"grad {key}: {e:.2e} against eager's {e0:.2e}"
