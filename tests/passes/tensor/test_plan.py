"""The tensor-parallel planner on a hand-written decoder LM with a tied head, on transformers'
GPT-2 and Llama and on a model whose head count tp does not divide: the style and cut of
each parameter against independent facts (transformers' own tensor-parallel plan for
Llama, GPT-2's Conv1D layout), the cut share of each block, and the oracle: the graph run
as the plan's ranks would run it (``tensor_emulation``) gives eager's outputs and
gradients."""

from __future__ import annotations

import dataclasses
import fnmatch
import functools
from typing import Any, NamedTuple

import pytest
import torch
import torch.fx as fx
from helpers import logits_of
from models import TinyGPT
from oracle import relative_error
from tensor_emulation import emulate
from torch import nn

import fxpipe
from fxpipe.errors import ConfigError
from fxpipe.passes.tensor.plan import tensor_plan
from fxpipe.passes.tensor.records import Shard, TensorPlan
from fxpipe.trace.tracing import trace

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB, BATCH, LENGTH = 128, 2, 8


def _gpt2() -> nn.Module:
    config = transformers.GPT2Config(
        n_layer=2, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=32, use_cache=False,
        attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(config)


def _llama(kv_heads: int = 2) -> nn.Module:
    config = transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
        num_key_value_heads=kv_heads, vocab_size=VOCAB, max_position_embeddings=32,
        use_cache=False, tie_word_embeddings=False, bos_token_id=0, eos_token_id=0,
        pad_token_id=0,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config)


