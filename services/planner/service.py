"""Planner: turns scale requests into scale operations.

A ScaleRequest names the desired number of instances; the planner reconciles
against the registry's view (one operation at a time per model), picks
targets or victims with the pure functions of libs.planning.placement, records
the operation in the registry, commands the workers, and follows their
instance events to close the operation.
"""

import asyncio
import logging
import time
import uuid
from collections import defaultdict

from opentelemetry import trace
from prometheus_client import Counter, Gauge, Histogram

from libs.planning.placement import Candidate, Held, LiveInstance, pick_targets, pick_victims
from libs.protocol import messages as m
from libs.protocol import subjects
from libs.protocol.bus import RemoteError, call, on_event, publish
from libs.telemetry import tracer
from services.common.runner import Service

log = logging.getLogger(__name__)
_tracer = tracer("planner")

SCALE_OPS = Counter("layercast_planner_scale_operations_total", "Scale operations finished",
                    ["model", "direction", "outcome"])
SCALE_DURATION = Histogram("layercast_planner_scale_operation_duration_seconds",
                           "Scale decision (load-monitor) to the operation's end: every target ready or failed",
                           ["model", "direction"], buckets=(0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300))
OPEN_OPS = Gauge("layercast_planner_open_scale_operations", "Scale-ups waiting for their instances")

LIVE = (m.InstanceState.loading, m.InstanceState.ready)


