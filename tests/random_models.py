"""Random non-Sequential models for property tests, and the Hypothesis strategy that draws them.

A model is a list of ops over values; value 0 is the input and every op appends one value of
shape ``(batch, WIDTH)``. Ops read any earlier value, so the graphs have branches, skip
connections of any length, values read by several consumers, add / product / concat joins,
p=0 dropout, and in-place writes. The model returns one value, a tuple or a dict.

In-place writes are kept valid in eager PyTorch: ``fresh`` makes a copy that nothing has saved
for backward; until it is written, only ops that save no input (``add``, ``cat``, ``scale``)
may read it; ``write`` then modifies it in place (``relu_``, ``add_``, ``mul_``, ``sigmoid_``
or ``nn.ReLU(inplace=True)``), so readers placed before the write see the old value and
readers after it (through either name) see the new one, as in the eager model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from hypothesis import strategies as st
from torch import nn

__all__ = ["WIDTH", "Op", "Spec", "RandomNet", "specs"]

WIDTH = 6
ACTIVATIONS = ("tanh", "relu", "gelu", "sigmoid")
WRITES = ("relu_", "add_", "mul_", "sigmoid_", "relu_module")
#: Ops whose backward needs their inputs: they must not read a value written later.
SAVING = frozenset({"linear", "act", "mul", "dropout"})


@dataclass(frozen=True)
class Op:
    """One op: what it does, which earlier values it reads, and its variant."""

    kind: str
    inputs: tuple[int, ...]
    variant: str = ""


@dataclass(frozen=True)
class Spec:
    """A whole model: its ops and which values it returns, as what."""

    ops: tuple[Op, ...]
    outputs: tuple[int, ...]
    #: "tensor" (one value), "tuple" or "dict".
    output_kind: str

    def __str__(self) -> str:
        lines = [
            f"v{k + 1} = {op.kind}{'/' + op.variant if op.variant else ''}"
            f"({', '.join(f'v{i}' for i in op.inputs)})"
            for k, op in enumerate(self.ops)
        ]
        outs = ", ".join(f"v{i}" for i in self.outputs)
        return "; ".join(lines) + f"; return {self.output_kind}({outs})"


class RandomNet(nn.Module):
    """The model a :class:`Spec` describes (fx-traceable: the loop runs on constants)."""

    def __init__(self, spec: Spec) -> None:
        super().__init__()
        self.spec = spec
        self.layers = nn.ModuleDict()
        for k, op in enumerate(spec.ops):
            if op.kind == "linear":
                self.layers[f"op{k}"] = nn.Linear(WIDTH, WIDTH)
            elif op.kind == "cat":
                self.layers[f"op{k}"] = nn.Linear(2 * WIDTH, WIDTH)
            elif op.kind == "dropout":
                self.layers[f"op{k}"] = nn.Dropout(0.0)
            elif op.kind == "write" and op.variant == "relu_module":
                self.layers[f"op{k}"] = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> Any:
        values = [x]
        for k, op in enumerate(self.spec.ops):
            values.append(self._run_op(k, op, [values[i] for i in op.inputs]))
        outs = [values[i] for i in self.spec.outputs]
        if self.spec.output_kind == "tensor":
            return outs[0]
        if self.spec.output_kind == "tuple":
            return tuple(outs)
        return {f"out{k}": v for k, v in enumerate(outs)}

    def _run_op(self, k: int, op: Op, args: list[torch.Tensor]) -> torch.Tensor:
        layer = self.layers[f"op{k}"] if f"op{k}" in self.layers else None
        if op.kind in ("linear", "dropout"):
            return layer(args[0])  # type: ignore[misc]
        if op.kind == "act":
            return getattr(F, op.variant)(args[0])  # type: ignore[no-any-return]
        if op.kind == "add":
            return args[0] + args[1]
        if op.kind == "mul":
            return args[0] * args[1]
        if op.kind == "cat":
            return layer(torch.cat([args[0], args[1]], dim=1))  # type: ignore[misc]
        if op.kind == "scale":
            return args[0] * 0.5
        if op.kind == "fresh":
            return args[0] * 1.0
        return _write(args[0], op.variant, layer)


def _write(value: torch.Tensor, variant: str, layer: nn.Module | None) -> torch.Tensor:
    if variant == "relu_module":
        return layer(value)  # type: ignore[misc, no-any-return]
    if variant == "add_":
        return value.add_(1.0)
    if variant == "mul_":
        return value.mul_(0.5)
    if variant == "sigmoid_":
        return value.sigmoid_()
    return value.relu_()


@st.composite
def specs(draw: st.DrawFn, max_ops: int = 14, with_writes: bool = True) -> Spec:
    """A random :class:`Spec` of 2 to ``max_ops`` ops."""
    count = draw(st.sampled_from(range(2, max_ops + 1)))
    ops: list[Op] = []
    fresh: set[int] = set()  # values not yet written that no saving op has read
    kinds = ["linear", "linear", "act", "add", "mul", "cat", "scale", "dropout"]
    if with_writes:
        kinds += ["fresh", "fresh", "write", "write"]
    for k in range(count):
        values = k + 1
        kind = draw(st.sampled_from(kinds))
        if kind == "write" and not fresh:
            kind = "fresh"
        settled = [i for i in range(values) if i not in fresh]
        arity = 2 if kind in ("add", "mul", "cat") else 1
        if kind == "write":
            pool = sorted(fresh)
        elif kind in SAVING:
            pool = settled
        else:
            pool = list(range(values))
        # Prefer recent values (a chain), but reach back anywhere (skips of any length).
        inputs = tuple(draw(_pick(pool)) for _ in range(arity))
        variant = ""
        if kind == "act":
            variant = draw(st.sampled_from(ACTIVATIONS))
        elif kind == "write":
            variant = draw(st.sampled_from(WRITES))
            fresh.discard(inputs[0])
        if kind == "fresh":
            fresh.add(values)
        ops.append(Op(kind, inputs, variant))
    last = len(ops)
    extra = draw(st.lists(st.integers(1, last), max_size=2, unique=True))
    outputs = tuple(dict.fromkeys([last, *extra]))
    output_kind = "tensor" if len(outputs) == 1 else draw(st.sampled_from(("tuple", "dict")))
    return Spec(tuple(ops), outputs, output_kind)


def _pick(pool: list[int]) -> st.SearchStrategy[int]:
    recent = pool[-2:]
    return st.one_of(st.sampled_from(recent), st.sampled_from(pool))
