"""Load-monitor: watches demand per model and asks the planner for a number
of instances. The decision itself is a pure policy from libs.planning.policies;
this service only keeps the windows and sends ScaleRequests."""

import asyncio
import logging
import time
from collections import deque
from dataclasses import dataclass, field

from opentelemetry import trace
from opentelemetry.context import Context
from prometheus_client import Counter, Gauge

from libs.planning.policies import ConcurrencyPolicy, MetricsSample, concurrency_policy
from libs.protocol import messages as m
from libs.protocol import subjects
from libs.bus.broker import call, on_event, publish
from libs.telemetry import tracer
from services.common.runner import EndedInstances, Service

log = logging.getLogger(__name__)

DESIRED = Gauge("layercast_load_monitor_desired_instances", "Instances the policy asks for", ["model"])
DEMAND = Gauge("layercast_load_monitor_demand_requests", "Queued plus in-flight requests", ["model"])
SCALE_REQUESTS = Counter("layercast_load_monitor_scale_requests_total", "Scale requests sent to the planner",
                         ["model", "direction"])
_tracer = tracer("load_monitor")


@dataclass
class ModelWindow:
    model: m.ModelInfo
    samples: deque[MetricsSample] = field(default_factory=lambda: deque(maxlen=1200))
    last_request_at: float | None = None
    last_sent: tuple[int, float] | None = None  # (desired, when)
    below_since: float | None = None  # since when the policy has wanted fewer instances than run


