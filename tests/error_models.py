"""The small models the error tests build pipelines of (tests/test_errors.py and
tests/test_not_errors.py), and the snapshot that shows a refusal left a model as it was.

The models use mixed training flags where they can (the model in train mode, one submodule in
eval), so a ``train()`` or ``eval()`` that is not undone shows.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


class Net(nn.Module):
    """Three blocks with a skip from the first to the head; ``blocks[1]`` is left in eval."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 8)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.0)) for _ in range(3)
        )
        self.head = nn.Linear(8, 2)
        self.register_buffer("scale", torch.full((8,), 0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h0 = torch.tanh(self.inp(x))
        h = h0
        for block in self.blocks:
            h = h + torch.tanh(block(h)) * self.scale
        return self.head(h + h0)


def net() -> Net:
    torch.manual_seed(0)
    model = Net()
    model.train()
    model.blocks[1].eval()
    return model


X = torch.randn(6, 4)


class Gate(nn.Module):
    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if h.sum() > 0:  # a Python branch on a tensor's value
            return h
        return -h


class DataDependent(nn.Module):
    """Data-dependent Python control flow inside a submodule: no tracer can capture it."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.gate = Gate()
        self.out = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.gate(self.fc(x)))


class Counter(Net):
    """Counts its calls in a buffer with a plain tensor op (fx runs it once, at trace time)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.steps += 1
        return super().forward(x)


class Pair(nn.Module):
    """Two tensor inputs and a keyword-only scale."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.c = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor, y: torch.Tensor, *, scale: torch.Tensor) -> torch.Tensor:
        return self.c(torch.relu(self.a(x)) + self.b(y) * scale)


def pair_example(batch: int = 6) -> tuple[tuple[torch.Tensor, ...], dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    x, y, s = (torch.randn(batch, 4, generator=g) for _ in range(3))
    return (x, y), {"scale": s}


class Steps(nn.Module):
    """A non-tensor argument that is fixed at trace time."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.out = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor, num_steps: int = 2) -> torch.Tensor:
        for _ in range(num_steps):
            x = torch.tanh(self.fc(x))
        return self.out(x)


class Outputs(nn.Module):
    """Returns ``what(h)`` next to a tensor, for outputs that are not per-sample tensors."""

    def __init__(self, what: Callable[[torch.Tensor], Any]) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.what = what

    def forward(self, x: torch.Tensor) -> Any:
        h = self.b(torch.tanh(self.a(x)))
        return h, self.what(h)


class Nothing(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> str:
        return "nothing computed"


class Keyed(nn.Module):
    """Takes one dict argument."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 2)

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.b(torch.tanh(self.a(batch["x"])) * batch["scale"])


@dataclass
class Snapshot:
    """Everything about a model that an error must leave as it was."""

    state: dict[str, torch.Tensor]
    tensors: dict[str, tuple[int, torch.device]]
    training: dict[str, bool]
    modules: dict[str, int]

    @classmethod
    def of(cls, model: nn.Module) -> Snapshot:
        return cls(
            {k: v.detach().clone() for k, v in model.state_dict().items()},
            {k: (id(t), t.device) for k, t in [*model.named_parameters(), *model.named_buffers()]},
            {name: m.training for name, m in model.named_modules()},
            {name: id(m) for name, m in model.named_modules()},
        )

    def assert_same(self, model: nn.Module) -> None:
        state = model.state_dict()
        assert list(state) == list(self.state)
        for key, value in self.state.items():
            assert torch.equal(state[key], value), f"{key} changed"
        tensors = [*model.named_parameters(), *model.named_buffers()]
        assert {k: (id(t), t.device) for k, t in tensors} == self.tensors
        assert {name: m.training for name, m in model.named_modules()} == self.training
        assert {name: id(m) for name, m in model.named_modules()} == self.modules
