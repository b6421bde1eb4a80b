"""``pipe.generate()``: the model's own ``generate`` loop (greedy, beam search, sampling, its
logits processors and stopping criteria), each of its forwards a step through the stages.

The batch's rows are cut into groups of ``sequences_per_lane``; ``lanes`` threads each take
the next waiting group, run ``generate``'s loop over it with that lane's rows of every
stage's cache, and take the next group when theirs has finished (continuous batching at the
grain of a group). Their steps meet in the :class:`fxpipe.generation.ring.Ring`, so with at
least as many lanes as stages every stage has work. Each group keeps the batch's padding, so
its rows compute what the same rows of the whole batch would; the groups' outputs are joined
in row order, each padded on the right with the pad token to the longest (as ``generate``
pads rows that finish early).

The model's forward does not generate: while ``generate`` runs, the model's ``forward`` is
replaced (on the model object, restored after) by the lane's step; it runs once before, over
two positions, to learn each layer's cache (:meth:`Generator.layout`).
"""

from __future__ import annotations

import functools
import inspect
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fxpipe.devices.targets import model_device
from fxpipe.errors import ConfigError, MemoryPlanError
from fxpipe.generation.cache import (
    CacheLayout,
    StageCaches,
    cache_argument,
    lane_cache,
    probe_layout,
)
from fxpipe.generation.calls import chunked, decoder_call, encoder_call, seq2seq_call
from fxpipe.generation.request import Request, resolve_request
from fxpipe.generation.ring import Ring
from fxpipe.generation.step import StepKind, StepVariant, trace_step
from fxpipe.ir import PipelinePlan, StageProgram
from fxpipe.runtime.recording import NO_RECORDER, RunRecorder
from fxpipe.weights.materialise import meta_view

__all__ = ["Generator", "GenerationRun"]


@dataclass(frozen=True)
class GenerationRun:
    """What the last ``generate`` call ran: lanes, rows, cache length and bytes per stage."""

    lanes: int
    sequences_per_lane: int
    groups: int
    #: Rows generated (sequences times beams or return sequences).
    rows: int
    #: Positions each row's cache holds: the prompt and every new token.
    length: int
    #: Bytes of key/value cache each stage held, for every lane's rows.
    cache_bytes: tuple[int, ...]
    #: The step variants traced so far (prefill, decode; each again for lanes of one row).
    variants: tuple[str, ...]
    #: Bytes of weights each stage holds (beside its cache).
    weight_bytes: tuple[int, ...] = ()
    devices: tuple[str, ...] = ()

    def summary(self) -> str:
        """A table of each stage's device, weights and cache, under a line of the run."""
        head = (
            f"generate: {self.lanes} lane(s), {self.groups} group(s) of up to "
            f"{self.sequences_per_lane} sequence(s), {self.rows} rows x {self.length} positions; "
            f"steps traced: {', '.join(self.variants)}"
        )
        lines = [head, "stage  device    weights MiB  cache MiB"]
        for j, cache in enumerate(self.cache_bytes):
            device = self.devices[j] if self.devices else "?"
            weights = self.weight_bytes[j] if self.weight_bytes else 0
            lines.append(f"{j:>5}  {device:<8}  {weights / 2**20:>11.2f}  {cache / 2**20:>9.2f}")
        return "\n".join(lines)


