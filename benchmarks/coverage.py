"""Coverage harness: real models (transformers, timm, torchvision) pipelined by fxpipe vs eager.

Each model runs in a subprocess of its own, in float64 with every dropout at zero, in train
and in eval mode, over 2-4 CPU stages with 4 micro-batches. Outputs (structure, containers and
every leaf) and every parameter's gradient are compared with the eager model's; in train mode
a model whose modules mix samples (BatchNorm and the like) is compared with eager run on the
same micro-batches fxpipe makes. Each model is classified equal / refused / crashed / wrong /
timeout (or skipped when eager itself fails here). Needs timm, torchvision and transformers,
which fxpipe's own environment does not have: see benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import copy
import fnmatch
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import zlib
from collections import Counter
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import keystr, tree_flatten, tree_flatten_with_path, tree_unflatten

Args = tuple[Any, ...]
Kwargs = dict[str, Any]
Built = tuple[nn.Module, Args, Kwargs]
Row = dict[str, Any]

CHUNKS = 4
BATCH = 8
#: err < TOLERANCE counts as equal. float64 rounding of sums taken in another order (as
#: micro-batching does) stays near 1e-13; a real fault (a lost term, a mis-routed micro-batch)
#: is of order 1e-3 or more. 1e-7 sits far from both.
TOLERANCE = 1e-7
#: an error's denominator never falls under FLOOR x the largest magnitude of the set
#: (outputs, or gradients), so an exactly-zero gradient is not divided by zero.
FLOOR = 1e-3
STATUSES = ("equal", "refused", "crashed", "wrong", "timeout", "skipped")
ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "coverage.json"


@dataclass(frozen=True)
class Spec:
    """One model: its family, how to build it with inputs, and whether it mixes samples."""

    name: str
    family: str
    build: Callable[[], Built]
    #: "train": the model mixes samples in train mode only (found automatically for
    #: BatchNorm); "always": also in eval mode (capacity-limited expert routing).
    mixes: str = ""
    #: build and run with float64 as torch's default dtype (models whose code makes a
    #: float32 scalar out of torch.finfo(their own dtype).min, which overflows in float64)
    default_double: bool = False


# ---------------------------------------------------------------------------------------------
# Inputs


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def images(size: int = 64, batch: int = BATCH, channels: int = 3) -> Args:
    return (torch.randn(batch, channels, size, size, generator=_gen(1)),)


def video(size: int = 32, frames: int = 8, batch: int = 4) -> Args:
    return (torch.randn(batch, 3, frames, size, size, generator=_gen(2)),)


def token_ids(vocab: int, length: int = 12, batch: int = BATCH, low: int = 3) -> torch.Tensor:
    return torch.randint(low, vocab, (batch, length), generator=_gen(3))


def padding_mask(batch: int = BATCH, length: int = 12) -> torch.Tensor:
    """All ones but sequence 1, right-padded after 8 tokens."""
    mask = torch.ones(batch, length, dtype=torch.long)
    mask[1, 8:] = 0
    return mask


# ---------------------------------------------------------------------------------------------
# Hugging Face transformers: small configs, no download

VOCAB = 99
DECODER: Kwargs = dict(
    num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
    num_key_value_heads=2, head_dim=8, vocab_size=VOCAB, max_position_embeddings=64,
    use_cache=False, pad_token_id=0, bos_token_id=1, eos_token_id=2,
)  # fmt: skip
ENCODER: Kwargs = dict(
    num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
    vocab_size=VOCAB, max_position_embeddings=64, pad_token_id=0, type_vocab_size=2,
)  # fmt: skip
SEQ2SEQ: Kwargs = dict(
    d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
    decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, vocab_size=VOCAB,
    max_position_embeddings=64, use_cache=False, pad_token_id=0, bos_token_id=1,
    eos_token_id=2, decoder_start_token_id=2,
)  # fmt: skip
T5: Kwargs = dict(
    vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2,
    num_heads=4, use_cache=False, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1,
)  # fmt: skip
VISION: Kwargs = dict(
    image_size=32, patch_size=4, num_channels=3, hidden_size=32, num_hidden_layers=2,
    num_attention_heads=4, intermediate_size=64, num_labels=10,
)  # fmt: skip
#: an override that removes a key of the base config (a config that has no such setting).
OMIT = "<omit>"
HEADS = {
    "causal": "AutoModelForCausalLM",
    "base": "AutoModel",
    "seq2seq": "AutoModelForSeq2SeqLM",
    "image": "AutoModelForImageClassification",
    "seqcls": "AutoModelForSequenceClassification",
    "mlm": "AutoModelForMaskedLM",
}


def _zero_config_dropout(config: Any) -> None:
    """Every numeric ``*drop*`` / jitter field of a config (and its sub-configs) to 0."""
    for key, value in list(vars(config).items()):
        if hasattr(value, "to_dict") and hasattr(value, "model_type"):
            _zero_config_dropout(value)
        elif isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
            if "drop" in key or "jitter" in key:
                setattr(config, key, 0.0)


def _text_inputs(kind: str, vocab: int) -> tuple[Args, Kwargs]:
    ids = token_ids(vocab)
    if kind == "ids":
        return (ids,), {}
    kwargs: Kwargs = {"attention_mask": padding_mask()}
    if kind == "seq2seq":
        kwargs["decoder_input_ids"] = token_ids(vocab, length=7)
    return (ids,), kwargs


def hf(model_type: str, head: str, base: Kwargs, inputs: str = "text", **over: Any) -> Any:
    """A builder for a transformers model from a small config (``inputs``: text, ids, seq2seq,
    image or image:SIZE)."""

    def build() -> Built:
        import transformers

        options = {k: v for k, v in {**base, **over}.items() if v != OMIT}
        config = transformers.AutoConfig.for_model(model_type, **options)
        _zero_config_dropout(config)
        model = getattr(transformers, HEADS[head]).from_config(config)
        if inputs.startswith("image"):
            size = int(inputs.split(":")[1]) if ":" in inputs else base.get("image_size", 32)
            return model, images(int(size)), {}
        return model, *_text_inputs(inputs, int(over.get("vocab_size", VOCAB)))

    return build


def _hf_decoders() -> list[Spec]:
    d, fam = DECODER, "hf-decoder"
    table: list[tuple[str, str, Kwargs]] = [
        ("gpt2", "gpt2", {}),
        ("gpt_neo", "gpt_neo", dict(attention_types=[[["global", "local"], 1]], window_size=4)),
        ("gpt_neox", "gpt_neox", dict(rotary_pct=0.5)),
        ("gptj", "gptj", dict(rotary_dim=4)),
        ("opt", "opt", dict(ffn_dim=64, word_embed_proj_dim=32)),
        ("bloom", "bloom", {}),
        ("llama", "llama", dict(tie_word_embeddings=True)),
        ("mistral", "mistral", dict(sliding_window=4)),
        ("qwen2", "qwen2", {}),
        ("qwen3", "qwen3", {}),
        ("gemma", "gemma", {}),
        ("gemma2", "gemma2", dict(sliding_window=4)),
        ("gemma3", "gemma3_text", dict(sliding_window=4)),
        ("phi", "phi", dict(partial_rotary_factor=0.5)),
        ("phi3", "phi3", {}),
        ("falcon", "falcon", dict(new_decoder_architecture=True, num_kv_heads=2, head_dim=OMIT)),
        ("starcoder2", "starcoder2", {}),
        ("codegen", "codegen", dict(rotary_dim=4, n_ctx=64)),
        ("olmo", "olmo", {}),
        ("olmo2", "olmo2", {}),
        ("olmo3", "olmo3", {}),
        ("cohere", "cohere", {}),
        ("cohere2", "cohere2", dict(sliding_window=4)),
        ("stablelm", "stablelm", {}),
        ("granite", "granite", {}),
        ("gpt_bigcode", "gpt_bigcode", {}),
        ("biogpt", "biogpt", {}),
        ("mpt", "mpt", dict(d_model=32, n_heads=4, n_layers=2, expansion_ratio=2)),
        ("persimmon", "persimmon", {}),
        ("nemotron", "nemotron", {}),
        ("glm", "glm", {}),
        ("glm4", "glm4", {}),
        ("helium", "helium", {}),
        ("smollm3", "smollm3", {}),
        ("arcee", "arcee", {}),
        ("seed_oss", "seed_oss", {}),
        ("apertus", "apertus", {}),
        ("exaone4", "exaone4", {}),
        ("ernie4_5", "ernie4_5", {}),
        ("hunyuan_v1_dense", "hunyuan_v1_dense", {}),
        ("ministral", "ministral", {}),
        ("mamba", "mamba", dict(state_size=8, expand=2, conv_kernel=4)),
        ("recurrent_gemma", "recurrent_gemma", dict(lru_width=32, attention_window_size=4)),
    ]
    specs = [Spec(n, fam, hf(t, "causal", d, **o)) for n, t, o in table]
    specs += [
        Spec(
            "xglm",
            fam,
            hf("xglm", "causal", d, d_model=32, ffn_dim=64, attention_heads=4, num_layers=2),
            default_double=True,
        ),
        Spec("llama-seqcls", fam, hf("llama", "seqcls", d, "ids", num_labels=3)),
        Spec("gpt2-seqcls", fam, hf("gpt2", "seqcls", d, "ids", num_labels=3)),
        Spec("llama-eager-attn", fam, hf("llama", "causal", d, attn_implementation="eager")),
    ]
    return specs


def _hf_encoders() -> list[Spec]:
    e, fam = ENCODER, "hf-encoder"
    table: list[tuple[str, str, Kwargs]] = [
        ("bert", "bert", {}),
        ("roberta", "roberta", {}),
        ("distilbert", "distilbert", dict(hidden_dim=64)),
        ("albert", "albert", dict(embedding_size=16)),
        ("electra", "electra", dict(embedding_size=16)),
        ("deberta", "deberta", dict(relative_attention=True, pos_att_type=["c2p", "p2c"])),
        ("deberta-v2", "deberta-v2", dict(relative_attention=True, pos_att_type=["c2p", "p2c"])),
        ("xlm-roberta", "xlm-roberta", {}),
        ("mpnet", "mpnet", {}),
        ("convbert", "convbert", dict(embedding_size=32)),
        ("modernbert", "modernbert", dict(global_attn_every_n_layers=2, local_attention=4)),
        ("camembert", "camembert", {}),
        ("roformer", "roformer", dict(embedding_size=32)),
        (
            "mobilebert",
            "mobilebert",
            dict(
                embedding_size=16,
                intra_bottleneck_size=32,
                true_hidden_size=32,
                num_feedforward_networks=2,
            ),
        ),
        (
            "squeezebert",
            "squeezebert",
            dict(
                embedding_size=32,
                q_groups=2,
                k_groups=2,
                v_groups=2,
                post_attention_groups=2,
                intermediate_groups=2,
                output_groups=2,
            ),
        ),
        (
            "funnel",
            "funnel",
            dict(
                block_sizes=[1, 1],
                d_model=32,
                n_head=4,
                d_head=8,
                d_inner=64,
                num_hidden_layers=OMIT,
                architectures=["FunnelModel"],
            ),
        ),
        ("megatron-bert", "megatron-bert", {}),
        ("ernie", "ernie", {}),
        ("data2vec-text", "data2vec-text", {}),
        ("esm", "esm", dict(token_dropout=False, mask_token_id=4)),
        ("rembert", "rembert", dict(input_embedding_size=16, output_embedding_size=16)),
        ("big_bird", "big_bird", dict(attention_type="original_full")),
        ("ibert", "ibert", {}),
        (
            "xlnet",
            "xlnet",
            dict(
                d_model=32,
                n_layer=2,
                n_head=4,
                d_inner=64,
                mem_len=None,
                num_hidden_layers=OMIT,
                max_position_embeddings=OMIT,
            ),
        ),
        ("flaubert", "flaubert", dict(emb_dim=32, n_layers=2, n_heads=4)),
        ("xlm", "xlm", dict(emb_dim=32, n_layers=2, n_heads=4)),
        ("layoutlm", "layoutlm", {}),
    ]
    specs = [Spec(n, fam, hf(t, "base", e, **o)) for n, t, o in table]
    specs += [
        Spec("bert-mlm", fam, hf("bert", "mlm", e)),
        # its attention mask does not broadcast against the landmarks here: no mask
        Spec(
            "nystromformer",
            fam,
            hf("nystromformer", "base", e, "ids", num_landmarks=4, segment_means_seq_len=12),
        ),
        Spec("roberta-seqcls", fam, hf("roberta", "seqcls", e, num_labels=3)),
        Spec(
            "canine",
            fam,
            hf(
                "canine",
                "base",
                e,
                "text",
                vocab_size=VOCAB,
                downsampling_rate=2,
                num_hash_functions=2,
                num_hash_buckets=64,
                local_transformer_stride=4,
            ),
        ),  # fmt: skip
    ]
    return specs


def _hf_seq2seq() -> list[Spec]:
    s, t, fam = SEQ2SEQ, T5, "hf-encdec"
    specs = [Spec(name, fam, hf(name, "seq2seq", t, "seq2seq")) for name in ("t5", "mt5", "umt5")]
    specs.append(Spec("longt5", fam, hf("longt5", "seq2seq", t, "seq2seq", local_radius=2)))
    for name in ("bart", "mbart", "pegasus", "marian", "blenderbot", "blenderbot-small",
                 "m2m_100", "plbart", "mvp"):  # fmt: skip
        specs.append(Spec(name, fam, hf(name, "seq2seq", s, "seq2seq")))
    specs.append(
        Spec(
            "led",
            fam,
            hf(
                "led",
                "seq2seq",
                s,
                "seq2seq",
                attention_window=4,
                max_encoder_position_embeddings=64,
                max_decoder_position_embeddings=64,
            ),
        )
    )
    specs += [
        Spec("bigbird_pegasus", fam,
             hf("bigbird_pegasus", "seq2seq", s, "seq2seq", attention_type="original_full")),
        Spec("pegasus_x", fam, hf("pegasus_x", "seq2seq", s, "seq2seq", block_size=4,
                                  num_global_tokens=2, stagger_local_blocks=False)),
        Spec("prophetnet", fam, hf("prophetnet", "seq2seq", s, "seq2seq", hidden_size=32,
                                   num_encoder_layers=2, num_decoder_layers=2,
                                   num_encoder_attention_heads=4,
                                   num_decoder_attention_heads=4, ngram=2, num_buckets=8,
                                   encoder_layers=OMIT, decoder_layers=OMIT)),
        Spec("fsmt", fam, hf("fsmt", "seq2seq", s, "seq2seq", langs=["en", "de"],
                             src_vocab_size=VOCAB, tgt_vocab_size=VOCAB)),
    ]  # fmt: skip
    return specs


def _hf_vision() -> list[Spec]:
    v, fam = VISION, "hf-vision"
    #: configs that take lists of widths and depths: the transformer keys of VISION removed
    cnn = {k: OMIT for k in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                             "intermediate_size", "patch_size")}  # fmt: skip
    cnn4 = dict(cnn, hidden_sizes=[8, 16, 24, 32], depths=[1, 1, 1, 1])
    three = dict(cnn, num_heads=[1, 2, 3], depth=[1, 2, 3])  # cvt indexes stage j with j < depth
    table: list[tuple[str, str, Kwargs]] = [
        ("vit", "vit", {}),
        ("deit", "deit", dict(architectures=["DeiTForImageClassification"])),
        ("beit", "beit", dict(use_relative_position_bias=True)),
        ("data2vec-vision", "data2vec-vision", dict(use_relative_position_bias=True)),
        ("dinov2", "dinov2", {}),
        ("dinov2_with_registers", "dinov2_with_registers", dict(num_register_tokens=2)),
        ("vit_msn", "vit_msn", {}),
        (
            "swin",
            "swin",
            dict(cnn, embed_dim=16, depths=[1, 1], num_heads=[2, 2], window_size=2, patch_size=4),
        ),
        (
            "swinv2",
            "swinv2",
            dict(cnn, embed_dim=16, depths=[1, 1], num_heads=[2, 2], window_size=2, patch_size=4),
        ),
        ("convnext", "convnext", cnn4),
        ("convnextv2", "convnextv2", cnn4),
        ("resnet", "resnet", dict(cnn4, embedding_size=8, layer_type="bottleneck")),
        ("regnet", "regnet", dict(cnn4, embedding_size=8, groups_width=8)),
        (
            "bit",
            "bit",
            dict(
                cnn4,
                embedding_size=8,
                global_padding="SAME",
                layer_type="bottleneck",
                num_groups=4,
            ),
        ),
        ("poolformer", "poolformer", cnn4),
        ("mobilenet_v2", "mobilenet_v2", dict(cnn, depth_multiplier=0.35)),
        ("mobilenet_v1", "mobilenet_v1", dict(cnn, depth_multiplier=0.25)),
        (
            "efficientnet",
            "efficientnet",
            dict(cnn, width_coefficient=0.25, hidden_dim=320, depth_coefficient=0.25),
        ),
        (
            "levit",
            "levit",
            dict(
                cnn,
                image_size=64,
                hidden_sizes=[16, 32, 48],
                architectures=["LevitForImageClassification"],
                num_attention_heads=[1, 2, 3],
                depths=[1, 1, 1],
                key_dim=[8, 8, 8],
                patch_size=16,
            ),
        ),
        (
            "cvt",
            "cvt",
            dict(
                three,
                embed_dim=[16, 32, 48],
                patch_sizes=[7, 3, 3],
                patch_stride=[4, 2, 2],
                patch_padding=[2, 1, 1],
                mlp_ratio=[2.0] * 3,
                qkv_bias=[True] * 3,
                cls_token=[False, False, True],
                stride_kv=[2] * 3,
                padding_kv=[1] * 3,
                kernel_qkv=[3] * 3,
                padding_q=[1] * 3,
                stride_q=[1] * 3,
                drop_path_rate=[0.0] * 3,
                drop_rate=[0.0] * 3,
                attention_drop_rate=[0.0] * 3,
            ),
        ),
        (
            "focalnet",
            "focalnet",
            dict(
                cnn,
                embed_dim=16,
                depths=[1, 1],
                focal_levels=[2, 2],
                focal_windows=[3, 3],
                patch_size=4,
            ),
        ),
        (
            "pvt",
            "pvt",
            dict(
                num_encoder_blocks=2,
                depths=[1, 1],
                sequence_reduction_ratios=[2, 1],
                hidden_sizes=[16, 32],
                patch_sizes=[4, 2],
                strides=[4, 2],
                num_attention_heads=[1, 2],
                mlp_ratios=[2, 2],
            ),
        ),
        (
            "pvt_v2",
            "pvt_v2",
            dict(
                num_encoder_blocks=2,
                depths=[1, 1],
                sr_ratios=[2, 1],
                hidden_sizes=[16, 32],
                patch_sizes=[7, 3],
                strides=[4, 2],
                num_attention_heads=[1, 2],
                mlp_ratios=[2, 2],
            ),
        ),
        (
            "segformer",
            "segformer",
            dict(
                num_encoder_blocks=2,
                depths=[1, 1],
                sr_ratios=[2, 1],
                hidden_sizes=[16, 32],
                patch_sizes=[7, 3],
                strides=[4, 2],
                num_attention_heads=[1, 2],
                mlp_ratios=[2, 2],
                decoder_hidden_size=32,
            ),
        ),
        (
            "mobilevit",
            "mobilevit",
            dict(
                cnn,
                image_size=64,
                hidden_sizes=[16, 24, 32],
                neck_hidden_sizes=[8, 8, 16, 16, 24, 32, 64],
            ),
        ),
        ("mobilevitv2", "mobilevitv2", dict(cnn, image_size=64, width_multiplier=0.25)),
        ("swiftformer", "swiftformer", dict(cnn, depths=[1, 1, 1, 1], embed_dims=[8, 16, 24, 32])),
        (
            "hiera",
            "hiera",
            dict(
                cnn,
                image_size=[64, 64],
                embed_dim=16,
                num_heads=[1, 2, 4, 8],
                depths=[1, 1, 1, 1],
                query_stride=[2, 2],
                masked_unit_size=[8, 8],
            ),
        ),
        ("ijepa", "ijepa", {}),
        ("siglip_vision", "siglip_vision_model", {}),
        ("clip_vision", "clip_vision_model", {}),
    ]
    specs = []
    for name, model_type, over in table:
        size = over.get("image_size", 32)
        size = 64 if isinstance(size, list) else int(size)
        head = "base" if model_type in ("siglip_vision_model", "clip_vision_model") else "image"
        specs.append(Spec(name, fam, hf(model_type, head, v, f"image:{size}", **over)))
    return specs


def _hf_moe() -> list[Spec]:
    d, fam = DECODER, "hf-moe"
    table: list[tuple[str, str, Kwargs, str]] = [
        ("mixtral", "mixtral", dict(num_local_experts=4, num_experts_per_tok=2), ""),
        ("qwen2_moe", "qwen2_moe", dict(num_experts=4, num_experts_per_tok=2,
                                        moe_intermediate_size=32,
                                        shared_expert_intermediate_size=32), ""),
        ("olmoe", "olmoe", dict(num_experts=4, num_experts_per_tok=2), ""),
        ("granitemoe", "granitemoe", dict(num_local_experts=4, num_experts_per_tok=2), ""),
        ("granitemoeshared", "granitemoeshared", dict(num_local_experts=4, num_experts_per_tok=2,
                                                      shared_intermediate_size=32), ""),
        ("phimoe", "phimoe", dict(num_local_experts=4, num_experts_per_tok=2), ""),
        ("qwen3_moe", "qwen3_moe", dict(num_experts=4, num_experts_per_tok=2,
                                        moe_intermediate_size=32), ""),
        ("deepseek_v3", "deepseek_v3", dict(n_routed_experts=4, n_shared_experts=1,
                                            num_experts_per_tok=2, moe_intermediate_size=32,
                                            first_k_dense_replace=1, q_lora_rank=16,
                                            kv_lora_rank=16, qk_rope_head_dim=4,
                                            qk_nope_head_dim=4, v_head_dim=8, n_group=1,
                                            topk_group=1, num_key_value_heads=4,
                                            head_dim=OMIT), ""),
        ("deepseek_v2", "deepseek_v2", dict(n_routed_experts=4, n_shared_experts=1,
                                            num_experts_per_tok=2, moe_intermediate_size=32,
                                            first_k_dense_replace=1, q_lora_rank=16,
                                            kv_lora_rank=16, qk_rope_head_dim=4,
                                            qk_nope_head_dim=4, v_head_dim=8, n_group=1,
                                            topk_group=1, num_key_value_heads=4,
                                            head_dim=OMIT), ""),
        ("gpt_oss", "gpt_oss", dict(num_local_experts=4, num_experts_per_tok=2,
                                    sliding_window=4), ""),
        ("ernie4_5_moe", "ernie4_5_moe", dict(moe_num_experts=4, moe_k=2,
                                              moe_intermediate_size=32), ""),
        ("glm4_moe", "glm4_moe", dict(n_routed_experts=4, num_experts_per_tok=2,
                                      moe_intermediate_size=32, first_k_dense_replace=1,
                                      n_group=1, topk_group=1), ""),
        ("hunyuan_v1_moe", "hunyuan_v1_moe", dict(num_experts=4, moe_topk=2), ""),
        ("dots1", "dots1", dict(n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
                                moe_intermediate_size=32, first_k_dense_replace=1,
                                n_group=1, topk_group=1), ""),
        ("jamba", "jamba", dict(num_experts=4, num_experts_per_tok=2, attn_layer_period=2,
                                attn_layer_offset=1, expert_layer_period=2,
                                expert_layer_offset=1, mamba_d_state=8,
                                use_mamba_kernels=False), ""),
        ("dbrx", "dbrx", dict(d_model=32, n_heads=4, n_layers=2,
                              attn_config=dict(kv_n_heads=2, rope_theta=1e4, clip_qkv=8.0),
                              ffn_config=dict(ffn_hidden_size=64, moe_num_experts=4,
                                              moe_top_k=2)), ""),
    ]  # fmt: skip
    # the default grouped_mm kernel takes no float64: batched_mm (every expert on every token,
    # weighted), and the reference loop over the experts hit for two of them
    specs = [
        Spec(n, fam, hf(t, "causal", d, experts_implementation="batched_mm", **o), m)
        for n, t, o, m in table
    ]
    specs += [
        Spec(f"{n}-eager-experts", fam, hf(t, "causal", d, experts_implementation="eager", **o))
        for n, t, o, _ in table
        if n in ("mixtral", "qwen3_moe")
    ]
    specs += [
        Spec("switch_transformers", fam,
             hf("switch_transformers", "seq2seq", T5, "seq2seq", num_experts=4,
                num_sparse_encoder_layers=1, num_sparse_decoder_layers=1,
                expert_capacity=4), "always"),
        Spec("nllb-moe", fam,
             hf("nllb-moe", "seq2seq", SEQ2SEQ, "seq2seq", num_experts=4,
                encoder_sparse_step=1, decoder_sparse_step=1, expert_capacity=4), "always"),
    ]  # fmt: skip
    return specs


# ---------------------------------------------------------------------------------------------
# timm


def timm_model(name: str, size: int = 64, batch: int = BATCH, **kwargs: Any) -> Any:
    """A builder for ``timm.create_model(name, pretrained=False, num_classes=10, ...)``."""

    def build() -> Built:
        import timm

        base = dict(pretrained=False, num_classes=10, **kwargs)
        for extra in ({"drop_rate": 0.0, "drop_path_rate": 0.0}, {"drop_rate": 0.0}, {}):
            try:
                model = timm.create_model(name, **base, **extra)
                break
            except TypeError:
                if not extra:
                    raise
        return model, images(size, batch), {}

    return build


TIMM: list[tuple[str, Kwargs]] = [
    # ResNets and relatives
    ("resnet18", {}), ("resnet26d", {}), ("resnet50", dict(batch=4)), ("resnet10t", {}),
    ("resnetv2_18", {}), ("resnetv2_50", dict(batch=4)), ("resnetv2_50x1_bit", dict(batch=4)),
    ("resnext26ts", {}), ("seresnext26d_32x4d", dict(batch=4)), ("ecaresnet26t", {}),
    ("skresnet18", {}), ("res2net50_14w_8s", dict(batch=4)), ("res2next50", dict(batch=4)),
    ("resnest14d", {}), ("resnest26d", dict(batch=4)), ("legacy_seresnet18", {}),
    ("nf_resnet26", {}), ("gcresnet33ts", {}),
    ("lambda_resnet26t", {}),
    ("botnet26t_256", dict(size=64, img_size=64)),
    ("test_resnet", {}), ("test_byobnet", {}), ("test_nfnet", {}),
    # re-parameterisable
    ("repvgg_a0", {}), ("mobileone_s0", {}), ("fastvit_t8", {}), ("repghostnet_050", {}),
    ("repvit_m1", {}),
    # mobile / efficient CNNs
    ("efficientnet_b0", {}), ("efficientnet_lite0", {}), ("tf_efficientnet_b0", {}),
    ("efficientnetv2_rw_t", {}), ("efficientnet_b0_gn", {}), ("mobilenetv3_small_050", {}),
    ("mobilenetv3_large_100", {}), ("mobilenetv2_050", {}), ("mnasnet_small", {}),
    ("fbnetc_100", {}), ("ghostnet_100", {}), ("ghostnetv2_100", {}), ("hardcorenas_a", {}),
    ("lcnet_050", {}), ("tinynet_e", {}), ("mixnet_s", {}), ("rexnet_100", {}),
    ("test_efficientnet", {}), ("test_efficientnet_evos", {}), ("test_efficientnet_ln", {}),
    # RegNet and other CNN families
    ("regnetx_002", {}), ("regnety_002", {}), ("regnetz_005", {}), ("dla34", {}),
    ("dla46_c", {}), ("dpn48b", {}), ("densenet121", dict(batch=4)),
    ("cspresnet50", dict(batch=4)),
    ("cspdarknet53", dict(batch=4)), ("cs3darknet_focus_s", {}), ("ese_vovnet19b_dw", {}),
    ("hrnet_w18_small", {}), ("selecsls42b", {}), ("gernet_s", {}),
    ("inception_v3", dict(size=75, batch=4)),
    ("hgnetv2_b0", {}), ("hgnet_tiny", {}), ("starnet_s1", {}), ("rdnet_tiny", dict(batch=4)),
    ("fasternet_t0", {}), ("darknet17", {}), ("vgg11", dict(size=32, batch=4)),
    # ConvNeXt and MetaFormers
    ("convnext_atto", {}), ("convnextv2_atto", {}), ("test_convnext", {}),
    ("poolformer_s12", {}), ("poolformerv2_s12", {}), ("caformer_s18", dict(batch=4)),
    ("inception_next_tiny", dict(batch=4)), ("mambaout_femto", {}), ("test_mambaout", {}),
    # ViT family
    ("vit_tiny_patch16_224", dict(img_size=64)), ("deit_tiny_patch16_224", dict(img_size=64)),
    ("deit_tiny_distilled_patch16_224", dict(img_size=64)),
    ("cait_xxs24_224", dict(img_size=64, depth=4)), ("xcit_nano_12_p16_224", dict(img_size=64)),
    ("pit_ti_224", dict(img_size=64)), ("eva02_tiny_patch14_224", dict(size=56, img_size=56)),
    ("vit_small_patch16_rope_224", dict(img_size=64, depth=4)),
    ("vit_little_patch16_reg4_gap_256", dict(img_size=64, depth=4)),
    ("beit_base_patch16_224", dict(img_size=64, depth=2, batch=4)),
    ("convit_tiny", dict(img_size=64)), ("test_vit", {}), ("test_vit2", {}),
    ("test_vit3", dict(img_size=64)), ("test_vit_relpos", dict(img_size=64)),
    ("mixer_s16_224", dict(img_size=64)),
    ("resmlp_12_224", dict(img_size=64)), ("gmlp_ti16_224", dict(img_size=64)),
    ("volo_d1_224", dict(img_size=64, batch=4)), ("visformer_tiny", dict(img_size=64)),
    # hierarchical / windowed attention
    ("swin_tiny_patch4_window7_224", dict(img_size=64, window_size=2, batch=4)),
    ("swinv2_cr_tiny_ns_224", dict(img_size=64, window_size=2, batch=4)),
    ("swinv2_tiny_window8_256", dict(img_size=64, window_size=2, batch=4)),
    ("davit_tiny", dict(batch=4)), ("focalnet_tiny_srf", dict(batch=4)),
    ("hiera_tiny_224", dict(img_size=64)), ("mvitv2_tiny", dict(img_size=64, batch=4)),
    ("pvt_v2_b0", {}), ("twins_pcpvt_small", dict(batch=4)), ("coat_lite_tiny", dict(img_size=64)),
    ("levit_128s", dict(img_size=64)), ("efficientvit_b0", {}), ("efficientvit_m0", {}),
    ("efficientformerv2_s0", dict(img_size=64)), ("tiny_vit_5m_224", {}),
    ("edgenext_xx_small", {}),
    ("mobilevit_xxs", {}), ("mobilevitv2_050", {}), ("nextvit_small", dict(batch=4)),
    # attention hybrids
    ("coatnet_nano_rw_224", dict(img_size=64)), ("coatnet_0_rw_224", dict(img_size=64, batch=4)),
    ("maxvit_rmlp_pico_rw_256", dict(img_size=64)), ("test_maxvit", dict(size=160, batch=4)),
    ("test_coatnet", dict(size=160, batch=4)),
    ("crossvit_tiny_240", dict(size=240, batch=2)), ("sequencer2d_s", dict(batch=4)),
]  # fmt: skip


def _timm_specs() -> list[Spec]:
    specs = []
    for name, over in TIMM:
        options = dict(over)
        size, batch = int(options.pop("size", 64)), int(options.pop("batch", BATCH))
        specs.append(Spec(name, "timm", timm_model(name, size, batch, **options)))
    return specs


# ---------------------------------------------------------------------------------------------
# torchvision


def tv_model(name: str, kind: str = "classify", size: int = 64, batch: int = BATCH,
             **kwargs: Any) -> Any:  # fmt: skip
    """A builder for ``torchvision.models.get_model(name, weights=None, ...)``."""

    def build() -> Built:
        import torchvision

        extra: Kwargs = dict(kwargs)
        if kind != "flow":
            extra.setdefault("num_classes", 10)
        if kind in ("segment", "detect"):
            extra.setdefault("weights_backbone", None)
        model = torchvision.models.get_model(name, weights=None, **extra)
        if kind == "video":
            return model, video(size, batch=batch), {}
        if kind == "flow":
            first, second = images(size, batch)[0], images(size, batch)[0].flip(0)
            return model, (first, second), {}
        return model, images(size, batch), {}

    return build


def small_mvit() -> Built:
    """torchvision's MViT-v2 code with four blocks, on 8 frames of 32 x 32 pixels."""
    from torchvision.models.video.mvit import MSBlockConfig, MViT

    blocks = [
        MSBlockConfig(1, 16, 16, [3, 3, 3], [3, 3, 3], [1, 1, 1], [1, 4, 4]),
        MSBlockConfig(2, 16, 32, [3, 3, 3], [3, 3, 3], [1, 2, 2], [1, 2, 2]),
        MSBlockConfig(2, 32, 32, [3, 3, 3], [3, 3, 3], [1, 1, 1], [1, 2, 2]),
        MSBlockConfig(4, 32, 64, [3, 3, 3], [3, 3, 3], [1, 2, 2], [1, 1, 1]),
    ]
    model = MViT((32, 32), 8, blocks, residual_pool=True, residual_with_cls_embed=False,
                 rel_pos_embed=True, proj_after_attn=True, dropout=0.0,
                 num_classes=10)  # fmt: skip
    return model, video(32, 8, batch=4), {}


