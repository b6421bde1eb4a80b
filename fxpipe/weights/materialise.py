"""Models built on ``meta``: planned on a meta copy of the example, their tensors made
(uninitialised) straight on their stage's device, and calls refused until they are loaded.

A model made under ``with torch.device("meta"):`` holds shapes and no data, so it costs no
memory however large it is. :func:`fxpipe.pipeline` traces and prices it as it is (the
example is moved to ``meta`` for that), splits it, and then gives each of its parameters and
buffers uninitialised storage on the device of the stage that holds it (a tensor no stage
reads goes to the first stage's device). The Python objects stay the model's own: their
storage is swapped underneath them, so ``parameters()``, ``state_dict()`` and any optimizer
made from them see the new tensors. Nothing is ever made whole on one device.

:class:`Materialised` remembers which tensors were made that way and which are still
uninitialised: :meth:`Pipeline.load_state_dict` and :func:`fxpipe.load_checkpoint` mark the
keys they load, and a tensor written in place since it was made (``nn.init``,
``reset_parameters()``, ``param.copy_(...)``: anything that moves its version counter)
counts as initialised too. The pipeline checks one flag per call, and refuses a call with
an :class:`~fxpipe.errors.UninitialisedError` while any tensor is still pending.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager, nullcontext
from itertools import chain
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map

from fxpipe.errors import CheckpointError, ConfigError, DeviceError, UninitialisedError

__all__ = [
    "holds_meta", "all_meta", "on_meta", "on_cpu", "meta_view", "cpu_view", "on_cpu_and_meta",
    "placed_view", "check_meta_pricing", "Materialised",
]  # fmt: skip

#: How many keys an error message names before it gives the count.
SHOWN = 5


def holds_meta(model: nn.Module) -> bool:
    """Whether any parameter or buffer of ``model`` is on the ``meta`` device."""
    return any(t.is_meta for t in chain(model.parameters(), model.buffers()))


def all_meta(model: nn.Module) -> bool:
    """Whether every parameter and buffer of ``model`` is on the ``meta`` device."""
    return all(t.is_meta for t in chain(model.parameters(), model.buffers()))


def meta_view(model: nn.Module, *, live: bool = False) -> AbstractContextManager[None]:
    """Within the block, the real tensors of ``model`` hold ``meta`` storage of their shape,
    so that a model partly on ``meta`` (parameters there, buffers real, as Accelerate's
    ``init_empty_weights`` leaves them), or spread over several devices, is traced and
    priced on one device; each gets its own storage back on exit (the same objects
    throughout). ``live``: a tensor an autograd graph still holds (a loss kept from the last
    step) is swapped too; nothing runs backward inside the block, and the swap is undone."""
    return _storage_swapped(model, from_meta=False, device="meta", check=not live)


def on_cpu_and_meta(model: nn.Module) -> bool:
    """Whether ``model``'s tensors lie on ``meta`` and the CPU, some on each (a rank's model
    holding only its stage's weights)."""
    found = {t.device.type for t in chain(model.parameters(), model.buffers())}
    return found == {"cpu", "meta"}


def cpu_view(model: nn.Module) -> AbstractContextManager[None]:
    """Within the block, the tensors of ``model`` on ``meta`` hold uninitialised CPU storage
    of their shape, so that a model on ``meta`` (and maybe the CPU) is traced as the CPU
    runs it: its code's branches on the device (transformers' grouped experts count tokens
    per expert one way on the CPU and another elsewhere) taken as they will run. A trace
    writes none of that storage, and the kernel only reserves pages nobody writes. The
    same objects throughout; each gets its ``meta`` storage back on exit."""
    return _storage_swapped(model, from_meta=True, device="cpu", check=False)


def placed_view(
    model: nn.Module, place: torch.device | None
) -> tuple[AbstractContextManager[None], torch.device]:
    """Where a placed model is traced again (a variant of its pipeline), with the view that
    puts it there: on ``place``, the one device its tensors share, where they share one; on
    the CPU where they lie on the CPU and ``meta`` (a rank's model: :func:`cpu_view`); else
    on ``meta`` views of them, a tensor a replica's gradient hooks hold swapped and back
    (nothing runs backward)."""
    if place is not None:
        return nullcontext(), place
    if on_cpu_and_meta(model):
        return cpu_view(model), torch.device("cpu")
    return meta_view(model, live=True), torch.device("meta")