def _qwen2() -> nn.Module:
    """A third family: Qwen2's attention has biases on q, k and v (cut with their columns)
    and grouped key-value heads."""
    config = transformers.Qwen2Config(
        num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=32,
        use_cache=False, tie_word_embeddings=False, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return transformers.Qwen2ForCausalLM(config)


def _family(name: str, **extra: Any) -> nn.Module:
    """A tiny decoder of a transformers family (2 layers, width 32, 4 heads over 2 key/value
    heads of 8, a tied embedding): Qwen3 and Gemma3 normalise each head's q and k with a
    weight of 8 entries (Gemma3 as ``1 + w``, with a window of 4 tokens on most layers),
    Phi-3 fuses q, k, v in unequal parts and gate and up, OLMo2 normalises q and k over all
    heads."""
    config_class, model_class = {
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "phi3": (transformers.Phi3Config, transformers.Phi3ForCausalLM),
        "olmo2": (transformers.Olmo2Config, transformers.Olmo2ForCausalLM),
    }[name]
    config = config_class(
        num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
        vocab_size=VOCAB, max_position_embeddings=64, use_cache=False, tie_word_embeddings=True,
        bos_token_id=0, eos_token_id=0, pad_token_id=0, **{"num_key_value_heads": 2, **extra},
    )  # fmt: skip
    return model_class(config)


#: Families whose blocks hold what the first three do not (per-head norms, sliding windows,
#: fused products in parts, a norm over all heads).
FAMILIES = {
    "qwen3": lambda: _family("qwen3", head_dim=8),
    "gemma3": lambda: _family("gemma3", head_dim=8, sliding_window=4, query_pre_attn_scalar=8),
    "mistral": lambda: _family("mistral", head_dim=8, sliding_window=4),
    "phi3": lambda: _family("phi3"),
    "olmo2": lambda: _family("olmo2"),
}

MODELS = {
    # the zoo's GPT: fx-traced, nn.Linear calls, a fused q, k, v viewed as (3, heads, dim),
    # matmul-softmax-matmul attention, the head tied to the token embedding
    "toy": lambda: TinyGPT(vocab=VOCAB, width=32, heads=4, layers=2, p=0.0),
    "odd_heads": lambda: TinyGPT(vocab=VOCAB, width=48, heads=3, layers=2, p=0.0),
    "gpt2": _gpt2,
    "llama": _llama,
    "qwen2": _qwen2,
    **FAMILIES,
    # q, k and v fused in three equal parts, sliced apart (not split)
    "phi3_mha": lambda: _family("phi3", num_key_value_heads=4),
}


class Planned(NamedTuple):
    model: nn.Module
    gm: fx.GraphModule
    example: tuple[torch.Tensor, ...]
    plan: TensorPlan


@functools.cache
def planned(name: str, tp: int = 2, stages: int = 1) -> Planned:
    """Model ``name`` built under seed 0, traced and planned over ``tp`` ranks (for a
    pipeline of ``stages``, each stage on its own)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = MODELS[name]()
        ids = torch.randint(0, VOCAB, (BATCH, LENGTH))
    if stages == 1:
        traced = trace(model, (ids,))
        gm, example = traced.graph_module, tuple(traced.example_values)
        return Planned(model, gm, example, tensor_plan(gm, tp, example))
    pipeline = fxpipe.plan(model, ids, ["cpu"] * stages)
    gm = pipeline.graph_module
    plan = tensor_plan(gm, tp, (ids,), stage_of=pipeline.stage_of)
    return Planned(model, gm, (ids,), plan)


def _styles(plan: TensorPlan) -> dict[str, tuple[str, Shard | None]]:
    return {name: (p.style, p.shard) for name, p in plan.params.items()}


# ------------------------------------------------------------------------------ structure


def test_llama_is_cut_as_transformers_own_tensor_parallel_plan_says() -> None:
    plan = planned("llama").plan
    expected = transformers.LlamaConfig.base_model_tp_plan  # {"layers.*.self_attn.q_proj": ...}
    checked = 0
    for name, p in plan.params.items():
        module = name.removeprefix("model.").removesuffix(".weight")
        style = next((s for pat, s in expected.items() if fnmatch.fnmatch(module, pat)), None)
        if style is None:
            continue
        checked += 1
        assert p.style == style, (name, p.style, style)
        # nn.Linear's weight is (out, in): column-wise cuts dim 0, row-wise dim 1
        assert p.shard == Shard(0 if style == "colwise" else 1), (name, p.shard)
    assert checked == 2 * 7  # q, k, v, o, gate, up, down in each of 2 layers
    heads = {g.heads for g in plan.groups if g.kind == "attention"}
    assert heads == {(4, 2)}  # 4 query heads, 2 key/value heads (GQA): 2 and 1 per rank
    assert plan.params["lm_head.weight"].shard == Shard(0)  # transformers: colwise_gather_output
    lm_head = next(g for g in plan.groups if g.kind == "lm_head")
    assert plan.node_styles[lm_head.columns[0]] == "gathered"
    assert plan.params["model.embed_tokens.weight"].style == "vocab"
    assert plan.params["model.norm.weight"].style == "replicated"
    assert not plan.replicated


def test_gpt2_conv1d_layout_and_its_fused_qkv_cut_in_three_parts() -> None:
    styles = _styles(planned("gpt2").plan)
    for layer in ("transformer.h.0", "transformer.h.1"):
        # Conv1D stores (in, out): column-wise cuts dim 1, row-wise dim 0
        assert styles[f"{layer}.attn.c_attn.weight"] == ("colwise", Shard(1, blocks=3))
        assert styles[f"{layer}.attn.c_attn.bias"] == ("colwise", Shard(0, blocks=3))
        assert styles[f"{layer}.attn.c_proj.weight"] == ("rowwise", Shard(0))
        assert styles[f"{layer}.attn.c_proj.bias"] == ("rowwise", None)  # added once
        assert styles[f"{layer}.mlp.c_fc.weight"] == ("colwise", Shard(1))
        assert styles[f"{layer}.mlp.c_proj.weight"] == ("rowwise", Shard(0))
        assert styles[f"{layer}.ln_1.weight"] == ("replicated", None)
    # the token embedding is the LM head's weight (tied): one cut over the vocabulary
    assert styles["lm_head.weight"] == ("vocab", Shard(0))
    assert styles["transformer.wpe.weight"] == ("replicated", None)
    kinds = [g.kind for g in planned("gpt2").plan.groups]
    assert kinds == ["embedding", "attention", "mlp", "attention", "mlp", "lm_head"]


def test_the_toy_lm_fused_qkv_by_view_and_tied_head() -> None:
    plan = planned("toy").plan
    styles = _styles(plan)
    assert styles["blocks.0.attn.qkv.weight"] == ("colwise", Shard(0, blocks=3))
    assert styles["blocks.0.attn.proj.weight"] == ("rowwise", Shard(1))
    assert styles["blocks.1.mlp.fc1.bias"] == ("colwise", Shard(0))
    assert styles["blocks.1.mlp.fc2.bias"] == ("rowwise", None)
    assert styles["tok.weight"] == ("vocab", Shard(0))  # read by the embedding and the head
    assert sorted(plan.node_styles.values()).count("gathered") == 1
    assert [g.heads for g in plan.groups if g.kind == "attention"] == [(4,), (4,)]


@pytest.mark.parametrize("name", ["toy", "gpt2", "llama"])
def test_at_least_nine_tenths_of_each_block_is_cut(name: str) -> None:
    fractions = planned(name).plan.block_fractions()
    assert len(fractions) == 2
    assert all(f >= 0.9 for f in fractions.values()), fractions
    if name == "llama":  # no biases: all of it
        assert set(fractions.values()) == {1.0}


def test_a_head_count_tp_does_not_divide_leaves_attention_whole_and_says_why() -> None:
    plan = planned("odd_heads").plan
    styles = _styles(plan)
    for layer in ("blocks.0", "blocks.1"):
        assert styles[f"{layer}.attn.qkv.weight"] == ("replicated", None)
        assert styles[f"{layer}.attn.proj.weight"] == ("replicated", None)
        assert styles[f"{layer}.mlp.fc1.weight"] == ("colwise", Shard(0))
        assert styles[f"{layer}.mlp.fc2.weight"] == ("rowwise", Shard(1))
    why = plan.params["blocks.0.attn.qkv.weight"].reason
    assert "as (3, 3, 16): 3 (the head count, in attention) does not divide by tp=2" in why
    assert "3 (the head count" in plan.replicated["blocks_0_attn_qkv"]
    assert "does not divide by tp=2" in plan.summary()


def test_key_value_heads_tp_does_not_divide_leave_attention_whole() -> None:
    plan = planned("llama", tp=4).plan
    q = plan.params["model.layers.0.self_attn.q_proj.weight"]
    assert q.style == "replicated"
    assert "does not divide by tp=4" in q.reason
    assert plan.params["model.layers.0.mlp.down_proj.weight"].shard == Shard(1)


def test_a_stage_keeps_its_cuts_to_itself() -> None:
    plan = planned("llama", stages=2).plan
    nodes = {n.name: n for n in planned("llama", stages=2).gm.graph.nodes}
    for name in plan.layouts:
        assert {plan.stage_of[u.name] for u in nodes[name].users} == {plan.stage_of[name]}
    text = plan.summary()
    assert "stage 0" in text and "stage 1" in text
    assert plan.stages() == [0, 1]


def test_tp_must_be_a_positive_int() -> None:
    p = planned("toy")
    with pytest.raises(ConfigError, match=r"tp=0 must be a positive int"):
        tensor_plan(p.gm, 0, p.example)


def test_the_printed_plan_names_each_group() -> None:
    text = planned("llama").plan.summary()
    assert (
        "attention  model.layers.0.self_attn: colwise q_proj, k_proj, v_proj -> rowwise o_proj"
        " + reduce-scatter; heads 4, 2 -> 2, 1 per rank"
    ) in text
    assert "mlp        model.layers.1.mlp: colwise gate_proj, up_proj -> rowwise down_proj" in text
    assert "lm head    lm_head.weight: 128 vocabulary rows -> 64 per rank" in text
    assert "model.layers.0 100.0%, model.layers.1 100.0%" in text
    assert "c_attn (in 3 parts)" in planned("gpt2").plan.summary()


# -------------------------------------------------------------------------------- numerics


def _grads(gm: fx.GraphModule, out: Any) -> dict[str, torch.Tensor]:
    logits = logits_of(out)
    weights = torch.linspace(-1.0, 1.0, logits.numel()).reshape(logits.shape)
    params = dict(gm.named_parameters())
    grads = torch.autograd.grad((logits * weights).sum(), list(params.values()))
    return dict(zip(params, grads))


@pytest.mark.parametrize(
    ("name", "tp", "stages"),
    [("toy", 2, 1), ("odd_heads", 2, 1), ("gpt2", 2, 1), ("llama", 2, 1), ("llama", 4, 1),
     ("gpt2", 2, 2), ("llama", 2, 3)],
)  # fmt: skip
def test_the_ranks_compute_eagers_outputs_and_gradients(name: str, tp: int, stages: int) -> None:
    p = planned(name, tp, stages)
    want = logits_of(p.model(*p.example))
    got = emulate(p.gm, p.plan, p.example)
    assert relative_error(logits_of(got), want) < 1e-5
    whole = _grads(p.gm, p.gm(*p.example))
    cut = _grads(p.gm, got)
    for param, grad in whole.items():
        assert relative_error(cut[param], grad) < 1e-5, param


def test_the_oracle_sees_a_wrong_cut() -> None:
    """The fused q, k, v cut in one part instead of three gives other logits."""
    p = planned("gpt2")
    params = {
        name: dataclasses.replace(spec, shard=Shard(spec.shard.dim))
        if spec.shard is not None and spec.shard.blocks == 3
        else spec
        for name, spec in p.plan.params.items()
    }
    wrong = dataclasses.replace(p.plan, params=params)
    got = logits_of(emulate(p.gm, wrong, p.example))
    assert relative_error(got, logits_of(p.model(*p.example))) > 1e-2


# --------------------------------------------------------------------- how groups are chosen


class Chain(nn.Module):
    """Four linear layers with nothing between them, the second one also used at the end."""

    def __init__(self, shared: bool) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(4))
        self.shared = shared

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.layers[1](x) if self.shared else x


def test_a_chain_of_products_pairs_up_first_to_last() -> None:
    """Each product could be column-wise; the second ends the first pair, so the third
    begins the next: col, row, col, row."""
    model, x = Chain(shared=False), torch.randn(3, 16)
    traced = trace(model, (x,))
    plan = tensor_plan(traced.graph_module, 2, (x,))
    styles = [plan.params[f"layers.{k}.weight"].style for k in range(4)]
    assert styles == ["colwise", "rowwise", "colwise", "rowwise"]
    assert relative_error(emulate(traced.graph_module, plan, (x,))[0], model(x)) < 1e-5


def test_a_weight_read_by_two_products_stays_whole() -> None:
    model, x = Chain(shared=True), torch.randn(3, 16)
    traced = trace(model, (x,))
    plan = tensor_plan(traced.graph_module, 2, (x,))
    shared = plan.params["layers.1.weight"]
    assert shared.style == "replicated" and "is also read by" in shared.reason
    assert relative_error(emulate(traced.graph_module, plan, (x,))[0], model(x)) < 1e-5


class TiedPositions(nn.Module):
    """A head tied to an embedding the model indexes by positions it computes."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.head = nn.Linear(8, 16, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(x + self.emb(torch.arange(x.shape[1])))


def test_a_head_tied_to_an_embedding_left_whole_stays_whole() -> None:
    model, x = TiedPositions(), torch.randn(2, 5, 8)
    traced = trace(model, (x,))
    plan = tensor_plan(traced.graph_module, 2, (x,))
    assert plan.params["emb.weight"].style == "replicated"
    assert "positions the model computes" in plan.params["emb.weight"].reason
    assert not plan.node_styles
    assert relative_error(emulate(traced.graph_module, plan, (x,))[0], model(x)) < 1e-5
