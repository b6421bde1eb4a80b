"""The shared tiny model zoo that tests run through fxpipe and compare with eager PyTorch.

- ``mlp_residual``: pre-LayerNorm residual MLP with GELU.
- ``resnet``: residual CNN with BatchNorm2d, strided blocks and 1x1 projection shortcuts.
- ``unet``: 3-level U-Net; long skips joined by ``torch.cat``; interpolate and
  ConvTranspose2d upsampling; GroupNorm.
- ``inception``: Inception-style blocks of four parallel branches joined by ``torch.cat``.
- ``transformer``: GPT-style decoder with a tied LM head, a keyword key-padding mask and
  position/causal-mask buffers.
- ``multi_io_dict`` / ``multi_io_tuple`` / ``multi_io_dataclass``: two positional tensors and
  a keyword-only tensor in; a dict, tuple or dataclass out.
- ``bn_dropout_buffers``: BatchNorm1d, Dropout, a buffer read in forward, in-place ops.
- ``export_only``: Python control flow on shapes; ``torch.fx`` cannot trace it,
  ``torch.export`` can.
- ``deep_mlp``: 24 residual blocks of very different widths (unequal cost per node).
- ``shared_module``: one block called at two depths (weights reused across the graph).
- ``routed_experts``: expert gates gathered per sample by a routing index from a stacked
  Parameter and applied blocks later (a value made from a Parameter alone crosses borders).
- ``shared_offsets``: every block's pre-activation offset by its own Parameter plus one
  Parameter all blocks share (gradients a split backward once counted several times).
- ``weight_for_dtype``: the output cast to the first layer's weight's dtype (that weight is
  read inside the first ``nn.Linear``'s call and at the end for its dtype alone).
- ``llama``: Llama-style decoder written the way Hugging Face models are (shapes unpacked
  from ``.shape``, so only ``torch.export`` traces it): rotary tables made once and read
  by every layer, grouped-query SDPA attention, SwiGLU, RMSNorm, an additive 4-D mask
  built from the padding mask, a dict output.

Every dropout is an ``nn.Dropout`` module, so ``train()``/``eval()`` on an fx-traced graph
still switches it. Graphs traced by ``torch.export`` freeze the train/eval mode they were
traced in, so ``export_only`` has no mode-dependent layers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

Example = tuple[tuple[Any, ...], dict[str, Any]]


@dataclass(frozen=True)
class Case:
    """One zoo model: how to build it, an example input, and what it exercises."""

    name: str
    build: Callable[[], nn.Module]  # same weights on every call
    example: Callable[[int], Example]  # batch size -> (args, kwargs), same on every call
    batch: int = 8
    max_stages: int = 4
    tracer: str = "fx"  # "fx": torch.fx.symbolic_trace works; "export": only torch.export
    kind: str = "chain"  # "chain" (residuals allowed) or "branchy" (wide parallel branches)
    tags: frozenset[str] = frozenset()


# ---------------------------------------------------------------------------- building blocks


class MLPBlock(nn.Module):
    """Pre-LN residual block: ``x + fc2(gelu(fc1(ln(x))))``."""

    def __init__(self, width: int, hidden: int, p: float = 0.0) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, hidden)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden, width)
        self.drop = nn.Dropout(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.fc2(self.act(self.fc1(self.norm(x)))))


class ConvBNReLU(nn.Module):
    """Conv2d without bias, BatchNorm2d, in-place ReLU."""

    def __init__(self, cin: int, cout: int, k: int, stride: int = 1) -> None:
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, k, stride, k // 2, bias=False)
        self.bn = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.relu(self.bn(self.conv(x)))


# ---------------------------------------------------------------------------- models


class ResidualMLP(nn.Module):
    """Input projection, pre-LN residual MLP blocks, final LayerNorm and head."""

    def __init__(self, d_in: int = 32, width: int = 64, depth: int = 6, d_out: int = 10) -> None:
        super().__init__()
        self.inp = nn.Linear(d_in, width)
        self.blocks = nn.ModuleList(MLPBlock(width, 2 * width) for _ in range(depth))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))


class BasicBlock(nn.Module):
    """ResNet basic block; a 1x1 strided projection when the shape changes."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.proj: nn.Module | None = None
        self.proj_bn: nn.Module | None = None
        if stride != 1 or cin != cout:
            self.proj = nn.Conv2d(cin, cout, 1, stride, bias=False)
            self.proj_bn = nn.BatchNorm2d(cout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        shortcut = x
        if self.proj is not None and self.proj_bn is not None:
            shortcut = self.proj_bn(self.proj(x))
        return self.relu(out + shortcut)


class ResNet(nn.Module):
    """Stem, three stages of two basic blocks (16/32/64 channels), pool, linear head."""

    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.stem = ConvBNReLU(3, 16, 3)
        plan = [(16, 16, 1), (16, 16, 1), (16, 32, 2), (32, 32, 1), (32, 64, 2), (64, 64, 1)]
        self.blocks = nn.ModuleList(BasicBlock(*p) for p in plan)
        self.fc = nn.Linear(64, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        for block in self.blocks:
            h = block(h)
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(h, 1), 1))


