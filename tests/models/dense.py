"""The zoo's fully connected models: residual MLPs, several inputs and outputs, BatchNorm
with dropout and buffers, a shape-dependent mixer only torch.export traces, shared blocks,
routed experts, shared offsets, a dtype read off a weight; and a model that runs one batch
size only."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks.harness.models.zoo_nets import MLPBlock

# Hidden widths of deep_mlp's blocks: 32, 1024, 256, 64, 2048, 512, 128, 32, ... (period 7),
# so that cutting the graph into equal node counts gives unequal stage costs.
DEEP_WIDTHS = tuple(32 << ((5 * i) % 7) for i in range(24))


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
