"""The sweeps' Hugging Face text models: decoders, encoders and encoder-decoders from small
configs (nothing downloaded), and the builder every transformers entry uses."""

from __future__ import annotations

from typing import Any

from benchmarks.harness.models.spec import (
    Args,
    Built,
    Kwargs,
    Spec,
    images,
    padding_mask,
    token_ids,
)

__all__ = ["VOCAB", "DECODER", "ENCODER", "SEQ2SEQ", "T5", "OMIT", "LENGTH", "decoder_length",
           "HfBuild", "hf", "hf_text_specs"]  # fmt: skip

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


#: The example's sequence length; the decoder's is 7 of it (``decoder_length``).
LENGTH = 12


def decoder_length(length: int) -> int:
    """An encoder-decoder's decoder sequence for an encoder sequence of ``length`` (7 of 12)."""
    return max(2, length * 7 // LENGTH)


def _text_inputs(kind: str, vocab: int, length: int = LENGTH) -> tuple[Args, Kwargs]:
    ids = token_ids(vocab, length=length)
    if kind == "ids":
        return (ids,), {}
    kwargs: Kwargs = {"attention_mask": padding_mask(length=length)}
    if kind == "seq2seq":
        kwargs["decoder_input_ids"] = token_ids(vocab, length=decoder_length(length))
    return (ids,), kwargs


class HfBuild:
    """A builder for a transformers model from a small config (``inputs``: text, ids, seq2seq,
    image or image:SIZE): called, the model (every dropout at zero unless ``dropout``) and its
    example; ``inputs(length)``, a text model's example at another sequence length."""

    def __init__(self, model_type: str, head: str, base: Kwargs, inputs: str, over: Kwargs):
        self.model_type, self.head, self.kind = model_type, head, inputs
        self.options = {k: v for k, v in {**base, **over}.items() if v != OMIT}
        self.image_size = int(inputs.split(":")[1]) if ":" in inputs else base.get("image_size")

    @property
    def text(self) -> bool:
        """Does the model take token ids whose dim 1 is the sequence?"""
        return self.kind in ("text", "ids", "seq2seq")

    def inputs(self, length: int = LENGTH) -> tuple[Args, Kwargs]:
        """The example batch; for a text model, with every sequence at ``length``."""
        if not self.text:
            return images(int(self.image_size or 32)), {}
        return _text_inputs(self.kind, int(self.options.get("vocab_size", VOCAB)), length)

    def __call__(self, dropout: bool = False) -> Built:
        import transformers

        config = transformers.AutoConfig.for_model(self.model_type, **self.options)
        if not dropout:
            _zero_config_dropout(config)
        model = getattr(transformers, HEADS[self.head]).from_config(config)
        return model, *self.inputs()


def hf(model_type: str, head: str, base: Kwargs, inputs: str = "text", **over: Any) -> HfBuild:
    """A builder for a transformers model from a small config (``inputs``: text, ids, seq2seq,
    image or image:SIZE); ``build(dropout=True)`` keeps the config's dropout."""
    return HfBuild(model_type, head, base, inputs, over)


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
                                   encoder_layers=OMIT, decoder_layers=OMIT),
             # its masks are float32 (the default dtype) times float64's finfo.min: NaN
             default_double=True),
        Spec("fsmt", fam, hf("fsmt", "seq2seq", s, "seq2seq", langs=["en", "de"],
                             src_vocab_size=VOCAB, tgt_vocab_size=VOCAB)),
    ]  # fmt: skip
    return specs


def hf_text_specs() -> list[Spec]:
    """Every text model of the registry but the Mixture-of-Experts ones."""
    return _hf_decoders() + _hf_encoders() + _hf_seq2seq()
