"""The GPU benchmark's sizes (on a GPU, and in a dry run on the CPU), stages and micro-batches,
and its model."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from benchmarks.harness.mlp import residual_mlp
from benchmarks.harness.output import result_path

DEFAULT_OUT = result_path("gpu")
STAGES = 4
CHUNKS = 8
MODES = ("never", "except_last", "always")
MIB = 1024.0 * 1024.0


@dataclass(frozen=True)
class Sizes:
    """(batch, width, hidden, depth) of each section's residual MLP, and repeats."""

    step: tuple[int, int, int, int]
    memory: tuple[int, int, int, int]
    stage: tuple[int, int, int, int]
    rounds: int
    stage_repeats: int
    overlap_repeats: int


GPU_SIZES = Sizes(
    step=(4096, 1024, 4096, 8),  # ~1.6 TFLOP per step
    memory=(8192, 512, 2048, 32),  # activations ~10x the parameters
    stage=(4096, 1024, 4096, 8),
    rounds=15,
    stage_repeats=20,
    overlap_repeats=10,
)
DRY_SIZES = Sizes(
    step=(64, 32, 64, 4),
    memory=(2048, 32, 64, 8),
    stage=(64, 32, 64, 4),
    rounds=3,
    stage_repeats=3,
    overlap_repeats=2,
)


def make_model(
    shape: tuple[int, int, int, int], device: torch.device
) -> tuple[nn.Module, torch.Tensor]:
    batch, width, hidden, depth = shape
    model = residual_mlp(width, hidden, depth).to(device)
    return model, torch.randn(batch, width, device=device)
