"""The TCP data plane takes bytes only from the peers a plan names, at the addresses the plan
gives them (a worker learns both from its TransferPart: `receives` names each block's source,
`peers` its address; libs/transfer/executor.py registers them with the transport)."""

import json
import logging
import os
import socket
import threading
import time
import zlib

import torch

from libs.engine.stages import CALL_CHANNEL, RemoteStage, StageServer, pack
from libs.transfer.base import ABORT_CHANNEL, BlockSlot
from libs.transfer.executor import Hop, PartRun
from libs.transfer.tcp import frames as f
from libs.transfer.tcp.transport import TcpTransport, split_address

OP = "op-peer-filter"
NBYTES = 256 << 10


def raw_connection(to_address: str, claims: str, bind_ip: str, payload: bytes) -> socket.socket:
    """A hand-made data-plane connection from `bind_ip` whose hello claims node id `claims`, then
    one data frame for block 0 of OP carrying `payload`."""
    s = socket.socket()
    s.bind((bind_ip, 0))
    s.connect(split_address(to_address))
    header = f.encode_data(f.DataHeader(OP, 0, 0, len(payload), NBYTES))
    try:
        s.sendall(f.encode_hello(f.ConnClass.BULK, claims) + header + payload)
    except OSError:
        pass  # closed on us while sending: what a refusal looks like from here
    return s


def closed_by_receiver(s: socket.socket, timeout_s: float = 30.0) -> bool:
    s.settimeout(timeout_s)
    try:
        return s.recv(1) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False
    finally:
        s.close()


