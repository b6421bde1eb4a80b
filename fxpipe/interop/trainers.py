"""How a pipeline stands where its model stood in training tools (Trainer, Accelerate, Lightning).

``transformers.Trainer``, ``accelerate.Accelerator.prepare`` and Lightning (``Fabric.setup``,
``lightning.pytorch.Trainer``) read or call these on the model they are handed:

- the signature of ``model.forward`` (which dataset columns to keep; whether the model takes
  ``num_items_in_batch``), and of ``type(model).forward`` (the label names);
- ``model.to(device)`` (or ``_apply``, through a parent module's ``to()``);
- ``hf_device_map``: a model spread over devices is not moved and not wrapped in DataParallel;
- ``config``, ``save_pretrained``, ``main_input_name``, ``accepts_loss_kwargs``... of the model;
- ``activation_checkpointing_enable()`` (``gradient_checkpointing_enable()`` before it).
"""

from __future__ import annotations

import inspect
import types
from collections.abc import Callable, Iterator, Mapping
from itertools import chain
from typing import Any

import torch
from torch import nn

from fxpipe.devices.targets import same_device
from fxpipe.errors import ConfigError, DeviceError
from fxpipe.ir import Checkpoints

__all__ = ["DropIn", "device_map"]

#: Private names of the model that training tools read through the model they were handed
#: (``Trainer`` compares the keys missing from a checkpoint it loads with it); other names
#: that start with an underscore are the pipeline's own, and are not looked up on the model.
FORWARDED_PRIVATE = frozenset({"_keys_to_ignore_on_save"})


