"""The partition benchmark's zoo: 13 small models with their examples, at the tests' sizes and
at benchmark sizes (``BENCH_SIZE``), where arithmetic rather than per-operator overhead sets
node times."""

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

__all__ = ["Case", "ZOO", "BENCH_SIZE", "HETEROGENEOUS", "benchmark_models"]

Example = tuple[tuple[Any, ...], dict[str, Any]]
Built = tuple[nn.Module, tuple[Any, ...], dict[str, Any]]


@dataclass(frozen=True)
class Case:
    """One zoo model: how to build it, an example input, and what kind of graph it is."""

    name: str
    build: Callable[[], nn.Module]  # same weights on every call
    example: Callable[[int], Example]  # batch size -> (args, kwargs), same on every call
    batch: int = 8
    tracer: str = "fx"  # "fx": torch.fx.symbolic_trace works; "export": only torch.export
    kind: str = "chain"  # "chain" (residuals allowed) or "branchy" (wide parallel branches)


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


_CASES = [
    Case("mlp_residual", _seeded(ResidualMLP), _randn(32)),
    Case("resnet", _seeded(ResNet), _randn(3, 16, 16)),
    Case("unet", _seeded(UNet), _randn(3, 32, 32), kind="branchy"),
    Case("inception", _seeded(Inception), _randn(3, 16, 16), kind="branchy"),
    Case("transformer", _seeded(TinyGPT), _gpt_example),
    Case("multi_io_dict", _seeded(lambda: MultiIO("dict")), _multi_io_example),
    Case("multi_io_tuple", _seeded(lambda: MultiIO("tuple")), _multi_io_example),
    Case("multi_io_dataclass", _seeded(lambda: MultiIO("dataclass")), _multi_io_example),
    Case("bn_dropout_buffers", _seeded(BNDropoutBuffers), _randn(24)),
    Case("export_only", _seeded(WindowMixer), _randn(10, 16), tracer="export"),
    Case("deep_mlp", _seeded(DeepMLP), _randn(32)),
    Case("shared_module", _seeded(SharedBlockNet), _randn(20)),
    Case("llama", _seeded(TinyLlama), _gpt_example, tracer="export"),
]

ZOO: dict[str, Case] = {case.name: case for case in _CASES}


# ---------------------------------------------------------------------------- benchmark sizes


def gpt_example(
    vocab: int = 16384, width: int = 256, heads: int = 4, layers: int = 12, seq: int = 128
) -> Callable[[], Built]:
    """The zoo's GPT in GPT-2 small's proportions (12 layers, 64-wide heads, a vocabulary
    64x the width, so that the tied LM head costs about as much as five blocks) at width 256,
    batch 8 of 128 tokens with padding."""

    def build() -> Built:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            model = TinyGPT(vocab=vocab, width=width, heads=heads, layers=layers, max_len=seq)
        return model, *_token_batch(vocab, seq)

    return build


def llama_example(
    vocab: int = 4096, width: int = 256, heads: int = 4, layers: int = 8, seq: int = 128
) -> Callable[[], Built]:
    """The zoo's Llama in Llama-2's proportions (64-wide heads, grouped-query attention
    with half as many key/value heads, a SwiGLU hidden width 2.7x the width, a vocabulary
    16x the width) at width 256, batch 8 of 128 tokens with padding."""

    def build() -> Built:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            model = TinyLlama(vocab, width, heads, heads // 2, layers, hidden=688)
        return model, *_token_batch(vocab, seq)

    return build


def _token_batch(vocab: int, seq: int, batch: int = 8) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Token ids and a right-padding mask (every sequence keeps at least 3/4 of ``seq``)."""
    gen = torch.Generator().manual_seed(1234)
    idx = torch.randint(0, vocab, (batch, seq), generator=gen)
    lengths = seq - torch.randint(0, seq // 4, (batch,), generator=gen)
    mask = (torch.arange(seq)[None, :] < lengths[:, None]).float()
    return (idx,), {"attention_mask": mask}


def _zoo_at(name: str, batch: int, *shape: int) -> Callable[[], Built]:
    """Zoo model ``name`` on a batch of ``batch`` random inputs of ``shape`` (or the zoo's
    own example at that batch when no shape is given)."""
    case = ZOO[name]

    def build() -> Built:
        if shape:
            return case.build(), (torch.randn(batch, *shape, generator=_gen()),), {}
        args, kwargs = case.example(batch)
        return case.build(), args, kwargs

    return build


#: The zoo at sizes where arithmetic, not per-operator overhead, sets node times: images of
#: 64-128 pixels, feature batches of 512-2048 rows, the GPT at GPT-2 small's proportions.
#: (The tests' sizes take microseconds per node, so every node costs about the same.)
BENCH_SIZE: dict[str, Callable[[], Built]] = {
    "mlp_residual": _zoo_at("mlp_residual", 1024, 32),
    "resnet": _zoo_at("resnet", 8, 3, 64, 64),
    "unet": _zoo_at("unet", 4, 3, 128, 128),
    "inception": _zoo_at("inception", 8, 3, 64, 64),
    "transformer": gpt_example(),
    "multi_io_dict": _zoo_at("multi_io_dict", 2048),
    "multi_io_tuple": _zoo_at("multi_io_tuple", 2048),
    "multi_io_dataclass": _zoo_at("multi_io_dataclass", 2048),
    "bn_dropout_buffers": _zoo_at("bn_dropout_buffers", 1024, 24),
    "export_only": _zoo_at("export_only", 512, 10, 16),
    "deep_mlp": _zoo_at("deep_mlp", 1024, 32),
    "shared_module": _zoo_at("shared_module", 1024, 20),
    "llama": llama_example(),
}
#: Zoo models with heterogeneous layers (convolutions over several resolutions, language
#: models with their LM head), the graphs the equal-node and parameter baselines are known
#: to split badly.
HETEROGENEOUS = ("resnet", "unet", "inception", "transformer", "llama")


def benchmark_models(
    size: str, batch: int | None = None, names: list[str] | None = None
) -> list[tuple[str, str, str, Callable[[], Built]]]:
    """(name, kind, tracer, build) for the zoo models ``names`` (default: every one), at
    the tests' size (``"test"``: each model's own batch, or ``batch``) or at benchmark size
    (``"bench"``)."""
    out = []
    for name, case in ZOO.items():
        if names is not None and name not in names:
            continue
        build = BENCH_SIZE[name] if size == "bench" else _zoo_at(name, batch or case.batch)
        out.append((name, case.kind, case.tracer, build))
    return out