def small_maxvit() -> Built:
    """torchvision's MaxViT code at 64 x 64 pixels, partition size 2."""
    from torchvision.models.maxvit import MaxVit

    model = MaxVit((64, 64), stem_channels=16, partition_size=2, block_channels=[16, 32],
                   block_layers=[1, 1], head_dim=8, stochastic_depth_prob=0.0,
                   num_classes=10)  # fmt: skip
    return model, images(64), {}


def small_vit() -> Built:
    """torchvision's VisionTransformer code at 32 x 32 pixels, 2 layers of width 64."""
    from torchvision.models.vision_transformer import VisionTransformer

    model = VisionTransformer(32, 8, num_layers=2, num_heads=4, hidden_dim=64, mlp_dim=128,
                              num_classes=10)  # fmt: skip
    return model, images(32), {}


TORCHVISION: list[tuple[str, str, Kwargs]] = [
    ("alexnet", "classify", dict(batch=4)), ("vgg11_bn", "classify", dict(size=32, batch=4)),
    ("resnet18", "classify", {}), ("resnet50", "classify", dict(batch=4)),
    ("resnext50_32x4d", "classify", dict(batch=4)), ("wide_resnet50_2", "classify", dict(batch=4)),
    ("densenet121", "classify", dict(batch=4)), ("squeezenet1_0", "classify", {}),
    ("squeezenet1_1", "classify", {}),
    ("inception_v3", "classify", dict(size=75, batch=4, aux_logits=False, init_weights=True)),
    ("googlenet", "classify", dict(aux_logits=False, init_weights=True)),
    ("shufflenet_v2_x0_5", "classify", {}), ("mobilenet_v2", "classify", {}),
    ("mobilenet_v3_small", "classify", {}), ("mobilenet_v3_large", "classify", {}),
    ("mnasnet0_5", "classify", {}), ("efficientnet_b0", "classify", {}),
    ("efficientnet_v2_s", "classify", dict(batch=4)), ("regnet_x_400mf", "classify", {}),
    ("regnet_y_400mf", "classify", {}), ("convnext_tiny", "classify", dict(batch=4)),
    ("swin_t", "classify", dict(batch=4)), ("swin_v2_t", "classify", dict(batch=4)),
    ("r3d_18", "video", {}), ("mc3_18", "video", {}), ("r2plus1d_18", "video", {}),
    ("swin3d_t", "video", {}),
    ("fcn_resnet50", "segment", dict(batch=4)),
    ("deeplabv3_mobilenet_v3_large", "segment", {}), ("lraspp_mobilenet_v3_large", "segment", {}),
    ("deeplabv3_resnet50", "segment", dict(batch=4, aux_loss=True)),
    ("fasterrcnn_mobilenet_v3_large_320_fpn", "detect", dict(batch=2)),
    ("retinanet_resnet50_fpn", "detect", dict(batch=2)),
    ("ssdlite320_mobilenet_v3_large", "detect", dict(batch=2)),
    ("fcos_resnet50_fpn", "detect", dict(batch=2)),
    ("raft_small", "flow", dict(batch=2, size=128)),
]  # fmt: skip
TV_FAMILY = {"classify": "tv-classify", "video": "tv-video", "segment": "tv-segment",
             "detect": "tv-detect", "flow": "tv-flow"}  # fmt: skip