def until(condition, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_bytes_from_a_peer_the_plan_does_not_name_never_reach_a_block(caplog):
    caplog.set_level(logging.WARNING, logger="libs.transfer.tcp.transport")
    data = os.urandom(NBYTES)
    receiver = TcpTransport("recv", unknown_op_wait_s=0.5)
    source = TcpTransport("src-a")  # listens on 127.0.0.1: its address in the plan
    try:
        slot = BlockSlot(0, bytearray(NBYTES))
        receiving = PartRun(receiver, OP, slots={0: slot}, sends=[], receives=[Hop(0, "src-a", 0)],
                            peers={"src-a": source.address}, checksums={0: zlib.crc32(data)})
        results: list = []
        t = threading.Thread(target=lambda: results.append(receiving.run()), daemon=True)
        t.start()

        # A node no plan names, and one that claims the named source's id from another address
        # (127.0.0.2: loopback too, but not where the plan says src-a is).
        intruder = raw_connection(receiver.address, "mallory", "127.0.0.1", b"\xee" * NBYTES)
        assert closed_by_receiver(intruder)
        impostor = raw_connection(receiver.address, "src-a", "127.0.0.2", b"\xee" * NBYTES)
        assert closed_by_receiver(impostor)
        assert receiver.refused_connections == 2
        assert slot.filled == 0 and slot.first_byte_at is None
        assert slot.error is None, "a refused impostor must not fail the real source's transfer"
        # Nor can it abort the op or break it by closing a message connection in src-a's name.
        abort = json.dumps({"op_id": OP, "reason": "forged"}).encode()
        m = socket.socket()
        m.bind(("127.0.0.2", 0))
        m.connect(split_address(receiver.address))
        m.sendall(f.encode_hello(f.ConnClass.MESSAGE, "src-a") + f.encode_message(ABORT_CHANNEL, len(abort)) + abort)
        m.close()
        until(lambda: not receiver._accepted and (slot.error is not None or any(
            "dropped an abort claiming to be from src-a" in r.getMessage()
            or "refused a message connection from 127.0.0.2 claiming to be src-a" in r.getMessage()
            for r in caplog.records)))
        # (the abort was handled, one way or the other, and the connection's end too: since message
        # connections are filtered too, it is refused at its hello)
        assert slot.error is None, "a forged abort or a message connection's end failed the real source's transfer"

        # The named source, from its address, delivers the block.
        sending = PartRun(source, OP, slots={0: BlockSlot(0, bytearray(data), complete=True)},
                          sends=[Hop(0, "recv", 0)], receives=[], peers={"recv": receiver.address})
        sending.run()
        t.join(30)
        assert results and results[0].bytes_received == NBYTES
        assert bytes(slot.view) == data
        assert receiver.refused_connections == 3  # the two bulk ones, and the forged abort's
    finally:
        receiver.close()
        source.close()


def test_a_source_is_checked_against_every_address_its_name_resolves_to():
    receiver = TcpTransport("recv")
    try:
        accept_local = receiver._from_plan_address("127.0.0.1")
        assert accept_local("localhost:7000") and accept_local("127.0.0.1:7000")
        assert not accept_local("127.0.0.2:7000")
        assert not receiver._from_plan_address("10.1.2.3")("localhost:7000")
        assert accept_local(None)  # a receive registered without an address (no plan): by name only
    finally:
        receiver.close()


def message_connection(to_address: str, claims: str, bind_ip: str, channel: str, payload: bytes) -> socket.socket:
    """A hand-made message connection from `bind_ip` whose hello claims `claims`, then one message."""
    s = socket.socket()
    s.bind((bind_ip, 0))
    s.connect(split_address(to_address))
    try:
        s.sendall(f.encode_hello(f.ConnClass.MESSAGE, claims) + f.encode_message(channel, len(payload)) + payload)
    except OSError:
        pass
    return s


def test_messages_are_taken_only_from_the_peers_a_pipeline_names_at_their_address():
    """Activations (a stage's calls and replies) travel on message connections: a stage server
    takes calls only from the entry its pipeline names, from the entry's address; once the
    stage is no longer hosted, not even from it; a reply is taken only from the peer called."""
    host = TcpTransport("stage-host", unknown_op_wait_s=0.5)
    entry = TcpTransport("entry", unknown_op_wait_s=0.5)
    served: list[str] = []
    answer_r2 = threading.Event()  # the host answers r2 only once the forged reply is sent

    class Echo:
        slots = 4

        def open(self, request_id):
            served.append(request_id)
            if request_id == "r2":
                answer_r2.wait(10)

        def close(self, request_id):
            pass

    server = StageServer(host, {})
    try:
        server.add("p/1", Echo(), caller="entry", address=entry.address)
        stage = RemoteStage(entry, "stage-host", host.address, "p/1", slots=4, timeout_s=5)
        stage.open("r1")  # the named entry, from its address: served, and its reply taken
        assert served == ["r1"]

        call = pack({"op": "open", "request_id": "forged", "stage": "p/1", "call_id": "x:1"})
        for claims, ip in (("mallory", "127.0.0.1"), ("entry", "127.0.0.2")):  # unnamed; named, from elsewhere
            assert closed_by_receiver(message_connection(host.address, claims, ip, CALL_CHANNEL, call))
        assert host.refused_connections == 2 and served == ["r1"]

        # A reply to the entry's call that comes from another peer than the one called is dropped.
        other = TcpTransport("other")
        try:
            entry.admit_messages("other", other.address)  # even a peer the entry names otherwise
            future = stage._submit({"op": "open", "request_id": "r2"})
            call_id = next(iter(stage._replies._waiting))
            other.send_message("entry", entry.address, "stage.reply", pack({"call_id": call_id, "ok": True},
                                                                           torch.zeros(1)))
            time.sleep(0.3)
            answer_r2.set()
            assert future.result(5) is None  # the stage host's own (empty) answer, not other's tensor
        finally:
            other.close()

        server.remove("p/1")  # the pipeline ended here: the entry's connection stays, its calls do not
        dropped = host.dropped_messages
        with_timeout = RemoteStage(entry, "stage-host", host.address, "p/1", slots=4, timeout_s=1.5)
        try:
            with_timeout.open("r3")
            raise AssertionError("a call after the stage ended was served")
        except TimeoutError:
            pass
        assert host.dropped_messages == dropped + 1 and served == ["r1", "r2"]
    finally:
        server.close()
        host.close()
        entry.close()