class PlannerService(Service):
    name = "planner"

    def __init__(self, nats_url: str | None = None, drain_timeout_s: float = 30.0):
        super().__init__(nats_url)
        self.drain_timeout_s = drain_timeout_s
        self._locks: dict[str, asyncio.Lock] = defaultdict(asyncio.Lock)
        self._open_ops: dict[str, m.ScaleOpInfo] = {}  # scale_op_id -> op waiting for instances
        self._op_spans: dict[str, trace.Span] = {}  # scale_op_id -> its span, ended with the op
        self._waiting: dict[str, str] = {}  # instance_id -> scale_op_id
        self._load: dict[str, int] = {}  # worker_id -> running requests (worker metrics)
        self._subscribe()

    async def reconcile(self, req: m.ScaleRequest) -> m.ScaleOpInfo | None:
        """Bring the model to `req.desired_instances`; returns the operation started, if any."""
        async with self._locks[req.model]:
            view = await call(self.broker, subjects.REGISTRY_CLUSTER, m.GetCluster(recent_scale_ops=0),
                              m.ClusterView)
            model = next((x for x in view.models if x.name == req.model), None)
            desired = req.desired_instances
            if model is None:
                desired = 0  # deleted (or never deployed): nothing may keep running
            else:
                desired = max(model.min_instances, min(desired, model.max_instances))
            live = [i for i in view.instances if i.model == req.model and i.state in LIVE]
            if desired > len(live) and model is not None:
                return await self._scale_up(model, view, live, desired, req)
            if desired < len(live):
                return await self._scale_down(req.model, live, desired, req)
            return None

    async def _record(self, op: m.ScaleOpInfo) -> None:
        try:
            await call(self.broker, subjects.REGISTRY_SCALEOP_RECORD, m.RecordScaleOp(**op.model_dump()),
                       m.ScaleOpInfo)
        except (TimeoutError, RemoteError) as e:
            log.warning("could not record scale op %s: %s", op.scale_op_id, e)

    async def _scale_up(self, model: m.ModelInfo, view: m.ClusterView, live: list[m.InstanceInfo], desired: int,
                        req: m.ScaleRequest) -> m.ScaleOpInfo | None:
        busy = {s.worker_id for i in live for s in i.stages}
        per_worker = defaultdict(int)
        for i in view.instances:
            for s in i.stages:
                per_worker[s.worker_id] += 1
        candidates = [Candidate(w.worker_id, self._load.get(w.worker_id, 0), per_worker[w.worker_id])
                      for w in view.workers if w.state == "alive" and w.worker_id not in busy]
        held = [Held(r.worker_id, r.block_id, r.tier.value) for r in view.replicas
                if r.model == model.name and r.state == m.ReplicaState.ready]
        block_bytes = {b.block_id: b.nbytes for b in model.blocks}
        targets = pick_targets(block_bytes, candidates, held, desired - len(live))
        if not targets:
            log.warning("scale-up of %s to %d: no free worker", model.name, desired)
            return None
        op = m.ScaleOpInfo(scale_op_id=f"op-{uuid.uuid4().hex[:12]}", model=model.name, direction="up",
                           reason=req.reason, from_instances=len(live), to_instances=len(live) + len(targets),
                           state="running", timings={"decided": req.sent_at, "planned": time.time()},
                           plan={"kind": "local-load", "targets": targets,
                                 "blocks": [0, len(model.blocks)]})
        # The span lasts as long as the operation: it ends when the last target is ready (or failed),
        # in whichever event handler sees that, so the trace shows the operation's real duration.
        span = _tracer.start_span("planner.scale_up", attributes={
            "layercast.model": model.name, "layercast.scale_op": op.scale_op_id, "layercast.mode": op.plan["kind"],
            "layercast.targets": ",".join(targets), "layercast.from_instances": op.from_instances,
            "layercast.to_instances": op.to_instances})
        self._op_spans[op.scale_op_id] = span
        with trace.use_span(span, end_on_exit=False):
            await self._record(op)
            self._open_ops[op.scale_op_id] = op
            OPEN_OPS.set(len(self._open_ops))
            for worker_id in targets:
                instance_id = f"inst-{uuid.uuid4().hex[:12]}"
                stage = m.Stage(worker_id=worker_id, block_start=0, block_end=len(model.blocks))
                try:
                    created = await call(self.broker, subjects.REGISTRY_INSTANCE_CREATE, m.CreateInstance(
                        instance_id=instance_id, model=model.name, stages=[stage], scale_op_id=op.scale_op_id),
                        m.InstanceInfo)
                    await publish(self.broker, subjects.EVENT_INSTANCE, m.InstanceEvent(instance=created,
                                                                                        reason=req.reason))
                    self._waiting[instance_id] = op.scale_op_id
                    ack = await call(self.broker, subjects.worker_command(worker_id), m.LoadModel(
                        instance_id=instance_id, model=model.name, path=model.path, block_start=0,
                        block_end=len(model.blocks), scale_op_id=op.scale_op_id), m.CommandAck, timeout=5.0)
                    if not ack.accepted:
                        raise RemoteError(subjects.worker_command(worker_id), m.ErrorReply(error=ack.detail))
                    log.info("scale-up %s: %s loads %s (%s)", op.scale_op_id, worker_id, model.name, req.reason)
                except (TimeoutError, RemoteError) as e:
                    log.warning("scale-up %s: worker %s refused: %s", op.scale_op_id, worker_id, e)
                    self._waiting.pop(instance_id, None)
                    failed = m.InstanceInfo(instance_id=instance_id, model=model.name, stages=[stage],
                                            state=m.InstanceState.failed, created_at=time.time(),
                                            scale_op_id=op.scale_op_id)
                    await publish(self.broker, subjects.EVENT_INSTANCE, m.InstanceEvent(instance=failed,
                                                                                        reason=str(e)))
            await self._maybe_close(op.scale_op_id)
        return op

    async def _scale_down(self, model: str, live: list[m.InstanceInfo], desired: int,
                          req: m.ScaleRequest) -> m.ScaleOpInfo:
        instances = [LiveInstance(i.instance_id, i.state.value, self._load.get(i.entry_worker, 0)) for i in live]
        victims = set(pick_victims(instances, len(live) - desired))
        op = m.ScaleOpInfo(scale_op_id=f"op-{uuid.uuid4().hex[:12]}", model=model, direction="down",
                           reason=req.reason, from_instances=len(live), to_instances=desired, state="running",
                           timings={"decided": req.sent_at, "planned": time.time()},
                           plan={"kind": "drain", "victims": sorted(victims)})
        with _tracer.start_as_current_span("planner.scale_down", attributes={
                "layercast.model": model, "layercast.scale_op": op.scale_op_id}):
            await self._record(op)
            for inst in live:
                if inst.instance_id not in victims:
                    continue
                # Stop routing first, then let the worker finish what it has.
                draining = inst.model_copy(update={"state": m.InstanceState.draining})
                await publish(self.broker, subjects.EVENT_INSTANCE, m.InstanceEvent(instance=draining,
                                                                                    reason=req.reason))
                try:
                    await call(self.broker, subjects.worker_command(inst.entry_worker), m.UnloadModel(
                        instance_id=inst.instance_id, drain_timeout_s=self.drain_timeout_s,
                        scale_op_id=op.scale_op_id), m.CommandAck, timeout=5.0)
                except (TimeoutError, RemoteError) as e:
                    # The worker is gone or never had it: the instance is over either way.
                    log.warning("scale-down %s: %s: %s", op.scale_op_id, inst.entry_worker, e)
                    stopped = inst.model_copy(update={"state": m.InstanceState.stopped})
                    await publish(self.broker, subjects.EVENT_INSTANCE, m.InstanceEvent(instance=stopped,
                                                                                        reason=str(e)))
            op = op.model_copy(update={"state": "done", "timings": {**op.timings, "done": time.time()}})
            await self._record(op)
            self._observe_end(op, "done")
            log.info("scale-down %s of %s: %d -> %d (%s)", op.scale_op_id, model, len(live), desired, req.reason)
        return op

    @staticmethod
    def _observe_end(op: m.ScaleOpInfo, outcome: str) -> None:
        SCALE_OPS.labels(op.model, op.direction, outcome).inc()
        decided = op.timings.get("decided") or op.timings.get("planned")
        if decided:
            SCALE_DURATION.labels(op.model, op.direction).observe(max(0.0, op.timings["done"] - decided))

    async def _maybe_close(self, scale_op_id: str) -> None:
        if any(op == scale_op_id for op in self._waiting.values()):
            return
        op = self._open_ops.pop(scale_op_id, None)
        OPEN_OPS.set(len(self._open_ops))
        span = self._op_spans.pop(scale_op_id, None)
        if op is not None:
            done = op.model_copy(update={"state": "done", "timings": {**op.timings, "done": time.time()}})
            await self._record(done)
            ready = sum(1 for k in done.timings if k.startswith("ready:"))
            outcome = "done" if ready == done.to_instances - done.from_instances else "partial" if ready else "failed"
            self._observe_end(done, outcome)
            if span is not None:
                span.set_attribute("layercast.instances_ready", ready)
                span.set_attribute("layercast.outcome", outcome)
        if span is not None:
            span.end()

    def _subscribe(self) -> None:
        b = self.broker

        @b.subscriber(subjects.SCALE_REQUEST)
        @on_event(m.ScaleRequest)
        async def scale(req: m.ScaleRequest) -> None:
            await self.reconcile(req)

        @b.subscriber(subjects.EVENT_INSTANCE)
        @on_event(m.InstanceEvent)
        async def instance(ev: m.InstanceEvent) -> None:
            inst = ev.instance
            op_id = self._waiting.get(inst.instance_id)
            if op_id is None or inst.state == m.InstanceState.loading:
                return
            del self._waiting[inst.instance_id]
            op = self._open_ops.get(op_id)
            if op is not None:
                key = f"ready:{inst.instance_id}" if inst.state == m.InstanceState.ready else \
                    f"failed:{inst.instance_id}"
                op.timings[key] = inst.ready_at or time.time()
                span = self._op_spans.get(op_id)
                if span is not None:
                    span.add_event("instance_ready" if key.startswith("ready:") else "instance_failed",
                                   {"layercast.instance": inst.instance_id,
                                    "layercast.worker": inst.entry_worker})
            await self._maybe_close(op_id)

        @b.subscriber(subjects.EVENT_MODEL)
        @on_event(m.ModelEvent)
        async def model(ev: m.ModelEvent) -> None:
            if ev.kind == "deleted":
                await self.reconcile(m.ScaleRequest(model=ev.model.name, desired_instances=0,
                                                    reason="model deleted"))
            elif ev.model.min_instances > 0:
                await self.reconcile(m.ScaleRequest(model=ev.model.name, desired_instances=ev.model.min_instances,
                                                    reason="min_instances at deploy"))

        @b.subscriber(subjects.METRICS_WORKER)
        @on_event(m.WorkerMetrics)
        async def worker_metrics(ev: m.WorkerMetrics) -> None:
            self._load[ev.worker_id] = ev.running_requests
