"""The messages of generation one process per stage, between 2 gloo ranks: every kind of
value a step hands on comes back as it was sent (dtypes, complex ones among them, shapes, an
odd number of bytes before a wider dtype, an empty tensor, Python scalars, None), with more
values than the header's manifest holds, a message whose bytes do not fit in its first send,
and a message with no values; received when asked for, and by an inbox whose receive is
posted before each message is sent; what the messages do not carry refused as it is
encoded."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from fxpipe.errors import ConfigError
from fxpipe.generation.wire import (
    STEP,
    STOP,
    Inbox,
    Message,
    encode,
    recv_message,
    send_message,
)
from tests.distributed.ranks import launch, preload, results

preload(__name__)


def _values() -> tuple[Any, ...]:
    g = torch.Generator().manual_seed(0)
    first = (
        torch.tensor([True, False, True]),  # 3 bytes, then a float64 must still line up
        torch.randn(2, 3, generator=g, dtype=torch.float64),
        torch.randn(4, 1, 5, generator=g).to(torch.bfloat16),
        torch.randint(0, 9, (3, 2), generator=g),
        torch.empty(0, 4),
        torch.randn(2, 3, generator=g)[:, 1:],  # not contiguous
        torch.randn(3, 2, generator=g, dtype=torch.complex64),  # Llama 4's rotary table
        torch.tensor([True]),  # 1 byte, then a complex128 must still line up
        torch.randn(2, generator=g, dtype=torch.complex128),
        7, -3, 2.5, True, None,
    )  # fmt: skip
    return first + tuple(torch.full((i + 1,), float(i)) for i in range(12))  # 26 values


def _job(rank: int, world: int) -> list[Message]:
    cpu = torch.device("cpu")
    wide = torch.arange(130 * 128, dtype=torch.float32).view(130, 128)  # past the first send
    sent = [
        Message(STEP, 3, 1, 0, 5, 11, 4, 9, _values()),
        Message(STEP, 1, 0, 0, 2, 6, 0, 0, (wide, 3, torch.tensor([1, 2]))),
        Message(STOP),
    ]
    if rank == 0:
        for message in sent:
            send_message(message, 1, None, cpu)
        dist.barrier()
        for message in sent:
            send_message(message, 1, None, cpu, tag=5)
        dist.barrier()
        return sent + sent
    got = [recv_message(0, None, cpu) for _ in sent]
    inbox = Inbox(0, None, cpu, tag=5)  # a receive posted before each message is sent
    dist.barrier()
    again = [inbox.next() for _ in sent]
    assert inbox._work is None or inbox._work.is_completed()  # none posted after the STOP
    dist.barrier()
    return [  # views of one buffer, which torch.save keeps as one: copies to save
        dataclasses.replace(m, values=tuple(_copy(v) for v in m.values)) for m in got + again
    ]


def _copy(v: Any) -> Any:
    return v.clone() if isinstance(v, torch.Tensor) else v


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    return type(a) is type(b) and a == b


def test_every_value_comes_back_as_sent(tmp_path: Path) -> None:
    sent, got = results(launch(_job, 2, tmp_path))
    for s, g in zip(sent, got, strict=True):
        assert (s.command, s.lane, s.kind, s.rows, s.length, s.seen) == (
            g.command, g.lane, g.kind, g.rows, g.length, g.seen,
        )  # fmt: skip
        assert len(s.values) == len(g.values)
        for i, (a, b) in enumerate(zip(s.values, g.values, strict=True)):
            assert _same(a, b), (i, a, b)


def test_a_value_the_messages_do_not_carry_is_refused_as_it_is_encoded() -> None:
    """Before any send (a process encodes each message it hands on, and what is refused
    travels on as the lane's error instead of stopping the ring)."""
    for value in (torch.zeros(2, dtype=torch.float8_e4m3fn), torch.zeros([1] * 9), "text"):
        with pytest.raises(ConfigError, match="do not carry"):
            encode(Message(STEP, 0, values=(torch.ones(2), value)), torch.device("cpu"))
