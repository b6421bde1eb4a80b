"""The sweeps' Hugging Face Mixture-of-Experts models, from small configs."""

from __future__ import annotations

from benchmarks.harness.models.hf_text import DECODER, OMIT, SEQ2SEQ, T5, hf
from benchmarks.harness.models.spec import Kwargs, Spec

__all__ = ["hf_moe_specs"]


def hf_moe_specs() -> list[Spec]:
    """Every Mixture-of-Experts model of the registry."""
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
    # the experts implementation transformers picks by default (grouped_mm: the batch's tokens
    # sorted by expert, one grouped product), which takes no float64 (skipped there); DBRX's
    # experts take no implementation (its own loop over them)
    specs += [
        Spec(f"{n}-grouped", fam, hf(t, "causal", d, **o), m)
        for n, t, o, m in table
        if n != "dbrx"
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
