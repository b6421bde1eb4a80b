"""Each stage's input and output shapes for one micro-batch, from a run of the stage program
on fake tensors (no memory, no device time): what torch's ``PipelineStage`` sizes its
receive buffers from.

At build, the program runs on the example's first micro-batch (on the example itself where
a shape depends on tensor values). For a step whose inputs have other sizes (another
sequence length), it runs on fake inputs of those sizes and on fake copies of every
stage's parameters and buffers, so that what a rank holds by then (its own stages' weights,
FSDP's shards, the other stages' released to ``meta``) makes no difference.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensorMode,
)
from torch.func import functional_call
from torch.utils._pytree import tree_flatten, tree_map

from fxpipe.distributed.rank.split_backward import autograd_nodes
from fxpipe.distributed.rank.strides import Strides, layout_of
from fxpipe.errors import ConfigError
from fxpipe.ir import StageProgram

__all__ = ["Metas", "StageShapes", "example_shapes", "shapes_at", "meta_like", "tensors"]

#: A stage's inputs and outputs for one micro-batch, as ``meta`` tensors.
Metas = tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]
_Spec = tuple[tuple[int, ...], torch.dtype, bool]


@dataclass(frozen=True)
class StageShapes:
    """One micro-batch's boundary values, stage by stage.

    ``metas``: each stage's inputs and outputs; ``layouts``: the strides of each stage's
    tensor inputs as the earlier stages make them (torch's buffers are contiguous);
    ``idle``: per stage, whether it holds a trained Parameter its outputs do not depend on
    (only found at build); ``by_values``: the shapes depend on tensor values, so they were
    found on the example's own values and cannot be found for other sizes.
    """

    metas: tuple[Metas, ...]
    layouts: tuple[tuple[Strides, ...], ...]
    idle: tuple[bool, ...] = ()
    by_values: bool = False


def tensors(value: Any) -> list[torch.Tensor]:
    """The tensor leaves of a pytree, in order."""
    return [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]


def meta_like(t: torch.Tensor) -> torch.Tensor:
    """A ``meta`` tensor of ``t``'s shape, dtype and ``requires_grad``."""
    return _meta(_spec(t))


def example_shapes(
    model: nn.Module, program: StageProgram, values: tuple[Any, ...]
) -> StageShapes:
    """The shapes for the example's micro-batch ``values``: from a run on fake tensors, or,
    where an output's shape depends on tensor values (an ``.item()`` in a length check) and
    the example holds real ones, from a run on the example's micro-batch itself (its
    buffer updates undone). Also, per stage, whether it holds a trained Parameter its
    outputs do not depend on (one it reads for its dtype or shape alone), for which DDP
    must look each step."""
    saved = [(b, b.detach().clone()) for b in model.buffers() if not b.is_meta]
    by_values = False
    try:
        with torch.random.fork_rng(devices=[]):
            try:
                specs, idle, layouts = _chain_specs(program, values, fake=True)
            except (DataDependentOutputException, DynamicOutputShapeException) as e:
                if any(t.is_meta for t in tensors(values)):
                    raise ConfigError(
                        "a stage's output shape depends on tensor values "
                        f"({type(e).__name__}), which a model on 'meta' does not hold; "
                        "build the model with real weights, or make the shape not depend "
                        "on values"
                    ) from e
                specs, idle, layouts = _chain_specs(program, values, fake=False)
                by_values = True
    finally:
        with torch.no_grad():
            for b, value in saved:
                b.copy_(value)
    return StageShapes(_metas(specs), tuple(layouts), tuple(idle), by_values)


def shapes_at(program: StageProgram, values: tuple[Any, ...], device: torch.device) -> StageShapes:
    """The shapes for ``values`` (``meta`` tensors standing for tensors on ``device``),
    every stage run on fake copies of its parameters and buffers on ``device``; the
    modules themselves are left as they are."""
    with torch.random.fork_rng(devices=[]):
        specs, _, layouts = _chain_specs(program, values, fake=True, swap=device)
    return StageShapes(_metas(specs), tuple(layouts))


def _metas(specs: Sequence[tuple[list[_Spec], list[_Spec]]]) -> tuple[Metas, ...]:
    # Made outside the fake mode: a tensor made inside would keep the mode (and its weak
    # references to the model's tensors) alive.
    return tuple((tuple(map(_meta, a)), tuple(map(_meta, b))) for a, b in specs)


def _spec(t: torch.Tensor) -> _Spec:
    return tuple(t.shape), t.dtype, t.requires_grad


def _meta(spec: _Spec) -> torch.Tensor:
    shape, dtype, grad = spec
    t = torch.empty(shape, dtype=dtype, device="meta")
    return t.requires_grad_(grad) if t.is_floating_point() or t.is_complex() else t


def _chain_specs(
    program: StageProgram,
    values: tuple[Any, ...],
    *,
    fake: bool,
    swap: torch.device | None = None,
) -> tuple[list[tuple[list[_Spec], list[_Spec]]], list[bool], list[tuple[Strides, ...]]]:
    """Each stage's input and output specs, the stages run in turn on ``values`` (as fake
    tensors with ``fake``), with gradients on so that ``requires_grad`` is known; for
    each stage whether it holds a trained Parameter its outputs do not depend on (not
    with ``swap``); and the layouts of its tensor inputs. With ``swap``, ``values`` are
    ``meta`` tensors and every stage runs on fake parameters and buffers, all on ``swap``."""
    mode = FakeTensorMode(allow_non_fake_inputs=True) if fake else contextlib.nullcontext()
    specs, idle, layouts = [], [], []
    with mode, torch.enable_grad():
        if isinstance(mode, FakeTensorMode):
            if swap is not None:
                values = tree_map(lambda t: _fake(t, swap), values)  # made in the mode: fake
            else:
                values = tree_map(
                    lambda t: mode.from_tensor(t) if isinstance(t, torch.Tensor) else t, values
                )
        env = dict(zip(program.graph_inputs, values))
        for j, module in enumerate(program.modules):
            ins = [env[n] for n in program.inputs[j]]
            if swap is None:
                outs = module(*ins)
            else:
                outs = functional_call(module, _fake_state(module, swap), tuple(ins))
            env.update(zip(program.outputs[j], outs))
            names_in, names_out = program.inputs[j], program.outputs[j]
            specs.append((_specs(j, names_in, ins, j > 0), _specs(j, names_out, outs, True)))
            layouts.append(tuple(layout_of(t) for t in ins if isinstance(t, torch.Tensor)))
            if swap is None:
                used = _accumulated(tensors(outs), tensors(ins))
                trained = [p for p in module.parameters() if p.requires_grad]
                # the graph holds the Parameters themselves (a fake mode lets real ones in)
                idle.append(any(id(p) not in used for p in trained))
        del env, values, ins, outs
    return specs, idle, layouts


def _fake(t: Any, device: torch.device) -> Any:
    """A tensor like the ``meta`` tensor ``t`` on ``device`` (fake, in a fake mode)."""
    if not isinstance(t, torch.Tensor):
        return t
    out = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device)
    return out.requires_grad_(t.requires_grad) if t.requires_grad else out