class DoubleConv(nn.Module):
    """Two 3x3 convolutions, each followed by GroupNorm and ReLU."""

    def __init__(self, cin: int, cout: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, padding=1)
        self.norm1 = nn.GroupNorm(4, cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1)
        self.norm2 = nn.GroupNorm(4, cout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.norm1(self.conv1(x)))
        return F.relu(self.norm2(self.conv2(x)))


class UNet(nn.Module):
    """U-Net over 32x32, 16x16 and 8x8; decoder levels concatenate the encoder's output."""

    def __init__(self, cin: int = 3, cout: int = 4) -> None:
        super().__init__()
        self.enc1 = DoubleConv(cin, 16)
        self.enc2 = DoubleConv(16, 32)
        self.mid = DoubleConv(32, 64)
        self.reduce = nn.Conv2d(64, 32, 1)
        self.dec2 = DoubleConv(64, 32)
        self.up1 = nn.ConvTranspose2d(32, 16, 2, stride=2)
        self.dec1 = DoubleConv(32, 16)
        self.head = nn.Conv2d(16, cout, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        e1 = self.enc1(x)
        e2 = self.enc2(F.max_pool2d(e1, 2))
        m = self.mid(F.max_pool2d(e2, 2))
        u2 = self.reduce(F.interpolate(m, scale_factor=2.0, mode="bilinear", align_corners=False))
        d2 = self.dec2(torch.cat([u2, e2], dim=1))
        d1 = self.dec1(torch.cat([self.up1(d2), e1], dim=1))
        return self.head(d1)


class InceptionBlock(nn.Module):
    """Branches 1x1 | 1x1-3x3 | 1x1-3x3-3x3 | maxpool-1x1, concatenated on channels."""

    def __init__(self, cin: int, c1: int, c3: int, c5: int, cp: int) -> None:
        super().__init__()
        self.b1 = ConvBNReLU(cin, c1, 1)
        self.b3_reduce = ConvBNReLU(cin, c3 // 2, 1)
        self.b3 = ConvBNReLU(c3 // 2, c3, 3)
        self.b5_reduce = ConvBNReLU(cin, c5 // 2, 1)
        self.b5_a = ConvBNReLU(c5 // 2, c5, 3)
        self.b5_b = ConvBNReLU(c5, c5, 3)
        self.bp = ConvBNReLU(cin, cp, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y1 = self.b1(x)
        y3 = self.b3(self.b3_reduce(x))
        y5 = self.b5_b(self.b5_a(self.b5_reduce(x)))
        yp = self.bp(F.max_pool2d(x, 3, stride=1, padding=1))
        return torch.cat([y1, y3, y5, yp], dim=1)


class Inception(nn.Module):
    """Stem, two Inception blocks at 16x16, max-pool, one at 8x8, pool, linear head."""

    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.stem = ConvBNReLU(3, 32, 3)
        self.block_a = InceptionBlock(32, 16, 24, 8, 8)  # -> 56 channels
        self.block_b = InceptionBlock(56, 24, 32, 16, 16)  # -> 88
        self.block_c = InceptionBlock(88, 32, 48, 16, 16)  # -> 112
        self.fc = nn.Linear(112, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.block_b(self.block_a(self.stem(x)))
        h = self.block_c(F.max_pool2d(h, 2))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(h, 1), 1))


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


@dataclass
class MultiOutput:
    """Dataclass output of ``multi_io_dataclass`` (registered as a pytree for torch.export)."""

    logits: torch.Tensor
    aux: torch.Tensor


torch.export.register_dataclass(MultiOutput, serialized_type_name=f"{__name__}.MultiOutput")


class MultiIO(nn.Module):
    """Two positional inputs and a keyword-only scale; ``aux`` comes from an early layer."""

    def __init__(self, out: str = "dict", width: int = 32, depth: int = 4) -> None:
        super().__init__()
        self.out = out
        self.enc_x = nn.Linear(16, width)
        self.enc_y = nn.Linear(8, width)
        self.aux_head = nn.Linear(width, 4)
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.head = nn.Linear(width, 10)

    def forward(
        self, x: torch.Tensor, y: torch.Tensor, *, scale: torch.Tensor | None = None
    ) -> Any:
        hx = F.gelu(self.enc_x(x))
        hy = F.gelu(self.enc_y(y))
        aux = self.aux_head(hy)
        h = hx * torch.sigmoid(hy)
        for layer in self.layers:
            h = h + torch.tanh(layer(h))
        if scale is not None:  # identity test: traces, as for TinyGPT's mask
            h = h * scale
        logits = self.head(h)
        if self.out == "dict":
            return {"logits": logits, "aux": aux}
        if self.out == "tuple":
            return logits, aux
        return MultiOutput(logits=logits, aux=aux)


class BNDropoutBuffers(nn.Module):
    """BatchNorm1d, Dropout, a fixed per-feature scale buffer and in-place ops per block."""

    def __init__(self, d_in: int = 24, width: int = 64, blocks: int = 4, p: float = 0.2) -> None:
        super().__init__()
        self.inp = nn.Linear(d_in, width)
        self.fcs = nn.ModuleList(nn.Linear(width, width) for _ in range(blocks))
        self.bns = nn.ModuleList(nn.BatchNorm1d(width) for _ in range(blocks))
        self.drop = nn.Dropout(p)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, width))
        self.head = nn.Linear(width, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for fc, bn in zip(self.fcs, self.bns, strict=True):
            residual = h
            h = bn(fc(h))
            h.relu_()  # result unused: only the mutation carries it (fx keeps no data edge)
            h = self.drop(h) * self.scale
            h += residual  # eager adds in place; fx records an out-of-place add
        return self.head(h)


class WindowMixer(nn.Module):
    """Pads a (B, T, F) sequence to whole windows, pools each window, mixes the windows.

    The shape check, the padding decision and the loop over windows are Python control flow
    on tensor shapes: torch.fx cannot trace them; torch.export specialises them to the
    example's T and F and keeps the batch dimension dynamic.
    """

    def __init__(
        self, features: int = 16, width: int = 32, window: int = 4, windows: int = 3
    ) -> None:
        super().__init__()
        self.features, self.window = features, window
        self.inp = nn.Linear(features, width)
        self.blocks = nn.ModuleList(MLPBlock(width, 2 * width) for _ in range(3))
        self.head = nn.Linear(windows * width, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.features:
            raise ValueError(f"expected {self.features} features, got {x.shape[-1]}")
        if x.shape[1] % self.window:
            x = F.pad(x, (0, 0, 0, self.window - x.shape[1] % self.window))
        h = self.inp(x)
        pooled = [h[:, i : i + self.window].mean(1) for i in range(0, h.shape[1], self.window)]
        h = torch.stack(pooled, dim=1)
        for block in self.blocks:
            h = block(h)
        return self.head(h.flatten(1))


# Hidden widths of deep_mlp's blocks: 32, 1024, 256, 64, 2048, 512, 128, 32, ... (period 7),
# so that cutting the graph into equal node counts gives unequal stage costs.
DEEP_WIDTHS = tuple(32 << ((5 * i) % 7) for i in range(24))


class DeepMLP(nn.Module):
    """24 pre-LN residual blocks of width 128 whose hidden widths vary from 32 to 2048."""

    def __init__(self, d_in: int = 32, width: int = 128, d_out: int = 10) -> None:
        super().__init__()
        self.inp = nn.Linear(d_in, width)
        self.blocks = nn.ModuleList(MLPBlock(width, w) for w in DEEP_WIDTHS)
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))


class SharedBlockNet(nn.Module):
    """``shared`` runs at depth 1 and again at depth 4: one set of weights, two graph places."""

    def __init__(self, d_in: int = 20, width: int = 48) -> None:
        super().__init__()
        self.inp = nn.Linear(d_in, width)
        self.shared = MLPBlock(width, 2 * width)
        self.a = MLPBlock(width, 2 * width)
        self.b = MLPBlock(width, 2 * width)
        self.c = MLPBlock(width, 2 * width)
        self.head = nn.Linear(width, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.shared(self.inp(x))
        h = self.shared(self.b(self.a(h)))
        return self.head(self.c(h))


class RoutedExperts(nn.Module):
    """Experts as Mixtral's batched kernel writes them: each sample's expert gates gathered
    from a stacked Parameter by its top routing index (no gradient through the index; the
    router learns through the top weight) five blocks before they are applied, so the
    gathered gates, made from the Parameter alone, are a value that crosses stage borders
    (smaller than the router's input, so the split sends them rather than computing them
    late)."""

    def __init__(self, width: int = 32, experts: int = 4, depth: int = 8) -> None:
        super().__init__()
        self.inp = nn.Linear(width, width)
        self.router = nn.Linear(width, experts)
        self.gates = nn.Parameter(torch.randn(experts, width // 4))
        self.blocks = nn.ModuleList(MLPBlock(width, 2 * width) for _ in range(depth))
        self.head = nn.Linear(width, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks[:3]:
            h = block(h)
        weight, index = self.router(h).softmax(-1).max(-1)  # the router learns by weight
        chosen = self.gates[index]  # (batch, width / 4), from the Parameter alone
        for block in self.blocks[3:]:
            h = block(h)
        return self.head(h * torch.sigmoid(chosen).repeat(1, 4) * weight.unsqueeze(-1))


class SharedOffsets(nn.Module):
    """Residual blocks whose hidden pre-activations get a per-block offset plus one offset
    shared by every block (``fc1(h) + (offsets[k] + shared)``), the per-block Parameters
    registered first: torch's split backward once grouped such Parameters so that the
    zero-bubble schedules counted their gradients several times over, silently (additions
    save no tensors, so nothing crashed)."""

    def __init__(self, width: int = 32, hidden: int = 48, depth: int = 8) -> None:
        super().__init__()
        self.inp = nn.Linear(width, width)
        self.norms = nn.ModuleList(nn.LayerNorm(width) for _ in range(depth))
        self.fc1 = nn.ModuleList(nn.Linear(width, hidden) for _ in range(depth))
        self.fc2 = nn.ModuleList(nn.Linear(hidden, width) for _ in range(depth))
        self.offsets = nn.ParameterList(
            nn.Parameter(0.1 * torch.randn(hidden)) for _ in range(depth)
        )
        self.shared = nn.Parameter(0.1 * torch.randn(hidden))
        self.head = nn.Linear(width, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for norm, fc1, fc2, offset in zip(self.norms, self.fc1, self.fc2, self.offsets):
            h = h + fc2(F.gelu(fc1(norm(h)) + (offset + self.shared)))
        return self.head(h)


class WeightForDtype(nn.Module):
    """The last layer casts to the first layer's weight's dtype, as Hugging Face code does
    (``x.to(self.embed.weight.dtype)``): that weight is read inside its module's call and,
    at the end, directly for its dtype alone (one process per stage: the last stage holds a
    copy, which gets no gradient there)."""

    def __init__(self, width: int = 32, depth: int = 6) -> None:
        super().__init__()
        self.first = nn.Linear(width, width)
        self.blocks = nn.Sequential(*(MLPBlock(width, 2 * width) for _ in range(depth)))
        self.head = nn.Linear(width, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.blocks(self.first(x))
        return self.head(h).to(self.first.weight.dtype)


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


# ---------------------------------------------------------------------------- cases


class FixedRows(nn.Module):
    """Not in the zoo, which runs any batch size: a batch size written into the model,
    ``reshape(rows, 2, width)`` of the hidden rows, so it runs batches of ``rows`` rows only
    (``width`` features in, ``out`` out)."""

    def __init__(self, rows: int = 6, width: int = 4, out: int = 2) -> None:
        super().__init__()
        self.rows, self.width = rows, width
        self.a = nn.Linear(width, 2 * width)
        self.b = nn.Linear(width, out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x).reshape(self.rows, 2, self.width).sum(1))


class LocalConvBlock(nn.Module):
    """TinyViT's block tail on ``(B, H, W, C)`` tokens: a depthwise convolution with
    BatchNorm over them as an image, back to tokens (a transposed view) plus an MLP of
    them, returned as a view ``(B, H, W, C)`` whose strides are not a contiguous tensor's."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(dim, dim, 3, padding=1, groups=dim, bias=False)
        self.bn = nn.BatchNorm2d(dim)
        self.mlp = nn.Sequential(
            nn.LayerNorm(dim), nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, h, w, c = x.shape
        t = self.bn(self.conv(x.permute(0, 3, 1, 2)))
        t = t.reshape(b, c, h * w).transpose(1, 2)
        t = t + self.mlp(t)
        return t.view(b, h, w, c)


class LocalConvTokens(nn.Module):
    """Not in the zoo (BatchNorm in training mode, so eager's oracle runs per micro-batch):
    a patch embedding, ``depth`` :class:`LocalConvBlock` s and a pooled head. Each block hands
    the next a strided view; with one-sample micro-batches its size-1 batch dimension has a
    stride no contiguous tensor has (TinyViT's layout, which torch's CPU BatchNorm backward
    answers wrongly for when the gradient arrives contiguous)."""

    def __init__(self, dim: int = 16, depth: int = 4) -> None:
        super().__init__()
        self.embed = nn.Conv2d(3, dim, 2, stride=2)
        self.blocks = nn.Sequential(*(LocalConvBlock(dim) for _ in range(depth)))
        self.head = nn.Linear(dim, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = self.embed(x).permute(0, 2, 3, 1)
        return self.head(self.blocks(tokens).mean((1, 2)))


def _seeded(factory: Callable[[], nn.Module]) -> Callable[[], nn.Module]:
    """Wrap ``factory`` so that it builds under seed 0, leaving the caller's RNG untouched."""

    def build() -> nn.Module:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            return factory()

    return build


def _gen() -> torch.Generator:
    return torch.Generator().manual_seed(1234)


def _randn(*shape: int) -> Callable[[int], Example]:
    """Example of one float tensor of shape (batch, *shape)."""
    return lambda b: ((torch.randn(b, *shape, generator=_gen()),), {})


def _multi_io_example(b: int) -> Example:
    g = _gen()
    x, y = torch.randn(b, 16, generator=g), torch.randn(b, 8, generator=g)
    return (x, y), {"scale": torch.rand(b, 1, generator=g) + 0.5}


def _gpt_example(b: int, t: int = 16) -> Example:
    g = _gen()
    idx = torch.randint(0, 64, (b, t), generator=g)
    lengths = t - torch.randint(0, t // 2, (b,), generator=g)
    lengths[0] = t - 3  # at least one padded sequence at every batch size
    mask = (torch.arange(t)[None, :] < lengths[:, None]).float()
    return (idx,), {"attention_mask": mask}


def _t(*tags: str) -> frozenset[str]:
    return frozenset(tags)


_CASES = [
    Case("mlp_residual", _seeded(ResidualMLP), _randn(32), max_stages=6),
    Case("resnet", _seeded(ResNet), _randn(3, 16, 16), max_stages=6, tags=_t("batchnorm")),
    Case("unet", _seeded(UNet), _randn(3, 32, 32), max_stages=4, kind="branchy"),
    Case(
        "inception",
        _seeded(Inception),
        _randn(3, 16, 16),
        kind="branchy",
        tags=_t("batchnorm"),
    ),
    Case(
        "transformer",
        _seeded(TinyGPT),
        _gpt_example,
        max_stages=8,
        tags=_t("tied", "kwargs", "transformer", "dropout", "buffers"),
    ),
    Case(
        "multi_io_dict",
        _seeded(lambda: MultiIO("dict")),
        _multi_io_example,
        tags=_t("kwargs", "dict_out"),
    ),
    Case(
        "multi_io_tuple",
        _seeded(lambda: MultiIO("tuple")),
        _multi_io_example,
        tags=_t("kwargs", "tuple_out"),
    ),
    Case(
        "multi_io_dataclass",
        _seeded(lambda: MultiIO("dataclass")),
        _multi_io_example,
        tags=_t("kwargs", "dataclass_out"),
    ),
    Case(
        "bn_dropout_buffers",
        _seeded(BNDropoutBuffers),
        _randn(24),
        tags=_t("batchnorm", "dropout", "buffers", "inplace"),
    ),
    Case("export_only", _seeded(WindowMixer), _randn(10, 16), tracer="export"),
    Case("deep_mlp", _seeded(DeepMLP), _randn(32), max_stages=8),
    Case("shared_module", _seeded(SharedBlockNet), _randn(20), tags=_t("shared")),
    Case("routed_experts", _seeded(RoutedExperts), _randn(32)),
    Case("weight_for_dtype", _seeded(WeightForDtype), _randn(32)),
    Case("shared_offsets", _seeded(SharedOffsets), _randn(32)),
    Case(
        "llama",
        _seeded(TinyLlama),
        _gpt_example,
        max_stages=8,
        tracer="export",
        tags=_t("kwargs", "dict_out", "transformer", "buffers"),
    ),
]

ZOO: dict[str, Case] = {case.name: case for case in _CASES}

#: The zoo models the quick subset (``pytest -m "not slow"``) sweeps: between them kwargs, a
#: dict output, BatchNorm, dropout, buffers, in-place ops, a shared module and torch.export.
#: A test given any other zoo model as a parameter (its Case or its name) is marked ``slow``
#: (tests/conftest.py).
QUICK_MODELS = frozenset({"multi_io_dict", "bn_dropout_buffers", "shared_module", "export_only"})


def cases(*, tag: str | None = None, tracer: str | None = None) -> list[Case]:
    """Zoo cases in definition order, optionally only those with ``tag`` / ``tracer``."""
    return [
        c
        for c in ZOO.values()
        if (tag is None or tag in c.tags) and (tracer is None or c.tracer == tracer)
    ]
