"""Captures a model as a flat GraphModule: torch.fx first, torch.export as the fallback.

The result is normalised so that every later pass sees the same shape of graph: one
placeholder per model input value, parameters reached through ``get_attr`` or leaf
``call_module`` nodes that hold the user's own Parameter objects, and an output node that
returns a flat tuple (the model's output structure is kept as a pytree spec beside it),
every shape query read in several places copied per reader (:mod:`fxpipe.trace.shapes`), and
every value made only from inputs and buffers and read by several nodes recomputed beside
each reader (:mod:`fxpipe.trace.recompute`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import io
import operator
import warnings
from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from operator import attrgetter
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch.fx.experimental.symbolic_shapes import is_concrete_int
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils._pytree import SUPPORTED_NODES, TreeSpec, tree_flatten, tree_map

from fxpipe.errors import TraceError
from fxpipe.ir import Finalize, TracerName
from fxpipe.model_state import preserved
from fxpipe.passes.price.estimate import output_sizes
from fxpipe.trace.aliasing import mark_aliasing
from fxpipe.trace.autograd_functions import (
    FunctionCall,
    backward_is_derivative,
    describe_function,
    functions_kept_whole,
    functions_recorded,
)
from fxpipe.trace.binding import InputBinder, bind_arguments, given_arguments, leaf_positions
from fxpipe.trace.recompute import recompute_input_values
from fxpipe.trace.shapes import replicate_shape_queries
from fxpipe.trace.trace_errors import trace_error

__all__ = ["Traced", "trace", "merge_aliased_attributes"]


@dataclass(frozen=True)
class Traced:
    """A model captured as a flat graph, with what maps calls onto it."""

    graph_module: fx.GraphModule
    binder: InputBinder
    #: Structure of the model's output; the graph returns its leaves as a flat tuple.
    output_spec: TreeSpec
    #: "fx" or "export": which tracer produced the graph.
    tracer: str
    #: The example's value for each placeholder, in order.
    example_values: tuple[Any, ...]
    #: Where the model reduces over its batch (a loss inside it): what joins the graph's
    #: outputs into the model's (:mod:`fxpipe.passes.batch.reductions`); None: the graph's
    #: outputs are the model's flat output leaves, each batch-first.
    finalize: Finalize | None = None
    #: Ops that mix the batch's rows (a router's capacity counted over the whole batch):
    #: (the node, as a message names it; why), for the warning of a run that splits it
    #: (:mod:`fxpipe.passes.batch.grouping`).
    row_mixing: tuple[tuple[str, str], ...] = ()


def trace(
    model: nn.Module,
    args: Sequence[Any],
    kwargs: Mapping[str, Any] | None = None,
    *,
    tracer: TracerName = "auto",
) -> Traced:
    """Trace ``model(*args, **kwargs)``; ``tracer`` is "fx", "export" or "auto" (fx, then export).

    Raises TraceError naming the module path and the construct when no tracer succeeds.
    The model is not modified.
    """
    kwargs = dict(kwargs or {})
    signature = inspect.signature(model.forward)
    bound = bind_arguments(signature, args, kwargs)
    given = given_arguments(signature, args, kwargs)
    failures: list[tuple[str, BaseException]] = []
    for name in ("fx", "export") if tracer == "auto" else (tracer,):
        try:
            with preserved(model) as kept:
                traced = _TRACE[name](model, signature, bound, given)
            if name == "fx" and kept.written:  # fx ran them once, at trace time only
                raise RuntimeError(
                    f"forward writes into buffer(s) {', '.join(map(repr, kept.written))} in "
                    "place with values torch.fx cannot trace, so the graph would not update them"
                )
        except TraceError:
            raise
        except Exception as e:  # any tracer failure: try the next one, report all
            failures.append((name, e))
            continue
        if traced.tracer == "fx":  # export's aten ops say what they alias and write
            with preserved(model), fake_runnable(model):
                mark_aliasing(traced.graph_module, traced.example_values)
                model.train(not model.training)  # the graph follows train()/eval(): both
                mark_aliasing(traced.graph_module, traced.example_values)
        _clone_mutated_inputs(traced.graph_module)
        _recompute_shared_inputs(traced.graph_module, traced.example_values)
        return traced
    raise trace_error(model, failures)


class _Tracer(fx.Tracer):
    """fx tracer that traces through modules owning a parameter shared with another module,
    so that a tied parameter becomes one ``get_attr`` value that stages can pass on."""

    def __init__(self, shared_owners: frozenset[str]) -> None:
        super().__init__()
        self.shared_owners = shared_owners
        #: How often each leaf module was called; one called twice is traced through next
        #: time, so that its parameters become get_attr values like tied ones.
        self.leaf_calls: dict[str, int] = {}
        #: The last value handed to ``create_arg`` from outside it: after tracing, what
        #: forward returned, with its own container types (fx records every dict as dict).
        self.returned: Any = None
        self._depth = 0

    def create_arg(self, a: Any) -> Any:
        self._depth += 1
        try:
            return super().create_arg(a)
        finally:
            self._depth -= 1
            if self._depth == 0:
                self.returned = a

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        if module_qualified_name in self.shared_owners:
            return False
        return super().is_leaf_module(m, module_qualified_name)

    def call_module(
        self, m: nn.Module, forward: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        path = self.path_of_module(m)
        if self.is_leaf_module(m, path) and any(True for _ in m.parameters()):
            self.leaf_calls[path] = self.leaf_calls.get(path, 0) + 1
        return super().call_module(m, forward, args, kwargs)


def _shared_parameter_owners(model: nn.Module) -> frozenset[str]:
    owners: dict[int, set[str]] = {}
    for path, module in model.named_modules(remove_duplicate=False):
        for p in module.parameters(recurse=False):
            owners.setdefault(id(p), set()).add(path)
    return frozenset(path for paths in owners.values() if len(paths) > 1 for path in paths)


def _leaves_to_trace_through(
    model: nn.Module, graph: fx.Graph, leaf_calls: Mapping[str, int]
) -> frozenset[str]:
    """Leaf modules whose parameters or buffers two stages could hold: one called more than
    once, and one whose tensor the graph also reads through a ``get_attr`` (``self.lin(x)``
    and later ``x.to(self.lin.weight.dtype)``). Traced through, their tensors become
    ``get_attr`` values, each with one home stage that passes it on."""
    reused = {path for path, n in leaf_calls.items() if n > 1}
    read = {id(_attribute(model, n)) for n in graph.nodes if n.op == "get_attr"}
    for path in leaf_calls:
        module = model.get_submodule(path)
        if any(id(t) in read for t in (*module.parameters(), *module.buffers())):
            reused.add(path)
    return frozenset(reused)


def _attribute(model: nn.Module, node: fx.Node) -> Any:
    """What the ``get_attr`` ``node`` names on ``model`` (None: ``model`` has no such
    attribute)."""
    try:
        return attrgetter(str(node.target))(model)
    except AttributeError:
        return None


def _trace_fx(
    model: nn.Module,
    signature: inspect.Signature,
    bound: inspect.BoundArguments,
    given: inspect.BoundArguments,
) -> Traced:
    del given  # fx binds every parameter: placeholders follow the defaults-applied binding
    concrete = {k: v for k, v in bound.arguments.items() if not _holds_tensor(v)}
    tracer = _Tracer(_shared_parameter_owners(model))
    with functions_kept_whole():
        graph = tracer.trace(model, concrete_args=concrete or None)
        reused = _leaves_to_trace_through(model, graph, tracer.leaf_calls)
        if reused:  # a leaf called twice, or whose tensors the graph also reads itself
            tracer = _Tracer(tracer.shared_owners | reused)
            graph = tracer.trace(model, concrete_args=concrete or None)
    _plain_placeholders(graph)
    gm = fx.GraphModule(tracer.root, graph, type(model).__name__)
    _drop_concrete_placeholders(gm, set(concrete))
    merge_aliased_attributes(gm)
    replicate_shape_queries(gm)
    spec = _flatten_output(gm, tracer.returned)
    targets = [str(n.target) for n in gm.graph.nodes if n.op == "placeholder"]
    binder = InputBinder.from_example(signature, bound, kind="params", targets=targets)
    values = binder.bind(bound.args, bound.kwargs)
    return Traced(gm, binder, spec, "fx", values)


def _trace_export(
    model: nn.Module,
    signature: inspect.Signature,
    bound: inspect.BoundArguments,
    given: inspect.BoundArguments,
) -> Traced:
    """Export the call as the caller wrote it (``given``): passing defaults positionally
    breaks forwards whose decorators fill them by keyword, and torch.export keys dynamic
    shapes by the arguments it binds, so a defaulted ``**kwargs`` must not appear."""
    auto = torch.export.Dim.AUTO  # every dim dynamic unless the model's code fixes it
    dynamic = {
        k: tree_map(lambda t: dict.fromkeys(range(t.ndim), auto) if _is_batched(t) else None, v)
        for k, v in _flat_arguments(signature, given).items()
    }
    quiet = io.StringIO()  # export prints partial graphs on failure
    functions: list[FunctionCall] = []
    with contextlib.redirect_stdout(quiet), contextlib.redirect_stderr(quiet):
        with functions_recorded(functions), _named_keywords(model, signature, given):
            program = torch.export.export(
                model, tuple(given.args), dict(given.kwargs), strict=False, dynamic_shapes=dynamic
            )
    lost = next((c.cls for c in functions if not backward_is_derivative(c)), None)
    if lost is not None:
        raise RuntimeError(
            f"custom autograd Function {describe_function(lost)} would lose its "
            "backward: torch.export records the ops of its forward, so the pipeline would "
            "differentiate those instead; make the model traceable by torch.fx "
            "(tracer='fx' keeps such Functions whole)"
        )
    with warnings.catch_warnings():  # such tensors are reattached to the model's below
        warnings.filterwarnings("ignore", message=".*requires gradient.*not properly registered")
        unlifted = program.module()
    assert isinstance(unlifted, fx.GraphModule)
    out_spec = unlifted._out_spec
    assert out_spec is not None, "torch.export gave a module without an output spec"
    graph = unlifted.graph
    graph._codegen = fx.graph.CodeGen()
    gm = fx.GraphModule(unlifted, graph, type(model).__name__)
    guards, guarded = _guards(gm)
    kept = _drop_guards_and_constants(gm, given)
    _reattach_grad_constants(gm, program.constants)
    merge_aliased_attributes(gm)
    replicate_shape_queries(gm)
    position = leaf_positions(signature, given, bound)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    binder = InputBinder.from_example(
        signature,
        bound,
        kind="leaves",
        targets=[position[i] for i in kept],
        fixed={position[i]: _fixed_dims(n) for i, n in zip(kept, placeholders, strict=True)},
        guards=guards,
        guard_leaves=[position[i] for i in guarded],
    )
    values = binder.bind(bound.args, bound.kwargs)
    return Traced(gm, binder, out_spec, "export", values)


def _flat_arguments(signature: inspect.Signature, given: inspect.BoundArguments) -> dict[str, Any]:
    """The call's arguments by name, what a ``**kwargs`` parameter took spread out by key."""
    out: dict[str, Any] = {}
    for name, value in given.arguments.items():
        if signature.parameters[name].kind is inspect.Parameter.VAR_KEYWORD:
            out.update(value)
        else:
            out[name] = value
    return out


