"""One model of the sweeps' registry (:class:`Spec`) and the inputs its builders make."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = ["Args", "Kwargs", "Built", "Spec", "BATCH", "images", "video", "token_ids",
           "padding_mask", "generator"]  # fmt: skip

Args = tuple[Any, ...]
Kwargs = dict[str, Any]
Built = tuple[nn.Module, Args, Kwargs]

#: Rows of an example batch, unless a model's entry says fewer.
BATCH = 8


@dataclass(frozen=True)
class Spec:
    """One model: its family, how to build it with inputs, and whether it mixes samples."""

    name: str
    family: str
    build: Callable[[], Built]
    #: "train": the model mixes samples in train mode only (found automatically for
    #: BatchNorm); "always": also in eval mode (capacity-limited expert routing).
    mixes: str = ""
    #: build and run with float64 as torch's default dtype (models whose code makes a
    #: float32 scalar out of torch.finfo(their own dtype).min, which overflows in float64)
    default_double: bool = False


def generator(seed: int) -> torch.Generator:
    """A CPU generator seeded with ``seed``: the same draws on every call."""
    return torch.Generator().manual_seed(seed)


def images(size: int = 64, batch: int = BATCH, channels: int = 3) -> Args:
    return (torch.randn(batch, channels, size, size, generator=generator(1)),)


def video(size: int = 32, frames: int = 8, batch: int = 4) -> Args:
    return (torch.randn(batch, 3, frames, size, size, generator=generator(2)),)


def token_ids(vocab: int, length: int = 12, batch: int = BATCH, low: int = 3) -> torch.Tensor:
    return torch.randint(low, vocab, (batch, length), generator=generator(3))


def padding_mask(batch: int = BATCH, length: int = 12) -> torch.Tensor:
    """All ones but sequence 1, right-padded after two thirds of its tokens (8 of 12)."""
    mask = torch.ones(batch, length, dtype=torch.long)
    mask[1, max(1, 2 * length // 3) :] = 0
    return mask
