"""Runs one worker's part of a multicast plan, data-driven.

The part comes from a pure schedule (`libs.planning.multicast.node_parts`):
which blocks this node receives from whom, which it forwards to whom, in step
order. There is no barrier per step: one send thread (the node's single send
port) walks the sends in order and starts each as soon as the block's first
bytes are in place, streaming the rest as they arrive (cut-through), while
receives complete in whatever order the network delivers them. Each received
block is verified against its checksum the moment it is complete and
announced through `on_block`; a broken stream, an abort from a peer, a stall
or a checksum mismatch fails the whole part with TransferError, and the
node's downstream peers are told at once (an abort message) instead of
waiting for their own stall timeout.

Star, binary tree, chain and binomial / k-way plans are all just schedules
here: the executor does not know which algorithm produced its part, nor which
transport runs below it.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from libs.planning.multicast import Transfer
from libs.transfer.base import DEFAULT_CHUNK_BYTES, BlockSlot, Transport, TransferError

log = logging.getLogger(__name__)

BlockCallback = Callable[[int, BlockSlot], None]
GATE_STALL_S = 1.0  # no byte for this long: receive the next scheduled block too


@dataclass(frozen=True, slots=True)
class Hop:
    """One line of a node's part: in `step`, move `block` to/from node `peer`."""

    step: int
    peer: str
    block: int


def hops_of(transfers: Sequence[Transfer], names: Sequence[str], outgoing: bool) -> list[Hop]:
    """Schedule transfers (node indices) as hops naming the peer by node id."""
    return [Hop(t.step, names[t.dst] if outgoing else names[t.src], t.block) for t in transfers]


@dataclass
class PartResult:
    op_id: str
    started_at: float  # wall clock (time.time()): comparable across processes on one host
    finished_at: float
    block_arrived_at: dict[int, float] = field(default_factory=dict)  # verified receives
    first_byte_at: float | None = None  # the first received byte landed (None: nothing received)
    bytes_sent: int = 0
    bytes_received: int = 0


