"""pyverbs, imported lazily: whether RDMA is usable here, and the verbs surface the transport uses.

pyverbs (rdma-core's Python bindings, the ``rdma`` extra) is imported only when
:func:`load_verbs` runs, so this module imports on machines without it.
:func:`load_verbs` is also the seam the tests replace with a fake verbs layer;
callers look it up on this module at call time so one patch reaches them all.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any

from libs.transfer.errors import TransferError

log = logging.getLogger(__name__)


def _import_failure(exc: ImportError) -> str:
    if isinstance(exc, ModuleNotFoundError) and (exc.name or "").split(".")[0] == "pyverbs":
        return "pyverbs is not installed (pip install 'layercast[rdma]', which builds rdma-core's Python bindings)"
    return (f"pyverbs is installed but does not load ({exc}); its build must match the system's "
            f"rdma-core/libibverbs version")


def load_verbs() -> SimpleNamespace:
    """The pyverbs classes and constants the transport uses; TransferError with the reason if unavailable."""
    try:
        import pyverbs.device as device
        from pyverbs.addr import GID, AHAttr, GlobalRoute
        from pyverbs.cq import CQ, CompChannel
        from pyverbs.mr import MR
        from pyverbs.pd import PD
        from pyverbs.pyverbs_error import PyverbsError
        from pyverbs.qp import QP, QPAttr, QPCap, QPInitAttr
        from pyverbs.wr import SGE, RecvWR, SendWR
        try:
            import pyverbs.libibverbs_enums as enums
        except ImportError:  # rdma-core before v37 named the module pyverbs.enums
            import pyverbs.enums as enums
        try:
            from pyverbs.cq import cqe_status_to_str
        except ImportError:
            cqe_status_to_str = None
    except ImportError as exc:
        raise TransferError(_import_failure(exc)) from exc

    def status_text(status: int) -> str:
        if cqe_status_to_str is not None:
            try:
                return f"{cqe_status_to_str(status)} (status {status})"
            except Exception:
                pass
        return f"completion status {status}"

    return SimpleNamespace(device=device, GID=GID, AHAttr=AHAttr, GlobalRoute=GlobalRoute, CQ=CQ,
                           CompChannel=CompChannel, MR=MR, PD=PD, PyverbsError=PyverbsError, QP=QP,
                           QPAttr=QPAttr, QPCap=QPCap, QPInitAttr=QPInitAttr, SGE=SGE, RecvWR=RecvWR,
                           SendWR=SendWR, e=enums, status_text=status_text)


def device_names(v: SimpleNamespace) -> list[str]:
    """Names of the RDMA devices present, from the verbs namespace `load_verbs` returned."""
    names = []
    for dev in v.device.get_device_list():
        name = dev.name
        names.append(name.decode() if isinstance(name, bytes) else str(name))
    return names


def rdma_available(device_name: str | None = None) -> tuple[bool, str]:
    """(True, devices) when pyverbs loads and an RDMA device (the named one, if given) exists; else (False, why)."""
    try:
        v = load_verbs()
    except TransferError as exc:
        return False, str(exc)
    try:
        names = device_names(v)
    except Exception as exc:  # libibverbs fails the listing when no RDMA driver is loaded at all
        return False, (f"pyverbs loads but listing RDMA devices failed ({exc}): no RDMA NIC, "
                       f"rxe or siw device is configured")
    if not names:
        return False, "pyverbs loads but no RDMA device is present (ibv_get_device_list found none)"
    if device_name is not None and device_name not in names:
        return False, f"RDMA device {device_name!r} not found (present: {', '.join(names)})"
    return True, f"RDMA device(s): {', '.join(names)}"


def close_quietly(obj: Any) -> None:
    """Close a verbs object (MR, QP, CQ, ...) if there is one, logging rather than raising on failure."""
    if obj is None:
        return
    try:
        obj.close()
    except Exception as exc:  # teardown goes on; the kernel reclaims what is left at exit
        log.debug("closing %s failed: %s", type(obj).__name__, exc)
