"""A plan the user writes, in torch's ``parallelize_module`` form (``{module path: style}``),
read as the cuts fxpipe's search may make: a product is cut column-wise only where the plan
names one of its weight's modules ``ColwiseParallel()``, a cut is contracted only by a
product named ``RowwiseParallel()``, an LM head's logits are gathered only where it is named
``ColwiseParallel(output_layouts=Replicate())``, and an embedding is cut by rows only where
it is named ``RowwiseParallel()``. Everything else stays whole. The search then proves the
named cuts as it proves its own (head counts, norms, stage borders); a named cut it cannot
make is refused with its reason (:func:`check_given`), never run otherwise than written.

Paths match as in ``parallelize_module``: atom by atom, each a shell pattern
(``model.layers.*.self_attn.q_proj``)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Any, Literal, TypeAlias

import torch.fx as fx
from torch import nn

from fxpipe.errors import ConfigError

__all__ = ["GivenPlan", "GivenStyle", "check_given", "given_plan"]

#: What a style lets the search do with the weights of the modules it names.
GivenStyle: TypeAlias = Literal["colwise", "rowwise", "gathered", "embedding"]

_REMEDY = (
    "use ColwiseParallel() for the first product of a pair, RowwiseParallel() for the "
    "second (and for an embedding cut by rows), ColwiseParallel(output_layouts=Replicate()) "
    "for an LM head; or pass tensor_parallel='auto'"
)


@dataclass(frozen=True)
class GivenPlan:
    """The user's plan: (path pattern, what its style allows), in the order given."""

    entries: tuple[tuple[str, GivenStyle], ...]

    def allowed(self, paths: Iterable[str]) -> set[GivenStyle]:
        """What the plan allows for a weight held by the modules at ``paths``."""
        return {style for path in paths for key, style in self.entries if _matches(key, path)}

    def on(self, gm: fx.GraphModule) -> Callable[[str], set[GivenStyle]]:
        """Parameter name -> what the plan allows it in ``gm`` (the modules holding each
        weight found in one pass over ``gm``, each weight's answer kept)."""
        holders = _weight_holders(gm)
        kept: dict[str, set[GivenStyle]] = {}

        def allowed(weight: str) -> set[GivenStyle]:
            if weight not in kept:
                kept[weight] = self.allowed(holders.get(weight, [weight.rpartition(".")[0]]))
            return kept[weight]

        return allowed


def given_plan(plan: object) -> GivenPlan:
    """``plan`` (``{module path: ColwiseParallel() | RowwiseParallel()}``) read; ConfigError
    for anything else, or for a style fxpipe does not run (sequence-parallel layouts, other
    styles)."""
    if not isinstance(plan, Mapping) or not plan:
        raise ConfigError(
            f"tensor_parallel={plan!r} is not a plan; pass 'auto', None, or a non-empty dict "
            "{module path: ColwiseParallel() | RowwiseParallel()} as parallelize_module takes"
        )
    entries: list[tuple[str, GivenStyle]] = []
    for key, style in plan.items():
        if not isinstance(key, str) or not key:
            raise ConfigError(
                f"tensor_parallel has the key {key!r}; each key is a module path of the model "
                "(a str, atoms may be shell patterns: 'model.layers.*.mlp.up_proj')"
            )
        entries.append((key, _allows(key, style)))
    return GivenPlan(tuple(entries))


def _allows(key: str, style: Any) -> GivenStyle:
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    inputs = tuple(getattr(style, "input_layouts", ()) or ())
    outputs = tuple(getattr(style, "output_layouts", ()) or ())
    if type(style) is ColwiseParallel and inputs == (Replicate(),):
        if outputs == (Replicate(),):
            return "gathered"
        if _last(outputs):  # the features cut, as fxpipe's search cuts them
            return "colwise"
    if type(style) is RowwiseParallel and outputs == (Replicate(),):
        if inputs == (Replicate(),):
            return "embedding"
        if _last(inputs):
            return "rowwise"
    raise ConfigError(
        f"tensor_parallel[{key!r}] = {style!r} is not run: fxpipe takes ColwiseParallel and "
        "RowwiseParallel with whole inputs and outputs between blocks (sequence-parallel "
        f"layouts and other styles are not done); {_REMEDY}"
    )


