"""The weights a micro-batch of the asynchronous schedule runs with on this rank's stage, as
its staleness mitigation says: the stage's own Parameters, a stashed copy of the version its
forward met, or the weights its optimizer is predicted to reach by its backward; and the
gradients computed at a copy carried to the Parameters the next update changes."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from fxpipe.errors import ConfigError

__all__ = ["Versions", "predicted"]

#: A held version: (updates before the forward, predicted steps; 0 for a stashed copy).
Key = tuple[int, int]


class Versions:
    """The copies of one stage's weights that micro-batches in flight run with, each shared
    by the micro-batches that met the same version and freed after the last one's
    backward; ``named``: the stage module's Parameters by name."""

    def __init__(self, named: dict[str, nn.Parameter], staleness: str) -> None:
        self.named, self.staleness = named, staleness
        self._held: dict[Key, tuple[dict[str, torch.Tensor], list[int]]] = {}
        #: The most versions held at once so far (the plan's figure, measured).
        self.most_held = 0

    def take(self, updates: int, stale: int, optimizer: torch.optim.Optimizer) -> Key | None:
        """The version a forward made after ``updates`` updates runs with, when
        ``stale`` updates come before its backward: None for the Parameters themselves
        (nothing changes them before its backward, or ``"none"``, which recomputes)."""
        if stale == 0 or self.staleness == "none":
            return None
        key = (updates, stale if self.staleness == "predict" else 0)
        if key not in self._held:
            stepped = updates or any(optimizer.state.values())  # or state loaded
            if self.staleness == "predict" and stepped:  # before any update: as it is
                weights = predicted(optimizer, self.named, stale)
            else:
                weights = {n: p.detach().clone() for n, p in self.named.items()}
            self._held[key] = ({n: t.requires_grad_() for n, t in weights.items()}, [0])
            self.most_held = max(self.most_held, len(self._held))
        self._held[key][1][0] += 1
        return key

    def weights(self, key: Key | None) -> dict[str, torch.Tensor] | None:
        """The tensors of ``key`` by Parameter name (None: the Parameters themselves)."""
        return None if key is None else self._held[key][0]

    def carry(self, key: Key | None) -> None:
        """After a backward at ``key``: its gradients added to the Parameters' (which the
        next update applies), the copy freed when no micro-batch in flight holds it."""
        if key is None:
            return
        weights, count = self._held[key]
        for name, t in weights.items():
            if t.grad is not None:
                p = self.named[name]
                p.grad = t.grad if p.grad is None else p.grad + t.grad
                t.grad = None
        count[0] -= 1
        if count[0] == 0:
            del self._held[key]


def predicted(
    optimizer: torch.optim.Optimizer, named: dict[str, nn.Parameter], steps: int
) -> dict[str, torch.Tensor]:
    """The weights ``optimizer`` reaches from the Parameters in ``named`` after ``steps`` more
    steps that each see a zero loss gradient (its momentum, weight decay, learning rate as
    they are now): a copy of the optimizer over copies of the weights and of its state,
    stepped."""
    if any(g.get("differentiable") for g in optimizer.param_groups):
        raise ConfigError("staleness='predict' does not predict a differentiable optimizer")
    copies = {id(p): p.detach().clone() for p in named.values()}
    groups = []
    for group in optimizer.param_groups:
        settings = {k: v for k, v in group.items() if k != "params"}
        groups.append({**settings, "params": [copies[id(p)] for p in group["params"]]})
    try:
        shadow = type(optimizer)(groups)  # type: ignore[call-arg]
    except TypeError as e:
        raise ConfigError(
            f"staleness='predict' remakes the stage's {type(optimizer).__name__} over copies "
            f"of its weights to predict them, which failed ({e}); use torch.optim.SGD, Adam "
            "or AdamW, or staleness='stash'"
        ) from e
    for p in named.values():
        state = optimizer.state.get(p)
        if state:
            shadow.state[copies[id(p)]] = {k: _copy(v) for k, v in state.items()}
    for t in copies.values():
        t.grad = torch.zeros_like(t)
    for _ in range(steps):
        shadow.step()
    return {n: copies[id(p)] for n, p in named.items()}


def _copy(value: Any) -> Any:
    return value.clone() if isinstance(value, torch.Tensor) else value