@contextmanager
def _storage_swapped(
    model: nn.Module, *, from_meta: bool, device: str, check: bool
) -> Iterator[None]:
    """Within the block, each tensor of ``model`` on ``meta`` (``from_meta``) or off it (not)
    holds empty storage of its shape on ``device``, each swapped once (a tied weight is one
    tensor) and back on exit; ``check`` as :func:`_swap_in` takes it."""
    swapped: list[tuple[torch.Tensor, torch.Tensor]] = []
    try:
        seen: set[int] = set()
        for name, t in chain(model.named_parameters(), model.named_buffers()):
            if t.is_meta == from_meta and id(t) not in seen:
                seen.add(id(t))
                empty = torch.empty_like(t, device=device)
                swapped.append((t, _swap_in(t, empty, name, check=check)))
        yield
    finally:
        for t, real in reversed(swapped):
            torch._C._swap_tensor_impl(t, real)


def _swap_in(
    tensor: torch.Tensor, storage: torch.Tensor, name: str, *, check: bool = True
) -> torch.Tensor:
    """Swap ``storage`` (a new tensor) into the object ``tensor``; returns the object that
    now holds ``tensor``'s old contents (swap them again to undo). ``check``: refuse a
    tensor a live autograd graph holds (the swap would outlive the caller's block)."""
    if check and tensor._use_count() > 1:  # type: ignore[attr-defined]
        raise DeviceError(
            f"{name!r} is referenced by a live autograd graph (outputs of an earlier run of "
            "the model are still held); drop them before fxpipe.pipeline(), so that the "
            "tensor can be moved between 'meta' and its stage's device in place"
        )
    if type(tensor) is not torch.Tensor:  # nn.Parameter or another subclass: same class
        storage = torch.Tensor._make_subclass(type(tensor), storage, tensor.requires_grad)
    else:
        storage.requires_grad_(tensor.requires_grad)
    torch._C._swap_tensor_impl(tensor, storage)
    return storage


def on_meta(value: Any) -> Any:
    """``value`` with every tensor in it (through lists, tuples, dicts) moved to ``meta``."""
    return tree_map(lambda t: t.to("meta") if isinstance(t, torch.Tensor) else t, value)


