"""GPipe checkpointing, split into ``Checkpoint`` (forward without grad) and ``Recompute``.

``torch.utils.checkpoint`` recomputes a segment only when its output gradient arrives. GPipe
wants the recomputation to start earlier, while that gradient is still on its way from the
next device, so the work is split in two autograd Functions that share one
:class:`_Recomputation`::

    phony, inputs ──► Checkpoint ──► out0 ──Fork──► out0' ──Join──► out0''
                                               └──► Recompute ─┘
                                                  (saves inputs)

In backward ``Join`` hands the phony gradient to ``Recompute`` at once, which reruns the
stage with grad enabled and the forward's RNG state; ``Fork`` then passes out0's gradient
to ``Checkpoint``, which backpropagates through the recomputed outputs.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from operator import attrgetter
from typing import Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils._pytree import TreeSpec, tree_flatten, tree_unflatten

from fxpipe.model_state import preserved
from fxpipe.runtime.dependency import fork, join
from fxpipe.runtime.phony import get_phony
from fxpipe.runtime.spans import SpanFactory, no_span
from fxpipe.runtime.stream import normalize_device, use_device
from fxpipe.runtime.worker import ThreadState, capture_thread_state

__all__ = [
    "is_checkpointing",
    "is_recomputing",
    "Checkpointing",
    "Checkpoint",
    "Recompute",
    "RNGState",
    "save_rng",
    "restore_rng",
]

Tensors = tuple[torch.Tensor, ...]
RNGState = tuple[torch.Tensor, torch.Tensor | None]


class _Flags(threading.local):
    checkpointing = False
    recomputing = False


_flags = _Flags()


def is_checkpointing() -> bool:
    """Whether this thread is in the first, gradient-free forward of a checkpointed stage."""
    return _flags.checkpointing


def is_recomputing() -> bool:
    """Whether this thread is recomputing a checkpointed stage for its backward."""
    return _flags.recomputing


@contextmanager
def _flag(name: str) -> Iterator[None]:
    previous = getattr(_flags, name)
    setattr(_flags, name, True)
    try:
        yield
    finally:
        setattr(_flags, name, previous)


def save_rng(device: torch.device) -> RNGState:
    """The CPU generator's state, and ``device``'s where it is a CUDA device."""
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


@contextmanager
def restore_rng(device: torch.device, state: RNGState) -> Iterator[None]:
    """Run the block from ``state``; the RNG state outside the block is left as it was."""
    cpu, cuda = state
    with torch.random.fork_rng(devices=[device] if cuda is not None else []):
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state(cuda, device)
        yield


def _buffer_versions(function: Callable[..., Any]) -> list[tuple[torch.Tensor, int]]:
    if not isinstance(function, nn.Module):
        return []
    return [(b, b._version) for b in function.buffers()]


def _needs_grad(rec: _Recomputation) -> bool:
    """Whether the stage's outputs can carry a gradient: an input or a tensor the stage
    holds needs one (any callable that is not a module may hold such tensors)."""
    if any(x.requires_grad for x in rec.in_tensors):
        return True
    function = rec.function
    if not isinstance(function, nn.Module):
        return True
    return any(t.requires_grad for t in _held_tensors(function))


def _held_tensors(module: nn.Module) -> Iterator[torch.Tensor]:
    """Every tensor ``module`` and its submodules hold: parameters, buffers and plain
    tensor attributes (a tensor that requires grad need not be a Parameter)."""
    yield from module.parameters()
    yield from module.buffers()
    for m in module.modules():
        yield from (v for v in vars(m).values() if isinstance(v, torch.Tensor))


def _batch_norm_buffers(function: Callable[..., Any]) -> list[torch.Tensor]:
    """Buffers a graph passes to a batch-norm op (which updates them without bumping their
    version counter): the running statistics of a graph from torch.export."""
    if not isinstance(function, torch.fx.GraphModule):
        return []
    buffers = {id(b): b for b in function.buffers()}
    found: dict[int, torch.Tensor] = {}
    for node in function.graph.nodes:
        if node.op == "call_function" and "batch_norm" in str(node.target):
            for arg in node.all_input_nodes:
                value = attrgetter(str(arg.target))(function) if arg.op == "get_attr" else None
                if isinstance(value, torch.Tensor) and id(value) in buffers:
                    found[id(value)] = value
    return list(found.values())


def _keep_batch_norm_stats(
    function: Callable[..., Any], written: Sequence[torch.Tensor] = ()
) -> preserved:
    """Undo the running-statistics update of every BatchNorm the recomputation runs.

    A BatchNorm in training updates its buffers in place on every call; the first forward
    already did, so the recomputation must not do it again. The same holds for the other
    ``written`` buffers the first forward changed (a graph from torch.export updates
    BatchNorm statistics through plain ops). (Other layers with side effects can check
    :func:`is_recomputing`.) The values go back through ``.data``: the recomputed graph
    saved these buffers, and a version bump would fail its backward.
    """
    buffers = list(written)
    if isinstance(function, nn.Module):
        for module in function.modules():
            if isinstance(module, _BatchNorm) and module.training:
                stats = (module.running_mean, module.running_var, module.num_batches_tracked)
                buffers.extend(b for b in stats if b is not None)
    return preserved(None, buffers=buffers, rng=False, structure=False)


def _is_float(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.is_floating_point()


#: Stands for a tensor leaf of a stage's outputs.
_TENSOR = object()


class _Recomputation:
    """What the Checkpoint and the Recompute of one stage call share."""

    def __init__(
        self,
        function: Callable[..., Sequence[Any]],
        args: tuple[Any, ...],
        device: torch.device,
        no_grad: frozenset[int] = frozenset(),
    ) -> None:
        self.function = function
        self.no_grad = no_grad
        #: Per tensor the first run returns, whether it never carries a gradient.
        self.constant: list[bool] = []
        self.device = normalize_device(device)
        leaves, self.in_spec = tree_flatten(args)
        self.in_leaves = leaves
        self.in_tensors: Tensors = tuple(x for x in leaves if isinstance(x, torch.Tensor))
        self.out_spec: TreeSpec | None = None
        self.out_leaves: list[Any] = []
        self.rng: RNGState | None = None
        self.state: ThreadState | None = None
        #: ``(recomputed output tensors, detached input tensors)`` between the two backwards.
        self.result: tuple[Tensors, Tensors] | None = None
        #: Buffers the first forward wrote into; the recomputation leaves them as they are.
        self.written: list[torch.Tensor] = []
        #: Times the recompute and the backward (a recorder's, while one is attached).
        self.span: SpanFactory = no_span

    def timed(self, phase: str, function: Callable[..., Any], *args: Any) -> Any:
        """``function(*args)``, timed as ``phase`` when a recorder is attached."""
        with self.span(phase):
            return function(*args)

    def call(self, tensors: Sequence[torch.Tensor]) -> Any:
        """Run the function on the saved arguments with ``tensors`` as their tensor leaves."""
        it = iter(tensors)
        leaves = [next(it) if isinstance(x, torch.Tensor) else x for x in self.in_leaves]
        return self.function(*tree_unflatten(leaves, self.in_spec))

    def run_first(self, tensors: Sequence[torch.Tensor]) -> Tensors:
        """The gradient-free forward: remember RNG and autocast, return detached outputs."""
        self.rng = save_rng(self.device)
        self.state = dataclasses.replace(capture_thread_state(), grad_enabled=True)
        versions = _buffer_versions(self.function)
        with torch.no_grad(), _flag("checkpointing"):
            outputs = self.call(tensors)
        self.written = [b for b, version in versions if b._version != version]
        self.written += _batch_norm_buffers(self.function)
        leaves, self.out_spec = tree_flatten(outputs)
        # Only the non-tensor leaves are kept: the tensors leave through the Function.
        self.out_leaves = [_TENSOR if isinstance(x, torch.Tensor) else x for x in leaves]
        self.constant = _constant_tensors(outputs, self.no_grad)
        return tuple(x.detach() for x in leaves if isinstance(x, torch.Tensor))

    def outputs(self, tensors: Sequence[torch.Tensor]) -> Any:
        """The stage's outputs with ``tensors`` in place of its tensor leaves."""
        assert self.out_spec is not None
        it = iter(tensors)
        leaves = [next(it) if x is _TENSOR else x for x in self.out_leaves]
        return tree_unflatten(leaves, self.out_spec)

    def recompute(self, tensors: Sequence[torch.Tensor]) -> None:
        """Rerun the stage with grad enabled and the first forward's RNG state."""
        assert self.rng is not None and self.state is not None
        inputs = tuple(x.detach().requires_grad_(x.requires_grad) for x in tensors)
        with restore_rng(self.device, self.rng), self.state.enter(), _flag("recomputing"):
            with use_device(self.device), _keep_batch_norm_stats(self.function, self.written):
                outputs = self.call(inputs)
        leaves = tree_flatten(outputs)[0]
        self.result = tuple(x for x in leaves if isinstance(x, torch.Tensor)), inputs