def _last(layouts: tuple[Any, ...]) -> bool:
    from torch.distributed.tensor import Shard

    return len(layouts) == 1 and isinstance(layouts[0], Shard) and layouts[0].dim == -1


def _matches(key: str, path: str) -> bool:
    atoms, parts = key.split("."), path.split(".")
    return len(atoms) == len(parts) and all(fnmatchcase(p, a) for a, p in zip(atoms, parts))


def _weight_holders(gm: fx.GraphModule) -> dict[str, list[str]]:
    """Parameter name -> its own prefix (export's graphs keep no modules) and the module
    paths of ``gm`` holding it as their ``weight`` (a tied one has several)."""
    by_id: dict[int, list[str]] = {}
    for path, module in gm.named_modules(remove_duplicate=False):
        weight = module._parameters.get("weight")
        if weight is not None:
            by_id.setdefault(id(weight), []).append(path)
    out: dict[str, list[str]] = {}
    for name, param in gm.named_parameters(remove_duplicate=False):
        own = name.rpartition(".")[0]
        out[name] = [own, *(p for p in by_id.get(id(param), []) if p != own)]
    return out


def check_given(
    given: GivenPlan,
    gm: fx.GraphModule,
    made: Mapping[str, tuple[str, bool, str, str]],
    allowed_of: Callable[[str], set[GivenStyle]],
) -> None:
    """ConfigError unless every key of ``given`` names a module of ``gm`` and every cut it
    names was made. ``made``: product or embedding node -> (its weight, whether it is an
    embedding, the style the plan gave it or "whole", why); ``allowed_of``:
    ``given.on(gm)``."""
    modules = dict(gm.named_modules(remove_duplicate=False))
    paths = set(modules) | {n.rpartition(".")[0] for n, _ in gm.named_parameters()}
    for key, style in given.entries:
        found = [p for p in paths if _matches(key, p)]
        if not found:
            raise ConfigError(
                f"tensor_parallel names {key!r}, which matches no module of the model; name "
                "the modules holding the weights (model.named_modules()), e.g. "
                "'model.layers.*.self_attn.q_proj'"
            )
        if style == "embedding" and any(isinstance(modules.get(p), nn.Linear) for p in found):
            raise ConfigError(
                f"tensor_parallel[{key!r}] is RowwiseParallel(input_layouts=Replicate()), "
                f"which cuts an embedding by rows, but {key!r} is an nn.Linear; {_REMEDY}"
            )
    looked_up = {weight for weight, lookup, _, _ in made.values() if lookup}
    for node, (weight, lookup, got, why) in made.items():
        allowed = allowed_of(weight)
        wanted = allowed & ({"embedding", "rowwise"} if lookup else _PRODUCT)
        if len(wanted) > 1:
            raise ConfigError(
                f"tensor_parallel cuts {weight.rpartition('.')[0]!r} both "
                f"{' and '.join(sorted(wanted))} (through the modules sharing {weight}); "
                f"name it once; {_REMEDY}"
            )
        if not lookup and "embedding" in allowed and weight not in looked_up:
            raise ConfigError(
                f"tensor_parallel cuts {weight.rpartition('.')[0]!r} as an embedding "
                "(RowwiseParallel(input_layouts=Replicate())), but it is a matrix product "
                f"(node {node}); {_REMEDY}"
            )
        what = next(iter(wanted), None)
        if what is not None and ("vocab" if lookup else _MADE[what]) != got:
            reason = why if got == "whole" else f"fxpipe's search cuts it {got}"
            raise ConfigError(
                f"tensor_parallel cuts {weight.rpartition('.')[0]!r} {what} (node {node}) but "
                f"fxpipe cannot run it so: {reason}. Leave it out of the plan (it then stays "
                "whole), or pass tensor_parallel='auto'"
            )


_PRODUCT: frozenset[GivenStyle] = frozenset({"colwise", "rowwise", "gathered"})
#: What the plan records for a node whose weight was given each style.
_MADE: dict[GivenStyle, str] = {
    "colwise": "colwise",
    "rowwise": "rowwise",
    "gathered": "gathered",
    "embedding": "vocab",
}
