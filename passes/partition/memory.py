"""The memory model: what a stage holds, the budgets it must fit, and the values it receives.

The estimate is :func:`fxpipe.passes.split.plan.stage_memory`'s, term for term, so that a split the
search accepts is one the plan accepts:

- ``param_copies(training)`` x the bytes of the parameters the stage holds (a tensor that
  several nodes of the stage hold counts once): weight, gradient and two Adam moments in
  training, the weight alone in inference;
- ``saved_coef[j]`` x the bytes its nodes keep for backward;
- ``input_coef[j]`` x the bytes of the boundary values it receives;

the coefficients set by ``chunks``, ``checkpoint`` and ``training`` (:func:`memory_terms`):
in inference a stage holds one micro-batch's activations and input at a time. Most bytes
belong to one unit and add up over a stage. The rest are *spread*: a parameter several
units hold (tied weights), a ``get_attr`` node's bytes (it lives in the stage of its first
reader), a placeholder's (first stage) or the output's (last stage); such an item is in
every stage that holds the first of one of its holders. A received value is in every stage
that reads it but does not make it (a model input is made in the first stage).

The tables a search reads this memory from (per split, per ideal pair, per segment of
an order) are :mod:`fxpipe.passes.partition.memory_tables`.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.fx as fx

from fxpipe.ir import CheckpointMode, Checkpoints, CostTable
from fxpipe.passes.ops import held_parameters

__all__ = [
    "PARAM_COPIES",
    "ESTIMATE",
    "MODEL_INPUT",
    "FIRST_READER",
    "FIRST_STAGE",
    "LAST_STAGE",
    "MemoryModel",
    "Spread",
    "Entering",
    "checkpointed",
    "stage_mode",
    "param_copies",
    "whole_coef",
    "memory_terms",
    "memory_model",
    "received_on_ideals",
]

#: Copies of each parameter a training step holds: weight, gradient, two Adam moments.
PARAM_COPIES = 4
#: Producer codes of a received value: a model input (made in the first stage), or a
#: ``get_attr`` value (made in the stage of its first reader).
MODEL_INPUT, FIRST_READER = -1, -2
#: Holder codes of a spread item: the first stage, the last stage.
FIRST_STAGE, LAST_STAGE = -1, -2


#: What the estimate counts, for messages: by ``training``.
ESTIMATE = {
    True: (
        f"training estimate: weights, gradients and Adam state, {PARAM_COPIES} copies of each "
        "parameter, and the activations of the micro-batches in flight"
    ),
    False: (
        "inference estimate (model in eval mode or grad disabled when planned): the weights "
        "once and one micro-batch's activations per stage"
    ),
}


def checkpointed(chunks: int, checkpoint: str, *, last: bool) -> int:
    """How many of ``chunks`` micro-batches a stage checkpoints in training."""
    count = {"always": chunks, "except_last": chunks - 1, "never": 0}[checkpoint]
    if last and checkpoint == "except_last":
        count = chunks - 1
    return count


def stage_mode(checkpoint: Checkpoints, j: int) -> CheckpointMode:
    """The checkpoint mode of stage ``j``: the one mode, or the ``j``-th of one per stage."""
    return checkpoint if isinstance(checkpoint, str) else checkpoint[j]


def whole_coef(training: bool) -> float:
    """Copies of a whole value (not cut with the batch) a stage receiving it holds: the
    value, and in training its gradient."""
    return 2.0 if training else 1.0


def param_copies(training: bool) -> int:
    """Copies of each parameter a stage holds: PARAM_COPIES in training, 1 in inference."""
    return PARAM_COPIES if training else 1


def memory_terms(
    chunks: int, checkpoint: str, *, last: bool, training: bool = True
) -> tuple[float, float]:
    """(saved_coef, input_coef): the multiples of a stage's saved bytes and received bytes
    (both for the whole example batch) in its memory; in inference (no backward, nothing
    stashed) one micro-batch's worth of each."""
    scale = 1.0 / max(chunks, 1)
    if not training:
        return scale, scale
    count = checkpointed(chunks, checkpoint, last=last)
    saved = (chunks - count) * scale + (scale if count else 0.0)
    return saved, count * scale


