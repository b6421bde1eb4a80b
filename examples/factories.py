"""Model factories for ``fxpipe inspect``: each function takes no argument and returns a model.

    fxpipe inspect examples/factories.py:unet --shape 8,3,64,64 --devices cpu,cpu,cpu,cpu
    fxpipe inspect examples/factories.py:gpt --input "torch.randint(0, 256, (8, 64))" \\
        --devices cpu,cpu,cpu,cpu --html report.html --run
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class DoubleConv(nn.Module):
    """Two 3x3 convolutions, each followed by GroupNorm and ReLU."""

    def __init__(self, cin: int, cout: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, padding=1)
        self.norm1 = nn.GroupNorm(8, cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1)
        self.norm2 = nn.GroupNorm(8, cout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.norm1(self.conv1(x)))
        return F.relu(self.norm2(self.conv2(x)))


class UNet(nn.Module):
    """Four-level U-Net: every encoder level's output skips across to its decoder level."""

    def __init__(self, cin: int = 3, classes: int = 4, width: int = 16) -> None:
        super().__init__()
        w = [width * 2**k for k in range(4)]
        self.down = nn.ModuleList(
            [DoubleConv(cin, w[0])] + [DoubleConv(w[k], w[k + 1]) for k in range(3)]
        )
        self.up = nn.ModuleList(nn.ConvTranspose2d(w[k + 1], w[k], 2, stride=2) for k in range(3))
        self.dec = nn.ModuleList(DoubleConv(2 * w[k], w[k]) for k in range(3))
        self.head = nn.Conv2d(w[0], classes, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skips = []
        for k, block in enumerate(self.down):
            x = block(x if k == 0 else F.max_pool2d(x, 2))
            skips.append(x)
        x = skips.pop()
        for k in reversed(range(3)):
            x = self.dec[k](torch.cat([self.up[k](x), skips[k]], dim=1))
        return self.head(x)


class Block(nn.Module):
    """Pre-LN transformer block with causal self-attention."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(width)
        self.attn = nn.MultiheadAttention(width, heads, batch_first=True)
        self.ln2 = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, 4 * width)
        self.fc2 = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class GPT(nn.Module):
    """Small GPT: token and position embeddings, causal blocks, a head tied to the embedding."""

    def __init__(
        self,
        vocab: int = 256,
        width: int = 128,
        heads: int = 4,
        layers: int = 6,
        max_len: int = 128,
    ) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, width)
        self.pos = nn.Embedding(max_len, width)
        mask = torch.full((max_len, max_len), float("-inf")).triu(1)
        self.register_buffer("mask", mask, persistent=False)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.tok.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        positions = torch.arange(t, device=idx.device)
        mask = self.mask.narrow(0, 0, t).narrow(1, 0, t)
        h = self.tok(idx) + self.pos(positions)
        for block in self.blocks:
            h = block(h, mask)
        return self.head(self.ln(h))


def unet() -> nn.Module:
    """U-Net for 3-channel images whose sides are a multiple of 8 (e.g. --shape 8,3,64,64)."""
    torch.manual_seed(0)
    return UNet()


def gpt() -> nn.Module:
    """GPT over 256 tokens (e.g. --input "torch.randint(0, 256, (8, 64))")."""
    torch.manual_seed(0)
    return GPT()
