"""The tensor-parallel plan as frozen records: how each parameter and value is cut over the
ranks of a ``"tp"`` mesh dimension, the groups of products that share a cut, and the
shard fraction of each decoder block."""

from __future__ import annotations

import math
import textwrap
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Literal, TypeAlias

import torch

__all__ = [
    "Shard",
    "Layout",
    "Style",
    "NodeStyle",
    "GroupKind",
    "ParamShard",
    "ShardGroup",
    "TensorPlan",
    "block_of",
]

#: How a parameter is held over the tp ranks: cut by output features (``colwise``), by
#: input features (``rowwise``, its product's partial sums all-reduced), an embedding cut
#: over its rows (``vocab``, its lookups all-reduced), or whole on every rank.
Style: TypeAlias = Literal["colwise", "rowwise", "vocab", "replicated"]
#: What a product or embedding node computes on each rank: its share of the output
#: features (``colwise``), a partial sum then all-reduced (``rowwise``), its share of the
#: output features then all-gathered (``gathered``: an LM head whose logits leave whole), or
#: the lookups of its own rows, then all-reduced (``vocab``).
NodeStyle: TypeAlias = Literal["colwise", "rowwise", "gathered", "vocab"]
#: What a group of nodes sharing one cut is: attention (the features viewed as heads), a
#: feed-forward pair, an embedding, an LM head.
GroupKind: TypeAlias = Literal["attention", "mlp", "embedding", "lm_head"]


#: Width the printed plan wraps its long lines at.
_WIDTH = 100