class DropIn(nn.Module):
    """The side of :class:`fxpipe.Pipeline` that stands where the model stood.

    - ``inspect.signature(pipe.forward)`` is ``inspect.signature(model.forward)``: each
      pipeline gets a subclass of its own class whose ``forward`` carries the model's
      signature (the class, as ``Trainer`` reads label names from ``type(model).forward``);
      copies and pickles keep it, and so does ``forward`` rewrapped as Accelerate does.
    - ``pipe.config``, ``pipe.save_pretrained``, ... : a name the pipeline does not have is
      looked up on the model (not names with leading underscores, except
      :data:`FORWARDED_PRIVATE`). A method found that way runs on the model itself, not
      through the stages (``generate`` is the pipeline's own: :mod:`fxpipe.generation`).
    - ``hf_device_map``: where the model's parameters and buffers are, in Accelerate's form.
    - ``to()``, ``cuda()``, ``cpu()``, ``_apply``: see :meth:`_apply`.
    - ``activation_checkpointing_enable()`` and its older name
      ``gradient_checkpointing_enable()``: see :meth:`activation_checkpointing_enable`.
    - A parent module's ``state_dict()`` holds the pipeline's values under the model's keys
      (``pipe.state_dict()`` is the model's); its ``load_state_dict()`` takes them back.

    The class using it sets ``module`` (the model), ``devices`` (one per stage) and a
    settable ``checkpoint`` mode, and calls :meth:`_stand_in_for` once they are set.
    """

    module: nn.Module
    devices: tuple[torch.device, ...]
    checkpoint: Checkpoints
    #: The pipeline recomputes activations in backward (:meth:`activation_checkpointing_enable`).
    supports_gradient_checkpointing = True

    def _stand_in_for(self, model: nn.Module) -> None:
        """Give this pipeline ``model.forward``'s signature (a subclass of its own)."""
        signature = _signature_of(model)
        if signature is not None:
            self.__class__ = _signed_class(_unsigned(type(self)), signature)

    # ------------------------------------------------------------------ copies and pickles

    def __reduce_ex__(self, protocol: Any) -> Any:
        """Pickled and copied as an object of the plain class, which :meth:`__setstate__`
        signs again from the model it holds."""
        reduced = super().__reduce_ex__(protocol)
        if not isinstance(reduced, tuple) or _unsigned(type(self)) is type(self):
            return reduced
        return (_new_object, (_unsigned(type(self)),), *reduced[2:])

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)  # type: ignore[no-untyped-call]
        model = self.__dict__.get("_modules", {}).get("module")
        if model is not None:
            self._stand_in_for(model)

    # ------------------------------------------------------------------ the model's attributes

    def __getattr__(self, name: str) -> Any:
        """nn.Module's own lookup (parameters, buffers, submodules), then the model's."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            model = self.__dict__.get("_modules", {}).get("module")
            private = name.startswith("_") and name not in FORWARDED_PRIVATE
            if model is None or private:
                raise
        try:
            return getattr(model, name)
        except AttributeError:
            raise AttributeError(
                f"'{type(self).__name__}' object has no attribute {name!r}, and neither has "
                f"its model ({type(model).__name__})"
            ) from None

    def _get_name(self) -> str:
        """The model's class name: ``Trainer`` decides from it whether the labels of a
        causal language model are shifted (its label smoother). ``repr(pipe)`` still says
        ``Pipeline``."""
        model = self.__dict__.get("_modules", {}).get("module")
        return model._get_name() if model is not None else "Pipeline"

    def __repr__(self) -> str:
        text = super().__repr__()
        return "Pipeline" + text[len(self._get_name()) :]

    @property
    def hf_device_map(self) -> dict[str, str]:
        """Where the model's parameters and buffers are, as Accelerate writes a device map:
        ``{module name: device}``, a module named once when all of its tensors share one
        device (``{"": "cpu"}`` for a pipeline on the CPU). ``Trainer`` sees a model placed
        over several devices (it neither moves it nor wraps it in ``DataParallel``), and so
        does ``Accelerator.prepare`` when there is more than one entry (it does not move it,
        and refuses it under a distributed launch, as a model loaded with
        ``device_map="auto"``, unless ``ACCELERATE_BYPASS_DEVICE_MAP=true``)."""
        return device_map(self.module)

    # ------------------------------------------------------------------ devices and dtypes

    def to(self, *args: Any, **kwargs: Any) -> Any:
        """``nn.Module.to``, where a device is one the pipeline is already on (see
        :meth:`_apply`): a dtype applies in place, a real move is a ``DeviceError``."""
        device = torch._C._nn._parse_to(*args, **kwargs)[0]
        if device is not None:
            self._placement([device] * len(self._stage_devices()), f"to({str(device)!r})")
        return super().to(*args, **kwargs)

    def cuda(self, device: int | torch.device | None = None) -> Any:
        """A no-op where the stages are on that CUDA device (see :meth:`_apply`)."""
        where = torch.device("cuda", device) if isinstance(device, int) else device
        target = torch.device("cuda") if where is None else torch.device(where)
        self._placement([target] * len(self._stage_devices()), "cuda()")
        return super().cuda(device)

    def cpu(self) -> Any:
        """A no-op where the stages are on the CPU (see :meth:`_apply`)."""
        self._placement([torch.device("cpu")] * len(self._stage_devices()), "cpu()")
        return super().cpu()

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> Any:
        """What ``to()``, ``cuda()``, ``cpu()``, ``half()``... do, and what a parent module's
        ``to()`` calls: converts the model's parameters, buffers and gradients in place (the
        same objects, which the stages and any optimizer hold).

        A change of dtype applies. The device does not change: where ``fn`` leaves every
        stage's tensors on their own device (``pipe.to("cpu")`` with every stage on the
        CPU) nothing moves, and where it takes them all to the first stage's device (where
        the inputs enter: a tool putting "the model" on ``cuda:0`` for a pipeline over
        ``cuda:0`` and ``cuda:1``) the device part is ignored and only the dtype applies.
        Any other move is a ``DeviceError``, raised before anything changes.
        """
        stages = self._stage_devices()
        targets = [_probe(fn, d, torch.float32).device for d in stages]
        if self._placement(targets, "to() or _apply()") == "first stage":
            convert = lambda t: t.to(dtype=_probe(fn, t.device, t.dtype).dtype)
        else:
            convert = fn
        if recurse:
            _convert_in_place(self.module, convert)
        return self

    def _stage_devices(self) -> list[torch.device]:
        """The stages' devices, each once, in pipeline order."""
        return list(dict.fromkeys(self.devices))

    def _placement(self, targets: list[torch.device], call: str) -> str:
        """``"in place"`` where each stage device's target (``targets``, aligned with
        :meth:`_stage_devices`) is that device, ``"first stage"`` where every target is the
        first stage's device; a ``DeviceError`` naming ``call`` for any other move."""
        stages = self._stage_devices()
        if all(same_device(t, d) for t, d in zip(targets, stages)):
            return "in place"
        if all(same_device(t, self.devices[0]) for t in targets):
            return "first stage"
        to = ", ".join(dict.fromkeys(str(t) for t in targets))
        raise DeviceError(
            f"a pipeline's stages stay on their devices {[str(d) for d in self.devices]}; "
            f"{call} cannot move it to {to}: leave the pipeline where it is (turn the "
            "trainer's device placement off, e.g. Fabric.setup(..., move_to_device=False)), "
            "or build a new pipeline with fxpipe.pipeline(model, ..., devices=[...]) on the "
            "devices wanted"
        )

    # ------------------------------------------------------------------ activation checkpointing

    def activation_checkpointing_enable(
        self,
        activation_checkpointing_kwargs: Mapping[str, Any] | None = None,
        every_n_layers: int = 1,
        offload: bool = False,
    ) -> None:
        """Recompute every micro-batch of every stage in backward (``checkpoint="always"``)
        until :meth:`activation_checkpointing_disable`.

        The model's own checkpointing flags do not reach the traced stages, so this is the
        pipeline's checkpointing (GPipe's: a stage's forward rerun per micro-batch), which
        keeps the model's outputs and gradients. ``activation_checkpointing_kwargs`` may
        hold ``use_reentrant`` (``torch.utils.checkpoint``'s choice, which the pipeline's
        recompute does not use, so either value is accepted); other keys, ``every_n_layers``
        other than 1 and ``offload=True`` are refused (``ConfigError``)."""
        extra = sorted(set(activation_checkpointing_kwargs or {}) - {"use_reentrant"})
        if extra or every_n_layers != 1 or offload:
            asked: dict[str, object] = {"kwargs": extra} if extra else {}
            if every_n_layers != 1:
                asked["every_n_layers"] = every_n_layers
            if offload:
                asked["offload"] = offload
            raise ConfigError(
                f"activation checkpointing with {asked} is not available for a pipeline: it "
                "recomputes whole stages per micro-batch (checkpoint='always'); call it without "
                "them, or build the pipeline with checkpoint='except_last' or 'never'"
            )
        if self.checkpoint != "always":
            self.__dict__["_checkpoint_before_enable"] = self.checkpoint
            self.checkpoint = "always"

    def activation_checkpointing_disable(self) -> None:
        """Back to the checkpoint mode the pipeline had before
        :meth:`activation_checkpointing_enable` (the one it was built with, unless set)."""
        before = self.__dict__.pop("_checkpoint_before_enable", None)
        if before is not None:
            self.checkpoint = before

    @property
    def is_activation_checkpointing(self) -> bool:
        """Whether every micro-batch of every stage is recomputed in backward."""
        return self.checkpoint == "always"

    def gradient_checkpointing_enable(
        self, gradient_checkpointing_kwargs: Mapping[str, Any] | None = None, **kwargs: Any
    ) -> None:
        """The older name of :meth:`activation_checkpointing_enable`."""
        self.activation_checkpointing_enable(gradient_checkpointing_kwargs, **kwargs)

    def gradient_checkpointing_disable(self) -> None:
        """The older name of :meth:`activation_checkpointing_disable`."""
        self.activation_checkpointing_disable()

    @property
    def is_gradient_checkpointing(self) -> bool:
        """The older name of :attr:`is_activation_checkpointing`."""
        return self.is_activation_checkpointing

    # ------------------------------------------------------------------ inside a parent module

    def _load_from_state_dict(
        self,
        state_dict: dict[str, Any],
        prefix: str,
        local_metadata: dict[str, Any],
        strict: bool,
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        """A parent's ``load_state_dict`` reaches the model under ``module.``; the parent's
        ``state_dict()`` wrote the model's keys without it (``pipe.state_dict()`` has the
        model's keys), so they are renamed here, in the dict the model's modules read next.
        ``assign=True`` is refused, as by the pipeline's own ``load_state_dict``."""
        if local_metadata.get("assign_to_params_buffers", False):
            raise ConfigError(
                f"load_state_dict(assign=True) would replace the Parameters the stages of the "
                f"pipeline at {prefix[:-1]!r} hold; use assign=False"
            )
        for key in [k for k in state_dict if k.startswith(prefix)]:
            state_dict[f"{prefix}module.{key[len(prefix) :]}"] = state_dict.pop(key)
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )


