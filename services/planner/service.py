"""Planner: turns scale requests into scale operations.

A ScaleRequest names the desired number of instances; the planner reconciles
against the registry's view (one operation at a time per model; the view is
kept between decisions while it is current, see views.py). What to do is decided
by the pure functions of libs.planning.scaleout (and libs.planning.pool for the
parameter pool); this service carries it out: records the operation in the
registry, sends the transfer parts and commands to the workers, and follows
their instance events to close the operation.
"""

import asyncio
import logging
import time
import uuid
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

from opentelemetry import trace
from prometheus_client import Counter, Gauge, Histogram

from libs.planning.pipelines import FormedPipeline, pipelines_to_form, pipelines_to_retire
from libs.planning.placement import saturated_workers
from libs.planning.pool import PoolFill, plan_pool_fills
from libs.planning.scaleout import (
    SERVERLESSLLM_KEEP_ALIVE_S,
    ScaleIn,
    ScalePlan,
    alive_workers,
    decide,
    target_load,
)
from libs.protocol import messages as m
from libs.protocol import subjects
from libs.bus.broker import RemoteError, call, on_event, publish
from libs.bus.plans import ensure_plan_stream, send_part
from libs.telemetry import tracer
from services.common.runner import Service
from services.common.transfer_parts import gather_parts, transfer_parts
from services.planner.views import ClusterViewCache

log = logging.getLogger(__name__)
_tracer = tracer("planner")

SCALE_OPS = Counter("layercast_planner_scale_operations_total", "Scale operations finished",
                    ["model", "direction", "outcome"])
SCALE_DURATION = Histogram("layercast_planner_scale_operation_duration_seconds",
                           "Scale decision (load-monitor) to the operation's end: every target ready or failed",
                           ["model", "direction"], buckets=(0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300))
OPEN_OPS = Gauge("layercast_planner_open_scale_operations", "Scale-ups waiting for their instances")
BUSY_REPORTS = Counter("layercast_planner_busy_worker_reports_total",
                       "Worker reports of requests refused as busy (the worker takes no new instance for a while)",
                       ["worker"])
HELD_BACK = Counter("layercast_planner_scale_ups_held_back_total",
                    "Scale-ups not started: every worker without the model refuses requests as busy", ["model"])

TRANSFER_STALL_S = 15.0  # a receiver that gets no byte for this long fails its part (then loads from disk)
COMMAND_TIMEOUT_S = 5.0  # a worker that has not answered a command by then has failed it
POOL_CHECK_S = 5.0  # how often the parameter pool's invariant is checked (also on deploy and worker loss)
POOL_FILL_GRACE_S = 120.0  # a fill in flight is not repeated for this long


def _stage(load: m.LoadModel, worker_id: str) -> m.Stage:
    return m.Stage(worker_id=worker_id, block_start=load.block_start, block_end=load.block_end)


def _new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


@dataclass
class _PipelineWatch:
    """A scale-out whose receivers serve as execution pipelines while its blocks arrive."""

    op: m.ScaleOpInfo
    model: m.ModelInfo
    groups: tuple[tuple[str, ...], ...]  # Alg. 2's groups (ScalePlan.pipelines)
    addresses: dict[str, str]  # worker -> data-plane address
    instance_of: dict[str, str]  # target worker -> its local instance
    holdings: dict[str, set[int]] = field(default_factory=dict)  # worker -> blocks in engine memory
    started: list[tuple[str, ...]] = field(default_factory=list)  # groups formed (whatever became of them)
    serving: dict[str, FormedPipeline] = field(default_factory=dict)  # pipeline instance -> its pipeline
    local: set[str] = field(default_factory=set)  # targets whose local instance holds every block


def _pipeline_info(model: str, instance_id: str, pipeline: FormedPipeline, state: m.InstanceState) -> m.InstanceInfo:
    return m.InstanceInfo(instance_id=instance_id, model=model, mode="pipeline", state=state, created_at=time.time(),
                          stages=[m.Stage(worker_id=s.worker_id, block_start=s.block_start, block_end=s.block_end)
                                  for s in pipeline.stages])