def on_cpu(value: Any) -> Any:
    """``value`` with every tensor in it (through lists, tuples, dicts) on the CPU: one on
    ``meta`` as zeros of its shape and dtype (an example's token ids stay in range)."""

    def moved(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        return torch.zeros(t.shape, dtype=t.dtype) if t.is_meta else t.to("cpu")

    return tree_map(moved, value)


def check_meta_pricing(model: nn.Module, pricing: object) -> None:
    """ConfigError for ``cost="time"`` on a model whose tensors are on ``meta``."""
    if pricing != "time":
        return
    name = next(n for n, t in chain(model.named_parameters(), model.named_buffers()) if t.is_meta)
    raise ConfigError(
        f"cost='time' profiles the model by running it, but its {name!r} (and maybe more) is "
        "on the 'meta' device, which holds no data; pass cost='auto' (the roofline, which "
        "runs nothing), 'flops' or 'params'"
    )


def shown(keys: Iterable[str]) -> str:
    """``['a', 'b', 'c', 'd', 'e'] and 3 more (8 in all)``: the first few keys, and a count."""
    items = list(keys)
    head = repr(items[:SHOWN])
    if len(items) <= SHOWN:
        return head
    return f"{head} and {len(items) - SHOWN} more ({len(items)} in all)"


class Materialised:
    """The tensors of one pipeline made on their stage's device from ``meta``, and which of
    them are still uninitialised.

    :meth:`make` is called while the stages are placed; :meth:`undo` puts every made tensor
    back on ``meta`` (when building the pipeline fails). ``active`` is the one flag a call
    reads: true while some tensor may still be pending.
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self._keys: dict[int, list[str]] = {}
        named = chain(
            model.named_parameters(remove_duplicate=False),
            model.named_buffers(remove_duplicate=False),
        )
        for key, t in named:
            self._keys.setdefault(id(t), []).append(key)
        self._made: list[tuple[torch.Tensor, torch.Tensor]] = []
        #: id -> (tensor, its version counter when made): made and not loaded yet.
        self._pending: dict[int, tuple[torch.Tensor, int]] = {}
        #: Keys of non-persistent buffers made here: not in ``state_dict()``, but a loader
        #: accepts them (they hold no value otherwise).
        self.extra_keys: frozenset[str] = frozenset()
        self.active = False

    def make(self, tensor: torch.Tensor, device: torch.device) -> None:
        """Give ``tensor`` (on ``meta``) uninitialised storage on ``device``, in place: the
        Python object stays, its contents are swapped for a new ``torch.empty_like``."""
        empty = torch.empty_like(tensor, device=device)
        shell = _swap_in(tensor, empty, self.keys_of(tensor)[0])
        self._made.append((tensor, shell))
        self._pending[id(tensor)] = (tensor, tensor._version)
        self.active = True

    def finish(self, devices: Iterable[torch.device]) -> None:
        """Make every tensor of the model that no stage holds (still on ``meta``) on the
        first stage's device, unless that device is ``meta``; note the non-persistent
        buffers made."""
        first = next(iter(devices))
        if first.type != "meta":
            seen: set[int] = set()
            for t in chain(self.model.parameters(), self.model.buffers()):
                if t.is_meta and id(t) not in seen:
                    seen.add(id(t))
                    self.make(t, first)
        made = {id(t) for t, _ in self._made}
        extra = set()
        for module_name, module in self.model.named_modules(remove_duplicate=False):
            for name in module._non_persistent_buffers_set:
                buffer = module._buffers.get(name)
                if buffer is not None and id(buffer) in made:
                    extra.add(f"{module_name}.{name}" if module_name else name)
        self.extra_keys = frozenset(extra)

    def settle(self) -> None:
        """Count the tensors still uninitialised from now: the build's own checks run the
        graph on fake tensors, and a buffer written there (restored after) has its version
        counter moved all the same, which is no initialisation."""
        self._pending = {i: (t, t._version) for i, (t, _) in self._pending.items()}

    def undo(self) -> None:
        """Put every made tensor back on ``meta`` (the model as it was before)."""
        for tensor, shell in reversed(self._made):
            torch._C._swap_tensor_impl(tensor, shell)
        self._made.clear()
        self._pending.clear()
        self.active = False

    def keys_of(self, tensor: torch.Tensor) -> list[str]:
        """The model's keys for ``tensor`` (several when it is tied), or a placeholder."""
        return self._keys.get(id(tensor), ["<a tensor that is not the model's own>"])

    def loaded(self, keys: Iterable[str]) -> None:
        """Mark the tensors under ``keys`` as loaded (a key of a tied tensor marks it)."""
        if not self._pending:
            return
        by_key = {k: i for i, ks in self._keys.items() for k in ks}
        for key in keys:
            i = by_key.get(key)
            if i is not None:
                self._pending.pop(i, None)
        self.active = bool(self._pending)

    def pending(self) -> list[str]:
        """The first key of every tensor still uninitialised (one written in place since it
        was made counts as initialised, and is dropped)."""
        self._pending = {
            i: (t, v) for i, (t, v) in self._pending.items() if t._version == v and not t.is_meta
        }
        self.active = bool(self._pending)
        return sorted(self.keys_of(t)[0] for t, _ in self._pending.values())

    def check(self) -> None:
        """UninitialisedError naming the tensors still uninitialised, if any."""
        keys = self.pending()
        if not keys:
            return
        extra = sorted(k for k in keys if k in self.extra_keys)
        note = (
            f" {shown(extra)} are non-persistent buffers, which state_dict() leaves out: "
            "include them in the state dict or checkpoint you load (they are accepted), or "
            "write them in place (pipe.module.get_buffer(name).copy_(value));"
            if extra
            else ""
        )
        raise UninitialisedError(
            f"the model was built on 'meta' and {len(keys)} of its parameters/buffers made on "
            f"the stages' devices hold no values yet: {shown(keys)};{note} load them "
            "before the first call: pipe.load_state_dict(state_dict) or "
            "fxpipe.load_checkpoint(pipe, path), or initialise them in place (nn.init, "
            "module.reset_parameters())"
        )

    def load_state_dict(
        self, model: nn.Module, state_dict: Mapping[str, Any], strict: bool
    ) -> Any:
        """``model.load_state_dict(state_dict, strict)``, that also takes the non-persistent
        buffers made from ``meta`` (:attr:`extra_keys`), and marks what it loaded."""
        extra = {k: v for k, v in state_dict.items() if k in self.extra_keys}
        if extra:
            check_shapes(extra, model)
            state_dict = {k: v for k, v in state_dict.items() if k not in self.extra_keys}
        result = model.load_state_dict(state_dict, strict=strict)
        with torch.no_grad():
            for key, value in extra.items():
                model.get_buffer(key).copy_(value)
        self.loaded(chain(state_dict.keys(), extra.keys()))
        return result


def check_shapes(values: Mapping[str, Any], model: nn.Module) -> None:
    """CheckpointError when a value's shape differs from the model's buffer of its key."""
    wrong = [
        f"{k!r} {tuple(v.shape)} (the model's: {tuple(model.get_buffer(k).shape)})"
        for k, v in values.items()
        if tuple(v.shape) != tuple(model.get_buffer(k).shape)
    ]
    if wrong:
        raise CheckpointError(
            f"the shapes of {len(wrong)} buffer(s) differ from the model's: "
            f"{'; '.join(wrong[:SHOWN])}; load values saved from this model"
        )
