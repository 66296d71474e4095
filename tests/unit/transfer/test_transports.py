"""The transport registry (libs/transfer/transports.py)."""

import socket
import threading

import pytest

from libs.transfer.tcp.transport import TcpTransport
from libs.transfer.transports import TRANSPORTS, make_transport


def test_the_registry_names_tcp_and_rdma():
    assert {"tcp", "rdma"} <= set(TRANSPORTS)


def test_an_unknown_transport_is_refused_with_the_known_ones():
    with pytest.raises(ValueError) as e:
        make_transport("carrier-pigeon", "n")
    assert "carrier-pigeon" in str(e.value)
    assert all(name in str(e.value) for name in TRANSPORTS)


def test_tcp_builds_a_working_transport_and_closes_it():
    a = make_transport("tcp", "a", host="127.0.0.1", port=0, advertise_host="127.0.0.1")
    b = make_transport("tcp", "b")
    try:
        assert isinstance(a, TcpTransport) and a.address.startswith("127.0.0.1:")
        got = threading.Event()
        b.on_message("ping", lambda src, payload: got.set() if (src, payload) == ("a", b"hi") else None)
        b.admit_messages("a", a.address)  # b takes messages only from peers it names
        a.send_message("b", b.address, "ping", b"hi")
        assert got.wait(5)
    finally:
        a.close()
        b.close()
    host, port = b.address.rsplit(":", 1)
    with pytest.raises(OSError):  # closed: nothing listens there any more
        socket.create_connection((host, int(port)), timeout=1).close()


def test_rdma_needs_an_exchange():
    with pytest.raises(ValueError, match="exchange"):
        make_transport("rdma", "n")


def test_rdma_without_a_device_says_why():
    from libs.transfer.rdma import rdma_available

    ok, why = rdma_available()
    if ok:
        pytest.skip("an RDMA device is present")
    with pytest.raises(RuntimeError, match="rdma") as e:
        make_transport("rdma", "n", exchange=lambda peer, info: {})
    assert why in str(e.value)
