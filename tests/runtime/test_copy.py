"""Copy and Wait: identities through the CPU placeholder; device moves on CUDA."""

from __future__ import annotations

import pytest
import torch

from fxpipe.runtime.copy import copy, wait
from fxpipe.runtime.stream import CPUStream, new_stream


def test_copy_and_wait_on_cpu_are_identities_with_gradients() -> None:
    x = torch.randn(3, requires_grad=True)
    ids = torch.arange(3)
    y, ids2 = copy((x * 2, ids), CPUStream, CPUStream)
    (y,) = wait((y,), CPUStream, CPUStream)
    assert torch.equal(ids2, ids) and not ids2.requires_grad
    assert y.grad_fn is not None
    (y * 3).sum().backward()
    assert x.grad is not None and torch.equal(x.grad, torch.full((3,), 6.0))


def test_inputs_without_grad_stay_without_grad() -> None:
    a = torch.randn(2, requires_grad=True)
    b = torch.randn(2)
    a2, b2 = copy((a, b), CPUStream, CPUStream)
    a3, b3 = wait((a2, b2), CPUStream, CPUStream)
    assert a3.requires_grad and not b2.requires_grad and not b3.requires_grad


def test_empty_is_a_no_op() -> None:
    assert copy((), CPUStream, CPUStream) == ()
    assert wait((), CPUStream, CPUStream) == ()


@pytest.mark.cuda
def test_copy_cpu_to_cuda_and_back() -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    stream = new_stream(device)
    x = torch.randn(4, requires_grad=True)
    (y,) = copy((x,), CPUStream, stream)
    (y,) = wait((y,), stream, torch.cuda.current_stream(device))
    assert y.device == device
    (y * 2).sum().backward()
    assert x.grad is not None and x.grad.device.type == "cpu"
    assert torch.equal(x.grad, torch.full((4,), 2.0))


@pytest.mark.cuda
def test_wait_covers_every_tensor() -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    stream = new_stream(device)
    with torch.cuda.stream(stream):
        a = torch.ones(1 << 20, device=device)
        b = torch.ones(1 << 20, device=device) * 2
    a2, b2 = wait((a, b), stream, torch.cuda.current_stream(device))
    assert a2.sum().item() == 1 << 20 and b2.sum().item() == 2 << 20