def _fake_state(module: nn.Module, device: torch.device) -> dict[str, torch.Tensor]:
    """A fake tensor on ``device`` for every parameter and buffer name of ``module``, one
    per tensor (tied names share it), of the tensor's whole shape (a DTensor's global one)."""
    made: dict[int, torch.Tensor] = {}
    state = {}
    named = [*module.named_parameters(remove_duplicate=False)]
    for name, t in named + [*module.named_buffers(remove_duplicate=False)]:
        if id(t) not in made:
            grad = isinstance(t, nn.Parameter) and t.requires_grad
            like = torch.empty(tuple(t.shape), dtype=t.dtype, device="meta").requires_grad_(grad)
            made[id(t)] = _fake(like, device)
        state[name] = made[id(t)]
    return state


def _accumulated(outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor]) -> set[int]:
    """The ids of the leaf tensors whose gradients backward from a stage's ``outputs``
    accumulates, down to the stage's ``inputs`` (the earlier stages' graph is not its)."""
    nodes = autograd_nodes(outputs, stop_at=inputs)
    leaves = (getattr(node, "variable", None) for node in nodes)
    return {id(leaf) for leaf in leaves if isinstance(leaf, torch.Tensor)}


def _specs(j: int, names: Iterable[str], values: Iterable[Any], strict: bool) -> list[_Spec]:
    """Specs of the tensors among ``values``; with ``strict``, any other value is an error."""
    out = []
    for name, v in zip(names, values):
        if isinstance(v, torch.Tensor):
            out.append(_spec(v))
        elif strict:
            raise ConfigError(
                f"value {name!r} at stage {j} is a {type(v).__name__}, not a tensor; "
                "torch.distributed.pipelining passes only tensors between stages and to the "
                "loss: pass tensors between the model's layers and return tensors"
            )
    return out
