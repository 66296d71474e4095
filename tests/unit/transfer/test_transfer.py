"""The data plane on loopback: frames, block slots, the TCP transport and the plan executor.

Real sockets throughout; the emulated-cluster runs (namespaces, rate caps) are in
test_multicast_emulated.py.
"""

import socket
import subprocess
import sys
import textwrap
import threading
import time
import zlib

import pytest
import torch

from libs.planning.multicast import (
    binary_tree_schedule,
    binomial_schedule,
    chain_schedule,
    kway_schedule,
    kway_subgroups,
    node_parts,
    star_schedule,
)
from libs.transfer.tcp import frames as f
from libs.transfer.base import BlockSlot, TransferError
from libs.transfer.executor import Hop, PartRun, hops_of, run_part
from libs.transfer.tcp.transport import TcpTransport


# --- frames ----------------------------------------------------------------------------------------


def test_data_frame_round_trip():
    h = f.DataHeader("op-1", 7, 4096, 1 << 20, 16 << 20)
    raw = f.encode_data(h)
    assert f.decode_kind(raw[: f.KIND_SIZE]) == f.FrameKind.DATA
    op_len, block, offset, length, total = f.decode_data_fixed(raw[f.KIND_SIZE: f.KIND_SIZE + f.DATA_FIXED])
    assert raw[f.KIND_SIZE + f.DATA_FIXED:].decode() == "op-1"
    assert (op_len, block, offset, length, total) == (4, 7, 4096, 1 << 20, 16 << 20)


def test_hello_and_message_round_trip():
    raw = f.encode_hello(f.ConnClass.MESSAGE, "worker-3")
    cls, n = f.decode_hello_fixed(raw[: f.HELLO_FIXED])
    assert cls == f.ConnClass.MESSAGE and raw[f.HELLO_FIXED:].decode() == "worker-3" and n == 8
    msg = f.encode_message("activations", 123)
    assert f.decode_message_fixed(msg[f.KIND_SIZE: f.KIND_SIZE + f.MESSAGE_FIXED]) == (11, 123)


@pytest.mark.parametrize("bad", [
    lambda: f.decode_hello_fixed(b"HTTP" + b"\x00\x00\x01"),
    lambda: f.decode_hello_fixed(f.MAGIC + b"\x07\x00\x01"),
    lambda: f.decode_kind(b"\x09"),
    lambda: f.encode_data(f.DataHeader("op", 0, 10, 10, 15)),
    lambda: f.encode_data(f.DataHeader("", 0, 0, 1, 1)),
    lambda: f.decode_data_fixed(f.encode_data(f.DataHeader("op", 0, 0, 1, 1))[1:1 + f.DATA_FIXED][:-8]
                                + (0).to_bytes(8, "big")),
    lambda: f.encode_message("ch", f.MAX_MESSAGE + 1),
])
def test_malformed_frames_are_rejected(bad):
    with pytest.raises(f.FrameError):
        bad()


# --- slots -------------------------------------------------------------------------------------------


def test_slot_fills_in_order_with_a_running_checksum():
    data = bytes(range(256)) * 40
    slot = BlockSlot(3, bytearray(len(data)))
    with pytest.raises(TransferError, match="offset 100"):
        slot.writable(100, 10)
    for start in range(0, len(data), 1000):
        chunk = data[start:start + 1000]
        slot.writable(start, len(chunk))[:] = chunk
        slot.advance(len(chunk))
    assert slot.complete and bytes(slot.view) == data and slot.crc == zlib.crc32(data)
    with pytest.raises(TransferError, match="overrun"):
        slot.writable(len(data), 1)


def test_slot_failure_wakes_waiters():
    slot = BlockSlot(0, bytearray(10))
    seen: list = []
    slot.on_done(seen.append)
    threading.Timer(0.05, slot.fail, args=(TransferError("peer lost"),)).start()
    with pytest.raises(TransferError, match="peer lost"):
        slot.wait_filled(10, timeout=5)
    assert seen == [slot]
    with pytest.raises(TransferError, match="no bytes"):
        BlockSlot(1, bytearray(4)).wait_filled(1, timeout=0.05)


