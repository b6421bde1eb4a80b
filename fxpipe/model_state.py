"""Puts a model back as it was after fxpipe runs it for its own purposes (tracing, checks on
fake tensors, pricing, recomputation in backward): one guard for every such run.

What a run may change, and what :class:`preserved` puts back:

- buffer values (BatchNorm running statistics, counters, caches written in place): copied
  back through ``.data``, so no version counter moves (a graph that saved the buffer for
  its backward still runs it);
- the random number generators (CPU, and CUDA once initialised): dropout during a fake
  run or a timing run must not shift the user's random stream;
- with ``structure=True`` (the default), the module tree itself: training flags, the
  buffer objects each module holds (a forward that assigns a new tensor to a buffer must
  not leave it there), and attributes added to the root (fx keeps a closed-over tensor as
  ``_tensor_constant0`` on the model).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

__all__ = ["preserved"]


class preserved:
    """Context manager: save ``module``'s state on entry, put it back on exit.

    ``buffers``: which tensors' values to save (default: every buffer of ``module`` that
    holds data; ``module`` may be None when they are given and ``structure=False``).
    ``rng``: whether to restore the random generators. ``structure``: whether to restore
    training flags, buffer objects and the root's attributes. After exit, :attr:`written`
    names the buffers the run wrote into (then restored).
    """

    def __init__(
        self,
        module: nn.Module | None,
        *,
        buffers: Iterable[torch.Tensor] | None = None,
        rng: bool = True,
        structure: bool = True,
    ) -> None:
        self.module = module
        self._buffers = buffers
        self._rng = rng
        self._structure = structure
        #: Names of the buffers the run wrote into (filled on exit).
        self.written: list[str] = []

    def __enter__(self) -> preserved:
        root = self.module if self.module is not None else nn.Module()
        names = {id(b): name for name, b in root.named_buffers()}
        chosen = root.buffers() if self._buffers is None else self._buffers
        unique = {id(b): b for b in chosen if not b.is_meta}
        self._values = [
            (names.get(key, "?"), b, b.detach().clone(), b._version) for key, b in unique.items()
        ]
        self._random = _rng_state() if self._rng else None
        if self._structure:
            assert self.module is not None, "structure=True needs the module"
            self._attributes = set(vars(self.module))
            self._modes = [(m, m.training) for m in self.module.modules()]
            self._held = [(m, dict(m._buffers)) for m in self.module.modules()]
        return self

    def __exit__(self, *exc: object) -> None:
        if self._structure:
            assert self.module is not None
            for m, mode in self._modes:
                m.training = mode
            for m, held in self._held:
                m._buffers.update(held)
        for name, b, saved, version in self._values:
            if b._version != version:
                self.written.append(name)
            if b.shape == saved.shape:
                b.data.copy_(saved)
        if self._random is not None:
            _set_rng_state(self._random)
        if self._structure:
            assert self.module is not None
            for name in set(vars(self.module)) - self._attributes:
                delattr(self.module, name)


def _rng_state() -> tuple[torch.Tensor, Any]:
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None  # type: ignore[no-untyped-call]
    return torch.random.get_rng_state(), cuda


def _set_rng_state(state: tuple[torch.Tensor, Any]) -> None:
    cpu, cuda = state
    torch.random.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)
