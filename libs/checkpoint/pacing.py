"""Emulation only: pace host -> device copies to an emulated PCIe rate.

On a CPU-only worker the engine's memory stands for the GPU, and a memcpy into
it runs at memory speed: no OS knob throttles it. To keep an emulated cluster's
ratios (network ~10x disk, PCIe ~1.25x network), each copy from the host tier
waits until a serial link of `rate_mbit` would have finished it. Off (None)
outside emulation.
"""

from __future__ import annotations

import threading
import time


class HostToDevicePacer:
    """One serial link at `rate_mbit` (1e6 bits/s): copies queue behind each other."""

    def __init__(self, rate_mbit: float) -> None:
        if rate_mbit <= 0:
            raise ValueError("rate_mbit must be > 0")
        self.rate_mbit = rate_mbit
        self._bytes_per_s = rate_mbit * 1e6 / 8
        self._free_at = 0.0  # monotonic time the link finishes what it has been given
        self._lock = threading.Lock()

    def pace(self, nbytes: int) -> float:
        """Block until a copy of nbytes, queued behind earlier ones, completes. Returns seconds waited."""
        start = time.monotonic()
        with self._lock:  # bookkeeping only: sleeping here would serialize callers' wake-ups too
            done_at = max(start, self._free_at) + nbytes / self._bytes_per_s
            self._free_at = done_at
        wait = done_at - start
        if wait > 0:
            time.sleep(wait)
        return wait


def make_pacer(rate_mbit: float) -> HostToDevicePacer | None:
    """A pacer at rate_mbit, or None (off) for a rate <= 0."""
    return HostToDevicePacer(rate_mbit) if rate_mbit and rate_mbit > 0 else None
