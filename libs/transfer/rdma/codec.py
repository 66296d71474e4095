"""RDMA wire codec: connection data, control messages, ctrl-QP frames and immediates.

Pure: no pyverbs, no sockets, no transport state, so it imports and runs on any
machine. The transport (:mod:`libs.transfer.rdma.transport`) puts these bytes
and numbers on the wire; this module only says what they are and checks what
arrives.
"""

from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass
from typing import Any

from libs.transfer.errors import TransferError

PROTOCOL_VERSION = 2

# Immediate data (32 bits): which inbound stream, and where the span it ends stops (in granules).
# Carrying the end offset keeps the receiver independent of wc.byte_len, which not every provider fills.
IMM_TOKEN_BITS = 14
IMM_UNIT_BITS = 18
MAX_TOKENS = 1 << IMM_TOKEN_BITS   # concurrent inbound WRITE streams per transport
MAX_UNITS = 1 << IMM_UNIT_BITS     # a block spans fewer granules than this; big blocks get big granules

MTU_ENUM_TO_BYTES = {1: 256, 2: 512, 3: 1024, 4: 2048, 5: 4096}  # ibv_mtu
MTU_BYTES_TO_ENUM = {b: e for e, b in MTU_ENUM_TO_BYTES.items()}
ZERO_GID = "0000:0000:0000:0000:0000:0000:0000:0000"
GID_RE = re.compile(r"^[0-9a-fA-F]{4}(:[0-9a-fA-F]{4}){7}$")

CTRL_FRAME_BYTES = 32 * 1024  # one SEND; larger messages are fragmented
MAX_MESSAGE_BYTES = 1 << 30


class RdmaProtocolError(TransferError):
    """A peer sent connection data, a control message or a frame that does not parse."""


# --------------------------------------------------------------------------------------
# Immediates and the spans they end, work requests, MTU
# --------------------------------------------------------------------------------------