class LoadMonitorService(Service):
    name = "load_monitor"

    def __init__(self, nats_url: str | None = None, tick_s: float = 0.1, window_s: float = 10.0,
                 target_concurrency: int = 8, resend_s: float = 2.0, scale_down_delay_s: float = 0.0):
        super().__init__(nats_url)
        self.tick_s, self.window_s, self.resend_s = tick_s, window_s, resend_s
        # A scale-in is asked for only once the policy has wanted it this long without a break
        # (BlitzScale keeps it sub-second; longer damps flapping between bursts).
        self.scale_down_delay_s = scale_down_delay_s
        self.target_concurrency = target_concurrency
        self.models: dict[str, ModelWindow] = {}
        self.live: dict[str, tuple[str, m.InstanceState]] = {}  # instance_id -> (model, state)
        self.ended = EndedInstances()
        # Latest report of each gateway, per model: several gateways add up.
        self._gateways: dict[str, dict[str, m.ModelLoad]] = {}
        self._synced = False
        self._subscribe()

    def healthy(self) -> bool:
        return self._synced

    def background(self) -> list:
        return [self._sync_loop(), self._tick_loop()]

    def policy(self, model: m.ModelInfo) -> ConcurrencyPolicy:
        # The deployment sets the bounds and keep-alive; the target is the cluster's.
        return ConcurrencyPolicy(target=self.target_concurrency, min_instances=model.min_instances,
                                 max_instances=model.max_instances, keep_alive_s=model.keep_alive_s)

    async def sync(self) -> None:
        view = await call(self.broker, subjects.REGISTRY_CLUSTER, m.GetCluster(recent_scale_ops=0), m.ClusterView)
        names = {x.name for x in view.models}
        for info in view.models:
            w = self.models.setdefault(info.name, ModelWindow(info))
            w.model = info
        for name in list(self.models):
            if name not in names:
                del self.models[name]
        self.live = {i.instance_id: (i.model, i.state) for i in view.instances if i.state in
                     (m.InstanceState.loading, m.InstanceState.ready) and i.instance_id not in self.ended}
        self._synced = True

    async def _sync_loop(self) -> None:
        while True:
            try:
                await self.sync()
            except Exception as e:
                log.warning("registry sync failed: %s", e)
            await asyncio.sleep(5.0 if self._synced else 0.5)

    def current_instances(self, model: str) -> int:
        return sum(1 for name, _ in self.live.values() if name == model)

    def sample(self, name: str, now: float) -> MetricsSample:
        loads = [g[name] for g in self._gateways.values() if name in g]
        states = [state for model, state in self.live.values() if model == name]
        return MetricsSample(t=now, ready=states.count(m.InstanceState.ready),
                             warming=states.count(m.InstanceState.loading),
                             in_flight=sum(x.queued + x.in_flight for x in loads))

    async def tick(self, now: float | None = None) -> None:
        now = now or time.time()
        for name, w in self.models.items():
            w.samples.append(self.sample(name, now))
            while w.samples and w.samples[0].t < now - self.window_s:
                w.samples.popleft()
            current = self.current_instances(name)
            desired = concurrency_policy(list(w.samples), self.policy(w.model), last_request_at=w.last_request_at)
            DESIRED.labels(name).set(desired)
            DEMAND.labels(name).set(w.samples[-1].in_flight)
            if desired >= current:
                w.below_since = None
            if desired == current:
                w.last_sent = None
                continue
            if 0 < desired < current:
                # Scale-ins wait out the delay (a burst's dips do not flap instances); the
                # scale to zero has waited for the model's keep-alive already.
                w.below_since = w.below_since or now
                if now - w.below_since < self.scale_down_delay_s:
                    continue
            # Repeat the request while the mismatch lasts (the planner reconciles idempotently).
            if w.last_sent and w.last_sent[0] == desired and now - w.last_sent[1] < self.resend_s:
                continue
            reason = (f"demand {w.samples[-1].in_flight} queued or in flight, {current} instance(s)"
                      if desired > current else
                      f"idle for {now - (w.last_request_at or now):.1f}s (keep-alive {w.model.keep_alive_s}s)")
            log.info("scale %s: %d -> %d (%s)", name, current, desired, reason)
            direction = "up" if desired > current else "down"
            SCALE_REQUESTS.labels(name, direction).inc()
            # The root of the scale operation's trace: the planner, the workers' loads and
            # transfers and the instances becoming ready all hang under it. A root even when the
            # tick runs inside a (quiet, untraced) metrics handler.
            with _tracer.start_as_current_span("load_monitor.scale_request", context=Context(),
                                               kind=trace.SpanKind.PRODUCER, attributes={
                    "layercast.model": name, "layercast.direction": direction, "layercast.from_instances": current,
                    "layercast.to_instances": desired, "layercast.reason": reason}):
                await publish(self.broker, subjects.SCALE_REQUEST,
                              m.ScaleRequest(model=name, desired_instances=desired, reason=reason))
            w.last_sent = (desired, now)

    async def _tick_loop(self) -> None:
        while True:
            await asyncio.sleep(self.tick_s)
            try:
                await self.tick()
            except Exception:
                log.exception("load-monitor tick failed")

    def _subscribe(self) -> None:
        b = self.broker

        @b.subscriber(subjects.METRICS_GATEWAY)
        @on_event(m.GatewayMetrics)
        async def gateway_metrics(ev: m.GatewayMetrics) -> None:
            self._gateways[ev.gateway_id] = {x.model: x for x in ev.models}
            for x in ev.models:
                w = self.models.get(x.model)
                if w is not None and x.last_request_at is not None:
                    w.last_request_at = max(w.last_request_at or 0.0, x.last_request_at)
            if any(x.queued and x.ready_instances == 0 for x in ev.models):
                await self.tick()  # demand for a cold model: act now, not at the next tick

        @b.subscriber(subjects.EVENT_INSTANCE)
        @on_event(m.InstanceEvent)
        async def instance(ev: m.InstanceEvent) -> None:
            i = ev.instance
            if i.state in (m.InstanceState.loading, m.InstanceState.ready):
                if i.instance_id not in self.ended:
                    self.live[i.instance_id] = (i.model, i.state)
            else:
                self.ended.mark(i.instance_id)
                self.live.pop(i.instance_id, None)

        @b.subscriber(subjects.EVENT_MODEL)
        @on_event(m.ModelEvent)
        async def model(ev: m.ModelEvent) -> None:
            if ev.kind == "deployed":
                self.models[ev.model.name] = ModelWindow(ev.model)
            else:
                self.models.pop(ev.model.name, None)
