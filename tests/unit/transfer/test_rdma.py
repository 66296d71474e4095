"""RDMA transport: pure logic without pyverbs, the protocol over a fake verbs layer, and a hardware test.

The fake verbs layer below stands in for pyverbs with the same classes and calls
the transport uses; its queue pairs execute WRITE/READ/SEND by memmove between
registered regions and post completions to completion queues, so connection
set-up, grants, immediates, READ pulls, fragmentation and failures run for real.
The hardware test runs the same scenarios on a device and skips with
rdma_available()'s reason where there is none.
"""

from __future__ import annotations

import ctypes
import itertools
import json
import os
import subprocess
import sys
import threading
import time
import zlib
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from libs.transfer.base import BlockSlot, TransferError
from libs.transfer.rdma import verbs
from libs.transfer.rdma.codec import (
    MAX_TOKENS,
    MAX_UNITS,
    ConnectionInfo,
    FrameAssembler,
    RdmaProtocolError,
    decode_connection_info,
    decode_imm,
    encode_connection_info,
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
    validate_control,
)
from libs.transfer.rdma.memory import MrCache, buffer_address
from libs.transfer.rdma.transport import RdmaTransport
from libs.transfer.rdma.verbs import rdma_available

REPO = Path(__file__).resolve().parents[3]


# ======================================================================================
# Pure logic
# ======================================================================================