def _tv_specs() -> list[Spec]:
    specs = []
    for name, kind, over in TORCHVISION:
        options = dict(over)
        size, batch = int(options.pop("size", 64)), int(options.pop("batch", BATCH))
        build = tv_model(name, kind, size, batch, **options)
        # RAFT builds its coordinate grids in the default dtype
        specs.append(Spec(f"tv-{name}", TV_FAMILY[kind], build, default_double=kind == "flow"))
    specs += [
        Spec("tv-vit_small", "tv-classify", small_vit),
        Spec("tv-maxvit_small", "tv-classify", small_maxvit),
        Spec("tv-mvit_v2_small", "tv-video", small_mvit),
    ]
    return specs


def registry() -> dict[str, Spec]:
    """Every model of the harness by name."""
    specs = _hf_decoders() + _hf_encoders() + _hf_seq2seq() + _hf_vision() + _hf_moe()
    specs += _timm_specs() + _tv_specs()
    table = {s.name: s for s in specs}
    assert len(table) == len(specs), "duplicate model names"
    return table


# ---------------------------------------------------------------------------------------------
# Preparing a model and its inputs

DROP_ATTRS = ("p", "drop_prob", "drop_rate", "drop_path_prob")


def _dropout_like(module: nn.Module) -> bool:
    name = type(module).__name__.lower()
    return (
        isinstance(module, nn.modules.dropout._DropoutNd)
        or "drop" in name
        or ("stochasticdepth" in name)
    )