# --- executor over real sockets ------------------------------------------------------------------------


def _blocks(n_blocks: int, nbytes: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    # Uneven sizes: the last block is shorter, as real models' are.
    return [torch.randint(0, 256, (nbytes - (b == n_blocks - 1) * 777,), dtype=torch.uint8, generator=g)
            for b in range(n_blocks)]


def _run_schedule(schedule, n_nodes: int, data: list[torch.Tensor], sources=(0,), chunk_bytes: int = 64 << 10):
    """Every node on its own transport and thread; returns each node's slots and arrival order."""
    names = [f"n{i}" for i in range(n_nodes)]
    transports = [TcpTransport(n) for n in names]
    peers = {n: t.address for n, t in zip(names, transports)}
    crcs = {b: zlib.crc32(d.numpy()) for b, d in enumerate(data)}
    parts = node_parts(schedule, n_nodes)
    slots: dict[int, dict[int, BlockSlot]] = {}
    announced: dict[int, list[int]] = {i: [] for i in range(n_nodes)}
    errors: list[BaseException] = []
    runs = []
    for i in range(n_nodes):
        slots[i] = {b: BlockSlot(b, d.clone(), complete=True) if i in sources else
                    BlockSlot(b, torch.empty_like(d)) for b, d in enumerate(data)}
        runs.append(PartRun(transports[i], "op", slots=slots[i], sends=hops_of(parts[i].sends, names, True),
                            receives=hops_of(parts[i].receives, names, False), peers=peers, checksums=crcs,
                            on_block=lambda b, _s, i=i: announced[i].append(b), chunk_bytes=chunk_bytes,
                            stall_timeout_s=20))

    def go(run):
        try:
            run.run()
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=go, args=(r,)) for r in runs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for t in transports:
        t.close()
    assert not errors, errors
    return slots, announced


SCHEDULES = {
    "star": lambda n, b: star_schedule(n, b),
    "binary-tree": lambda n, b: binary_tree_schedule(n, b),
    "chain": lambda n, b: chain_schedule([list(range(n))], b),
    "binomial": lambda n, b: binomial_schedule(n, b),
}


@pytest.mark.parametrize("n_nodes", [2, 3, 5, 8])
@pytest.mark.parametrize("algorithm", sorted(SCHEDULES))
def test_every_algorithm_delivers_identical_blocks(algorithm, n_nodes):
    data = _blocks(6, 200_003)
    slots, announced = _run_schedule(SCHEDULES[algorithm](n_nodes, 6), n_nodes, data)
    for node in range(1, n_nodes):
        assert sorted(announced[node]) == list(range(6))
        for b, d in enumerate(data):
            assert torch.equal(slots[node][b].buffer, d), (node, b)


@pytest.mark.parametrize("n_nodes,k", [(5, 2), (8, 2), (8, 4)])
def test_kway_and_multi_chain_plans_deliver(n_nodes, k):
    data = _blocks(8, 50_000, seed=k)
    sources = tuple(range(k))
    slots, _ = _run_schedule(kway_schedule(n_nodes, 8, k), n_nodes, data, sources)
    chains = [[i, *g] for i, g in enumerate(kway_subgroups(n_nodes, k))]
    slots2, _ = _run_schedule(chain_schedule(chains, 8), n_nodes, data, sources)
    for s in (slots, slots2):
        for node in range(k, n_nodes):
            assert all(torch.equal(s[node][b].buffer, d) for b, d in enumerate(data))