class Generator:
    """What a pipeline keeps for ``generate``: the cache layout, the step variants (traced
    when first needed) and the last run's figures (:attr:`last`)."""

    def __init__(self, model: nn.Module, plan: PipelinePlan, program: StageProgram) -> None:
        self.model, self.plan, self.program = model, plan, program
        self.variants: list[StepVariant] = []
        self.last: GenerationRun | None = None
        self._layout: CacheLayout | None = None
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ what it needs

    @functools.cached_property
    def argument(self) -> str:
        """The keyword the model's forward takes its cache by (ConfigError where none)."""
        return cache_argument(self.model)

    def layout(self) -> CacheLayout:
        """Each attention layer's cache (heads, head sizes, dtype), from one run of the model
        over two positions (on ``meta`` where its tensors live on several devices)."""
        if self._layout is None:
            model = self.model
            table = model.get_input_embeddings().weight  # type: ignore[operator]
            place = model_device(model)
            view = meta_view(model, live=True) if place is None else nullcontext()
            with view:  # a real run of two positions where one device holds the model
                shape = (1, 2, table.shape[1])
                embeds = torch.zeros(shape, dtype=table.dtype, device=place or "meta")
                self._layout = probe_layout(model, embeds, self.argument)
        return self._layout

    def variant(self, kind: StepKind, rows: int) -> StepVariant:
        """The step of ``kind`` for lanes of ``rows`` rows, traced the first time asked."""
        with self._lock:
            for v in self.variants:
                if v.fits(kind, rows):
                    return v
            was = self.model.training
            self.model.eval()
            first = self._first_with_cache()
            floor = first.cache_stage if first is not None and kind != "encode" else ()
            try:
                v = trace_step(
                    self.model, self.plan, self.program, self.layout(),
                    self.argument, kind=kind, rows=rows, floor=floor,
                )  # fmt: skip
            finally:
                self.model.train(was)
            if kind != "encode" and first is not None and v.cache_stage != first.cache_stage:
                raise ConfigError(
                    f"the {kind} step keeps its layers' caches on stages {v.cache_stage}, the "
                    f"first step on {first.cache_stage}: a cache would move between "
                    "steps, which pipelined generate() does not do; call the model's own "
                    "generate() on one device"
                )
            self.variants.append(v)
            return v

    def _first_with_cache(self) -> StepVariant | None:
        """The first variant traced that holds the cache (not an encoder's), or None."""
        return next((v for v in self.variants if v.kind != "encode"), None)

    def cache_bytes(
        self, rows: int, length: int, rows_one: bool = False, source: int = 0
    ) -> tuple[int, ...]:
        """Bytes of cache each stage holds for ``rows`` sequences of ``length`` positions
        (and an encoder's output of ``source``, for an encoder-decoder's cross-attention)."""
        stages = self.variant("decode", 1 if rows_one else 2).layer_stages
        out = [0] * self.plan.num_stages
        for j, size in zip(stages, self.layout().bytes(rows, length, source), strict=True):
            out[j] += size
        return tuple(out)

    # ------------------------------------------------------------------ generate

    def generate(
        self,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        *,
        recorder: RunRecorder = NO_RECORDER,
    ) -> Any:
        """``model.generate(*args, **kwargs)`` through the stages (see the module docstring);
        ``lanes`` and ``sequences_per_lane`` are taken out of ``kwargs``."""
        request = resolve_request(
            self.model, self.places(), args, kwargs, lane_rows=self.lane_rows
        )
        for a, b in request.groups:  # every variant traced before any step
            for kind in _kinds(request):
                self.variant(kind, (b - a) * (1 if kind == "encode" else request.expand))
        widest = max(b - a for a, b in request.groups) * request.expand
        devices = self._cache_devices()
        cache_bytes = self.cache_bytes(
            widest * request.lanes, request.length, widest == 1, request.source
        )
        _check_fits(self.plan, cache_bytes, request)
        pools = [
            StageCaches(self.layout(), devices, widest, request.length, request.source)
            for _ in range(request.lanes)
        ]
        results = self._run_lanes(request, pools, recorder)
        self.last = GenerationRun(
            request.lanes, request.per_lane, len(request.groups),
            request.ids.shape[0] * request.expand, request.length,
            cache_bytes,
            tuple(f"{v.kind}{' (one row)' if v.one_row else ''}" for v in self.variants),
            tuple(s.param_bytes for s in self.plan.stages),
            tuple(str(d) for d in self.plan.devices),
        )  # fmt: skip
        return _joined(results, request.config)

    # ------------------------------------------------------------------ where stages run

    #: Rows each lane ``lanes="auto"`` makes must have (fewer: fewer lanes).
    lane_rows = 1

    def places(self) -> int:
        """Devices the stages span (``lanes="auto"`` runs one lane per device)."""
        return len(set(self.plan.devices))

    def _cache_devices(self) -> list[torch.device]:
        """The device each layer's cache is made on."""
        first = self._first_with_cache()
        assert first is not None
        return [self.plan.devices[j] for j in first.layer_stages]

    def _ring(self, threads: bool, recorder: RunRecorder) -> Any:
        """The ring the lanes' steps go through (a context manager)."""
        return Ring(self.plan.devices, threads=threads, recorder=recorder)

    def _through(
        self, ring: Any, lane: int, variant: StepVariant, values: list[Any], cache: Any
    ) -> torch.Tensor:
        """One step of ``lane`` through ``ring``: the logits of each row's last position
        (the encoder's output, for an encoder's step, whose ``cache`` is None)."""
        out: torch.Tensor = ring.step(lane, variant.program, values)
        return out

    # ------------------------------------------------------------------ lanes

    def _run_lanes(
        self, request: Request, pools: list[StageCaches], recorder: RunRecorder
    ) -> list[Any]:
        """Every group's ``generate`` output, the groups taken by ``request.lanes`` lanes
        (threads where several) whose steps meet in one ring."""
        model, argument = self.model, self.argument
        waiting = list(range(len(request.groups)))
        results: dict[int, Any] = {}
        errors: list[BaseException] = []
        taken = threading.Lock()
        local = threading.local()

        def step(*args: Any, **kwargs: Any) -> Any:
            return self._step(local.lane, local.ring, argument, args, kwargs, request.chunk)

        def encode(*args: Any, **kwargs: Any) -> Any:
            return self._encode(local.lane, local.ring, args, kwargs)

        def lane(j: int, ring: Ring) -> None:
            local.lane, local.ring = j, ring
            while not errors:
                with taken:
                    if not waiting:
                        return
                    g = waiting.pop(0)
                try:
                    results[g] = self._group(request, g, pools[j], argument)
                except BaseException as e:  # raised in the caller's thread below
                    errors.append(e)

        threads = request.lanes > 1
        recorder.begin_run()
        encoder = model.get_encoder() if request.seq2seq else None  # type: ignore[operator]
        with _forward_replaced(model, step), _forward_replaced(encoder, encode):
            with self._ring(threads, recorder) as ring:
                workers = [
                    threading.Thread(target=lane, args=(j, ring), name=f"fxpipe-lane-{j}")
                    for j in range(request.lanes if threads else 0)
                ]
                for w in workers:
                    w.start()
                if not threads:
                    lane(0, ring)
                for w in workers:
                    w.join()
        if errors:
            raise errors[0]
        return [results[g] for g in range(len(request.groups))]

    def _group(self, request: Request, g: int, pool: StageCaches, argument: str) -> Any:
        """``generate`` over group ``g``'s rows, with a cache over the lane's rows."""
        a, b = request.groups[g]
        rows = request.ids.shape[0]
        cache = lane_cache(pool.rows_of(0, (b - a) * request.expand))
        for t in cache.tensors:
            t.zero_()
        kwargs = {k: _rows(v, a, b, rows) for k, v in request.model_kwargs.items()}
        return self.model.generate(  # type: ignore[operator]
            request.ids[a:b], generation_config=request.config, **{argument: cache}, **kwargs
        )

    def _step(
        self,
        lane: int,
        ring: Ring,
        argument: str,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        chunk: int = 0,
    ) -> Any:
        """One forward of ``generate``'s loop for ``lane``: its new tokens through the stages
        (a prompt in steps of ``chunk`` tokens at most), written into its rows of the cache;
        the logits of each row's last position."""
        from transformers.modeling_outputs import CausalLMOutputWithPast, Seq2SeqLMOutput

        if args:
            raise ConfigError("generate's loop called the model with positional arguments")
        cache = kwargs.pop(argument)
        seq2seq = "encoder_outputs" in kwargs
        call = seq2seq_call(cache, kwargs) if seq2seq else decoder_call(cache, kwargs)
        device = call.values[0].device
        for part in chunked(call, chunk):
            variant = self.variant(part.kind, part.rows)
            logits = self._through(ring, lane, variant, part.values, cache).to(device)
            cache.seen = part.seen
        output = Seq2SeqLMOutput if seq2seq else CausalLMOutputWithPast
        return output(logits=logits, **{argument: cache})

    def _encode(self, lane: int, ring: Ring, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """An encoder-decoder's encoder over one group's prompts (``generate`` calls it once
        before its loop), through the stages: its output as transformers' encoders give it."""
        from transformers.modeling_outputs import BaseModelOutput

        if args:
            raise ConfigError("generate called the encoder with positional arguments")
        call = encoder_call(kwargs)
        variant = self.variant(call.kind, call.rows)
        return BaseModelOutput(
            last_hidden_state=self._through(ring, lane, variant, call.values, None)
        )


def _check_fits(plan: PipelinePlan, cache_bytes: tuple[int, ...], request: Request) -> None:
    """MemoryPlanError where a stage's weights and its cache would pass its device's budget
    (``max_memory``, as the plan keeps it), naming the stage and what to lower."""
    for j, (stage, cache) in enumerate(zip(plan.stages, cache_bytes, strict=True)):
        capacity = plan.capacities[j] if plan.capacities else None
        if capacity is not None and stage.param_bytes + cache > capacity:
            raise MemoryPlanError(
                f"stage {j} ({stage.device}) would hold {stage.param_bytes} bytes of weights "
                f"and {cache} of key/value cache ({request.lanes} lane(s) of "
                f"{request.per_lane * request.expand} rows x {request.length} positions), "
                f"over its budget of {capacity} bytes: pass fewer sequences_per_lane or "
                "lanes, or a smaller max_new_tokens"
            )


def _kinds(request: Request) -> tuple[StepKind, ...]:
    """The step variants a request runs."""
    if request.seq2seq:
        return ("encode", "prefill", "decode")
    return ("prefill", "decode") if request.ids.shape[1] > 1 else ("decode",)


@contextmanager
def _forward_replaced(model: nn.Module | None, step: Callable[..., Any]) -> Iterator[None]:
    """Within the block, ``model.forward`` is ``step`` (with the forward's signature, which
    ``generate`` reads); restored after (nothing, for no model)."""
    if model is None:
        yield
        return
    step.__signature__ = inspect.signature(model.forward)  # type: ignore[attr-defined]
    had = "forward" in vars(model)
    original = vars(model).get("forward")
    vars(model)["forward"] = step
    try:
        yield
    finally:
        if had:
            vars(model)["forward"] = original
        else:
            del vars(model)["forward"]


def _rows(value: Any, a: int, b: int, rows: int) -> Any:
    """Rows ``a:b`` of a per-row tensor argument; anything else as it is."""
    if isinstance(value, torch.Tensor) and value.ndim > 0 and value.shape[0] == rows:
        return value[a:b]
    return value


def _joined(outputs: list[Any], gc: Any) -> Any:
    """The groups' outputs in row order, each padded on the right with the pad token."""
    if len(outputs) == 1:
        return outputs[0]
    pad = gc.pad_token_id
    if pad is None:
        eos = gc.eos_token_id
        pad = eos[0] if isinstance(eos, list) else eos
    if pad is None:
        pad = 0
    longest = max(o.shape[1] for o in outputs)
    padded = [
        torch.nn.functional.pad(o, (0, longest - o.shape[1]), value=int(pad)) for o in outputs
    ]
    return torch.cat(padded)
