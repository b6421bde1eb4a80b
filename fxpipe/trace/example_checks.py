"""What the example call tells before planning: its positional arguments, the batch size
every tensor shares, and that every output the model returns follows that batch (so that
micro-batch outputs can be joined into it)."""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Mapping
from typing import Any

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensorMode
from torch.utils._pytree import (
    TreeSpec,
    keystr,
    tree_flatten_with_path,
    tree_map,
    tree_unflatten,
)

from fxpipe.errors import InputError, PlanError
from fxpipe.passes.batch.grouping import row_grouping
from fxpipe.passes.batch.mixing import check_no_batch_mixing
from fxpipe.passes.batch.reductions import split_reductions
from fxpipe.passes.batch.roles import batch_roles
from fxpipe.passes.ops import module_path, op_name
from fxpipe.passes.price.recorded import recorded_outputs
from fxpipe.passes.shape_only import same_shape_output
from fxpipe.trace.binding import argument_name, describe_value
from fxpipe.trace.tracing import Traced

__all__ = [
    "example_args",
    "example_batch",
    "output_names",
    "with_reductions",
    "check_outputs_follow_batch",
]


def example_args(example_input: Any) -> tuple[Any, ...]:
    """The example's positional arguments: a tuple as it is, another value as the only one.
    A list is refused: it reads as several arguments but would reach the model as one; so is
    a dict, a collated batch whose entries are the model's keyword arguments."""
    if isinstance(example_input, tuple):
        return example_input
    if isinstance(example_input, Mapping):
        keys = ", ".join(repr(k) for k in example_input)
        raise InputError(
            f"example_input is a {type(example_input).__name__} with keys {keys} (a collated "
            "batch, as a DataLoader or Trainer gives), which the model would get as one "
            "positional argument; pass its entries as keyword arguments: example_input=(), "
            "example_kwargs=batch (fxpipe.pipeline(model, (), devices, example_kwargs=batch), "
            "then pipe(**batch)), or (batch,) when the model's first argument is a dict"
        )
    if isinstance(example_input, list):
        raise InputError(
            f"example_input is {describe_value(example_input)}, which the model would get as "
            "one argument; pass the tensor itself for a model of one argument, a tuple "
            "(x, y) for several positional arguments, or ([a, b],) when the model's first "
            "argument is a list"
        )
    return (example_input,)


