"""The zoo's convolutional models: a ResNet, a U-Net and Inception-style blocks; and TinyViT's
block tail, whose strided token views the multi-process tests keep across sends."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class ConvBNReLU(nn.Module):
    """Conv2d without bias, BatchNorm2d, in-place ReLU."""

    def __init__(self, cin: int, cout: int, k: int, stride: int = 1) -> None:
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, k, stride, k // 2, bias=False)
        self.bn = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.relu(self.bn(self.conv(x)))


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
