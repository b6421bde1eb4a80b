"""Phony tensors: cached empty tensors that only carry autograd dependencies."""

from __future__ import annotations

import torch

from fxpipe.runtime.stream import default_stream, normalize_device, use_stream

__all__ = ["get_phony"]

_phonies: dict[tuple[torch.device, bool], torch.Tensor] = {}


def get_phony(device: torch.device, *, requires_grad: bool) -> torch.Tensor:
    """A size-0 tensor on ``device``, cached per ``(device, requires_grad)``.

    A phony holds no data, so creating and copying it costs nothing; it exists to add an
    edge to the autograd graph. Autograd Functions that return one must return
    ``get_phony(...).detach()``: the cached tensor itself must never become part of a graph.
    """
    key = (normalize_device(device), requires_grad)
    phony = _phonies.get(key)
    if phony is None:
        with use_stream(default_stream(key[0])):
            phony = torch.empty(0, device=key[0], requires_grad=requires_grad)
        phony = _phonies.setdefault(key, phony)
    return phony