@contextlib.contextmanager
def _named_keywords(
    model: nn.Module, signature: inspect.Signature, given: inspect.BoundArguments
) -> Iterator[None]:
    """Within the block, a call that passes keywords through ``**kwargs`` (Hugging Face's
    ``num_items_in_batch``) meets a forward whose signature names them: torch.export keys
    dynamic shapes by the forward's parameters and rejects any spec for ``**kwargs``. The
    forward called is the model's own; only its signature is spelt out."""
    var = [p for p in signature.parameters.values() if p.kind is p.VAR_KEYWORD]
    if not var or not given.arguments.get(var[0].name):
        yield
        return
    keyword = inspect.Parameter.KEYWORD_ONLY
    params = [p for p in signature.parameters.values() if p.kind is not p.VAR_KEYWORD]
    params += [inspect.Parameter(k, keyword) for k in given.arguments[var[0].name]]
    original = model.forward
    had = "forward" in vars(model)

    def forward(*args: Any, **kwargs: Any) -> Any:
        return original(*args, **kwargs)

    forward.__signature__ = signature.replace(parameters=params)  # type: ignore[attr-defined]
    model.forward = forward
    try:
        yield
    finally:
        if had:
            model.forward = original
        else:
            del model.forward


def _guards(gm: fx.GraphModule) -> tuple[nn.Module | None, list[int]]:
    """The module torch.export made to check a call's input sizes (it raises
    AssertionError naming the condition a call breaks), and the index of each input leaf
    it takes; (None, []) where the graph has none."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for node in gm.graph.nodes:
        if node.op == "call_module" and str(node.target).startswith("_guards"):
            guards = gm.get_submodule(str(node.target))
            return guards, [placeholders.index(a) for a in node.args]
    return None, []


def _fixed_dims(placeholder: fx.Node) -> tuple[int | None, ...]:
    """The size torch.export fixed at each dim after the batch of an input (None: dynamic,
    or nothing recorded)."""
    value = placeholder.meta.get("val")
    if not isinstance(value, torch.Tensor) or value.ndim == 0:
        return ()
    return tuple(int(d) if is_concrete_int(d) else None for d in value.shape[1:])


@contextlib.contextmanager
def fake_runnable(model: nn.Module) -> Iterator[None]:
    """Let fake-tensor runs through BatchNorms with ``momentum=None`` (a cumulative average):
    they read their batch count into Python to update the running statistics, which fake
    tensors cannot; a fixed momentum while pricing gives the same outputs and shapes (the
    buffers are restored afterwards by the callers)."""
    cumulative = [m for m in model.modules() if isinstance(m, _BatchNorm) and m.momentum is None]
    for m in cumulative:
        m.momentum = 0.0
    try:
        yield
    finally:
        for m in cumulative:
            m.momentum = None


def _reattach_grad_constants(gm: fx.GraphModule, constants: Mapping[str, Any]) -> None:
    """Point the graph at the model's own tensors where export lifted a tensor that requires
    grad but is not a Parameter (a plain attribute, a closed-over tensor): export keeps a
    detached copy, so the gradient would never reach the model's tensor."""
    for node in gm.graph.nodes:
        value = constants.get(str(node.target)) if node.op == "get_attr" else None
        if isinstance(value, torch.Tensor) and value.requires_grad:
            owner, _, name = str(node.target).rpartition(".")
            module = gm.get_submodule(owner)
            if name in module._buffers:
                module._buffers[name] = value
            else:
                setattr(module, name, value)


