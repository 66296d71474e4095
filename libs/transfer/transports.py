"""The data-plane transports a worker can run, by name (`--transport`).

Every factory takes the same keyword arguments and uses those its transport needs: tcp
listens on host:port and tells peers advertise_host (and paces its block sends to egress_mbit
where given: emulation without root); rdma reaches peers through `exchange`
(the connection handshake, over the control plane) on `rdma_device`. The rdma package loads
pyverbs, an optional extra, so it is imported only when asked for.
"""

from collections.abc import Callable

from libs.transfer.base import Transport
from libs.transfer.tcp.transport import TcpTransport

Exchange = Callable[[str, dict], dict]  # (peer, our connection info) -> the peer's


def _tcp(node_id: str, *, host: str = "127.0.0.1", port: int = 0, advertise_host: str | None = None,
         exchange: Exchange | None = None, rdma_device: str | None = None, egress_mbit: float = 0.0) -> Transport:
    return TcpTransport(node_id, host, port, advertise_host=advertise_host, egress_mbit=egress_mbit)


def _rdma(node_id: str, *, host: str = "127.0.0.1", port: int = 0, advertise_host: str | None = None,
          exchange: Exchange | None = None, rdma_device: str | None = None, egress_mbit: float = 0.0) -> Transport:
    if egress_mbit:
        raise ValueError("the rdma transport is not paced in process: emulate its links with tc")
    if exchange is None:
        raise ValueError("the rdma transport needs an exchange (the connection handshake with peers)")
    from libs.transfer.rdma import RdmaTransport, rdma_available

    ok, why = rdma_available(rdma_device)
    if not ok:
        raise RuntimeError(f"--transport rdma: {why}")
    return RdmaTransport(node_id, exchange, device_name=rdma_device)


TRANSPORTS: dict[str, Callable[..., Transport]] = {"tcp": _tcp, "rdma": _rdma}


def make_transport(name: str, node_id: str, *, host: str = "127.0.0.1", port: int = 0,
                   advertise_host: str | None = None, exchange: Exchange | None = None,
                   rdma_device: str | None = None, egress_mbit: float = 0.0) -> Transport:
    """The transport called `name` (a key of TRANSPORTS), started for `node_id`."""
    factory = TRANSPORTS.get(name)
    if factory is None:
        raise ValueError(f"unknown transport {name!r}: one of {', '.join(TRANSPORTS)}")
    return factory(node_id, host=host, port=port, advertise_host=advertise_host, exchange=exchange,
                   rdma_device=rdma_device, egress_mbit=egress_mbit)