@dataclass(frozen=True)
class MemoryModel:
    """The memory budgets a split must fit and what each node adds to its stage's memory."""

    #: Bytes each stage position may use (None: not checked); stages on one device share it.
    budgets: tuple[int | None, ...]
    #: The device of each stage position, as text: stages with the same text share a budget.
    devices: tuple[str, ...]
    chunks: int
    #: One checkpoint mode for every stage, or one per stage position.
    checkpoint: Checkpoints
    #: Example batch size the bytes were measured at.
    batch: int
    #: Node name -> bytes it keeps for backward (the non-zero ones).
    saved: Mapping[str, int]
    #: One entry per parameter tensor: (bytes, names of the nodes that hold it).
    params: tuple[tuple[int, tuple[str, ...]], ...]
    #: Training (weights, gradients, Adam state, stashed activations) or inference.
    training: bool = True

    def device_groups(self) -> dict[str, list[int]]:
        """Device -> its stage positions, in order."""
        groups: dict[str, list[int]] = {}
        for j, d in enumerate(self.devices):
            groups.setdefault(d, []).append(j)
        return groups


def memory_model(
    gm: fx.GraphModule,
    costs: CostTable,
    devices: Sequence[torch.device],
    budgets: Sequence[int | None],
    *,
    chunks: int,
    checkpoint: Checkpoints,
    training: bool = True,
) -> MemoryModel | None:
    """What the search needs to keep each device under its budget (training or inference
    memory); None when no device has one (nothing to check)."""
    if all(b is None for b in budgets):
        return None
    holders: dict[int, tuple[int, list[str]]] = {}
    for node in gm.graph.nodes:
        for p in held_parameters(gm, node):
            entry = holders.setdefault(id(p), (p.numel() * p.element_size(), []))
            entry[1].append(node.name)
    return MemoryModel(
        budgets=tuple(budgets),
        devices=tuple(str(d) for d in devices),
        chunks=chunks,
        checkpoint=checkpoint,
        training=training,
        batch=costs.batch_size,
        saved={n: c.saved_bytes for n, c in costs.nodes.items() if c.saved_bytes},
        params=tuple((size, tuple(names)) for size, names in holders.values()),
    )


@dataclass(frozen=True)
class Spread:
    """Bytes in every stage that holds the first unit of one of ``holders``."""

    bytes: int
    #: Parameter bytes (x the copies), else saved bytes.
    param: bool
    #: Unit sets, or ``(FIRST_STAGE,)`` / ``(LAST_STAGE,)``.
    holders: tuple[tuple[int, ...], ...]


@dataclass(frozen=True)
class Entering:
    """A value other units read: where it is made and where it is read. The partitioner
    counts its bytes as traffic; a stage that reads it and does not make it receives it."""

    bytes: int
    #: Unit id, MODEL_INPUT or FIRST_READER (made where its first reader is).
    producer: int
    readers: tuple[int, ...]
    #: The model output reads it (in the last stage).
    to_output: bool
    #: Cut with the batch; else (a weight sent on, such as a tied embedding) the same
    #: whole value for every micro-batch, which the runtime sends once per step: a stage
    #: receiving it holds one copy (and, in training, its gradient): ``whole_coef``.
    batched: bool = True


def received_on_ideals(
    ideals: np.ndarray,
    values: Iterable[Entering],
    made_in: Callable[[np.ndarray, Entering], np.ndarray],
) -> np.ndarray:
    """``out[I, J]``: the bytes stage ``I - J`` receives, of the values made in ideal J
    (``made_in(ideals, v)``: which ideals make ``v``) with a reader in ``I - J``, each once
    however many readers it has there.

    With ``c(I)`` the number of v's readers in ideal I (the output counts as a reader in the
    full ideal only), v enters ``I - J`` exactly when it is made in J and ``c(I) > c(J)``:
    the sum over ``c < m`` of ``[c(J) = c, made in J] [c(I) > c]`` for m readers, rank-one
    terms, so the whole table is one matrix product over (value, c) columns. Values alike
    but for their bytes share their columns."""
    count = len(ideals)
    last = np.zeros(count, dtype=np.int64)
    last[-1] = 1  # rows are ordered by size: the last one is the full ideal
    grouped: dict[tuple[int, tuple[int, ...], bool], float] = defaultdict(float)
    for v in values:
        grouped[(v.producer, v.readers, v.to_output)] += v.bytes
    receives, sends = [], []
    for (producer, readers, to_output), size in grouped.items():
        made = made_in(ideals, Entering(0, producer, readers, to_output))
        inside = ideals[:, list(readers)].sum(axis=1) + (last if to_output else 0)
        for c in range(len(readers) + to_output):
            receives.append(inside > c)
            sends.append(size * (made & (inside == c)))
    if not receives:
        return np.zeros((count, count))
    return np.asarray(np.stack(receives, axis=1).astype(np.float64) @ np.stack(sends, axis=1).T)
