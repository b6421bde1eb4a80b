"""One ``generate`` call checked and resolved before anything runs: the prompts, the
generation config, what the pipeline refuses, the cache's length and how the rows are cut
into groups for lanes (``lanes="auto"``: one lane per device the stages span)."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fxpipe.errors import ConfigError, InputError

__all__ = ["REFUSED", "Request", "resolve_request", "lanes_and_rows", "prefill_tokens"]

#: ``generate`` options pipelined generation does not run, each with why.
REFUSED: Mapping[str, str] = {
    "assistant_model": "assisted decoding runs a second model beside this one",
    "prompt_lookup_num_tokens": "prompt-lookup decoding rolls the cache back",
    "inputs_embeds": "prompts are token ids here (the first stage embeds them)",
    "cache": "the pipeline keeps its own cache on the stages",
    "past_key_values": "the pipeline keeps its own cache on the stages",
    "cache_implementation": "the pipeline keeps its own static cache on the stages",
}


@dataclass(frozen=True)
class Request:
    """One ``generate`` call resolved: prompts, generation config, how rows go to lanes."""

    ids: torch.Tensor
    config: Any
    #: What ``generate`` passes on to the model (the attention mask, ...), per row.
    model_kwargs: dict[str, Any]
    #: Rows each returned sequence stands for (beams, or return sequences).
    expand: int
    #: Positions every row's cache holds: the prompt and every new token.
    length: int
    lanes: int
    per_lane: int
    #: (first row, end row) of each group, in order.
    groups: tuple[tuple[int, int], ...]
    #: An encoder-decoder: ``ids`` are the encoder's, ``length`` the decoder's.
    seq2seq: bool = False
    #: Prompt tokens a prefill step takes at most (longer prompts go in chunks); 0: all.
    chunk: int = 0

    @property
    def source(self) -> int:
        """Positions of the encoder's output each row's cross-attention cache holds."""
        return int(self.ids.shape[1]) if self.seq2seq else 0


def resolve_request(
    model: nn.Module,
    devices: int,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    lane_rows: int = 1,
) -> Request:
    """The call checked and resolved (ConfigError or InputError naming what to change);
    ``devices`` and ``lane_rows`` as :func:`lanes_and_rows` takes them."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(model, "generate"):
        raise ConfigError(
            f"{type(model).__name__} has no generate(): pipelined generation runs a "
            "transformers model's generate loop; call pipe(...) step by step instead"
        )
    seq2seq = bool(getattr(config, "is_encoder_decoder", False))
    for name in ("decoder_input_ids", "encoder_outputs") if seq2seq else ():
        if kwargs.get(name) is not None:
            raise ConfigError(
                f"generate({name}=...) on an encoder-decoder pipeline: the pipeline runs the "
                "encoder over the prompts and starts the decoder from the generation "
                f"config's decoder_start_token_id; leave {name} out"
            )
    lanes, per_lane = kwargs.pop("lanes", "auto"), kwargs.pop("sequences_per_lane", None)
    chunk = kwargs.pop("prefill_chunk", "auto")
    for name, why in REFUSED.items():
        if kwargs.get(name) is not None:
            raise ConfigError(f"generate({name}=...) is not run by a pipeline: {why}")
    if kwargs.get("use_cache") is False:
        raise ConfigError(
            "use_cache=False would run every step over the whole prefix; a pipeline's "
            "generate() keeps the cache on its stages: leave use_cache out"
        )
    ids = _prompt(args, kwargs)
    gc: Any = copy.deepcopy(kwargs.pop("generation_config", None) or model.generation_config)
    model_kwargs = gc.update(**kwargs)
    if gc.cache_implementation is not None:
        raise ConfigError(f"generation_config.cache_implementation: {REFUSED['cache']}")
    gc.use_cache = True  # a model pipelined with use_cache=False in its config
    mask = model_kwargs.get("attention_mask")
    if mask is not None and tuple(mask.shape) != tuple(ids.shape):
        raise InputError(
            f"attention_mask has shape {tuple(mask.shape)}, input_ids {tuple(ids.shape)}: "
            "give one mask value per token"
        )
    rows = ids.shape[0]
    lanes, per_lane = lanes_and_rows(lanes, per_lane, rows, devices, gc, lane_rows=lane_rows)
    groups = tuple((a, min(a + per_lane, rows)) for a in range(0, rows, per_lane))
    if len(groups) > 1 and gc.return_dict_in_generate:
        raise ConfigError(
            f"return_dict_in_generate=True with {len(groups)} groups of sequences: pass "
            f"lanes=1 and sequences_per_lane={rows} (one group) to get generate's whole output"
        )
    expand = max(int(gc.num_beams or 1), int(gc.num_return_sequences or 1))
    length = _length(gc, 1 if seq2seq else ids.shape[1])  # a decoder starts from one token
    chunk = prefill_tokens(chunk, per_lane * expand, lanes)
    return Request(ids, gc, model_kwargs, expand, length, lanes, per_lane, groups, seq2seq, chunk)


