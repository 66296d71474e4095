"""TCP transport: the default data plane, everywhere.

- A persistent connection pool: one bulk and one message connection per peer,
  opened on first use, kept and reused; a broken one is dropped and reopened by
  the next send.
- Bulk sends are framed chunks (≈1 MiB) sent straight from the block buffer
  (`sendmsg` of header + memoryview, no copy in user space) while the slot
  fills, so a relay forwards chunk k while it receives chunk k+1.
- Receivers `recv_into` the pre-allocated block buffer at the frame's offset.
- Small messages (pipeline activations) use their own connections with
  TCP_NODELAY, so they never wait behind bulk bytes (BlitzScale §4: serving
  traffic must not queue behind parameter transfers).
- Bytes only from the peers a plan names: a bulk connection is admitted once a
  registered operation expects bytes from the node its hello names, and only if it
  comes from that node's address in the plan (its IP, or an IP its name resolves
  to); otherwise it is closed before a byte of it is read into a block. Every data
  frame is checked again (the op must expect that block from that node, at that
  address), since one connection carries many operations. Message connections
  (activations, grants, aborts) likewise: admitted, and each message taken, only while
  a transfer, pipeline or live pair here names the peer at that address
  (`Transport.admit_messages`; `check_message_peers=False` turns it off).
- A connection with an admitted peer that breaks, or a send to a peer that fails, is
  told to `on_peer_lost`: the worker reports the peer, which may be dead, to the registry.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import socket
import threading
import time
from collections.abc import Callable

from libs.transfer.tcp import frames as f
from libs.checkpoint.pacing import make_pacer
from libs.transfer.base import ABORT_CHANNEL, BlockSlot, Transport, TransferError

log = logging.getLogger(__name__)

DRAIN_CHUNK = 1 << 20
MESSAGE_CHUNK = 1 << 20  # a message's payload is allocated in pieces of this as it arrives
TCP_NOTSENT_LOWAT = getattr(socket, "TCP_NOTSENT_LOWAT", 25)  # Linux value; older Pythons lack the name
DEFAULT_UNSENT_LIMIT = 128 << 10
DEFAULT_CONGESTION_CONTROL = "cubic"  # for bulk connections; see TcpTransport._set_congestion_control
RESOLVE_TTL_S = 10.0  # how long a peer's resolved addresses are reused


def split_address(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"data-plane address {address!r} is not host:port")
    return host.strip("[]"), int(port)


def _recv_exact(sock: socket.socket, n: int) -> bytes | None:
    """n bytes, or None on a clean EOF before the first byte; EOF inside raises."""
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            if got == 0:
                return None
            raise ConnectionError(f"connection closed inside a frame header ({got}/{n} bytes)")
        got += k
    return bytes(buf)


def _recv_header(sock: socket.socket, n: int) -> bytes:
    buf = _recv_exact(sock, n)
    if buf is None:
        raise ConnectionError("connection closed inside a frame header")
    return buf


def _recv_into(sock: socket.socket, view: memoryview, first: Callable[[], None] | None = None) -> None:
    """Fill `view` from `sock`; `first()` runs as soon as the first bytes are in."""
    got = 0
    while got < len(view):
        k = sock.recv_into(view[got:])
        if k == 0:
            raise ConnectionError(f"connection closed inside a frame ({got}/{len(view)} payload bytes)")
        if got == 0 and first is not None:
            first()
        got += k


def _normal_ip(ip: str) -> str:
    """An IP as text, an IPv4-mapped IPv6 address as its IPv4 form (one spelling per host)."""
    try:
        addr = ipaddress.ip_address(ip.split("%")[0])
    except ValueError:
        return ip
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped
    return addr.compressed


def _recv_payload(sock: socket.socket, length: int) -> bytes:
    """A message's `length` bytes, allocated as they arrive: a header that announces a large
    message and never sends it (a broken or hostile peer) costs no more memory than was sent."""
    if length <= MESSAGE_CHUNK:
        buf = bytearray(length)
        _recv_into(sock, memoryview(buf))
        return bytes(buf)
    parts, got = [], 0
    while got < length:
        part = bytearray(min(MESSAGE_CHUNK, length - got))
        _recv_into(sock, memoryview(part))
        parts.append(part)
        got += len(part)
    return b"".join(parts)


def _send_all(sock: socket.socket, buffers: list[bytes | memoryview]) -> None:
    """sendmsg until every byte of every buffer is out (the kernel may take part of them)."""
    views = [memoryview(b).cast("B") for b in buffers if len(b)]
    while views:
        sent = sock.sendmsg(views)
        while views and sent >= len(views[0]):
            sent -= len(views[0])
            views.pop(0)
        if views and sent:
            views[0] = views[0][sent:]


class _Conn:
    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.lock = threading.Lock()  # one frame at a time on the wire
        self.broken = False


class TcpTransport(Transport):
    def __init__(self, node_id: str, host: str = "127.0.0.1", port: int = 0, *,
                 advertise_host: str | None = None, connect_timeout_s: float = 10.0,
                 unknown_op_wait_s: float = 30.0, unsent_limit_bytes: int = DEFAULT_UNSENT_LIMIT,
                 congestion_control: str | None = DEFAULT_CONGESTION_CONTROL, egress_mbit: float = 0.0,
                 check_peer_hosts: bool = True, check_message_peers: bool = True):
        super().__init__(node_id)
        # Whether bytes must come from the address the plan gives their sender (not just carry its name).
        self.check_peer_hosts = check_peer_hosts
        # Whether messages are taken only from peers something here names (admit_messages).
        self.check_message_peers = check_message_peers
        self.refused_connections = 0  # connections closed: nothing here names their peer (at their address)
        self.dropped_messages = 0  # messages on an admitted connection from a peer no longer named
        self._resolved: dict[str, tuple[float, frozenset[str]]] = {}
        # Emulation without root (tests): block data leaves at most at this rate, paced in process.
        self._egress = make_pacer(egress_mbit)
        self.unsent_limit_bytes = unsent_limit_bytes
        self.congestion_control = congestion_control
        self._warned_congestion = False
        self.connect_timeout_s = connect_timeout_s
        self.unknown_op_wait_s = unknown_op_wait_s
        self._listener = socket.create_server((host, port), backlog=128, reuse_port=False)
        bound_host, bound_port = self._listener.getsockname()[:2]
        self._address = f"{advertise_host or bound_host}:{bound_port}"
        self._pool: dict[tuple[str, f.ConnClass], _Conn] = {}
        self._pool_lock = threading.Lock()
        self._accepted: set[socket.socket] = set()
        self._closed = False
        self._accept_thread = threading.Thread(target=self._accept_loop, name=f"tcp-accept-{node_id}", daemon=True)
        self._accept_thread.start()

    @property
    def address(self) -> str:
        return self._address

    # --- sending ---------------------------------------------------------------------------------
    def _conn(self, peer: str, address: str, conn_class: f.ConnClass) -> _Conn:
        key = (address, conn_class)
        with self._pool_lock:
            conn = self._pool.get(key)
            if conn is not None and not conn.broken:
                return conn
        if self._closed:
            raise TransferError(f"{self.node_id}: transport is closed")
        try:
            sock = socket.create_connection(split_address(address), timeout=self.connect_timeout_s)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if conn_class == f.ConnClass.BULK:
                # Keep little unsent data in the kernel: a send "returns" when its bytes are on the
                # wire, not parked in a deep socket buffer while the next send (to another peer)
                # starts. Otherwise a node feeds several peers at once and every block of a
                # schedule arrives late (the schedules assume one send at a time per node).
                sock.setsockopt(socket.IPPROTO_TCP, TCP_NOTSENT_LOWAT, self.unsent_limit_bytes)
                self._set_congestion_control(sock)
            _send_all(sock, [f.encode_hello(conn_class, self.node_id)])
        except OSError as e:
            if not self._closed:
                self.peer_lost(peer, f"connect to {address} failed: {e}")
            raise TransferError(f"{self.node_id}: cannot connect to {peer} at {address}: {e}") from e
        conn = _Conn(sock)
        with self._pool_lock:
            old = self._pool.get(key)
            if old is not None and not old.broken:  # another thread won the race: use its connection
                sock.close()
                return old
            self._pool[key] = conn
        return conn

    def _set_congestion_control(self, sock: socket.socket) -> None:
        """Bulk connections use a loss-based congestion control (cubic by default).

        Schedules run in near lock-step: each step waits for the slowest transfer of the
        step before, so per-transfer jitter adds up over the steps. BBR's periodic probing
        (pacing-gain cycles, ProbeRTT's cwnd cut) makes block times jitter on a shaped
        link, so a pipeline ends further from its bound with BBR than with cubic.
        Where the kernel does not offer or allow it, the system default stays.
        """
        if not self.congestion_control:
            return
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, self.congestion_control.encode())
        except OSError as e:
            if not self._warned_congestion:
                self._warned_congestion = True
                log.info("%s: congestion control %r unavailable (%s); using the system default",
                         self.node_id, self.congestion_control, e)

    def _drop(self, address: str, conn_class: f.ConnClass, conn: _Conn) -> None:
        conn.broken = True
        with self._pool_lock:
            if self._pool.get((address, conn_class)) is conn:
                del self._pool[(address, conn_class)]
        try:
            conn.sock.close()
        except OSError:
            pass

    def _send_frame(self, peer: str, address: str, conn_class: f.ConnClass, buffers: list,
                    timeout_s: float | None) -> None:
        conn = self._conn(peer, address, conn_class)
        try:
            with conn.lock:
                if conn.broken:
                    raise OSError("connection was closed")
                conn.sock.settimeout(timeout_s)
                _send_all(conn.sock, buffers)
        except OSError as e:
            self._drop(address, conn_class, conn)
            if not self._closed:
                self.peer_lost(peer, f"send to {address} failed: {e}")
            raise TransferError(f"{self.node_id}: sending to {peer} at {address} failed: {e}") from e

    def _stream_block(self, peer: str, address: str, op_id: str, slot: BlockSlot, chunk_bytes: int,
                      cancelled: Callable[[], bool] | None, stall_timeout_s: float) -> None:
        offset = 0
        while offset < slot.nbytes:
            # Cut-through: send what is in place now (up to a chunk) rather than waiting for a full chunk.
            filled = slot.wait_filled(offset + 1, timeout=stall_timeout_s, cancelled=cancelled)
            length = min(chunk_bytes, filled - offset)
            header = f.encode_data(f.DataHeader(op_id, slot.block_id, offset, length, slot.nbytes))
            if self._egress is not None:
                self._egress.pace(length)  # the bytes land when a link of that rate would have carried them
            self._send_frame(peer, address, f.ConnClass.BULK, [header, slot.view[offset:offset + length]],
                             stall_timeout_s)
            offset += length

    def send_message(self, peer: str, address: str, channel: str, payload: bytes) -> None:
        header = f.encode_message(channel, len(payload))
        self._send_frame(peer, address, f.ConnClass.MESSAGE, [header, payload], self.connect_timeout_s)

    # --- receiving --------------------------------------------------------------------------------
    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                sock, _ = self._listener.accept()
            except OSError:
                if self._closed:
                    return
                time.sleep(0.05)
                continue
            with self._pool_lock:
                if self._closed:
                    sock.close()
                    return
                self._accepted.add(sock)
            threading.Thread(target=self._serve, args=(sock,), name=f"tcp-recv-{self.node_id}", daemon=True).start()

    def _ips(self, address: str) -> frozenset[str]:
        """The IPs `address` ("host:port" from a plan) stands for; a name is resolved (cached briefly)."""
        host = split_address(address)[0]
        try:
            ipaddress.ip_address(host)
            return frozenset({_normal_ip(host)})
        except ValueError:
            pass
        now = time.monotonic()
        cached = self._resolved.get(host)
        if cached is not None and now - cached[0] < RESOLVE_TTL_S:
            return cached[1]
        try:
            ips = frozenset(_normal_ip(info[4][0]) for info in socket.getaddrinfo(host, None))
        except OSError as e:
            log.warning("%s: cannot resolve data-plane peer %s: %s", self.node_id, host, e)
            ips = frozenset()
        self._resolved[host] = (now, ips)
        return ips

    def _from_plan_address(self, remote_ip: str):
        """accept(address) for Transport.named_source / expected_slot: the bytes come from `remote_ip`."""
        if not self.check_peer_hosts:
            return lambda address: True
        return lambda address: address is None or remote_ip in self._ips(address)

    def _serve(self, sock: socket.socket) -> None:
        src = "<unknown>"
        admitted = False
        conn_class = None
        ended = "closed the connection"
        try:
            remote_ip = _normal_ip(sock.getpeername()[0])
            fixed = _recv_exact(sock, f.HELLO_FIXED)
            if fixed is None:
                return
            conn_class, n = f.decode_hello_fixed(fixed)
            src = f.decode_name(_recv_header(sock, n), "node id")
            accept = self._from_plan_address(remote_ip)
            if conn_class == f.ConnClass.BULK and not self.named_source(src, accept, self.unknown_op_wait_s):
                self.refused_connections += 1
                log.warning("%s: refused a data-plane connection from %s claiming to be %s: no operation here "
                            "expects bytes from %s at that address", self.node_id, remote_ip, src, src)
                return
            if (conn_class == f.ConnClass.MESSAGE and self.check_message_peers
                    and not self.message_source(src, accept, self.unknown_op_wait_s)):
                self.refused_connections += 1
                log.warning("%s: refused a message connection from %s claiming to be %s: no plan, pipeline or "
                            "live pair here names %s at that address", self.node_id, remote_ip, src, src)
                return
            admitted = True
            if conn_class == f.ConnClass.MESSAGE:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            while True:
                kind_raw = _recv_exact(sock, f.KIND_SIZE)
                if kind_raw is None:
                    break  # clean close between frames
                kind = f.decode_kind(kind_raw)
                if kind == f.FrameKind.DATA:
                    self._receive_data(sock, src, accept)
                else:
                    self._receive_message(sock, src, accept)
        except (OSError, ConnectionError, f.FrameError, TransferError) as e:
            ended = f"connection ended: {e}"
            if not self._closed:
                log.warning("%s: data-plane connection from %s ended: %s", self.node_id, src, e)
        finally:
            with self._pool_lock:
                self._accepted.discard(sock)
            sock.close()
            if not self._closed and admitted and conn_class == f.ConnClass.BULK:
                # Whatever this peer still owed us will not come on this connection. (Only an admitted
                # bulk connection: whoever merely claims a name must not break that peer's transfers.)
                self.fail_from(src, TransferError(f"connection from {src} closed"))
            if not self._closed and admitted:
                # A peer that died closes (or resets) every connection at once: said now, it is
                # known dead long before its heartbeats expire. (A live peer that merely dropped
                # one is found alive by the registry's own check.)
                self.peer_lost(src, f"its {conn_class.name.lower()} connection: {ended}")

    def _receive_data(self, sock: socket.socket, src: str, accept=None) -> None:
        op_len, block, offset, length, total = f.decode_data_fixed(_recv_header(sock, f.DATA_FIXED))
        op_id = f.decode_name(_recv_header(sock, op_len), "op id")
        slot = self.expected_slot(op_id, block, src, self.unknown_op_wait_s, accept)
        if slot is None or slot.error is not None:
            # The operation already ended or failed here: drop the bytes to keep the stream in frame.
            self._drain(sock, length)
            return
        if total != slot.nbytes:
            err = TransferError(f"op {op_id} block {block}: {src} sends {total} bytes, expected {slot.nbytes}")
            slot.fail(err)
            raise err
        # Until admitted, leave the bytes in the socket: TCP back-pressure holds the sender, so the
        # link carries the blocks this node needs first instead of sharing it among several.
        slot.wait_admitted()
        if slot.error is not None:
            self._drain(sock, length)
            return
        try:
            into = slot.writable(offset, length)
        except TransferError as e:
            slot.fail(e)
            raise
        try:
            _recv_into(sock, into, slot.bytes_landing)  # a frame is a chunk (~1 MiB): stamp its start
        except (OSError, ConnectionError) as e:
            slot.fail(TransferError(f"op {op_id} block {block}: stream from {src} broke at "
                                    f"{offset}/{total} bytes: {e}"))
            raise
        slot.advance(length)

    def _receive_message(self, sock: socket.socket, src: str, accept=None) -> None:
        ch_len, length = f.decode_message_fixed(_recv_header(sock, f.MESSAGE_FIXED))
        channel = f.decode_name(_recv_header(sock, ch_len), "channel")
        payload = _recv_payload(sock, length)
        if channel == ABORT_CHANNEL and accept is not None and not self._abort_from_plan(src, payload, accept):
            log.warning("%s: dropped an abort claiming to be from %s, sent from elsewhere than its address in "
                        "the plan", self.node_id, src)
            return
        if (self.check_message_peers and accept is not None
                and not self.message_source(src, accept, self.unknown_op_wait_s)):
            # Admitted once, no longer named (its pipeline, pair or transfer ended here).
            self.dropped_messages += 1
            log.warning("%s: dropped a message on %r from %s: nothing here names it now", self.node_id, channel, src)
            return
        self.dispatch(src, channel, payload)

    def _abort_from_plan(self, src: str, payload: bytes, accept) -> bool:
        """Whether an abort comes from where the op's plan says `src` is (it fails that op's blocks)."""
        try:
            op_id = str(json.loads(payload)["op_id"])
        except (ValueError, KeyError, TypeError):
            return True  # malformed: the handler drops it
        with self._expected_changed:
            address = self._source_addresses.get((op_id, src))
        return accept(address)

    @staticmethod
    def _drain(sock: socket.socket, length: int) -> None:
        scratch = memoryview(bytearray(min(length, DRAIN_CHUNK)))
        while length:
            n = min(length, len(scratch))
            _recv_into(sock, scratch[:n])
            length -= n

    # --- lifecycle ------------------------------------------------------------------------------------------
    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._listener.close()
        with self._pool_lock:
            conns = list(self._pool.values())
            self._pool.clear()
            accepted = list(self._accepted)
        for conn in conns:
            conn.broken = True
            conn.sock.close()
        for sock in accepted:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self.fail_all(TransferError(f"{self.node_id}: transport closed"))
