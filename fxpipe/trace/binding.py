"""Maps a call's ``(*args, **kwargs)`` onto the placeholders of a traced graph, and checks it."""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import SequenceKey, TreeSpec, tree_flatten, tree_flatten_with_path

from fxpipe.errors import InputError

__all__ = ["InputBinder", "bind_arguments", "describe_path", "argument_name", "describe_value"]


def bind_arguments(
    signature: inspect.Signature, args: Sequence[Any], kwargs: Mapping[str, Any]
) -> inspect.BoundArguments:
    """Bind a call to ``signature`` with defaults applied; a mismatch is an InputError."""
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError as e:
        raise InputError(
            f"the call does not match the model's forward{signature}: {e}; "
            "pass the same arguments as the model itself takes"
        ) from e
    bound.apply_defaults()
    return bound


def given_arguments(
    signature: inspect.Signature, args: Sequence[Any], kwargs: Mapping[str, Any]
) -> inspect.BoundArguments:
    """Bind a call as its caller wrote it, defaults not applied: what torch.export binds, and
    what wrappers that fill arguments from a config (Hugging Face models) expect."""
    return signature.bind(*args, **kwargs)


def leaf_positions(
    signature: inspect.Signature, given: inspect.BoundArguments, bound: inspect.BoundArguments
) -> list[int]:
    """For each leaf of ``(given.args, given.kwargs)``, the index of the same argument's leaf
    in ``(bound.args, bound.kwargs)``, the same call with defaults applied."""
    flat_bound, _ = tree_flatten_with_path((bound.args, bound.kwargs))
    index = {argument_name(signature, path): i for i, (path, _) in enumerate(flat_bound)}
    flat_given, _ = tree_flatten_with_path((given.args, given.kwargs))
    return [index[argument_name(signature, path)] for path, _ in flat_given]


def describe_path(path: Sequence[Any]) -> str:
    """A pytree key path as Python-like text: ``args[0]['mask']``."""
    return "".join(str(k) for k in path) or "<root>"


@dataclass(frozen=True)
class _Leaf:
    """What the example had at one leaf of the call's pytree."""

    where: str
    is_tensor: bool
    value: Any  # the example's constant, for non-tensor leaves
    ndim: int = 0
    inner_shape: tuple[int, ...] = ()
    dtype: torch.dtype | None = None
    #: For a tensor the graph only takes in some shapes: the size it needs at each dim
    #: after the batch (None: any size); empty when every dim may change.
    fixed: tuple[int | None, ...] = ()


def argument_name(signature: inspect.Signature, path: Sequence[Any]) -> str:
    """The name a user knows a leaf of ``(bound.args, bound.kwargs)`` by: ``mask``,
    ``inputs[1]``, ``batch['x']``."""
    if len(path) < 2:
        return describe_path(path)
    group, key, rest = path[0], path[1], "".join(str(k) for k in path[2:])
    if getattr(group, "idx", None) == 1:
        return f"{getattr(key, 'key', key)}{rest}"
    index = int(getattr(key, "idx", 0))
    params = list(signature.parameters.values())
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if index < len(positional):
        return f"{positional[index].name}{rest}"
    var = next((p.name for p in params if p.kind == p.VAR_POSITIONAL), "args")
    return f"{var}[{index - len(positional)}]{rest}"


def _example_leaves(
    signature: inspect.Signature, bound: inspect.BoundArguments
) -> tuple[list[_Leaf], TreeSpec]:
    flat, spec = tree_flatten_with_path((bound.args, bound.kwargs))
    leaves = []
    for path, value in flat:
        where = argument_name(signature, path)
        if isinstance(value, torch.Tensor):
            leaves.append(
                _Leaf(where, True, None, value.ndim, tuple(value.shape[1:]), value.dtype)
            )
        else:
            leaves.append(_Leaf(where, False, value))
    return leaves, spec