def _prompt(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor:
    """The prompts' token ids (positional, ``input_ids=`` or ``inputs=``), taken out."""
    if len(args) > 1:
        raise InputError("generate() takes the prompts' ids positionally, the rest by keyword")
    ids = args[0] if args else kwargs.pop("input_ids", None)
    if ids is None:
        ids = kwargs.pop("inputs", None)
    if not isinstance(ids, torch.Tensor) or ids.ndim != 2 or ids.is_floating_point():
        raise InputError(
            f"generate() needs input_ids, token ids of shape (batch, length); got "
            f"{type(ids).__name__ if not isinstance(ids, torch.Tensor) else tuple(ids.shape)}"
        )
    return ids


def _length(gc: Any, prompt: int) -> int:
    """Positions each row's cache must hold: the prompt and every new token."""
    if gc.max_new_tokens is not None:
        return prompt + int(gc.max_new_tokens)
    return max(int(gc.max_length), prompt + 1)


#: Rows times prompt tokens a prefill step of ``prefill_chunk="auto"`` takes at most.
CHUNK_BUDGET = 512


def prefill_tokens(chunk: Any, rows: int, lanes: int) -> int:
    """Prompt tokens a prefill step takes at most (0: the whole prompt at once):
    ``"auto"``, with several lanes, keeps each step near :data:`CHUNK_BUDGET` rows times
    tokens, so a long prompt of many rows goes in chunks that let the other lanes' steps
    through between them (a lane's first step otherwise holds each stage for as long as the
    whole prompt, and the stages after it wait); with one lane there is nothing to let
    through, and the prompt goes in one step, as with ``None``."""
    if chunk is None:
        return 0
    if chunk == "auto":
        return max(2, CHUNK_BUDGET // rows) if lanes > 1 else 0
    if not isinstance(chunk, int) or isinstance(chunk, bool) or chunk < 2:
        raise ConfigError(
            f"prefill_chunk={chunk!r}: give an int of 2 or more (prompt tokens a step takes), "
            "'auto' or None (each prompt in one step)"
        )
    return chunk


def lanes_and_rows(
    lanes: Any, per_lane: Any, rows: int, devices: int, gc: Any, *, lane_rows: int = 1
) -> tuple[int, int]:
    """(lanes, sequences per lane) resolved: ``"auto"`` is one lane per device the stages
    span (lanes pay only where stages compute at once, and stages that share a device take
    turns on it), each with at least ``lane_rows`` rows where there are that many, the rows
    shared evenly; sampling runs one lane."""
    sampling = bool(gc.do_sample)
    if lanes == "auto":
        lanes = 1 if sampling else max(1, min(devices, rows // lane_rows))
    if not isinstance(lanes, int) or isinstance(lanes, bool) or lanes < 1:
        raise ConfigError(f"lanes={lanes!r}: give a positive int or 'auto'")
    if sampling and lanes > 1:
        raise ConfigError(
            f"lanes={lanes} with do_sample=True: sampling draws from torch's one random "
            "generator, which lanes running side by side would draw from in no set order; "
            "pass lanes=1 (then it equals model.generate's sampling under the same seed)"
        )
    if per_lane is None:
        per_lane = -(-rows // lanes)
    if not isinstance(per_lane, int) or isinstance(per_lane, bool) or per_lane < 1:
        raise ConfigError(f"sequences_per_lane={per_lane!r}: give a positive int")
    return min(lanes, -(-rows // per_lane)), per_lane