def _recompute_shared_inputs(gm: fx.GraphModule, values: Sequence[Any]) -> None:
    """Recompute shared input-derived values beside their readers (:mod:`fxpipe.trace.recompute`),
    sized from the shapes torch.export recorded or by one run on fake tensors; left as
    they are when that run fails (the pricing that follows reports the failing node)."""
    recompute_input_values(gm, lambda: output_sizes(gm, values))


_TRACE = {"fx": _trace_fx, "export": _trace_export}


def _holds_tensor(value: Any) -> bool:
    leaves, _ = tree_flatten(value)
    return any(isinstance(x, torch.Tensor) for x in leaves)


def _is_batched(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.ndim > 0


def _clone_mutated_inputs(gm: fx.GraphModule) -> None:
    """Make the graph write into a copy of any input it modifies in place.

    Micro-batches are views of the caller's tensor that share one version counter, and a
    checkpointed stage runs again from its saved inputs: a write into an input would
    invalidate the other micro-batches' saved tensors and be applied twice. (The caller's
    tensor is therefore left as it was, where the eager model would have modified it.)
    """
    graph = gm.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    written = {_written_input(gm, node) for node in graph.nodes} - {None}
    for source in (n for n in placeholders if n in written):
        with graph.inserting_after(placeholders[-1]):
            copy = graph.call_function(_clone_leaves, (source,))
        source.replace_all_uses_with(copy, delete_user_cb=functools.partial(operator.is_not, copy))
    if written:
        graph.lint()
        gm.recompile()


def _clone_leaves(value: Any) -> Any:
    """``value`` with every tensor in it cloned (a model input the graph writes into)."""
    return tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, value)


