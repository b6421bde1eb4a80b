"""The zoo's convolutional models: a ResNet, a U-Net and Inception-style blocks; and TinyViT's
block tail, whose strided token views the multi-process tests keep across sends."""

from __future__ import annotations

import torch
from torch import nn


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