class PlannerService(Service):
    name = "planner"

    def __init__(self, nats_url: str | None = None, drain_timeout_s: float = 30.0,
                 serverlessllm_keep_alive_s: float = SERVERLESSLLM_KEEP_ALIVE_S):
        super().__init__(nats_url)
        self.drain_timeout_s = drain_timeout_s
        self.serverlessllm_keep_alive_s = serverlessllm_keep_alive_s
        self._locks: dict[str, asyncio.Lock] = defaultdict(asyncio.Lock)
        self._open_ops: dict[str, m.ScaleOpInfo] = {}  # scale_op_id -> op waiting for instances
        self._op_spans: dict[str, trace.Span] = {}  # scale_op_id -> its span, ended with the op
        self._waiting: dict[str, str] = {}  # instance_id -> scale_op_id
        self._load: dict[str, int] = {}  # worker_id -> running requests (worker metrics)
        self._last_refusal: dict[str, float] = {}  # worker_id -> when it last reported busy refusals (monotonic)
        self._pool_fills: dict[tuple[str, str], float] = {}  # (model, worker) -> when a fill was sent
        self._watches: dict[str, _PipelineWatch] = {}  # scale_op_id -> its execution pipelines
        # Pipelines in their mode switch: their entry finishes its step, then their stages stop.
        self._retiring: dict[str, tuple[str | None, FormedPipeline]] = {}  # instance -> (scale op, pipeline)
        self.views = ClusterViewCache(self._read_cluster)
        self._subscribe()

    async def _read_cluster(self) -> m.ClusterView:
        return await call(self.broker, subjects.REGISTRY_CLUSTER, m.GetCluster(recent_scale_ops=0), m.ClusterView)

    async def reconcile(self, req: m.ScaleRequest) -> m.ScaleOpInfo | None:
        """Bring the model to `req.desired_instances`; returns the operation started, if any."""
        received = time.time()
        async with self._locks[req.model]:
            view = await self.views.get()
            viewed = time.time()
            decision = decide(view, req, self._load, saturated=saturated_workers(self._last_refusal, time.monotonic()),
                              host_keep_alive_s=self.serverlessllm_keep_alive_s)
            if isinstance(decision, ScalePlan) and not decision.loads and decision.held_back:
                log.info("scale-up of %s to %d waits: %s refuse requests as busy (no room for another instance)",
                         req.model, decision.desired, ",".join(decision.held_back))
                HELD_BACK.labels(req.model).inc()
                return None
            if isinstance(decision, ScalePlan):
                operation = self._scale_up(decision, view, req, {"received": received, "viewed": viewed})
            elif isinstance(decision, ScaleIn):
                operation = self._scale_down(decision, req)
            else:
                return None  # already there (the load-monitor repeats its requests): the view stays current
            try:
                return await operation
            finally:
                # Its instances are in the registry before the registry's announcement reaches us.
                self.views.mark_stale()

    async def _record(self, op: m.ScaleOpInfo) -> None:
        try:
            await call(self.broker, subjects.REGISTRY_SCALEOP_RECORD, m.RecordScaleOp(**op.model_dump()),
                       m.ScaleOpInfo)
        except (TimeoutError, RemoteError) as e:
            log.warning("could not record scale op %s: %s", op.scale_op_id, e)

    async def _scale_up(self, plan: ScalePlan, view: m.ClusterView, req: m.ScaleRequest,
                        stamps: dict[str, float]) -> m.ScaleOpInfo | None:
        model = plan.model
        if not plan.loads:
            log.warning("scale-up of %s to %d: no free worker", model.name, plan.desired)
            return None
        op = m.ScaleOpInfo(scale_op_id=_new_id("op"), model=model.name, direction="up",
                           reason=req.reason, from_instances=plan.from_instances, to_instances=plan.to_instances,
                           state="running", timings={"decided": req.sent_at, **stamps, "planned": time.time()},
                           plan=plan.record())
        # The span lasts as long as the operation: it ends when the last target is loaded (or
        # failed), in whichever event handler sees that, so the trace shows the real duration.
        span = _tracer.start_span("planner.scale_up", attributes={
            "layercast.model": model.name, "layercast.scale_op": op.scale_op_id, "layercast.mode": op.plan["kind"],
            "layercast.scaling_mode": model.scaling_mode, "layercast.algorithm": op.plan.get("algorithm", ""),
            "layercast.targets": ",".join(plan.targets), "layercast.from_instances": op.from_instances,
            "layercast.to_instances": op.to_instances})
        self._op_spans[op.scale_op_id] = span
        with trace.use_span(span, end_on_exit=False):
            recorded = asyncio.create_task(self._record(op))  # beside the transfers, not before them
            self._open_ops[op.scale_op_id] = op
            OPEN_OPS.set(len(self._open_ops))
            loads = {t.worker_id: t.command(model, _new_id("inst"), op.scale_op_id) for t in plan.loads}
            for load in loads.values():
                self._waiting[load.instance_id] = op.scale_op_id
            # Bytes first: the transfer parts go out before anything else (decision -> first byte
            # is the scale-out's latency); each receiver then loads its blocks as they arrive.
            transfer_id = await self._multicast(op, plan, alive_workers(view)) if plan.multicast else None
            if plan.multicast and transfer_id is None:
                op.plan["kind"] = "local-load"  # a worker refused its part: every target loads on its own
            for t in plan.loads:
                if transfer_id and t.receives:
                    loads[t.worker_id].incoming_transfer = transfer_id
            if transfer_id and plan.pipelines:
                alive = alive_workers(view)
                self._watches[op.scale_op_id] = _PipelineWatch(
                    op, model, plan.pipelines, {w: alive[w].data_address for w in plan.targets},
                    {w: load.instance_id for w, load in loads.items()})
            created = await asyncio.gather(*(self._create_instance(op, w, load, req.reason)
                                             for w, load in loads.items()))
            await asyncio.gather(*(self._command_load(op, w, load) for (w, load), ok in zip(loads.items(), created)
                                   if ok))
            await recorded  # the closing record (with every timing) comes after this one
            await self._maybe_close(op.scale_op_id)
        return op

    async def _create_instance(self, op: m.ScaleOpInfo, worker_id: str, load: m.LoadModel, reason: str) -> bool:
        try:
            created = await call(self.broker, subjects.REGISTRY_INSTANCE_CREATE, m.CreateInstance(
                instance_id=load.instance_id, model=load.model, stages=[_stage(load, worker_id)],
                scale_op_id=op.scale_op_id), m.InstanceInfo)
        except (TimeoutError, RemoteError) as e:
            await self._load_failed(op, worker_id, load, str(e))
            return False
        await publish(self.broker, subjects.EVENT_INSTANCE, m.InstanceEvent(instance=created, reason=reason))
        return True

    async def _multicast(self, op: m.ScaleOpInfo, scale: ScalePlan, alive: dict[str, m.WorkerInfo]) -> str | None:
        """Send every worker its part of the plan, all at once. Returns the transfer id, or None
        when a worker refused its part: then the targets load on their own.

        No ordering is needed: a sender sends a block only once its receiver has granted it,
        which the receiver does after registering where the block lands (the executor's
        grant), so the parts go out together and decision -> first byte saves a round trip.
        On a refusal every worker is told to cancel its part (accepted ones stop, a late one is
        refused), and the receivers read from disk instead (LoadModel without incoming_transfer)."""
        model, plan = scale.model, scale.multicast
        nodes = scale.nodes()
        transfer_id = f"{op.scale_op_id}-{plan.algorithm}"
        parts = transfer_parts(plan, nodes, {w: alive[w].data_address for w in nodes}, model.blocks,
                               transfer_id=transfer_id, model=model.name,
                               stall_timeout_s=TRANSFER_STALL_S, scale_op_id=op.scale_op_id)
        op.timings["first_send"] = time.time()
        answers = await asyncio.gather(*(self._command(w, part) for w, part in parts.items()))
        refused = {w: why for w, why in zip(parts, answers) if why}
        if refused:
            log.warning("scale-up %s: %s refused their %s parts (%s); targets load on their own",
                        op.scale_op_id, ",".join(refused), plan.algorithm, "; ".join(refused.values()))
            op.timings.pop("first_send", None)
            cancel = m.CancelTransfer(transfer_id=transfer_id, reason=f"{','.join(refused)} refused their parts")
            # In the background: a silent worker must not hold up the targets' own loads.
            self.spawn(self._cancel_parts(op, [w for w in parts if w not in refused], cancel))
            return None
        log.info("scale-up %s: %s k=%d from %s to %s", op.scale_op_id, plan.algorithm, plan.k,
                 ",".join(scale.senders), ",".join(scale.receivers))
        return transfer_id

    async def _cancel_parts(self, op: m.ScaleOpInfo, workers: list[str], cancel: m.CancelTransfer) -> None:
        answers = await asyncio.gather(*(self._command(w, cancel) for w in workers))
        for w, why in zip(workers, answers):
            if why:
                log.warning("scale-up %s: cancelling %s on %s failed: %s", op.scale_op_id, cancel.transfer_id, w, why)

    async def _command(self, worker_id: str, cmd: m.Message, part_id: str | None = None) -> str | None:
        """Send a worker one command; None once it accepted, else why not (refused, gone, silent).

        Parts of a plan (a TransferPart, a LoadModel) go through the JetStream plan stream, the
        rest (unload, fetch, release) as RPCs."""
        try:
            if isinstance(cmd, (m.TransferPart, m.LoadModel)):
                # The stream drops a part whose id it has seen: a resent one needs its own id.
                part_id = part_id or (f"{cmd.transfer_id}:{worker_id}" if isinstance(cmd, m.TransferPart)
                                      else f"{cmd.instance_id}:load")
                ack = await send_part(self.broker._connection, worker_id, cmd, part_id, COMMAND_TIMEOUT_S)
            else:
                ack = await call(self.broker, subjects.worker_command(worker_id), cmd, m.CommandAck,
                                 timeout=COMMAND_TIMEOUT_S)
            return None if ack.accepted else ack.detail or "refused"
        except (TimeoutError, RemoteError) as e:
            return str(e)

    async def _command_load(self, op: m.ScaleOpInfo, worker_id: str, load: m.LoadModel,
                            part_id: str | None = None) -> None:
        why = await self._command(worker_id, load, part_id)
        if why is None:
            log.info("scale-up %s: %s loads %s", op.scale_op_id, worker_id, load.model)
        else:
            log.warning("scale-up %s: worker %s refused: %s", op.scale_op_id, worker_id, why)
            await self._load_failed(op, worker_id, load, why)

    async def _load_failed(self, op: m.ScaleOpInfo, worker_id: str, load: m.LoadModel, reason: str) -> None:
        self._waiting.pop(load.instance_id, None)
        failed = m.InstanceInfo(instance_id=load.instance_id, model=load.model, stages=[_stage(load, worker_id)],
                                state=m.InstanceState.failed, created_at=time.time(), scale_op_id=op.scale_op_id)
        await publish(self.broker, subjects.EVENT_INSTANCE, m.InstanceEvent(instance=failed, reason=reason))

    async def _transferred(self, report: m.TransferReport) -> None:
        """A receiver's part ended (the registry records its timings; its load goes on by itself)."""
        if not report.ok and report.scale_op_id in self._open_ops:
            log.warning("scale-up %s: transfer to %s failed (%s); it loads what is missing from disk",
                        report.scale_op_id, report.worker_id, report.error)

    # --- execution pipelines (λScale §4.3-4.4) ------------------------------------------------------
    async def _block_arrived(self, ev: m.BlockEvent) -> None:
        """A receiver made a block ready in engine memory: start the pipelines that can serve now."""
        watch = self._watches.get(ev.scale_op_id or "")
        if watch is None or ev.tier != m.Tier.gpu or ev.state != m.ReplicaState.ready:
            return
        watch.holdings.setdefault(ev.worker_id, set()).add(ev.block_id)
        for pipeline in pipelines_to_form(watch.groups, watch.holdings, len(watch.model.blocks), watch.started):
            watch.started.append(pipeline.members)
            await self._start_pipeline(watch, pipeline)

    async def _start_pipeline(self, watch: _PipelineWatch, pipeline: FormedPipeline) -> None:
        """Register the pipeline, have the later stages host their ranges, then the entry serve."""
        iid = _new_id("pipe")
        op = watch.op
        info = _pipeline_info(watch.model.name, iid, pipeline, m.InstanceState.loading)
        try:
            await call(self.broker, subjects.REGISTRY_INSTANCE_CREATE, m.CreateInstance(
                instance_id=iid, model=info.model, stages=info.stages), m.InstanceInfo)
        except (TimeoutError, RemoteError) as e:
            log.warning("scale-up %s: pipeline over %s not registered: %s", op.scale_op_id, pipeline.workers, e)
            return
        start = m.StartPipeline(instance_id=iid, model=watch.model.name, path=watch.model.path, stages=info.stages,
                                peers={w: watch.addresses[w] for w in pipeline.workers}, scale_op_id=op.scale_op_id)
        watch.serving[iid] = pipeline
        later = await asyncio.gather(*(self._command(w, start) for w in pipeline.workers[1:]))
        why = next((x for x in later if x), None) or await self._command(pipeline.workers[0], start)
        if why is not None:
            log.warning("scale-up %s: pipeline %s over %s did not start: %s", op.scale_op_id, iid,
                        ",".join(pipeline.workers), why)
            await self._end_pipeline(watch, iid, m.InstanceState.failed, f"did not start: {why}")
            return
        if iid not in watch.serving:
            # Retired while its stages were being built (its workers finished loading meanwhile):
            # the unloads may have come before the stages, so stop them again.
            await self._unload_stages(op.scale_op_id, iid, pipeline.workers)
            return
        op.timings[f"pipeline_ready:{iid}"] = time.time()
        log.info("scale-up %s: pipeline %s serving on %s", op.scale_op_id, iid,
                 ", ".join(f"{s.worker_id}[{s.block_start},{s.block_end})" for s in pipeline.stages))
        if span := self._op_spans.get(op.scale_op_id):
            span.add_event("pipeline_ready", {"layercast.instance": iid, "layercast.stages": len(pipeline.stages)})

    async def _local_loaded(self, op_id: str, worker_id: str) -> None:
        """A target holds the whole model: the pipelines all of whose stages do now retire."""
        watch = self._watches.get(op_id)
        if watch is None:
            return
        watch.local.add(worker_id)
        for iid in pipelines_to_retire({i: p.workers for i, p in watch.serving.items()}, watch.local):
            await self._retire_pipeline(watch, iid)

    async def _retire_pipeline(self, watch: _PipelineWatch, iid: str) -> None:
        """λScale §4.4 mode switch: no new requests go to the pipeline; its entry finishes the
        step in flight (those tokens go out, no computed work is thrown away), then stops, and
        the gateway moves its unfinished requests to the new local instances (which rebuild
        their KV from the tokens so far). Its later stages stop once the entry has stopped."""
        pipeline = watch.serving.pop(iid, None)
        if pipeline is None:
            return
        op_id = watch.op.scale_op_id
        switched_to = [watch.instance_of[w] for w in pipeline.workers if w in watch.local]
        self._retiring[iid] = (op_id, pipeline)
        await publish(self.broker, subjects.EVENT_INSTANCE, m.InstanceEvent(
            instance=_pipeline_info(watch.model.name, iid, pipeline, m.InstanceState.draining),
            reason="switching to local instances", switched_to=switched_to))
        unload = m.UnloadModel(instance_id=iid, drain_timeout_s=0.0, scale_op_id=op_id, switched_to=switched_to)
        if why := await self._command(pipeline.workers[0], unload):
            log.info("pipeline %s: its entry %s did not take the switch: %s", iid, pipeline.workers[0], why)
            await self._unload_stages(op_id, iid, pipeline.workers)
        watch.op.timings[f"switched:{iid}"] = time.time()
        if span := self._op_spans.get(op_id):
            span.add_event("pipeline_switched", {"layercast.instance": iid})

    async def _end_pipeline(self, watch: _PipelineWatch, iid: str, state: m.InstanceState, reason: str) -> None:
        """Stop routing to the pipeline (the gateway hands its requests over), then stop its stages."""
        pipeline = watch.serving.pop(iid, None)
        if pipeline is None:
            return
        await publish(self.broker, subjects.EVENT_INSTANCE, m.InstanceEvent(
            instance=_pipeline_info(watch.model.name, iid, pipeline, state), reason=reason))
        await self._unload_stages(watch.op.scale_op_id, iid, pipeline.workers)

    async def _unload_stages(self, op_id: str | None, iid: str, workers: Sequence[str]) -> None:
        self._retiring.pop(iid, None)
        unload = m.UnloadModel(instance_id=iid, drain_timeout_s=0.0, scale_op_id=op_id)
        for w in workers:  # the entry first: no more calls to the stages after it
            if why := await self._command(w, unload):
                log.info("pipeline %s: stopping its stage on %s: %s", iid, w, why)

    async def _pipeline_stopped(self, iid: str) -> None:
        """A pipeline's entry stopped after its mode switch: its later stages stop now."""
        if retiring := self._retiring.get(iid):
            op_id, pipeline = retiring
            await self._unload_stages(op_id, iid, pipeline.workers[1:])

    async def _pipeline_ended(self, inst: m.InstanceInfo) -> None:
        """The entry worker reported the pipeline failed (a stage stopped answering)."""
        for watch in self._watches.values():
            if inst.instance_id in watch.serving:
                await self._end_pipeline(watch, inst.instance_id, inst.state, "a stage failed")

    async def _worker_lost(self, worker_id: str) -> None:
        """A stage worker is gone: the pipelines it was part of fail (their requests are handed over)."""
        for iid, (_, pipeline) in list(self._retiring.items()):
            if pipeline.workers[0] == worker_id:  # an entry gone in its switch never reports stopping
                await self._pipeline_stopped(iid)
        for watch in list(self._watches.values()):
            for iid, pipeline in list(watch.serving.items()):
                if worker_id in pipeline.workers:
                    await self._end_pipeline(watch, iid, m.InstanceState.failed, f"worker {worker_id} expired")

    async def _scale_down(self, scale_in: ScaleIn, req: m.ScaleRequest) -> m.ScaleOpInfo:
        model = scale_in.model
        op = m.ScaleOpInfo(scale_op_id=_new_id("op"), model=model, direction="down", reason=req.reason,
                           from_instances=scale_in.from_instances, to_instances=scale_in.desired, state="running",
                           timings={"decided": req.sent_at, "planned": time.time()}, plan=scale_in.record())
        with _tracer.start_as_current_span("planner.scale_down", attributes={
                "layercast.model": model, "layercast.scale_op": op.scale_op_id}):
            await self._record(op)
            for inst in scale_in.victims:
                # Stop routing first, then let the worker finish what it has.
                draining = inst.model_copy(update={"state": m.InstanceState.draining})
                await publish(self.broker, subjects.EVENT_INSTANCE, m.InstanceEvent(instance=draining,
                                                                                    reason=req.reason))
                try:
                    await call(self.broker, subjects.worker_command(inst.entry_worker), m.UnloadModel(
                        instance_id=inst.instance_id, drain_timeout_s=self.drain_timeout_s,
                        scale_op_id=op.scale_op_id, host_keep_alive_s=scale_in.host_keep_alive_s), m.CommandAck,
                        timeout=COMMAND_TIMEOUT_S)
                except (TimeoutError, RemoteError) as e:
                    # The worker is gone or never had it: the instance is over either way.
                    log.warning("scale-down %s: %s: %s", op.scale_op_id, inst.entry_worker, e)
                    stopped = inst.model_copy(update={"state": m.InstanceState.stopped})
                    await publish(self.broker, subjects.EVENT_INSTANCE, m.InstanceEvent(instance=stopped,
                                                                                        reason=str(e)))
            op = op.model_copy(update={"state": "done", "timings": {**op.timings, "done": time.time()}})
            await self._record(op)
            self._observe_end(op, "done")
            log.info("scale-down %s of %s: %d -> %d (%s)", op.scale_op_id, model, scale_in.from_instances,
                     scale_in.desired, req.reason)
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
        watch = self._watches.pop(scale_op_id, None)
        if watch is not None:
            # Every target is loaded or failed: no pipeline is needed any more.
            for iid in list(watch.serving):
                await self._retire_pipeline(watch, iid)
        op = self._open_ops.pop(scale_op_id, None)
        OPEN_OPS.set(len(self._open_ops))
        span = self._op_spans.pop(scale_op_id, None)
        if op is not None:
            done = op.model_copy(update={"state": "done", "timings": {**op.timings, "done": time.time()}})
            await self._record(done)
            ready = sum(1 for k in done.timings if k.startswith("loaded:"))
            outcome = "done" if ready == done.to_instances - done.from_instances else "partial" if ready else "failed"
            self._observe_end(done, outcome)
            if span is not None:
                span.set_attribute("layercast.instances_ready", ready)
                span.set_attribute("layercast.outcome", outcome)
        if span is not None:
            span.end()

    async def start(self) -> None:
        await super().start()
        await ensure_plan_stream(self.broker._connection)
        try:
            await self.resume_open_ops()
        except (TimeoutError, RemoteError) as e:
            log.warning("could not look for scale operations a previous planner left open: %s", e)

    async def resume_open_ops(self) -> dict[str, str]:
        """Take over the scale operations a previous planner left open (scale_op_id -> outcome).

        A scale-out whose instances are still on their way is resumed: each one's LoadModel is
        sent again (idempotent on the worker: a load that is running or done just says so; one
        that never reached the worker starts now) and the operation is followed to its end as
        usual. One with nothing left to follow, and any scale-in (its drains were sent or its
        victims are still serving; the load-monitor repeats its request), ends as aborted."""
        view = await call(self.broker, subjects.REGISTRY_CLUSTER, m.GetCluster(recent_scale_ops=1000), m.ClusterView,
                          timeout=COMMAND_TIMEOUT_S)
        models = {x.name: x for x in view.models}
        outcomes: dict[str, str] = {}
        for op in view.scale_ops:
            if op.state not in ("planned", "running") or op.scale_op_id in self._open_ops:
                continue
            pending = [i for i in view.instances if i.scale_op_id == op.scale_op_id and
                       (i.state == m.InstanceState.loading or i.state == m.InstanceState.ready and i.loaded_at is None)]
            model = models.get(op.model)
            if op.direction != "up" or not pending or model is None:
                await self._record(op.model_copy(update={"state": "aborted", "error": "the planner restarted",
                                                         "timings": {**op.timings, "done": time.time()}}))
                outcomes[op.scale_op_id] = "aborted"
                continue
            self._open_ops[op.scale_op_id] = op
            self._op_spans[op.scale_op_id] = _tracer.start_span("planner.scale_up.resumed", attributes={
                "layercast.model": op.model, "layercast.scale_op": op.scale_op_id,
                "layercast.instances": ",".join(i.instance_id for i in pending)})
            for inst in pending:
                self._waiting[inst.instance_id] = op.scale_op_id
            OPEN_OPS.set(len(self._open_ops))
            outcomes[op.scale_op_id] = "resumed"
            log.warning("resuming scale operation %s left open by a previous planner: %d instance(s) to follow",
                        op.scale_op_id, len(pending))
            for inst in pending:
                stage = inst.stages[0]
                load = target_load(model.scaling_mode, stage.worker_id, stage.block_start,
                                   stage.block_end).command(model, inst.instance_id, op.scale_op_id)
                await self._command_load(op, stage.worker_id, load, part_id=f"{inst.instance_id}:resume")
            await self._maybe_close(op.scale_op_id)
        return outcomes

    # --- the parameter pool -----------------------------------------------------------------------
    def background(self):
        return [self.every(POOL_CHECK_S, self.check_pool, "parameter-pool check"), self.views.keep_current()]

    async def check_pool(self, only_model: str | None = None) -> None:
        """Keep every model's complete host copy (BlitzScale §5.3): restore it where a worker's
        loss or an eviction broke it. An `ideal` deployment's copy is on every worker instead."""
        view = await self.views.get()
        alive = alive_workers(view)
        now = time.time()
        # A model with a scale-out open is left out: its loads are bringing copies into host
        # tiers (look again once they are done).
        for model, fill in plan_pool_fills(view, {op.model for op in self._open_ops.values()}, only_model):
            if any(op.model == model.name for op in self._open_ops.values()):
                continue  # opened while the fills before this one were sent
            if now - self._pool_fills.get((model.name, fill.worker), 0.0) < POOL_FILL_GRACE_S:
                continue  # sent recently; its blocks are still on their way
            self._pool_fills[(model.name, fill.worker)] = now
            await self._fill(model, fill, alive)

    async def _fill(self, model: m.ModelInfo, fill: PoolFill, alive: dict[str, m.WorkerInfo]) -> None:
        """Blocks from surviving holders over the data plane (receiver first), then the
        FetchBlocks that keeps them all: it waits for those arriving, reads the rest from disk."""
        if fill.from_peers:
            parts = gather_parts(fill.worker, fill.from_peers, {w: alive[w].data_address for w in alive},
                                 model.blocks, transfer_id=_new_id("pool"), model=model.name,
                                 stall_timeout_s=TRANSFER_STALL_S)
            for worker_id, part in parts.items():
                if why := await self._command(worker_id, part):
                    log.warning("pool copy of %s: %s refused its part (%s); the disk serves instead",
                                model.name, worker_id, why)
                    break
        fetch = m.FetchBlocks(model=model.name, path=model.path, blocks=list(fill.blocks), keep=True)
        if why := await self._command(fill.worker, fetch):
            log.warning("pool copy of %s on %s failed: %s", model.name, fill.worker, why)
        else:
            log.info("pool copy of %s: %s keeps blocks %s (%d from peers, %d from disk)", model.name, fill.worker,
                     list(fill.blocks), len(fill.from_peers), len(fill.from_disk))

    async def _release_pool(self, model: m.ModelInfo) -> None:
        """A deleted model's pool copy may leave the host tiers (workers release only what they keep)."""
        view = await self.views.get()
        self._pool_fills = {k: t for k, t in self._pool_fills.items() if k[0] != model.name}
        release = m.ReleaseBlocks(model=model.name, blocks=[b.block_id for b in model.blocks])
        for w in view.workers:
            if w.state == "alive" and (why := await self._command(w.worker_id, release)):
                log.warning("releasing the pool copy of %s on %s: %s", model.name, w.worker_id, why)

    def _subscribe(self) -> None:
        b = self.broker

        @b.subscriber(subjects.SCALE_REQUEST)
        @on_event(m.ScaleRequest)
        async def scale(req: m.ScaleRequest) -> None:
            await self.reconcile(req)

        @b.subscriber(subjects.EVENT_INSTANCE)
        @on_event(m.InstanceEvent)
        async def instance(ev: m.InstanceEvent) -> None:
            self.views.mark_stale()
            inst = ev.instance
            if inst.mode == "pipeline":
                if inst.state in (m.InstanceState.failed, m.InstanceState.stopped):
                    if inst.instance_id in self._retiring:
                        await self._pipeline_stopped(inst.instance_id)
                    else:
                        await self._pipeline_ended(inst)
                return
            op_id = self._waiting.get(inst.instance_id)
            if op_id is None or inst.state == m.InstanceState.loading:
                return
            op = self._open_ops.get(op_id)
            span = self._op_spans.get(op_id)
            attrs = {"layercast.instance": inst.instance_id, "layercast.worker": inst.entry_worker}
            if inst.state == m.InstanceState.ready:
                # Serving (from its first block, with serve-while-loading); the target is done
                # once every block is loaded.
                if op is not None and f"ready:{inst.instance_id}" not in op.timings:
                    op.timings[f"ready:{inst.instance_id}"] = inst.ready_at or time.time()
                    if span is not None:
                        span.add_event("instance_ready", attrs)
                if inst.loaded_at is None:
                    return
                if op is not None:
                    op.timings[f"loaded:{inst.instance_id}"] = inst.loaded_at
                if span is not None:
                    span.add_event("instance_loaded", attrs)
                await self._local_loaded(op_id, inst.entry_worker)
            else:
                # failed, or stopped/draining: a scale-in took it before it was loaded
                if op is not None:
                    op.timings[f"{inst.state.value}:{inst.instance_id}"] = time.time()
                if span is not None:
                    span.add_event(f"instance_{inst.state.value}", attrs)
            del self._waiting[inst.instance_id]
            await self._maybe_close(op_id)

        @b.subscriber(subjects.EVENT_BLOCK)
        @on_event(m.BlockEvent)
        async def block(ev: m.BlockEvent) -> None:
            await self._block_arrived(ev)

        @b.subscriber(subjects.EVENT_TRANSFER)
        @on_event(m.TransferReport)
        async def transferred(report: m.TransferReport) -> None:
            await self._transferred(report)

        @b.subscriber(subjects.EVENT_WORKER_EXPIRED)
        @on_event(m.WorkerExpired)
        async def worker_expired(ev: m.WorkerExpired) -> None:
            self.views.mark_stale()
            self._load.pop(ev.worker_id, None)
            self._last_refusal.pop(ev.worker_id, None)
            await self._worker_lost(ev.worker_id)
            await self.check_pool()

        @b.subscriber(subjects.EVENT_MODEL)
        @on_event(m.ModelEvent)
        async def model(ev: m.ModelEvent) -> None:
            self.views.mark_stale()
            if ev.kind == "deleted":
                await self.reconcile(m.ScaleRequest(model=ev.model.name, desired_instances=0,
                                                    reason="model deleted"))
                await self._release_pool(ev.model)
                return
            if ev.model.min_instances > 0:
                await self.reconcile(m.ScaleRequest(model=ev.model.name, desired_instances=ev.model.min_instances,
                                                    reason="min_instances at deploy"))
            await self.check_pool(ev.model.name)

        @b.subscriber(subjects.EVENT_CLUSTER_CHANGED)
        @on_event(m.ClusterChanged)
        async def cluster_changed(ev: m.ClusterChanged) -> None:
            self.views.announced(ev)

        @b.subscriber(subjects.METRICS_WORKER)
        @on_event(m.WorkerMetrics)
        async def worker_metrics(ev: m.WorkerMetrics) -> None:
            self._load[ev.worker_id] = ev.running_requests
            if ev.busy_refusals:
                self._last_refusal[ev.worker_id] = time.monotonic()
                BUSY_REPORTS.labels(ev.worker_id).inc()
