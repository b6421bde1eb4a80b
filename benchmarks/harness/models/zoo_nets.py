"""The vision and MLP models of the partition benchmark and of the tests' zoo (one copy).

Residual MLPs, a ResNet, a U-Net, Inception blocks, multi-input/multi-output nets, BatchNorm
with dropout and buffers, a window mixer only ``torch.export`` traces, a deep MLP of unequal
widths and one block called at two depths. The tests' zoo (``tests/models``) imports them
and adds models of its own; a change here changes the benchmark's rows and the tests alike,
so a model that needs to differ gets a new class.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "MLPBlock",
    "ResidualMLP",
    "ResNet",
    "UNet",
    "Inception",
    "MultiOutput",
    "MultiIO",
    "BNDropoutBuffers",
    "WindowMixer",
    "DeepMLP",
    "SharedBlockNet",
]

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
