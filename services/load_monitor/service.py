"""Load-monitor: watches demand per model and asks the planner for a number
of instances. The whole decision (windows, the deployment's policy, the
hysteresis around it) is the pure state machine libs.planning.autoscale; this
service feeds it metrics every tick and sends the ScaleRequests it returns.

Each tick's sample per model comes from the gateways' reports through
libs.planning.demand.GatewayReports: requests queued and in flight, the demand
in tokens/s (``load_tps`` = completion tokens streamed per second + the output
tokens the queued requests asked for / ``drain_s``; the threshold policy's
load) and the TTFT/TPOT observations reported since the previous tick (the SLO
policy's), each in exactly one tick's sample. The scale-down delay is per
deployment (policy parameter ``scale_down_delay_s``); ``scale_down_delay_s``
here is the cluster's, for policies without a scale-down timeout of their own."""

import logging
import time

from opentelemetry import trace
from opentelemetry.context import Context
from prometheus_client import Counter, Gauge

from libs.planning import autoscale
from libs.planning.demand import GatewayReports, ModelReport
from libs.protocol import messages as m
from libs.protocol import subjects
from libs.bus.broker import call, on_event, publish
from libs.telemetry import tracer
from services.common.runner import EndedInstances, Service

log = logging.getLogger(__name__)

DESIRED = Gauge("layercast_load_monitor_desired_instances", "Instances the policy asks for", ["model"])
DEMAND = Gauge("layercast_load_monitor_demand_requests", "Queued plus in-flight requests", ["model"])
LOAD = Gauge("layercast_load_monitor_demand_tokens_per_second",
             "Demand in tokens/s: completion tokens streamed per second plus queued output tokens to drain",
             ["model"])
# The cluster's scale-in delay for policies without a scale-down timeout of their own
# (concurrency): a few seconds, so a dip (a gateway restart, a lull between bursts) does not
# flap 1 -> 2 -> 1.
DEFAULT_SCALE_DOWN_DELAY_S = 5.0
SCALE_REQUESTS = Counter("layercast_load_monitor_scale_requests_total", "Scale requests sent to the planner",
                         ["model", "direction"])
_tracer = tracer("load_monitor")


deployment = autoscale.deployment_of  # the name callers used


class LoadMonitorService(Service):
    name = "load_monitor"

    def __init__(self, nats_url: str | None = None, tick_s: float = 0.1, window_s: float = 10.0,
                 target_concurrency: int = 8, resend_s: float = 2.0,
                 scale_down_delay_s: float = DEFAULT_SCALE_DOWN_DELAY_S, drain_s: float = 1.0, gateway_stale_s: float = 5.0):
        super().__init__(nats_url)
        self.tick_s, self.window_s, self.resend_s = tick_s, window_s, resend_s
        # A scale-in is asked for only once the policy has wanted it this long without a break,
        # where the deployment's policy has no scale-down timeout of its own and the deployment
        # sets no scale_down_delay_s (damps flapping between bursts; threshold keeps its own
        # sub-second timeout).
        self.scale_down_delay_s = scale_down_delay_s
        self.target_concurrency = target_concurrency
        # The concurrency policy's target where a deployment sets none is the cluster's.
        self.state = autoscale.AutoscaleState(autoscale.AutoscaleConfig(
            window_s=window_s, scale_down_delay_s=scale_down_delay_s, resend_s=resend_s,
            defaults={"concurrency": {"target": target_concurrency}}))
        self.models: dict[str, m.ModelInfo] = {}
        self.live: dict[str, tuple[str, m.InstanceState]] = {}  # instance_id -> (model, state)
        self.ended = EndedInstances()
        # Latest report of each gateway, per model (several gateways add up), and the latency
        # samples no tick has taken yet.
        self.reports = GatewayReports(drain_s=drain_s, stale_s=gateway_stale_s)
        self._synced = False
        self._subscribe()

    def healthy(self) -> bool:
        return self._synced

    def background(self) -> list:
        return [self.every(lambda: 5.0 if self._synced else 0.5, self.sync, "registry sync", first_now=True),
                self.every(self.tick_s, self.tick, "tick")]

    async def sync(self) -> None:
        view = await call(self.broker, subjects.REGISTRY_CLUSTER, m.GetCluster(recent_scale_ops=0), m.ClusterView)
        self.models = {info.name: info for info in view.models}
        self.live = {i.instance_id: (i.model, i.state) for i in view.instances if i.state in
                     (m.InstanceState.loading, m.InstanceState.ready) and i.instance_id not in self.ended}
        self._synced = True

    def current_instances(self, model: str) -> int:
        return sum(1 for name, _ in self.live.values() if name == model)

    def observe(self, now: float) -> autoscale.Observation:
        # Gateway reports are timed on this process's monotonic clock (a tick's `now` may be given).
        received = time.monotonic()
        self.reports.forget(self.models)
        observed = {}
        for name, info in self.models.items():
            demand = self.reports.take(name, received)
            states = [state for model, state in self.live.values() if model == name]
            observed[name] = autoscale.model_observation(info, now, states, demand.requests, demand.load_tps,
                                                         demand.ttft_s, demand.tpot_s, demand.last_requests)
        return autoscale.Observation(observed)

    async def tick(self, now: float | None = None) -> None:
        now = now or time.time()
        # The step is synchronous: a tick that starts while this one publishes sees its state.
        self.state, decisions = autoscale.step(self.state, self.observe(now), now)
        for name, s in self.state.models.items():
            DESIRED.labels(name).set(s.desired)
            DEMAND.labels(name).set(s.demand)
            if s.samples:
                LOAD.labels(name).set(s.samples[-1].load_tps)
        for d in decisions:
            log.info("scale %s: %d -> %d (%s)", d.model, d.current, d.desired, d.reason)
            SCALE_REQUESTS.labels(d.model, d.direction).inc()
            # The root of the scale operation's trace: the planner, the workers' loads and
            # transfers and the instances becoming ready all hang under it. A root even when the
            # tick runs inside a (quiet, untraced) metrics handler.
            with _tracer.start_as_current_span("load_monitor.scale_request", context=Context(),
                                               kind=trace.SpanKind.PRODUCER, attributes={
                    "layercast.model": d.model, "layercast.direction": d.direction,
                    "layercast.from_instances": d.current, "layercast.to_instances": d.desired,
                    "layercast.reason": d.reason}):
                await publish(self.broker, subjects.SCALE_REQUEST,
                              m.ScaleRequest(model=d.model, desired_instances=d.desired, reason=d.reason))

    def _subscribe(self) -> None:
        b = self.broker

        @b.subscriber(subjects.METRICS_GATEWAY)
        @on_event(m.GatewayMetrics)
        async def gateway_metrics(ev: m.GatewayMetrics) -> None:
            self.reports.add(ev.gateway_id, time.monotonic(), (
                (x.model, ModelReport(queued=x.queued, in_flight=x.in_flight, tokens_generated=x.tokens_generated,
                                      queued_tokens=x.queued_tokens, interval_s=ev.interval_s,
                                      last_request_at=x.last_request_at, ttft_s=tuple(x.ttft_s),
                                      tpot_s=tuple(x.tpot_s)))
                for x in ev.models))
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
            # A (re)deployed model starts afresh; a deleted one is forgotten at the next tick.
            self.state = self.state.without(ev.model.name)
            if ev.kind == "deployed":
                self.models[ev.model.name] = ev.model
            else:
                self.models.pop(ev.model.name, None)