def test_granule_keeps_every_end_offset_inside_the_immediate():
    assert imm_granule(0) == 1 and imm_granule(MAX_UNITS - 1) == 1
    assert imm_granule(MAX_UNITS) == 2
    for nbytes in (1, 4095, 1 << 20, (1 << 30) + 3, 80 << 30):
        g = imm_granule(nbytes)
        assert g & (g - 1) == 0  # a power of two
        assert -(-nbytes // g) < MAX_UNITS
        assert g == 1 or -(-nbytes // (g // 2)) >= MAX_UNITS  # and the smallest such
    with pytest.raises(ValueError):
        imm_granule(-1)


def test_write_spans_send_what_is_in_place_up_to_a_chunk():
    # all there: a chunk at a time, the last span short
    assert next_write_end(0, 1000, 1000, 256, 1) == 256
    assert next_write_end(768, 1000, 1000, 256, 1) == 1000
    # partly there: what is in place, cut back to the granule
    assert next_write_end(0, 300, 1000, 256, 1) == 256
    assert next_write_end(256, 300, 1000, 256, 16) == 288
    assert next_write_end(256, 270, 1000, 256, 16) == 256  # less than a granule in place: nothing yet
    # the end of the block need not sit on a granule
    assert next_write_end(992, 1001, 1001, 256, 16) == 1001
    # spans from any fill sequence tile the block and end where the immediate can name them
    nbytes, chunk, g = 10_000, 1024, 64
    offset, ends = 0, []
    for filled in (1, 63, 64, 500, 3000, 3001, 9999, 10_000, 10_000, 10_000, 10_000, 10_000, 10_000, 10_000):
        end = next_write_end(offset, max(filled, offset), nbytes, chunk, g)
        if end > offset:
            assert end - offset <= chunk and (end % g == 0 or end == nbytes)
            assert imm_end_offset(-(-end // g), g, nbytes) == end
            ends.append(end)
            offset = end
    assert offset == nbytes and ends == sorted(set(ends))
    with pytest.raises(ValueError):
        next_write_end(0, 10, 100, 8, 16)  # a chunk smaller than the granule
    with pytest.raises(ValueError):
        next_write_end(50, 10, 100, 32, 1)


def test_work_requests_respect_the_max_message_size():
    wrs = split_work_requests(1000, 10_000, 4096)
    assert wrs == [(1000, 4096), (5096, 4096), (9192, 1808)]
    assert split_work_requests(0, 4096, 4096) == [(0, 4096)]
    assert split_work_requests(5, 0, 4096) == []
    with pytest.raises(ValueError):
        split_work_requests(0, 10, 0)
    with pytest.raises(ValueError):
        split_work_requests(-1, 10, 4)


def test_immediate_round_trip_and_bounds():
    for token, units in [(0, 0), (1, 2), (MAX_TOKENS - 1, MAX_UNITS - 1), (1234, 98765)]:
        imm = encode_imm(token, units)
        assert 0 <= imm < 1 << 32
        assert decode_imm(imm) == (token, units)
    with pytest.raises(ValueError):
        encode_imm(MAX_TOKENS, 0)
    with pytest.raises(ValueError):
        encode_imm(0, MAX_UNITS)
    with pytest.raises(ValueError):
        decode_imm(1 << 32)


def test_mtu_conversion():
    assert mtu_to_enum(4096) == 5 and mtu_from_enum(5) == 4096
    assert [mtu_from_enum(mtu_to_enum(m)) for m in (256, 512, 1024, 2048, 4096)] == [256, 512, 1024, 2048, 4096]
    with pytest.raises(ValueError):
        mtu_to_enum(1500)
    with pytest.raises(ValueError):
        mtu_from_enum(9)


def _info(**over) -> dict:
    d = ConnectionInfo(node="w1", lid=7, gid="fe80:0000:0000:0000:0000:0000:0000:0001", mtu=4096,
                       max_msg=1 << 30, bulk_qpn=0x1234, bulk_psn=0xABCDE, ctrl_qpn=0x1235, ctrl_psn=1).to_dict()
    d.update(over)
    return d


def test_connection_info_round_trip_is_json_safe():
    info = decode_connection_info(_info())
    d = encode_connection_info(info)
    assert json.loads(json.dumps(d)) == d
    assert decode_connection_info(json.loads(json.dumps(d))) == info
    # GIDs compare in one case
    assert decode_connection_info(_info(gid="FE80:0000:0000:0000:0000:0000:0000:00AB")).gid.endswith("00ab")


@pytest.mark.parametrize("over, needle", [
    ({"lid": "7"}, "'lid' must be an integer"),
    ({"lid": 70000}, "'lid' = 70000 outside"),
    ({"bulk_qpn": True}, "'bulk_qpn' must be an integer"),
    ({"bulk_qpn": 0}, "'bulk_qpn' = 0 outside"),
    ({"ctrl_psn": 1 << 24}, "'ctrl_psn'"),
    ({"gid": "fe80::1"}, "'gid'"),
    ({"mtu": 1500}, "'mtu' = 1500"),
    ({"v": 99}, "protocol version 99"),
    ({"node": ""}, "'node' is empty"),
])
def test_connection_info_rejects_malformed_fields(over, needle):
    with pytest.raises(RdmaProtocolError, match=needle):
        decode_connection_info(_info(**over))


def test_connection_info_names_a_missing_field_and_bad_types():
    d = _info()
    del d["ctrl_qpn"]
    with pytest.raises(RdmaProtocolError, match="'ctrl_qpn' is missing"):
        decode_connection_info(d)
    with pytest.raises(RdmaProtocolError, match="must be a dict"):
        decode_connection_info(["not", "a", "dict"])
    assert issubclass(RdmaProtocolError, TransferError)


def test_superseded_reply_is_recognised_and_not_connection_info():
    reply = superseded_reply("w0")
    assert is_superseded_reply(reply) and not is_superseded_reply(_info())
    with pytest.raises(RdmaProtocolError):
        decode_connection_info(reply)


def test_control_messages_validate():
    offer = make_control("offer", op="op", block=3, nbytes=10, chunk=4, granule=1, mode="read", addr=1 << 40,
                         rkey=5)
    assert validate_control(json.loads(json.dumps(offer))) == offer
    with pytest.raises(RdmaProtocolError, match="unknown control message type"):
        validate_control({"t": "nope"})
    with pytest.raises(RdmaProtocolError, match="'chunk' = 0"):
        make_control("offer", op="op", block=3, nbytes=10, chunk=0, granule=1, mode="write", addr=0, rkey=0)
    with pytest.raises(RdmaProtocolError, match="mode"):
        make_control("offer", op="op", block=3, nbytes=10, chunk=4, granule=1, mode="push", addr=0, rkey=0)
    with pytest.raises(RdmaProtocolError, match="'granule' is missing"):
        make_control("offer", op="op", block=3, nbytes=10, chunk=4, mode="write", addr=0, rkey=0)
    with pytest.raises(RdmaProtocolError, match="'ok' must be bool"):
        make_control("done", op="op", block=1, ok=1, reason="")
    with pytest.raises(RdmaProtocolError, match="'token'"):
        make_control("ready", op="op", block=1, token=MAX_TOKENS, addr=0, rkey=0)


def test_frames_round_trip_controls_and_fragmented_messages():
    asm = FrameAssembler()
    ctl = make_control("avail", op="o", block=2, upto=99)
    assert asm.feed(encode_control_frame(ctl)) == ("control", ctl)
    payload = bytes(range(256)) * 40  # 10 KiB over 1 KiB frames
    frames = fragment_message("acts", payload, frame_bytes=1024)
    assert len(frames) > 10 and all(len(f) <= 1024 for f in frames)
    results = [asm.feed(f) for f in frames]
    assert results[:-1] == [None] * (len(frames) - 1)
    assert results[-1] == ("message", ("acts", payload))
    # a control frame may sit between fragments; empty payloads are one frame
    frames = fragment_message("ch", b"x" * 3000, frame_bytes=1024)
    assert asm.feed(frames[0]) is None
    assert asm.feed(encode_control_frame(ctl)) == ("control", ctl)
    for f in frames[1:-1]:
        assert asm.feed(f) is None
    assert asm.feed(frames[-1]) == ("message", ("ch", b"x" * 3000))
    assert [asm.feed(f) for f in fragment_message("e", b"")] == [("message", ("e", b""))]


def test_frame_assembler_rejects_broken_streams():
    with pytest.raises(RdmaProtocolError, match="without a message"):
        FrameAssembler().feed(bytes([3, 0]) + b"abc")
    asm = FrameAssembler()
    asm.feed(fragment_message("a", b"y" * 3000, 1024)[0])
    with pytest.raises(RdmaProtocolError, match="before message"):
        asm.feed(fragment_message("b", b"z")[0])
    with pytest.raises(RdmaProtocolError, match="shorter than its header"):
        FrameAssembler().feed(b"\x01")
    with pytest.raises(RdmaProtocolError, match="unknown frame kind"):
        FrameAssembler().feed(b"\x09\x00")
    with pytest.raises(RdmaProtocolError, match="not JSON"):
        FrameAssembler().feed(b"\x01\x00{")
    with pytest.raises(RdmaProtocolError, match="never fragmented"):
        FrameAssembler().feed(b"\x01\x01{}")
    small = FrameAssembler(max_message_bytes=100)
    frames = fragment_message("a", b"q" * 500, 64)
    with pytest.raises(RdmaProtocolError, match="exceeds"):
        for f in frames:
            small.feed(f)
    with pytest.raises(ValueError):
        fragment_message("a-long-channel", b"x", frame_bytes=8)


def test_buffer_address_points_at_the_bytes():
    ba = bytearray(b"hello rdma")
    assert ctypes.string_at(buffer_address(memoryview(ba)), len(ba)) == b"hello rdma"
    ro = b"read-only bytes"
    assert ctypes.string_at(buffer_address(memoryview(ro)), len(ro)) == ro
    t = torch.arange(16, dtype=torch.uint8)
    slot = BlockSlot(0, t, complete=True)
    assert ctypes.string_at(buffer_address(slot.view), 16) == bytes(range(16))
    assert buffer_address(slot.view) == t.data_ptr()
    arr = np.arange(8, dtype=np.uint8)
    assert buffer_address(arr) == arr.ctypes.data


class _FakeHandle:
    keys = itertools.count(100)

    def __init__(self, addr, length, access):
        self.addr, self.length, self.access = addr, length, access
        self.lkey = self.rkey = next(self.keys)
        self.closed = False

    def close(self):
        assert not self.closed
        self.closed = True


def test_mr_cache_shares_registrations_and_closes_on_last_release():
    made = []

    def register(addr, length, access):
        made.append(_FakeHandle(addr, length, access))
        return made[-1]

    cache = MrCache(register)
    buf = bytearray(4096)
    full = cache.acquire(memoryview(buf), 7, owner=buf)
    again = cache.acquire(memoryview(buf), 1)  # a subset of the access: shared
    assert again is full and full.refs == 2 and len(made) == 1
    assert full.addr == buffer_address(memoryview(buf)) and full.owner is buf
    other = cache.acquire(memoryview(buf)[:100], 1)  # another span: its own registration
    assert other is not full and len(made) == 2
    assert cache.lookup(memoryview(buf), 2) is full and cache.lookup(memoryview(bytearray(8)), 0) is None
    cache.release(again)
    assert not made[0].closed
    cache.release(full)
    assert made[0].closed and full.owner is None
    assert len(cache) == 1
    narrow = cache.acquire(memoryview(buf), 4)
    wider = cache.acquire(memoryview(buf), 6)  # needs more than `narrow` has
    assert wider is not narrow and len(made) == 4
    cache.close_all()
    assert all(h.closed for h in made)
    with pytest.raises(TransferError, match="closed"):
        cache.acquire(memoryview(buf), 1)
    cache.release(narrow)  # after close: no double close


def test_mr_cache_reports_registration_failure():
    def register(addr, length, access):
        raise OSError("Cannot allocate memory")

    with pytest.raises(TransferError, match="Cannot allocate memory"):
        MrCache(register).acquire(memoryview(bytearray(10)), 1)
    with pytest.raises(ValueError):
        MrCache(register).acquire(memoryview(bytearray(0)), 1)


def test_rdma_available_without_pyverbs(monkeypatch):
    monkeypatch.setitem(sys.modules, "pyverbs", None)  # import pyverbs now fails as when not installed
    ok, reason = rdma_available()
    assert not ok and "pyverbs is not installed" in reason
    with pytest.raises(TransferError, match="pyverbs is not installed"):
        RdmaTransport("a", lambda peer, info: {})


def test_rdma_available_reasons_for_missing_devices(monkeypatch):
    def devices(listing):
        return lambda: SimpleNamespace(device=SimpleNamespace(get_device_list=listing))

    monkeypatch.setattr(verbs, "load_verbs", devices(lambda: []))
    ok, reason = rdma_available()
    assert not ok and "no RDMA device is present" in reason

    def failing():
        raise RuntimeError("Failed to get devices list")

    monkeypatch.setattr(verbs, "load_verbs", devices(failing))
    ok, reason = rdma_available()
    assert not ok and "Failed to get devices list" in reason

    monkeypatch.setattr(verbs, "load_verbs", devices(lambda: [SimpleNamespace(name=b"mlx5_0")]))
    assert rdma_available() == (True, "RDMA device(s): mlx5_0")
    ok, reason = rdma_available("mlx5_9")
    assert not ok and "'mlx5_9' not found (present: mlx5_0)" in reason


def test_rdma_available_reports_a_pyverbs_that_does_not_load(monkeypatch):
    def broken():
        raise TransferError(verbs._import_failure(ImportError("libibverbs.so.1: version `IBVERBS_PRIVATE_59' "
                                                              "not found")))

    monkeypatch.setattr(verbs, "load_verbs", broken)
    ok, reason = rdma_available()
    assert not ok and "does not load" in reason and "IBVERBS_PRIVATE_59" in reason


def test_module_imports_without_pyverbs():
    code = ("import sys; sys.modules['pyverbs'] = None\n"
            "import libs.transfer.rdma.transport\n"
            "from libs.transfer.rdma import rdma_available\n"
            "assert not any(m.startswith('pyverbs.') for m in sys.modules)\n"
            "print(rdma_available()[1])\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "pyverbs is not installed" in out.stdout


def test_codec_imports_and_runs_alone():
    """The wire codec needs neither pyverbs, torch nor the rest of the RDMA package."""
    code = ("import json, sys\n"
            "sys.modules['pyverbs'] = None; sys.modules['torch'] = None\n"
            "from libs.transfer.errors import TransferError\n"
            "from libs.transfer.rdma import codec\n"
            "frame = codec.encode_control_frame(codec.make_control('avail', op='op', block=1, upto=5))\n"
            "assert codec.FrameAssembler().feed(frame) == ('control', {'t': 'avail', 'op': 'op', 'block': 1, "
            "'upto': 5})\n"
            "assert issubclass(codec.RdmaProtocolError, TransferError)\n"
            "assert not any(m.startswith(('pyverbs.', 'torch.')) for m in sys.modules)\n"
            "print(json.dumps(sorted(m for m in sys.modules if m.startswith('libs.transfer.rdma.'))))\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr  # importing pyverbs or torch fails on their None placeholders
    assert json.loads(out.stdout) == ["libs.transfer.rdma.codec"]  # not the transport, verbs or memory


# ======================================================================================
# A fake verbs layer: the pyverbs surface the transport uses, backed by memmove
# ======================================================================================

E = SimpleNamespace(
    IBV_PORT_ACTIVE=4, IBV_QPT_RC=2, IBV_ACCESS_LOCAL_WRITE=1, IBV_ACCESS_REMOTE_WRITE=2,
    IBV_ACCESS_REMOTE_READ=4, IBV_WC_SUCCESS=0, IBV_WC_LOC_PROT_ERR=4, IBV_WC_WR_FLUSH_ERR=5,
    IBV_WC_REM_ACCESS_ERR=10, IBV_WC_RETRY_EXC_ERR=12, IBV_WC_SEND=0, IBV_WC_RDMA_WRITE=1,
    IBV_WC_RDMA_READ=2, IBV_WC_RECV=128, IBV_WC_RECV_RDMA_WITH_IMM=129, IBV_WR_RDMA_WRITE=0,
    IBV_WR_RDMA_WRITE_WITH_IMM=1, IBV_WR_SEND=2, IBV_WR_RDMA_READ=4, IBV_QPS_RESET=0, IBV_QPS_INIT=1,
    IBV_QPS_RTR=2, IBV_QPS_RTS=3, IBV_QPS_ERR=6, IBV_QP_STATE=1, IBV_LINK_LAYER_INFINIBAND=1,
    IBV_LINK_LAYER_ETHERNET=2,
)


class FakePyverbsError(Exception):
    pass


class _Bag:
    def __init__(self, **kw):
        self.__dict__.update(kw)


class FakeGID:
    def __init__(self, val=None):
        self.val = val or "0000:0000:0000:0000:0000:0000:0000:0000"

    def __str__(self):
        return self.val


class FakeSGE:
    def __init__(self, addr, length, lkey):
        self.addr, self.length, self.lkey = addr, length, lkey


class FakeSendWR:
    def __init__(self, wr_id=0, opcode=E.IBV_WR_SEND, num_sge=0, imm_data=0, sg=None, send_flags=2):
        if num_sge < 1 or not sg:
            raise FakePyverbsError("A WR needs at least one SGE")
        self.wr_id, self.opcode, self.sg, self.imm_data = wr_id, opcode, list(sg), imm_data
        self.rkey = self.remote_addr = None

    def set_wr_rdma(self, rkey, addr):
        self.rkey, self.remote_addr = rkey, addr


class FakeRecvWR:
    def __init__(self, wr_id=0, num_sge=0, sg=None):
        self.wr_id, self.sg = wr_id, list(sg or [])[:num_sge]


def _wc(wr_id, status, opcode, qp_num, byte_len=0, imm_data=0):
    return SimpleNamespace(wr_id=wr_id, status=status, opcode=opcode, qp_num=qp_num, byte_len=byte_len,
                           imm_data=imm_data, vendor_err=0)


class Fabric:
    """All fake devices of a test: QPs by number, MRs by key."""

    def __init__(self, max_msg=1 << 30):
        self.lock = threading.RLock()
        self.qps: dict[int, FakeQP] = {}
        self.mrs: dict[int, FakeMR] = {}
        self.qpns = itertools.count(0x100)
        self.keys = itertools.count(0x1000)
        self.lids = itertools.count(1)
        self.max_msg = max_msg
        self.posted: list[tuple[str, int]] = []  # (opcode name, length) of every RDMA WR

    def covers(self, key, addr, length, access):
        mr = self.mrs.get(key)
        return (mr is not None and mr.access & access == access and mr.addr <= addr
                and addr + length <= mr.addr + mr.length)


class FakeChannel:
    def __init__(self, ctx):
        self.fd, self._w = os.pipe()

    def notify(self):
        os.write(self._w, b"x")

    def get_cq_event(self, cq):
        try:
            os.read(self.fd, 1)
        except BlockingIOError:
            raise FakePyverbsError("Failed to get CQ event") from None
        cq.num_events += 1

    def close(self):
        if self._w is not None:
            os.close(self.fd)
            os.close(self._w)
            self._w = None


class FakeCQ:
    def __init__(self, ctx, cqe, cq_context=None, channel=None, comp_vector=0):
        self.entries: deque = deque()
        self.lock = threading.Lock()
        self.channel, self.armed, self.num_events = channel, False, 0

    def push(self, wc):
        with self.lock:
            self.entries.append(wc)
            fire, self.armed = self.armed, False
        if fire:
            self.channel.notify()

    def poll(self, num_entries=1):
        with self.lock:
            out = [self.entries.popleft() for _ in range(min(num_entries, len(self.entries)))]
        return len(out), out

    def req_notify(self, solicited_only=False):
        with self.lock:
            self.armed = True

    def ack_events(self, n):
        self.num_events -= n

    def close(self):
        pass


class FakeMR:
    def __init__(self, pd, length=0, access=0, address=None, **kw):
        self.fabric = pd.ctx.fabric
        if address is None:
            self._own = np.zeros(length, dtype=np.uint8)
            address = self._own.ctypes.data
        self.addr, self.length, self.access = address, length, access
        self.lkey = self.rkey = next(self.fabric.keys)
        self.fabric.mrs[self.lkey] = self

    def close(self):
        self.fabric.mrs.pop(self.lkey, None)


class FakeQP:
    def __init__(self, pd, init_attr, qp_attr=None):
        self.fabric = pd.ctx.fabric
        self.qp_num = next(self.fabric.qpns)
        self.cq = init_attr.scq
        self.access = qp_attr.qp_access_flags
        self.state = E.IBV_QPS_INIT
        self.recvs: deque = deque()
        self.inbound: deque = deque()  # arrived while no receive was posted (RNR retry)
        self.dest = None
        self.fabric.qps[self.qp_num] = self

    def to_rtr(self, attr):
        assert self.state == E.IBV_QPS_INIT and attr.dest_qp_num and attr.path_mtu
        self.dest, self.state = attr.dest_qp_num, E.IBV_QPS_RTR

    def to_rts(self, attr):
        assert self.state == E.IBV_QPS_RTR
        self.state = E.IBV_QPS_RTS

    def modify(self, attr, mask):
        assert mask == E.IBV_QP_STATE and attr.qp_state == E.IBV_QPS_ERR
        self.to_error()

    def to_error(self):
        with self.fabric.lock:
            if self.state == E.IBV_QPS_ERR:
                return
            self.state = E.IBV_QPS_ERR
            recvs, self.recvs = list(self.recvs), deque()
        for r in recvs:
            self.cq.push(_wc(r.wr_id, E.IBV_WC_WR_FLUSH_ERR, E.IBV_WC_RECV, self.qp_num))

    def post_recv(self, wr):
        with self.fabric.lock:
            if self.state == E.IBV_QPS_ERR:
                self.cq.push(_wc(wr.wr_id, E.IBV_WC_WR_FLUSH_ERR, E.IBV_WC_RECV, self.qp_num))
                return
            self.recvs.append(wr)
            while self.inbound and self.recvs:
                self._consume(*self.inbound.popleft())

    def _consume(self, opcode, data, imm):
        r = self.recvs.popleft()
        if data is not None:
            sge = r.sg[0]
            assert len(data) <= sge.length
            ctypes.memmove(sge.addr, data, len(data))
        self.cq.push(_wc(r.wr_id, E.IBV_WC_SUCCESS, opcode, self.qp_num, len(data or b""), imm))

    def _arrive(self, opcode, data, imm):
        if self.recvs:
            self._consume(opcode, data, imm)
        else:
            self.inbound.append((opcode, data, imm))

    def post_send(self, wr):
        f = self.fabric
        with f.lock:
            if self.state == E.IBV_QPS_ERR:
                self.cq.push(_wc(wr.wr_id, E.IBV_WC_WR_FLUSH_ERR, 0, self.qp_num))
                return
            if self.state != E.IBV_QPS_RTS:
                raise FakePyverbsError("Failed to post send (QP not in RTS)")
            sge = wr.sg[0]
            peer = f.qps.get(self.dest)

            def fail(status):
                self.cq.push(_wc(wr.wr_id, status, 0, self.qp_num))
                self.to_error()

            if peer is None or peer.state == E.IBV_QPS_ERR:
                return fail(E.IBV_WC_RETRY_EXC_ERR)
            if sge.length > f.max_msg:
                return fail(E.IBV_WC_LOC_PROT_ERR)
            if wr.opcode in (E.IBV_WR_RDMA_WRITE, E.IBV_WR_RDMA_WRITE_WITH_IMM):
                f.posted.append(("write_imm" if wr.opcode == E.IBV_WR_RDMA_WRITE_WITH_IMM else "write", sge.length))
                if not f.covers(sge.lkey, sge.addr, sge.length, 0):
                    return fail(E.IBV_WC_LOC_PROT_ERR)
                if not f.covers(wr.rkey, wr.remote_addr, sge.length, E.IBV_ACCESS_REMOTE_WRITE):
                    return fail(E.IBV_WC_REM_ACCESS_ERR)
                ctypes.memmove(wr.remote_addr, sge.addr, sge.length)
                if wr.opcode == E.IBV_WR_RDMA_WRITE_WITH_IMM:
                    peer._arrive(E.IBV_WC_RECV_RDMA_WITH_IMM, None, wr.imm_data)
                self.cq.push(_wc(wr.wr_id, E.IBV_WC_SUCCESS, E.IBV_WC_RDMA_WRITE, self.qp_num))
            elif wr.opcode == E.IBV_WR_RDMA_READ:
                f.posted.append(("read", sge.length))
                if not f.covers(sge.lkey, sge.addr, sge.length, E.IBV_ACCESS_LOCAL_WRITE):
                    return fail(E.IBV_WC_LOC_PROT_ERR)
                if not f.covers(wr.rkey, wr.remote_addr, sge.length, E.IBV_ACCESS_REMOTE_READ):
                    return fail(E.IBV_WC_REM_ACCESS_ERR)
                ctypes.memmove(sge.addr, wr.remote_addr, sge.length)
                self.cq.push(_wc(wr.wr_id, E.IBV_WC_SUCCESS, E.IBV_WC_RDMA_READ, self.qp_num))
            elif wr.opcode == E.IBV_WR_SEND:
                if not f.covers(sge.lkey, sge.addr, sge.length, 0):
                    return fail(E.IBV_WC_LOC_PROT_ERR)
                peer._arrive(E.IBV_WC_RECV, ctypes.string_at(sge.addr, sge.length), 0)
                self.cq.push(_wc(wr.wr_id, E.IBV_WC_SUCCESS, E.IBV_WC_SEND, self.qp_num))
            else:
                raise FakePyverbsError(f"opcode {wr.opcode} not supported")

    def close(self):
        self.fabric.qps.pop(self.qp_num, None)


class FakeContext:
    def __init__(self, fabric, name):
        self.fabric, self.name = fabric, name
        self.lid = next(fabric.lids)

    def query_device(self):
        return _Bag(max_qp_rd_atom=16, max_qp_init_rd_atom=16, max_qp_wr=32768, max_cqe=1 << 22)

    def query_port(self, port):
        return _Bag(state=E.IBV_PORT_ACTIVE, lid=self.lid, active_mtu=5, max_msg_sz=self.fabric.max_msg,
                    link_layer=E.IBV_LINK_LAYER_INFINIBAND)

    def query_gid(self, port, index):
        return FakeGID(f"fe80:0000:0000:0000:0000:0000:0000:{self.lid:04x}")

    def close(self):
        pass


def fake_verbs(fabric: Fabric) -> SimpleNamespace:
    return SimpleNamespace(
        device=SimpleNamespace(get_device_list=lambda: [_Bag(name=b"fake0")],
                               Context=lambda name: FakeContext(fabric, name)),
        GID=FakeGID, AHAttr=_Bag, GlobalRoute=_Bag, CQ=FakeCQ, CompChannel=FakeChannel, MR=FakeMR,
        PD=lambda ctx: _Bag(ctx=ctx, close=lambda: None), PyverbsError=FakePyverbsError, QP=FakeQP,
        QPAttr=_Bag, QPCap=_Bag, QPInitAttr=_Bag, SGE=FakeSGE, RecvWR=FakeRecvWR, SendWR=FakeSendWR, e=E,
        status_text=lambda s: f"status {s}")


@pytest.fixture
def fabric(monkeypatch):
    fab = Fabric(max_msg=96 * 1024)  # smaller than a chunk: chunks go out as several WRs
    monkeypatch.setattr(verbs, "load_verbs", lambda: fake_verbs(fab))
    return fab


# ======================================================================================
# Scenarios, run over the fake layer and (marked rdma) over a real device
# ======================================================================================

@contextmanager
def transport_pair(mode: str, **kw) -> Iterator[tuple[RdmaTransport, RdmaTransport]]:
    """make_pair, closed again however the test ends."""
    a, b = make_pair(mode, **kw)
    try:
        yield a, b
    finally:
        a.close()
        b.close()


def make_pair(mode: str, **kw) -> tuple[RdmaTransport, RdmaTransport]:
    nodes: dict[str, RdmaTransport] = {}

    def exchange_from(me):
        # What the worker does over NATS request/reply, here a direct call.
        return lambda peer, info: json.loads(json.dumps(nodes[peer].accept_exchange(me, json.loads(json.dumps(info)))))

    nodes["a"] = RdmaTransport("a", exchange_from("a"), mode=mode, **kw)
    nodes["b"] = RdmaTransport("b", exchange_from("b"), mode=mode, **kw)
    return nodes["a"], nodes["b"]


def _random_block(block_id: int, nbytes: int, seed: int) -> BlockSlot:
    gen = torch.Generator().manual_seed(seed)
    return BlockSlot(block_id, torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen), complete=True)


def scenario_blocks_move_byte_identically(a: RdmaTransport, b: RdmaTransport) -> None:
    sizes = [(1 << 20) + 17, 300 * 1024, 100]
    srcs = [_random_block(i, n, seed=i) for i, n in enumerate(sizes)]
    dsts = [BlockSlot(i, bytearray(n)) for i, n in enumerate(sizes)]
    for d in dsts:
        b.expect("op-1", d.block_id, "a", d)
    for s in srcs:
        a.send_block("b", b.address, "op-1", s, chunk_bytes=256 * 1024, stall_timeout_s=10)
    for s, d in zip(srcs, dsts, strict=True):
        d.wait_filled(d.nbytes, timeout=10)
        assert bytes(d.view) == bytes(s.view)
        assert d.crc == zlib.crc32(bytes(s.view))
    b.forget("op-1")


def scenario_cut_through(a: RdmaTransport, b: RdmaTransport) -> None:
    """The source fills chunk by chunk; the receiver has bytes before the source is complete."""
    chunk, nchunks = 64 * 1024, 8
    data = bytes(_random_block(0, chunk * nchunks, seed=7).view)
    src = BlockSlot(0, bytearray(len(data)))
    dst = BlockSlot(0, bytearray(len(data)))
    b.expect("op-ct", 0, "a", dst)
    seen_early: list[int] = []

    def fill():
        for k in range(nchunks):
            src.writable(k * chunk, chunk)[:] = data[k * chunk:(k + 1) * chunk]
            src.advance(chunk)
            time.sleep(0.05)
            if k < nchunks - 1:
                seen_early.append(dst.filled)

    filler = threading.Thread(target=fill)
    filler.start()
    a.send_block("b", b.address, "op-ct", src, chunk_bytes=chunk, stall_timeout_s=10)
    filler.join()
    dst.wait_filled(dst.nbytes, timeout=10)
    assert bytes(dst.view) == data
    assert max(seen_early) > 0, "nothing arrived before the source block was complete"


def scenario_messages(a: RdmaTransport, b: RdmaTransport) -> None:
    got: list[tuple[str, str, bytes]] = []
    done = threading.Event()

    def handler(name):
        def on(sender, payload):
            got.append((name, sender, payload))
            if len(got) == 3:
                done.set()
        return on

    b.on_message("acts", handler("b"))
    a.on_message("acts", handler("a"))
    big = bytes(_random_block(0, 100 * 1024, seed=3).view)  # several frames
    a.send_message("b", b.address, "acts", b"small")
    a.send_message("b", b.address, "acts", big)
    b.send_message("a", a.address, "acts", b"reply")
    assert done.wait(10)
    assert sorted(got) == sorted([("b", "a", b"small"), ("b", "a", big), ("a", "b", b"reply")])


def _rdma_hw_kwargs() -> dict:
    kw: dict = {}
    if os.environ.get("LAYERCAST_RDMA_DEVICE"):
        kw["device_name"] = os.environ["LAYERCAST_RDMA_DEVICE"]
    if os.environ.get("LAYERCAST_RDMA_PORT"):
        kw["port"] = int(os.environ["LAYERCAST_RDMA_PORT"])
    if os.environ.get("LAYERCAST_RDMA_GID_INDEX"):
        kw["gid_index"] = int(os.environ["LAYERCAST_RDMA_GID_INDEX"])
    return kw


@pytest.mark.rdma
@pytest.mark.parametrize("mode", ["write", "read"])
def test_rdma_device_two_transports_move_blocks(mode):
    """Two transports in one process on a real device (loopback through the HCA)."""
    ok, reason = rdma_available(os.environ.get("LAYERCAST_RDMA_DEVICE"))
    if not ok:
        pytest.skip(reason)
    with transport_pair(mode, **_rdma_hw_kwargs()) as (a, b):
        scenario_blocks_move_byte_identically(a, b)
        scenario_cut_through(a, b)
        scenario_messages(a, b)


# ======================================================================================
# The protocol over the fake layer
# ======================================================================================

@pytest.mark.parametrize("mode", ["write", "read"])
def test_fake_blocks_move_byte_identically(fabric, mode):
    with transport_pair(mode) as (a, b):
        scenario_blocks_move_byte_identically(a, b)
        # per-transfer registrations are gone again; what stays: two send pools and two ctrl rings
        deadline = time.monotonic() + 5
        while (len(a._mrs) or len(b._mrs)) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert len(a._mrs) == len(b._mrs) == 0
        assert len(fabric.mrs) == 4
    assert not fabric.mrs and not fabric.qps


def test_fake_write_mode_splits_chunks_and_marks_each_with_one_immediate(fabric):
    with transport_pair("write") as (a, b):
        src = _random_block(5, 256 * 1024 + 10, seed=5)
        dst = BlockSlot(5, bytearray(src.nbytes))
        b.expect("op", 5, "a", dst)
        a.send_block("b", b.address, "op", src, chunk_bytes=128 * 1024)
        dst.wait_filled(dst.nbytes, timeout=5)
        assert bytes(dst.view) == bytes(src.view)
        # spans of a chunk (128K, 128K, 10): each cut at the 96K max message, its last WR carrying the immediate
        assert fabric.posted == [("write", 96 * 1024), ("write_imm", 32 * 1024), ("write", 96 * 1024),
                                 ("write_imm", 32 * 1024), ("write_imm", 10)]


def test_fake_read_mode_pulls_with_rdma_read(fabric):
    with transport_pair("read") as (a, b):
        src = _random_block(1, 200 * 1024, seed=1)
        dst = BlockSlot(1, bytearray(src.nbytes))
        b.expect("op", 1, "a", dst)
        a.send_block("b", b.address, "op", src, chunk_bytes=64 * 1024)
        assert dst.complete and bytes(dst.view) == bytes(src.view)  # READ mode returns after the receiver's done
        assert {op for op, _ in fabric.posted} == {"read"}
        assert all(n <= 64 * 1024 for _, n in fabric.posted)


@pytest.mark.parametrize("mode", ["write", "read"])
def test_fake_cut_through(fabric, mode):
    with transport_pair(mode) as (a, b):
        scenario_cut_through(a, b)


def test_fake_messages_both_ways(fabric):
    with transport_pair("write") as (a, b):
        scenario_messages(a, b)


def test_fake_send_before_expect_waits_for_the_registration(fabric):
    with transport_pair("write") as (a, b):
        src = _random_block(0, 50_000, seed=2)
        dst = BlockSlot(0, bytearray(src.nbytes))
        sender = threading.Thread(target=a.send_block, args=("b", b.address, "late", src),
                                  kwargs={"stall_timeout_s": 10})
        sender.start()
        time.sleep(0.3)
        assert not dst.complete
        b.expect("late", 0, "a", dst)
        sender.join(10)
        dst.wait_filled(dst.nbytes, timeout=5)
        assert bytes(dst.view) == bytes(src.view)


def test_fake_simultaneous_connect_ends_with_one_connection_per_side(fabric):
    with transport_pair("write") as (a, b):
        got = []
        a.on_message("x", lambda s, p: got.append(p))
        b.on_message("x", lambda s, p: got.append(p))
        start = threading.Barrier(2)

        def send(src, dst, name):
            start.wait()
            src.send_message(name, dst.address, "x", f"from {src.node_id}".encode())

        threads = [threading.Thread(target=send, args=(a, b, "b")), threading.Thread(target=send, args=(b, a, "a"))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(20)
        deadline = time.monotonic() + 5
        while len(got) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert sorted(got) == [b"from a", b"from b"]
        ca, cb = a._conns["b"], b._conns["a"]
        assert ca.remote.bulk_qpn == cb.bulk_qp.qp_num and cb.remote.bulk_qpn == ca.bulk_qp.qp_num


def test_fake_late_request_of_a_lost_tie_does_not_replace_the_connection_in_use(fabric):
    """b's attempt loses the tie to a's, but its request reaches a only after a's connection is up:
    a must not take it for a reconnect (that failed the connection at both ends mid-multicast)."""
    nodes: dict[str, RdmaTransport] = {}
    gate = threading.Event()

    def exchange_from(me):
        def exchange(peer, info):
            if me == "b":
                gate.wait(10)  # b's request is held in flight
            return json.loads(json.dumps(nodes[peer].accept_exchange(me, json.loads(json.dumps(info)))))
        return exchange

    nodes["a"] = RdmaTransport("a", exchange_from("a"), mode="write")
    nodes["b"] = RdmaTransport("b", exchange_from("b"), mode="write")
    a, b = nodes["a"], nodes["b"]
    try:
        got: list[bytes] = []
        a.on_message("x", lambda s, p: got.append(p))
        b.on_message("x", lambda s, p: got.append(p))
        late = threading.Thread(target=b.send_message, args=("a", a.address, "x", b"from b"))
        late.start()
        deadline = time.monotonic() + 5
        while "a" not in b._conns and time.monotonic() < deadline:
            time.sleep(0.01)
        a.send_message("b", b.address, "x", b"from a")  # a's attempt wins at b
        while b"from a" not in got and time.monotonic() < deadline:
            time.sleep(0.01)
        in_use = a._conns["b"]
        gate.set()
        late.join(20)
        while len(got) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert sorted(got) == [b"from a", b"from b"]
        assert a._conns["b"] is in_use and in_use.dead is None
    finally:
        gate.set()
        a.close()
        b.close()


def test_fake_forgotten_operation_is_refused(fabric):
    with transport_pair("write") as (a, b):
        b.forget("gone")
        with pytest.raises(TransferError, match="refused"):
            a.send_block("b", b.address, "gone", _random_block(0, 1000, seed=0), stall_timeout_s=5)


def test_fake_wrong_source_is_refused(fabric):
    with transport_pair("write") as (a, b):
        b.expect("op", 0, "someone-else", BlockSlot(0, bytearray(1000)))
        with pytest.raises(TransferError, match="expected from someone-else"):
            a.send_block("b", b.address, "op", _random_block(0, 1000, seed=0), stall_timeout_s=5)


@pytest.mark.parametrize("mode", ["write", "read"])
def test_fake_cancelled_send_fails_the_receiving_slot(fabric, mode):
    with transport_pair(mode) as (a, b):
        src = BlockSlot(0, bytearray(300 * 1024))  # never fills past the first chunk
        src.writable(0, 64 * 1024)[:] = b"\x01" * (64 * 1024)
        src.advance(64 * 1024)
        dst = BlockSlot(0, bytearray(src.nbytes))
        b.expect("op", 0, "a", dst)
        t0 = time.monotonic()
        # Cancelled while stalled on the source, once the first chunk is at the receiver (under
        # load, a fixed 0.3 s could pass before it landed: CI saw filled == 0).
        with pytest.raises(TransferError, match="cancelled"):
            a.send_block("b", b.address, "op", src, chunk_bytes=64 * 1024, stall_timeout_s=10,
                         cancelled=lambda: time.monotonic() - t0 > 0.3 and dst.filled >= 64 * 1024)
        with pytest.raises(TransferError, match="gave up"):
            dst.wait_filled(dst.nbytes, timeout=5)
        assert dst.filled == 64 * 1024  # the first chunk had landed


def test_fake_forget_during_a_write_revokes_it(fabric):
    with transport_pair("write") as (a, b):
        src = BlockSlot(0, bytearray(256 * 1024))
        src.writable(0, 64 * 1024)[:] = b"\x02" * (64 * 1024)
        src.advance(64 * 1024)
        dst = BlockSlot(0, bytearray(src.nbytes))
        b.expect("op", 0, "a", dst)
        errors = []

        def send():
            try:
                a.send_block("b", b.address, "op", src, chunk_bytes=64 * 1024, stall_timeout_s=10)
            except TransferError as exc:
                errors.append(str(exc))

        sender = threading.Thread(target=send)
        sender.start()
        dst.wait_filled(64 * 1024, timeout=5)
        b.forget("op")
        sender.join(10)
        assert errors and "dropped" in errors[0]
        deadline = time.monotonic() + 5  # the sender's abort lets the receiver drop its registration
        while b._tokens and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not b._tokens


def test_fake_lost_peer_fails_the_send(fabric):
    with transport_pair("write") as (a, b):
        a.send_message("b", b.address, "x", b"connect")
        b.close()
        with pytest.raises(TransferError):
            a.send_block("b", "", "op", _random_block(0, 10_000, seed=0), stall_timeout_s=3)


def test_fake_close_fails_pending_receives(fabric):
    a, b = make_pair("write")
    dst = BlockSlot(0, bytearray(100))
    b.expect("op", 0, "a", dst)
    b.close()
    a.close()
    with pytest.raises(TransferError, match="closed"):
        dst.wait_filled(100, timeout=1)
    with pytest.raises(TransferError, match="closed"):
        b.expect("op", 1, "a", BlockSlot(1, bytearray(10)))


def test_fake_accept_exchange_rejects_malformed_info(fabric):
    with transport_pair("write") as (a, b):
        with pytest.raises(RdmaProtocolError, match="'bulk_qpn'"):
            b.accept_exchange("a", _info(node="a", bulk_qpn="x"))
        with pytest.raises(RdmaProtocolError, match="names node"):
            b.accept_exchange("a", _info(node="mallory"))
        with pytest.raises(TransferError, match="itself"):
            a.send_message("a", a.address, "x", b"")


def test_fake_register_slot_keeps_one_registration(fabric):
    with transport_pair("write") as (a, b):
        src = _random_block(0, 10_000, seed=4)
        a.register_slot(src)
        before = len(fabric.mrs)
        for op in ("o1", "o2"):
            dst = BlockSlot(0, bytearray(src.nbytes))
            b.expect(op, 0, "a", dst)
            a.send_block("b", b.address, op, src)
            dst.wait_filled(dst.nbytes, timeout=5)
            assert bytes(dst.view) == bytes(src.view)
        assert len(a._mrs) == 1 and len(fabric.mrs) >= before
        a.unregister_slot(src)
        assert len(a._mrs) == 0
        with pytest.raises(TransferError, match="not registered"):
            a.unregister_slot(src)


def test_fake_roce_port_with_an_empty_gid_is_refused(fabric, monkeypatch):
    monkeypatch.setattr(FakeContext, "query_gid", lambda self, port, index: FakeGID())
    monkeypatch.setattr(FakeContext, "query_port", lambda self, port: _Bag(
        state=E.IBV_PORT_ACTIVE, lid=0, active_mtu=3, max_msg_sz=1 << 30, link_layer=E.IBV_LINK_LAYER_ETHERNET))
    with pytest.raises(TransferError, match="GID index 0 .* is empty"):
        RdmaTransport("a", lambda peer, info: {})


def test_fake_held_slot_is_answered_once_admitted(fabric):
    with transport_pair("write") as (a, b):
        src = _random_block(0, 20_000, seed=6)
        dst = BlockSlot(0, bytearray(src.nbytes))
        dst.hold()
        b.expect("op", 0, "a", dst)
        sender = threading.Thread(target=a.send_block, args=("b", b.address, "op", src),
                                  kwargs={"stall_timeout_s": 10})
        sender.start()
        time.sleep(0.3)
        assert dst.filled == 0 and sender.is_alive()  # nothing lands before admission
        dst.admit()
        sender.join(10)
        dst.wait_filled(dst.nbytes, timeout=5)
        assert bytes(dst.view) == bytes(src.view)


@pytest.mark.parametrize("mode", ["write", "read"])
def test_fake_schedule_grant_and_abort_travel_as_messages(fabric, mode):
    """The base class's receiver-driven grant (wait_grant) and op abort work over the ctrl QP."""
    with transport_pair(mode) as (a, b):
        src = _random_block(2, 30_000, seed=8)
        dst = BlockSlot(2, bytearray(src.nbytes))
        b.expect("op", 2, "a", dst)
        sender = threading.Thread(target=a.send_block, args=("b", b.address, "op", src),
                                  kwargs={"stall_timeout_s": 10, "wait_grant": True})
        sender.start()
        time.sleep(0.2)
        assert dst.filled == 0
        b.grant("a", a.address, "op", 2)
        sender.join(10)
        dst.wait_filled(dst.nbytes, timeout=5)
        assert bytes(dst.view) == bytes(src.view)
        # abort: the receiver fails what it still expects from the sender for that op
        pending = BlockSlot(3, bytearray(10))
        b.expect("op2", 3, "a", pending)
        a.abort("b", b.address, "op2", "upstream failed")
        with pytest.raises(TransferError, match="upstream failed"):
            pending.wait_filled(10, timeout=5)
        with pytest.raises(ValueError, match="reserved"):
            a.on_message("layercast.abort", lambda s, p: None)


def test_fake_duplicate_expect_is_rejected_by_the_base(fabric):
    with transport_pair("write") as (a, b):
        b.expect("op", 0, "a", BlockSlot(0, bytearray(10)))
        with pytest.raises(ValueError, match="already expected"):
            b.expect("op", 0, "a", BlockSlot(0, bytearray(10)))


@pytest.mark.parametrize("mode", ["write", "read"])
@pytest.mark.parametrize("schedule", ["chain", "binomial"])
def test_fake_plan_executor_runs_a_multicast_over_rdma(fabric, mode, schedule):
    """The plan executor (hold/admit, grants, cut-through relays, checksums) over RdmaTransport."""
    from libs.planning.multicast import binomial_schedule, chain_schedule, node_parts
    from libs.transfer.executor import PartRun, hops_of

    n_nodes, n_blocks = 5, 6
    sched = chain_schedule([list(range(n_nodes))], n_blocks) if schedule == "chain" else \
        binomial_schedule(n_nodes, n_blocks)
    names = [f"n{i}" for i in range(n_nodes)]
    nodes: dict[str, RdmaTransport] = {}
    for name in names:
        nodes[name] = RdmaTransport(name, lambda peer, info, me=name: nodes[peer].accept_exchange(me, info),
                                    mode=mode)
    try:
        data = [bytes(_random_block(b, 150_000 - 777 * (b == n_blocks - 1), seed=b).view) for b in range(n_blocks)]
        crcs = {b: zlib.crc32(d) for b, d in enumerate(data)}
        parts = node_parts(sched, n_nodes)
        peers = {n: nodes[n].address for n in names}
        slots = {i: {b: BlockSlot(b, bytearray(d), complete=True) if i == 0 else BlockSlot(b, bytearray(len(d)))
                     for b, d in enumerate(data)} for i in range(n_nodes)}
        runs = [PartRun(nodes[names[i]], "op", slots=slots[i], sends=hops_of(parts[i].sends, names, True),
                        receives=hops_of(parts[i].receives, names, False), peers=peers, checksums=crcs,
                        chunk_bytes=32 * 1024, stall_timeout_s=20) for i in range(n_nodes)]
        errors: list[BaseException] = []

        def go(run):
            try:
                run.run()
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        threads = [threading.Thread(target=go, args=(r,)) for r in runs]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors, errors
        for i in range(1, n_nodes):
            for b, d in enumerate(data):
                assert bytes(slots[i][b].view) == d
    finally:
        for t in nodes.values():
            t.close()