def _written_input(gm: fx.GraphModule, node: fx.Node) -> fx.Node | None:
    """The placeholder ``node`` writes into in place, directly or through views."""
    from fxpipe.passes.ops import is_view, mutated_input, viewed_input

    value: fx.Node | None = mutated_input(gm, node)
    while value is not None and value.op != "placeholder":
        value = viewed_input(value) if is_view(value) else None
    return value


def _plain_placeholders(graph: fx.Graph) -> None:
    """fx names the placeholders of ``*args`` and ``**kwargs`` with their stars, making the
    generated forward variadic; every placeholder here takes one value (a tuple or a dict
    for those), so the stars go."""
    for node in graph.nodes:
        if node.op == "placeholder" and str(node.target).startswith("*"):
            node.target = str(node.target).lstrip("*")


def _drop_concrete_placeholders(gm: fx.GraphModule, names: set[str]) -> None:
    """Remove the placeholders fx made for constant arguments, and their assertion nodes;
    the binder checks those constants at call time instead."""
    graph = gm.graph
    concrete = {n for n in graph.nodes if n.op == "placeholder" and _base_name(n) in names}
    asserts = (torch._assert, fx._symbolic_trace._assert_is_none)
    for node in reversed(list(graph.nodes)):
        if node.op != "call_function" or node.target not in asserts or node.users:
            continue
        inputs = node.all_input_nodes
        if not any(a in concrete or set(a.all_input_nodes) & concrete for a in inputs):
            continue
        graph.erase_node(node)
        for arg in inputs:
            if arg.op == "call_function" and not arg.users:
                graph.erase_node(arg)
    for node in concrete:
        if not node.users:
            graph.erase_node(node)
    gm.recompile()