def _backward(outputs: Tensors, grads: Sequence[torch.Tensor | None]) -> None:
    """Backpropagate ``grads`` through the ``outputs`` that require grad and got one (an
    output no loss reached gets ``None``, so the parameters behind it keep ``grad=None``)."""
    pairs = [
        (y, g) for y, g in zip(outputs, grads, strict=True) if y.requires_grad and g is not None
    ]
    if pairs:
        torch.autograd.backward([y for y, _ in pairs], [g for _, g in pairs])


class Checkpoint(torch.autograd.Function):
    """Run a stage without grad; in backward, backpropagate through its recomputation."""

    @staticmethod
    def forward(
        ctx: Any, phony: torch.Tensor, rec: _Recomputation, *tensors: torch.Tensor
    ) -> Tensors:
        ctx.rec = rec
        ctx.save_for_backward(*tensors)
        ctx.set_materialize_grads(False)
        outputs = rec.run_first(tensors)
        # integers, and values the program says never carry a gradient (a histogram of the
        # batch): a run without grad cannot tell them, and the next stage's recompute would
        # take them for differentiable
        constants = [
            x
            for x, constant in zip(outputs, rec.constant, strict=True)
            if constant or not (x.is_floating_point() or x.is_complex())
        ]
        if constants:
            ctx.mark_non_differentiable(*constants)
        return outputs

    @staticmethod
    def backward(ctx: Any, *grad_outputs: torch.Tensor) -> tuple[Any, ...]:  # pragma: no cover
        rec: _Recomputation = ctx.rec
        if rec.result is None:
            # Recompute did not run first (its output was not on the way to the loss).
            rec.timed("recompute", rec.recompute, ctx.saved_tensors)
        assert rec.result is not None
        outputs, inputs = rec.result
        rec.result = None
        rec.timed("backward", _backward, outputs, grad_outputs)
        grads = [x.grad if x.requires_grad else None for x in inputs]
        return (None, None, *grads)


