"""RDMA transport: block bytes move by one-sided RDMA WRITE (default) or READ over RC queue pairs.

Sources: λScale (§6) moves model blocks with a libibverbs transfer library that
*pulls* them with one-sided RDMA READs; BlitzScale (§3–4) scales through the RDMA
compute network between GPU servers. This module gives the plan executors the
same :class:`~libs.transfer.base.Transport` interface as TCP, built on rdma-core's
Python bindings (pyverbs, the ``rdma`` extra). pyverbs is imported lazily
(:mod:`~libs.transfer.rdma.verbs`), so this module imports on machines without it;
the wire format is :mod:`~libs.transfer.rdma.codec`, the memory regions
:mod:`~libs.transfer.rdma.memory`.

How it works
------------
* One protection domain, one completion queue with a completion channel, and one
  poller thread per transport. The poller never blocks: it releases credits,
  wakes waiters and hands everything else to a worker thread (slot bookkeeping,
  control messages) or a dispatcher thread (application messages).
* Per peer, two RC queue pairs. *bulk* carries the one-sided WRITE/READ work
  requests; *ctrl* carries SEND/RECV frames (control messages and the small
  messages of :meth:`RdmaTransport.send_message`), so those never queue behind
  bulk work requests. The QPs are connected with data (QP numbers, PSNs, LID,
  GID, MTU, max message size) that the injected ``exchange`` callable carries to
  the peer, where :meth:`RdmaTransport.accept_exchange` answers it.
* Memory regions are registered over the block buffers themselves (pyverbs
  ``MR(pd, length, access, address=...)``, i.e. ibv_reg_mr on the slot's
  memory), so bytes land in place without a copy. A block's address and rkey
  travel in a small control message per (operation, block).
* WRITE mode (push, default). Sender → ``offer``; once its slot is admitted
  (:meth:`BlockSlot.admit`), the receiver registers it and answers ``ready``
  (address, rkey and a stream token). The sender then streams the slot as it
  fills (cut-through, like TCP: whatever is in place, up to a chunk); each span
  is RDMA WRITEs whose last one is WRITE_WITH_IMM carrying (token, end of the
  span in granules). The receiver's completion for that immediate advances its
  slot: the bytes are already in place, ``writable()`` only checks the order.
  The sender waits for ``ready``, its slot to fill and its WRITE completions; the
  receiver waits for nothing but immediates.
* READ mode (pull, as in λScale; ``mode="read"``). Sender → ``offer`` with its own
  address and rkey; the receiver registers its admitted slot and answers
  ``ready``; the sender then announces ``avail`` (bytes [0, upto) are in place)
  as its slot fills. The receiver posts RDMA READs for what was announced,
  advances its slot as they complete and finally answers ``done``. The sender
  waits for its slot to fill and then for ``done`` (its memory must stay
  registered until the receiver has pulled it); the receiver waits for
  ``avail`` and its READ completions.
* Receive registrations, reserved channels (abort, grant) and message dispatch
  are the base class's, as for TCP; the schedule-level ``grant`` (``wait_grant``)
  travels as a small message before the per-transfer ``offer``/``ready``.
* ``forget`` on the receiver sends ``revoke``; a sender that gives a transfer up
  sends the per-transfer ``abort`` (the base class's op-wide abort is separate).
  A registration is dropped only when nothing can still land in it (the peer
  confirmed, the stream ended, or the connection is in the error state), so a
  late WRITE never reaches freed memory. Any error completion puts an RC QP in
  the error state: the connection is dropped, its transfers fail with
  :class:`TransferError`, and the next send reconnects through ``exchange``.

Limitations: host memory only (GPU memory would need dma-buf or peer-memory
registration); the process must not fork while memory is registered; pyverbs
must match the installed rdma-core (libibverbs) version.
"""

from __future__ import annotations

import itertools
import logging
import os
import queue
import random
import select
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from libs.transfer.base import BlockSlot, TransferError, Transport

# verbs.load_verbs is looked up at call time, so a fake verbs layer patched into that module reaches us too
from libs.transfer.rdma import verbs
from libs.transfer.rdma.codec import (
    CTRL_FRAME_BYTES,
    GID_RE,
    MAX_TOKENS,
    MAX_UNITS,
    ZERO_GID,
    ConnectionInfo,
    FrameAssembler,
    RdmaProtocolError,
    decode_imm,
    encode_control_frame,
    encode_imm,
    fragment_message,
    imm_end_offset,
    imm_granule,
    is_superseded_reply,
    make_control,
    mtu_from_enum,
    mtu_to_enum,
    next_write_end,
    split_work_requests,
    superseded_reply,
)
from libs.transfer.rdma.memory import MrCache, Registration, buffer_address
from libs.transfer.rdma.verbs import close_quietly

log = logging.getLogger(__name__)

MAX_WR_BYTES = 1 << 30  # one work request never moves more, whatever the port allows (2^31)

# Queue sizes. Every WR is signalled, so the CQ must hold all of them at once.
BULK_SQ_DEPTH = 128
BULK_RQ_DEPTH = 256   # receives consumed by WRITE_WITH_IMM
CTRL_SQ_DEPTH = 64
CTRL_RQ_DEPTH = 64
SEND_POOL_FRAMES = 256        # registered send buffers shared by all peers
CQ_ENTRIES = 1 << 16
POLL_BATCH = 64

RD_ATOMIC = 16        # outstanding RDMA READs per QP (capped by the device)
MIN_RNR_TIMER = 12    # 0.64 ms before a receiver-not-ready retry
ACK_TIMEOUT = 14      # 4.096 µs · 2^14 ≈ 67 ms per transport retry
RETRY_COUNT = 7
RNR_RETRY = 7         # 7 = retry forever: a full receive queue only slows the sender
HOP_LIMIT = 64

CONNECT_TIMEOUT_S = 15.0
CONTROL_TIMEOUT_S = 30.0
REVOKE_GRACE_S = 30.0     # keep a revoked registration this long for the sender's abort
DRAIN_TIMEOUT_S = 30.0    # wait this long for our own WRs when giving a transfer up
PENDING_OFFER_TTL_S = 600.0
GRAVE_TTL_S = 60.0
HOUSEKEEPING_S = 1.0
ADMISSION_POLL_S = 0.005   # how often held slots are checked for admission while offers wait

_RECV_FLAG = 1 << 63
_CTRL, _BULK = 1, 2
_ACTIVE, _FAILED, _FORGOTTEN, _ABORTED = "active", "failed", "forgotten", "aborted"
_STOP = object()


# --------------------------------------------------------------------------------------
# Per-connection and per-stream state
# --------------------------------------------------------------------------------------

