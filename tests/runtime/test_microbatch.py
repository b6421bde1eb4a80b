"""Scatter and gather of pytree values along the batch dimension."""

from __future__ import annotations

import pytest
import torch

from fxpipe.errors import ConfigError, InputError
from fxpipe.runtime.microbatch import gather, scatter


def test_scatter_even() -> None:
    x = torch.arange(8.0).view(8, 1)
    batches = scatter((x,), 4)
    assert [b[0].flatten().tolist() for b in batches] == [[0, 1], [2, 3], [4, 5], [6, 7]]


def test_scatter_uneven_sizes_differ_by_at_most_one() -> None:
    x = torch.arange(10.0)
    batches = scatter((x,), 4)
    assert [len(b[0]) for b in batches] == [3, 3, 2, 2]
    assert torch.equal(torch.cat([b[0] for b in batches]), x)


def test_scatter_smaller_than_chunks() -> None:
    x = torch.arange(3.0)
    batches = scatter((x,), 8)
    assert [b[0].tolist() for b in batches] == [[0.0], [1.0], [2.0]]


def test_scatter_pytrees_and_non_tensor_leaves() -> None:
    x, y, z = torch.randn(6, 2), torch.randn(6, 3), torch.randn(6)
    values = (x, {"y": y, "pair": [z, 7]}, "mode")
    batches = scatter(values, 3)
    assert len(batches) == 3
    for i, (bx, bd, mode) in enumerate(batches):
        rows = slice(2 * i, 2 * i + 2)
        assert torch.equal(bx, x[rows])
        assert torch.equal(bd["y"], y[rows])
        assert torch.equal(bd["pair"][0], z[rows])
        assert bd["pair"][1] == 7
        assert mode == "mode"


def test_scatter_without_tensors_is_one_micro_batch() -> None:
    assert scatter((1, "a"), 4) == [(1, "a")]


def test_scatter_mismatched_batch_names_the_leaf() -> None:
    values = (torch.zeros(4, 2), {"mask": [torch.zeros(3, 2)]})
    with pytest.raises(InputError, match=r"ids\['mask'\]\[0\].*\(3, 2\).*batch size is 4"):
        scatter(values, 2, names=["x", "ids"])
    with pytest.raises(InputError, match=r"values\[1\]\['mask'\]\[0\]"):
        scatter(values, 2)


def test_scatter_passes_a_zero_dim_tensor_whole_to_every_micro_batch() -> None:
    total = torch.tensor(7.0)  # num_items_in_batch: one number for the whole batch
    parts = scatter((torch.arange(4.0), total), 3)
    assert [p[0].tolist() for p in parts] == [[0.0, 1.0], [2.0], [3.0]]
    assert all(p[1] is total for p in parts)
    assert len(scatter((total,), 3)) == 1  # nothing to split: one micro-batch


def test_scatter_rejects_empty_batches() -> None:
    with pytest.raises(InputError, match="empty batch"):
        scatter((torch.zeros(0, 3),), 2)
    with pytest.raises(ConfigError):
        scatter((torch.zeros(4),), 0)


def test_gather_round_trip_with_pytrees() -> None:
    x = torch.randn(7, 2)
    outputs = [[b[0] * 2, {"a": b[0], "n": 3}] for b in scatter((x,), 3)]
    doubled, tree = gather(outputs)
    assert torch.equal(doubled, x * 2)
    assert torch.equal(tree["a"], x)
    assert tree["n"] == 3


def test_gather_keeps_autograd() -> None:
    x = torch.randn(5, 2, requires_grad=True)
    outputs = [[b[0] * 3] for b in scatter((x,), 2)]
    (y,) = gather(outputs, torch.device("cpu"))
    y.sum().backward()
    assert x.grad is not None and torch.equal(x.grad, torch.full((5, 2), 3.0))


def test_gather_adds_partial_sums_and_keeps_values_every_micro_batch_gives_alike() -> None:
    x = torch.randn(7, 3, requires_grad=True)
    parts = [[b[0].sum(), b[0].shape[0], torch.float32, b[0] * 2] for b in scatter((x,), 3)]
    total, rows, dtype, doubled = gather(parts, joins=["sum", "sum", "same", "cat"])
    torch.testing.assert_close(total, x.sum())
    assert rows == 7 and dtype is torch.float32
    torch.testing.assert_close(doubled, x * 2)
    total.backward()
    assert x.grad is not None and torch.equal(x.grad, torch.ones(7, 3))


def test_gather_errors() -> None:
    a, b = torch.zeros(2), torch.zeros(2)
    with pytest.raises(InputError, match="differs between micro-batches"):
        gather([[a, 1], [b, 2]])
    with pytest.raises(InputError, match="0-dim"):
        gather([[torch.tensor(1.0)], [torch.tensor(2.0)]])
    with pytest.raises(InputError, match="structure"):
        gather([[(a, b)], [(a,)]])
    with pytest.raises(InputError, match="not in others"):
        gather([[a], [3]])
    with pytest.raises(InputError):
        gather([])


@pytest.mark.cuda
def test_gather_moves_onto_device() -> None:
    x = torch.randn(4, 2)
    (y,) = gather([[b[0].cuda()] for b in scatter((x,), 2)], torch.device("cpu"))
    assert y.device.type == "cpu" and torch.equal(y, x)
