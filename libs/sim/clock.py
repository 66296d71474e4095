"""The simulator's clock and event queue: deterministic, single-threaded.

Events run in time order; events at the same time run in the order they were scheduled
(a sequence number breaks ties), so a run depends on nothing but its inputs and its seed.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from typing import Any

__all__ = ["EventQueue"]


class EventQueue:
    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable[..., Any], tuple]] = []
        self._seq = 0
        self.processed = 0

    def at(self, t: float, fn: Callable[..., Any], *args: Any) -> None:
        """Run fn(*args) at time t (never before now)."""
        self._seq += 1
        heapq.heappush(self._heap, (max(t, self.now), self._seq, fn, args))

    def after(self, dt: float, fn: Callable[..., Any], *args: Any) -> None:
        self.at(self.now + dt, fn, *args)

    def run(self, until: float = float("inf"), progress: Callable[[float], None] | None = None) -> None:
        every = 0
        while self._heap and self._heap[0][0] <= until:
            t, _, fn, args = heapq.heappop(self._heap)
            self.now = t
            fn(*args)
            self.processed += 1
            every += 1
            if progress is not None and every >= 20000:
                every = 0
                progress(t)

    def __len__(self) -> int:
        return len(self._heap)