class PartRun:
    """One node's part, prepared: buffers checked and receives registered with the transport.

    Build it before telling anyone this node is ready (bytes arriving from a fast
    sender land in registered slots), then call :meth:`run` (blocking; run it on a
    thread) and :meth:`cancel` from anywhere to stop it.
    """

    def __init__(self, transport: Transport, op_id: str, *, slots: Mapping[int, BlockSlot], sends: Sequence[Hop],
                 receives: Sequence[Hop], peers: Mapping[str, str], checksums: Mapping[int, int] | None = None,
                 on_block: BlockCallback | None = None, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                 stall_timeout_s: float = 30.0, ordered_receives: bool = True):
        _check_part(op_id, slots, sends, receives, peers, checksums)
        self.transport, self.op_id = transport, op_id
        self.slots, self.peers = slots, peers
        self.sends = sorted(sends, key=lambda h: h.step)
        self.receives = sorted(receives, key=lambda h: h.step)
        self.checksums, self.on_block = checksums, on_block
        self.chunk_bytes, self.stall_timeout_s = chunk_bytes, stall_timeout_s
        self._cancel = threading.Event()
        self._done: queue.Queue[BlockSlot] = queue.Queue()
        # Receive in schedule order, one block at a time (the single-port model the schedules
        # assume): each block is granted to its sender when the previous one is complete, so a
        # sender that runs ahead waits instead of sharing this node's download link with the
        # block it needs now. `_window` grows only if the gate stalls (see _await_receives),
        # so ordering can never deadlock.
        self._gate = threading.Lock()
        self._granted: set[int] = set()
        self._window = 1 if ordered_receives else len(self.receives)
        for hop in self.receives[self._window:]:
            slots[hop.block].hold()
        try:
            for hop in self.receives:
                # Bytes are taken only from the peer the plan names, at the address it gives.
                transport.expect(op_id, hop.block, hop.peer, slots[hop.block], address=peers[hop.peer])
        except BaseException:
            transport.forget(op_id)
            raise
        # Messages too (grants from its receivers, aborts from its senders), until the run ends.
        self._admitted = [(peer, peers[peer]) for peer in {h.peer for h in (*self.sends, *self.receives)}]
        for peer, address in self._admitted:
            transport.admit_messages(peer, address)
        for hop in self.receives:
            slot = slots[hop.block]
            slot.on_done(self._received)
            # Ask for the next block while this one's last chunk is still arriving: the grant's
            # round trip overlaps with it instead of leaving the download link idle.
            slot.when_filled(max(1, slot.nbytes - chunk_bytes), lambda _s: self._admit(early=1))
        self._admit()

    def _received(self, slot: BlockSlot) -> None:
        self._done.put(slot)
        self._admit()

    def _admit(self, widen: bool = False, early: int = 0) -> None:
        """Admit as many receives (in step order) as have completed, plus the window.

        `early` counts a receive about to complete as done.
        """
        with self._gate:
            if widen:
                self._window += 1
            finished = sum(1 for hop in self.receives if self.slots[hop.block].complete)
            limit = min(len(self.receives), finished + self._window + early)
            admit = [hop for hop in self.receives[:limit] if hop.block not in self._granted]
            self._granted.update(hop.block for hop in admit)
        for hop in admit:
            self.slots[hop.block].admit()
            try:
                self.transport.grant(hop.peer, self.peers[hop.peer], self.op_id, hop.block)
            except TransferError as e:  # the sender is gone: its stream (or the stall timeout) fails the op
                log.info("op %s: cannot ask %s for block %d: %s", self.op_id, hop.peer, hop.block, e)

    def cancel(self) -> None:
        self._cancel.set()

    def run(self) -> PartResult:
        """Execute the part; returns when every send is out and every receive verified."""
        op_id, cancel = self.op_id, self._cancel
        result = PartResult(op_id=op_id, started_at=time.time(), finished_at=0.0)
        send_error: list[BaseException] = []

        def send_all() -> None:
            try:
                for hop in self.sends:
                    slot = self.slots[hop.block]
                    self.transport.send_block(hop.peer, self.peers[hop.peer], op_id, slot, self.chunk_bytes,
                                              cancelled=cancel.is_set, stall_timeout_s=self.stall_timeout_s,
                                              wait_grant=True)
                    result.bytes_sent += slot.nbytes
            except BaseException as e:  # noqa: BLE001 - handed to the waiting thread
                send_error.append(e)
                cancel.set()

        try:
            sender = threading.Thread(target=send_all, name=f"send-{op_id[:8]}", daemon=True)
            sender.start()
            _await_receives(op_id, self.receives, self.slots, self.checksums, self.on_block, self._done, cancel,
                            send_error, self.stall_timeout_s, result, lambda: self._admit(widen=True))
            while sender.is_alive():
                sender.join(0.2)
                if cancel.is_set() and not send_error:
                    raise TransferError(f"op {op_id}: cancelled")
            if send_error:
                raise _as_transfer_error(op_id, send_error[0])
            result.finished_at = time.time()
            stamps = [self.slots[h.block].first_byte_at for h in self.receives]
            result.first_byte_at = min((t for t in stamps if t is not None), default=None)
            return result
        except BaseException as e:
            cancel.set()
            _abort_downstream(self.transport, op_id, self.sends, self.peers, str(e))
            if isinstance(e, TransferError):
                raise
            raise _as_transfer_error(op_id, e) from e
        finally:
            self.transport.forget(op_id)
            for peer, address in self._admitted:
                self.transport.revoke_messages(peer, address)
            self._admitted = []


def run_part(transport: Transport, op_id: str, **kwargs) -> PartResult:
    """Prepare and execute this node's part (see :class:`PartRun` for the arguments)."""
    return PartRun(transport, op_id, **kwargs).run()


