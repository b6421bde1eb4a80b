"""The sweep in a dtype narrower than float64: the model's copies in that dtype (eager's and
fxpipe's) and eager on the model in float64, the reference both are measured against."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from benchmarks.harness.compare import Side
from benchmarks.harness.models.spec import Args, Kwargs, Spec
from benchmarks.harness.oracle import backward, eager_side, loss_weights, run_eager
from benchmarks.harness.prepare import map_tensors

__all__ = ["DTYPES", "BATCHED", "Wants", "dtype_name", "cast", "experts_of", "reference",
           "in_dtype", "reference_default", "narrow_weights", "narrow_eager"]  # fmt: skip

#: The dtypes the sweep runs in, by the name ``--dtype`` takes.
DTYPES: dict[str, torch.dtype] = {
    "float64": torch.float64,
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
}
#: The experts implementation of a Mixture-of-Experts model's float64 reference: transformers'
#: grouped products take no float64, its batched ones do (every expert on every token, weighted).
BATCHED = "batched_mm"


@dataclass
class Wants:
    """Eager in the run's dtype and eager in float64 (the reference) on the same inputs, and
    the projection weights eager's backward took (float64's, rounded to each leaf's dtype)."""

    eager: Side
    reference: Side
    weights: list[torch.Tensor | None]


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


def cast(tree: Any, dtype: torch.dtype) -> Any:
    """Every floating-point tensor of ``tree`` in ``dtype``."""
    return map_tensors(tree, lambda x: x.to(dtype) if x.is_floating_point() else x)


def experts_of(model: nn.Module) -> str | None:
    """The experts implementation of a transformers Mixture-of-Experts model whose experts
    take one (``"grouped_mm"``, ``"batched_mm"``, ``"eager"``); None for any other model."""
    config = getattr(model, "config", None)
    can_set = getattr(type(model), "_can_set_experts_implementation", None)
    if config is None or can_set is None or not can_set():
        return None
    return getattr(config, "_experts_implementation", None)


def reference(model: nn.Module) -> nn.Module:
    """``model`` (float64) made the reference: a Mixture-of-Experts model's experts switched to
    batched products (grouped ones take no float64), in place; ``model`` itself."""
    if experts_of(model) not in (None, BATCHED):
        model.set_experts_implementation(BATCHED)  # type: ignore[operator]
    return model


def in_dtype(model: nn.Module, dtype: torch.dtype, experts: str | None) -> nn.Module:
    """A deep copy of the float64 reference ``model`` in ``dtype``, its experts run by
    ``experts`` (the implementation it was built with; None: as the reference)."""
    narrow = copy.deepcopy(model).to(dtype)
    if experts is not None and experts_of(narrow) != experts:
        narrow.set_experts_implementation(experts)  # type: ignore[operator]
    return narrow


@contextlib.contextmanager
def reference_default(spec: Spec) -> Iterator[None]:
    """torch's default dtype while the float64 reference runs: float64 for a model built so
    (its code makes a float32 scalar of its own dtype's ``finfo.min``), else float32, as
    the copies in the run's dtype run."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64 if spec.default_double else torch.float32)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


def narrow_weights(reference_output: Any, output: Any) -> list[torch.Tensor | None]:
    """The reference's projection weights (:func:`loss_weights` of its outputs), each rounded
    to the dtype of ``output``'s leaf in its place, so that both sides weigh alike."""
    leaves = tree_flatten(output)[0]
    weights = loss_weights(reference_output)
    if len(leaves) != len(weights):
        raise ValueError(f"{len(leaves)} output leaves, float64 eager's {len(weights)}")
    return [
        w.to(x.dtype) if w is not None and isinstance(x, torch.Tensor) else None
        for w, x in zip(weights, leaves)
    ]


def narrow_eager(
    spec: Spec,
    model: nn.Module,
    inputs: tuple[Args, Kwargs],
    dtype: torch.dtype,
    experts: str | None,
    train: bool,
    chunks: int | None,
    counts: torch.Tensor | None = None,
) -> Wants:
    """Eager on the float64 reference ``model`` and on its copy in ``dtype`` (floating inputs
    cast to it), on the whole batch or (``chunks``) on its micro-batches, each backward
    through the same projection: outputs, gradients and buffers of each."""
    with reference_default(spec):
        ref = eager_side(model, inputs, train, chunks, counts)
    oracle = in_dtype(model, dtype, experts).train(train)
    output = run_eager(oracle, *cast(inputs, dtype), chunks, counts)
    weights = narrow_weights(ref.output, output)
    return Wants(backward(oracle, output, weights), ref, weights)
