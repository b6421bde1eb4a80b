"""The zoo's fully connected models: residual MLPs, several inputs and outputs, BatchNorm
with dropout and buffers, a shape-dependent mixer only torch.export traces, shared blocks,
routed experts, shared offsets, a dtype read off a weight; and a model that runs one batch
size only."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


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
