"""The language models of the partition benchmark and of the tests' zoo (``transformer`` and
``llama`` there): a GPT with a tied LM head and a keyword padding mask, and a Llama written
the way Hugging Face models are (rotary tables, grouped-query attention, SwiGLU, RMSNorm).
One copy, as for ``zoo_nets``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks.harness.models.zoo_nets import MLPBlock

__all__ = ["TinyGPT", "TinyLlama"]


class SelfAttention(nn.Module):
    """Multi-head self-attention by matmul and softmax; masked keys get a large negative."""

    def __init__(self, width: int, heads: int, p: float) -> None:
        super().__init__()
        self.heads = heads
        self.scale = (width // heads) ** -0.5
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.attn_drop = nn.Dropout(p)
        self.resid_drop = nn.Dropout(p)

    def forward(self, x: torch.Tensor, blocked: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape[0], x.shape[1], x.shape[2]
        qkv = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]
        scores = (q @ k.transpose(-2, -1)) * self.scale
        probs = self.attn_drop(torch.softmax(scores.masked_fill(blocked, -1e4), dim=-1))
        y = (probs @ v).transpose(1, 2).reshape(b, t, d)
        return self.resid_drop(self.proj(y))


class DecoderBlock(nn.Module):
    """Pre-LN transformer block: attention then MLP, each on a residual."""

    def __init__(self, width: int, heads: int, p: float) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(width)
        self.attn = SelfAttention(width, heads, p)
        self.mlp = MLPBlock(width, 4 * width, p)

    def forward(self, x: torch.Tensor, blocked: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x), blocked)
        return self.mlp(x)


class TinyGPT(nn.Module):
    """GPT-style decoder; the LM head's weight is the token embedding's weight."""

    def __init__(
        self,
        vocab: int = 64,
        width: int = 32,
        heads: int = 4,
        layers: int = 4,
        max_len: int = 32,
        p: float = 0.1,
    ) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, width)
        self.pos = nn.Embedding(max_len, width)
        self.register_buffer("pos_ids", torch.arange(max_len), persistent=False)
        self.register_buffer("causal", torch.ones(max_len, max_len, dtype=torch.bool).tril())
        self.drop = nn.Dropout(p)
        self.blocks = nn.ModuleList(DecoderBlock(width, heads, p) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.tok.weight

    def forward(
        self, idx: torch.Tensor, attention_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        # An identity test, not a tensor test: torch.fx traces it, and a traced graph always
        # takes the mask (the examples pass it), while eager calls may leave it out.
        if attention_mask is None:
            attention_mask = torch.ones_like(idx)
        t = idx.shape[1]  # narrow, not slicing: a buffer sliced by a traced size breaks fx
        causal = self.causal.narrow(0, 0, t).narrow(1, 0, t)
        keep = causal & (attention_mask != 0)[:, None, None, :]
        blocked = ~keep  # (B, 1, T, T); True where a query may not see a key
        h = self.drop(self.tok(idx) + self.pos(self.pos_ids.narrow(0, 0, t)))
        for block in self.blocks:
            h = block(h, blocked)
        return self.head(self.ln_f(h))


class RMSNorm(nn.Module):
    """Root-mean-square norm with a learned scale (no mean subtraction, no bias)."""

    def __init__(self, width: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        variance = x.pow(2).mean(-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(variance + self.eps))


class RotaryEmbedding(nn.Module):
    """cos/sin tables of rotary position embeddings for the given positions."""

    def __init__(self, dim: int, base: float = 10000.0) -> None:
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2).float() / dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(
        self, x: torch.Tensor, position_ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids[:, :, None].float() * self.inv_freq[None, None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class LlamaAttention(nn.Module):
    """Grouped-query attention with rotary embeddings and an additive 4-D mask, written the
    way Hugging Face models are: shapes unpacked from ``.shape``, SDPA for the kernel."""

    def __init__(self, width: int, heads: int, kv_heads: int) -> None:
        super().__init__()
        self.head_dim = width // heads
        self.groups = heads // kv_heads
        self.q_proj = nn.Linear(width, heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(width, kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(width, kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(heads * self.head_dim, width, bias=False)

    def forward(
        self,
        hidden_states: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attention_mask: torch.Tensor,
    ) -> torch.Tensor:
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)  # unpacks a shape: fx cannot trace
        q = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        k = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        v = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        k = k.repeat_interleave(self.groups, dim=1)
        v = v.repeat_interleave(self.groups, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask)
        return self.o_proj(out.transpose(1, 2).reshape(*input_shape, -1))


class LlamaMLP(nn.Module):
    """SwiGLU feed-forward: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(width, hidden, bias=False)
        self.up_proj = nn.Linear(width, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaLayer(nn.Module):
    """Pre-norm decoder layer: RMSNorm, attention, residual; RMSNorm, SwiGLU, residual."""

    def __init__(self, width: int, heads: int, kv_heads: int, hidden: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(width)
        self.self_attn = LlamaAttention(width, heads, kv_heads)
        self.post_attention_layernorm = RMSNorm(width)
        self.mlp = LlamaMLP(width, hidden)

    def forward(
        self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, mask)
        return h + self.mlp(self.post_attention_layernorm(h))


class TinyLlama(nn.Module):
    """Llama-style causal LM: rotary tables made once and read by every layer (the case
    that makes torch's pipelining outline the rotary nodes twice), grouped-query
    attention, SwiGLU, RMSNorm, a padding mask turned into an additive 4-D float mask, and
    a dict output in the shape of a Hugging Face ``ModelOutput``."""

    def __init__(
        self,
        vocab: int = 64,
        width: int = 32,
        heads: int = 4,
        kv_heads: int = 2,
        layers: int = 3,
        hidden: int = 64,
    ) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, width)
        self.rotary_emb = RotaryEmbedding(width // heads)
        self.layers = nn.ModuleList(
            LlamaLayer(width, heads, kv_heads, hidden) for _ in range(layers)
        )
        self.norm = RMSNorm(width)
        self.lm_head = nn.Linear(width, vocab, bias=False)

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None
    ) -> dict[str, torch.Tensor]:
        batch, length = input_ids.shape
        h = self.embed_tokens(input_ids)
        position_ids = torch.arange(length, device=input_ids.device).unsqueeze(0)
        position_ids = position_ids.expand(batch, -1)
        cos, sin = self.rotary_emb(h, position_ids)
        causal = torch.ones(length, length, dtype=torch.bool, device=h.device).triu(1)
        blocked = causal[None, None, :, :]
        if attention_mask is not None:
            blocked = blocked | (attention_mask[:, None, None, :] == 0)
        mask = torch.zeros(blocked.shape, dtype=h.dtype, device=h.device)
        mask = mask.masked_fill(blocked, torch.finfo(h.dtype).min)
        for layer in self.layers:
            h = layer(h, cos, sin, mask)
        h = self.norm(h)
        return {"logits": self.lm_head(h), "last_hidden_state": h}
