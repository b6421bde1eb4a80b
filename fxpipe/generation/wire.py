"""The messages of generation one process per stage: what one lane's step hands to the next
process, sent point to point as one buffer of a fixed size holding a header, a manifest of
each value's kind and shape and, where they fit, the tensors' bytes (a step's shapes change
between prefill and decode and from group to group, so the receiver learns them from the
manifest rather than fixing them). A decode step's few kilobytes go in that one send; more
values than the header's manifest holds take one more send, and tensors' bytes past what the
buffer holds one more (a prompt's hidden states): each send costs a round of the transport
(traced in the ring of 2 processes with a header send and a payload send per message, sends
of a few kilobytes took 4 to 8 ms while both processes waited)."""

from __future__ import annotations

import math
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from fxpipe.errors import ConfigError

__all__ = [
    "Inbox",
    "Message",
    "Packet",
    "STEP",
    "STOP",
    "ERROR",
    "send_message",
    "encode",
    "send_packet",
    "recv_message",
    "error_message",
    "error_text",
    "named",
    "in_order",
]

#: A message's command: a lane's step, the end of the call, a stage's error on its way back.
STOP, STEP, ERROR = 0, 1, 2
#: The header's fields, in order.
_FIELDS = ("command", "lane", "kind", "one_row", "rows", "length", "seen", "source", "count")
#: Manifest columns per value: its kind, its number of dimensions, up to 8 sizes.
_WIDTH, _MAX_DIMS = 10, 8
#: Values whose manifest rows travel in the header's send (the rest in one more).
_IN_HEADER = 16
#: 8-byte numbers of the header: its fields and ``_IN_HEADER`` manifest rows, made even so
#: that the tensors' bytes after it start on 16 bytes (where a complex128 view may).
_HEAD_WORDS = -(-(len(_FIELDS) + _IN_HEADER * _WIDTH) // 2) * 2
#: Bytes of the first send: the header, then room for the tensors' bytes of a message whose
#: bytes fit (else unused).
_HEAD_BYTES = 8 * _HEAD_WORDS
_INLINE = 1 << 16
#: Tensor dtypes by their code (a value's kind); negative codes are Python scalars.
_DTYPES = (
    torch.float32, torch.float64, torch.float16, torch.bfloat16,
    torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
    torch.complex64, torch.complex128,  # Llama 4's rotary table is complex
)  # fmt: skip
_INT, _FLOAT, _BOOL, _NONE = -1, -2, -3, -4


@dataclass(frozen=True)
class Message:
    """One message: a command, the lane, the step (prefill 0, decode 1 or an encoder's 2, for
    lanes of one row or not), its rows, the cache's length, the positions written before it,
    the encoder's length (an encoder-decoder's cross-attention cache; else 0), and values in
    an order both sides know (``count`` of them)."""

    command: int
    lane: int = 0
    kind: int = 0
    one_row: int = 0
    rows: int = 0
    length: int = 0
    seen: int = 0
    source: int = 0
    values: tuple[Any, ...] = field(default=())


@dataclass(frozen=True)
class Packet:
    """A message encoded for its sends: the first buffer (the header, the first values'
    manifest rows and, where they fit, every tensor's bytes), the further manifest rows and
    the tensors' bytes that did not fit (each ``None`` where there are none)."""

    command: int
    first: torch.Tensor
    more: torch.Tensor | None
    packed: torch.Tensor | None


def encode(message: Message, device: torch.device) -> Packet:
    """``message`` as the buffers :func:`send_packet` sends (tensors via ``device``); a value
    the messages do not carry raises ConfigError here, before anything is sent."""
    rows = [_entry(v) for v in message.values]
    head = [getattr(message, f) for f in _FIELDS[:-1]] + [len(rows)]
    first = rows[:_IN_HEADER] + [[0] * _WIDTH] * (_IN_HEADER - len(rows[:_IN_HEADER]))
    flat = head + [x for row in first for x in row]
    flat += [0] * (_HEAD_WORDS - len(flat))
    header = torch.tensor(flat, dtype=torch.long, device=device).view(torch.uint8)
    tensors = [v for v in message.values if isinstance(v, torch.Tensor) and v.numel()]
    packed = torch.cat([_bytes(t.detach().to(device)) for t in tensors]) if tensors else None
    inline = packed is None or packed.numel() <= _INLINE
    body = packed if inline and packed is not None else header[:0]
    rest = torch.zeros(_INLINE - body.numel(), dtype=torch.uint8, device=device)
    more = rows[_IN_HEADER:]
    return Packet(
        message.command, torch.cat([header, body, rest]),
        torch.tensor(more, dtype=torch.long, device=device) if more else None,
        None if inline else packed,
    )  # fmt: skip


def send_packet(
    packet: Packet, dst: int, group: dist.ProcessGroup | None, *, tag: int = 0
) -> None:
    """Send an encoded message to global rank ``dst`` over ``group`` under ``tag``: its first
    buffer, then any further manifest rows and any tensors' bytes, one send each."""
    for part in (packet.first, packet.more, packet.packed):
        if part is not None:
            dist.send(part, dst, group=group, tag=tag)


def send_message(
    message: Message,
    dst: int,
    group: dist.ProcessGroup | None,
    device: torch.device,
    *,
    tag: int = 0,
) -> None:
    """Send ``message`` to global rank ``dst`` over ``group`` under ``tag`` (tensors via
    ``device``): :func:`encode`, then :func:`send_packet`."""
    send_packet(encode(message, device), dst, group, tag=tag)


def recv_message(
    src: int, group: dist.ProcessGroup | None, device: torch.device, *, tag: int = 0
) -> Message:
    """The next message from global rank ``src`` over ``group`` (tensors on ``device``, each
    a view of the one buffer they came in)."""
    buffer = _first_buffer(device)
    dist.recv(buffer, src, group=group, tag=tag)
    return _message(buffer, src, group, device, tag)


class Inbox:
    """The messages from global rank ``src`` under ``tag``, a receive always posted for the
    next one's first send: a gloo send waits for its receiver's receive, and a receive
    posted only once this process is free again (or a sender that only hears of it while
    it computes) costs the ring a few milliseconds a step. Nothing is posted after a STOP,
    so the next call's first message is not taken by this one's inbox. Over a device's
    transport (``device`` not the CPU) each message is received when asked for: there a
    posted receive would hold up this process's sends to ``src`` queued behind it."""

    def __init__(
        self, src: int, group: dist.ProcessGroup | None, device: torch.device, *, tag: int
    ) -> None:
        self.src, self.group, self.device, self.tag = src, group, device, tag
        self.ahead = device.type == "cpu"
        self._work: Any = None
        if self.ahead:
            self._post()

    def _post(self) -> None:
        self._buffer = _first_buffer(self.device)
        self._work = dist.irecv(self._buffer, self.src, group=self.group, tag=self.tag)

    def next(self) -> Message:
        """The next message (its further sends received), the one after posted for."""
        if not self.ahead:
            return recv_message(self.src, self.group, self.device, tag=self.tag)
        self._work.wait()
        message = _message(self._buffer, self.src, self.group, self.device, self.tag)
        if message.command != STOP:
            self._post()
        return message


def _first_buffer(device: torch.device) -> torch.Tensor:
    """A buffer for a message's first send."""
    return torch.empty(_HEAD_BYTES + _INLINE, dtype=torch.uint8, device=device)


def _message(
    buffer: torch.Tensor,
    src: int,
    group: dist.ProcessGroup | None,
    device: torch.device,
    tag: int,
) -> Message:
    """The message whose first send ``buffer`` holds, its further sends received."""
    numbers = buffer[:_HEAD_BYTES].view(torch.long).tolist()
    fields = dict(zip(_FIELDS, numbers[: len(_FIELDS)], strict=True))
    count = fields.pop("count")
    body = numbers[len(_FIELDS) :]
    rows = [body[i * _WIDTH : (i + 1) * _WIDTH] for i in range(min(count, _IN_HEADER))]
    if count > _IN_HEADER:
        more = torch.empty((count - _IN_HEADER, _WIDTH), dtype=torch.long, device=device)
        dist.recv(more, src, group=group, tag=tag)
        rows += more.tolist()
    shapes = [(code, sizes[:ndim]) for code, ndim, *sizes in rows]
    sizes = [
        math.prod(shape) * _DTYPES[code].itemsize if code >= 0 else 0 for code, shape in shapes
    ]
    total = sum(_padded(n) for n in sizes)
    if total <= _INLINE:  # the bytes came in the first send (as the sender chose)
        packed = buffer[_HEAD_BYTES : _HEAD_BYTES + total]
    else:
        packed = torch.empty(total, dtype=torch.uint8, device=device)
        dist.recv(packed, src, group=group, tag=tag)
    values: list[Any] = []
    offset = 0
    for (code, shape), size, (_, _, raw, *_) in zip(shapes, sizes, rows, strict=True):
        if code < 0:
            values.append(_scalar(code, raw))
            continue
        data = packed[offset : offset + size]
        offset += _padded(size)
        values.append(data.view(_DTYPES[code]).view(shape) if size else
                      torch.empty(shape, dtype=_DTYPES[code], device=device))  # fmt: skip
    return Message(**fields, values=tuple(values))


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """A tensor's contents as flat bytes, padded to a multiple of 16 (so that each tensor in
    a packed buffer starts where a view of any dtype may: complex128's elements are 16)."""
    data = t.contiguous().reshape(-1).view(torch.uint8)
    pad = _padded(data.numel()) - data.numel()
    return torch.nn.functional.pad(data, (0, pad)) if pad else data


def _padded(size: int) -> int:
    """``size`` bytes rounded up to a multiple of 16."""
    return -(-size // 16) * 16


def error_message(lane: int, error: BaseException) -> Message:
    """An ERROR message for ``lane`` carrying ``error``'s text (as bytes)."""
    text = f"{type(error).__name__}: {error}".encode()
    return Message(ERROR, lane, values=(torch.tensor(list(text), dtype=torch.uint8),))


def error_text(message: Message) -> str:
    """The text an ERROR message carries."""
    (data,) = message.values
    return bytes(data.tolist()).decode(errors="replace")


def named(message: Message, names: Sequence[str]) -> dict[str, Any]:
    """``message``'s values by ``names`` (the order both sides computed), checked."""
    if len(names) != len(message.values):
        raise ConfigError(
            f"a generation step carried {len(message.values)} values where this process "
            f"expects {len(names)} ({list(names)}): the processes traced different steps; "
            "build the pipeline alike on every rank"
        )
    return dict(zip(names, message.values, strict=True))


def in_order(values: Mapping[str, Any], names: Sequence[str]) -> tuple[Any, ...]:
    """``values`` in the order of ``names``."""
    return tuple(values[n] for n in names)


def _entry(value: Any) -> list[int]:
    """A value's manifest row."""
    if isinstance(value, torch.Tensor):
        if value.dtype not in _DTYPES or value.ndim > _MAX_DIMS:
            raise ConfigError(
                f"a generation step sends a {value.dtype} tensor of {value.ndim} dimensions "
                "between processes, which fxpipe's messages do not carry"
            )
        sizes = list(value.shape) + [0] * (_MAX_DIMS - value.ndim)
        return [_DTYPES.index(value.dtype), value.ndim, *sizes]
    if value is None:
        return [_NONE, 0] + [0] * _MAX_DIMS
    if isinstance(value, bool):
        return [_BOOL, 0, int(value)] + [0] * (_MAX_DIMS - 1)
    if isinstance(value, int):
        return [_INT, 0, value] + [0] * (_MAX_DIMS - 1)
    if isinstance(value, float):
        bits = struct.unpack("<q", struct.pack("<d", value))[0]
        return [_FLOAT, 0, bits] + [0] * (_MAX_DIMS - 1)
    raise ConfigError(
        f"a generation step sends a {type(value).__name__} between processes, which "
        "fxpipe's messages do not carry (tensors, ints, floats, bools and None)"
    )


def _scalar(code: int, raw: int) -> Any:
    """The Python scalar a manifest row of ``code`` holds."""
    if code == _INT:
        return raw
    if code == _BOOL:
        return bool(raw)
    if code == _FLOAT:
        return struct.unpack("<d", struct.pack("<q", raw))[0]
    return None