def test_relay_forwards_while_it_receives():
    """Cut-through: the chain's last node has bytes of a block before the relay has all of it."""
    with TcpTransport("a") as a, TcpTransport("b") as b, TcpTransport("c") as c:
        total = 4 << 20
        src = BlockSlot(0, bytearray(total))
        mid, end = BlockSlot(0, bytearray(total)), BlockSlot(0, bytearray(total))
        b.expect("op", 0, "a", mid)
        c.expect("op", 0, "b", end)
        relay = threading.Thread(target=b.send_block, args=("c", c.address, "op", mid, 64 << 10))
        relay.start()
        sender = threading.Thread(target=a.send_block, args=("b", b.address, "op", src, 64 << 10))
        src.filled = 0  # the source itself is still loading: feed it slowly
        sender.start()
        for off in range(0, total // 2, 256 << 10):
            src.writable(off, 256 << 10)
            src.advance(256 << 10)
            time.sleep(0.005)
        end.wait_filled(1 << 20, timeout=10)
        assert end.filled < total and not mid.complete  # c is already receiving; b is not done
        src.writable(total // 2, total // 2)
        src.advance(total // 2)
        end.wait_filled(total, timeout=10)
        sender.join(10)
        relay.join(10)
        assert end.crc == zlib.crc32(bytes(total))


def test_corrupt_block_fails_every_receiver_and_is_never_announced():
    data = _blocks(3, 100_000)
    crcs = {b: zlib.crc32(d.numpy()) for b, d in enumerate(data)}
    crcs[1] ^= 1  # what the plan promises differs from the bytes sent
    names = ["s", "r1", "r2"]
    ts = [TcpTransport(n) for n in names]
    peers = {n: t.address for n, t in zip(names, ts)}
    parts = node_parts(chain_schedule([[0, 1, 2]], 3), 3)
    announced: dict[int, list[int]] = {1: [], 2: []}
    errors: dict[int, BaseException] = {}

    def go(i):
        slots = {b: BlockSlot(b, d.clone(), complete=(i == 0)) for b, d in enumerate(data)}
        try:
            run_part(ts[i], "op", slots=slots, sends=hops_of(parts[i].sends, names, True),
                     receives=hops_of(parts[i].receives, names, False), peers=peers, checksums=crcs,
                     on_block=lambda b, _s: announced[i].append(b) if i else None, stall_timeout_s=30)
        except TransferError as e:
            errors[i] = e

    t0 = time.monotonic()
    threads = [threading.Thread(target=go, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    for t in ts:
        t.close()
    assert time.monotonic() - t0 < 10  # told at once, not after the 30 s stall timeout
    assert set(errors) >= {1, 2}
    assert "corrupt" in str(errors[1]) and ("corrupt" in str(errors[2]) or "aborted" in str(errors[2]))
    assert 1 not in announced[1] and 1 not in announced[2]


PEER_SCRIPT = textwrap.dedent("""
    import sys, time
    from libs.transfer.base import BlockSlot
    from libs.transfer.tcp.transport import TcpTransport
    address = sys.argv[1]
    t = TcpTransport("relay")
    slot = BlockSlot(0, bytearray(8 << 20))
    slot.writable(0, 3 << 20); slot.advance(3 << 20)  # holds only part of the block
    print("ready", flush=True)
    t.send_block("sink", address, "op", slot, 1 << 20, stall_timeout_s=600)  # blocks until killed
""")


def test_peer_killed_mid_block_is_an_error_not_a_short_block():
    with TcpTransport("sink") as sink:
        slot = BlockSlot(0, bytearray(8 << 20))
        announced: list[int] = []
        run = PartRun(sink, "op", slots={0: slot}, sends=[], receives=[Hop(0, "relay", 0)], peers={"relay": "127.0.0.1:1"},
                      checksums={0: 0}, on_block=lambda b, _s: announced.append(b), stall_timeout_s=60)
        proc = subprocess.Popen([sys.executable, "-c", PEER_SCRIPT, sink.address], stdout=subprocess.PIPE)
        try:
            assert proc.stdout.readline().strip() == b"ready"
            slot.wait_filled(3 << 20, timeout=20)
            proc.kill()
            t0 = time.monotonic()
            with pytest.raises(TransferError, match="relay"):
                run.run()
            assert time.monotonic() - t0 < 10
        finally:
            proc.kill()
            proc.wait()
        assert announced == [] and not slot.complete and slot.filled == 3 << 20


def test_stalled_sender_times_out():
    with TcpTransport("r") as r:
        slot = BlockSlot(0, bytearray(100))
        with pytest.raises(TransferError, match="no progress"):
            run_part(r, "op", slots={0: slot}, sends=[], receives=[Hop(0, "ghost", 0)], peers={"ghost": "127.0.0.1:1"},
                     stall_timeout_s=0.5)


def test_sending_a_block_never_held_is_refused_up_front():
    with TcpTransport("n") as t:
        with pytest.raises(ValueError, match="never holds"):
            run_part(t, "op", slots={0: BlockSlot(0, bytearray(10))}, sends=[Hop(0, "m", 0)], receives=[],
                     peers={"m": "127.0.0.1:1"})


def test_small_messages_do_not_wait_behind_bulk_bytes():
    with TcpTransport("a") as a, TcpTransport("b", unknown_op_wait_s=30) as b:
        got = threading.Event()
        b.on_message("activations", lambda src, payload: got.set() if (src, payload) == ("a", b"x" * 1000) else None)
        b.admit_messages("a", a.address)
        # b does not expect this op yet: its bulk reader holds the stream (back-pressure), the link is busy.
        big = BlockSlot(0, bytearray(32 << 20), complete=True)
        bulk = threading.Thread(target=a.send_block, args=("b", b.address, "late-op", big), daemon=True)
        bulk.start()
        time.sleep(0.3)
        assert bulk.is_alive()  # stuck behind back-pressure
        t0 = time.monotonic()
        a.send_message("b", b.address, "activations", b"x" * 1000)
        assert got.wait(5) and time.monotonic() - t0 < 1.0
        sink = BlockSlot(0, bytearray(32 << 20))
        b.expect("late-op", 0, "a", sink)  # the plan arrives: the bulk stream resumes
        sink.wait_filled(32 << 20, timeout=20)
        bulk.join(20)


def test_connections_are_pooled_and_reused():
    with TcpTransport("a") as a, TcpTransport("b") as b:
        for op in ("op1", "op2", "op3"):
            sink = BlockSlot(0, bytearray(1000))
            b.expect(op, 0, "a", sink)
            a.send_block("b", b.address, op, BlockSlot(0, bytearray(b"z" * 1000), complete=True))
            sink.wait_filled(1000, timeout=5)
        assert len(a._pool) == 1 and len(b._accepted) == 1


def test_garbage_on_the_data_port_does_not_hurt_the_transport():
    with TcpTransport("a") as a, TcpTransport("b") as b:
        host, port = b.address.rsplit(":", 1)
        with socket.create_connection((host, int(port))) as s:
            s.sendall(b"GET / HTTP/1.1\r\n\r\n")
        with socket.create_connection((host, int(port))) as s:  # valid hello, then a bad frame kind
            s.sendall(f.encode_hello(f.ConnClass.BULK, "mallory") + b"\x7f" * 16)
        sink = BlockSlot(0, bytearray(5000))
        b.expect("op", 0, "a", sink)
        a.send_block("b", b.address, "op", BlockSlot(0, bytearray(b"q" * 5000), complete=True))
        sink.wait_filled(5000, timeout=5)


def test_bytes_from_the_wrong_peer_are_refused():
    with TcpTransport("a") as a, TcpTransport("b") as b:
        sink = BlockSlot(0, bytearray(1000))
        b.expect("op", 0, "someone-else", sink)
        a.send_block("b", b.address, "op", BlockSlot(0, bytearray(1000), complete=True))
        time.sleep(0.3)
        assert sink.filled == 0


def test_first_byte_is_stamped_when_a_frame_starts_landing_not_when_it_is_complete():
    # A frame is a ~1 MiB chunk (21 ms at 400 Mbit/s): "first byte" is its first bytes landing.
    from libs.transfer.tcp.transport import _recv_into

    sender, receiver = socket.socketpair()
    with sender, receiver:
        slot = BlockSlot(0, bytearray(8))
        reader = threading.Thread(target=_recv_into, args=(receiver, slot.writable(0, 8), slot.bytes_landing))
        reader.start()
        sender.sendall(b"1234")
        deadline = time.monotonic() + 5
        while slot.first_byte_at is None and time.monotonic() < deadline:
            time.sleep(0.01)
        stamped = slot.first_byte_at
        assert stamped is not None and reader.is_alive() and slot.filled == 0  # the frame is not in yet
        sender.sendall(b"5678")
        reader.join(5)
        slot.advance(8)
        assert slot.complete and slot.first_byte_at == stamped