@dataclass(frozen=True)
class InputBinder:
    """Turns call arguments into one value per graph placeholder, rejecting what the graph
    was not traced for (a different structure, a changed constant, a changed shape)."""

    signature: inspect.Signature
    #: pytree spec of ``(bound.args, bound.kwargs)`` at trace time.
    in_spec: TreeSpec
    leaves: tuple[_Leaf, ...]
    #: "params": one placeholder per forward parameter (fx); "leaves": one per flat leaf.
    kind: str
    #: For kind "params", the parameter name of each placeholder; for "leaves", the
    #: index of each placeholder's leaf.
    targets: tuple[Any, ...]
    #: The conditions torch.export recorded on the input sizes (a callable that raises
    #: AssertionError naming the one a call breaks), called on the leaves at
    #: ``guard_leaves``; None when there are none.
    guards: Callable[..., Any] | None = None
    guard_leaves: tuple[int, ...] = ()

    @classmethod
    def from_example(
        cls,
        signature: inspect.Signature,
        bound: inspect.BoundArguments,
        *,
        kind: str,
        targets: Sequence[Any],
        fixed: Mapping[int, tuple[int | None, ...]] | None = None,
        guards: Callable[..., Any] | None = None,
        guard_leaves: Sequence[int] = (),
    ) -> InputBinder:
        """``fixed``: leaf index -> the size the graph needs at each dim after the batch
        (None: any), for leaves whose graph fixed some (torch.export specialises a dim the
        model's Python code branches on); ``guards``: see the field."""
        leaves, spec = _example_leaves(signature, bound)
        for index, dims in (fixed or {}).items():
            if any(d is not None for d in dims):
                leaves[index] = dataclasses.replace(leaves[index], fixed=tuple(dims))
        return cls(
            signature, spec, tuple(leaves), kind, tuple(targets), guards, tuple(guard_leaves)
        )

    @property
    def shape_specialized(self) -> bool:
        """Whether some tensor argument must keep a non-batch size of the example's."""
        return any(leaf.fixed for leaf in self.leaves)

    def fits(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> bool:
        """Whether the call has the structure this graph was traced for: the same
        arguments passed, tensors where tensors were, the same non-tensor values. (Its
        shapes are :meth:`bind`'s to check.) InputError when it does not match the
        forward's signature at all."""
        bound = bind_arguments(self.signature, args, kwargs)
        flat, spec = tree_flatten((bound.args, bound.kwargs))
        if spec != self.in_spec:
            return False
        for leaf, value in zip(self.leaves, flat, strict=True):
            if leaf.is_tensor != isinstance(value, torch.Tensor):
                return False
            if not leaf.is_tensor and not _same_constant(value, leaf.value):
                return False
        return True

    def same_call(self, other: InputBinder) -> bool:
        """Whether ``other`` maps calls onto its graph as this one does."""
        return (
            self.in_spec == other.in_spec
            and self.leaves == other.leaves
            and self.kind == other.kind
            and self.targets == other.targets
            and (self.guards is None) == (other.guards is None)
        )

    def bind(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> tuple[Any, ...]:
        """One value per placeholder for this call; raises InputError on any mismatch."""
        bound = bind_arguments(self.signature, args, kwargs)
        flat, spec = tree_flatten((bound.args, bound.kwargs))
        if spec != self.in_spec:
            raise InputError(self._structure_mismatch(bound))
        for leaf, value in zip(self.leaves, flat):
            self._check_leaf(leaf, value)
        self._check_batch(flat)
        self._check_guards(flat)
        if self.kind == "leaves":
            return tuple(flat[int(i)] for i in self.targets)
        return tuple(bound.arguments[str(name).lstrip("*")] for name in self.targets)

    def _check_batch(self, flat: Sequence[Any]) -> None:
        """Every tensor traced with a batch dimension has one, of the same non-zero size."""
        first: tuple[str, int] | None = None
        for leaf, value in zip(self.leaves, flat):
            if not leaf.is_tensor or leaf.ndim == 0:
                continue
            shape = tuple(value.shape)
            if not shape:
                raise InputError(
                    f"argument {leaf.where} is a 0-dim tensor but was traced with a batch "
                    "dimension; dim 0 of every tensor input is the batch: give it one"
                )
            if first is None:
                first = (leaf.where, shape[0])
                if shape[0] == 0:
                    raise InputError(
                        f"argument {leaf.where} has an empty batch (shape {shape}); pass at "
                        "least one sample"
                    )
            elif shape[0] != first[1]:
                raise InputError(
                    f"argument {leaf.where} has shape {shape}, batch size {shape[0]}, but "
                    f"{first[0]} has {first[1]}; dim 0 of every tensor input is the batch"
                )

    def _check_guards(self, flat: Sequence[Any]) -> None:
        """The sizes satisfy what the graph was traced for (a graph whose code unrolled a
        loop over a dynamic size holds for the sizes that unroll alike)."""
        if self.guards is None:
            return
        try:
            self.guards(*[flat[i] for i in self.guard_leaves])
        except AssertionError as e:
            shapes = ", ".join(
                f"{leaf.where} {tuple(flat[i].shape)}"
                for i, leaf in enumerate(self.leaves)
                if leaf.is_tensor and isinstance(flat[i], torch.Tensor)
            )
            raise InputError(
                f"the inputs' shapes ({shapes}) break a condition the model's code put on "
                f"them when torch.export traced it ({e}): the graph holds for the sizes "
                "that meet it; pass such sizes, or rebuild the pipeline with an example of "
                "the new shape"
            ) from None

    def _check_leaf(self, leaf: _Leaf, value: Any) -> None:
        if not leaf.is_tensor:
            if isinstance(value, torch.Tensor) or not _same_constant(value, leaf.value):
                raise InputError(
                    f"argument {leaf.where} is {_short(value)} but the pipeline was traced "
                    f"with {_short(leaf.value)}; non-tensor arguments are fixed at trace time: "
                    "pass the traced value or rebuild the pipeline with this one"
                )
            return
        if not isinstance(value, torch.Tensor):
            raise InputError(
                f"argument {leaf.where} is {_short(value)} but a tensor was traced there; "
                "pass a tensor"
            )
        if not leaf.fixed:
            return
        inner = tuple(value.shape[1:])
        wrong = value.ndim != leaf.ndim or any(
            need is not None and need != got for need, got in zip(leaf.fixed, inner)
        )
        if wrong:
            wanted = ", ".join("*" if d is None else str(d) for d in leaf.fixed)
            dims = [str(d + 1) for d, need in enumerate(leaf.fixed) if need is not None]
            raise InputError(
                f"argument {leaf.where} has shape {tuple(value.shape)} but the graph was "
                f"traced for shape (batch, {wanted}) ('*': any size): the model's code fixed "
                f"dim {', '.join(dims)} to the example's size (torch.export specialises a "
                "size the forward branches or loops on); pass that size, or rebuild the "
                "pipeline with an example of the new shape"
            )

    def _structure_mismatch(self, bound: inspect.BoundArguments) -> str:
        """The first argument whose structure differs from the example's, in words."""
        traced = self._traced_arguments()
        given: list[tuple[int | str, Any]] = [*enumerate(bound.args), *bound.kwargs.items()]
        for key, value in given:
            if key not in traced:
                return (
                    f"argument {self._name(key)} is {describe_value(value)} but the example "
                    "passed nothing there; call the pipeline with the arguments of the "
                    "example, or rebuild it with an example that passes this one"
                )
            spec, leaves = traced[key]
            if tree_flatten(value)[1] != spec:
                return (
                    f"argument {self._name(key)} is {describe_value(value)} but the pipeline was "
                    f"traced with {_describe_spec(spec, leaves)} there; pass "
                    f"{_describe_spec(spec, leaves)} as the example did, or rebuild the "
                    "pipeline with an example of this structure"
                )
        missing = next(self._name(k) for k in traced if k not in dict(given))
        return (
            f"argument {missing} is missing but the example passed it; call the pipeline "
            "with the arguments of the example"
        )

    def _traced_arguments(self) -> dict[int | str, tuple[TreeSpec, list[_Leaf]]]:
        """Per positional index or keyword: the example's spec and leaves there."""
        args_spec, kwargs_spec = self.in_spec.children()
        keys: list[int | str] = [*range(args_spec.num_children), *kwargs_spec.context]
        specs = [*args_spec.children(), *kwargs_spec.children()]
        out, start = {}, 0
        for key, spec in zip(keys, specs, strict=True):
            out[key] = (spec, list(self.leaves[start : start + spec.num_leaves]))
            start += spec.num_leaves
        return out

    def _name(self, key: int | str) -> str:
        if isinstance(key, str):
            return key
        return argument_name(self.signature, (SequenceKey(0), SequenceKey(key)))


def describe_value(value: Any) -> str:
    """What a call passed, in words: a tensor of shape (8, 4), a list of 2 items, ..."""
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    if isinstance(value, (list, tuple)):
        items = ", ".join([*map(describe_value, value[:3]), *(["..."] if len(value) > 3 else [])])
        return f"a {type(value).__name__} of {_items(len(value))} ({items})"
    if isinstance(value, dict):
        return f"a dict with keys {sorted(map(str, value))}"
    return _short(value)


def _describe_spec(spec: TreeSpec, leaves: Sequence[_Leaf]) -> str:
    """What the example passed where ``spec`` (holding ``leaves``) was traced, in words."""
    if spec.is_leaf():
        leaf = leaves[0]
        if leaf.is_tensor:
            inner = "".join(f", {n}" for n in leaf.inner_shape)
            return f"a tensor of shape (batch{inner})" if leaf.ndim else "a 0-dim tensor"
        return _short(leaf.value)
    if spec.type in (list, tuple):
        return f"a {spec.type.__name__} of {_items(spec.num_children)}"
    if spec.type is dict:
        return f"a dict with keys {sorted(map(str, spec.context))}"
    if spec.type is type(None):
        return "None"
    return f"a {getattr(spec.type, '__name__', spec.type)}"


def _items(n: int) -> str:
    return f"{n} item" if n == 1 else f"{n} items"


def _same_constant(a: Any, b: Any) -> bool:
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:
        return a is b


def _short(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
