"""The key/value cache of pipelined generation: each attention layer's keys and values in
static tensors of ``(rows, heads, length, head dim)`` on the device of the stage that reads
them, written in place, with the objects Hugging Face's code talks to while it runs.

Three views of one cache:

- :class:`CacheLayout` (what a layer holds: heads, head sizes, dtype), found by one run of the
  model over two positions (:func:`probe_layout`), and :class:`StageCaches`, its tensors made
  for a batch and a length on each layer's stage device;
- :func:`step_cache`, what the model's attention writes into while the generation step is
  traced: each layer's new keys and values copied into its tensors at the step's positions
  (``index_copy_``, an in-place write that the trace keeps, so the graph's stages write
  their own layers' cache and nothing of it crosses a border);
- :func:`lane_cache`, what ``generate``'s loop holds for a lane: how many positions it has
  written, and beam search's reordering of its rows.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fxpipe.errors import ConfigError

__all__ = [
    "CacheLayout",
    "LayerLayout",
    "StageCaches",
    "step_cache",
    "seq2seq_step_cache",
    "lane_cache",
    "probe_layout",
    "cache_argument",
    "error_line",
]


@dataclass(frozen=True)
class LayerLayout:
    """What one attention layer keeps per row and position."""

    heads: int
    key_dim: int
    value_dim: int
    dtype: torch.dtype
    #: A decoder's cross-attention over the encoder's output: as long as the source.
    cross: bool = False

    def bytes_per_position(self) -> int:
        """Bytes of keys and values one row holds per position."""
        size = torch.empty((), dtype=self.dtype).element_size()
        return self.heads * (self.key_dim + self.value_dim) * size


@dataclass(frozen=True)
class CacheLayout:
    """Every attention layer's cache, in the model's layer order."""

    layers: tuple[LayerLayout, ...]

    def bytes(self, rows: int, length: int, source: int = 0) -> tuple[int, ...]:
        """Bytes of each layer's keys and values for ``rows`` sequences of ``length``
        (a cross-attention layer's: of ``source``, the encoder's length)."""
        return tuple(
            rows * (source if layer.cross else length) * layer.bytes_per_position()
            for layer in self.layers
        )


def cache_argument(model: nn.Module) -> str:
    """The keyword the model's forward takes its cache by (``cache``, or the older
    ``past_key_values``); ConfigError where it takes none."""
    names = inspect.signature(model.forward).parameters
    for name in ("cache", "past_key_values"):
        if name in names:
            return name
    raise ConfigError(
        f"{type(model).__name__}.forward takes no key/value cache (neither 'cache' nor "
        "'past_key_values'), so pipelined generate() has no cache to keep on the stages; "
        "call the model's own generate() on one device"
    )


@functools.cache
def _classes() -> tuple[type[Any], type[Any], type[Any]]:
    """transformers' ``Cache``, the layer class of this module's caches and their common
    base over a list of tensors (built once, when generation is first asked for:
    transformers is imported only then)."""
    from transformers.cache_utils import Cache, CacheLayerMixin

    class Layer(CacheLayerMixin):  # type: ignore[no-untyped-call]
        """One attention layer's keys and values as the model's code sees them."""

        is_compileable = False
        is_sliding = False
        is_croppable = False

        def __init__(self, keys: torch.Tensor | None, values: torch.Tensor | None) -> None:
            super().__init__()  # type: ignore[no-untyped-call]
            self.keys, self.values = keys, values
            self.is_initialized = keys is not None

        def lazy_initialization(self, *args: Any) -> None:
            """Nothing: the tensors are made before the model runs."""

        def update(self, *args: Any, **kwargs: Any) -> Any:
            raise NotImplementedError  # the Cache's own update writes

        def get_mask_sizes(self, *args: Any) -> tuple[Any, int]:
            assert self.keys is not None
            return self.keys.shape[2], 0

        def get_seq_length(self) -> int:
            return 0

        def get_max_cache_shape(self) -> int:
            return -1 if self.keys is None else int(self.keys.shape[2])

        def get_max_length(self) -> int:
            return self.get_max_cache_shape()

        def reorder_cache(self, beam_idx: torch.Tensor) -> None:
            for t in (self.keys, self.values):
                if t is not None:
                    t.copy_(t.index_select(0, beam_idx.to(t.device)))

    class Over(Cache):
        """A cache over ``tensors``: the keys and values of each layer in turn."""

        def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
            pairs = zip(tensors[0::2], tensors[1::2], strict=True)
            super().__init__(layers=[Layer(k, v) for k, v in pairs])
            self.tensors = list(tensors)

    return Cache, Layer, Over


def probe_layout(model: nn.Module, embeds: torch.Tensor, argument: str) -> CacheLayout:
    """Each attention layer's heads, head sizes and dtype, from one run of ``model`` over
    ``embeds`` (embedded tokens of one row, zeros or on ``meta``: token ids and a mask would
    have some models read their values) with a cache that records what each layer writes
    (an encoder-decoder's decoder over the same embeds, its cross-attention layers recorded
    after its self-attention layers); where that run fails (on ``meta``, some kernels such as
    grouped experts run only while traced), from torch.export's trace of it. ConfigError
    where a layer keeps something else (a recurrent state, layers sharing one cache) or the
    model writes no cache."""
    seq2seq = bool(getattr(getattr(model, "config", None), "is_encoder_decoder", False))
    found: list[dict[int, LayerLayout]] = [{}, {}]

    def cache() -> Any:
        for seen in found:
            seen.clear()
        if not seq2seq:
            return _probe(model, found[0], cross=False)
        from transformers.cache_utils import EncoderDecoderCache

        return EncoderDecoderCache(
            _probe(model, found[0], cross=False), _probe(model, found[1], cross=True)
        )

    with torch.no_grad():
        try:
            model(**_probe_inputs(embeds, seq2seq), **{argument: cache()}, use_cache=True)
        except ConfigError:
            raise
        except Exception:  # on meta, some kernels (grouped experts) run only while traced
            try:
                traced = _Traced(model, argument, cache, seq2seq)
                torch.export.export(traced, (embeds,), strict=False)
            except ConfigError:
                raise
            except Exception as e:
                raise ConfigError(
                    f"{type(model).__name__} did not run with a cache of keys and values per "
                    f"attention layer ({error_line(e)}): it may keep other states (a "
                    "recurrent or convolution state, as Mamba layers do), which pipelined "
                    "generate() does not hold; call the model's own generate() on one device"
                ) from e
    layers: list[LayerLayout] = []
    for seen in found[: 1 + seq2seq]:
        if not seen or sorted(seen) != list(range(len(seen))):
            raise ConfigError(
                f"{type(model).__name__} wrote no key/value cache of its attention layers in "
                f"order (layers {sorted(seen)}); pipelined generate() keeps one per attention "
                "layer: call the model's own generate()"
            )
        layers += [seen[i] for i in range(len(seen))]
    return CacheLayout(tuple(layers))


def _probe_inputs(embeds: torch.Tensor, seq2seq: bool) -> dict[str, torch.Tensor]:
    """The probe's inputs: the embeds, for an encoder-decoder's decoder too."""
    if seq2seq:
        return {"inputs_embeds": embeds, "decoder_inputs_embeds": embeds}
    return {"inputs_embeds": embeds}


def _probe(model: nn.Module, seen: dict[int, LayerLayout], *, cross: bool) -> Any:
    """A cache that records in ``seen`` what each layer writes (its shapes and dtype) and
    keeps nothing."""
    cache_cls, layer_cls, _ = _classes()

    class _Probe(cache_cls):  # type: ignore[misc, valid-type]
        def __init__(self) -> None:
            super().__init__(layers=[])

        def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
                   *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
            if layer_idx in seen or key_states.ndim != 4:
                raise ConfigError(
                    f"layer {layer_idx} of {type(model).__name__} writes its cache in a form "
                    "pipelined generate() does not keep (a cache shared between layers, or "
                    "not of (batch, heads, length, head dim)); call the model's own generate()"
                )
            seen[layer_idx] = LayerLayout(
                int(key_states.shape[1]), int(key_states.shape[3]), int(value_states.shape[3]),
                key_states.dtype, cross,
            )  # fmt: skip
            while len(self.layers) <= layer_idx:
                self.layers.append(layer_cls(None, None))
            return key_states, value_states

        def get_seq_length(self, layer_idx: int = 0) -> int:
            return 0

        def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
            return int(query_length), 0

        def get_query_offset(self, layer_idx: int = 0) -> int:
            return 0

    return _Probe()


def error_line(e: BaseException) -> str:
    """``Type: first line of the message`` of an error another library raised."""
    text = str(e)
    return f"{type(e).__name__}: {text.splitlines()[0] if text else ''}"


class _Traced(nn.Module):
    """The model over embedded tokens with a cache made by ``cache`` (for a probe under
    torch.export)."""

    def __init__(
        self, model: nn.Module, argument: str, cache: Callable[[], Any], seq2seq: bool
    ) -> None:
        super().__init__()
        self.model, self.argument, self.cache, self.seq2seq = model, argument, cache, seq2seq

    def forward(self, embeds: torch.Tensor) -> Any:
        inputs = _probe_inputs(embeds, self.seq2seq)
        out = self.model(**inputs, **{self.argument: self.cache()}, use_cache=True)
        return out.logits if hasattr(out, "logits") else out[0]


class StageCaches:
    """Every layer's keys and values for ``rows`` sequences of up to ``length`` positions
    (a cross-attention layer's: of the ``source`` positions of the encoder's output), each
    on its layer's device (``devices[i]``), zeros until written."""

    def __init__(
        self,
        layout: CacheLayout,
        devices: Sequence[torch.device],
        rows: int,
        length: int,
        source: int = 0,
    ) -> None:
        self.layout, self.rows, self.length, self.source = layout, rows, length, source
        self.tensors: list[torch.Tensor] = []
        for layer, device in zip(layout.layers, devices, strict=True):
            for dim in (layer.key_dim, layer.value_dim):
                shape = (rows, layer.heads, source if layer.cross else length, dim)
                self.tensors.append(torch.zeros(shape, dtype=layer.dtype, device=device))

    def rows_of(self, start: int, stop: int) -> list[torch.Tensor]:
        """Views of rows ``start:stop`` of every tensor, in the step's order (keys and values
        of layer 0, then of layer 1, ...)."""
        return [t[start:stop] for t in self.tensors]


