"""Per-model routing table and admission queue of the gateway.

A request takes a slot on the least-loaded ready instance: an instance has as many slots as
its engine runs requests at once (its `max_batch`, at most `slots_per_instance`), so what no
engine can run yet waits here and goes to whichever instance frees a slot or joins first, new
capacity included, instead of queueing inside one busy engine. Instances whose blocks are still
arriving (serve-while-loading) get work only when every warm instance and pipeline is
saturated: their requests would wait for blocks. With no free slot
it waits in a bounded FIFO queue (full: 429), for at most `queue_timeout_s`
(then 503). Both carry a Retry-After. Waiting requests are the demand the
load-monitor sees, which is how a model at zero instances scales up.
"""

import asyncio
import time
from collections import deque
from dataclasses import dataclass, field

from services.gateway.errors import APIError


@dataclass
class Route:
    instance_id: str
    worker_id: str
    in_flight: int = 0
    loading: bool = False  # serving while its blocks still arrive
    slots: int = 1


@dataclass
class ModelRoutes:
    model: str
    max_queue: int
    slots_per_instance: int
    routes: dict[str, Route] = field(default_factory=dict)
    _waiters: deque[asyncio.Future] = field(default_factory=deque)
    arrivals: int = 0
    last_request_at: float | None = None

    @property
    def queued(self) -> int:
        return sum(1 for f in self._waiters if not f.done())

    @property
    def in_flight(self) -> int:
        return sum(r.in_flight for r in self.routes.values())

    def add(self, instance_id: str, worker_id: str, loading: bool = False, max_batch: int | None = None) -> None:
        slots = min(self.slots_per_instance, max_batch or self.slots_per_instance)
        route = self.routes.get(instance_id)
        if route is None:
            self.routes[instance_id] = Route(instance_id, worker_id, loading=loading, slots=slots)
        elif (route.loading and not loading) or route.slots != slots:
            route.loading, route.slots = route.loading and loading, slots
        else:
            return
        self._wake()

    def remove(self, instance_id: str) -> Route | None:
        return self.routes.pop(instance_id, None)

    def _free_route(self) -> Route | None:
        free = [r for r in self.routes.values() if r.in_flight < r.slots]
        return min(free, key=lambda r: (r.loading, r.in_flight, r.instance_id)) if free else None

    def _wake(self) -> None:
        while self._waiters:
            route = self._free_route()
            if route is None:
                return
            waiter = self._waiters.popleft()
            if waiter.done():
                continue
            route.in_flight += 1
            waiter.set_result(route)

    async def acquire(self, timeout_s: float) -> Route:
        """A slot on an instance; raises APIError 429 (queue full) or 503 (timed out)."""
        self.arrivals += 1
        self.last_request_at = time.time()
        route = self._free_route() if not self._waiters else None
        if route is not None:
            route.in_flight += 1
            return route
        if self.queued >= self.max_queue:
            raise APIError(429, f"the queue of model {self.model!r} is full ({self.max_queue} waiting); retry later",
                           code="queue_full", retry_after=1)
        waiter: asyncio.Future = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            return await asyncio.wait_for(asyncio.shield(waiter), timeout_s)
        except TimeoutError:
            if waiter.done() and not waiter.cancelled():
                return waiter.result()  # got a slot at the deadline: keep it
            waiter.cancel()
            raise APIError(503, f"no capacity for model {self.model!r} within {timeout_s:.0f}s; it is scaling up, "
                           "retry later", code="model_unavailable", retry_after=5) from None
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self.release(waiter.result())
            waiter.cancel()
            raise

    def release(self, route: Route) -> None:
        route.in_flight = max(0, route.in_flight - 1)
        self._wake()

    def fail_all(self, message: str) -> None:
        """The model went away: every waiter gets a 404."""
        while self._waiters:
            w = self._waiters.popleft()
            if not w.done():
                w.set_exception(APIError(404, message, param="model", code="model_not_found"))
