"""Memory registrations for RDMA: reference-counted memory regions over the block buffers themselves.

Registering pins the pages and can take milliseconds, so a buffer's region is
shared by every transfer that uses it and deregistered when the last one lets go.
The registering call is injected (a pyverbs ``MR`` in the transport), so the
cache runs without pyverbs.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from libs.transfer.errors import TransferError
from libs.transfer.rdma.verbs import close_quietly


def buffer_address(view: memoryview | bytearray | bytes | np.ndarray) -> int:
    """Virtual address of the first byte of a contiguous buffer (read-only buffers too)."""
    arr = view if isinstance(view, np.ndarray) else np.frombuffer(view, dtype=np.uint8)
    if not arr.flags.c_contiguous:
        raise ValueError("buffer must be contiguous")
    return int(arr.ctypes.data)


@dataclass(eq=False)
class Registration:
    """One registered memory region over a buffer, shared by the transfers that use it."""

    addr: int
    length: int
    access: int
    lkey: int
    rkey: int
    handle: Any
    owner: Any = field(repr=False, default=None)  # keeps the memory alive (and its address unreused)
    refs: int = 0


class MrCache:
    """Reference-counted memory registrations keyed by (address, length).

    `register(addr, length, access)` returns an object with `lkey`, `rkey` and
    `close()` (a pyverbs MR). A registration whose access flags include what is
    asked for is shared; the last release deregisters it.
    """

    def __init__(self, register: Callable[[int, int, int], Any]) -> None:
        self._register = register
        self._regs: dict[tuple[int, int], list[Registration]] = {}
        self._lock = threading.Lock()
        self._closed = False

    def acquire(self, view: memoryview, access: int, owner: Any = None) -> Registration:
        length = len(view)
        if length == 0:
            raise ValueError("cannot register an empty buffer")
        addr = buffer_address(view)
        # Registration pins pages and can take milliseconds; holding the lock keeps one MR per buffer.
        with self._lock:
            if self._closed:
                raise TransferError("memory registrations are closed")
            for reg in self._regs.get((addr, length), ()):
                if reg.access & access == access:
                    reg.refs += 1
                    return reg
            try:
                handle = self._register(addr, length, access)
            except TransferError:
                raise
            except Exception as exc:
                raise TransferError(f"registering {length} bytes at {addr:#x} for RDMA failed: {exc}") from exc
            reg = Registration(addr, length, access, int(handle.lkey), int(handle.rkey), handle,
                               owner if owner is not None else view, 1)
            self._regs.setdefault((addr, length), []).append(reg)
            return reg

    def lookup(self, view: memoryview, access: int) -> Registration | None:
        """The registration `acquire` would share for `view`, without taking a reference."""
        if len(view) == 0:
            return None
        addr = buffer_address(view)
        with self._lock:
            for reg in self._regs.get((addr, len(view)), ()):
                if reg.access & access == access:
                    return reg
        return None

    def release(self, reg: Registration) -> None:
        with self._lock:
            reg.refs -= 1
            if reg.refs > 0:
                return
            regs = self._regs.get((reg.addr, reg.length), [])
            if reg not in regs:
                return  # closed already
            regs.remove(reg)
            if not regs:
                del self._regs[(reg.addr, reg.length)]
        close_quietly(reg.handle)
        reg.owner = None

    def close_all(self) -> None:
        with self._lock:
            self._closed = True
            regs = [r for rs in self._regs.values() for r in rs]
            self._regs.clear()
        for reg in regs:
            close_quietly(reg.handle)
            reg.owner = None

    def __len__(self) -> int:
        with self._lock:
            return sum(len(rs) for rs in self._regs.values())