def example_batch(
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
    scalars = [w for w, shape in sizes if len(shape) == 0]  # whole values, not split
    sizes = [(w, shape) for w, shape in sizes if len(shape) > 0]
    if not sizes:
        raise InputError(
            f"example input {scalars[0]} is a 0-dim tensor, and the example has no tensor "
            "with a batch dimension to split (dim 0 of a tensor is the batch; a 0-dim tensor "
            "goes whole to every micro-batch); pass at least one batched tensor input"
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


def output_names(spec: TreeSpec) -> list[str]:
    """How the model names each of its output leaves: ``'loss'`` for a key or attribute of
    the output itself, ``output[1]['x']`` deeper, ``output`` for a lone tensor."""
    leaves = tree_unflatten(list(range(spec.num_leaves)), spec)
    names = []
    for path, _ in tree_flatten_with_path(leaves)[0]:
        key = path[0] if len(path) == 1 else None
        plain = getattr(key, "key", getattr(key, "name", None))
        names.append(repr(plain) if isinstance(plain, str) else f"output{keystr(path)}")
    return names


def with_reductions(
    traced: Traced, batch: int, *, reductions: bool = True, whole: bool = False
) -> Traced:
    """``traced`` checked for values that mix the batch's samples, and (``reductions``) with
    the outputs that reduce over the batch (a loss inside the model) computed from
    per-micro-batch partial sums (:mod:`fxpipe.passes.batch.reductions`). A per-sample value
    computed from a reduction over the batch is refused (PlanError), unless the batch runs
    whole (``whole``: one micro-batch, nothing to differ); ops along the batch's rows that
    mix them (a router's capacity over the batch) are kept in ``row_mixing`` for the
    runtime's warning. As it is where the graph's values at another batch size cannot be
    told (the output check that follows reports what it can)."""
    roles = batch_roles(traced.graph_module, traced.example_values, batch)
    if roles is None:
        return traced
    gm = traced.graph_module
    grouping = row_grouping(gm, roles) if whole else check_no_batch_mixing(gm, roles)
    mixing = tuple((describe_node(gm, name), why) for name, why in grouping.mixing.items())
    traced = dataclasses.replace(traced, row_mixing=mixing)
    if not reductions:
        return traced
    names = output_names(traced.output_spec)
    gm, finalize = split_reductions(gm, roles, names)
    if finalize is None:
        return traced
    return dataclasses.replace(traced, graph_module=gm, finalize=finalize)


def describe_node(gm: fx.GraphModule, name: str) -> str:
    """``'cumsum' in module 'model.layers.0.moe.gate'``: a node as a warning names it."""
    node = next(n for n in gm.graph.nodes if n.name == name)
    where = module_path(node)
    return f"{name!r} in module {where!r}" if where else repr(name)


def check_outputs_follow_batch(traced: Traced, batch: int) -> None:
    """Micro-batch outputs are joined along dim 0, so every tensor the model returns must
    grow with the batch (dim 0 in proportion, other dims fixed) and every other value must
    not depend on it. Checked at the example's batch and one more, from the sizes torch.export
    recorded in terms of the batch where it did, else on fake tensors; a graph that does not
    run on fake tensors is not checked."""
    gm = traced.graph_module
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    if not any(isinstance(a, fx.Node) for a in output.args[0]):
        return
    runs = _recorded_runs(traced, batch)
    for size in (batch, batch + 1) if not runs else ():
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
    joins = traced.finalize.joins if traced.finalize else ("cat",) * len(output.args[0])
    names = _leaf_names(traced)
    for leaf, join, name, a, b in zip(output.args[0], joins, names, *runs, strict=True):
        if join != "cat":  # a partial sum or count (fxpipe's own), joined by adding
            continue
        graph_name = f" (the graph's {leaf.name!r})" if isinstance(leaf, fx.Node) else ""
        if isinstance(a, _Shape) and isinstance(b, _Shape):
            same_rest = len(a) == len(b) > 0 and a[1:] == b[1:]
            if not (same_rest and a[0] * (batch + 1) == b[0] * batch):
                raise PlanError(
                    f"output tensor {name}{graph_name} has shape {tuple(a)} for a batch of "
                    f"{batch} and {tuple(b)} for {batch + 1}: its dim 0 is not the batch, so "
                    "micro-batches cannot be joined into it; return per-sample values (batch "
                    "first) and reduce outside the model"
                )
        elif not _same(a, b):
            raise PlanError(
                f"output value {name}{graph_name} is {a!r} for a batch of {batch} and {b!r} for "
                f"{batch + 1}: it depends on the batch size, so each micro-batch would return "
                "its own; return it as a batch-first tensor or compute it outside the model"
            )


def _leaf_names(traced: Traced) -> list[str]:
    """How the model names each output of the traced graph (a partial sum the graph adds
    is named by fxpipe)."""
    output = next(n for n in reversed(traced.graph_module.graph.nodes) if n.op == "output")
    count = len(output.args[0])
    names = output_names(traced.output_spec)
    finalize = traced.finalize
    if finalize is None:
        return names
    kept = [names[i] for i in range(len(names)) if i not in finalize.reduced]
    return kept + [f"partial sum {k}" for k in range(count - len(kept))]


#: Ops that read a tensor's value into Python (a number or a list).
_SCALAR_READS = frozenset(
    {"item", "tolist", "_local_scalar_dense", "int", "float", "bool", "__int__", "__float__"}
)


def _reads_scalar(node: fx.Node) -> bool:
    """Whether ``node`` itself turns a tensor into a Python value (not a module or op that
    reads a number internally, as a BatchNorm with ``momentum=None`` does)."""
    return node.op in ("call_function", "call_method") and op_name(node) in _SCALAR_READS


def _recorded_runs(traced: Traced, batch: int) -> list[list[Any]]:
    """The output leaves at ``batch`` and ``batch + 1`` as :class:`_FakeRun` gives them,
    from the sizes export recorded; empty where it recorded none that tell."""
    runs = recorded_outputs(traced.graph_module, traced.example_values, batch)
    return [[_Shape(v) if tensor else v for tensor, v in run] for run in runs or []]


class _Shape(tuple[int, ...]):
    """The shape of a tensor leaf (a tuple leaf of the output is a value, not this)."""


class _FakeRun(fx.Interpreter):
    """Runs a graph on fake tensors with another batch size; remembers the node it is at.
    Leaf modules whose output is shaped like their input are not run
    (:mod:`fxpipe.passes.shape_only`: a fake BatchNorm costs some thirty ops)."""

    node: fx.Node | None = None

    def run_node(self, n: fx.Node) -> Any:
        self.node = n
        if n.op == "call_module":
            args, kwargs = self.fetch_args_kwargs_from_env(n)
            out = same_shape_output(self.module.get_submodule(str(n.target)), args, kwargs)
            if out is not None:
                return out
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