def _check_part(op_id: str, slots: Mapping[int, BlockSlot], sends: Sequence[Hop], receives: Sequence[Hop],
                peers: Mapping[str, str], checksums: Mapping[int, int] | None) -> None:
    received: set[int] = set()
    for hop in receives:
        if hop.block in received:
            raise ValueError(f"op {op_id}: block {hop.block} is received twice")
        received.add(hop.block)
        slot = slots.get(hop.block)
        if slot is None:
            raise ValueError(f"op {op_id}: no buffer for received block {hop.block}")
        if slot.complete:
            raise ValueError(f"op {op_id}: block {hop.block} is already held but also received")
        if checksums is not None and hop.block not in checksums:
            raise ValueError(f"op {op_id}: no checksum for block {hop.block}")
        if hop.peer not in peers:
            raise ValueError(f"op {op_id}: no address for peer {hop.peer}")
    for hop in sends:
        slot = slots.get(hop.block)
        if slot is None or not (slot.complete or hop.block in received):
            raise ValueError(f"op {op_id}: sends block {hop.block} to {hop.peer} but never holds it")
        if hop.peer not in peers:
            raise ValueError(f"op {op_id}: no address for peer {hop.peer}")


def _await_receives(op_id: str, receives: Sequence[Hop], slots: Mapping[int, BlockSlot],
                    checksums: Mapping[int, int] | None, on_block: BlockCallback | None,
                    done: queue.Queue[BlockSlot], cancel: threading.Event, send_error: list[BaseException],
                    stall_timeout_s: float, result: PartResult, widen_gate: Callable[[], None]) -> None:
    source = {hop.block: hop.peer for hop in receives}
    pending = set(source)
    last_progress, last_filled, last_widen = time.monotonic(), -1, time.monotonic()
    while pending:
        try:
            slot = done.get(timeout=0.2)
        except queue.Empty:
            if send_error:
                raise send_error[0]
            if cancel.is_set():
                raise TransferError(f"op {op_id}: cancelled")
            filled = sum(slots[b].filled for b in pending)
            now = time.monotonic()
            if filled != last_filled:
                last_progress, last_filled = now, filled
            elif now - max(last_progress, last_widen) > GATE_STALL_S:
                # The block due next is not coming (its sender serves another operation first, or
                # is slow): let the next one in rather than wait; ordering is an optimisation only.
                widen_gate()
                last_widen = now
            if now - last_progress > stall_timeout_s:
                missing = sorted(pending)
                raise TransferError(f"op {op_id}: no progress for {stall_timeout_s:.0f}s; blocks {missing[:8]} "
                                    f"still missing (from {sorted({source[b] for b in missing})})")
            continue
        if slot.error is not None:
            raise TransferError(f"op {op_id}: block {slot.block_id} from {source[slot.block_id]} failed: "
                                f"{slot.error}")
        if checksums is not None and slot.crc != checksums[slot.block_id]:
            raise TransferError(f"op {op_id}: block {slot.block_id} from {source[slot.block_id]} is corrupt "
                                f"(crc32 {slot.crc:08x}, expected {checksums[slot.block_id]:08x})")
        pending.discard(slot.block_id)
        result.block_arrived_at[slot.block_id] = slot.completed_at or time.time()
        result.bytes_received += slot.nbytes
        if on_block is not None:
            on_block(slot.block_id, slot)


def _abort_downstream(transport: Transport, op_id: str, sends: Sequence[Hop], peers: Mapping[str, str],
                      reason: str) -> None:
    """Tell every peer this node still had to feed that nothing more is coming."""
    for peer in dict.fromkeys(hop.peer for hop in sends):
        try:
            transport.abort(peer, peers[peer], op_id, reason[:500])
        except Exception as e:  # noqa: BLE001 - best effort: the peer's stall timeout is the fallback
            log.info("op %s: could not tell %s about the abort: %s", op_id, peer, e)


def _as_transfer_error(op_id: str, e: BaseException) -> TransferError:
    if isinstance(e, TransferError):
        return e
    return TransferError(f"op {op_id}: {type(e).__name__}: {e}")
