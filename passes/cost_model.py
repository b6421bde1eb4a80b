"""Prices every node of a traced graph: compute cost, output bytes and parameter bytes.

Modes:

- ``"time"``: each node runs forward and backward on the profiling device (one warm-up,
  median of ``repeats``); cost in seconds. A module whose weights live elsewhere runs as a
  copy on that device, and device constants in the graph point at it. Nodes of a region
  that runs under a functorch transform level (:func:`fxpipe.passes.ops.stateful_regions`)
  run once, forward only (autograd may not start there), priced at 3x that time; the
  calls that enter and leave the level cost 0.
- ``"flops"``: fake tensors, no real memory or device time (a model built on the ``meta``
  device can be priced). FlopCounterMode counts matmuls and convolutions; element-wise
  ops, norms, pooling and CPU attention (which it counts as 0) get formulas here, and a
  roofline term (``intensity`` FLOP per byte moved) prices memory-bound nodes. Forward +
  backward is taken as 3x forward for counted ops and 2x for the rest.
- ``"params"``: cost is the parameter bytes a node holds (the DeepSpeed default).
- a callable ``(node) -> float``: the user's own cost; bytes still come from fake tensors.

The graph, the model and its state (buffers, RNG, ``.grad``) are left as they were.
"""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from operator import attrgetter
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensorMode,
)
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.flop_counter import FlopCounterMode

from fxpipe.errors import ConfigError, StageError
from fxpipe.ir import CostTable, NodeCost
from fxpipe.passes.ops import VIEW_OPS, op_name, state_change, stateful_regions
from fxpipe.passes.placement import retarget

__all__ = ["estimate_costs", "COST_MODES", "DEFAULT_INTENSITY"]

COST_MODES = ("time", "flops", "params")
#: FLOP a device does in the time it moves one byte (machine balance), per device type.
DEFAULT_INTENSITY = {"cpu": 10.0, "cuda": 100.0, "meta": 10.0}

#: Forward + backward over forward time, for nodes timed forward only.
_FORWARD_AND_BACKWARD = 3.0
_HEAVY_ELEMENTWISE = {  # FLOP per output element, forward
    "layer_norm": 8,
    "batch_norm": 8,
    "group_norm": 8,
    "instance_norm": 8,
    "rms_norm": 6,
    "native_layer_norm": 8,
    "native_batch_norm": 8,
    "_native_batch_norm_legit": 8,
    "_native_batch_norm_legit_functional": 8,
    "softmax": 5,
    "log_softmax": 5,
    "_softmax": 5,
    "_log_softmax": 5,
    "gelu": 8,
    "silu": 4,
    "tanh": 4,
    "sigmoid": 4,
    "exp": 4,
    "erf": 8,
    "cross_entropy": 6,
    "dropout": 2,
    "native_dropout": 2,
}
CostFn = Callable[[fx.Node], float]


def estimate_costs(
    gm: fx.GraphModule,
    example_values: Sequence[Any],
    *,
    mode: str | CostFn = "flops",
    device: torch.device | None = None,
    repeats: int = 5,
    intensity: float | None = None,
) -> CostTable:
    """Price every node of ``gm`` run on ``example_values`` (one value per placeholder)."""
    if callable(mode):
        return _run(gm, example_values, "custom", mode, device, repeats, intensity)
    if mode not in COST_MODES:
        raise ConfigError(
            f"cost={mode!r} is not one of {COST_MODES + ('auto',)} or a callable "
            "(node) -> float; pick one of them"
        )
    return _run(gm, example_values, mode, None, device, repeats, intensity)


def _run(
    gm: fx.GraphModule,
    values: Sequence[Any],
    mode: str,
    fn: CostFn | None,
    device: torch.device | None,
    repeats: int,
    intensity: float | None,
) -> CostTable:
    device = device or _device_of(values)
    if intensity is None:
        intensity = DEFAULT_INTENSITY.get(device.type, 10.0)
    pricer = _Pricer(gm, mode, fn, device, repeats, intensity)
    with _state_preserved(gm):
        if mode == "time":
            pricer.run(*[_to(v, device) for v in values])
        else:
            fake = FakeTensorMode(allow_non_fake_inputs=True)
            with fake:
                pricer.run(*[_fake(fake, v) for v in values])
    unit = {"time": "s", "flops": "flop", "params": "B"}.get(mode, "custom")
    return CostTable(mode, unit, dict(pricer.costs), _batch_size(values))


