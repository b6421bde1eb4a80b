"""Stream functions: the CPU placeholder path, and CUDA streams where a GPU exists."""

from __future__ import annotations

import pytest
import torch

from fxpipe.runtime.stream import (
    CPUStream,
    CPUStreamType,
    current_stream,
    default_stream,
    get_device,
    is_cuda,
    new_stream,
    normalize_device,
    record_stream,
    use_device,
    use_stream,
    wait_stream,
)

CPU = torch.device("cpu")


def test_cpu_stream_is_a_singleton_placeholder() -> None:
    assert CPUStreamType() is CPUStream
    for make in (new_stream, current_stream, default_stream):
        assert make(CPU) is CPUStream
    assert not is_cuda(CPUStream)
    assert get_device(CPUStream) == CPU


def test_cpu_stream_functions_do_nothing() -> None:
    x = torch.ones(3)
    with use_device(CPU), use_stream(CPUStream):
        wait_stream(CPUStream, CPUStream)
        record_stream(x, CPUStream)
        y = x + 1
    assert torch.equal(y, torch.full((3,), 2.0))


def test_normalize_device() -> None:
    assert normalize_device("cpu") == normalize_device("cpu:0") == CPU
    assert normalize_device(torch.device("cpu", 0)) == CPU
    assert normalize_device(1) == torch.device("cuda", 1)
    assert normalize_device("cuda:0") == torch.device("cuda", 0)


@pytest.mark.cuda
def test_cuda_streams() -> None:
    device = normalize_device("cuda")
    assert device.index == torch.cuda.current_device()
    stream = new_stream(device)
    assert is_cuda(stream) and stream != default_stream(device)
    assert get_device(stream) == device
    with use_stream(stream):
        assert current_stream(device) == stream
    assert current_stream(device) == default_stream(device)


@pytest.mark.cuda
def test_cuda_wait_and_record_shifted_view() -> None:
    device = normalize_device("cuda")
    stream = new_stream(device)
    base = torch.ones(1024, device=device)
    view = base[512:]
    with use_stream(stream):
        wait_stream(stream, default_stream(device))
        out = view * 2
    record_stream(view, stream)
    wait_stream(default_stream(device), stream)
    assert torch.equal(out.cpu(), torch.full((512,), 2.0))
