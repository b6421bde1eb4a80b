"""``generate``'s calls to the model turned into a step's inputs: a decoder-only model's
forward, an encoder-decoder's encoder (once per group) and its decoder's forward, each
checked for what the pipeline's steps do not take."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from fxpipe.errors import ConfigError
from fxpipe.generation.step import StepKind

__all__ = ["StepCall", "decoder_call", "seq2seq_call", "encoder_call", "chunked"]


@dataclass(frozen=True)
class StepCall:
    """One call of ``generate``'s loop as a step: its kind, its rows and its inputs in the
    step's order (the lane's cache tensors last)."""

    kind: StepKind
    rows: int
    #: Positions the step writes (the cache's ``seen`` after it).
    seen: int
    values: list[Any]


def decoder_call(cache: Any, kwargs: dict[str, Any]) -> StepCall:
    """A decoder-only model's forward: its new tokens, the mask over the whole cache, their
    positions."""
    ids = kwargs.pop("input_ids")
    mask = kwargs.pop("attention_mask", None)
    position = kwargs.pop("position_ids", None)
    no_more(kwargs, "input_ids, attention_mask and position_ids")
    rows, tokens = ids.shape
    whole, positions = _whole_mask(cache, ids, mask)
    if position is None:  # what the model's forward does without them
        position = positions.expand(rows, tokens)
    values = [ids, whole, position.contiguous(), positions, *cache.tensors]
    kind: StepKind = "prefill" if tokens > 1 else "decode"
    return StepCall(kind, rows, cache.seen + tokens, values)


def chunked(call: StepCall, tokens: int) -> list[StepCall]:
    """A decoder-only prefill ``call`` as steps of at most ``tokens`` prompt tokens each (2
    at least: a step of one token is a decode step), in order: each writes its positions of
    the cache, its mask ends at its last token, and the last one's logits are the call's;
    any other call, or ``tokens`` 0, as it is."""
    ids, whole, position, positions, *caches = call.values
    count = int(ids.shape[1])
    if call.kind != "prefill" or tokens == 0 or count <= tokens:
        return [call]
    cuts = list(range(0, count, tokens))
    if count - cuts[-1] < 2:  # a last piece of one token joins the one before
        cuts.pop()
    ends = [*cuts[1:], count]
    start = call.seen - count
    out = []
    for a, b in zip(cuts, ends, strict=True):
        mask = whole.clone()
        mask[:, start + b :] = 0
        values = [ids[:, a:b], mask, position[:, a:b].contiguous(), positions[a:b], *caches]
        out.append(StepCall("prefill", call.rows, start + b, values))
    return out


def seq2seq_call(cache: Any, kwargs: dict[str, Any]) -> StepCall:
    """An encoder-decoder's decoder forward: the first of a group (nothing written yet) the
    prefill that writes the cross-attention caches from the encoder's output, the later
    ones decode steps that read them."""
    ids = kwargs.pop("decoder_input_ids")
    hidden = kwargs.pop("encoder_outputs")[0]
    source_mask = kwargs.pop("attention_mask", None)
    if source_mask is None:
        source_mask = torch.ones(hidden.shape[:2], dtype=torch.long, device=ids.device)
    mask = kwargs.pop("decoder_attention_mask", None)
    no_more(kwargs, "decoder_input_ids, encoder_outputs and the masks")
    rows, tokens = ids.shape
    if cache.seen == 0 and tokens != 1:
        raise ConfigError(
            f"the decoder's first step has {tokens} tokens a row: a pipeline's "
            "encoder-decoder generate() starts each row from decoder_start_token_id alone"
        )
    whole, positions = _whole_mask(cache, ids, mask)
    values = [ids, whole, positions, hidden, source_mask, *cache.tensors]
    kind: StepKind = "prefill" if cache.seen == 0 else "decode"
    return StepCall(kind, rows, cache.seen + tokens, values)


def encoder_call(kwargs: dict[str, Any]) -> StepCall:
    """An encoder-decoder's encoder over one group's prompts."""
    ids = kwargs.pop("input_ids")
    mask = kwargs.pop("attention_mask", None)
    if mask is None:
        mask = torch.ones_like(ids)
    kwargs.pop("labels", None)  # generate hands the encoder what it was given; it ignores them
    for name in ("output_attentions", "output_hidden_states"):
        if kwargs.pop(name, None):
            raise ConfigError(f"generate({name}=True) is not run by a pipeline's generate()")
    no_more(kwargs, "input_ids and attention_mask")
    return StepCall("encode", int(ids.shape[0]), 0, [ids, mask])


def _whole_mask(
    cache: Any, ids: torch.Tensor, mask: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The attention mask over the cache's whole length (1 where a position holds a token of
    the row, the step's included) and the step's absolute positions; ConfigError where the
    step would go past the cache."""
    rows, tokens = ids.shape
    seen, length = cache.seen, cache.tensors[0].shape[2]
    if seen + tokens > length:
        raise ConfigError(
            f"generation went past the cache's {length} positions; pass max_new_tokens"
        )
    whole = torch.zeros((rows, length), dtype=torch.long, device=ids.device)
    whole[:, : seen + tokens] = 1 if mask is None else mask[:, -(seen + tokens) :]
    return whole, torch.arange(seen, seen + tokens, device=ids.device)


def no_more(kwargs: dict[str, Any], takes: str) -> None:
    """ConfigError where ``generate`` passed the model more than the step takes (``takes``)
    beyond flags that change nothing here."""
    for name in ("use_cache", "return_dict", "logits_to_keep"):
        kwargs.pop(name, None)
    unknown = sorted(k for k, v in kwargs.items() if v is not None and v is not False)
    if unknown:
        raise ConfigError(
            f"generate() passed {unknown} to the model, which the pipeline's generation "
            f"step does not take (it takes {takes}); call generate() without them"
        )