class _Pricer(fx.Interpreter):
    """Runs the graph node by node and records each node's cost and sizes."""

    def __init__(
        self,
        gm: fx.GraphModule,
        mode: str,
        fn: CostFn | None,
        device: torch.device,
        repeats: int,
        intensity: float,
    ) -> None:
        super().__init__(gm, garbage_collect_values=True)
        self.mode, self.fn, self.device = mode, fn, device
        self.repeats, self.intensity = repeats, intensity
        self.costs: dict[str, NodeCost] = {}
        self.in_region = {n for region in stateful_regions(gm.graph) for n in region}

    def run_node(self, n: fx.Node) -> Any:
        try:
            with torch.enable_grad():
                out, cost = self._price(n)
        except (DataDependentOutputException, DynamicOutputShapeException) as e:
            raise ConfigError(
                f"cost={self.mode!r} prices nodes on fake tensors, but node {n.name!r} "
                f"({n.format_node()}) has an output that depends on tensor values "
                f"({type(e).__name__}); use cost='time', which runs the nodes"
            ) from e
        except ConfigError:
            raise
        except Exception as e:
            raise StageError(
                f"pricing with cost={self.mode!r} failed at node {n.name!r} ({n.format_node()}): "
                f"{type(e).__name__}: {e}; check that the model runs on the example input, "
                "or pass another cost mode"
            ) from e
        self.costs[n.name] = _describe(n, out, cost, self._param_bytes(n))
        return out

    def _price(self, n: fx.Node) -> tuple[Any, float]:
        if n.op in ("placeholder", "output"):
            return super().run_node(n), 0.0
        if self.mode == "time":
            return self._timed(n)
        with FlopCounterMode(display=False) as counter:
            out = super().run_node(n)
        if self.mode == "params":
            return out, float(self._param_bytes(n))
        if self.fn is not None:
            return out, _custom_cost(self.fn, n)
        return out, self._flops(n, out, counter.get_total_flops())

    def _flops(self, n: fx.Node, out: Any, counted: int) -> float:
        name = op_name(n)
        if n.op == "get_attr" or name in VIEW_OPS:
            return 0.0
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        moved = _tensor_bytes((args, kwargs)) + _tensor_bytes(out)
        if counted == 0 and "scaled_dot_product" in name:
            counted = _attention_flops(args)
        if counted:
            compute = 3.0 * counted
        else:
            compute = 2.0 * _HEAVY_ELEMENTWISE.get(name, 1) * _numel(out)
        return max(compute, self.intensity * moved)

    def _timed(self, n: fx.Node) -> tuple[Any, float]:
        args, kwargs = retarget(n, *self.fetch_args_kwargs_from_env(n), self.device)
        if n.op == "get_attr":
            return self._attr_on_device(str(n.target)), 0.0
        module = self._module_on_device(str(n.target)) if n.op == "call_module" else None
        params: list[torch.Tensor] = (
            [p for p in module.parameters() if p.requires_grad] if module else []
        )

        def run(a: Any, k: Any) -> Any:
            return module(*a, **k) if module is not None else getattr(self, n.op)(n.target, a, k)

        if n in self.in_region:  # under a transform level: once, forward only
            start = time.perf_counter()
            out = run(args, kwargs)
            _sync(self.device)
            forward = time.perf_counter() - start
            return out, 0.0 if state_change(n) else _FORWARD_AND_BACKWARD * forward
        out = run(args, kwargs)
        samples = []
        for _ in range(max(1, self.repeats) + 1):
            leaves, a, k = _grad_inputs(args, kwargs)
            _sync(self.device)
            start = time.perf_counter()
            result = run(a, k)
            _backward(result, leaves + params)
            _sync(self.device)
            samples.append(time.perf_counter() - start)
        return out, statistics.median(samples[1:])

    def _module_on_device(self, target: str) -> nn.Module:
        """The submodule, or a copy of it on the profiling device when its tensors live
        elsewhere: profiling never moves the user's model."""
        sub = self.module.get_submodule(target)
        tensors = [*sub.parameters(), *sub.buffers()]
        if all(t.device == self.device for t in tensors):
            return sub
        return copy.deepcopy(sub).to(self.device)

    def _attr_on_device(self, target: str) -> Any:
        value = attrgetter(target)(self.module)
        if isinstance(value, torch.Tensor) and value.device != self.device:
            return value.detach().to(self.device).requires_grad_(value.requires_grad)
        return value

    def _param_bytes(self, n: fx.Node) -> int:
        if n.op == "call_module":
            sub = self.module.get_submodule(str(n.target))
            return sum(p.numel() * p.element_size() for p in sub.parameters())
        if n.op == "get_attr":
            value = attrgetter(str(n.target))(self.module)
            if isinstance(value, nn.Parameter):
                return value.numel() * value.element_size()
        return 0


