"""Hugging Face models at their published sizes, for building on ``meta``: Llama-7B,
Llama-70B, GPT-2 XL."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

__all__ = ["llama_7b", "llama_70b", "gpt2_xl", "GIANTS"]


def llama_7b() -> nn.Module:
    """Llama-7B's shape (32 layers of width 4,096, a 32,000-token vocabulary), no cache."""
    import transformers

    config = transformers.LlamaConfig(
        num_hidden_layers=32, hidden_size=4096, intermediate_size=11008,
        num_attention_heads=32, num_key_value_heads=32, vocab_size=32000,
        max_position_embeddings=4096, use_cache=False,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config)


def llama_70b() -> nn.Module:
    """Llama-2-70B's shape (80 layers of width 8,192, 64 query heads sharing 8 key-value
    heads, an MLP of 28,672, a 32,000-token vocabulary), no cache."""
    import transformers

    config = transformers.LlamaConfig(
        num_hidden_layers=80, hidden_size=8192, intermediate_size=28672,
        num_attention_heads=64, num_key_value_heads=8, vocab_size=32000,
        max_position_embeddings=4096, use_cache=False,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config)


def gpt2_xl() -> nn.Module:
    """GPT-2 XL's shape (48 layers of width 1,600, a 50,257-token vocabulary), no cache."""
    import transformers

    config = transformers.GPT2Config(
        n_layer=48, n_embd=1600, n_head=25, vocab_size=50257, n_positions=1024,
        use_cache=False,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(config)


#: name -> (build, vocabulary size).
GIANTS: dict[str, tuple[Callable[[], nn.Module], int]] = {
    "llama-7b": (llama_7b, 32000),
    "llama-70b": (llama_70b, 32000),
    "gpt2-xl": (gpt2_xl, 50257),
}