def zero_dropout(model: nn.Module) -> None:
    """``p = 0`` on every dropout-like module; every float ``*dropout*`` attribute to 0."""
    for module in model.modules():
        dropish = _dropout_like(module)
        for key, value in list(vars(module).items()):
            if not isinstance(value, float) or value <= 0:
                continue
            named = "dropout" in key or "drop_path" in key or "layerdrop" in key
            if named or (dropish and key in DROP_ATTRS):
                setattr(module, key, 0.0)


def _map_tensors(tree: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    leaves, spec = tree_flatten(tree)
    return tree_unflatten([fn(x) if isinstance(x, torch.Tensor) else x for x in leaves], spec)


def to_double(tree: Any) -> Any:
    return _map_tensors(tree, lambda x: x.double() if x.is_floating_point() else x)


def fresh(tree: Any) -> Any:
    return _map_tensors(tree, lambda x: x.clone())


def _batch_statistics(module: nn.Module, train: bool) -> bool:
    """Does ``module`` normalise with statistics of the batch it is given?"""
    if isinstance(module, nn.modules.batchnorm._BatchNorm):
        return train or module.running_mean is None
    name = type(module).__name__
    return train and ("BatchNorm" in name or name.startswith("EvoNorm2dB"))


def mixes_samples(spec: Spec, model: nn.Module, train: bool) -> bool:
    if spec.mixes == "always" or (train and spec.mixes == "train"):
        return True
    return any(_batch_statistics(m, train) for m in model.modules())


# ---------------------------------------------------------------------------------------------
# The oracle: eager, on the whole batch or on fxpipe's micro-batches


def split_rows(tree: Any, parts: int) -> list[Any]:
    """Every tensor of ``tree`` split on dim 0 into ``parts`` (``tensor_split``), as fxpipe's
    scatter and torch's pipelining split a batch."""
    leaves, spec = tree_flatten(tree)
    cut = [x.tensor_split(parts) if isinstance(x, torch.Tensor) else None for x in leaves]
    return [
        tree_unflatten([x if c is None else c[i] for x, c in zip(leaves, cut)], spec)
        for i in range(parts)
    ]


def micro_batches(args: Args, kwargs: Kwargs) -> list[tuple[Args, Kwargs]]:
    """Every tensor split on dim 0 into min(CHUNKS, batch) parts, as fxpipe's scatter does."""
    size = next(x.size(0) for x in tree_flatten((args, kwargs))[0] if isinstance(x, torch.Tensor))
    return split_rows((args, kwargs), min(CHUNKS, size))


def join(outputs: list[Any]) -> Any:
    """Micro-batch outputs concatenated on dim 0 (other leaves from the first)."""
    flat = [tree_flatten(out) for out in outputs]
    columns = zip(*(leaves for leaves, _ in flat))
    joined = [torch.cat(c) if isinstance(c[0], torch.Tensor) else c[0] for c in columns]
    return tree_unflatten(joined, flat[0][1])


@dataclass
class Side:
    """What one side (eager or fxpipe) produced: outputs, gradients, buffers after the step."""

    output: Any
    grads: dict[str, torch.Tensor | None]
    buffers: dict[str, torch.Tensor]


def loss_weights(output: Any) -> list[torch.Tensor | None]:
    """Fixed random weights for every floating-point leaf of ``output``."""
    gen = _gen(7)
    return [
        torch.randn(x.shape, generator=gen, dtype=x.dtype)
        if isinstance(x, torch.Tensor) and x.is_floating_point()
        else None
        for x in tree_flatten(output)[0]
    ]


def backward(model: nn.Module, output: Any, weights: list[torch.Tensor | None]) -> Side:
    """Backward of sum(output * weights) over the floating leaves; the model's gradients and
    persistent buffers after it."""
    leaves = tree_flatten(output)[0]
    terms = [(x * w).sum() for x, w in zip(leaves, weights) if w is not None]
    loss = sum(terms, torch.zeros((), dtype=torch.float64))
    if loss.requires_grad:
        loss.backward()
    grads = {
        n: None if p.grad is None else p.grad.detach().clone() for n, p in model.named_parameters()
    }
    # persistent buffers only: the state a checkpoint keeps (running statistics); caches a
    # forward rebuilds (ConViT's rel_indices) are not part of the contract
    kept = set(model.state_dict())
    buffers = {n: b.detach().clone() for n, b in model.named_buffers() if n in kept}
    return Side(_detach(output), grads, buffers)


def _detach(tree: Any) -> Any:
    return _map_tensors(tree, lambda x: x.detach())


def run_eager(model: nn.Module, args: Args, kwargs: Kwargs, split: bool) -> Any:
    if not split:
        return model(*fresh(args), **fresh(kwargs))
    return join([model(*a, **k) for a, k in micro_batches(fresh(args), fresh(kwargs))])


# ---------------------------------------------------------------------------------------------
# Comparing


def err(got: torch.Tensor, want: torch.Tensor, floor: float) -> float:
    """max|got - want| / max(max|want|, floor); NaN where both are NaN counts as equal."""
    if want.numel() == 0:
        return 0.0
    if not want.is_floating_point() and not want.is_complex():
        return 0.0 if torch.equal(got, want) else float("inf")
    g, w = got.detach().to(torch.complex128 if want.is_complex() else torch.float64), want
    both = torch.isnan(g) & torch.isnan(w)
    if (torch.isnan(g) ^ torch.isnan(w)).any():
        return float("inf")
    diff = (g - w).abs().masked_fill(both, 0).max().item()
    scale = max(w.abs().masked_fill(both, 0).max().item(), floor)
    return diff / scale if scale > 0 else diff


def _largest(tensors: Iterable[Any]) -> float:
    sizes = [
        t.detach().abs().nan_to_num().max().item()
        for t in tensors
        if isinstance(t, torch.Tensor) and t.numel() and (t.is_floating_point() or t.is_complex())
    ]
    return max(sizes, default=0.0)


def _shape_problem(name: str, got: Any, want: torch.Tensor) -> str | None:
    if not isinstance(got, torch.Tensor):
        return f"{name}: got {type(got).__name__}, eager a tensor"
    if got.shape != want.shape or got.dtype != want.dtype:
        shapes = f"{tuple(got.shape)} {got.dtype}, eager {tuple(want.shape)} {want.dtype}"
        return f"{name}: got {shapes}"
    return None


Named = Iterable[tuple[str, torch.Tensor, Any]]


def _worst(named: Named, floor: float) -> tuple[str | None, float]:
    """The leaf with the largest error (named when over TOLERANCE) and that error; a leaf of
    another type, shape or dtype is reported at once."""
    worst, where = 0.0, ""
    for name, w, g in named:
        problem = _shape_problem(name, g, w)
        if problem:
            return problem, float("inf")
        e = err(g, w, floor)
        if not e <= worst:
            worst, where = e, name
    return (f"{where}: err {worst:.2e}" if not worst < TOLERANCE else None), worst


def compare_outputs(got: Any, want: Any) -> tuple[str | None, float]:
    """The worst difference in structure or value (None when equal), and the largest error."""
    if type(got) is not type(want):
        return f"output type {type(got).__name__}, eager {type(want).__name__}", float("inf")
    got_leaves, got_spec = tree_flatten(got)
    want_paths, want_spec = tree_flatten_with_path(want)
    if got_spec != want_spec:
        return f"output structure differs: got {got_spec}, eager {want_spec}"[:400], float("inf")
    named = []
    for (path, w), g in zip(want_paths, got_leaves):
        name = f"output{keystr(path)}"
        if isinstance(w, torch.Tensor):
            named.append((name, w, g))
        elif g != w:
            return f"{name}: got {g!r}, eager {w!r}", float("inf")
    return _worst(named, FLOOR * _largest(tree_flatten(want)[0]))


def compare_tensors(
    kind: str, got: dict[str, Any], want: dict[str, Any]
) -> tuple[str | None, float]:
    """Gradients or buffers by name: None against not None, shape, then the error."""
    if list(got) != list(want):
        missing = sorted(set(want) ^ set(got))[:3]
        return f"{kind} names differ (e.g. {missing})", float("inf")
    for name, w in want.items():
        if (got[name] is None) != (w is None):
            which = ["a tensor", "None"]
            return (f"{kind} {name}: got {which[got[name] is None]}, eager "
                    f"{which[w is None]}"), float("inf")  # fmt: skip
    named = [(f"{kind} {n}", w, got[n]) for n, w in want.items() if w is not None]
    return _worst(named, FLOOR * _largest(want.values()))


def compare(got: Side, want: Side) -> tuple[str | None, dict[str, float]]:
    """The first kind (outputs, gradients, buffers) that differs, by its worst leaf, and the
    largest error of each kind."""
    worst: dict[str, float] = {}
    first: str | None = None
    problem, worst["output"] = compare_outputs(got.output, want.output)
    if problem:
        return problem, worst
    for kind, g, w in (("grad", got.grads, want.grads), ("buffer", got.buffers, want.buffers)):
        problem, worst[kind] = compare_tensors(kind, g, w)
        first = first or problem
    return first, worst


# ---------------------------------------------------------------------------------------------
# One model, in its own process

_PHASE = ["start"]


def phase(text: str) -> None:
    """Say on stderr what the worker is doing (the driver reports the last one on a timeout)."""
    _PHASE[0] = text
    print(f"[coverage] phase: {text}", file=sys.stderr, flush=True)


def _source_roots() -> list[Path]:
    """Where the fxpipe being checked lives (its checkout), then this repository."""
    import fxpipe

    return [Path(fxpipe.__file__).resolve().parent.parent, ROOT]


def _short(path: str) -> str:
    """A frame's file without machine paths: relative to the checkout or site-packages."""
    for root in _source_roots():
        try:
            return str(Path(path).resolve().relative_to(root))
        except ValueError:
            continue
    parts = Path(path).parts
    if "site-packages" in parts:
        return "/".join(parts[parts.index("site-packages") + 1 :])
    return Path(path).name


def _frame(f: traceback.FrameSummary) -> str:
    return f"{_short(f.filename)}:{f.lineno} in {f.name}"


def _is_fxpipe(f: traceback.FrameSummary) -> bool:
    return _short(f.filename).startswith(("fxpipe/", "passes/"))


def _chain(exc: BaseException) -> list[BaseException]:
    chain = [exc]
    while len(chain) < 8:
        nxt = chain[-1].__cause__ or chain[-1].__context__
        if nxt is None or nxt in chain:
            break
        chain.append(nxt)
    return chain


def scrub(text: str) -> str:
    """``text`` without machine paths: site-packages and the checkout become relative."""
    text = re.sub(r"[^\s\"'(]*/site-packages/", "", text)
    for root in _source_roots():
        text = text.replace(f"{root}/", "")
    return text


def describe(exc: BaseException) -> Row:
    """Type, message, innermost fxpipe frame and innermost frame of an exception (and of the
    exception at the root of its chain, when that is another one)."""
    chain = _chain(exc)
    info: Row = {"type": type(exc).__name__, "message": scrub(str(exc))[:3000]}
    for e in reversed(chain):
        frames = [f for f in traceback.extract_tb(e.__traceback__) if _is_fxpipe(f)]
        if frames:
            info["fxpipe_frame"] = _frame(frames[-1])
            break
    frames = traceback.extract_tb(chain[-1].__traceback__)
    if frames:
        info["frame"] = _frame(frames[-1])
    if len(chain) > 1:
        info["cause"] = f"{type(chain[-1]).__name__}: {scrub(str(chain[-1]))[:1000]}"
    return info


def _first_line(text: str, limit: int = 200) -> str:
    line = " ".join(text.split())
    return line if len(line) <= limit else line[: limit - 3] + "..."


def failure(exc: BaseException) -> Row:
    """refused for an FxPipeError fxpipe raises on purpose, crashed for anything else."""
    import fxpipe
    from fxpipe.errors import StageError

    on_purpose = isinstance(exc, fxpipe.FxPipeError) and not isinstance(exc, StageError)
    info = describe(exc)
    return {
        "status": "refused" if on_purpose else "crashed",
        "where": _PHASE[0],
        "reason": _first_line(f"{info['type']}: {info['message']}"),
        "error": info,
    }


def check_mode(spec: Spec, model: nn.Module, inputs: tuple[Args, Kwargs], train: bool,
               stages: int, cost: str) -> Row:  # fmt: skip
    """Eager against fxpipe in one mode, each on a fresh deep copy of ``model``."""
    import fxpipe

    mode = "train" if train else "eval"
    args, kwargs = inputs
    split = mixes_samples(spec, model, train)
    row: Row = {"oracle": "micro-batches" if split else "whole batch"}
    phase(f"{mode}: eager")
    try:
        want = eager_side(model, inputs, train, split)
    except Exception as exc:
        return {**row, "status": "skipped", "reason": f"eager failed: {_first_line(repr(exc))}"}
    weights = loss_weights(want.output)
    piped = copy.deepcopy(model).train(train)
    try:
        phase(f"{mode}: fxpipe.pipeline")
        options: Kwargs = {"chunks": CHUNKS, "cost": cost, "example_kwargs": fresh(kwargs)}
        pipe = fxpipe.pipeline(piped, fresh(args), ["cpu"] * stages, **options)
        row["tracer"] = getattr(getattr(pipe, "_traced", None), "tracer", None)
        phase(f"{mode}: pipeline forward")
        output = pipe(*fresh(args), **fresh(kwargs))
        phase(f"{mode}: pipeline backward")
        problem, _ = compare_outputs(output, want.output)
        got = Side(output, {}, {}) if problem else backward(piped, output, weights)
    except Exception as exc:
        return {**row, **failure(exc)}
    return {**row, **judge(spec, model, inputs, train, split, got, want)}


def eager_side(model: nn.Module, inputs: tuple[Args, Kwargs], train: bool, split: bool) -> Side:
    oracle = copy.deepcopy(model).train(train)
    output = run_eager(oracle, *inputs, split)
    return backward(oracle, output, loss_weights(output))


def judge(spec: Spec, model: nn.Module, inputs: tuple[Args, Kwargs], train: bool,
          split: bool, got: Side, want: Side) -> Row:  # fmt: skip
    """equal or wrong. Before calling a difference wrong: eager is run again (it must repeat
    itself), and, on a whole-batch oracle, eager on the micro-batches measures the model's own
    noise under micro-batching (float32 casts inside a float64 model round differently):
    errors within 10x that noise count as equal."""
    problem, worst = compare(got, want)
    errors = {k: v for k, v in worst.items() if v != float("inf")}
    if problem is None:
        return {"status": "equal", "reason": "", "max_err": errors}
    mode = "train" if train else "eval"
    phase(f"{mode}: eager again")
    again, _ = compare(eager_side(model, inputs, train, split), want)
    if again is not None:
        return {"status": "skipped", "reason": f"eager is not deterministic: {again}"}
    if not split and len(errors) == len(worst):
        phase(f"{mode}: eager on micro-batches")
        _, noise = compare(eager_side(model, inputs, train, True), want)
        bound = {k: max(TOLERANCE, 10 * noise.get(k, 0.0)) for k in worst}
        if all(worst[k] <= bound[k] for k in worst):
            return {"status": "equal", "reason": "", "max_err": errors, "noise": noise}
        return {"status": "wrong", "reason": problem, "max_err": errors, "noise": noise}
    return {"status": "wrong", "reason": problem, "max_err": errors}


PRIORITY = ("wrong", "crashed", "refused", "equal")


def overall(modes: dict[str, Row]) -> tuple[str, str]:
    """The model's class: the worst of its modes (all skipped: skipped)."""
    for status in PRIORITY:
        for mode, result in modes.items():
            if result["status"] == status:
                return status, f"{mode}: {result['reason']}" if result["reason"] else ""
    first = next(iter(modes.values()))
    return "skipped", first["reason"]


def stages_for(name: str) -> int:
    """2, 3 or 4 stages, fixed per model name."""
    return 2 + zlib.crc32(name.encode()) % 3


def check_model(spec: Spec, cost: str, save: Callable[[Row], None]) -> Row:
    """Build, prepare (float64, no dropout) and check ``spec`` in train then eval mode."""
    row: Row = {"name": spec.name, "family": spec.family, "stages": stages_for(spec.name)}
    phase("build")
    torch.manual_seed(0)
    if spec.default_double:
        torch.set_default_dtype(torch.float64)
    try:
        model, args, kwargs = spec.build()
    except Exception as exc:
        return {**row, "status": "skipped", "reason": f"build failed: {_first_line(repr(exc))}"}
    model = model.double()
    zero_dropout(model)
    inputs = (to_double(args), to_double(kwargs))
    row["params"] = sum(p.numel() for p in model.parameters())
    row["batch"] = next(x.size(0) for x in tree_flatten(inputs)[0] if isinstance(x, torch.Tensor))
    row["modes"] = {}
    for mode in ("train", "eval"):
        row["modes"][mode] = check_mode(spec, model, inputs, mode == "train", row["stages"], cost)
        row["status"], row["reason"] = overall(row["modes"])
        save(row)
    return row


def worker(name: str, cost: str, result: Path) -> None:
    torch.set_num_threads(1)
    started = time.perf_counter()

    def save(row: Row) -> None:
        seconds = round(time.perf_counter() - started, 1)
        result.write_text(scrub(json.dumps({**row, "seconds": seconds})))

    save(check_model(registry()[name], cost, save))


# ---------------------------------------------------------------------------------------------
# The driver

CHILD_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
             "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}  # fmt: skip


def _last_phase(stderr: str) -> str:
    marks = [line for line in stderr.splitlines() if line.startswith("[coverage] phase: ")]
    return marks[-1].split(": ", 1)[1] if marks else "start"


def _finish(row: Row, timed_out: bool, rc: int | None, stderr: str, timeout: float) -> Row:
    """The row of a child that timed out or died without a verdict."""
    if timed_out:
        row["status"] = "timeout"
        row["reason"] = f"no verdict after {timeout:.0f} s (in {_last_phase(stderr)})"
    elif "status" not in row or "modes" in row and len(row["modes"]) < 2 and rc != 0:
        tail = _first_line(stderr.strip().splitlines()[-1] if stderr.strip() else "", 300)
        row["status"] = "crashed"
        row["reason"] = f"worker exited with {rc} in {_last_phase(stderr)}: {tail}"
    return row


def run_child(spec: Spec, cost: str, timeout: float) -> Row:
    """Run one model's worker in a subprocess of its own, killed after ``timeout`` seconds."""
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "row.json"
        cmd = [sys.executable, "-m", "benchmarks.coverage", "--worker", spec.name,
               "--cost", cost, "--result", str(result)]  # fmt: skip
        started = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, **CHILD_ENV}, text=True,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                start_new_session=True)  # fmt: skip
        try:
            _, stderr = proc.communicate(timeout=timeout)
            timed_out = False
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            _, stderr = proc.communicate()
            timed_out = True
        row: Row = json.loads(result.read_text()) if result.exists() else {}
    row = {"name": spec.name, "family": spec.family, "stages": stages_for(spec.name), **row}
    row = _finish(row, timed_out, proc.returncode, stderr, timeout)
    row["seconds"] = round(time.perf_counter() - started, 1)
    return row