def _signature_of(model: nn.Module) -> inspect.Signature | None:
    """``model.forward``'s signature, or None where Python cannot tell it."""
    try:
        return inspect.signature(model.forward)
    except (TypeError, ValueError):
        return None


def _unsigned(cls: type[nn.Module]) -> type[nn.Module]:
    """The class a signed class was made from (``cls`` itself when it is not one)."""
    base: type[nn.Module] = cls.__dict__.get("_signed_from", cls)
    return base


def _signed_class(base: type[nn.Module], signature: inspect.Signature) -> type:
    """A subclass of ``base`` whose ``forward`` is a copy of ``base.forward`` (the same code,
    so no extra frame) that carries ``signature`` (a bound method's: ``self`` goes first)."""
    run = base.forward
    forward = types.FunctionType(
        run.__code__, run.__globals__, run.__name__, run.__defaults__, run.__closure__
    )
    forward.__kwdefaults__ = run.__kwdefaults__
    forward.__dict__.update(run.__dict__)
    forward.__doc__ = run.__doc__
    forward.__qualname__ = run.__qualname__
    forward.__module__ = run.__module__
    name = "self" if "self" not in signature.parameters else "_pipeline"
    first = inspect.Parameter(name, inspect.Parameter.POSITIONAL_ONLY)
    forward.__signature__ = signature.replace(  # type: ignore[attr-defined]
        parameters=[first, *signature.parameters.values()]
    )
    namespace = {
        "forward": forward,
        "_signed_from": base,
        "__module__": base.__module__,
        "__qualname__": base.__qualname__,
        "__doc__": base.__doc__,
    }
    return type(base.__name__, (base,), namespace)


