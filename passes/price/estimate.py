"""Prices every node of a traced graph: compute cost, output bytes and parameter bytes.

Modes:

- ``"roofline"`` (what ``cost="auto"`` uses): forward + backward seconds on a reference
  device of the stages' kind, from each node's FLOPs and bytes
  (:mod:`fxpipe.passes.price.roofline`); analytic and deterministic, nothing runs on a device.
  A graph from ``torch.export`` is priced from the shapes export recorded on its nodes
  (:mod:`fxpipe.passes.price.recorded`); any other runs once on fake tensors.
- ``"time"``: each node runs forward and backward on the profiling device (one warm-up,
  median of ``repeats``); cost in seconds. Only the inputs that require grad in training
  get a gradient. A module whose weights live elsewhere runs as a copy on that device,
  and device constants in the graph point at it. A node that cannot run backward there
  is timed forward only, priced at 3x that time when its output requires grad (as are
  the nodes of a region under a functorch transform level,
  :func:`fxpipe.passes.ops.stateful_regions`, where autograd may not start; the calls
  that enter and leave the level cost 0); a node that cannot run at all there gets the
  roofline estimate, and zeros of its output's shape feed the nodes after it.
- ``"flops"``: fake tensors, no real memory or device time (a model built on the ``meta``
  device can be priced). FlopCounterMode counts matmuls and convolutions; element-wise
  ops, norms, pooling and CPU attention (which it counts as 0) get formulas here, and a
  roofline term (``intensity`` FLOP per byte moved) prices memory-bound nodes. Forward +
  backward is taken as 3x forward for counted ops and 2x for the rest.
- ``"params"``: cost is the parameter bytes a node holds (the DeepSpeed default).
- a callable ``(node) -> float``: the user's own cost; bytes still come from fake tensors.

``progress(done, total)``, when given, is called after each node is priced. The graph, the
model and its state (buffers, RNG, ``.grad``) are left as they were.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from operator import attrgetter
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
    FakeTensorMode,
)
from torch.utils._pytree import tree_leaves, tree_map
from torch.utils.flop_counter import FlopCounterMode

from fxpipe.errors import ConfigError, StageError
from fxpipe.ir import CostTable, NodeCost, PricingMode
from fxpipe.model_state import preserved
from fxpipe.passes.ops import VIEW_OPS, is_check, op_name, state_change, stateful_regions
from fxpipe.passes.price.op_work import Facts, attention_flops, attribute, describe, tensors
from fxpipe.passes.price.recorded import price_recorded, recorded_shapes, recorded_sizes
from fxpipe.passes.price.roofline import HEAVY_ELEMENTWISE, Roofline, roofline_for
from fxpipe.passes.price.timing import step_seconds, sync, zeros_like
from fxpipe.passes.shape_only import same_shape_output
from fxpipe.passes.split.placement import retarget

__all__ = [
    "estimate_costs",
    "output_sizes",
    "borrowed_costs",
    "ValueDependentError",
    "DEFAULT_INTENSITY",
    "Progress",
]

#: FLOP a device does in the time it moves one byte (machine balance), per device type.
DEFAULT_INTENSITY = {"cpu": 10.0, "cuda": 100.0, "meta": 10.0}
#: ``progress(done, total)``: nodes priced so far, out of all nodes of the graph.
Progress = Callable[[int, int], None]
CostFn = Callable[[fx.Node], float]

#: Forward + backward over forward time, for nodes timed forward only.
_FORWARD_AND_BACKWARD = 3.0
_UNITS = {"time": "s", "roofline": "s", "flops": "flop", "params": "B"}
_log = logging.getLogger(__name__)


def estimate_costs(
    gm: fx.GraphModule,
    example_values: Sequence[Any],
    *,
    mode: PricingMode | CostFn = "flops",
    device: torch.device | None = None,
    repeats: int = 5,
    intensity: float | None = None,
    micro_batches: int = 1,
    progress: Progress | None = None,
    roofline: Roofline | None = None,
) -> CostTable:
    """Price every node of ``gm`` run on ``example_values`` (one value per placeholder).

    ``device``: where "time" profiles, and whose kind of device "roofline" prices for
    (default: the examples' device); the other modes run on the examples where they are and
    ignore it. ``micro_batches``: how many pieces the pipeline cuts the batch into
    ("roofline" charges per-kernel and per-weight costs once per piece). ``roofline``:
    the constants "roofline" prices with (default: those of the device's kind).
    """
    if mode not in ("time", "roofline"):
        device = None
    if callable(mode):
        return _run(gm, example_values, "custom", mode, device, repeats, intensity, progress)
    if mode == "roofline" and recorded_shapes(gm, example_values) is not None:
        rates = roofline or roofline_for((device or _device_of(example_values)).type)
        table: CostTable = price_recorded(gm, example_values, rates, micro_batches)
        if progress is not None:
            progress(len(table.nodes), len(table.nodes))
        return _checks_free(gm, table)
    table = _run(
        gm, example_values, mode, None, device, repeats, intensity, progress, micro_batches,
        roofline,
    )  # fmt: skip
    return _checks_free(gm, table)


def _checks_free(gm: fx.GraphModule, table: CostTable) -> CostTable:
    """Assertions (``torch._assert``, export's ``_assert_tensor_metadata``) check metadata
    and compute nothing: they cost 0, however large the tensor they look at."""
    checks = [n.name for n in gm.graph.nodes if is_check(n) and table.nodes[n.name].cost]
    if not checks:
        return table
    nodes = dict(table.nodes)
    for name in checks:
        nodes[name] = dataclasses.replace(nodes[name], cost=0.0)
    return dataclasses.replace(table, nodes=nodes)


def borrowed_costs(gm: fx.GraphModule, table: CostTable) -> CostTable:
    """``gm``'s nodes priced as ``table`` prices the nodes of the same name (another trace of
    the same model), nothing for the others: for a graph whose split is already fixed, so
    that its costs only describe its stages, when it cannot be priced without running it."""
    nothing = NodeCost(cost=0.0, output_bytes=0, param_bytes=0, is_tensor=False)
    nodes = {n.name: table.nodes.get(n.name, nothing) for n in gm.graph.nodes}
    return CostTable(table.mode, table.unit, nodes, table.batch_size)


def output_sizes(gm: fx.GraphModule, example_values: Sequence[Any]) -> dict[str, int] | None:
    """Bytes of every node's output (0 for values that are not tensors); from the shapes
    ``torch.export`` recorded where it did, else from one run on fake tensors. None when
    the graph does not run on fake tensors."""
    recorded: dict[str, int] | None = recorded_sizes(gm, example_values)
    if recorded is not None:
        return recorded
    try:
        table = estimate_costs(gm, example_values, mode="params")
    except (ConfigError, StageError):
        return None
    return {name: c.output_bytes for name, c in table.nodes.items()}


def _run(
    gm: fx.GraphModule,
    values: Sequence[Any],
    mode: str,
    fn: CostFn | None,
    device: torch.device | None,
    repeats: int,
    intensity: float | None,
    progress: Progress | None,
    micro_batches: int = 1,
    roofline: Roofline | None = None,
) -> CostTable:
    device = device or _device_of(values)
    if intensity is None:
        intensity = DEFAULT_INTENSITY.get(device.type, 10.0)

    def pricer_for() -> _Pricer:
        made = _Pricer(gm, mode, fn, device, repeats, intensity)
        made.micro_batches, made.progress = micro_batches, progress
        made.home = _device_of(values)
        if roofline is not None:
            made.roofline = roofline
        return made

    pricer = pricer_for()
    with preserved(gm, structure=False):  # pricing runs the user's modules
        if mode == "time":
            pricer.run(*[_to(v, device) for v in values])
        else:
            try:
                fake = FakeTensorMode(allow_non_fake_inputs=True)
                pricer.fake = fake
                with fake:
                    pricer.run(*[_fake(fake, v) for v in values])
            except ValueDependentError:
                if any(
                    t.is_meta for t in tree_leaves(list(values)) if isinstance(t, torch.Tensor)
                ):
                    raise
                # The example holds real values: count the same FLOP and bytes on them.
                pricer = pricer_for()
                pricer.run(*values)
    unit = _UNITS.get(mode, "custom")
    return CostTable(mode, unit, dict(pricer.costs), _batch_size(values))


class ValueDependentError(ConfigError):
    """A node's output depends on tensor values (``.item()``, a data-dependent shape), which
    fake tensors do not have, so pricing without running the graph stops there."""


class _Pricer(fx.Interpreter):
    """Runs the graph node by node and records each node's cost and sizes."""

    module: fx.GraphModule

    def fetch_args_kwargs_from_env(self, n: fx.Node) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The node's arguments, with fresh lists and dicts for the immutable ones fx stores
        (a leaf function may write into a list argument, as generated code allows)."""
        args, kwargs = super().fetch_args_kwargs_from_env(n)
        return _mutable(args), _mutable(kwargs)

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
        self.roofline: Roofline = roofline_for(device.type)
        self.micro_batches = 1
        self.progress: Progress | None = None
        self.fake: FakeTensorMode | None = None
        #: Where the examples live: a node that cannot run on ``device`` is faked there.
        self.home = device
        self.costs: dict[str, NodeCost] = {}
        self.in_region = {n for region in stateful_regions(gm.graph) for n in region}
        #: Nodes whose value depends on a model input (their work shrinks with the batch).
        self.batched: set[fx.Node] = set()
        self.total = len(gm.graph.nodes)

    def run_node(self, n: fx.Node) -> Any:
        try:
            with torch.enable_grad():
                out, cost = self._price(n)
        except (DataDependentOutputException, DynamicOutputShapeException) as e:
            raise ValueDependentError(
                f"cost={self.mode!r} prices nodes on fake tensors, but node {n.name!r} "
                f"({n.format_node()}) has an output that depends on tensor values "
                f"({type(e).__name__}); use cost='time', which runs the nodes"
            ) from e
        except (ConfigError, StageError):
            raise
        except Exception as e:
            raise _failed(self.mode, n, e) from e
        if n.op == "placeholder" or any(a in self.batched for a in n.all_input_nodes):
            self.batched.add(n)
        self.costs[n.name] = describe(n, out, cost, self._param_bytes(n))
        if self.progress is not None:
            self.progress(len(self.costs), self.total)
        return out

    def _price(self, n: fx.Node) -> tuple[Any, float]:
        if n.op in ("placeholder", "output"):
            return super().run_node(n), 0.0
        if self.mode == "time":
            return self._timed(n)
        with FlopCounterMode(display=False) as counter:
            out = self._shape_only(n)
            out = super().run_node(n) if out is None else out
        if self.mode == "params":
            return out, float(self._param_bytes(n))
        if self.fn is not None:
            return out, _custom_cost(self.fn, n)
        if self.mode == "roofline":
            if n.op == "get_attr" and self.fake is not None:  # so that views of it alias it
                out = tree_map(lambda t: _fake_of(self.fake, t), out)
            return out, self._roofline(n, out, counter)
        return out, self._flops(n, out, counter.get_total_flops())

    def _shape_only(self, n: fx.Node) -> Any:
        """The output of a leaf module that returns a tensor shaped like its input, made
        without running the module (:mod:`fxpipe.passes.shape_only`); None otherwise."""
        if n.op != "call_module":
            return None
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        return same_shape_output(self.module.get_submodule(str(n.target)), args, kwargs)

    def _flops(self, n: fx.Node, out: Any, counted: int) -> float:
        name = op_name(n)
        if n.op == "get_attr" or name in VIEW_OPS:
            return 0.0
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        moved = _tensor_bytes((args, kwargs)) + _tensor_bytes(out)
        if counted == 0 and "scaled_dot_product" in name:
            counted = attention_flops(args)
        if counted:
            compute = 3.0 * counted
        else:
            compute = 2.0 * HEAVY_ELEMENTWISE.get(name, 1) * _numel(out)
        return max(compute, self.intensity * moved)

    def _roofline(self, n: fx.Node, out: Any, counter: FlopCounterMode | None) -> float:
        """Roofline seconds of ``n`` from its inputs (in the environment) and output."""
        if n.op == "get_attr":
            value = attrgetter(str(n.target))(self.module)
            work = attribute(value, len(n.users))
            return float(self.roofline.seconds(work, self.micro_batches))
        module = self.module.get_submodule(str(n.target)) if n.op == "call_module" else None
        facts = Facts.of_node(
            self.module,
            n,
            inputs=[(a, self.env[a]) for a in n.all_input_nodes],
            out=out,
            module=module,
            counted=counter.get_flop_counts().get("Global", {}) if counter else {},
            batched=lambda a: a in self.batched,
        )
        seconds: float = self.roofline.seconds(facts.work(), self.micro_batches)
        return seconds

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
            sync(self.device)
            forward = time.perf_counter() - start
            return out, 0.0 if state_change(n) else _FORWARD_AND_BACKWARD * forward
        try:
            out = run(args, kwargs)
        except Exception as e:  # it does not run on this device
            fake_out, cost = self._estimated(n, e)
            return tree_map(lambda t: zeros_like(t, self.device), fake_out), cost
        try:
            return out, step_seconds(run, args, kwargs, params, self.device, self.repeats)
        except Exception as e:
            _log.info("node %r is timed forward only: %s: %s", n.name, type(e).__name__, e)
        try:
            forward = step_seconds(run, args, kwargs, None, self.device, self.repeats)
        except Exception as e:
            return out, self._estimated(n, e)[1]
        grad = any(t.requires_grad for t in tensors(out))
        return out, forward * (_FORWARD_AND_BACKWARD if grad else 1.0)

    def _estimated(self, n: fx.Node, error: Exception) -> tuple[Any, float]:
        """The fake output and roofline seconds of a node that cannot run on the profiling
        device; ``error`` when it does not run on fake tensors either (a model bug)."""
        env = self.env
        try:
            with FakeTensorMode(allow_non_fake_inputs=True):
                self.env = {a: tree_map(self._at_home, env[a]) for a in n.all_input_nodes}
                with FlopCounterMode(display=False) as counter:
                    out = fx.Interpreter.run_node(self, n)
            cost = self._roofline(n, out, counter)
        except Exception:
            raise error from None
        finally:
            self.env = env
        _log.info("node %r does not run on %s (%s); priced by the roofline", n.name,
                  self.device, error)  # fmt: skip
        return out, cost

    def _at_home(self, value: Any) -> Any:
        """A fake tensor like ``value`` on the examples' device (where the model runs)."""
        if not isinstance(value, torch.Tensor):
            return value
        fake = torch.empty_strided(
            value.shape, value.stride(), dtype=value.dtype, device=self.home
        )
        return fake.requires_grad_(value.requires_grad) if fake.is_floating_point() else fake

    def _module_on_device(self, target: str) -> nn.Module:
        """The submodule, or a copy of it on the profiling device when its tensors live
        elsewhere: profiling never moves the user's model."""
        sub = self.module.get_submodule(target)
        tensors_ = [*sub.parameters(), *sub.buffers()]
        if all(t.device == self.device for t in tensors_):
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


def _failed(mode: str, n: fx.Node, e: Exception) -> StageError:
    return StageError(
        f"pricing with cost={mode!r} failed at node {n.name!r} ({n.format_node()}): "
        f"{type(e).__name__}: {e}; check that the model runs on the example input, "
        "or pass another cost mode"
    )


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


def _tensor_bytes(value: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors(value))


def _numel(value: Any) -> int:
    return sum(t.numel() for t in tensors(value))


def _device_of(values: Sequence[Any]) -> torch.device:
    found = tensors(list(values))
    return found[0].device if found else torch.device("cpu")


def _batch_size(values: Sequence[Any]) -> int:
    found = [t for t in tensors(list(values)) if t.ndim > 0]
    return int(found[0].shape[0]) if found else 1


def _to(value: Any, device: torch.device) -> Any:
    return tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, value)


def _fake(mode: FakeTensorMode, value: Any) -> Any:
    return tree_map(lambda t: mode.from_tensor(t) if isinstance(t, torch.Tensor) else t, value)


def _fake_of(mode: FakeTensorMode | None, value: Any) -> Any:
    if mode is None or not isinstance(value, torch.Tensor) or isinstance(value, FakeTensor):
        return value
    fake = mode.from_tensor(value.detach())
    return fake.requires_grad_(value.requires_grad) if value.is_floating_point() else fake


def _mutable(value: Any) -> Any:
    """``value`` with every list and dict in it (fx's immutable ones included) copied."""
    if isinstance(value, list):
        return [_mutable(v) for v in value]
    if isinstance(value, dict):
        return {k: _mutable(v) for k, v in value.items()}
    if type(value) is tuple:
        return tuple(_mutable(v) for v in value)
    return value
