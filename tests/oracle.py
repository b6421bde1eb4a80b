"""How the tests compare fxpipe's results with eager PyTorch's."""

from __future__ import annotations

import torch


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """||got - want|| / ||want|| in float64 (||got - want|| when ``want`` is zero): sums taken
    in another order, as micro-batching does, differ only in the last bits."""
    scale = want.double().norm().item()
    diff = (got.double() - want.double()).norm().item()
    return diff / scale if scale > 0 else diff