def select(table: dict[str, Spec], only: str | None) -> list[Spec]:
    """Models whose name or family matches one of the comma-separated patterns (a model's
    exact name; else a pattern without a wildcard matches as a substring)."""
    if not only:
        return list(table.values())
    wanted = [p for p in only.split(",") if p]
    pats = [p if p in table or any(c in p for c in "*?[") else f"*{p}*" for p in wanted]
    return [
        s for s in table.values()
        if any(fnmatch.fnmatch(s.name, p) or fnmatch.fnmatch(s.family, p) for p in pats)
    ]  # fmt: skip


def interleave(specs: list[Spec]) -> list[Spec]:
    """Round-robin over families, so that any prefix of a run samples every family."""
    groups: dict[str, list[Spec]] = {}
    for spec in specs:
        groups.setdefault(spec.family, []).append(spec)
    order: list[Spec] = []
    while any(groups.values()):
        order += [group.pop(0) for group in groups.values() if group]
    return order


def run_all(specs: list[Spec], args: argparse.Namespace, meta: Row) -> list[Row]:
    """Run every model, saving the rows to ``args.out`` after each one."""
    rows: list[Row] = []
    merge = args.merge or args.resume
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        futures = [pool.submit(run_child, s, args.cost, args.timeout) for s in specs]
        for i, future in enumerate(futures, 1):
            row = future.result()
            rows.append(row)
            head = f"[{i}/{len(specs)}] {row['name']:<34} {row['status']:<8}"
            print(f"{head} {row['seconds']:6.1f} s  {_first_line(row.get('reason', ''), 90)}",
                  flush=True)  # fmt: skip
            everything = save(args.out, rows, meta, merge or i > 1)
    return everything if rows else []