class Recompute(torch.autograd.Function):
    """A phony identity whose backward recomputes the stage before Checkpoint's backward."""

    @staticmethod
    def forward(
        ctx: Any, phony: torch.Tensor, rec: _Recomputation, *tensors: torch.Tensor
    ) -> torch.Tensor:
        ctx.rec = rec
        ctx.save_for_backward(*tensors)
        return phony.detach()

    @staticmethod
    def backward(ctx: Any, grad_phony: torch.Tensor) -> tuple[Any, ...]:  # pragma: no cover
        rec: _Recomputation = ctx.rec
        rec.timed("recompute", rec.recompute, ctx.saved_tensors)
        return (None, None, *(None for _ in ctx.saved_tensors))


def _constant_tensors(outputs: Any, no_grad: frozenset[int]) -> list[bool]:
    """Per tensor leaf of ``outputs``, whether it is inside an item at a position of
    ``no_grad`` (``outputs`` a tuple or list of items; else none is)."""
    if not isinstance(outputs, (tuple, list)):
        return [False] * sum(isinstance(x, torch.Tensor) for x in tree_flatten(outputs)[0])
    marks: list[bool] = []
    for k, item in enumerate(outputs):
        tensors = sum(isinstance(x, torch.Tensor) for x in tree_flatten(item)[0])
        marks += [k in no_grad] * tensors
    return marks


_checkpoint: Callable[..., Tensors] = Checkpoint.apply
_recompute: Callable[..., torch.Tensor] = Recompute.apply


class Checkpointing:
    """Checkpoint one call of a stage: ``checkpoint()`` in a worker, ``recompute()`` after.

    ``function(*args)`` returns a tuple of values (or any pytree); ``args`` and the outputs
    may hold non-tensor leaves and tensors that do not require grad.
    """

    def __init__(
        self,
        function: Callable[..., Sequence[Any]],
        args: tuple[Any, ...],
        device: torch.device | str = "cpu",
        no_grad: frozenset[int] = frozenset(),
    ) -> None:
        """``no_grad``: the positions of ``function``'s outputs (a tuple) that never carry
        a gradient (:attr:`fxpipe.ir.StageProgram.no_grad`)."""
        self._rec = _Recomputation(function, args, torch.device(device), no_grad)

    def time_with(self, span: SpanFactory) -> None:
        """Time the recompute and the backward of this call with ``span`` (recording)."""
        self._rec.span = span

    def checkpoint(self) -> Any:
        """Run the stage without keeping activations; returns its outputs."""
        rec = self._rec
        # A phony that requires grad keeps Checkpoint in the graph even when no input
        # requires grad (the stage's parameters are not inputs of the Function); a stage
        # with neither gives outputs that do not require grad, as it would unpipelined.
        phony = get_phony(rec.device, requires_grad=_needs_grad(rec))
        tensors: Tensors = _checkpoint(phony, rec, *rec.in_tensors)
        return rec.outputs(tensors)

    def recompute(self, outputs: Any) -> Any:
        """Attach Recompute to ``outputs`` so that it runs before Checkpoint's backward."""
        leaves, spec = tree_flatten(outputs)
        k = next((k for k, x in enumerate(leaves) if _is_float(x) and x.requires_grad), None)
        if k is None:
            return outputs
        output, phony = fork(leaves[k])
        phony = _recompute(phony, self._rec, *self._rec.in_tensors)
        leaves[k] = join(output, phony)
        return tree_unflatten(leaves, spec)
