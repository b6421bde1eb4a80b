"""Each step's input sizes, learned by every rank of a pipeline from its first rank.

torch's ``PipelineStage`` receives into buffers of fixed shapes, and only the first rank
sees a step's inputs. So each step starts, before anything is sent, with one small
broadcast over the pipeline's ranks (``"pp"``; each replica of a mesh has its own): the
first rank checks the step's call (the model's arguments as traced, the example's number
of rows, the sizes the graph fixes and the conditions torch.export recorded on them) and
sends the micro-batch size of every tensor argument, or word that it refused the call and
why, on which every rank raises. Where the sizes differ from the previous step's, every
rank finds its stages' shapes for them (:func:`fxpipe.distributed.rank.shapes.shapes_at`, once
per set of sizes, then cached) and its stages re-make their buffers.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.pipelining.microbatch import split_args_kwargs_into_chunks
from torch.utils._pytree import tree_flatten, tree_unflatten

from fxpipe.distributed.rank.shapes import StageShapes, shapes_at
from fxpipe.errors import ConfigError, InputError
from fxpipe.ir import StageProgram
from fxpipe.trace.binding import InputBinder, bind_arguments

__all__ = ["Key", "StepShapes"]

#: The micro-batch shape of every tensor argument of a call, in the order of the model's
#: arguments as bound (defaults applied, then flattened).
Key = tuple[tuple[int, ...], ...]
#: Sets of sizes whose stage shapes are kept (a few hundred bytes each).
_CACHED = 1024


class StepShapes:
    """The sizes of the steps of one pipeline replica, agreed by its ranks.

    ``key``: the sizes the stages' buffers have now; ``example``: the example's shapes.
    """

    def __init__(
        self,
        program: StageProgram,
        binder: InputBinder,
        example: StageShapes,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        *,
        n_microbatches: int,
        group: dist.ProcessGroup | None,
        device: torch.device,
        comm: torch.device,
    ) -> None:
        self._program, self._binder, self._n = program, binder, n_microbatches
        self._group, self._device, self._comm = group, device, comm
        leaves = tree_flatten(_bound(binder, args, kwargs))[0]
        tensors = [t for t in leaves if isinstance(t, torch.Tensor)]
        self.rows = next((t.shape[0] for t in tensors if t.ndim), 0)
        # the example's tensor arguments (their dtypes and requires_grad), as meta tensors
        self._template = [torch.empty(0, dtype=t.dtype, device="meta") for t in tensors]
        self._grads = [t.requires_grad for t in tensors]
        self.key = self._example_key = self._key(args, kwargs)
        self.example = example
        self._cache: dict[Key, StageShapes] = {self.key: example}

    def agree(self, args: tuple[Any, ...], kwargs: dict[str, Any], *, first: bool) -> Key:
        """This step's sizes, on every rank of the pipeline (a collective over it): the
        first rank checks its call and sends them; InputError on every rank when it
        refuses the call."""
        failure: Exception | None = None
        key: Key = ()
        if first:
            try:
                key = self.check(args, kwargs)
            except Exception as e:  # every rank must hear of it, whatever it is
                failure = e
        if dist.get_world_size(self._group) == 1:
            if failure is not None:
                raise failure
            return key
        width = sum(len(shape) for shape in self.key)
        header = torch.zeros(1 + width, dtype=torch.int64)
        if first:
            header[0] = failure is not None
            if failure is None and width:
                header[1:] = torch.tensor([size for shape in key for size in shape])
        header = header.to(self._comm)
        src = 0 if self._group is None else dist.get_global_rank(self._group, 0)
        dist.broadcast(header, src=src, group=self._group)
        sizes = header.tolist()
        if sizes[0]:
            self._refused(failure, src)
        return self._unflat(sizes[1:]) if not first else key

    def check(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Key:
        """The micro-batch sizes of a step's call on the first rank; InputError for a call
        the pipeline cannot take: another structure, number of rows or number of dims
        than the example's, then what the binder refuses in its first micro-batch (another
        constant, a size the graph fixes, a broken condition torch.export recorded)."""
        key = self._key(args, kwargs)
        mb_args, mb_kwargs = split_args_kwargs_into_chunks(args, kwargs, self._n)
        self._binder.bind(mb_args[0], mb_kwargs[0])
        return key

    def shapes(self, key: Key) -> StageShapes:
        """The stages' shapes for a step of sizes ``key`` (found once, then cached);
        ConfigError or InputError, alike on every rank, where they cannot be found."""
        found = self._cache.get(key)
        if found is not None:
            return found
        if self.example.by_values:
            raise ConfigError(
                "this model's stage shapes depend on tensor values (a length read with "
                "'.item()'), so fxpipe found them on the example's own values and cannot "
                f"find them for other sizes: a step of micro-batch shapes {list(key)} differs "
                f"from the example's {list(self._example_key)}; "
                "pad every batch to the example's sizes, or build the pipeline with an "
                "example of the sizes you step with"
            )
        values = self._binder.bind(*self._call(key))
        try:
            found = shapes_at(self._program, values, self._device)
        except Exception as e:
            raise InputError(
                f"the model's stages do not run on inputs of micro-batch shapes {list(key)} "
                f"({type(e).__name__}: {e}); step with the sizes the model takes"
            ) from e
        if len(self._cache) >= _CACHED:
            self._cache.pop(next(k for k in self._cache if k != self.key))
        self._cache[key] = found
        return found

    def _key(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Key:
        """The micro-batch sizes of a call, checked against the example's structure, rows
        and numbers of dims."""
        flat, spec = tree_flatten(_bound(self._binder, args, kwargs))
        if spec != self._binder.in_spec:
            self._binder.bind(args, kwargs)  # raises, naming the argument that differs
        key = []
        for leaf, t in zip(self._binder.leaves, flat, strict=True):
            if not leaf.is_tensor:
                continue  # a constant: the binder checks it
            if not isinstance(t, torch.Tensor):
                raise InputError(
                    f"argument {leaf.where} is a {type(t).__name__} but a tensor was traced "
                    "there; pass a tensor"
                )
            if t.ndim != leaf.ndim:
                raise InputError(
                    f"argument {leaf.where} has shape {tuple(t.shape)} ({t.ndim} dims) but "
                    f"the pipeline was traced with {leaf.ndim} dims there; pass a tensor of "
                    f"{leaf.ndim} dims"
                )
            if t.ndim and t.shape[0] != self.rows:
                mb = self.rows // self._n
                raise InputError(
                    f"argument {leaf.where} has shape {tuple(t.shape)}: a batch of "
                    f"{t.shape[0]} rows, but the pipeline was built for batches of "
                    f"{self.rows} rows (the example's, in n_microbatches={self._n} of "
                    f"{mb}); torch.distributed.pipelining sizes its buffers per "
                    f"micro-batch: step with batches of {self.rows} rows (their other "
                    "sizes, a sequence length, may change), or build the pipeline with an "
                    "example of the batch you step with"
                )
            key.append((t.shape[0] // self._n, *t.shape[1:]) if t.ndim else ())
        return tuple(tuple(int(s) for s in shape) for shape in key)

    def _unflat(self, sizes: list[int]) -> Key:
        out, at = [], 0
        for shape in self.key:
            out.append(tuple(sizes[at : at + len(shape)]))
            at += len(shape)
        return tuple(out)

    def _call(self, key: Key) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """A micro-batch call of sizes ``key``: ``meta`` tensors where the example had
        tensors (its dtypes), the example's constants elsewhere."""
        made = iter(
            torch.empty(shape, dtype=t.dtype, device="meta").requires_grad_(grad)
            for shape, t, grad in zip(key, self._template, self._grads, strict=True)
        )
        flat = [next(made) if leaf.is_tensor else leaf.value for leaf in self._binder.leaves]
        bound_args, bound_kwargs = tree_unflatten(flat, self._binder.in_spec)
        return tuple(bound_args), dict(bound_kwargs)

    def _refused(self, failure: Exception | None, src: int) -> None:
        """Every rank raises: the first rank its own error, the others one that quotes it."""
        box: list[Any] = [None if failure is None else f"{type(failure).__name__}: {failure}"]
        dist.broadcast_object_list(box, src=src, group=self._group, device=self._comm)
        if failure is not None:
            raise failure
        raise InputError(
            f"the pipeline's first rank refused this step's inputs ({box[0]}); fix the "
            "inputs given to schedule.step on the first rank"
        )


def _bound(binder: InputBinder, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``(args, kwargs)`` of a call as the binder sees them (defaults applied)."""
    bound = bind_arguments(binder.signature, args, kwargs)
    return bound.args, bound.kwargs