class _Conn:
    """The two RC QPs to one peer, the ctrl receive ring and the send credits."""

    def __init__(self, tr: RdmaTransport, peer: str, initiator: bool) -> None:
        v, e = tr._v, tr._v.e
        self.peer = peer
        self.initiator = initiator
        self.ready = False
        self.created_at = time.monotonic()
        self.dead: str | None = None
        self.died_at = 0.0
        self.destroyed = False
        self.inflight = 0       # signalled send WRs not yet completed (under tr._wr_lock)
        self.posted_recvs = 0   # receive WRs not yet completed (under tr._wr_lock)
        self.post_lock = threading.Lock()  # posting vs. destroying the QPs
        self.ctrl_lock = threading.Lock()  # one message's frames go out together
        self.bulk_credits = threading.Semaphore(tr._bulk_sq)
        self.ctrl_credits = threading.Semaphore(tr._ctrl_sq)
        self.out_streams: dict[tuple[str, int], _OutStream] = {}
        self.in_streams: dict[tuple[str, int], _InStream] = {}
        self.pump_waiting: set[_InStream] = set()
        self.assembler = FrameAssembler()
        self.max_msg = tr._max_msg
        self.remote: ConnectionInfo | None = None
        self._tr = tr
        self.ring = np.zeros(tr._ctrl_rq * CTRL_FRAME_BYTES, dtype=np.uint8)
        self.ring_addr = buffer_address(self.ring)
        self.ring_mr: Any = None
        self.bulk_qp: Any = None
        self.ctrl_qp: Any = None
        try:
            self.ring_mr = v.MR(tr._pd, len(self.ring), e.IBV_ACCESS_LOCAL_WRITE, address=self.ring_addr)
            remote_access = e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_WRITE | e.IBV_ACCESS_REMOTE_READ
            self.bulk_qp = self._create_qp(tr._bulk_sq, tr._bulk_rq, remote_access)
            self.ctrl_qp = self._create_qp(tr._ctrl_sq, tr._ctrl_rq, e.IBV_ACCESS_LOCAL_WRITE)
        except Exception:
            self.destroy()
            raise
        self.bulk_psn = random.getrandbits(24)
        self.ctrl_psn = random.getrandbits(24)
        self.local_info = ConnectionInfo(node=tr.node_id, lid=tr._lid, gid=tr._gid, mtu=tr._mtu,
                                         max_msg=tr._max_msg, bulk_qpn=int(self.bulk_qp.qp_num),
                                         bulk_psn=self.bulk_psn, ctrl_qpn=int(self.ctrl_qp.qp_num),
                                         ctrl_psn=self.ctrl_psn, incarnation=tr._incarnation,
                                         attempt=next(tr._attempts))

    def _create_qp(self, sq: int, rq: int, access: int) -> Any:
        tr = self._tr
        v, e = tr._v, tr._v.e
        cap = v.QPCap(max_send_wr=sq, max_recv_wr=rq, max_send_sge=1, max_recv_sge=1)
        init = v.QPInitAttr(qp_type=e.IBV_QPT_RC, scq=tr._cq, rcq=tr._cq, cap=cap, sq_sig_all=1)
        attr = v.QPAttr(port_num=tr._port)
        attr.qp_access_flags = access
        # With a QPAttr, pyverbs moves an RC QP to INIT right away (RTR needs the peer's data).
        return v.QP(tr._pd, init, attr)

    def connect(self, remote: ConnectionInfo) -> None:
        """INIT → RTR → RTS for both QPs, towards the peer's QPs."""
        tr = self._tr
        v = tr._v
        self.remote = remote
        self.max_msg = min(tr._max_msg, remote.max_msg)
        mtu = mtu_to_enum(min(tr._mtu, remote.mtu))
        for qp, rqpn, rpsn, lpsn in ((self.bulk_qp, remote.bulk_qpn, remote.bulk_psn, self.bulk_psn),
                                     (self.ctrl_qp, remote.ctrl_qpn, remote.ctrl_psn, self.ctrl_psn)):
            attr = v.QPAttr(port_num=tr._port)
            attr.path_mtu = mtu
            attr.dest_qp_num = rqpn
            attr.rq_psn = rpsn
            attr.max_dest_rd_atomic = tr._rd_atomic
            attr.min_rnr_timer = MIN_RNR_TIMER
            if remote.gid != ZERO_GID:
                # A GRH is required on RoCE and harmless on InfiniBand (as ibv_rc_pingpong does).
                gr = v.GlobalRoute(dgid=v.GID(remote.gid), sgid_index=tr._gid_index, hop_limit=HOP_LIMIT)
                attr.ah_attr = v.AHAttr(port_num=tr._port, dlid=remote.lid, is_global=1, gr=gr)
            else:
                attr.ah_attr = v.AHAttr(port_num=tr._port, dlid=remote.lid)
            attr.timeout = ACK_TIMEOUT
            attr.retry_cnt = RETRY_COUNT
            attr.rnr_retry = RNR_RETRY
            attr.sq_psn = lpsn
            attr.max_rd_atomic = tr._init_rd_atomic
            with self.post_lock:
                if self.destroyed:
                    raise TransferError(f"connection to {self.peer} was closed while connecting")
                qp.to_rtr(attr)
                qp.to_rts(attr)

    def post_send(self, qp: Any, wr: Any) -> None:
        with self.post_lock:
            if self.destroyed or self.dead is not None:
                raise TransferError(f"connection to {self.peer} is down: {self.dead or 'closed'}")
            qp.post_send(wr)

    def post_recv(self, qp: Any, wr: Any) -> None:
        with self.post_lock:
            if self.destroyed or self.dead is not None:
                raise TransferError(f"connection to {self.peer} is down: {self.dead or 'closed'}")
            qp.post_recv(wr)

    def to_error(self) -> None:
        """Move both QPs to the error state: nothing more lands, outstanding WRs complete as flushed."""
        v, e = self._tr._v, self._tr._v.e
        with self.post_lock:
            if self.destroyed:
                return
            for qp in (self.bulk_qp, self.ctrl_qp):
                if qp is None:
                    continue
                try:
                    qp.modify(v.QPAttr(qp_state=e.IBV_QPS_ERR), e.IBV_QP_STATE)
                except Exception as exc:
                    log.debug("moving a QP to %s to the error state failed: %s", self.peer, exc)

    def destroy(self) -> None:
        with self.post_lock:
            if self.destroyed:
                return
            self.destroyed = True
            for obj in (self.bulk_qp, self.ctrl_qp, self.ring_mr):
                close_quietly(obj)


class _OutStream:
    """One send_block call: what the receiver answered and what is still in flight."""

    def __init__(self, conn: _Conn, key: tuple[str, int], slot: BlockSlot, mode: str, chunk: int,
                 region: Registration) -> None:
        self.conn = conn
        self.key = key
        self.slot = slot
        self.mode = mode
        self.chunk = chunk
        self.region = region
        self.cv = threading.Condition()
        self.offered = False
        self.ready: dict | None = None
        self.refused: str | None = None
        self.revoked: str | None = None
        self.done: dict | None = None
        self.error: str | None = None
        self.inflight = 0

    def fail(self, reason: str) -> None:
        with self.cv:
            if self.error is None:
                self.error = reason
            self.cv.notify_all()

    def problem(self) -> str | None:
        op, block = self.key
        peer = self.conn.peer
        if self.error is not None:
            return f"block {block} of {op} to {peer}: {self.error}"
        if self.refused is not None:
            return f"{peer} refused block {block} of {op}: {self.refused}"
        if self.revoked is not None:
            return f"{peer} dropped block {block} of {op}: {self.revoked}"
        if self.done is not None and not self.done["ok"]:
            return f"{peer} could not read block {block} of {op}: {self.done['reason']}"
        return None


class _InStream:
    """One block being received from one peer (touched only by the worker thread)."""

    def __init__(self, conn: _Conn, key: tuple[str, int], slot: BlockSlot, mode: str, chunk: int, granule: int,
                 region: Registration) -> None:
        self.conn = conn
        self.key = key
        self.slot = slot
        self.mode = mode
        self.nbytes = slot.nbytes
        self.chunk = chunk
        self.granule = granule
        self.region = region
        self.token: int | None = None
        self.state = _ACTIVE
        self.reason = ""
        self.deadline = 0.0
        self.received = 0       # WRITE: end of the last span announced by an immediate
        self.remote_addr = 0    # READ: the sender's buffer
        self.rkey = 0
        self.avail = 0          # READ: bytes the sender announced
        self.posted = 0         # READ: bytes asked for
        self.inflight = 0       # READ: WRs outstanding
        self.done_bytes = 0
        self.finished = False
        self.released = False


@dataclass
class _PendingOffer:
    """An offer waiting for its expect() or for its slot to be admitted."""

    conn: _Conn
    msg: dict
    since: float


# --------------------------------------------------------------------------------------
# The transport
# --------------------------------------------------------------------------------------

