"""Fuzzing the data plane's byte-level parsers (issue 40, item 5): whatever bytes a peer sends, the
parser refuses them with its own error (FrameError, RdmaProtocolError), never another exception, a
hang or an allocation the bytes did not pay for (a length field of 2^32 - 1 or 2^63)."""

import json
import socket
import struct
import threading
import tracemalloc

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from libs.transfer.rdma import codec
from libs.transfer.tcp import frames as f
from libs.transfer.tcp.transport import TcpTransport

# A few hundred cases each in all: the whole file runs in seconds.
FUZZ = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
FUZZ_FEW = settings(FUZZ, max_examples=50)

u8, u16, u32, u64 = (st.integers(0, (1 << bits) - 1) for bits in (8, 16, 32, 64))
names = st.one_of(st.binary(min_size=0, max_size=40), st.text(max_size=20).map(str.encode))


# --- TCP frames: the decoders of each fixed part ------------------------------------------------------

@FUZZ
@given(st.binary(max_size=40))
def test_each_fixed_part_decoder_takes_any_bytes_or_raises_a_frame_error(raw):
    for decode in (f.decode_hello_fixed, f.decode_kind, f.decode_data_fixed, f.decode_message_fixed):
        try:
            decode(raw)
        except f.FrameError:
            pass


@FUZZ
@given(u16, u32, u64, u32, u64)
def test_a_data_header_that_decodes_names_a_range_inside_its_block(op_len, block, offset, length, total):
    try:
        _, _, off, n, size = f.decode_data_fixed(struct.pack("!HIQIQ", op_len, block, offset, length, total))
    except f.FrameError:
        return
    assert 0 < n and 0 <= off and off + n <= size


@FUZZ
@given(u16, u32)
def test_a_message_header_that_decodes_announces_at_most_the_largest_message(ch_len, length):
    try:
        _, n = f.decode_message_fixed(struct.pack("!HI", ch_len, length))
    except f.FrameError:
        return
    assert n <= f.MAX_MESSAGE


# --- TCP frames: a whole connection's bytes, through the receiving transport --------------------------

def _hello(name: bytes, conn_class: int = 1) -> bytes:
    return struct.pack("!4sBH", f.MAGIC, conn_class, len(name)) + name


@st.composite
def frame(draw) -> bytes:
    """A frame whose header fields are anything (lengths up to 2^32 - 1, offsets up to 2^64 - 1)."""
    kind = draw(st.sampled_from([1, 2, 0, 3, 255]))
    name = draw(names)
    name_len = draw(st.one_of(st.just(len(name)), u16))
    if kind == 1:
        head = struct.pack("!HIQIQ", name_len, draw(u32), draw(u64), draw(u32), draw(u64))
    else:
        head = struct.pack("!HI", name_len, draw(st.one_of(u32, st.integers(0, 64))))
    return bytes([kind]) + head + name + draw(st.binary(max_size=64))


connection = st.one_of(
    st.binary(max_size=256),  # not even a hello
    st.tuples(names, st.sampled_from([0, 1, 2, 255]), st.lists(frame(), max_size=4), st.binary(max_size=16)).map(
        lambda t: _hello(t[0], t[1]) + b"".join(t[2]) + t[3]),
)


