"""``fxpipe.plan`` and ``fxpipe.pipeline``: the one place the passes meet the runtime."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensorMode
from torch.utils._pytree import tree_flatten_with_path, tree_map

from fxpipe.binding import argument_name
from fxpipe.devices import device_capacity, normalize_devices, parse_device
from fxpipe.errors import ConfigError, DeviceError, InputError, PlanError
from fxpipe.ir import PipelinePlan, StageProgram
from fxpipe.passes.cost_model import COST_MODES, estimate_costs
from fxpipe.passes.nx_graph import to_networkx
from fxpipe.passes.ops import op_name
from fxpipe.passes.partition import partition_graph
from fxpipe.passes.plan import build_plan
from fxpipe.passes.split_stages import split_stages
from fxpipe.pipeline import CHECKPOINT_MODES, Pipeline
from fxpipe.tracing import Traced, _preserved, fake_runnable, trace

__all__ = ["plan", "pipeline", "compile_model", "Compiled"]

CostArg = str | Callable[[fx.Node], float]
#: Graphs up to this many nodes are profiled when ``cost="auto"`` and the devices allow it.
AUTO_TIME_MAX_NODES = 3000


@dataclass(frozen=True)
class Compiled:
    """Everything the compiler made for one model: traced graph, plan and stage program."""

    traced: Traced
    plan: PipelinePlan
    program: StageProgram

    def pipeline(
        self,
        model: nn.Module,
        *,
        chunks: int | None = None,
        checkpoint: str = "except_last",
        deferred_batch_norm: bool = False,
        output_device: torch.device | None = None,
    ) -> Pipeline:
        """The runnable Pipeline of ``model`` (the model this was compiled from)."""
        return Pipeline(
            model,
            self.traced,
            self.plan,
            self.program,
            chunks=self.plan.chunks if chunks is None else chunks,
            checkpoint=checkpoint,
            deferred_batch_norm=deferred_batch_norm,
            output_device=output_device,
        )


def plan(
    model: nn.Module,
    example_input: Any,
    devices: Sequence[Any],
    *,
    cost: CostArg = "auto",
    tracer: str = "auto",
    example_kwargs: Mapping[str, Any] | None = None,
    chunks: int | None = None,
    slack: float = 0.0,
) -> PipelinePlan:
    """Trace ``model``, price its nodes and split it across ``devices``; runs nothing on them.

    ``slack`` lets the bottleneck grow by that fraction (0.01 = 1%) where that sends fewer
    bytes between stages; the default 0 keeps the best bottleneck, with the fewest bytes
    among the splits that reach it. The model is not modified.
    """
    compiled = compile_model(
        model,
        example_input,
        devices,
        cost=cost,
        tracer=tracer,
        example_kwargs=example_kwargs,
        chunks=chunks,
        slack=slack,
        require_present=False,
    )
    return compiled.plan


def pipeline(
    model: nn.Module,
    example_input: Any,
    devices: Sequence[Any],
    *,
    chunks: int | None = None,
    checkpoint: str = "except_last",
    cost: CostArg = "auto",
    tracer: str = "auto",
    example_kwargs: Mapping[str, Any] | None = None,
    deferred_batch_norm: bool = False,
    output_device: Any = None,
    slack: float = 0.0,
) -> Pipeline:
    """Compile ``model`` into stages over ``devices`` and return a drop-in ``nn.Module``.

    ``pipe(*args, **kwargs)`` returns what ``model(*args, **kwargs)`` returns, with the same
    gradients; the model's own Parameters move (in place) to their stage's device.
    """
    _check_runtime_options(chunks, checkpoint, deferred_batch_norm)
    out_device = None if output_device is None else parse_device(output_device)
    compiled = compile_model(
        model,
        example_input,
        devices,
        cost=cost,
        tracer=tracer,
        example_kwargs=example_kwargs,
        chunks=chunks,
        checkpoint=checkpoint,
        slack=slack,
    )
    _check_meta_stages(model, compiled.plan.devices)
    if deferred_batch_norm and compiled.traced.tracer != "fx":
        raise ConfigError(
            "deferred_batch_norm=True needs a model traced with torch.fx (this one needed "
            "torch.export, which fixes BatchNorm into the graph); pass deferred_batch_norm=False"
        )
    return compiled.pipeline(
        model,
        chunks=chunks,
        checkpoint=checkpoint,
        deferred_batch_norm=deferred_batch_norm,
        output_device=out_device,
    )


def compile_model(
    model: nn.Module,
    example_input: Any,
    devices: Sequence[Any],
    *,
    cost: CostArg = "auto",
    tracer: str = "auto",
    example_kwargs: Mapping[str, Any] | None = None,
    chunks: int | None = None,
    checkpoint: str = "except_last",
    slack: float = 0.0,
    mode: str = "direct",
    require_present: bool = True,
) -> Compiled:
    """Trace, price, partition and split; the steps of :func:`pipeline` before any device work."""
    if not isinstance(model, nn.Module):
        raise ConfigError(f"model is a {type(model).__name__}, not an nn.Module; pass the module")
    targets = normalize_devices(devices, require_present=require_present)
    args = _example_args(example_input)
    batch = _example_batch(inspect.signature(model.forward), args, example_kwargs or {})
    traced = trace(model, args, example_kwargs, tracer=tracer)
    with _preserved(model), fake_runnable(model):  # fake runs may write into real buffers
        _check_outputs_follow_batch(traced, batch)
    mode_name = _cost_mode(cost, traced.graph_module, targets, model)
    with fake_runnable(model):
        costs = estimate_costs(
            traced.graph_module,
            traced.example_values,
            mode=mode_name,
            device=targets[0] if mode_name == "time" else None,
        )

    g = to_networkx(traced.graph_module, costs)
    parts = partition_graph(g, len(targets), slack=slack, traffic=mode)
    default_chunks = max(1, min(4 * len(targets), batch))
    the_plan = build_plan(
        traced.graph_module,
        costs,
        g,
        parts,
        targets,
        chunks=chunks or default_chunks,
        checkpoint=checkpoint,
        capacity=device_capacity(targets),
    )
    program = split_stages(the_plan, traced.output_spec, mode=mode)
    return Compiled(traced, the_plan, program)


def _check_meta_stages(model: nn.Module, devices: Sequence[torch.device]) -> None:
    """Tensors with data cannot move onto ``meta`` stages (a model on meta may run there)."""
    if not any(d.type == "meta" for d in devices):
        return
    tensors = [*model.named_parameters(), *model.named_buffers()]
    real = next(((n, t.device) for n, t in tensors if not t.is_meta), None)
    if real is not None:
        raise DeviceError(
            f"devices {[str(d) for d in devices]} include 'meta', which holds no data, but "
            f"the model's {real[0]!r} is on {real[1]}; run the stages on cpu or cuda "
            "(fxpipe.plan accepts meta devices)"
        )


def _check_runtime_options(chunks: int | None, checkpoint: str, deferred_bn: bool) -> None:
    bad_chunks = isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1
    if chunks is not None and bad_chunks:
        raise ConfigError(f"chunks={chunks!r} must be a whole number >= 1 (or None for a default)")
    if checkpoint not in CHECKPOINT_MODES:
        raise ConfigError(
            f"checkpoint={checkpoint!r} is not one of {CHECKPOINT_MODES}; pick one of them"
        )
    if not isinstance(deferred_bn, bool):
        raise ConfigError(f"deferred_batch_norm={deferred_bn!r} must be True or False")


def _cost_mode(
    cost: CostArg, gm: fx.GraphModule, devices: Sequence[torch.device], model: nn.Module
) -> Any:
    if callable(cost):
        return cost
    if cost != "auto":
        if cost not in COST_MODES:
            raise ConfigError(
                f"cost={cost!r} is not one of {('auto',) + COST_MODES} or a callable "
                "(node) -> float; pick one of them"
            )
        return cost
    on_cpu = all(d.type == "cpu" for d in devices)
    params_cpu = all(p.device.type == "cpu" for p in model.parameters())
    small = len(gm.graph.nodes) <= AUTO_TIME_MAX_NODES
    return "time" if on_cpu and params_cpu and small else "flops"


def _example_args(example_input: Any) -> tuple[Any, ...]:
    if isinstance(example_input, tuple):
        return example_input
    return (example_input,)


def _example_batch(
    signature: inspect.Signature, args: tuple[Any, ...], kwargs: Mapping[str, Any]
) -> int:
    """The batch size every tensor of the example shares on dim 0; InputError otherwise."""
    flat, _ = tree_flatten_with_path((args, dict(kwargs)))
    sizes = [
        (argument_name(signature, path), tuple(t.shape))
        for path, t in flat
        if isinstance(t, torch.Tensor)
    ]
    if not sizes:
        raise InputError("the example has no tensor; pass at least one batched tensor input")
    scalars = [w for w, shape in sizes if len(shape) == 0]
    if scalars:
        raise InputError(
            f"example input {scalars[0]} is a 0-dim tensor; dim 0 of every tensor is the batch "
            "dimension: give it one"
        )
    batch = sizes[0][1][0]
    for where, shape in sizes:
        if shape[0] != batch:
            raise InputError(
                f"example input {where} has batch size {shape[0]} (shape {shape}) but "
                f"{sizes[0][0]} has {batch}; dim 0 of every tensor must be the same batch"
            )
    if batch == 0:
        raise InputError("the example batch is empty (size 0); pass at least one sample")
    return int(batch)


def _check_outputs_follow_batch(traced: Traced, batch: int) -> None:
    """Micro-batch outputs are joined along dim 0, so every tensor the model returns must
    grow with the batch (dim 0 in proportion, other dims fixed) and every other value must
    not depend on it. Checked on fake tensors at the example's batch and one more; a graph
    that does not run on fake tensors is not checked."""
    gm = traced.graph_module
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    if not any(isinstance(a, fx.Node) for a in output.args[0]):
        return
    runs = []
    for size in (batch, batch + 1):
        runner = _FakeRun(gm)
        try:
            runs.append(runner.outputs(traced.example_values, size))
        except DataDependentOutputException as e:
            node = runner.node
            if node is not None and node in output.args[0] and _reads_scalar(node):
                raise PlanError(
                    f"output value {node.name!r} ({node.format_node()}) is read "
                    "out of a tensor into Python: each micro-batch would return its own; "
                    "return the tensor instead"
                ) from e
            return
        except Exception:
            return
    for leaf, a, b in zip(output.args[0], *runs, strict=True):
        name = leaf.name if isinstance(leaf, fx.Node) else repr(leaf)
        if isinstance(a, _Shape) and isinstance(b, _Shape):
            same_rest = len(a) == len(b) > 0 and a[1:] == b[1:]
            if not (same_rest and a[0] * (batch + 1) == b[0] * batch):
                raise PlanError(
                    f"output tensor {name!r} has shape {tuple(a)} for a batch of {batch} and "
                    f"{tuple(b)} for {batch + 1}: its dim 0 is not the batch, so micro-batches "
                    "cannot be joined into it; return per-sample values (batch first) and "
                    "reduce outside the model"
                )
        elif not _same(a, b):
            raise PlanError(
                f"output value {name!r} is {a!r} for a batch of {batch} and {b!r} for "
                f"{batch + 1}: it depends on the batch size, so each micro-batch would return "
                "its own; return it as a batch-first tensor or compute it outside the model"
            )


#: Ops that read a tensor's value into Python (a number or a list).
_SCALAR_READS = frozenset(
    {"item", "tolist", "_local_scalar_dense", "int", "float", "bool", "__int__", "__float__"}
)


def _reads_scalar(node: fx.Node) -> bool:
    """Whether ``node`` itself turns a tensor into a Python value (not a module or op that
    reads a number internally, as a BatchNorm with ``momentum=None`` does)."""
    return node.op in ("call_function", "call_method") and op_name(node) in _SCALAR_READS


class _Shape(tuple[int, ...]):
    """The shape of a tensor leaf (a tuple leaf of the output is a value, not this)."""


class _FakeRun(fx.Interpreter):
    """Runs a graph on fake tensors with another batch size; remembers the node it is at."""

    node: fx.Node | None = None

    def run_node(self, n: fx.Node) -> Any:
        self.node = n
        return super().run_node(n)

    def outputs(self, values: tuple[Any, ...], batch: int) -> list[Any]:
        """Each output leaf: a tensor's shape as a tuple, any other value as it is."""
        mode = FakeTensorMode(allow_non_fake_inputs=True)

        def fake(t: Any) -> Any:
            if not isinstance(t, torch.Tensor) or t.ndim == 0:
                return t
            return torch.zeros((batch, *t.shape[1:]), dtype=t.dtype, device=t.device)

        with mode, torch.no_grad():
            flat = self.run(*tree_map(fake, values))
        return [_Shape(x.shape) if isinstance(x, torch.Tensor) else x for x in flat]


def _same(a: Any, b: Any) -> bool:
    """Equal values; two objects that only compare by identity count as the same."""
    equality: object = type(a).__eq__
    if a is b or (type(a) is type(b) and equality is object.__eq__):
        return True
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:
        return False
