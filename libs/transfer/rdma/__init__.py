"""RDMA data plane through pyverbs (an optional extra, imported lazily).

Modules: :mod:`.codec` (wire format, pure), :mod:`.memory` (memory regions),
:mod:`.verbs` (loading pyverbs, device discovery), :mod:`.transport`
(:class:`RdmaTransport`). The names below are resolved on first use, so importing
this package (or just its codec) loads neither pyverbs nor the transport.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from libs.transfer.rdma.codec import ConnectionInfo, RdmaProtocolError
    from libs.transfer.rdma.memory import MrCache
    from libs.transfer.rdma.transport import RdmaTransport
    from libs.transfer.rdma.verbs import rdma_available

_EXPORTS = {
    "ConnectionInfo": "codec",
    "RdmaProtocolError": "codec",
    "MrCache": "memory",
    "RdmaTransport": "transport",
    "rdma_available": "verbs",
}

__all__ = ["ConnectionInfo", "MrCache", "RdmaProtocolError", "RdmaTransport", "rdma_available"]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