def table(rows: list[Row]) -> str:
    """Counts per family and class (total: the models counted, skipped ones left out), then
    one line per model that is not equal."""
    families = list(dict.fromkeys(r["family"] for r in rows))
    counts = Counter((r["family"], r["status"]) for r in rows)
    head = f"{'family':<12}" + "".join(f"{s:>9}" for s in STATUSES[:-1]) + f"{'total':>9}"
    head += f"{'skipped':>9}"
    lines = [head, "-" * len(head)]
    for fam in families + ["all"]:
        n = [sum(counts[(f, s)] for f in families) if fam == "all" else counts[(fam, s)]
             for s in STATUSES]  # fmt: skip
        cells = "".join(f"{c:>9}" for c in n[:-1])
        lines.append(f"{fam:<12}{cells}{sum(n[:-1]):>9}{n[-1]:>9}")
        if fam == families[-1]:
            lines.append("-" * len(head))
    bad = [r for r in rows if r["status"] != "equal"]
    order = {s: i for i, s in enumerate(("wrong", "crashed", "timeout", "refused", "skipped"))}
    lines.append("")
    for r in sorted(bad, key=lambda r: (order.get(r["status"], 9), r["family"], r["name"])):
        lines.append(f"{r['status']:<8} {r['name']:<34} {_first_line(r.get('reason', ''), 150)}")
    return "\n".join(lines)