def _custom_cost(fn: CostFn, n: fx.Node) -> float:
    value = fn(n)
    try:
        cost = float(value)
    except (TypeError, ValueError):
        cost = float("nan")
    if not 0 <= cost < float("inf"):
        raise ConfigError(
            f"the cost callable returned {value!r} for node {n.name!r}; it must return a "
            "finite number >= 0 for every node"
        )
    return cost


def _describe(n: fx.Node, out: Any, cost: float, param_bytes: int) -> NodeCost:
    is_tensor = isinstance(out, torch.Tensor)
    out_bytes = _tensor_bytes(out)
    grad = any(t.requires_grad for t in _tensors(out))
    naming = n.op in ("get_attr", "placeholder", "output")
    saved = 0 if naming or op_name(n) in VIEW_OPS else out_bytes
    return NodeCost(
        cost=max(0.0, float(cost)),
        output_bytes=out_bytes,
        param_bytes=param_bytes,
        is_tensor=is_tensor,
        requires_grad=grad,
        saved_bytes=saved if grad else 0,
    )


def _attention_flops(args: Sequence[Any]) -> int:
    q, k, v = args[0], args[1], args[2]
    batch_heads = q.numel() // (q.shape[-2] * q.shape[-1])
    return int(2 * batch_heads * q.shape[-2] * k.shape[-2] * (q.shape[-1] + v.shape[-1]))


def _tensors(value: Any) -> list[torch.Tensor]:
    leaves, _ = tree_flatten(value)
    return [x for x in leaves if isinstance(x, torch.Tensor)]


def _tensor_bytes(value: Any) -> int:
    return sum(t.numel() * t.element_size() for t in _tensors(value))


def _numel(value: Any) -> int:
    return sum(t.numel() for t in _tensors(value))


def _grad_inputs(args: Any, kwargs: Any) -> tuple[list[torch.Tensor], Any, Any]:
    """Fresh copies of the float tensor inputs, differentiable and safe to modify in place."""
    leaves: list[torch.Tensor] = []

    def fresh(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        if not t.is_floating_point():
            return t.clone()
        leaf = t.detach().requires_grad_(True)
        leaves.append(leaf)
        return leaf.clone()

    return leaves, tree_map(fresh, args), tree_map(fresh, kwargs)


def _backward(result: Any, wrt: list[torch.Tensor]) -> None:
    outs = [t for t in _tensors(result) if t.requires_grad]
    if outs and wrt:
        grads = [torch.ones_like(t) for t in outs]
        torch.autograd.grad(outs, wrt, grads, allow_unused=True)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _device_of(values: Sequence[Any]) -> torch.device:
    tensors = _tensors(list(values))
    return tensors[0].device if tensors else torch.device("cpu")


def _batch_size(values: Sequence[Any]) -> int:
    tensors = [t for t in _tensors(list(values)) if t.ndim > 0]
    return int(tensors[0].shape[0]) if tensors else 1


def _to(value: Any, device: torch.device) -> Any:
    return tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, value)


def _fake(mode: FakeTensorMode, value: Any) -> Any:
    return tree_map(lambda t: mode.from_tensor(t) if isinstance(t, torch.Tensor) else t, value)


@contextmanager
def _state_preserved(gm: fx.GraphModule) -> Iterator[None]:
    """Pricing runs the user's modules; put back their buffers and the RNG state."""
    buffers = [(b, b.detach().clone()) for b in gm.buffers() if not b.is_meta]
    rng = torch.random.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None  # type: ignore[no-untyped-call]
    try:
        yield
    finally:
        with torch.no_grad():
            for b, saved in buffers:
                b.copy_(saved)
        torch.random.set_rng_state(rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)
