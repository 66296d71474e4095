"""What every transport gives the plan executors: block slots and the Transport interface.

A :class:`BlockSlot` is one block's pre-allocated buffer plus how many bytes of it
are in place. Receivers write into it front to back and advance the watermark;
a relaying sender streams from it as the watermark moves (cut-through: chunk k
goes out while chunk k+1 comes in). A running crc32 is kept as bytes arrive so
the block can be verified the moment it is complete.

Executors only see this interface, never which transport runs below it.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import zlib
from abc import ABC, abstractmethod
from collections import Counter, OrderedDict
from collections.abc import Callable

import torch

from libs.transfer.errors import TransferError  # noqa: F401  (re-exported: the transports' error)

log = logging.getLogger(__name__)

DEFAULT_CHUNK_BYTES = 1 << 20  # bulk transfers move ~1 MiB per frame
FORGOTTEN_OPS_KEPT = 4096


def _byte_view(buffer: torch.Tensor | memoryview | bytearray) -> memoryview:
    if isinstance(buffer, torch.Tensor):
        if buffer.device.type != "cpu" or not buffer.is_contiguous():
            raise ValueError("block slots need a contiguous host (CPU) tensor")
        return memoryview(buffer.view(torch.uint8).reshape(-1).numpy()).cast("B")
    return memoryview(buffer).cast("B")


class BlockSlot:
    """One block's buffer with a fill watermark, a running checksum and a failure flag.

    Thread-safe: one writer (the transport's receive path) advances it; any number of
    readers (senders relaying the block) wait for the watermark.
    """

    def __init__(self, block_id: int, buffer: torch.Tensor | memoryview | bytearray, nbytes: int | None = None,
                 *, complete: bool = False):
        view = _byte_view(buffer)
        nbytes = len(view) if nbytes is None else nbytes
        if nbytes > len(view):
            raise ValueError(f"block {block_id}: buffer holds {len(view)} bytes, block needs {nbytes}")
        self.block_id = block_id
        self.buffer = buffer  # keeps the storage alive
        self.view = view[:nbytes]
        self.nbytes = nbytes
        self.filled = nbytes if complete else 0
        self.crc = 0  # running crc32 of the bytes received so far (not computed for source blocks)
        self.completed_at: float | None = time.time() if complete else None
        self.first_byte_at: float | None = None  # the first received byte landed in the buffer
        self.error: BaseException | None = None
        self.admitted = True  # see admit(): a receiver may hold back bytes until earlier receives are done
        self._cond = threading.Condition()
        self._listeners: list[Callable[[BlockSlot], None]] = []
        self._thresholds: list[tuple[int, Callable[[BlockSlot], None]]] = []

    @property
    def complete(self) -> bool:
        return self.filled >= self.nbytes

    def writable(self, offset: int, length: int) -> memoryview:
        """Where a receiver puts bytes [offset, offset+length); must continue the fill in order."""
        if offset != self.filled:
            raise TransferError(f"block {self.block_id}: bytes at offset {offset} but {self.filled} are filled")
        if offset + length > self.nbytes:
            raise TransferError(f"block {self.block_id}: {offset}+{length} bytes overrun {self.nbytes}")
        return self.view[offset:offset + length]

    def bytes_landing(self) -> None:
        """The first bytes of a frame just landed (before :meth:`advance`, which a transport
        calls once the whole frame is in): the first call stamps first_byte_at."""
        if self.first_byte_at is None:
            self.first_byte_at = time.time()

    def advance(self, length: int) -> None:
        """Mark `length` more bytes (just written through :meth:`writable`) as in place."""
        start = self.filled
        if start == 0:
            self.bytes_landing()
        self.crc = zlib.crc32(self.view[start:start + length], self.crc)
        with self._cond:
            self.filled = start + length
            done = self.complete
            if done:
                self.completed_at = time.time()
            self._cond.notify_all()
            listeners = list(self._listeners) if done else []
            reached = [fn for at, fn in self._thresholds if at <= self.filled]
            self._thresholds = [(at, fn) for at, fn in self._thresholds if at > self.filled]
        for fn in reached:
            fn(self)
        for fn in listeners:
            fn(self)

    def hold(self) -> None:
        """Keep this block's bytes back until admit() (receive in schedule order)."""
        with self._cond:
            self.admitted = False

    def admit(self) -> None:
        with self._cond:
            self.admitted = True
            self._cond.notify_all()

    def wait_admitted(self) -> None:
        """Block the receive path until the block is admitted (or the slot fails)."""
        with self._cond:
            while not self.admitted and self.error is None:
                self._cond.wait(0.5)

    def fail(self, error: BaseException) -> None:
        with self._cond:
            if self.complete or self.error is not None:
                return
            self.error = error
            self._cond.notify_all()
            listeners = list(self._listeners)
        for fn in listeners:
            fn(self)

    def on_done(self, fn: Callable[[BlockSlot], None]) -> None:
        """Call `fn(slot)` once the slot is complete or has failed (now, if it already is)."""
        with self._cond:
            done = self.complete or self.error is not None
            if not done:
                self._listeners.append(fn)
        if done:
            fn(self)

    def when_filled(self, at_least: int, fn: Callable[[BlockSlot], None]) -> None:
        """Call `fn(slot)` once `at_least` bytes are in place (now, if they already are)."""
        with self._cond:
            if self.filled < at_least:
                self._thresholds.append((at_least, fn))
                return
        fn(self)

    def wait_filled(self, at_least: int, timeout: float | None = None,
                    cancelled: Callable[[], bool] | None = None) -> int:
        """Block until `at_least` bytes are in place; return the watermark.

        Raises TransferError when the slot fails, when `cancelled()` turns true, or on timeout.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self.filled < at_least:
                if self.error is not None:
                    raise TransferError(f"block {self.block_id}: {self.error}") from self.error
                if cancelled is not None and cancelled():
                    raise TransferError(f"block {self.block_id}: operation cancelled")
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TransferError(f"block {self.block_id}: no bytes for {timeout:.1f}s "
                                        f"({self.filled}/{self.nbytes} in place)")
                self._cond.wait(0.2 if left is None else min(left, 0.2))
            return self.filled


MessageHandler = Callable[[str, bytes], None]  # (sender node id, payload)
ABORT_CHANNEL = "layercast.abort"  # reserved: a sender gives up on an operation; its receivers fail it at once
GRANT_CHANNEL = "layercast.grant"  # reserved: a receiver is ready for a block (receiver-driven flow control)
RESERVED_CHANNELS = (ABORT_CHANNEL, GRANT_CHANNEL)
# What parsing a grant or an abort from a peer can raise: not JSON (or not UTF-8), nested too deep
# for the parser, a field missing or of the wrong type, a block number that is infinite.
MALFORMED = (ValueError, KeyError, TypeError, RecursionError, OverflowError)


class Transport(ABC):
    """Moves block bytes and small messages between worker data planes.

    Nodes are named by id; callers pass the address a peer's transport listens on.
    Bulk sends stream a slot as it fills; small messages travel on connections
    (or queues) of their own so they never wait behind bulk bytes.

    The base class keeps what every transport shares: which (operation, block)
    is expected from which peer into which slot, and message dispatch.
    """

    def __init__(self, node_id: str):
        self.node_id = node_id
        self._expected: dict[tuple[str, int], tuple[str, BlockSlot]] = {}
        # (op, source) -> the data-plane address the op's plan gives that source: bytes for the op
        # are taken only from there (see named_source / expected_slot's `accept`).
        self._source_addresses: dict[tuple[str, str], str] = {}
        # Peers whose messages (activations, grants, aborts) are taken: node -> the addresses the
        # plans, pipelines and pairs that name it give it -> how many of them do (see admit_messages).
        self._message_peers: dict[str, Counter[str]] = {}
        self._expected_changed = threading.Condition()
        self._handlers: dict[str, MessageHandler] = {ABORT_CHANNEL: self._on_abort, GRANT_CHANNEL: self._on_grant}
        self._grants: set[tuple[str, int, str]] = set()  # (op, block, receiver) a receiver is ready for
        self._grants_changed = threading.Condition()
        self._forgotten: OrderedDict[str, None] = OrderedDict()  # recent finished ops: late bytes are dropped
        # Called (peer node id, what happened) on a transport thread when a connection with an
        # admitted peer breaks or a send to it fails: the peer may be dead (the worker tells the
        # registry, which checks: libs/planning/liveness.py). Never called for this node's own close.
        self.on_peer_lost: Callable[[str, str], None] | None = None

    @property
    @abstractmethod
    def address(self) -> str:
        """Where peers reach this node ("host:port" for TCP)."""

    def send_block(self, peer: str, address: str, op_id: str, slot: BlockSlot, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                   cancelled: Callable[[], bool] | None = None, stall_timeout_s: float = 30.0,
                   wait_grant: bool = False) -> None:
        """Send all of `slot` to node `peer` at `address`, chunk by chunk as the slot fills.

        With `wait_grant`, the first byte goes out only once the receiver has granted the
        block (see :meth:`grant`). Returns once every byte has been handed to the link (TCP)
        or written/read (RDMA); raises TransferError if the peer is lost, the slot fails or
        `cancelled()` turns true.
        """
        if chunk_bytes <= 0:
            raise ValueError("chunk_bytes must be positive")
        if wait_grant:
            self.wait_granted(peer, op_id, slot.block_id, stall_timeout_s, cancelled)
        self._stream_block(peer, address, op_id, slot, chunk_bytes, cancelled, stall_timeout_s)

    @abstractmethod
    def _stream_block(self, peer: str, address: str, op_id: str, slot: BlockSlot, chunk_bytes: int,
                      cancelled: Callable[[], bool] | None, stall_timeout_s: float) -> None:
        """The transport's part of send_block: move the slot's bytes as they fill."""

    @abstractmethod
    def send_message(self, peer: str, address: str, channel: str, payload: bytes) -> None:
        """Send a small latency-sensitive message (e.g. a pipeline activation)."""

    @abstractmethod
    def close(self) -> None:
        """Close every connection and the listener; pending receives fail."""

    # --- receive registrations (shared) -------------------------------------------------------
    def expect(self, op_id: str, block_id: int, src: str, slot: BlockSlot, address: str | None = None) -> None:
        """Register that `src` will send `block_id` of operation `op_id` into `slot`; `address`: where
        the plan says `src` is (a transport that can tell takes the bytes only from there)."""
        with self._expected_changed:
            key = (op_id, block_id)
            if key in self._expected:
                raise ValueError(f"op {op_id}: block {block_id} is already expected")
            self._expected[key] = (src, slot)
            if address is not None:
                self._source_addresses[(op_id, src)] = address
            self._expected_changed.notify_all()

    def named_source(self, src: str, accept: Callable[[str | None], bool], wait_s: float) -> bool:
        """Whether an operation registered here expects bytes from `src` at an address `accept`s
        (its argument: the plan's address for `src`, None where none was registered). Waits up to
        `wait_s` for a plan still arriving."""
        return self._wait_until(lambda: self._plan_expects(src, accept), wait_s)

    def _plan_expects(self, src: str, accept: Callable[[str | None], bool]) -> bool:
        """(Under the lock.) Whether an operation expects bytes from `src` at an address `accept`s."""
        ops = {op for (op, _), (s, _) in self._expected.items() if s == src}
        return any(accept(self._source_addresses.get((op, src))) for op in ops)

    def _wait_until(self, predicate: Callable[[], bool], wait_s: float) -> bool:
        """Whether `predicate` (checked under the lock) holds within `wait_s`: rechecked on every
        change of the expected sources, and every 0.5 s."""
        deadline = time.monotonic() + wait_s
        with self._expected_changed:
            while not predicate():
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._expected_changed.wait(min(left, 0.5))
            return True

    def admit_messages(self, peer: str, address: str) -> None:
        """Take messages from `peer` at `address` (where a plan, a pipeline or a live pair says it
        is) until as many `revoke_messages` as calls of this: a transport that can tell takes a
        message connection, and each message on it, only from a peer so named."""
        with self._expected_changed:
            self._message_peers.setdefault(peer, Counter())[address] += 1
            self._expected_changed.notify_all()

    def revoke_messages(self, peer: str, address: str) -> None:
        with self._expected_changed:
            addresses = self._message_peers.get(peer)
            if addresses is None or addresses[address] <= 0:
                return
            addresses[address] -= 1
            if addresses[address] <= 0:
                del addresses[address]
            if not addresses:
                del self._message_peers[peer]

    def message_source(self, src: str, accept: Callable[[str | None], bool], wait_s: float) -> bool:
        """Whether messages from `src` are taken: something here names it at an address `accept`s
        (admit_messages, or an operation expecting its bytes: its aborts). Waits up to `wait_s`
        for a plan still arriving (a receiver's grant may come before the sender's part)."""
        return self._wait_until(lambda: any(accept(a) for a in self._message_peers.get(src, ()))
                                or self._plan_expects(src, accept), wait_s)

    def forget(self, op_id: str) -> None:
        """Drop an operation's registrations (it finished or failed); late bytes for it are refused."""
        with self._grants_changed:
            self._grants = {g for g in self._grants if g[0] != op_id}
            self._grants_changed.notify_all()
        with self._expected_changed:
            for key in [k for k in self._expected if k[0] == op_id]:
                del self._expected[key]
            for key in [k for k in self._source_addresses if k[0] == op_id]:
                del self._source_addresses[key]
            self._forgotten[op_id] = None
            while len(self._forgotten) > FORGOTTEN_OPS_KEPT:
                self._forgotten.popitem(last=False)
            self._expected_changed.notify_all()

    def expected_slot(self, op_id: str, block_id: int, src: str, wait_s: float,
                      accept: Callable[[str | None], bool] | None = None) -> BlockSlot | None:
        """The slot registered for bytes `src` sends, or None for an operation that already ended here.
        With `accept`, the bytes must also come from where the plan says `src` is (see named_source).

        Waits a little for a plan that is still arriving: a sender may start before its
        receiver has registered (plans reach workers in any order); TCP back-pressure
        holds the bytes meanwhile.
        """
        deadline = time.monotonic() + wait_s
        with self._expected_changed:
            while (op_id, block_id) not in self._expected:
                if op_id in self._forgotten:
                    return None
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TransferError(f"{self.node_id}: bytes from {src} for op {op_id} block {block_id}, "
                                        f"which this node does not expect")
                self._expected_changed.wait(min(left, 0.5))
            want_src, slot = self._expected[(op_id, block_id)]
            address = self._source_addresses.get((op_id, src))
        if want_src != src:
            raise TransferError(f"{self.node_id}: op {op_id} block {block_id} expected from {want_src}, "
                                f"arrived from {src}")
        if accept is not None and not accept(address):
            raise TransferError(f"{self.node_id}: op {op_id} block {block_id}: bytes claiming to be from {src} "
                                f"came from elsewhere than its address in the plan ({address})")
        return slot

    def fail_from(self, src: str, error: BaseException, op_id: str | None = None) -> None:
        """Fail every incomplete block expected from `src` (of one operation, or of all)."""
        with self._expected_changed:
            slots = [slot for (op, _), (s, slot) in self._expected.items()
                     if s == src and (op_id is None or op == op_id)]
        for slot in slots:
            slot.fail(error)

    def peer_lost(self, peer: str, reason: str) -> None:
        """Tell `on_peer_lost` (if set) that the data plane lost `peer`; its errors are only logged."""
        if self.on_peer_lost is None or peer == self.node_id:
            return
        try:
            self.on_peer_lost(peer, reason)
        except Exception:
            log.exception("%s: on_peer_lost(%s) failed", self.node_id, peer)

    def fail_all(self, error: BaseException) -> None:
        with self._expected_changed:
            slots = [slot for _, slot in self._expected.values()]
        for slot in slots:
            slot.fail(error)

    # --- small messages (shared dispatch) -----------------------------------------------------------
    def on_message(self, channel: str, handler: MessageHandler) -> None:
        """Deliver messages arriving on `channel` to `handler` (called on a transport thread)."""
        if channel in RESERVED_CHANNELS:
            raise ValueError(f"channel {channel!r} is reserved")
        self._handlers[channel] = handler

    def dispatch(self, src: str, channel: str, payload: bytes) -> None:
        handler = self._handlers.get(channel)
        if handler is None:
            log.warning("%s: message on unknown channel %r from %s dropped", self.node_id, channel, src)
            return
        try:
            handler(src, payload)
        except Exception:
            log.exception("%s: handler of channel %r failed", self.node_id, channel)

    def abort(self, peer: str, address: str, op_id: str, reason: str) -> None:
        """Tell `peer` this node will send nothing more for `op_id`: it fails the op now, not at a stall timeout."""
        self.send_message(peer, address, ABORT_CHANNEL, json.dumps({"op_id": op_id, "reason": reason}).encode())

    # --- receiver-driven flow control ------------------------------------------------------------------
    def grant(self, peer: str, address: str, op_id: str, block_id: int) -> None:
        """Tell sender `peer` this node is ready to take `block_id` of `op_id` now.

        As in RDMC's receiver-ready handshake: each node takes in one block at a time, in
        schedule order, so a sender that runs ahead waits instead of sharing the
        receiver's download link with the block the receiver needs first.
        """
        self.send_message(peer, address, GRANT_CHANNEL, json.dumps({"op_id": op_id, "block": block_id}).encode())

    def _on_grant(self, src: str, payload: bytes) -> None:
        try:
            msg = json.loads(payload)
            key = (str(msg["op_id"]), int(msg["block"]), src)
        except MALFORMED:
            log.warning("%s: malformed grant from %s dropped", self.node_id, src)
            return
        with self._grants_changed:
            self._grants.add(key)
            self._grants_changed.notify_all()

    def wait_granted(self, peer: str, op_id: str, block_id: int, timeout: float,
                     cancelled: Callable[[], bool] | None = None) -> None:
        """Block until `peer` has granted `block_id` of `op_id` (consumes the grant)."""
        key = (op_id, block_id, peer)
        deadline = time.monotonic() + timeout
        with self._grants_changed:
            while key not in self._grants:
                if cancelled is not None and cancelled():
                    raise TransferError(f"op {op_id}: cancelled while waiting for {peer} to take block {block_id}")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TransferError(f"op {op_id}: {peer} did not ask for block {block_id} within {timeout:.0f}s")
                self._grants_changed.wait(min(left, 0.2))
            self._grants.discard(key)

    def _on_abort(self, src: str, payload: bytes) -> None:
        try:
            msg = json.loads(payload)
            op_id, reason = str(msg["op_id"]), str(msg["reason"])
        except MALFORMED:
            log.warning("%s: malformed abort from %s dropped", self.node_id, src)
            return
        self.fail_from(src, TransferError(f"{src} aborted op {op_id}: {reason}"), op_id)

    def __enter__(self) -> Transport:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