def imm_granule(nbytes: int) -> int:
    """Smallest power of two `g` such that every end offset of a block of `nbytes` fits the immediate in units of g."""
    if nbytes < 0:
        raise ValueError(f"nbytes must not be negative, got {nbytes}")
    g = 1
    while -(-nbytes // g) >= MAX_UNITS:
        g <<= 1
    return g


def next_write_end(offset: int, filled: int, nbytes: int, chunk: int, granule: int) -> int:
    """Where the next WRITE span from `offset` ends: what is in place, up to a chunk, on a granule
    boundary (the immediate names ends in granules) unless it is the end of the block.

    Returns `offset` when less than a granule is in place and the block is not all there.
    """
    if chunk < granule or chunk <= 0:
        raise ValueError(f"chunk {chunk} must be positive and at least the granule {granule}")
    if not 0 <= offset <= filled <= nbytes:
        raise ValueError(f"bad watermarks: offset {offset}, filled {filled}, nbytes {nbytes}")
    end = min(offset + chunk, filled)
    if end < nbytes:
        end -= end % granule
    return max(end, offset)


def imm_end_offset(units: int, granule: int, nbytes: int) -> int:
    """The byte offset an immediate's end (in granules) stands for."""
    return min(units * granule, nbytes)


def split_work_requests(offset: int, length: int, max_msg: int) -> list[tuple[int, int]]:
    """Cut bytes [offset, offset+length) into work requests of at most `max_msg` bytes each."""
    if max_msg <= 0:
        raise ValueError(f"max_msg must be positive, got {max_msg}")
    if offset < 0 or length < 0:
        raise ValueError(f"bad span: offset {offset}, length {length}")
    return [(start, min(max_msg, offset + length - start)) for start in range(offset, offset + length, max_msg)]


def encode_imm(token: int, units: int) -> int:
    """Immediate data of a WRITE_WITH_IMM: the stream token (high bits) and the span's end in granules (low bits).

    Host order; the transport puts it on the wire with htonl and reads it back with ntohl.
    """
    if not 0 <= token < MAX_TOKENS:
        raise ValueError(f"stream token {token} outside [0, {MAX_TOKENS})")
    if not 0 <= units < MAX_UNITS:
        raise ValueError(f"end offset of {units} granules outside [0, {MAX_UNITS})")
    return (token << IMM_UNIT_BITS) | units


def decode_imm(imm: int) -> tuple[int, int]:
    """(token, end in granules) from immediate data (host byte order)."""
    if not 0 <= imm < 1 << 32:
        raise ValueError(f"immediate data {imm} is not a 32-bit value")
    return imm >> IMM_UNIT_BITS, imm & (MAX_UNITS - 1)


def mtu_to_enum(mtu_bytes: int) -> int:
    """ibv_mtu value for an MTU in bytes (256 … 4096)."""
    try:
        return MTU_BYTES_TO_ENUM[mtu_bytes]
    except KeyError:
        raise ValueError(f"not an RDMA MTU: {mtu_bytes} (one of {sorted(MTU_BYTES_TO_ENUM)})") from None


def mtu_from_enum(value: int) -> int:
    """MTU in bytes for an ibv_mtu value."""
    try:
        return MTU_ENUM_TO_BYTES[int(value)]
    except KeyError:
        raise ValueError(f"not an ibv_mtu value: {value}") from None


# --------------------------------------------------------------------------------------
# Connection data carried by `exchange` (JSON-safe dicts)
# --------------------------------------------------------------------------------------

def _field(d: dict, name: str, kind: type, lo: int | None = None, hi: int | None = None, what: str = "") -> Any:
    if name not in d:
        raise RdmaProtocolError(f"{what}: field {name!r} is missing")
    value = d[name]
    # bool is an int subclass; a JSON true must not pass as a QP number
    if kind is int and (isinstance(value, bool) or not isinstance(value, int)):
        raise RdmaProtocolError(f"{what}: field {name!r} must be an integer, got {value!r}")
    if kind is not int and not isinstance(value, kind):
        raise RdmaProtocolError(f"{what}: field {name!r} must be {kind.__name__}, got {value!r}")
    if lo is not None and value < lo or hi is not None and value > hi:
        raise RdmaProtocolError(f"{what}: field {name!r} = {value} outside [{lo}, {hi}]")
    return value


@dataclass(frozen=True)
class ConnectionInfo:
    """What a peer needs to connect its two RC QPs to ours."""

    node: str
    lid: int          # 0 on RoCE
    gid: str          # 8 groups of 4 hex digits; all zero when the port has no GID
    mtu: int          # active MTU in bytes
    max_msg: int      # largest message the port takes
    bulk_qpn: int
    bulk_psn: int
    ctrl_qpn: int
    ctrl_psn: int
    # Which life of the transport and which of its connections this is: an attempt older than
    # the connection the peer already has with us is stale, not a reconnect (accept_exchange).
    incarnation: str = ""
    attempt: int = 0

    def to_dict(self) -> dict:
        return {"v": PROTOCOL_VERSION, "node": self.node, "lid": self.lid, "gid": self.gid, "mtu": self.mtu,
                "max_msg": self.max_msg, "bulk_qpn": self.bulk_qpn, "bulk_psn": self.bulk_psn,
                "ctrl_qpn": self.ctrl_qpn, "ctrl_psn": self.ctrl_psn,
                "incarnation": self.incarnation, "attempt": self.attempt}

    @classmethod
    def from_dict(cls, d: Any) -> ConnectionInfo:
        """Validate and parse; raises RdmaProtocolError naming the bad field."""
        what = "RDMA connection info"
        if not isinstance(d, dict):
            raise RdmaProtocolError(f"{what} must be a dict, got {type(d).__name__}")
        if isinstance(d.get("node"), str):
            what = f"RDMA connection info from {d['node']!r}"
        version = _field(d, "v", int, what=what)
        if version != PROTOCOL_VERSION:
            raise RdmaProtocolError(f"{what}: protocol version {version}, this node speaks {PROTOCOL_VERSION}")
        node = _field(d, "node", str, what=what)
        if not node:
            raise RdmaProtocolError(f"{what}: field 'node' is empty")
        gid = _field(d, "gid", str, what=what)
        if not GID_RE.match(gid):
            raise RdmaProtocolError(f"{what}: field 'gid' = {gid!r} is not 8 groups of 4 hex digits")
        mtu = _field(d, "mtu", int, what=what)
        if mtu not in MTU_BYTES_TO_ENUM:
            raise RdmaProtocolError(f"{what}: field 'mtu' = {mtu} is not one of {sorted(MTU_BYTES_TO_ENUM)}")
        return cls(
            node=node,
            lid=_field(d, "lid", int, 0, 0xFFFF, what),
            gid=gid.lower(),
            mtu=mtu,
            max_msg=_field(d, "max_msg", int, 1, 1 << 32, what),
            bulk_qpn=_field(d, "bulk_qpn", int, 1, 0xFFFFFF, what),
            bulk_psn=_field(d, "bulk_psn", int, 0, 0xFFFFFF, what),
            ctrl_qpn=_field(d, "ctrl_qpn", int, 1, 0xFFFFFF, what),
            ctrl_psn=_field(d, "ctrl_psn", int, 0, 0xFFFFFF, what),
            incarnation=_field(d, "incarnation", str, what=what),
            attempt=_field(d, "attempt", int, 0, None, what),
        )


def encode_connection_info(info: ConnectionInfo) -> dict:
    return info.to_dict()


def decode_connection_info(d: Any) -> ConnectionInfo:
    return ConnectionInfo.from_dict(d)


def superseded_reply(node: str) -> dict:
    """accept_exchange's answer when both ends connect at once and this end's attempt wins."""
    return {"v": PROTOCOL_VERSION, "node": node, "superseded": True}


def is_superseded_reply(d: Any) -> bool:
    return isinstance(d, dict) and d.get("superseded") is True


# --------------------------------------------------------------------------------------
# Control messages and ctrl-QP frames
# --------------------------------------------------------------------------------------

_KEY = {"op": str, "block": int}
_CONTROL_SCHEMA: dict[str, dict[str, type]] = {
    "hello": {},
    "offer": {**_KEY, "nbytes": int, "chunk": int, "granule": int, "mode": str, "addr": int, "rkey": int},
    "ready": {**_KEY, "token": int, "addr": int, "rkey": int},
    "refuse": {**_KEY, "reason": str},
    "revoke": {**_KEY, "reason": str},
    "avail": {**_KEY, "upto": int},
    "done": {**_KEY, "ok": bool, "reason": str},
    "abort": {**_KEY, "reason": str},
}
_RANGES = {"block": (0, None), "nbytes": (0, None), "chunk": (1, None), "granule": (1, None),
           "addr": (0, (1 << 64) - 1),
           "rkey": (0, (1 << 32) - 1), "token": (0, MAX_TOKENS - 1), "upto": (0, None)}


def validate_control(msg: Any) -> dict:
    """Check a control message against its schema; returns it, raises RdmaProtocolError."""
    if not isinstance(msg, dict):
        raise RdmaProtocolError(f"control message must be a dict, got {type(msg).__name__}")
    t = msg.get("t")
    if not isinstance(t, str) or t not in _CONTROL_SCHEMA:  # (a list or dict is not hashable)
        raise RdmaProtocolError(f"unknown control message type {t!r}")
    what = f"control message {t!r}"
    for name, kind in _CONTROL_SCHEMA[t].items():
        lo, hi = _RANGES.get(name, (None, None))
        _field(msg, name, kind, lo, hi, what)
    if t == "offer" and msg["mode"] not in ("write", "read"):
        raise RdmaProtocolError(f"{what}: mode {msg['mode']!r} is neither 'write' nor 'read'")
    return msg


def make_control(t: str, **fields: Any) -> dict:
    return validate_control({"t": t, **fields})


_FRAME = struct.Struct("!BB")  # kind, flags
_CHANNEL_LEN = struct.Struct("!H")
FRAME_CONTROL, FRAME_MESSAGE, FRAME_CONTINUATION = 1, 2, 3
FLAG_MORE = 1


def encode_control_frame(msg: dict) -> bytes:
    return _FRAME.pack(FRAME_CONTROL, 0) + json.dumps(validate_control(msg), separators=(",", ":")).encode()


def fragment_message(channel: str, payload: bytes, frame_bytes: int = CTRL_FRAME_BYTES) -> list[bytes]:
    """Frames carrying one application message: a first frame with the channel, then continuations."""
    ch = channel.encode()
    if len(ch) > 0xFFFF:
        raise ValueError("channel name too long")
    head = _FRAME.size + _CHANNEL_LEN.size + len(ch)
    if frame_bytes <= head:
        raise ValueError(f"frames of {frame_bytes} bytes cannot carry channel {channel!r}")
    data = memoryview(payload).cast("B")
    first = data[:frame_bytes - head]
    rest = data[len(first):]
    room = frame_bytes - _FRAME.size
    frames = [_FRAME.pack(FRAME_MESSAGE, FLAG_MORE if len(rest) else 0) + _CHANNEL_LEN.pack(len(ch)) + ch
              + bytes(first)]
    for start in range(0, len(rest), room):
        piece = rest[start:start + room]
        more = FLAG_MORE if start + room < len(rest) else 0
        frames.append(_FRAME.pack(FRAME_CONTINUATION, more) + bytes(piece))
    return frames


class FrameAssembler:
    """Turns the frames of one ctrl QP (in order) back into control messages and application messages."""

    def __init__(self, max_message_bytes: int = MAX_MESSAGE_BYTES) -> None:
        self._max = max_message_bytes
        self._channel: str | None = None
        self._parts: list[bytes] = []
        self._size = 0

    def feed(self, frame: bytes) -> tuple[str, Any] | None:
        """("control", dict) or ("message", (channel, payload)) when something is complete, else None."""
        if len(frame) < _FRAME.size:
            raise RdmaProtocolError(f"frame of {len(frame)} bytes is shorter than its header")
        kind, flags = _FRAME.unpack_from(frame)
        body = frame[_FRAME.size:]
        more = bool(flags & FLAG_MORE)
        if kind == FRAME_CONTROL:
            if more:
                raise RdmaProtocolError("control frames are never fragmented")
            try:
                msg = json.loads(body)
            except (ValueError, RecursionError) as exc:  # (nested too deep for the parser)
                raise RdmaProtocolError(f"control frame is not JSON: {exc}") from None
            return "control", validate_control(msg)
        if kind == FRAME_MESSAGE:
            if self._channel is not None:
                raise RdmaProtocolError(f"new message before message on {self._channel!r} ended")
            if len(body) < _CHANNEL_LEN.size:
                raise RdmaProtocolError("message frame too short for its channel length")
            (n,) = _CHANNEL_LEN.unpack_from(body)
            if len(body) < _CHANNEL_LEN.size + n:
                raise RdmaProtocolError("message frame too short for its channel name")
            try:
                channel = body[_CHANNEL_LEN.size:_CHANNEL_LEN.size + n].decode()
            except UnicodeDecodeError:
                raise RdmaProtocolError("channel name is not UTF-8") from None
            data = body[_CHANNEL_LEN.size + n:]
            if not more:
                return "message", (channel, bytes(data))
            self._channel, self._parts, self._size = channel, [bytes(data)], len(data)
            return None
        if kind == FRAME_CONTINUATION:
            if self._channel is None:
                raise RdmaProtocolError("continuation frame without a message")
            self._size += len(body)
            if self._size > self._max:
                raise RdmaProtocolError(f"message on {self._channel!r} exceeds {self._max} bytes")
            self._parts.append(bytes(body))
            if more:
                return None
            channel, payload = self._channel, b"".join(self._parts)
            self._channel, self._parts, self._size = None, [], 0
            return "message", (channel, payload)
        raise RdmaProtocolError(f"unknown frame kind {kind}")