def _base_name(node: fx.Node) -> str:
    target = str(node.target)
    stem, _, suffix = target.rpartition("_")
    return stem if stem and suffix.isdigit() else target


def _drop_guards_and_constants(gm: fx.GraphModule, call: inspect.BoundArguments) -> list[int]:
    """Remove export's guard call and the placeholders of constant leaves; return, for each
    remaining placeholder, the index of its leaf in the flattened ``call``."""
    graph = gm.graph
    for node in list(graph.nodes):
        if node.op == "call_module" and str(node.target).startswith("_guards") and not node.users:
            graph.erase_node(node)
            if hasattr(gm, str(node.target)):
                delattr(gm, str(node.target))
    leaves, _ = tree_flatten((call.args, call.kwargs))
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(leaves):
        raise RuntimeError(
            f"export made {len(placeholders)} placeholders for {len(leaves)} input leaves"
        )
    kept = []
    for index, (node, leaf) in enumerate(zip(placeholders, leaves)):
        if isinstance(leaf, torch.Tensor) or node.users:
            kept.append(index)
        else:
            graph.erase_node(node)
    return kept


def merge_aliased_attributes(gm: fx.GraphModule) -> None:
    """One ``get_attr`` node per tensor object: a tied parameter reached under two names
    becomes one value, so it lives on one device; unused ``get_attr`` nodes are dropped."""
    first: dict[int, fx.Node] = {}
    for node in list(gm.graph.nodes):
        if node.op != "get_attr":
            continue
        if not node.users:
            gm.graph.erase_node(node)
            continue
        value = attrgetter(str(node.target))(gm)
        if not isinstance(value, torch.Tensor):
            continue
        kept = first.setdefault(id(value), node)
        if kept is not node:
            node.replace_all_uses_with(kept)
            gm.graph.erase_node(node)
    gm.graph.lint()
    gm.recompile()


def _plain(value: Any, like: Any = None) -> Any:
    """fx stores containers as immutable_dict / immutable_list; the user returned a dict
    (an OrderedDict where ``like``, the value forward returned, has one with these keys)
    or a list."""
    if isinstance(value, dict):
        same = isinstance(like, dict) and list(like) == list(value)
        kind = OrderedDict if same and type(like) is OrderedDict else dict
        return kind((k, _plain(v, like[k] if same else None)) for k, v in value.items())
    if isinstance(value, list):
        same = isinstance(like, list) and len(like) == len(value)
        return [_plain(v, like[i] if same else None) for i, v in enumerate(value)]
    if isinstance(value, tuple) and type(value) is tuple:
        same = isinstance(like, tuple) and len(like) == len(value)
        return tuple(_plain(v, like[i] if same else None) for i, v in enumerate(value))
    return value


def _expand_dataclass(value: Any) -> Any:
    """A traced call that builds a dataclass output becomes that dataclass of its field
    values, so the output's tensors are leaves like any others."""
    if not (isinstance(value, fx.Node) and value.op == "call_function"):
        return value
    cls = value.target
    if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
        return value
    if cls not in SUPPORTED_NODES:
        torch.export.register_dataclass(cls)
    return cls(*value.args, **value.kwargs)


def _flatten_output(gm: fx.GraphModule, returned: Any = None) -> TreeSpec:
    """Make the graph return a flat tuple of leaves; return the original structure's spec
    (``returned``, what forward returned while traced, gives dict subclasses back)."""
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    leaves, spec = tree_flatten(tree_map(_expand_dataclass, _plain(output.args[0], returned)))
    output.args = (tuple(leaves),)
    gm.recompile()
    return spec