def _new_object(cls: type[nn.Module]) -> nn.Module:
    """An uninitialised object of ``cls``, which unpickling fills with its state."""
    return cls.__new__(cls)


def _probe(
    fn: Callable[[torch.Tensor], torch.Tensor], device: torch.device, dtype: torch.dtype
) -> torch.Tensor:
    """What ``fn`` makes of an empty tensor of ``dtype`` on ``device``."""
    return fn(torch.empty(0, dtype=dtype, device=device))


def _unique_tensors(model: nn.Module) -> Iterator[torch.Tensor]:
    seen: set[int] = set()
    for t in chain(model.parameters(), model.buffers()):
        if id(t) not in seen:
            seen.add(id(t))
            yield t


def _convert_in_place(model: nn.Module, convert: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Every parameter, buffer and gradient of ``model`` becomes ``convert`` of itself, in
    place (``.data`` is replaced; the objects stay), one at a time as ``nn.Module`` does."""
    with torch.no_grad():
        for t in _unique_tensors(model):
            for x in (t, t.grad):
                if x is not None:
                    value = convert(x)
                    if value is not x:
                        x.data = value


def device_map(model: nn.Module) -> dict[str, str]:
    """``{module or tensor name: device}`` for every parameter and buffer of ``model``, a
    module named once when all of its tensors share one device (``{"": "cpu"}`` for a model
    wholly on the CPU)."""
    placed: dict[str, str] = {}
    _place(model, "", placed)
    return placed


def _place(module: nn.Module, name: str, placed: dict[str, str]) -> None:
    """``placed[name] = device`` when all of ``module``'s tensors share one device, else the
    same for each of its own tensors and each child."""
    devices = {_device_name(t) for t in _unique_tensors(module)}
    if len(devices) == 1:
        placed[name] = devices.pop()
        return
    if not devices:
        return
    own = chain(module.named_parameters(recurse=False), module.named_buffers(recurse=False))
    for key, t in own:
        placed[_join(name, key)] = _device_name(t)
    for key, child in module.named_children():
        _place(child, _join(name, key), placed)


def _device_name(t: torch.Tensor) -> str:
    return "cpu" if t.device.type == "cpu" else str(t.device)


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name
