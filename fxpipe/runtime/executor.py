"""Runs a StageProgram's stages over micro-batches on the clock-cycle schedule.

Every clock tick has two phases. *Fence* (main thread): for each cell ``(i, j)``, fetch the
inputs of stage ``j`` for micro-batch ``i`` straight from wherever they were produced onto
``devices[j]``, then tie the backward of micro-batch ``i - 1`` at stage ``j`` behind that of
micro-batch ``i``. *Compute*: send every cell to its device's worker thread, wait for all
of them, and store their outputs.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NoReturn

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from fxpipe.errors import ConfigError, InputError, StageError, StageRunError
from fxpipe.ir import Checkpoints, StageProgram
from fxpipe.runtime.batchnorm import DeferredBatchNorm
from fxpipe.runtime.checkpoint import Checkpointing
from fxpipe.runtime.copy import copy, wait
from fxpipe.runtime.dependency import fork, join
from fxpipe.runtime.microbatch import batch_size
from fxpipe.runtime.recording import NO_RECORDER, RunRecorder
from fxpipe.runtime.schedule import clock_cycles
from fxpipe.runtime.stream import (
    AbstractStream,
    current_stream,
    is_cuda,
    new_stream,
    normalize_device,
)
from fxpipe.runtime.worker import InQueue, OutQueue, Result, Task, WorkerPool

__all__ = ["Executor"]

Env = dict[str, Any]
Cell = tuple[int, int]


@dataclass
class _Run:
    """The state of one :meth:`Executor.run`."""

    #: ``envs[i]``: value name -> value, for micro-batch ``i``.
    envs: list[Env]
    #: ``copies[i]``: (value name, device) -> the value copied onto that device.
    copies: list[dict[tuple[str, torch.device], Any]]
    #: ``stops[j]``: micro-batches ``i < stops[j]`` of stage ``j`` are checkpointed.
    stops: list[int]
    grad: bool
    keep: frozenset[str]
    #: The micro-batches as given, for error messages (their rows).
    batches: Sequence[tuple[Any, ...]] = ()
    #: Stage arguments prepared by the fence, waiting for the compute phase.
    args: dict[Cell, list[Any]] = field(default_factory=dict)
    #: (value name, device) -> a whole value (``program.whole``) on that device, copied
    #: once for the run from the first micro-batch that made it.
    whole: dict[tuple[str, torch.device], Any] = field(default_factory=dict)


def _float_leaf(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and x.is_floating_point()


class Executor:
    """Runs the stages of a :class:`StageProgram` on ``devices``, GPipe-style.

    ``checkpoint`` is ``"always"``, ``"except_last"`` or ``"never"``, or a tuple of one of
    them per stage: micro-batch ``i`` of a stage is checkpointed when ``i < checkpoint_stop``,
    which is ``m``, ``m - 1`` or ``0`` for ``m`` real micro-batches. Nothing is
    checkpointed, and no ordering or checkpoint Function is attached, under
    ``torch.no_grad()``; a stage in eval mode is never checkpointed.
    """

    #: Told about every run, cell and transfer: a ``Recorder`` times them while one is
    #: attached (``Pipeline.attach_recorder``); ``NO_RECORDER`` runs them as they are.
    recorder: RunRecorder = NO_RECORDER

    def __init__(
        self,
        program: StageProgram,
        devices: Sequence[torch.device | str | int],
        checkpoint: Checkpoints = "except_last",
        *,
        labels: Sequence[str] | None = None,
    ) -> None:
        if len(devices) != program.num_stages:
            raise ConfigError(
                f"one device per stage is needed (devices: {len(devices)}, "
                f"stages: {program.num_stages})"
            )
        self.program = program
        self._no_grad = tuple(
            frozenset(k for k, name in enumerate(names) if name in program.no_grad)
            for names in program.outputs
        )
        self.devices = tuple(normalize_device(d) for d in devices)
        self.checkpoint = checkpoint
        #: How error messages name each stage (``stage 1 (blocks.2 to head, on cpu)``).
        self.labels = tuple(labels or (f"stage {j}" for j in range(program.num_stages)))
        self._distinct_devices = frozenset(self.devices)
        #: The DeferredBatchNorm wrappers of each stage; told the micro-batch count per run.
        self.deferred_batch_norms: tuple[tuple[DeferredBatchNorm, ...], ...] = tuple(
            tuple(m for m in gm.modules() if isinstance(m, DeferredBatchNorm))
            for gm in program.modules
        )
        self._last_use: dict[str, int] = {}
        for j, names in enumerate(program.inputs):
            for name in names:
                self._last_use[name] = j
        self._known = set(program.graph_inputs).union(*program.outputs)
        self._copy_streams: dict[tuple[torch.device, int], AbstractStream] = {}
        #: One worker thread per distinct device, kept across runs (stopped on failure).
        self.workers = WorkerPool()
        #: Run stages in worker threads; with one distinct device there is nothing to
        #: overlap, so by default they run in the calling thread and skip the hand-off.
        self.use_threads = len(self._distinct_devices) > 1

    def checkpoint_stop(self, m: int, j: int) -> int:
        """Micro-batches ``i < checkpoint_stop(m, j)`` of stage ``j`` run checkpointed."""
        if not torch.is_grad_enabled() or not self.program.modules[j].training:
            return 0
        mode = self.checkpoint if isinstance(self.checkpoint, str) else self.checkpoint[j]
        return {"always": m, "except_last": m - 1, "never": 0}[mode]

    def run(self, batches: Sequence[tuple[Any, ...]], wanted: Sequence[str]) -> list[Env]:
        """Run every micro-batch through every stage; return the ``wanted`` values of each.

        ``batches[i]`` holds micro-batch ``i``'s values of ``program.graph_inputs``. The
        first exception a stage raises is re-raised here, with its own type and traceback,
        once the tick it happened in has drained; later ticks never start.
        """
        run = self._start(batches, wanted)
        self.recorder.begin_run()
        m, n = len(batches), self.program.num_stages
        if not self.use_threads:
            for cells in clock_cycles(m, n):
                self._fence(cells, run)
                self._compute(cells, run, None)
        else:
            with self.workers.session(self.devices) as queues:
                for cells in clock_cycles(m, n):
                    self._fence(cells, run)
                    self._compute(cells, run, queues)
        return [{name: env[name] for name in wanted} for env in run.envs]

    def _start(self, batches: Sequence[tuple[Any, ...]], wanted: Sequence[str]) -> _Run:
        names = self.program.graph_inputs
        if not batches:
            raise InputError("there are no micro-batches to run")
        for i, batch in enumerate(batches):
            if len(batch) != len(names):
                raise InputError(
                    f"micro-batch {i} has {len(batch)} values, but the program takes "
                    f"{len(names)} ({', '.join(names)})"
                )
        unknown = [name for name in wanted if name not in self._known]
        if unknown:
            raise ConfigError(f"no stage produces {', '.join(unknown)}")
        m = len(batches)
        for wrappers in self.deferred_batch_norms:
            for wrapper in wrappers:
                wrapper.begin_step(m)
        return _Run(
            envs=[dict(zip(names, batch, strict=True)) for batch in batches],
            copies=[{} for _ in batches],
            stops=[self.checkpoint_stop(m, j) for j in range(self.program.num_stages)],
            grad=torch.is_grad_enabled(),
            keep=frozenset(wanted),
            batches=batches,
        )

    # One cell (i, j), stage j - 1 on another device, checkpointing on:
    #
    #  fence (main):  env[i][v] ─Wait─Copy─Wait─► a ─Join◄─ phony ◄─Fork─ outputs of (i-1, j)
    #                                             │
    #  compute (worker):                          └─► Checkpoint(stage j) ─► out0, out1, ...
    #                                                                          │
    #  compute (main):  out0 ─Fork─► out0' ─Join─► env[i][out0]                ◄┘
    #                         └─► Recompute ─┘
    #
    #  next tick, fence (i+1, j): outputs of (i, j) ─Fork─► phony ─Join─► an input of (i+1, j)
    #
    # In backward, Join hands the phony gradient to Recompute first, then Checkpoint
    # backpropagates through the recomputed stage; Fork on the outputs of (i, j) holds its
    # gradient until the backward of (i+1, j) has reached that Join.

    def _fence(self, cells: list[Cell], run: _Run) -> None:
        for i, j in cells:
            phonies = self._fork_outputs(run.envs[i - 1], j) if run.grad and i > 0 else []
            device = self.devices[j]
            args = [self._fetch(run, (i, j), name, device) for name in self.program.inputs[j]]
            run.args[(i, j)] = self._join_inputs(args, phonies)
            self._release(run, i, j)

    def _fork_outputs(self, env: Env, j: int) -> list[torch.Tensor]:
        """Fork every output of stage ``j`` in ``env`` that carries a gradient."""
        phonies: list[torch.Tensor] = []
        for name in self.program.outputs[j]:
            if name not in env:
                continue
            leaves, spec = tree_flatten(env[name])
            for k, leaf in enumerate(leaves):
                if _float_leaf(leaf) and leaf.requires_grad:
                    leaves[k], phony = fork(leaf)
                    phonies.append(phony)
            env[name] = tree_unflatten(leaves, spec)
        return phonies

    def _join_inputs(self, args: list[Any], phonies: list[torch.Tensor]) -> list[Any]:
        """Join ``phonies`` to the first floating-point tensor among ``args`` that carries a
        gradient, else to the first one. A joined tensor carries one: joined to a value that
        did not (a rotary table, a float mask), it would have autograd differentiate the
        stage by it, and a compiled stage see its inputs change from micro-batch 0 to 1
        (one more compile)."""
        if not phonies:
            return args
        leaves, spec = tree_flatten(args)
        floats = [k for k, leaf in enumerate(leaves) if _float_leaf(leaf)]
        k = next((k for k in floats if leaves[k].requires_grad), floats[0] if floats else None)
        if k is None:
            return args
        for phony in phonies:
            leaves[k] = join(leaves[k], phony)
        joined: list[Any] = tree_unflatten(leaves, spec)
        return joined

    def _release(self, run: _Run, i: int, j: int) -> None:
        """Forget the inputs of stage ``j`` that no later stage reads (autograd keeps them)."""
        for name in self.program.inputs[j]:
            if self._last_use[name] == j and name not in run.keep:
                run.envs[i].pop(name, None)
                for device in self._distinct_devices:
                    run.copies[i].pop((name, device), None)

    def _fetch(self, run: _Run, cell: Cell, name: str, device: torch.device) -> Any:
        """The value ``name`` of micro-batch ``i`` on ``device``, copied once per device; a
        whole value (the same for every micro-batch) once per run."""
        key = (name, device)
        cache = run.whole if name in self.program.whole else run.copies[cell[0]]
        if key not in cache:
            cache[key] = self._move(run.envs[cell[0]][name], cell, device)
        return cache[key]

    def _move(self, value: Any, cell: Cell, device: torch.device) -> Any:
        if isinstance(value, torch.Tensor):
            if normalize_device(value.device) == device:
                return value
            return self._transfer((value,), cell, normalize_device(value.device), device)[0]
        leaves, spec = tree_flatten(value)
        groups: dict[torch.device, list[int]] = {}
        for k, leaf in enumerate(leaves):
            if isinstance(leaf, torch.Tensor) and normalize_device(leaf.device) != device:
                groups.setdefault(normalize_device(leaf.device), []).append(k)
        if not groups:
            return value
        for source, ks in groups.items():
            moved = self._transfer(tuple(leaves[k] for k in ks), cell, source, device)
            for k, tensor in zip(ks, moved, strict=True):
                leaves[k] = tensor
        return tree_unflatten(leaves, spec)

    def _transfer(
        self,
        tensors: tuple[torch.Tensor, ...],
        cell: Cell,
        source: torch.device,
        dest: torch.device,
    ) -> tuple[torch.Tensor, ...]:
        """Copy on the copy streams of micro-batch ``i``, ordered against both compute streams."""
        i = cell[0]
        prev, nxt = self.copy_stream(source, i), self.copy_stream(dest, i)
        compute_prev, compute_next = current_stream(source), current_stream(dest)
        if is_cuda(prev):
            tensors = wait(tensors, compute_prev, prev)
        move = functools.partial(copy, prev_stream=prev, next_stream=nxt)
        tensors = self.recorder.transfer(move, tensors, cell, (source, dest), nxt)
        if is_cuda(nxt):
            tensors = wait(tensors, nxt, compute_next)
        return tensors

    def copy_stream(self, device: torch.device, i: int) -> AbstractStream:
        """The copy stream of micro-batch ``i`` on ``device`` (created once, then reused)."""
        key = (device, i)
        if key not in self._copy_streams:
            self._copy_streams[key] = new_stream(device)
        return self._copy_streams[key]

    def _compute(
        self,
        cells: list[Cell],
        run: _Run,
        queues: tuple[list[InQueue], list[OutQueue]] | None,
    ) -> None:
        """Run one tick's cells: in the workers when ``queues`` are given, else here."""
        pending: list[tuple[int, int, Checkpointing | None]] = []
        tasks: list[Task] = []
        recorder = self.recorder
        for i, j in cells:
            args = tuple(run.args.pop((i, j)))
            module, device = self.program.modules[j], self.devices[j]
            checkpointing = None
            if i < run.stops[j]:
                checkpointing = Checkpointing(module, args, device, self._no_grad[j])
            compute = recorder.cell((i, j), device, module, args, checkpointing, run.grad)
            tasks.append(Task(compute, stream=current_stream(device)))
            pending.append((i, j, checkpointing))
        results: list[Result]
        if queues is None:
            results = [task.run() for task in tasks]
        else:
            for (_, j, _), task in zip(pending, tasks, strict=True):
                queues[0][j].put(task)
            # Drain the whole tick before raising, so no worker is left busy with it.
            results = [queues[1][j].get() for _, j, _ in pending]
        for (i, j, checkpointing), (ok, payload) in zip(pending, results, strict=True):
            if not ok:
                self._raise_failure(payload, (i, j), run)
            outputs = self._check_outputs(payload, j)
            if checkpointing is not None:
                outputs = checkpointing.recompute(outputs)
            run.envs[i].update(zip(self.program.outputs[j], outputs, strict=True))

    def _raise_failure(self, exc_info: Any, cell: Cell, run: _Run) -> NoReturn:
        """Re-raise what cell ``(i, j)`` raised: torch's plain RuntimeError (shape errors)
        as a StageRunError naming the stage, the micro-batch and its rows of the batch; any
        other exception as it is, with that context added as a note."""
        _, error, traceback = exc_info
        error = error.with_traceback(traceback)
        stage, micro_batch = self.labels[cell[1]], _micro_batch(cell[0], run)
        if type(error) is RuntimeError:
            message = f"{stage} failed on {micro_batch}: {error}{_size_hint(error)}"
            raise StageRunError(message) from error
        if isinstance(error, Exception) and hasattr(error, "add_note"):
            error.add_note(f"fxpipe: raised by {stage} on {micro_batch}")
        raise error

    def _check_outputs(self, outputs: Any, j: int) -> tuple[Any, ...]:
        names = self.program.outputs[j]
        if not isinstance(outputs, (tuple, list)) or len(outputs) != len(names):
            got = f"{len(outputs)} values" if isinstance(outputs, (tuple, list)) else outputs
            raise StageError(
                f"stage {j} must return a tuple of {len(names)} values ({', '.join(names)}), "
                f"but returned {type(outputs).__name__} {got}"
            )
        return tuple(outputs)


def _micro_batch(i: int, run: _Run) -> str:
    """``micro-batch 2 of 4 (rows 6-8 of the call's batch of 12)``."""
    rows = [batch_size(b) or 0 for b in run.batches]
    first = sum(rows[:i])
    span = f"rows {first}-{first + rows[i] - 1}" if rows[i] > 1 else f"row {first}"
    return f"micro-batch {i} of {len(rows)} ({span} of the call's batch of {sum(rows)})"


_SIZE_WORDS = re.compile(r"shape|size|dimension|mat1 and mat2", re.IGNORECASE)


def _size_hint(error: BaseException) -> str:
    """For a shape error, the likely cause when it appears only in micro-batches."""
    if not _SIZE_WORDS.search(str(error)):
        return ""
    return (
        ". A batch size written into the model (a fixed number in reshape/view/expand, or a "
        "tensor made for a fixed batch) fits whole batches of that size, not micro-batches: "
        "compute it from the input (x.shape[0], or -1 in reshape/view), or pass chunks=1 to "
        "run whole batches"
    )