def step_cache(tensors: Sequence[torch.Tensor], positions: torch.Tensor) -> Any:
    """A transformers ``Cache`` over ``tensors`` (keys and values of each layer in turn) whose
    ``update`` writes a layer's new keys and values at ``positions`` (the step's absolute
    positions) in place and returns the whole tensors; masks are sized to the whole length
    (the attention mask given with the step marks what is written)."""
    _, _, over = _classes()

    class _Step(over):  # type: ignore[misc, valid-type]
        def update(
            self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
            *args: Any, **kwargs: Any,
        ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
            keys, values = self.tensors[2 * layer_idx], self.tensors[2 * layer_idx + 1]
            keys.index_copy_(2, positions, key_states)
            values.index_copy_(2, positions, value_states)
            return keys, values

        def get_seq_length(self, layer_idx: int = 0) -> Any:
            return positions[0]

        def get_query_offset(self, layer_idx: int = 0) -> Any:
            return positions[0]

        def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
            return self.tensors[0].shape[2], 0

    return _Step(tensors)


def seq2seq_step_cache(
    tensors: Sequence[torch.Tensor], positions: torch.Tensor, layout: CacheLayout, filled: bool
) -> Any:
    """An encoder-decoder's ``EncoderDecoderCache`` over ``tensors`` (the decoder's
    self-attention layers' keys and values, then its cross-attention layers'): the first as
    :func:`step_cache`; the cross-attention layers written whole by the step that computes
    them from the encoder's output (``filled`` False: the first step of a group), read as
    they are by the later steps (``filled``: transformers' code then skips their
    projections)."""
    from transformers.cache_utils import EncoderDecoderCache

    _, _, over = _classes()
    own = 2 * sum(not layer.cross for layer in layout.layers)

    class _Cross(over):  # type: ignore[misc, valid-type]
        def update(
            self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
            *args: Any, **kwargs: Any,
        ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
            keys, values = self.tensors[2 * layer_idx], self.tensors[2 * layer_idx + 1]
            keys.copy_(key_states)
            values.copy_(value_states)
            return keys, values

        def get_seq_length(self, layer_idx: int = 0) -> int:
            return int(filled)  # transformers reads "written" as a length above 0

    return EncoderDecoderCache(step_cache(tensors[:own], positions), _Cross(tensors[own:]))


def lane_cache(tensors: Sequence[torch.Tensor]) -> Any:
    """The ``Cache`` ``generate``'s loop holds for one lane whose rows of every layer are
    ``tensors``: how many positions it has written (``seen``), beam search's row reordering
    done in place on every stage's device (and kept, for stages in other processes, until
    :meth:`take_reordered`); the model's own forward cannot write it."""
    _, _, over = _classes()

    class _Lane(over):  # type: ignore[misc, valid-type]
        seen = 0
        #: Beam search's reorderings since the last step, as one index (None: none).
        reordered: torch.Tensor | None = None

        def reorder_cache(self, beam_idx: torch.Tensor) -> None:
            super().reorder_cache(beam_idx)
            last = self.reordered
            self.reordered = beam_idx if last is None else last.index_select(0, beam_idx)

        def take_reordered(self) -> torch.Tensor | None:
            """The rows' reordering since this was last taken (for a stage in another
            process, which holds its own rows), or None."""
            out, self.reordered = self.reordered, None
            return out

        @property
        def is_compileable(self) -> bool:
            return False

        def get_seq_length(self, layer_idx: int = 0) -> int:
            return self.seen

        def get_query_offset(self, layer_idx: int = 0) -> int:
            return self.seen

        def update(self, *args: Any, **kwargs: Any) -> Any:
            raise ConfigError(
                "a pipeline's generation cache is written by its stages only; the model's "
                "own forward cannot use it"
            )

    return _Lane(tensors)
