"""Wire format of the TCP data plane: one hello per connection, then frames.

    hello : magic "LCX1" | u8 connection class | u16 len | sender node id (utf-8)
    data  : u8 kind=1 | u16 op len | u32 block | u64 offset | u32 length | u64 block size | op id | payload
    msg   : u8 kind=2 | u16 channel len | u32 payload len | channel | payload

Big-endian. The data header names the byte range so a receiver can check it
continues the block in order and `recv_into` the payload straight into the
block's buffer.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from enum import IntEnum

MAGIC = b"LCX1"
MAX_NAME = 1024  # node ids, op ids, channels
MAX_MESSAGE = 256 << 20  # a small-message payload (activations) never exceeds this

_HELLO = struct.Struct("!4sBH")
_KIND = struct.Struct("!B")
_DATA = struct.Struct("!HIQIQ")
_MSG = struct.Struct("!HI")


class ConnClass(IntEnum):
    BULK = 0  # block bytes
    MESSAGE = 1  # small latency-sensitive messages: never queued behind bulk bytes


class FrameKind(IntEnum):
    DATA = 1
    MESSAGE = 2


class FrameError(ValueError):
    """Bytes on a data-plane connection that do not follow the wire format."""


@dataclass(frozen=True, slots=True)
class DataHeader:
    op_id: str
    block_id: int
    offset: int
    length: int
    block_nbytes: int


@dataclass(frozen=True, slots=True)
class MessageHeader:
    channel: str
    length: int


def _name(value: str, what: str) -> bytes:
    raw = value.encode()
    if not raw or len(raw) > MAX_NAME:
        raise FrameError(f"{what} must be 1..{MAX_NAME} bytes, got {len(raw)}")
    return raw


def decode_name(raw: bytes, what: str) -> str:
    """A node id, op id or channel as received: UTF-8, else a FrameError."""
    try:
        return raw.decode()
    except UnicodeDecodeError as e:
        raise FrameError(f"{what} is not UTF-8: {e}") from None


def encode_hello(conn_class: ConnClass, node_id: str) -> bytes:
    raw = _name(node_id, "node id")
    return _HELLO.pack(MAGIC, int(conn_class), len(raw)) + raw


HELLO_FIXED = _HELLO.size


def _unpack(s: struct.Struct, buf: bytes, what: str) -> tuple:
    if len(buf) != s.size:
        raise FrameError(f"{what} of {len(buf)} bytes, expected {s.size}")
    return s.unpack(buf)


def decode_hello_fixed(buf: bytes) -> tuple[ConnClass, int]:
    """The fixed part of a hello: (connection class, length of the node id that follows)."""
    magic, cls, n = _unpack(_HELLO, buf, "hello")
    if magic != MAGIC:
        raise FrameError(f"not a layercast data-plane connection (magic {magic!r})")
    try:
        conn_class = ConnClass(cls)
    except ValueError:
        raise FrameError(f"unknown connection class {cls}") from None
    if not 0 < n <= MAX_NAME:
        raise FrameError(f"node id length {n} out of range")
    return conn_class, n


def encode_data(h: DataHeader) -> bytes:
    op = _name(h.op_id, "op id")
    if h.length <= 0 or h.offset < 0 or h.offset + h.length > h.block_nbytes:
        raise FrameError(f"byte range {h.offset}+{h.length} does not fit a {h.block_nbytes}-byte block")
    return _KIND.pack(FrameKind.DATA) + _DATA.pack(len(op), h.block_id, h.offset, h.length, h.block_nbytes) + op


def encode_message(channel: str, length: int) -> bytes:
    ch = _name(channel, "channel")
    if not 0 <= length <= MAX_MESSAGE:
        raise FrameError(f"message of {length} bytes exceeds {MAX_MESSAGE}")
    return _KIND.pack(FrameKind.MESSAGE) + _MSG.pack(len(ch), length) + ch


KIND_SIZE = _KIND.size
DATA_FIXED = _DATA.size
MESSAGE_FIXED = _MSG.size


def decode_kind(buf: bytes) -> FrameKind:
    (k,) = _unpack(_KIND, buf, "frame kind")
    try:
        return FrameKind(k)
    except ValueError:
        raise FrameError(f"unknown frame kind {k}") from None


def decode_data_fixed(buf: bytes) -> tuple[int, int, int, int, int]:
    """(op id length, block, offset, length, block size) of a data frame, validated."""
    op_len, block, offset, length, total = _unpack(_DATA, buf, "data frame header")
    if not 0 < op_len <= MAX_NAME:
        raise FrameError(f"op id length {op_len} out of range")
    if length <= 0 or offset + length > total:
        raise FrameError(f"byte range {offset}+{length} does not fit a {total}-byte block")
    return op_len, block, offset, length, total


def decode_message_fixed(buf: bytes) -> tuple[int, int]:
    """(channel length, payload length) of a message frame, validated."""
    ch_len, length = _unpack(_MSG, buf, "message frame header")
    if not 0 < ch_len <= MAX_NAME:
        raise FrameError(f"channel length {ch_len} out of range")
    if length > MAX_MESSAGE:
        raise FrameError(f"message of {length} bytes exceeds {MAX_MESSAGE}")
    return ch_len, length
