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

Most models are the partition benchmark's too, defined once in ``benchmarks.harness.models``
(``zoo_nets``, ``zoo_lm``); those only the tests run are in ``models.dense`` and
``models.conv``. This module makes them cases (``ZOO``, ``QUICK_MODELS``, ``cases``) and is
what tests import.

Every dropout is an ``nn.Dropout`` module, so ``train()``/``eval()`` on an fx-traced graph
still switches it. Graphs traced by ``torch.export`` freeze the train/eval mode they were
traced in, so ``export_only`` has no mode-dependent layers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from benchmarks.harness.models.zoo_lm import TinyGPT, TinyLlama
from benchmarks.harness.models.zoo_nets import (
    BNDropoutBuffers,
    DeepMLP,
    Inception,
    MultiIO,
    ResidualMLP,
    ResNet,
    SharedBlockNet,
    UNet,
    WindowMixer,
)
from models.conv import LocalConvBlock, LocalConvTokens
from models.dense import FixedRows, RoutedExperts, SharedOffsets, WeightForDtype

__all__ = [
    "QUICK_MODELS",
    "ZOO",
    "Case",
    "Example",
    "FixedRows",
    "LocalConvBlock",
    "LocalConvTokens",
    "ResidualMLP",
    "TinyGPT",
    "cases",
]

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
