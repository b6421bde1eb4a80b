"""What torch.export traces for each variant of a generation step: the module that calls
the model, zero-valued example inputs (the cache tensors last, as one list) and their
dynamic dims, for a decoder-only model (``input_ids``, ``attention_mask``, ``position_ids``,
``cache_position``, the caches) and for an encoder-decoder's encoder (the prompts and their
mask) and decoder (its new tokens, the mask over its cache, ``cache_position``, the
encoder's output and mask, its self- then cross-attention caches)."""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from fxpipe.generation.cache import CacheLayout, seq2seq_step_cache, step_cache

__all__ = ["StepKind", "KINDS", "Form", "step_form", "STEP_INPUTS", "SEQ2SEQ_INPUTS"]

StepKind = Literal["encode", "prefill", "decode"]
#: The kinds in the order their numbers travel in (``wire.Message.kind``).
KINDS: tuple[StepKind, ...] = ("prefill", "decode", "encode")

#: A decoder-only step's inputs before the cache tensors, in order.
STEP_INPUTS = ("input_ids", "attention_mask", "position_ids", "cache_position")
#: An encoder-decoder's decoder step's inputs before the cache tensors, in order.
SEQ2SEQ_INPUTS = (
    "decoder_input_ids", "attention_mask", "cache_position", "encoder_hidden_states",
    "encoder_attention_mask",
)  # fmt: skip


class _Step(nn.Module):
    """The model called for one step of generation with the static cache (traced only)."""

    def __init__(self, model: nn.Module, argument: str, keeps_logits: bool) -> None:
        super().__init__()
        self.model, self.argument, self.keeps_logits = model, argument, keeps_logits

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        cache_position: torch.Tensor,
        caches: list[torch.Tensor],
    ) -> torch.Tensor:
        extra: dict[str, Any] = {self.argument: step_cache(caches, cache_position)}
        if self.keeps_logits:
            extra["logits_to_keep"] = 1
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=True,
            **extra,
        )
        return _last_logits(out)