@pytest.fixture(scope="module")
def tcp_pair():
    """Makes connected TCP sockets (ours, the peer's): a message connection sets TCP options a
    socketpair does not take."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        def make() -> tuple[socket.socket, socket.socket]:
            peer = socket.create_connection(listener.getsockname())
            ours, _ = listener.accept()
            return ours, peer
        yield make


@pytest.fixture(scope="module")
def receiver():
    # unknown_op_wait_s=0: bytes for an operation nobody expects are refused at once, not after 30 s
    # check_message_peers=False: message frames from any hello's name reach the parsers (who may
    # send is test_peer_filter.py's)
    with TcpTransport("fuzz-receiver", unknown_op_wait_s=0, check_message_peers=False) as transport:
        got: list[tuple[str, bytes]] = []
        transport.on_message("fuzz", lambda src, payload: got.append((src, payload)))
        yield transport, got


@FUZZ
@given(connection)
def test_any_bytes_on_a_connection_end_it_with_a_logged_error_and_allocate_no_more_than_they_pay_for(
        receiver, tcp_pair, data):
    """The bytes, then the peer's close: the connection's reader returns (anything but a protocol
    error, a transfer error or a closed connection would escape it here), and the memory it held
    at its peak stays small, whatever lengths the headers announced."""
    transport, _ = receiver
    ours, peer = tcp_pair()
    try:
        peer.sendall(data)
        peer.shutdown(socket.SHUT_WR)
        tracemalloc.start()
        try:
            transport._serve(ours)  # what the accept loop runs on its own thread for each connection
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    finally:
        peer.close()
    assert peak < 4 * f.MAX_NAME + 4 * len(data) + (2 << 20), f"{peak} bytes held for {len(data)} sent"


def test_a_message_frame_announcing_256_mib_allocates_only_what_arrives(receiver, tcp_pair):
    transport, got = receiver
    got.clear()
    ours, peer = tcp_pair()
    peer.sendall(_hello(b"peer") + bytes([2]) + struct.pack("!HI", 4, f.MAX_MESSAGE) + b"fuzz" + b"x" * 1000)
    peer.shutdown(socket.SHUT_WR)
    tracemalloc.start()
    transport._serve(ours)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    peer.close()
    assert peak < 4 << 20, peak
    assert got == []  # cut short: nothing delivered


def test_well_formed_messages_still_arrive_whole(receiver, tcp_pair):
    transport, got = receiver
    got.clear()
    big = bytes(range(256)) * (5 << 12)  # 5 MiB: several allocation pieces
    ours, peer = tcp_pair()
    stream = _hello(b"peer") + f.encode_message("fuzz", 3) + b"abc" + f.encode_message("fuzz", len(big))
    sender = threading.Thread(target=lambda: (peer.sendall(stream + big), peer.shutdown(socket.SHUT_WR)))
    sender.start()
    transport._serve(ours)
    sender.join()
    peer.close()
    assert got == [("peer", b"abc"), ("peer", big)]


# --- RDMA wire codec ----------------------------------------------------------------------------------

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(1 << 70), 1 << 70) | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=6)
control_like = st.fixed_dictionaries(
    {"t": st.one_of(st.sampled_from(sorted(codec._CONTROL_SCHEMA)), json_values)},
    optional={k: st.one_of(json_values, u64, st.integers(-5, 5)) for k in
              ("op", "block", "nbytes", "chunk", "granule", "mode", "addr", "rkey", "token", "upto", "ok",
               "reason")})


@FUZZ_FEW
@given(st.one_of(control_like, json_values))
def test_a_control_message_validates_or_raises_a_protocol_error(msg):
    try:
        codec.validate_control(msg)
    except codec.RdmaProtocolError:
        pass


@FUZZ_FEW
@given(st.one_of(
    st.dictionaries(st.sampled_from(["v", "node", "lid", "gid", "mtu", "max_msg", "bulk_qpn", "bulk_psn",
                                     "ctrl_qpn", "ctrl_psn", "incarnation", "attempt"]), json_values),
    json_values))
def test_connection_info_parses_or_raises_a_protocol_error(d):
    try:
        codec.ConnectionInfo.from_dict(d)
    except codec.RdmaProtocolError:
        pass


ctrl_frame = st.one_of(
    st.binary(max_size=64),
    st.tuples(st.sampled_from([0, 1, 2, 3, 255]), st.sampled_from([0, 1, 3]), st.one_of(
        st.binary(max_size=64),
        control_like.map(lambda d: json.dumps(d, default=str).encode()),
        st.integers(1, 3000).map(lambda depth: b"[" * depth + b"]" * depth),  # deeper than the JSON parser goes
        st.tuples(u16, names, st.binary(max_size=32)).map(lambda t: struct.pack("!H", t[0]) + t[1] + t[2]),
    )).map(lambda t: bytes(t[:2]) + t[2]))


@FUZZ_FEW
@given(st.lists(ctrl_frame, min_size=1, max_size=6))
def test_ctrl_frames_assemble_or_raise_a_protocol_error_and_never_exceed_the_message_limit(frames):
    assembler = codec.FrameAssembler(max_message_bytes=100)
    for raw in frames:
        try:
            out = assembler.feed(raw)
        except codec.RdmaProtocolError:
            assembler = codec.FrameAssembler(max_message_bytes=100)  # the transport drops the connection
            continue
        assert assembler._size <= 100
        if out is not None and out[0] == "message":
            assert len(out[1][1]) <= 100 + codec.CTRL_FRAME_BYTES


def test_control_frames_nested_too_deep_for_the_parser_are_a_protocol_error():
    with pytest.raises(codec.RdmaProtocolError):
        codec.FrameAssembler().feed(bytes([codec.FRAME_CONTROL, 0]) + b"[" * 100_000 + b"]" * 100_000)
    with pytest.raises(codec.RdmaProtocolError):
        codec.validate_control({"t": ["offer"]})  # unhashable: it was a TypeError


# --- the data plane's own messages: grants and aborts --------------------------------------------------

json_bytes = st.one_of(
    st.binary(max_size=64),
    st.fixed_dictionaries({}, optional={"op_id": json_values, "block": st.one_of(json_values, st.just(1e400)),
                                        "reason": json_values}).map(lambda d: json.dumps(d).encode()),
    st.integers(1, 3000).map(lambda depth: b"[" * depth + b"]" * depth))


@FUZZ_FEW
@given(json_bytes)
def test_a_grant_or_abort_from_a_peer_is_taken_or_dropped_never_raises(receiver, payload):
    transport, _ = receiver
    transport._on_grant("peer", payload)
    transport._on_abort("peer", payload)


@pytest.mark.parametrize("payload", [b'{"op_id": "op", "block": Infinity}', b"[" * 100_000 + b"]" * 100_000])
def test_a_grant_with_an_infinite_block_or_nested_too_deep_is_dropped(receiver, payload):
    receiver[0]._on_grant("peer", payload)