class RdmaTransport(Transport):
    """Transport over RDMA RC queue pairs (pyverbs); see the module docstring for the protocol.

    `exchange(peer_node_id, local_info) -> remote_info` carries connection data to
    the peer (the worker does it over NATS request/reply), whose handler answers
    with :meth:`accept_exchange`. Dicts are JSON-safe. `exchange` is called on the
    thread that sends (send_block / send_message) and must block until the reply
    is in; it must not need that thread's event loop to get it. `mode` picks how
    this node sends blocks: "write" (push, default) or "read" (receiver pulls); a
    receiver serves either. `device_name` defaults to the first RDMA device;
    `gid_index` picks the port's GID (on RoCEv2 between hosts, an IPv4-mapped one).
    """

    def __init__(self, node_id: str, exchange: Callable[[str, dict], dict], device_name: str | None = None,
                 port: int = 1, gid_index: int = 0, *, mode: str = "write") -> None:
        if mode not in ("write", "read"):
            raise ValueError(f"mode must be 'write' or 'read', got {mode!r}")
        if not node_id:
            raise ValueError("node_id must not be empty")
        super().__init__(node_id)
        self.mode = mode
        self._exchange = exchange
        self._port = port
        self._gid_index = gid_index
        self._v = verbs.load_verbs()
        v, e = self._v, self._v.e
        try:
            names = verbs.device_names(v)
        except Exception as exc:
            raise TransferError(f"cannot list RDMA devices: {exc}") from exc
        if not names:
            raise TransferError("no RDMA device is present")
        if device_name is not None and device_name not in names:
            raise TransferError(f"RDMA device {device_name!r} not found (present: {', '.join(names)})")
        self._device = device_name or names[0]

        self._ctx: Any = None
        self._pd: Any = None
        self._channel: Any = None
        self._cq: Any = None
        self._pool_mr: Any = None
        try:
            self._ctx = v.device.Context(name=self._device)
            dattr = self._ctx.query_device()
            pattr = self._ctx.query_port(port)
            if int(pattr.state) != int(e.IBV_PORT_ACTIVE):
                raise TransferError(f"port {port} of {self._device} is not active (state {pattr.state})")
            self._gid = str(self._ctx.query_gid(port, gid_index)).lower()
            if not GID_RE.match(self._gid):
                raise TransferError(f"GID {gid_index} of {self._device} port {port} reads as {self._gid!r}")
            if self._gid == ZERO_GID and int(pattr.link_layer) == int(e.IBV_LINK_LAYER_ETHERNET):
                # RoCE needs a GRH, i.e. a populated GID (RoCEv2 between hosts: usually an IPv4-mapped one)
                raise TransferError(f"GID index {gid_index} of {self._device} port {port} is empty; "
                                    f"pick a populated one (see show_gids)")
            self._lid = int(pattr.lid)
            self._mtu = mtu_from_enum(pattr.active_mtu)
            self._max_msg = max(1, min(int(pattr.max_msg_sz), MAX_WR_BYTES))
            self._rd_atomic = max(1, min(RD_ATOMIC, int(dattr.max_qp_rd_atom)))
            self._init_rd_atomic = max(1, min(RD_ATOMIC, int(dattr.max_qp_init_rd_atom)))
            max_wr = int(dattr.max_qp_wr)
            self._bulk_sq, self._bulk_rq = min(BULK_SQ_DEPTH, max_wr), min(BULK_RQ_DEPTH, max_wr)
            self._ctrl_sq, self._ctrl_rq = min(CTRL_SQ_DEPTH, max_wr), min(CTRL_RQ_DEPTH, max_wr)
            self._cq_entries = min(CQ_ENTRIES, int(dattr.max_cqe))
            self._pd = v.PD(self._ctx)
            self._channel = v.CompChannel(self._ctx)
            self._cq = v.CQ(self._ctx, self._cq_entries, None, self._channel, 0)
            self._pool = np.zeros(SEND_POOL_FRAMES * CTRL_FRAME_BYTES, dtype=np.uint8)
            self._pool_addr = buffer_address(self._pool)
            self._pool_mr = self._register(self._pool_addr, len(self._pool), e.IBV_ACCESS_LOCAL_WRITE)
        except Exception as exc:
            self._close_verbs()
            if isinstance(exc, TransferError):
                raise
            raise TransferError(f"opening RDMA device {self._device} port {port}: {exc}") from exc

        self._access_local_write = int(e.IBV_ACCESS_LOCAL_WRITE)
        self._access_remote_write = int(e.IBV_ACCESS_REMOTE_WRITE)
        self._access_remote_read = int(e.IBV_ACCESS_REMOTE_READ)
        self._wc_success = int(e.IBV_WC_SUCCESS)
        self._wc_flush = int(e.IBV_WC_WR_FLUSH_ERR)
        self._wc_recv_imm = int(e.IBV_WC_RECV_RDMA_WITH_IMM)
        self._mrs = MrCache(self._register)
        self._pool_free: queue.Queue[int] = queue.Queue()
        for i in range(SEND_POOL_FRAMES):
            self._pool_free.put(i)

        self._lock = threading.Lock()
        self._cv = threading.Condition(self._lock)
        self._closed = False
        self._stopping = False
        self._conns: dict[str, _Conn] = {}
        self._incarnation = os.urandom(8).hex()  # this transport's life, told apart from a restart's
        self._attempts = itertools.count(1)  # each connection's number, in the order they are made
        self._graveyard: list[_Conn] = []
        self._qpn: dict[int, tuple[_Conn, int]] = {}
        self._pending_offers: dict[tuple[str, int], _PendingOffer] = {}  # before expect()
        self._admission: dict[tuple[str, int], _PendingOffer] = {}  # expected, slot held back (hold/admit)
        self._receiving: dict[tuple[str, int], _InStream] = {}
        self._tokens: dict[int, _InStream] = {}
        self._next_token = 0
        self._wr_lock = threading.Lock()
        self._wr_done: dict[int, tuple[_Conn, Callable[[bool, str], None]]] = {}
        self._wr_ids = itertools.count(1)
        self._work: queue.Queue = queue.Queue()
        self._deliveries: queue.Queue = queue.Queue()
        self._threads = [
            threading.Thread(target=self._poll_loop, name=f"rdma-poll-{node_id}", daemon=True),
            threading.Thread(target=self._work_loop, name=f"rdma-work-{node_id}", daemon=True),
            threading.Thread(target=self._deliver_loop, name=f"rdma-msg-{node_id}", daemon=True),
        ]
        for t in self._threads:
            t.start()

    # ---- Transport interface -------------------------------------------------------

    @property
    def address(self) -> str:
        """Informational: peers are reached by node id through `exchange`, not by this address."""
        return f"rdma://{self.node_id}/{self._device}/{self._port}"

    def expect(self, op_id: str, block_id: int, src: str, slot: BlockSlot, address: str | None = None) -> None:
        key = (op_id, block_id)
        with self._lock:  # against _on_offer: an offer is either pending here or sees the registration
            self._check_open()
            super().expect(op_id, block_id, src, slot, address)
            pending = self._pending_offers.pop(key, None)
        if pending is not None:
            # The sender offered before we expected the block: answer it now.
            self._work.put(("ctrl", pending.conn, pending.msg))

    def forget(self, op_id: str) -> None:
        with self._lock:
            super().forget(op_id)
            streams = [ist for key, ist in self._receiving.items() if key[0] == op_id]
            pend = [(k, self._pending_offers.pop(k)) for k in list(self._pending_offers) if k[0] == op_id]
            pend += [(k, self._admission.pop(k)) for k in list(self._admission) if k[0] == op_id]
        for ist in streams:
            self._work.put(("forget_stream", ist))
        for (op, block), p in pend:
            self._work.put(("send", p.conn, make_control("refuse", op=op, block=block,
                                                          reason="the receiver dropped this operation")))

    def _stream_block(self, peer: str, address: str, op_id: str, slot: BlockSlot, chunk_bytes: int,
                      cancelled: Callable[[], bool] | None, stall_timeout_s: float) -> None:
        """WRITE or READ mode; `address` is not needed: peers are reached by id."""
        if slot.nbytes == 0:
            return  # the receiver's empty slot is complete already
        conn = self._connect(peer)
        key = (op_id, slot.block_id)
        chunk = max(chunk_bytes, imm_granule(slot.nbytes))
        access = self._access_remote_read if self.mode == "read" else 0  # a WRITE source needs local read only
        region = self._mrs.acquire(slot.view, access, owner=slot.buffer)
        st = _OutStream(conn, key, slot, self.mode, chunk, region)
        with self._lock:
            problem = conn.dead or ("already being sent" if key in conn.out_streams else None)
            if problem is None:
                conn.out_streams[key] = st
        if problem is not None:
            self._mrs.release(region)
            raise TransferError(f"block {slot.block_id} of {op_id} to {peer}: {problem}")
        try:
            if self.mode == "write":
                self._push(st, cancelled, stall_timeout_s)
            else:
                self._offer(st, cancelled, stall_timeout_s)
        except Exception as exc:
            self._abandon(st, str(exc))
            if isinstance(exc, TransferError):
                raise
            raise TransferError(f"block {slot.block_id} of {op_id} to {peer}: {exc}") from exc
        finally:
            with self._lock:
                if conn.out_streams.get(key) is st:
                    del conn.out_streams[key]
            self._mrs.release(region)

    def send_message(self, peer: str, address: str, channel: str, payload: bytes) -> None:
        conn = self._connect(peer)
        self._send_frames(conn, fragment_message(channel, bytes(payload), CTRL_FRAME_BYTES), CONTROL_TIMEOUT_S)

    def close(self) -> None:
        with self._cv:
            if self._closed:
                return
            self._closed = True
            conns = list(self._conns.values()) + self._graveyard
            self._conns.clear()
            self._graveyard = []
            self._pending_offers.clear()
            self._admission.clear()
            for conn in conns:
                if conn.dead is None:
                    conn.dead = "transport closed"
                    conn.died_at = time.monotonic()
            outs = [st for conn in conns for st in conn.out_streams.values()]
            self._cv.notify_all()
        for st in outs:
            st.fail("RDMA transport closed")
        for conn in conns:
            conn.to_error()
        self.fail_all(TransferError(f"{self.node_id}: transport closed"))
        self._stopping = True
        self._work.put(_STOP)
        self._deliveries.put(_STOP)
        me = threading.current_thread()
        for t in self._threads:
            if t is not me:
                t.join(timeout=5.0)
        for conn in conns:
            conn.destroy()
        self._mrs.close_all()
        self._close_verbs()

    # ---- connection setup ----------------------------------------------------------

    def accept_exchange(self, peer_node_id: str, remote_info: dict) -> dict:
        """Answer a peer's `exchange`: connect fresh QPs to the peer's and return ours (JSON-safe).

        When both ends connect at once, the attempt of the smaller node id wins:
        the other end answers :func:`superseded_reply` and waits for it.
        """
        peer = peer_node_id
        if peer == self.node_id:
            raise TransferError("a node cannot connect to itself over RDMA")
        remote = ConnectionInfo.from_dict(remote_info)
        if remote.node != peer:
            raise RdmaProtocolError(f"connection info names node {remote.node!r}, the request came from {peer!r}")
        with self._cv:
            self._check_open()
            cur = self._conns.get(peer)
            if (cur is not None and cur.dead is None and cur.initiator and not cur.ready
                    and self.node_id < peer):
                return superseded_reply(self.node_id)
            if (cur is not None and cur.dead is None and cur.ready and cur.remote is not None
                    and remote.incarnation == cur.remote.incarnation and remote.attempt < cur.remote.attempt):
                # A late request of the peer's, made before the connection we both use now: replacing
                # that connection would fail it at both ends. The peer drops its attempt and uses it.
                return superseded_reply(self.node_id)
            conn = self._new_conn(peer, initiator=False)
            self._conns[peer] = conn
        if cur is not None and cur.dead is None:
            if cur.ready:  # the peer restarted or lost the old connection: this one replaces it
                self._conn_failed(cur, "replaced by a new connection from the peer")
            else:  # our own attempt that lost the tie, or an older request of the peer's
                self._discard(cur)
        try:
            conn.connect(remote)
        except Exception as exc:
            self._discard(conn)
            raise TransferError(f"connecting QPs to {peer}: {exc}") from exc
        with self._cv:
            self._cv.notify_all()
        return conn.local_info.to_dict()

    def _connect(self, peer: str, timeout: float = CONNECT_TIMEOUT_S) -> _Conn:
        if peer == self.node_id:
            raise TransferError("a node cannot connect to itself over RDMA")
        deadline = time.monotonic() + timeout
        wait_only_until = 0.0  # after a superseded reply: the peer's attempt will arrive, don't start another
        while True:
            with self._cv:
                while True:
                    self._check_open()
                    conn = self._conns.get(peer)
                    now = time.monotonic()
                    if conn is not None and conn.dead is None:
                        if conn.ready:
                            return conn
                    elif now >= wait_only_until:
                        break
                    if now >= deadline:
                        raise TransferError(f"no RDMA connection to {peer} within {timeout:.0f}s")
                    self._cv.wait(min(deadline - now, 0.2))
                conn = self._new_conn(peer, initiator=True)
                self._conns[peer] = conn
            try:
                reply = self._exchange(peer, conn.local_info.to_dict())
            except Exception as exc:
                self._discard(conn)
                raise TransferError(f"exchanging RDMA connection data with {peer} failed: {exc}") from exc
            if is_superseded_reply(reply):
                self._discard(conn)
                wait_only_until = deadline
                continue
            try:
                remote = ConnectionInfo.from_dict(reply)
                if remote.node != peer:
                    raise RdmaProtocolError(f"{peer} answered with the connection info of {remote.node!r}")
                with self._lock:
                    replaced = self._conns.get(peer) is not conn
                if replaced:  # the peer connected to us meanwhile; use that connection
                    self._discard(conn)
                    continue
                conn.connect(remote)
                self._send_ctrl(conn, make_control("hello"), CONTROL_TIMEOUT_S)
            except Exception as exc:
                self._discard(conn)
                if isinstance(exc, TransferError):
                    raise
                raise TransferError(f"connecting QPs to {peer}: {exc}") from exc
            with self._cv:
                if self._conns.get(peer) is conn and conn.dead is None:
                    conn.ready = True
                    self._cv.notify_all()
                    return conn

    def _new_conn(self, peer: str, initiator: bool) -> _Conn:
        """Create a connection's QPs (INIT) and post its receives; caller holds self._lock."""
        per_conn = self._bulk_sq + self._bulk_rq + self._ctrl_sq + self._ctrl_rq
        if (len(self._conns) + len(self._graveyard) + 1) * per_conn > self._cq_entries:
            raise TransferError(f"too many RDMA connections for a completion queue of {self._cq_entries}")
        try:
            conn = _Conn(self, peer, initiator)
        except TransferError:
            raise
        except Exception as exc:
            raise TransferError(f"creating RDMA queue pairs for {peer}: {exc}") from exc
        self._qpn[int(conn.bulk_qp.qp_num)] = (conn, _BULK)
        self._qpn[int(conn.ctrl_qp.qp_num)] = (conn, _CTRL)
        try:
            for i in range(self._ctrl_rq):
                self._post_recv(conn, _CTRL, i)
            for i in range(self._bulk_rq):
                self._post_recv(conn, _BULK, i)
        except Exception as exc:
            conn.dead = f"posting receives failed: {exc}"
            conn.died_at = time.monotonic()
            self._graveyard.append(conn)
            conn.to_error()
            raise TransferError(f"posting RDMA receives for {peer}: {exc}") from exc
        return conn

    def _discard(self, conn: _Conn) -> None:
        """Drop a connection that never carried anything (a failed or superseded attempt)."""
        with self._cv:
            if self._conns.get(conn.peer) is conn:
                del self._conns[conn.peer]
            if conn.dead is None:
                conn.dead = "discarded"
                conn.died_at = time.monotonic()
                self._graveyard.append(conn)
            self._cv.notify_all()
        conn.to_error()

    def _mark_ready(self, conn: _Conn) -> None:
        with self._cv:
            if conn.dead is None and self._conns.get(conn.peer) is conn:
                conn.ready = True
                self._cv.notify_all()

    def _conn_failed(self, conn: _Conn, reason: str) -> None:
        """Any thread: the connection is unusable; its transfers fail and nothing more lands."""
        with self._cv:
            if conn.dead is not None:
                return
            conn.dead = reason
            conn.died_at = time.monotonic()
            conn.ready = False
            if self._conns.get(conn.peer) is conn:
                del self._conns[conn.peer]
            self._graveyard.append(conn)
            outs = list(conn.out_streams.values())
            self._cv.notify_all()
        log.warning("RDMA connection %s -> %s dropped: %s", self.node_id, conn.peer, reason)
        conn.to_error()
        for st in outs:
            st.fail(f"connection lost: {reason}")
        self._work.put(("conn_failed", conn))

    def _check_open(self) -> None:
        if self._closed:
            raise TransferError("RDMA transport is closed")

    # ---- memory registration -------------------------------------------------------

    def _register(self, addr: int, length: int, access: int) -> Any:
        try:
            return self._v.MR(self._pd, length, access, address=addr)
        except TypeError as exc:
            raise TransferError("this pyverbs cannot register existing memory (MR(..., address=) is missing; "
                                "it needs a newer rdma-core)") from exc

    def register_slot(self, slot: BlockSlot) -> None:
        """Keep `slot`'s buffer registered across transfers (registration pins pages and takes time).

        Without this, each transfer registers the buffer for its own duration.
        Balance with :meth:`unregister_slot`.
        """
        if slot.nbytes == 0:
            return
        access = self._access_remote_read
        if not slot.view.readonly:
            access |= self._access_local_write | self._access_remote_write
        self._mrs.acquire(slot.view, access, owner=slot.buffer)

    def unregister_slot(self, slot: BlockSlot) -> None:
        if slot.nbytes == 0:
            return
        access = self._access_remote_read
        if not slot.view.readonly:
            access |= self._access_local_write | self._access_remote_write
        reg = self._mrs.lookup(slot.view, access)
        if reg is None:
            raise TransferError(f"block {slot.block_id} is not registered")
        self._mrs.release(reg)

    # ---- posting -------------------------------------------------------------------

    def _post_send(self, conn: _Conn, qp: Any, build: Callable[[int], Any],
                   on_done: Callable[[bool, str], None]) -> None:
        wid = next(self._wr_ids)
        with self._wr_lock:
            self._wr_done[wid] = (conn, on_done)
            conn.inflight += 1
        try:
            conn.post_send(qp, build(wid))
        except Exception as exc:
            with self._wr_lock:
                self._wr_done.pop(wid, None)
                conn.inflight -= 1
            if isinstance(exc, TransferError):
                raise
            self._conn_failed(conn, f"posting a work request failed: {exc}")
            raise TransferError(f"posting a work request to {conn.peer} failed: {exc}") from exc

    def _post_recv(self, conn: _Conn, kind: int, idx: int) -> None:
        v = self._v
        if kind == _CTRL:
            sge = v.SGE(conn.ring_addr + idx * CTRL_FRAME_BYTES, CTRL_FRAME_BYTES, conn.ring_mr.lkey)
            wr = v.RecvWR(wr_id=_RECV_FLAG | (kind << 32) | idx, num_sge=1, sg=[sge])
            qp = conn.ctrl_qp
        else:
            # WRITE_WITH_IMM consumes a receive but places no data in it.
            wr = v.RecvWR(wr_id=_RECV_FLAG | (kind << 32) | idx, num_sge=0)
            qp = conn.bulk_qp
        with self._wr_lock:
            conn.posted_recvs += 1
        try:
            conn.post_recv(qp, wr)
        except Exception:
            with self._wr_lock:
                conn.posted_recvs -= 1
            raise

    def _rdma_wr(self, wid: int, opcode: int, laddr: int, length: int, lkey: int, raddr: int, rkey: int,
                 imm: int | None = None) -> Any:
        v = self._v
        wr = v.SendWR(wr_id=wid, opcode=opcode, num_sge=1, sg=[v.SGE(laddr, length, lkey)],
                      imm_data=socket.htonl(imm) if imm is not None else 0)
        wr.set_wr_rdma(rkey, raddr)
        return wr

    def _send_ctrl(self, conn: _Conn, msg: dict, timeout: float) -> None:
        self._send_frames(conn, [encode_control_frame(msg)], timeout)

    def _send_ctrl_quiet(self, conn: _Conn, msg: dict) -> None:
        """Best effort (worker thread): a dead connection has already failed what depended on it."""
        if conn.dead is not None:
            return
        try:
            self._send_ctrl(conn, msg, CONTROL_TIMEOUT_S)
        except TransferError as exc:
            log.info("control message %s to %s not sent: %s", msg.get("t"), conn.peer, exc)

    def _send_frames(self, conn: _Conn, frames: list[bytes], timeout: float) -> None:
        """SEND frames on the ctrl QP, in order; never called on the poller thread (it waits for credits)."""
        deadline = time.monotonic() + timeout
        if not self._wait_for(lambda t: conn.ctrl_lock.acquire(timeout=t), conn, deadline):
            raise TransferError(f"control channel to {conn.peer} busy for {timeout:.0f}s")
        try:
            for frame in frames:
                if len(frame) > CTRL_FRAME_BYTES:
                    raise TransferError(f"frame of {len(frame)} bytes exceeds {CTRL_FRAME_BYTES}")
                if not self._wait_for(lambda t: conn.ctrl_credits.acquire(timeout=t), conn, deadline):
                    raise TransferError(f"control queue to {conn.peer} full for {timeout:.0f}s")
                slot_idx: list[int] = []
                try:
                    got = self._wait_for(lambda t, out=slot_idx: self._take_pool_frame(out, t), conn, deadline)
                except BaseException:
                    conn.ctrl_credits.release()
                    raise
                if not got:
                    conn.ctrl_credits.release()
                    raise TransferError("no free RDMA send buffer")
                idx = slot_idx[0]
                off = idx * CTRL_FRAME_BYTES
                self._pool[off:off + len(frame)] = np.frombuffer(frame, dtype=np.uint8)

                def done(ok: bool, detail: str, idx: int = idx) -> None:
                    self._pool_free.put(idx)
                    conn.ctrl_credits.release()

                addr, n, lkey = self._pool_addr + off, len(frame), self._pool_mr.lkey
                try:
                    self._post_send(conn, conn.ctrl_qp, lambda wid, a=addr, n=n, k=lkey: self._v.SendWR(
                        wr_id=wid, opcode=self._v.e.IBV_WR_SEND, num_sge=1, sg=[self._v.SGE(a, n, k)]), done)
                except BaseException:
                    done(False, "not posted")
                    raise
        finally:
            conn.ctrl_lock.release()

    def _take_pool_frame(self, out: list[int], timeout: float) -> bool:
        try:
            out.append(self._pool_free.get(timeout=timeout))
            return True
        except queue.Empty:
            return False

    def _wait_for(self, attempt: Callable[[float], bool], conn: _Conn, deadline: float) -> bool:
        """Retry `attempt(timeout)` in short slices so a dead connection or a close stops the wait."""
        while True:
            if conn.dead is not None:
                raise TransferError(f"connection to {conn.peer} is down: {conn.dead}")
            if self._closed:
                raise TransferError("RDMA transport is closed")
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            if attempt(min(left, 0.2)):
                return True

    # ---- sender side ---------------------------------------------------------------

    def _push(self, st: _OutStream, cancelled: Callable[[], bool] | None, stall: float) -> None:
        """WRITE mode: offer → ready, then WRITE what is in place (up to a chunk) as the slot fills."""
        conn, slot = st.conn, st.slot
        op, block = st.key
        granule = imm_granule(slot.nbytes)
        self._send_ctrl(conn, make_control("offer", op=op, block=block, nbytes=slot.nbytes, chunk=st.chunk,
                                           granule=granule, mode="write", addr=0, rkey=0), stall)
        st.offered = True
        self._await(st, lambda: st.ready is not None, stall, cancelled, "ready from the receiver")
        assert st.ready is not None
        token, raddr, rkey = st.ready["token"], st.ready["addr"], st.ready["rkey"]
        e = self._v.e
        offset = 0
        while offset < slot.nbytes:
            filled = self._wait_source(st, min(offset + granule, slot.nbytes), stall, cancelled)
            end = next_write_end(offset, filled, slot.nbytes, st.chunk, granule)
            pieces = split_work_requests(offset, end - offset, conn.max_msg)
            for i, (poff, plen) in enumerate(pieces):
                # Only the span's last WR carries the immediate: it names the span's end.
                imm = encode_imm(token, -(-end // granule)) if i == len(pieces) - 1 else None
                opcode = e.IBV_WR_RDMA_WRITE_WITH_IMM if imm is not None else e.IBV_WR_RDMA_WRITE
                self._post_bulk(st, opcode, "WRITE", st.region.addr + poff, plen, raddr + poff, rkey, imm,
                                cancelled, stall)
            offset = end
        self._await(st, lambda: st.inflight == 0, stall, cancelled, "RDMA WRITE completions")

    def _offer(self, st: _OutStream, cancelled: Callable[[], bool] | None, stall: float) -> None:
        """READ mode: offer (our address, rkey) → ready, then avail as the slot fills, then wait for done."""
        conn, slot = st.conn, st.slot
        op, block = st.key
        self._send_ctrl(conn, make_control("offer", op=op, block=block, nbytes=slot.nbytes, chunk=st.chunk,
                                           granule=1, mode="read", addr=st.region.addr, rkey=st.region.rkey),
                        stall)
        st.offered = True
        self._await(st, lambda: st.ready is not None, stall, cancelled, "ready from the receiver")
        announced = 0
        while announced < slot.nbytes:
            # Announce whatever is in place (cut-through); the receiver reads it in chunks.
            upto = self._wait_source(st, announced + 1, stall, cancelled)
            self._raise_if_stopped(st, cancelled)
            self._send_ctrl(conn, make_control("avail", op=op, block=block, upto=upto), stall)
            announced = upto
        self._await(st, lambda: st.done is not None, stall, cancelled, "RDMA READs by the receiver")

    def _wait_source(self, st: _OutStream, upto: int, stall: float, cancelled: Callable[[], bool] | None) -> int:
        """Wait for the slot to fill (cut-through); a refusal, revoke or lost connection ends the wait too."""
        def stop() -> bool:
            return (cancelled is not None and cancelled()) or st.problem() is not None or self._closed

        try:
            return st.slot.wait_filled(upto, timeout=stall, cancelled=stop)
        except TransferError:
            self._raise_if_stopped(st, cancelled)  # our reason, when it was ours
            raise

    def _post_bulk(self, st: _OutStream, opcode: int, what: str, laddr: int, length: int, raddr: int, rkey: int,
                   imm: int | None, cancelled: Callable[[], bool] | None, stall: float) -> None:
        conn = st.conn
        deadline = time.monotonic() + stall
        self._raise_if_stopped(st, cancelled)
        while not conn.bulk_credits.acquire(timeout=0.2):
            self._raise_if_stopped(st, cancelled)
            if time.monotonic() > deadline:
                raise TransferError(f"send queue to {conn.peer} stayed full for {stall:.0f}s")
        with st.cv:
            st.inflight += 1

        def done(ok: bool, detail: str) -> None:
            conn.bulk_credits.release()
            self._kick_pumps(conn)
            with st.cv:
                st.inflight -= 1
                if not ok and st.error is None:
                    st.error = f"RDMA {what} failed: {detail}"
                st.cv.notify_all()

        lkey = st.region.lkey
        try:
            self._post_send(conn, conn.bulk_qp,
                            lambda wid: self._rdma_wr(wid, opcode, laddr, length, lkey, raddr, rkey, imm), done)
        except BaseException:
            conn.bulk_credits.release()
            with st.cv:
                st.inflight -= 1
            raise

    def _raise_if_stopped(self, st: _OutStream, cancelled: Callable[[], bool] | None) -> None:
        with st.cv:
            problem = st.problem()
        if problem is not None:
            raise TransferError(problem)
        if cancelled is not None and cancelled():
            raise TransferError(f"block {st.key[1]} of {st.key[0]}: operation cancelled")
        if self._closed:
            raise TransferError("RDMA transport is closed")

    def _await(self, st: _OutStream, pred: Callable[[], bool], timeout: float,
               cancelled: Callable[[], bool] | None, what: str) -> None:
        deadline = time.monotonic() + timeout
        with st.cv:
            while True:
                problem = st.problem()
                if problem is not None:
                    raise TransferError(problem)
                if pred():
                    return
                if cancelled is not None and cancelled():
                    raise TransferError(f"block {st.key[1]} of {st.key[0]}: operation cancelled")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TransferError(f"block {st.key[1]} of {st.key[0]} to {st.conn.peer}: "
                                        f"no {what} for {timeout:.1f}s")
                st.cv.wait(min(left, 0.2))

    def _abandon(self, st: _OutStream, reason: str) -> None:
        """A send failed: drain our WRs, tell the receiver, and (READ) let its READs finish before unregistering."""
        conn = st.conn
        if self._closed:
            return
        deadline = time.monotonic() + DRAIN_TIMEOUT_S
        with st.cv:
            while st.inflight and time.monotonic() < deadline:
                st.cv.wait(0.2)
        if conn.dead is not None or not st.offered or st.refused is not None:
            return
        op, block = st.key
        try:
            self._send_ctrl(conn, make_control("abort", op=op, block=block, reason=reason[:500]), 5.0)
        except TransferError:
            return
        if st.mode == "read" and st.ready is not None:
            deadline = time.monotonic() + DRAIN_TIMEOUT_S
            with st.cv:
                while st.done is None and st.error is None and time.monotonic() < deadline:
                    st.cv.wait(0.2)

    # ---- receiver side (worker thread) --------------------------------------------

    def _on_control(self, conn: _Conn, msg: dict) -> None:
        t = msg["t"]
        key = (msg["op"], msg["block"])
        if conn.dead is not None:
            return
        if t == "offer":
            self._on_offer(conn, msg)
        elif t in ("ready", "refuse", "revoke", "done"):
            with self._lock:
                st = conn.out_streams.get(key)
            if st is None:
                return  # the send is over already
            with st.cv:
                if t == "ready":
                    st.ready = msg
                elif t == "refuse":
                    st.refused = msg["reason"]
                elif t == "revoke":
                    st.revoked = msg["reason"]
                else:
                    st.done = msg
                st.cv.notify_all()
        elif t == "avail":
            with self._lock:
                ist = conn.in_streams.get(key)
            if ist is None or ist.mode != "read" or ist.released:
                return
            if not ist.avail <= msg["upto"] <= ist.nbytes:
                self._end_in(ist, _FAILED, f"sender announced {msg['upto']} of {ist.nbytes} bytes "
                                           f"after {ist.avail}")
                self._maybe_finish_read(ist)
                return
            ist.avail = msg["upto"]
            self._pump_reads(ist)
        elif t == "abort":
            with self._lock:
                for waiting in (self._pending_offers, self._admission):
                    pend = waiting.get(key)
                    if pend is not None and pend.conn is conn:
                        del waiting[key]
                ist = conn.in_streams.get(key)
            if ist is None or ist.released:
                return
            self._end_in(ist, _ABORTED, f"sender {conn.peer} gave up: {msg['reason']}")
            if ist.mode == "write":
                ist.finished = True
                self._release_in(ist)  # the sender drained its WRITEs before aborting
            else:
                self._maybe_finish_read(ist)

    def _on_offer(self, conn: _Conn, msg: dict) -> None:
        key = (msg["op"], msg["block"])
        with self._lock:
            if self._closed:
                return
            with self._expected_changed:
                entry = self._expected.get(key)
                forgotten = msg["op"] in self._forgotten
            if entry is None and not forgotten:
                # Not expected yet: plans reach workers in any order; expect() answers it.
                self._pending_offers[key] = _PendingOffer(conn, msg, time.monotonic())
                return
        if entry is None:
            self._refuse(conn, key, "the receiver dropped this operation")
            return
        src, slot = entry
        if not slot.admitted and slot.error is None:
            # Held back (receive in schedule order): answer once admitted, as TCP leaves bytes in its socket.
            with self._lock:
                self._admission[key] = _PendingOffer(conn, msg, time.monotonic())
            return
        self._start_in_stream(conn, key, src, slot, msg)

    def _check_admissions(self) -> None:
        with self._lock:
            waiting = list(self._admission.items())
        for key, pend in waiting:
            with self._expected_changed:
                entry = self._expected.get(key)
            if entry is not None and not entry[1].admitted and entry[1].error is None:
                continue
            with self._lock:
                if self._admission.get(key) is not pend:
                    continue  # forgotten or aborted meanwhile
                del self._admission[key]
            if entry is None:
                self._refuse(pend.conn, key, "the receiver dropped this operation")
            else:
                self._start_in_stream(pend.conn, key, entry[0], entry[1], pend.msg)

    def _refuse(self, conn: _Conn, key: tuple[str, int], reason: str) -> None:
        self._send_ctrl_quiet(conn, make_control("refuse", op=key[0], block=key[1], reason=reason))

    def _start_in_stream(self, conn: _Conn, key: tuple[str, int], src: str, slot: BlockSlot, msg: dict) -> None:
        mode, chunk, granule = msg["mode"], msg["chunk"], msg["granule"]
        if src != conn.peer:
            return self._refuse(conn, key, f"expected from {src}, not {conn.peer}")
        if msg["nbytes"] != slot.nbytes:
            return self._refuse(conn, key, f"size {msg['nbytes']} but the receiving slot holds {slot.nbytes}")
        if slot.filled or slot.error is not None:
            return self._refuse(conn, key, "the receiving slot is not empty")
        if mode == "write" and -(-slot.nbytes // granule) >= MAX_UNITS:
            return self._refuse(conn, key, f"granule {granule} leaves more than {MAX_UNITS} units")
        access = self._access_local_write | (self._access_remote_write if mode == "write" else 0)
        try:
            region = self._mrs.acquire(slot.view, access, owner=slot.buffer)
        except (TransferError, ValueError) as exc:
            return self._refuse(conn, key, f"cannot register the receiving buffer: {exc}")
        ist = _InStream(conn, key, slot, mode, chunk, granule, region)
        ist.remote_addr, ist.rkey = msg["addr"], msg["rkey"]
        problem = None
        with self._lock:
            with self._expected_changed:
                entry = self._expected.get(key)
            if entry is None or entry[1] is not slot:
                problem = "the receiver dropped this operation"
            elif key in self._receiving:
                problem = "this block is being received already"
            elif conn.dead is not None:
                problem = "connection down"
            elif mode == "write":
                ist.token = self._alloc_token()
                if ist.token is None:
                    problem = f"all {MAX_TOKENS} inbound stream tokens are in use"
                else:
                    self._tokens[ist.token] = ist
            if problem is None:
                self._receiving[key] = ist
                conn.in_streams[key] = ist
        if problem is not None:
            self._mrs.release(region)
            return self._refuse(conn, key, problem)
        if mode == "write":
            ready = make_control("ready", op=key[0], block=key[1], token=ist.token, addr=region.addr,
                                 rkey=region.rkey)
        else:
            ready = make_control("ready", op=key[0], block=key[1], token=0, addr=0, rkey=0)
        self._send_ctrl_quiet(conn, ready)

    def _alloc_token(self) -> int | None:
        """Round-robin, so a token is reused as late as possible; caller holds self._lock."""
        for i in range(MAX_TOKENS):
            token = (self._next_token + i) % MAX_TOKENS
            if token not in self._tokens:
                self._next_token = (token + 1) % MAX_TOKENS
                return token
        return None

    def _end_in(self, ist: _InStream, state: str, reason: str, fail_slot: bool = True) -> None:
        if ist.state != _ACTIVE:
            return
        ist.state = state
        ist.reason = reason
        ist.deadline = time.monotonic() + REVOKE_GRACE_S
        if fail_slot:
            ist.slot.fail(TransferError(f"block {ist.key[1]} of {ist.key[0]}: {reason}"))

    def _release_in(self, ist: _InStream) -> None:
        with self._lock:
            if ist.released:
                return
            ist.released = True
            if ist.token is not None and self._tokens.get(ist.token) is ist:
                del self._tokens[ist.token]
            if ist.conn.in_streams.get(ist.key) is ist:
                del ist.conn.in_streams[ist.key]
            if self._receiving.get(ist.key) is ist:
                del self._receiving[ist.key]
        ist.conn.pump_waiting.discard(ist)
        self._mrs.release(ist.region)

    def _on_imm(self, conn: _Conn, imm: int) -> None:
        """WRITE mode: the span up to the immediate's end offset is in place."""
        token, units = decode_imm(imm)
        with self._lock:
            ist = self._tokens.get(token)
        if ist is None or ist.conn is not conn or ist.released:
            log.debug("immediate for unknown stream token %d from %s", token, conn.peer)
            return
        end = imm_end_offset(units, ist.granule, ist.nbytes)
        if end <= ist.received:
            self._end_in(ist, _FAILED, f"span ending at {end} arrived after {ist.received} bytes")
            self._send_ctrl_quiet(conn, make_control("revoke", op=ist.key[0], block=ist.key[1], reason=ist.reason))
            return
        if ist.state == _ACTIVE:
            try:
                ist.slot.writable(ist.received, end - ist.received)  # checks the order; the bytes are there
                ist.slot.advance(end - ist.received)
            except TransferError as exc:
                self._end_in(ist, _FAILED, str(exc))
                self._send_ctrl_quiet(conn, make_control("revoke", op=ist.key[0], block=ist.key[1],
                                                         reason=str(exc)))
        ist.received = end
        if ist.received >= ist.nbytes:
            ist.finished = True
            self._release_in(ist)  # the last span landed: nothing more will be written

    def _pump_reads(self, ist: _InStream) -> None:
        """READ mode: post READs for announced bytes while send credits last."""
        conn = ist.conn
        e = self._v.e
        while ist.state == _ACTIVE and not ist.released and ist.posted < ist.avail:
            if not conn.bulk_credits.acquire(blocking=False):
                conn.pump_waiting.add(ist)
                # A credit released between the failed acquire and the add would not kick us: retry once.
                if not conn.bulk_credits.acquire(blocking=False):
                    return
                conn.pump_waiting.discard(ist)
            off = ist.posted
            n = min(ist.avail - off, ist.chunk, conn.max_msg)

            def done(ok: bool, detail: str, off: int = off, n: int = n) -> None:
                conn.bulk_credits.release()
                self._kick_pumps(conn)
                self._work.put(("read_done", ist, off, n, ok, detail))

            laddr, lkey = ist.region.addr + off, ist.region.lkey
            raddr, rkey = ist.remote_addr + off, ist.rkey
            ist.inflight += 1
            try:
                self._post_send(conn, conn.bulk_qp, lambda wid, la=laddr, n=n, lk=lkey, ra=raddr, rk=rkey:
                                self._rdma_wr(wid, e.IBV_WR_RDMA_READ, la, n, lk, ra, rk), done)
            except TransferError as exc:
                conn.bulk_credits.release()
                ist.inflight -= 1
                self._end_in(ist, _FAILED, str(exc))
                self._maybe_finish_read(ist)
                return
            ist.posted += n

    def _on_read_done(self, ist: _InStream, off: int, n: int, ok: bool, detail: str) -> None:
        ist.inflight -= 1
        if ist.released:
            return
        if not ok:
            self._end_in(ist, _FAILED, f"RDMA READ from {ist.conn.peer} failed: {detail}")
        elif ist.state == _ACTIVE:
            try:
                ist.slot.writable(off, n)  # READs complete in posting order
                ist.slot.advance(n)
                ist.done_bytes += n
            except TransferError as exc:
                self._end_in(ist, _FAILED, str(exc))
        self._pump_reads(ist)
        self._maybe_finish_read(ist)

    def _maybe_finish_read(self, ist: _InStream) -> None:
        if ist.finished or ist.inflight:
            return
        if ist.state == _ACTIVE and ist.done_bytes < ist.nbytes:
            return
        ist.finished = True
        ok = ist.state == _ACTIVE
        self._release_in(ist)  # none of our READs is outstanding
        self._send_ctrl_quiet(ist.conn, make_control("done", op=ist.key[0], block=ist.key[1], ok=ok,
                                                     reason="" if ok else ist.reason))

    def _forget_stream(self, ist: _InStream) -> None:
        if ist.finished or ist.released:
            return
        self._end_in(ist, _FORGOTTEN, "the receiver dropped this operation", fail_slot=False)
        if ist.mode == "write":
            # Keep the registration until the sender confirms (abort) or finishes: its WRITEs may be in flight.
            self._send_ctrl_quiet(ist.conn, make_control("revoke", op=ist.key[0], block=ist.key[1],
                                                         reason=ist.reason))
        else:
            self._maybe_finish_read(ist)

    def _cleanup_failed_conn(self, conn: _Conn) -> None:
        with self._lock:
            ins = list(conn.in_streams.values())
            for waiting in (self._pending_offers, self._admission):
                for key in [k for k, p in waiting.items() if p.conn is conn]:
                    del waiting[key]
        for ist in ins:
            self._end_in(ist, _FAILED, f"connection to {conn.peer} lost: {conn.dead}")
            ist.finished = True
            self._release_in(ist)  # the QPs are in the error state: nothing more can land
        # As TCP: whatever this peer still owed us will not come on this connection.
        self.fail_from(conn.peer, TransferError(f"connection to {conn.peer} lost: {conn.dead}"))
        if not self._closed:
            self.peer_lost(conn.peer, f"rdma connection lost: {conn.dead}")

    def _kick_pumps(self, conn: _Conn) -> None:
        if conn.pump_waiting:
            self._work.put(("pump", conn))

    # ---- threads ---------------------------------------------------------------------

    def _poll_loop(self) -> None:
        """Drain the CQ; sleep on the completion channel when it is empty."""
        v = self._v
        fd = self._channel.fd
        os.set_blocking(fd, False)  # a spurious wakeup must not block in ibv_get_cq_event
        while not self._stopping:
            try:
                if self._drain():
                    continue
                self._cq.req_notify()
                if self._drain():  # completions that arrived before the notification was armed
                    continue
                readable, _, _ = select.select([fd], [], [], 0.1)
                if readable:
                    try:
                        self._channel.get_cq_event(self._cq)
                        self._cq.ack_events(1)
                    except v.PyverbsError:
                        pass  # nothing to read after all
            except Exception:
                if self._stopping:
                    return
                log.exception("RDMA completion poller")
                time.sleep(0.01)

    def _drain(self) -> int:
        total = 0
        while True:
            n, wcs = self._cq.poll(POLL_BATCH)
            for wc in wcs:
                try:
                    self._on_wc(wc)
                except Exception:
                    log.exception("handling an RDMA completion")
            total += n
            if n < POLL_BATCH:
                return total

    def _on_wc(self, wc: Any) -> None:
        wid = int(wc.wr_id)
        if wid & _RECV_FLAG:
            self._on_recv(wc, wid)
            return
        with self._wr_lock:
            entry = self._wr_done.pop(wid, None)
            if entry is not None:
                entry[0].inflight -= 1
        if entry is None:
            return
        conn, on_done = entry
        ok = int(wc.status) == self._wc_success
        detail = "" if ok else f"{self._v.status_text(int(wc.status))}, vendor error {int(wc.vendor_err):#x}"
        on_done(ok, detail)
        if not ok:
            self._conn_failed(conn, detail)

    def _on_recv(self, wc: Any, wid: int) -> None:
        entry = self._qpn.get(int(wc.qp_num))
        if entry is None:
            return
        conn, kind = entry
        with self._wr_lock:
            conn.posted_recvs -= 1
        status = int(wc.status)
        if status != self._wc_success:
            if status != self._wc_flush:
                self._conn_failed(conn, f"receive failed: {self._v.status_text(status)}")
            return
        if conn.dead is not None:
            return
        idx = wid & 0xFFFFFFFF
        if kind == _CTRL:
            start = idx * CTRL_FRAME_BYTES
            frame = conn.ring[start:start + int(wc.byte_len)].tobytes()
            self._repost(conn, kind, idx)
            self._on_frame(conn, frame)
        else:
            imm = socket.ntohl(int(wc.imm_data))
            self._repost(conn, kind, idx)
            if int(wc.opcode) == self._wc_recv_imm:
                self._work.put(("imm", conn, imm))

    def _repost(self, conn: _Conn, kind: int, idx: int) -> None:
        try:
            self._post_recv(conn, kind, idx)
        except Exception as exc:
            if conn.dead is None:
                self._conn_failed(conn, f"re-posting a receive failed: {exc}")

    def _on_frame(self, conn: _Conn, frame: bytes) -> None:
        try:
            item = conn.assembler.feed(frame)
        except RdmaProtocolError as exc:
            self._conn_failed(conn, f"bad frame: {exc}")
            return
        if item is None:
            return
        kind, value = item
        if kind == "control":
            if value["t"] == "hello":
                self._mark_ready(conn)
            else:
                self._work.put(("ctrl", conn, value))
        else:
            self._deliveries.put((conn.peer, value[0], value[1]))

    def _work_loop(self) -> None:
        last = time.monotonic()
        while True:
            try:
                item = self._work.get(timeout=ADMISSION_POLL_S if self._admission else HOUSEKEEPING_S)
            except queue.Empty:
                item = None
            if item is _STOP:
                return
            try:
                if item is not None:
                    self._handle_work(item)
                if self._admission:
                    self._check_admissions()
                if time.monotonic() - last >= HOUSEKEEPING_S:
                    last = time.monotonic()
                    self._housekeeping()
            except Exception:
                log.exception("RDMA transport worker")

    def _handle_work(self, item: tuple) -> None:
        kind = item[0]
        if kind == "ctrl":
            self._on_control(item[1], item[2])
        elif kind == "send":
            self._send_ctrl_quiet(item[1], item[2])
        elif kind == "imm":
            self._on_imm(item[1], item[2])
        elif kind == "read_done":
            self._on_read_done(*item[1:])
        elif kind == "pump":
            conn = item[1]
            waiting = list(conn.pump_waiting)
            conn.pump_waiting.clear()
            for ist in waiting:
                self._pump_reads(ist)
        elif kind == "forget_stream":
            self._forget_stream(item[1])
        elif kind == "conn_failed":
            self._cleanup_failed_conn(item[1])

    def _housekeeping(self) -> None:
        now = time.monotonic()
        with self._lock:
            expired = [ist for ist in self._tokens.values()
                       if ist.state != _ACTIVE and not ist.released and now > ist.deadline]
            stale = [(k, self._pending_offers.pop(k)) for k, p in list(self._pending_offers.items())
                     if now - p.since > PENDING_OFFER_TTL_S]
            # An accepted connection whose initiator never said hello would block connecting to that peer.
            unborn = [c for c in self._conns.values() if not c.ready and now - c.created_at > 2 * CONNECT_TIMEOUT_S]
            with self._wr_lock:
                reap = [c for c in self._graveyard
                        if (c.inflight == 0 and c.posted_recvs == 0) or now - c.died_at > GRAVE_TTL_S]
            for conn in reap:
                self._graveyard.remove(conn)
                for qp in (conn.bulk_qp, conn.ctrl_qp):
                    if qp is not None and self._qpn.get(int(qp.qp_num), (None,))[0] is conn:
                        del self._qpn[int(qp.qp_num)]
        for conn in unborn:
            self._discard(conn)
        for ist in expired:
            ist.finished = True
            self._release_in(ist)
        for key, pend in stale:
            self._refuse(pend.conn, key, "the block was never expected here")
        for conn in reap:
            with self._wr_lock:
                orphans = [(w, cb) for w, (c, cb) in self._wr_done.items() if c is conn]
                for w, _ in orphans:
                    del self._wr_done[w]
            for _, cb in orphans:
                cb(False, "connection destroyed")
            conn.destroy()

    def _deliver_loop(self) -> None:
        while True:
            item = self._deliveries.get()
            if item is _STOP:
                return
            peer, channel, payload = item
            self.dispatch(peer, channel, payload)

    def _close_verbs(self) -> None:
        for name in ("_pool_mr", "_cq", "_channel", "_pd", "_ctx"):
            obj = getattr(self, name, None)
            setattr(self, name, None)
            close_quietly(obj)