class _Encode(nn.Module):
    """An encoder-decoder's encoder over the prompts, once per group (traced only)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        encoder = self.model.get_encoder()  # type: ignore[operator]
        out = encoder(input_ids=input_ids, attention_mask=attention_mask, return_dict=True)
        hidden: torch.Tensor = out.last_hidden_state
        return hidden


class _DecoderStep(nn.Module):
    """An encoder-decoder's decoder called for one step with its static caches (traced
    only): the first step of a group (``filled`` False) computes every cross-attention
    layer's keys and values from the encoder's output and writes them, the later ones read
    them."""

    def __init__(self, model: nn.Module, argument: str, layout: CacheLayout, filled: bool) -> None:
        super().__init__()
        self.model, self.argument, self.layout, self.filled = model, argument, layout, filled

    def forward(
        self,
        decoder_input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        cache_position: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        encoder_attention_mask: torch.Tensor,
        caches: list[torch.Tensor],
    ) -> torch.Tensor:
        from transformers.modeling_outputs import BaseModelOutput

        cache = seq2seq_step_cache(caches, cache_position, self.layout, self.filled)
        out = self.model(
            encoder_outputs=BaseModelOutput(last_hidden_state=encoder_hidden_states),
            attention_mask=encoder_attention_mask,
            decoder_input_ids=decoder_input_ids,
            decoder_attention_mask=attention_mask,
            use_cache=True,
            **{self.argument: cache},
        )
        return _last_logits(out)


def _last_logits(out: Any) -> torch.Tensor:
    """The logits of each row's last position, of a model's output."""
    logits = out.logits if hasattr(out, "logits") else out[0]
    last: torch.Tensor = logits[:, -1:]
    return last


@dataclass(frozen=True)
class Form:
    """What torch.export traces for one variant: the module, example inputs (the cache
    tensors last, as one list), their dynamic dims, the inputs before the caches and which
    of them sizes may be read off (small ones)."""

    module: nn.Module
    example: tuple[Any, ...]
    dynamic: tuple[Any, ...]
    inputs: int
    small: tuple[int, ...]


def step_form(
    model: nn.Module, layout: CacheLayout, argument: str, kind: StepKind, rows: int,
    device: torch.device,
) -> Form:  # fmt: skip
    """The module and example of a step of ``kind`` over lanes of ``rows`` rows."""
    dim = torch.export.Dim
    r = {0: _free("rows")} if rows > 1 else {}
    if not getattr(getattr(model, "config", None), "is_encoder_decoder", False):
        keeps = "logits_to_keep" in inspect.signature(model.forward).parameters
        tokens = 1 if kind == "decode" else 3
        step = _Step(model, argument, keeps)
        example = _example(layout, rows, tokens, device)
        return Form(step, example, _dynamic(layout, rows, tokens), 4, (0, 1, 2, 3))
    source = dim("source", min=2)
    if kind == "encode":
        ids = torch.zeros((rows, 6), dtype=torch.long, device=device)
        spec = {**r, 1: source}
        return Form(_Encode(model), (ids, torch.ones_like(ids)), (spec, spec), 2, (0, 1))
    width = model.get_input_embeddings().weight  # type: ignore[operator]
    ids = torch.zeros((rows, 1), dtype=torch.long, device=device)
    mask = torch.ones((rows, 8), dtype=torch.long, device=device)
    encoded = torch.zeros((rows, 5, width.shape[1]), dtype=width.dtype, device=device)
    caches = [
        torch.zeros(
            (rows, layer.heads, 5 if layer.cross else 8, d), dtype=layer.dtype, device=device
        )
        for layer in layout.layers
        for d in (layer.key_dim, layer.value_dim)
    ]
    example = (ids, mask, torch.zeros(1, dtype=torch.long, device=device), encoded,
               torch.ones((rows, 5), dtype=torch.long, device=device), caches)  # fmt: skip
    length = dim("length", min=2)
    dynamic: tuple[Any, ...] = (
        r, {**r, 1: length}, {}, {**r, 1: source}, {**r, 1: source},
        [{**r, 2: source if layer.cross else length} for layer in layout.layers for _ in "kv"],
    )  # fmt: skip
    decoder = _DecoderStep(model, argument, layout, filled=kind == "decode")
    return Form(decoder, example, dynamic, 5, (0, 1, 2, 4))


def _example(layout: CacheLayout, rows: int, tokens: int, device: torch.device) -> tuple[Any, ...]:
    """Zero-valued step inputs of ``rows`` rows, ``tokens`` new tokens, a cache of 8."""
    length = 8
    ids = torch.zeros((rows, tokens), dtype=torch.long, device=device)
    mask = torch.ones((rows, length), dtype=torch.long, device=device)
    position = torch.arange(tokens, device=device).expand(rows, tokens).contiguous()
    caches = [
        torch.zeros((rows, layer.heads, length, dim), dtype=layer.dtype, device=device)
        for layer in layout.layers
        for dim in (layer.key_dim, layer.value_dim)
    ]
    return ids, mask, position, torch.arange(tokens, device=device), caches


def _dynamic(layout: CacheLayout, rows: int, tokens: int) -> tuple[Any, ...]:
    """torch.export's dynamic dims: rows (unless one) and tokens (unless one) unnamed
    (:func:`_free`), the cache's length one named size (shared by the mask and every
    layer's keys and values)."""
    dim = torch.export.Dim
    r = {0: _free("rows")} if rows > 1 else {}
    t = _free("tokens") if tokens > 1 else None
    length = dim("length", min=2)
    ids = {**r, 1: t} if t is not None else r
    caches = [{**r, 2: length} for _ in range(2 * len(layout.layers))]
    return (ids, {**r, 1: length}, ids, {0: t} if t is not None else {}, caches)


def _free(name: str) -> Any:
    """A dynamic size of at least 2 that torch.export does not name: each input gets a size
    of its own, which export equates where the model combines them. A named size makes
    export prove every guard on it symbolically, which it cannot for some it emits
    (Llama 4's experts reshape rows x tokens: ``n * Min(32, 32 * n) == 32 * n``); the
    cache's length stays named, as every layer's cache and the mask share it. Where torch's
    hint takes no bounds (older versions), the named size."""
    hint = getattr(torch.export.Dim, "DYNAMIC", None)
    return hint(min=2) if callable(hint) else torch.export.Dim(name, min=2)
