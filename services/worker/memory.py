"""The worker's hazard-aware memory orchestration (LLM-Mesh §6.3, sharing=mesh).

Every change of this worker's memory (a model's weights loaded or unloaded, an instance's KV
cache grown or shrunk) goes through :meth:`MemoryOrchestrator.change`: it issues the operation
to the pure reservation station of libs/planning/mesh.py (`issue`, `complete`, `abort`), which
decides; this class only carries the decisions out: it raises :class:`OutOfMemory` when the
optimistic budget refuses, waits while the operation sits in the reservation station (a
scale-up that could overrun memory before a scale-down under way has freed its part), runs the
change, and completes the operation, or takes it back when the change failed (which may refuse
waiting scale-ups, whose callers then get OutOfMemory).

The budget covers what this worker's engines hold: weights (on a CPU worker, the host buffers
the engine runs over) and KV caches. Nothing here evicts: §6.4's last resort (evict and
reschedule the request with the longest headroom) is not done; a request whose KV cannot be
granted is refused ("busy") before it joins instead.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Callable
from typing import Any

from prometheus_client import Counter, Gauge

from libs.planning.mesh import MemOp, MemoryState, abort, complete, issue

log = logging.getLogger(__name__)

CAPACITY = Gauge("layercast_worker_mesh_memory_capacity_bytes", "The memory this worker's engines may hold")
BUDGET = Gauge("layercast_worker_mesh_memory_budget_bytes",
               "Optimistic budget: every allocation at the size it is heading to (§6.3)")
TRACKED = Gauge("layercast_worker_mesh_memory_tracked_bytes",
                "Pessimistic tracking: what may be allocated now (a shrink under way at its old size)")
WAITS = Counter("layercast_worker_mesh_memory_waits_total",
                "Scale-ups that waited in the reservation station for a scale-down to complete")
REFUSALS = Counter("layercast_worker_mesh_memory_refusals_total",
                   "Scale-ups refused: the budget could not take them, or a scale-down they waited for failed")
ABORTS = Counter("layercast_worker_mesh_memory_aborts_total", "Memory changes that failed and were taken back")


class OutOfMemory(Exception):
    """The memory budget cannot take this change now (nothing was changed)."""


Apply = Callable[[], Any]  # the change itself: a plain call, or one returning an awaitable


class MemoryOrchestrator:
    """One worker's memory budget and tracking, and the operations under way (event-loop only)."""

    def __init__(self, capacity_bytes: int):
        if capacity_bytes <= 0:
            raise ValueError(f"memory capacity must be positive, got {capacity_bytes}")
        self.state = MemoryState(capacity=capacity_bytes)
        self.sizes: dict[str, int] = {}  # allocation -> bytes it holds (settled)
        self._locks: dict[str, asyncio.Lock] = {}  # one change at a time per allocation
        self._waiting: dict[str, asyncio.Future] = {}  # op id -> set when it leaves the reservation station
        self._n = 0
        self._publish()

    @property
    def capacity(self) -> int:
        return self.state.capacity

    @property
    def available(self) -> int:
        """What the optimistic budget still has free (what a scale-up may be granted)."""
        return self.state.capacity - self.state.budget

    def size(self, alloc_id: str) -> int:
        return self.sizes.get(alloc_id, 0)

    async def change(self, alloc_id: str, new_bytes: int, apply: Apply | None = None, *,
                     during: int | None = None) -> Any:
        """Change allocation `alloc_id` from its current size to `new_bytes` by running `apply()`
        (None: the caller allocates after, or has freed before, this returns); its result.

        `during`: the bytes the allocation holds while `apply` runs, when more than before and
        after (a KV resize copies into a new pool: old + new). The change is then charged as a
        growth to `during`, applied, and a shrink to `new_bytes` completed at once.

        Raises OutOfMemory (nothing changed) when refused; whatever `apply` raises after the
        operation is taken back (the allocation keeps its old size). Changes of one allocation
        run one at a time, in call order."""
        if new_bytes < 0:
            raise ValueError(f"an allocation cannot hold {new_bytes} bytes")
        lock = self._locks.setdefault(alloc_id, asyncio.Lock())
        async with lock:
            old = self.size(alloc_id)
            if during is not None and during > max(old, new_bytes):
                result = await self._run(alloc_id, old, during, apply)
                await self._run(alloc_id, during, new_bytes, None)  # freed when apply returned
                return result
            return await self._run(alloc_id, old, new_bytes, apply)

    async def release(self, alloc_id: str, apply: Apply | None = None) -> Any:
        """The allocation goes (to 0 bytes), by `apply()`; forgotten after."""
        result = await self.change(alloc_id, 0, apply)
        if self.sizes.get(alloc_id) == 0:
            del self.sizes[alloc_id]
            lock = self._locks.get(alloc_id)
            if lock is not None and not lock.locked():
                del self._locks[alloc_id]
        return result

    # --- one operation -----------------------------------------------------------------------
    async def _run(self, alloc_id: str, old: int, new: int, apply: Apply | None) -> Any:
        self._n += 1
        op = MemOp(f"{alloc_id}#{self._n}", old, new)
        state, ok, started = issue(self.state, op)
        if not ok:
            REFUSALS.inc()
            raise OutOfMemory(f"{alloc_id}: {old} -> {new} bytes does not fit the budget "
                              f"({self.state.budget} of {self.state.capacity} bytes)")
        self.state = state
        self._publish()
        if op not in started:
            WAITS.inc()
            waited = asyncio.get_running_loop().create_future()
            self._waiting[op.id] = waited
            log.debug("%s waits in the reservation station (tracked %d of %d bytes)", op.id, self.state.tracked,
                      self.state.capacity)
            try:
                await waited  # OutOfMemory when refused: its op is gone already
            except asyncio.CancelledError:
                self._waiting.pop(op.id, None)
                if op in self.state.waiting or op in self.state.running:
                    self._take_back(op)  # never applied, waiting or just started
                raise
        task = asyncio.ensure_future(_call(apply))
        try:
            result = await asyncio.shield(task)
        except asyncio.CancelledError:
            if task.done():
                self._settle(op, alloc_id, task)
            else:  # the change goes on (engine-thread work cannot be stopped): settle it when it ends
                task.add_done_callback(lambda t: self._settle(op, alloc_id, t))
            raise
        except BaseException:
            self._settle(op, alloc_id, task)
            raise
        self._settle(op, alloc_id, task)
        return result

    def _settle(self, op: MemOp, alloc_id: str, task: asyncio.Future) -> None:
        if task.cancelled() or task.exception() is not None:
            ABORTS.inc()
            log.warning("memory change %s (%d -> %d bytes) failed: taken back", op.id, op.old, op.new)
            self._take_back(op)
            return
        self.state, started = complete(self.state, op.id)
        self.sizes[alloc_id] = op.new
        self._wake(started, ())

    def _take_back(self, op: MemOp) -> None:
        self.state, started, refused = abort(self.state, op.id)
        self._wake(started, refused)

    def _wake(self, started: tuple[MemOp, ...], refused: tuple[MemOp, ...]) -> None:
        for o in started:
            waited = self._waiting.pop(o.id, None)
            if waited is not None and not waited.done():
                waited.set_result(None)
        for o in refused:
            REFUSALS.inc()
            waited = self._waiting.pop(o.id, None)
            if waited is not None and not waited.done():
                waited.set_exception(OutOfMemory(f"{o.id}: the scale-down it waited for failed"))
        self._publish()

    def _publish(self) -> None:
        CAPACITY.set(self.state.capacity)
        BUDGET.set(self.state.budget)
        TRACKED.set(self.state.tracked)


async def _call(apply: Apply | None) -> Any:
    if apply is None:
        return None
    result = apply()
    if inspect.isawaitable(result):
        result = await result
    return result