@dataclass(frozen=True, slots=True)
class Shard:
    """A tensor cut along ``dim`` over the tp ranks: the dimension is ``blocks`` equal
    consecutive parts, each cut into tp equal pieces, and rank r holds piece r of every
    part (``blocks=1``: one contiguous piece per rank; a fused q, k, v weight: 3)."""

    dim: int
    blocks: int = 1

    def take(self, tensor: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
        """Rank ``rank``'s piece of ``tensor`` (differentiable: a gradient flows back to
        the whole tensor)."""
        dim, size = self.dim, tensor.shape[self.dim]
        piece = size // (self.blocks * tp)
        shape = (*tensor.shape[:dim], self.blocks, tp, piece, *tensor.shape[dim + 1 :])
        return tensor.reshape(shape).select(dim + 1, rank).flatten(dim, dim + 1)


#: The cut of one node's output: one Shard, or one entry per item where the node returns
#: several tensors (a split), None for an item left whole.
Layout: TypeAlias = Shard | tuple[Shard | None, ...]


@dataclass(frozen=True, slots=True)
class ParamShard:
    """How one parameter is held over the tp ranks, and why."""

    #: The parameter's name in the model (as the graph's ``get_attr`` or module reads it).
    name: str
    style: Style
    #: The cut of the parameter; None where it is whole on every rank (replicated, and the
    #: bias of a row-wise product, added once after the all-reduce).
    shard: Shard | None
    #: Why it is held so: the group it belongs to, or why it could not be cut.
    reason: str
    #: The parameter's sizes.
    shape: tuple[int, ...]
    #: Whether a matrix product (a linear layer, not an embedding) reads it.
    product: bool
    #: The nodes that read it (their stages are where it lives).
    readers: tuple[str, ...] = ()

    @property
    def numel(self) -> int:
        """Elements of the parameter."""
        return math.prod(self.shape)


@dataclass(frozen=True, slots=True)
class ShardGroup:
    """Nodes that share one cut: column-wise products whose output features flow, through
    element-wise ops, head splits and attention, into row-wise products that contract them
    (a Megatron pair); or one embedding or LM head."""

    kind: GroupKind
    #: Product nodes cut by output features (an LM head: then all-gathered).
    columns: tuple[str, ...]
    #: Product nodes cut by input features, each followed by an all-reduce (an embedding:
    #: the lookup node).
    rows: tuple[str, ...]
    #: The head counts the cut features are viewed as (each a multiple of tp).
    heads: tuple[int, ...]
    #: The parameters of the group, by name.
    params: tuple[str, ...]


@dataclass(frozen=True)
class TensorPlan:
    """How one graph (a whole model or one stage) runs over ``tp`` ranks; compile-time
    data. Every value not in ``layouts`` is whole on every rank."""

    tp: int
    #: Every parameter the graph reads, by name.
    params: Mapping[str, ParamShard]
    groups: tuple[ShardGroup, ...]
    #: Node name -> the cut of its output, for every value held in pieces.
    layouts: Mapping[str, Layout]
    #: Product and embedding node name -> what it computes on each rank (cut nodes only).
    node_styles: Mapping[str, NodeStyle]
    #: Product and embedding node name -> the weight it reads (cut nodes only).
    node_weights: Mapping[str, str]
    #: Product node name -> why it is left whole.
    replicated: Mapping[str, str]
    #: Node name -> stage index, where the plan was made for a pipeline's stages.
    stage_of: Mapping[str, int] = field(default_factory=dict)
    #: Node name -> the dimension its output is cut along, for every value held cut along
    #: the sequence (sequence parallelism, :mod:`fxpipe.passes.tensor.sequence`); the
    #: row-wise products and embeddings among them reduce-scatter instead of all-reducing.
    sequence: Mapping[str, int] = field(default_factory=dict)
    #: Sequence-cut value -> the nodes that read it whole (it is all-gathered once first).
    sequence_gathers: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    #: Why the regions that could be cut along the sequence are not, one line each.
    sequence_declined: tuple[str, ...] = ()
    #: Product node -> the value it reads unflattened where it reads the tokens flattened
    #: (transformers' ``Conv1D``) and starts or ends a region: its flattening view is then
    #: skipped, so that its output or input is laid out by sequence.
    unflattened: Mapping[str, str] = field(default_factory=dict)
    #: Whole value with a gradient -> the cut nodes that read it: each rank's gradient
    #: through those reads is a partial sum, summed over the tp ranks
    #: (:mod:`fxpipe.passes.tensor.partial`).
    partial_reads: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    #: Cut node calling a norm module -> the module's parameters, read alike.
    partial_modules: Mapping[str, tuple[str, ...]] = field(default_factory=dict)

    def block_fractions(self, held: Collection[str] | None = None) -> dict[str, float]:
        """Decoder block (``model.layers.0``) -> the fraction of its matrix products'
        parameter elements that are cut (a row-wise product's bias is whole); of the blocks
        whose parameters ``held`` names (one rank's stages), where given."""
        total: dict[str, int] = {}
        cut: dict[str, int] = {}
        for p in self.params.values():
            block = block_of(p.name)
            if not p.product or block is None or (held is not None and p.name not in held):
                continue
            total[block] = total.get(block, 0) + p.numel
            cut[block] = cut.get(block, 0) + (p.numel if p.shard is not None else 0)
        return {b: cut[b] / total[b] for b in total if total[b]}

    def stages(self) -> list[int]:
        """The stages the plan covers, in order ([0] for a graph planned whole)."""
        return sorted(set(self.stage_of.values())) or [0]

    def summary(self) -> str:
        """What is cut how, per stage: a text a person reads."""
        products = [s for s in self.node_styles.values() if s != "vocab"]
        lines = [
            f"tensor-parallel plan over tp={self.tp}: {len(products)} of "
            f"{len(products) + len(self.replicated)} matrix products cut, in "
            f"{len(self.groups)} groups"
        ]
        stages = self.stages()
        for j in stages:
            if len(stages) > 1:
                lines.append(f"stage {j}")
            lines += ["  " + self._group_line(g) for g in self.groups if self._stage(g) == j]
            lines += ["  " + line for line in self._sequence_lines(j)]
            lines += ["  " + line for line in self._whole_lines(j)]
        fractions = self.block_fractions()
        if fractions:
            shown = ", ".join(f"{b} {100 * f:.1f}%" for b, f in fractions.items())
            lines.append(f"cut share of each block's matrix-product parameters: {shown}")
        return "\n".join(lines)

    def _stage(self, group: ShardGroup) -> int:
        first = (group.columns or group.rows)[0]
        return self.stage_of.get(first, 0)

    def _group_line(self, g: ShardGroup) -> str:
        if g.kind in ("embedding", "lm_head"):
            p = self.params[g.params[0]]
            vocab = p.shape[0]
            what = "lookups all-reduced" if g.kind == "embedding" else "logits all-gathered"
            if g.kind == "embedding" and g.rows and g.rows[0] in self.sequence:
                what = "lookups reduce-scattered along the sequence"
            kind = "embedding" if g.kind == "embedding" else "lm head"
            each = vocab // self.tp
            return f"{kind:<10} {p.name}: {vocab} vocabulary rows -> {each} per rank, {what}"
        names = [n.removesuffix(".weight").removesuffix(".bias") for n in g.params]
        prefix = _common_prefix(names)
        columns: list[str] = []
        rows: list[str] = []
        for name, short in zip(g.params, names):
            kept = columns if self.params[name].style == "colwise" else rows
            label = short[len(prefix) :].lstrip(".") or short
            blocks = self.params[name].shard
            if blocks is not None and blocks.blocks > 1:
                label += f" (in {blocks.blocks} parts)"
            if label not in kept:
                kept.append(label)
        heads = ""
        if g.heads:
            counts = ", ".join(str(h) for h in g.heads)
            shares = ", ".join(str(h // self.tp) for h in g.heads)
            heads = f"; heads {counts} -> {shares} per rank"
        reduced = "reduce-scatter" if all(r in self.sequence for r in g.rows) else "all-reduce"
        return (
            f"{g.kind:<10} {prefix or '(root)'}: colwise {', '.join(columns)} -> rowwise "
            f"{', '.join(rows)} + {reduced}{heads}"
        )

    def _sequence_lines(self, stage: int) -> list[str]:
        """What ``stage`` holds cut along the sequence, in one line."""
        mine = [n for n in self.sequence if self.stage_of.get(n, 0) == stage]
        if not mine:
            declined = self.sequence_declined if stage == self.stages()[0] else ()
            return [
                textwrap.fill(
                    f"{'sequence':<10} not cut: {why}", width=_WIDTH, subsequent_indent=" " * 13
                )
                for why in declined
            ]
        scattered = [n for n in mine if n in self.node_styles]
        gathered = [n for n in self.sequence_gathers if self.stage_of.get(n, 0) == stage]
        dims = sorted({self.sequence[n] for n in mine})
        text = (
            f"{'sequence':<10} {len(mine)} values between row-wise and column-wise products "
            f"cut along dim {', '.join(map(str, dims))} (the sequence): {len(scattered)} "
            f"reduce-scatters ({', '.join(scattered)}) in place of all-reduces, "
            f"{len(gathered)} all-gathers ({', '.join(gathered)})"
        )
        return [
            textwrap.fill(text, width=_WIDTH, subsequent_indent=" " * 13, break_on_hyphens=False)
        ]

    def _whole_lines(self, stage: int) -> list[str]:
        """The parameters of ``stage`` left whole, one line per reason."""
        by_reason: dict[str, list[str]] = {}
        for p in self.params.values():
            if p.style != "replicated":
                continue
            here = {self.stage_of.get(r, 0) for r in p.readers} or {0}
            if min(here) == stage:
                by_reason.setdefault(p.reason, []).append(p.name)
        return [
            textwrap.fill(
                f"{'whole':<10} {', '.join(names)}: {why}",
                width=_WIDTH,
                subsequent_indent=" " * 13,
                break_on_hyphens=False,
            )
            for why, names in by_reason.items()
        ]

    def __str__(self) -> str:
        return self.summary()


def block_of(name: str) -> str | None:
    """The decoder block a parameter name is in: its path up to the first numbered part
    (``model.layers.0`` for ``model.layers.0.mlp.up_proj.weight``); None outside any."""
    parts = name.split(".")
    for k, part in enumerate(parts[:-1]):
        if part.isdigit():
            return ".".join(parts[: k + 1])
    return None


def _common_prefix(names: list[str]) -> str:
    """The longest dotted path every name starts with."""
    parts = [n.split(".") for n in names]
    common: list[str] = []
    for level in zip(*parts):
        if len(set(level)) != 1:
            break
        common.append(level[0])
    return ".".join(common)
