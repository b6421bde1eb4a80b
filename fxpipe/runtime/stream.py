"""CPU and CUDA streams behind one small interface, so both take the same code path."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TypeAlias

import torch

from fxpipe.errors import DeviceError

__all__ = [
    "CPUStreamType",
    "CPUStream",
    "AbstractStream",
    "normalize_device",
    "new_stream",
    "current_stream",
    "default_stream",
    "use_device",
    "use_stream",
    "get_device",
    "wait_stream",
    "record_stream",
    "is_cuda",
]


class CPUStreamType:
    """The type of :data:`CPUStream`: CPU work is synchronous, so there is nothing to hold."""

    _instance: CPUStreamType | None = None

    def __new__(cls) -> CPUStreamType:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "CPUStream"


#: The placeholder stream of the CPU (a singleton).
CPUStream = CPUStreamType()

#: A CUDA stream or the CPU placeholder.
AbstractStream: TypeAlias = torch.cuda.Stream | CPUStreamType

_CPU = torch.device("cpu")


def normalize_device(device: torch.device | str | int) -> torch.device:
    """The canonical form of a device: ``cpu:0`` is ``cpu``, ``cuda`` is the current index."""
    if isinstance(device, int):
        device = torch.device("cuda", device)
    device = torch.device(device)
    if device.type == "cpu":
        return _CPU
    if device.type == "cuda" and device.index is None:
        if not torch.cuda.is_available():
            raise DeviceError(f"device {device} is not available (no CUDA on this machine)")
        return torch.device("cuda", torch.cuda.current_device())
    return device


def new_stream(device: torch.device) -> AbstractStream:
    """A new stream on ``device`` (the placeholder on CPU)."""
    if device.type != "cuda":
        return CPUStream
    return torch.cuda.Stream(device)  # type: ignore[no-untyped-call]


def current_stream(device: torch.device) -> AbstractStream:
    """The stream work on ``device`` is queued on now, in this thread."""
    if device.type != "cuda":
        return CPUStream
    return torch.cuda.current_stream(device)


def default_stream(device: torch.device) -> AbstractStream:
    """The default stream of ``device``."""
    if device.type != "cuda":
        return CPUStream
    return torch.cuda.default_stream(device)


@contextmanager
def use_device(device: torch.device) -> Iterator[None]:
    """Make ``device`` the current CUDA device inside the block (nothing on CPU)."""
    if device.type != "cuda":
        yield
        return
    with torch.cuda.device(device):
        yield


@contextmanager
def use_stream(stream: AbstractStream) -> Iterator[None]:
    """Queue work on ``stream`` inside the block (nothing on CPU)."""
    if not is_cuda(stream):
        yield
        return
    assert isinstance(stream, torch.cuda.Stream)
    with torch.cuda.stream(stream):
        yield


def get_device(stream: AbstractStream) -> torch.device:
    """The device ``stream`` belongs to."""
    if not is_cuda(stream):
        return _CPU
    assert isinstance(stream, torch.cuda.Stream)
    return torch.device(stream.device)


def wait_stream(source: AbstractStream, target: AbstractStream) -> None:
    """Make ``source`` wait for the work queued on ``target`` so far."""
    if not is_cuda(target):
        return
    assert isinstance(target, torch.cuda.Stream)
    if is_cuda(source):
        assert isinstance(source, torch.cuda.Stream)
        source.wait_stream(target)
    else:
        target.synchronize()


def record_stream(tensor: torch.Tensor, stream: AbstractStream) -> None:
    """Tell the caching allocator that ``tensor`` is in use on ``stream`` (nothing on CPU).

    ``Tensor.record_stream`` once missed views whose data pointer is shifted from the start
    of their storage (pytorch/pytorch#27366), so the record goes on an empty tensor that
    aliases the whole storage instead.
    """
    if not is_cuda(stream) or not tensor.is_cuda:
        return
    assert isinstance(stream, torch.cuda.Stream)
    whole = torch.empty(0, dtype=torch.uint8, device=tensor.device)
    whole.set_(tensor.untyped_storage())
    whole.record_stream(stream)


def is_cuda(stream: AbstractStream) -> bool:
    """Whether ``stream`` is a CUDA stream (not the CPU placeholder)."""
    return stream is not CPUStream