def library_versions() -> dict[str, str | None]:
    """The version of each library the models come from (None: not installed)."""
    versions: dict[str, str | None] = {}
    for lib in ("torch", "torchvision", "timm", "transformers"):
        try:
            versions[lib] = __import__(lib).__version__
        except ImportError:
            versions[lib] = None
    return versions


def _meta(args: argparse.Namespace) -> Row:
    import platform

    return {"date": time.strftime("%Y-%m-%d"), "python": platform.python_version(),
            "cpus": os.cpu_count(), "cost": args.cost, "timeout_s": args.timeout,
            "chunks": CHUNKS, "tolerance": TOLERANCE, "floor": FLOOR, "label": args.label,
            **library_versions()}  # fmt: skip


def save(
    path: Path,
    rows: list[Row],
    meta: Row,
    merge: bool,
    key: Callable[[Row], Any] = lambda r: r["name"],
) -> list[Row]:
    """Write ``rows``, each with the label of the run that made it (with ``merge``: over the
    rows already in ``path`` of other ``key`` s, which keep theirs; a row written before
    rows had labels takes its file's), in the registry's order of models."""
    rows = [{"label": meta["label"], **r} for r in rows]
    if merge and path.exists():
        before = json.loads(path.read_text())
        old = {key(r): {"label": before["meta"].get("label", ""), **r} for r in before["rows"]}
        old.update({key(r): r for r in rows})
        order = list(registry())  # models no longer in the registry are dropped
        rows = sorted((r for r in old.values() if r["name"] in order),
                      key=lambda r: order.index(r["name"]))  # fmt: skip
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="comma-separated name or family patterns")
    parser.add_argument("--cost", default="flops", help="fxpipe's cost= (default flops)")
    parser.add_argument("--jobs", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=240.0, help="seconds per model")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument(
        "--merge",
        action="store_true",
        help="keep the rows of --out for the models not run this time",
    )
    parser.add_argument(
        "--resume", action="store_true", help="skip the models --out already has (implies --merge)"
    )
    parser.add_argument("--list", action="store_true", help="list the selected models")
    parser.add_argument("--label", default="", help="a note kept in the JSON (which fxpipe)")
    parser.add_argument("--show", action="store_true", help="print the table of --out only")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.worker, args.cost, args.result)
        sys.stdout.flush()
        os._exit(0)  # fxpipe's worker threads must not hold the process open
    if args.show:
        print(table(json.loads(args.out.read_text())["rows"]))
        return
    specs = select(registry(), args.only)
    if args.resume and args.out.exists():
        done = {r["name"] for r in json.loads(args.out.read_text())["rows"]}
        specs = [s for s in specs if s.name not in done]
    if args.list:
        print("\n".join(f"{s.family:<12} {s.name}" for s in specs))
        return
    rows = run_all(interleave(specs), args, _meta(args))
    print()
    print(table(rows))


if __name__ == "__main__":
    main()
