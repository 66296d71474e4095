"""Per-model routing table and admission queue of the gateway.

A request takes a slot on the least-loaded ready instance (one per choice when it asks for n > 1:
each runs as a row of its own): an instance has as many slots as
its engine runs requests at once (its `max_batch`, at most `slots_per_instance`), so what no
engine can run yet waits here and goes to whichever instance frees a slot or joins first, new
capacity included, instead of queueing inside one busy engine. Instances whose blocks are still
arriving (serve-while-loading) get work only when every warm instance and pipeline is
saturated: their requests would wait for blocks. With no free slot
it waits in a bounded FIFO queue (full: 429), for at most `queue_timeout_s`
(then 503). Both carry a Retry-After. Waiting requests are the demand the
load-monitor sees, which is how a model at zero instances scales up.

With sharing "mesh" (LLM-Mesh, many models on shared workers) the order is bin-packing
instead (§7.2): the instance with the largest batch that still has a free slot, CPU before CUDA
(§4), loading ones still last, so small fragments drain and are recycled after keep-alive. A mesh
worker refuses ("busy") a request that would push one of its requests past its SLO: its route
is then full at its current load (`refuse`) until one of its requests ends or REFUSAL_HOLD_S has
passed (time changes headroom), and the request tries the next route or waits here.
"""

import asyncio
import time
from collections import deque
from dataclasses import dataclass, field

from libs.planning.sharing import SharingSetting, sharing_setting
from services.gateway.errors import APIError

# How long a refused route stays full at its load with none of its requests ending: long
# enough not to ask its worker again per request, short against an SLO of seconds.
REFUSAL_HOLD_S = 0.2


@dataclass
class Route:
    instance_id: str
    worker_id: str
    in_flight: int = 0
    loading: bool = False  # serving while its blocks still arrive
    slots: int = 1
    device: str = "cpu"  # its entry worker's device kind ("cpu" or "cuda")
    # A worker's "busy" refusal: the route takes no more than `refused_load` slots until
    # `refused_until` (monotonic seconds); None: not refused.
    refused_load: int | None = None
    refused_until: float = 0.0
    added_at: float = field(default_factory=time.monotonic)  # when an event or a resync first routed to it

    def capacity(self, now: float) -> int:
        """The slots it may fill now: all, or only its load when refused (a request that ends
        frees one below it)."""
        if self.refused_load is not None and now < self.refused_until:
            return min(self.slots, self.refused_load)
        return self.slots


@dataclass
class ModelRoutes:
    model: str
    max_queue: int
    slots_per_instance: int
    sharing: str = "exclusive"  # a name of libs.planning.sharing.SHARINGS: how a request picks its instance
    routes: dict[str, Route] = field(default_factory=dict)
    _waiters: deque[tuple[asyncio.Future, int]] = field(default_factory=deque)  # (waiter, slots it needs)
    arrivals: int = 0
    last_request_at: float | None = None

    def __post_init__(self):
        self.setting: SharingSetting = sharing_setting(self.sharing)

    @property
    def queued(self) -> int:
        return sum(1 for f, _ in self._waiters if not f.done())

    @property
    def in_flight(self) -> int:
        return sum(r.in_flight for r in self.routes.values())

    def add(self, instance_id: str, worker_id: str, loading: bool = False, max_batch: int | None = None,
            device: str = "cpu") -> None:
        slots = min(self.slots_per_instance, max_batch or self.slots_per_instance)
        route = self.routes.get(instance_id)
        if route is None:
            self.routes[instance_id] = Route(instance_id, worker_id, loading=loading, slots=slots, device=device)
        elif (route.loading and not loading) or route.slots != slots or route.device != device:
            route.loading, route.slots, route.device = route.loading and loading, slots, device
        else:
            return
        self._wake()

    def remove(self, instance_id: str) -> Route | None:
        return self.routes.pop(instance_id, None)

    @staticmethod
    def charge(route: Route, weight: int) -> int:
        """The slots `weight` choices take on `route`: all of it at most (more than an instance has
        go to one whole, whose worker refuses them if its engine cannot run them at once)."""
        return min(weight, route.slots)

    def _free_route(self, weight: int = 1) -> Route | None:
        now = time.monotonic()
        free = [r for r in self.routes.values() if r.in_flight + self.charge(r, weight) <= r.capacity(now)]
        if not free:
            return None
        route_key = self.setting.route_key
        return min(free, key=lambda r: (r.loading, *route_key(r.device, r.in_flight, r.instance_id)))

    def _wake(self) -> None:
        while self._waiters:
            waiter, weight = self._waiters[0]
            if waiter.done():
                self._waiters.popleft()
                continue
            route = self._free_route(weight)
            if route is None:
                return  # first come, first served: the head waits for room for all its choices
            self._waiters.popleft()
            route.in_flight += self.charge(route, weight)
            waiter.set_result(route)

    async def acquire(self, timeout_s: float, weight: int = 1, admitted: bool = False) -> Route:
        """Slots for `weight` choices on one instance; raises APIError 429 (queue full) or 503 (timed out).

        `admitted`: the request was admitted before (refused elsewhere as "busy", its instance
        stopping, or handed over from a failed or switched instance): it is no new arrival, is
        never turned away as the queue is full, and waits at the queue's head, before requests
        that came after it."""
        if not admitted:
            self.arrivals += 1
            self.last_request_at = time.time()
        route = self._free_route(weight) if admitted or not self._waiters else None
        if route is not None:
            route.in_flight += self.charge(route, weight)
            return route
        if self.queued >= self.max_queue and not admitted:
            raise APIError(429, f"the queue of model {self.model!r} is full ({self.max_queue} waiting); retry later",
                           code="queue_full", retry_after=1)
        waiter: asyncio.Future = asyncio.get_running_loop().create_future()
        if admitted:
            self._waiters.appendleft((waiter, weight))
        else:
            self._waiters.append((waiter, weight))
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
                self.release(waiter.result(), weight)
            waiter.cancel()
            raise

    def release(self, route: Route, weight: int = 1) -> None:
        route.in_flight = max(0, route.in_flight - self.charge(route, weight))
        self._wake()

    def refuse(self, route: Route, weight: int = 1, hold_s: float = REFUSAL_HOLD_S) -> None:
        """Its worker refused a request ("busy") that held `weight` choices' slots there: free
        them, and take no more there than it runs now until one of its requests ends or
        `hold_s` passes. The route stays: the refusal is no failure."""
        route.in_flight = max(0, route.in_flight - self.charge(route, weight))
        route.refused_load = route.in_flight
        route.refused_until = until = time.monotonic() + hold_s

        def expire() -> None:
            if route.refused_until == until:  # not refused again since
                route.refused_load = None
            self._wake()

        asyncio.get_running_loop().call_later(hold_s, expire)
        self._wake()  # the head may fit elsewhere

    def fail_all(self, message: str) -> None:
        """The model went away: every waiter gets a 404."""
        while self._waiters:
            w, _ = self._waiters.popleft()
            if not w.done():
                w.set_exception(APIError(404, message, param="model", code="model_not_found"))
