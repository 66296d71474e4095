"""Planner: turns scale requests into scale operations.

A ScaleRequest names the desired number of instances; the planner reconciles
against the registry's view (one operation at a time per model; the view is
kept between decisions while it is current, see views.py). What to do is decided
by the pure functions of libs.planning.scaleout (and libs.planning.pool for the
parameter pool); an operation's lifecycle, from its parts to its outcome, is the
state machine of libs.planning.scaleop. This service only interprets it: it feeds
each operation the answers and events that concern it and carries out the effects
it gets back, through two ports (WorkerCommands to the workers, ClusterRegistry to
the registry), so it runs as well against in-memory fakes as against NATS.
"""

import asyncio
import logging
import time
import uuid
from collections import defaultdict
from collections.abc import Awaitable, Callable

from opentelemetry import trace
from prometheus_client import Counter, Gauge, Histogram

from libs.bus.broker import RemoteError, on_event
from libs.bus.plans import ensure_plan_stream
from libs.bus.worker_commands import NatsWorkerCommands, WorkerCommands
from libs.planning import scaleop as so
from libs.planning.placement import saturated_workers
from libs.planning.pool import PoolFill, plan_pool_fills
from libs.planning.scaleout import SERVERLESSLLM_KEEP_ALIVE_S, ScaleIn, ScalePlan, alive_workers, decide
from libs.planning.sharing import sharing_setting
from libs.protocol import messages as m
from libs.protocol import subjects
from libs.telemetry import tracer
from services.common.runner import Service
from services.common.transfer_parts import gather_parts, transfer_parts
from services.planner.ports import ClusterRegistry, NatsClusterRegistry
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

TIMERS = so.Timers()  # the periodic checks and deadlines scaleop declares


def _new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


class PlannerService(Service):
    name = "planner"

    def __init__(self, nats_url: str | None = None, drain_timeout_s: float = 30.0,
                 serverlessllm_keep_alive_s: float = SERVERLESSLLM_KEEP_ALIVE_S, *,
                 workers: WorkerCommands | None = None, registry: ClusterRegistry | None = None,
                 timers: so.Timers = TIMERS, sharing: str = "exclusive"):
        super().__init__(nats_url)
        # The cluster's sharing setting (libs/planning/sharing.py): with one model per worker
        # (dedicated) the placement is pick_dedicated_targets'. An unknown name fails here.
        self.sharing = sharing_setting(sharing)
        self.drain_timeout_s = drain_timeout_s
        self.serverlessllm_keep_alive_s = serverlessllm_keep_alive_s
        self.timers = timers
        self.workers: WorkerCommands = workers or NatsWorkerCommands(self.broker, timers.command_timeout_s)
        self.registry: ClusterRegistry = registry or NatsClusterRegistry(self.broker, timers.command_timeout_s)
        self._locks: dict[str, asyncio.Lock] = defaultdict(asyncio.Lock)
        self.ops: dict[str, so.ScaleOp] = {}  # scale_op_id -> the operation, until it is settled
        self._op_spans: dict[str, trace.Span] = {}  # scale_op_id -> its span, ended with the op
        self._records: dict[str, asyncio.Task] = {}  # scale_op_id -> its record being written in the background
        self._load: dict[str, int] = {}  # worker_id -> running requests (worker metrics)
        self._last_refusal: dict[str, float] = {}  # worker_id -> when it last reported busy refusals (monotonic)
        self._ended: dict[str, m.ScaleOpInfo] = {}  # the last records of settled operations
        self.pool_fills: so.PoolFills = {}
        self.views = ClusterViewCache(self._read_cluster)
        self._subscribe()

    async def _read_cluster(self) -> m.ClusterView:
        return await self.registry.cluster(recent_scale_ops=0)

    def open_ops(self) -> dict[str, so.ScaleOp]:
        """The operations still running (not ended)."""
        return {i: op for i, op in self.ops.items() if not op.ended}

    async def reconcile(self, req: m.ScaleRequest) -> m.ScaleOpInfo | None:
        """Bring the model to `req.desired_instances`; returns the operation started, if any."""
        received = time.time()
        # One model at a time per model; with one model per worker, one at a time overall: two
        # models' decisions on the same view would both take the same idle worker.
        async with self._locks["" if self.sharing.one_model_per_worker else req.model]:
            # The registry's view, with the live pairs open now (only this planner forms them).
            view = (await self.views.get()).model_copy(update={"live_pairs": so.open_live_pairs(self.ops.values())})
            viewed = time.time()
            decision = decide(view, req, self._load, saturated=saturated_workers(self._last_refusal, time.monotonic()),
                              dedicated=self.sharing.one_model_per_worker,
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

    async def _scale_up(self, plan: ScalePlan, view: m.ClusterView, req: m.ScaleRequest,
                        stamps: dict[str, float]) -> m.ScaleOpInfo | None:
        model = plan.model
        if not plan.loads:
            log.warning("scale-up of %s to %d: no free worker", model.name, plan.desired)
            return None
        now = time.time()
        info = m.ScaleOpInfo(scale_op_id=_new_id("op"), model=model.name, direction="up",
                             reason=req.reason, from_instances=plan.from_instances, to_instances=plan.to_instances,
                             state="running", timings={"decided": req.sent_at, **stamps, "planned": now},
                             plan=plan.record())
        # The span lasts as long as the operation: it ends when the last target is loaded (or
        # failed), in whichever event handler sees that, so the trace shows the real duration.
        span = _tracer.start_span("planner.scale_up", attributes={
            "layercast.model": model.name, "layercast.scale_op": info.scale_op_id, "layercast.mode": info.plan["kind"],
            "layercast.scaling_mode": model.scaling_mode, "layercast.algorithm": info.plan.get("algorithm", ""),
            "layercast.targets": ",".join(plan.targets), "layercast.from_instances": info.from_instances,
            "layercast.to_instances": info.to_instances})
        self._op_spans[info.scale_op_id] = span
        addresses = {w: x.data_address for w, x in alive_workers(view).items()}
        with trace.use_span(span, end_on_exit=False):
            op, effects = so.open_scale_up(info, plan, {t.worker_id: _new_id("inst") for t in plan.loads},
                                           addresses, now)
            self._open(op)
            await self._carry_out(op.op_id, effects)
        return self._latest(op.op_id)

    async def _scale_down(self, scale_in: ScaleIn, req: m.ScaleRequest) -> m.ScaleOpInfo:
        info = m.ScaleOpInfo(scale_op_id=_new_id("op"), model=scale_in.model, direction="down", reason=req.reason,
                             from_instances=scale_in.from_instances, to_instances=scale_in.desired, state="running",
                             timings={"decided": req.sent_at, "planned": time.time()}, plan=scale_in.record())
        with _tracer.start_as_current_span("planner.scale_down", attributes={
                "layercast.model": scale_in.model, "layercast.scale_op": info.scale_op_id}):
            op, effects = so.open_scale_down(info, scale_in, self.drain_timeout_s, req.reason, time.time())
            self._open(op)
            await self._carry_out(op.op_id, effects)
            log.info("scale-down %s of %s: %d -> %d (%s)", info.scale_op_id, scale_in.model, scale_in.from_instances,
                     scale_in.desired, req.reason)
        return self._latest(op.op_id)

    # --- the interpreter: events in, effects out ------------------------------------------------------
    def _open(self, op: so.ScaleOp) -> None:
        self.ops[op.op_id] = op
        self._store(op)

    def _store(self, op: so.ScaleOp) -> None:
        """Keep the operation while anything it started needs the planner."""
        if op.settled:
            self.ops.pop(op.op_id, None)  # its closing Record (after the first) is still to come
            self._ended[op.op_id] = op.record()
            if len(self._ended) > 100:  # only the last few are read back (reconcile's answer)
                self._ended.pop(next(iter(self._ended)))
        else:
            self.ops[op.op_id] = op
        OPEN_OPS.set(sum(1 for o in self.open_ops().values() if o.info.direction == "up"))

    def _latest(self, op_id: str) -> m.ScaleOpInfo:
        op = self.ops.get(op_id)
        return op.record() if op is not None else self._ended[op_id]

    def _step(self, op_id: str, event: so.Event) -> list[so.Effect]:
        """One step of the operation (synchronous: no other handler runs between read and write)."""
        op = self.ops.get(op_id)
        if op is None:
            return []
        op, effects = so.step(op, event, time.time(), self.timers)
        self._store(op)
        return effects

    async def feed(self, op_id: str, event: so.Event) -> None:
        """Give the operation an event and carry out what it says."""
        await self._carry_out(op_id, self._step(op_id, event))

    async def _carry_out(self, op_id: str, effects: list[so.Effect]) -> None:
        """Carry out the effects in order. A run of effects that answer (loads, creates, ...) goes
        out at once; their answers are stepped together, and what those say is carried out next
        (so every target's LoadModel goes out together, after every instance was created)."""
        i = 0
        while i < len(effects):
            effect = effects[i]
            run = self._answering.get(type(effect))
            if run is None:
                await self._effects[type(effect)](self, op_id, effect)
                i += 1
                continue
            j = i
            while j < len(effects) and type(effects[j]) is type(effect):
                j += 1
            answers = await asyncio.gather(*(run(self, op_id, e) for e in effects[i:j]))
            follow: list[so.Effect] = []
            for answer in answers:
                follow += self._step(op_id, answer)
            await self._carry_out(op_id, follow)
            i = j

    # Effects answered by an event.
    async def _send_parts(self, op_id: str, e: so.SendParts) -> so.Event:
        """Send every worker its part of the plan, all at once.

        No ordering is needed: a sender sends a block only once its receiver has granted it,
        which the receiver does after registering where the block lands (the executor's
        grant), so the parts go out together and decision -> first byte saves a round trip."""
        scale = e.scale
        nodes = scale.nodes()
        parts = transfer_parts(scale.multicast, nodes, {w: e.addresses[w] for w in nodes}, scale.model.blocks,
                               transfer_id=e.transfer_id, model=scale.model.name,
                               stall_timeout_s=self.timers.transfer_stall_s, scale_op_id=op_id)
        answers = await asyncio.gather(*(self.workers.send_part(w, part, so.plan_part_id(w, part))
                                         for w, part in parts.items()))
        return so.PartsAnswered(tuple(parts), {w: why for w, why in zip(parts, answers) if why})

    async def _create_instance(self, op_id: str, e: so.CreateInstance) -> so.Event:
        load = e.load
        try:
            created = await self.registry.create_instance(m.CreateInstance(
                instance_id=load.instance_id, model=load.model, scale_op_id=op_id,
                stages=[m.Stage(worker_id=e.worker_id, block_start=load.block_start, block_end=load.block_end)]))
        except (TimeoutError, RemoteError) as ex:
            return so.InstanceCreated(load.instance_id, str(ex))
        await self.registry.announce(m.InstanceEvent(instance=created, reason=e.reason))
        return so.InstanceCreated(load.instance_id)

    async def _send_load(self, op_id: str, e: so.SendLoad) -> so.Event:
        return so.LoadAnswered(e.load.instance_id, await self.workers.send_part(e.worker_id, e.load, e.part_id))

    async def _form_pipeline(self, op_id: str, e: so.FormPipeline) -> so.Event:
        info = e.instance
        try:
            await self.registry.create_instance(m.CreateInstance(instance_id=info.instance_id, model=info.model,
                                                                 stages=info.stages))
        except (TimeoutError, RemoteError) as ex:
            return so.PipelineRegistered(info.instance_id, str(ex))
        return so.PipelineRegistered(info.instance_id)

    async def _start_pipeline(self, op_id: str, e: so.StartPipeline) -> so.Event:
        """The later stages host their ranges first, then the entry serves."""
        later = await asyncio.gather(*(self.workers.command(w, e.start) for w in e.workers[1:]))
        why = next((x for x in later if x), None) or await self.workers.command(e.workers[0], e.start)
        return so.PipelineStartAnswered(e.start.instance_id, why)

    async def _switch_pipeline(self, op_id: str, e: so.SwitchPipeline) -> so.Event:
        return so.SwitchAnswered(e.unload.instance_id, await self.workers.command(e.entry, e.unload))

    async def _drain(self, op_id: str, e: so.Drain) -> so.Event:
        return so.DrainAnswered(e.unload.instance_id, await self.workers.command(e.worker_id, e.unload))

    async def _form_pair(self, op_id: str, e: so.FormPair) -> so.Event:
        """The target hosts its front first, then the source pairs with it (as a pipeline's stages);
        a source that refuses leaves the target paired with nothing: it is told the pair is over."""
        form = e.form
        if why := await self.workers.command(form.target_worker, form):
            return so.PairAnswered(form.target_instance, f"target {form.target_worker}: {why}")
        if why := await self.workers.command(form.source_worker, form):
            end = m.EndLivePair(instance_id=form.target_instance, reason=f"the source refused: {why}")
            if also := await self.workers.command(form.target_worker, end):
                log.info("live pair %s: ending the target's part: %s", form.target_instance, also)
            return so.PairAnswered(form.target_instance, f"source {form.source_worker}: {why}")
        return so.PairAnswered(form.target_instance)

    _answering: dict[type, Callable[..., Awaitable[so.Event]]] = {
        so.SendParts: _send_parts, so.CreateInstance: _create_instance, so.SendLoad: _send_load,
        so.FormPipeline: _form_pipeline, so.StartPipeline: _start_pipeline, so.SwitchPipeline: _switch_pipeline,
        so.Drain: _drain, so.FormPair: _form_pair,
    }

    # Effects without an answer.
    async def _record(self, op_id: str, e: so.Record) -> None:
        earlier = self._records.pop(op_id, None)
        if e.background:
            self._records[op_id] = asyncio.create_task(self._write_record(e.info))
            return
        if earlier is not None:
            await earlier  # the closing record (with every timing) comes after the first one
        await self._write_record(e.info)

    async def _write_record(self, info: m.ScaleOpInfo) -> None:
        try:
            await self.registry.record(info)
        except (TimeoutError, RemoteError) as ex:
            log.warning("could not record scale op %s: %s", info.scale_op_id, ex)

    async def _cancel_parts(self, op_id: str, e: so.CancelParts) -> None:
        # In the background: a silent worker must not hold up the targets' own loads.
        async def cancel() -> None:
            answers = await asyncio.gather(*(self.workers.command(w, e.cancel) for w in e.workers))
            for w, why in zip(e.workers, answers):
                if why:
                    log.warning("scale-up %s: cancelling %s on %s failed: %s", op_id, e.cancel.transfer_id, w, why)
        self.spawn(cancel())

    async def _announce(self, op_id: str, e: so.Announce) -> None:
        await self.registry.announce(m.InstanceEvent(instance=e.instance, reason=e.reason,
                                                     switched_to=list(e.switched_to)))

    async def _unload_stages(self, op_id: str, e: so.UnloadStages) -> None:
        for w in e.workers:  # the entry first: no more calls to the stages after it
            if why := await self.workers.command(w, e.unload):
                log.info("pipeline %s: stopping its stage on %s: %s", e.unload.instance_id, w, why)

    async def _check_instances(self, op_id: str, e: so.CheckInstances) -> None:
        try:
            view = await self.views.get()
        except (TimeoutError, RemoteError) as ex:
            log.warning("scale-up %s: could not read its instances' states: %s", op_id, ex)
            return
        wanted = set(e.instance_ids)
        for inst in view.instances:
            if inst.instance_id in wanted:
                await self.feed(op_id, so.InstanceReported(inst))

    async def _ended_effect(self, op_id: str, e: so.Ended) -> None:
        SCALE_OPS.labels(e.info.model, e.info.direction, e.outcome).inc()
        decided = e.info.timings.get("decided") or e.info.timings.get("planned")
        if decided and "done" in e.info.timings:
            SCALE_DURATION.labels(e.info.model, e.info.direction).observe(max(0.0, e.info.timings["done"] - decided))
        if span := self._op_spans.pop(op_id, None):
            span.set_attribute("layercast.instances_ready", e.instances_ready)
            span.set_attribute("layercast.outcome", e.outcome)
            span.end()

    async def _trace(self, op_id: str, e: so.Trace) -> None:
        if span := self._op_spans.get(op_id):
            span.add_event(e.name, dict(e.attributes))

    async def _log(self, op_id: str, e: so.Log) -> None:
        (log.warning if e.level == "warning" else log.info)("%s", e.text)

    _effects: dict[type, Callable[..., Awaitable[None]]] = {
        so.Record: _record, so.CancelParts: _cancel_parts, so.Announce: _announce, so.UnloadStages: _unload_stages,
        so.CheckInstances: _check_instances, so.Ended: _ended_effect, so.Trace: _trace, so.Log: _log,
    }

    # --- after a restart ------------------------------------------------------------------------------
    async def start(self) -> None:
        await super().start()
        await ensure_plan_stream(self.broker._connection)
        try:
            await self.resume_open_ops()
        except (TimeoutError, RemoteError) as e:
            log.warning("could not look for scale operations a previous planner left open: %s", e)

    async def resume_open_ops(self) -> dict[str, str]:
        """Take over the scale operations a previous planner left open (scale_op_id -> outcome:
        resumed or aborted); which, is scaleop.resume_plan's decision."""
        view = await self.registry.cluster(recent_scale_ops=1000)
        models = {x.name: x for x in view.models}
        outcomes: dict[str, str] = {}
        for info, pending in so.resume_plan(view, self.ops):
            op, effects = so.resume(info, pending, models.get(info.model), time.time())
            outcomes[op.op_id] = "aborted" if op.ended else "resumed"
            if not op.ended:
                self._op_spans[op.op_id] = _tracer.start_span("planner.scale_up.resumed", attributes={
                    "layercast.model": info.model, "layercast.scale_op": op.op_id,
                    "layercast.instances": ",".join(i.instance_id for i in pending)})
                self._open(op)
            await self._carry_out(op.op_id, effects)
        return outcomes

    # --- periodic checks --------------------------------------------------------------------------------
    def background(self):
        return [self.every(self.timers.pool_check_s, self.check_pool, "parameter-pool check"),
                self.every(self.timers.tick_s, self.tick, "scale-operation check"), self.views.keep_current()]

    async def tick(self) -> None:
        """Every open operation's periodic check (lost events, its deadline)."""
        for op_id in list(self.ops):
            await self.feed(op_id, so.Tick())

    # --- the parameter pool -----------------------------------------------------------------------
    async def check_pool(self, only_model: str | None = None) -> None:
        """Keep every model's complete host copy (BlitzScale §5.3): restore it where a worker's
        loss or an eviction broke it. An `ideal` deployment's copy is on every worker instead."""
        view = await self.views.get()
        alive = alive_workers(view)
        open_models = {op.info.model for op in self.open_ops().values()}
        for model, fill in plan_pool_fills(view, open_models, only_model):
            # Admitted one at a time: a scale-out opened while the fills before it were sent.
            self.pool_fills, send = so.admit_pool_fill(
                self.pool_fills, model.name, fill.worker, {op.info.model for op in self.open_ops().values()},
                time.time(), self.timers)
            if send:
                await self._fill(model, fill, alive)

    async def _fill(self, model: m.ModelInfo, fill: PoolFill, alive: dict[str, m.WorkerInfo]) -> None:
        """Blocks from surviving holders over the data plane (receiver first), then the
        FetchBlocks that keeps them all: it waits for those arriving, reads the rest from disk."""
        if fill.from_peers:
            parts = gather_parts(fill.worker, fill.from_peers, {w: alive[w].data_address for w in alive},
                                 model.blocks, transfer_id=_new_id("pool"), model=model.name,
                                 stall_timeout_s=self.timers.transfer_stall_s)
            for worker_id, part in parts.items():
                if why := await self.workers.send_part(worker_id, part, so.plan_part_id(worker_id, part)):
                    log.warning("pool copy of %s: %s refused its part (%s); the disk serves instead",
                                model.name, worker_id, why)
                    break
        fetch = m.FetchBlocks(model=model.name, path=model.path, blocks=list(fill.blocks), keep=True)
        if why := await self.workers.command(fill.worker, fetch):
            log.warning("pool copy of %s on %s failed: %s", model.name, fill.worker, why)
        else:
            log.info("pool copy of %s: %s keeps blocks %s (%d from peers, %d from disk)", model.name, fill.worker,
                     list(fill.blocks), len(fill.from_peers), len(fill.from_disk))

    async def _release_pool(self, model: m.ModelInfo) -> None:
        """A deleted model's pool copy may leave the host tiers (workers release only what they keep)."""
        view = await self.views.get()
        self.pool_fills = so.forget_pool_model(self.pool_fills, model.name)
        release = m.ReleaseBlocks(model=model.name, blocks=[b.block_id for b in model.blocks])
        for w in view.workers:
            if w.state == "alive" and (why := await self.workers.command(w.worker_id, release)):
                log.warning("releasing the pool copy of %s on %s: %s", model.name, w.worker_id, why)

    # --- what the planner observes ------------------------------------------------------------------
    def _op_of_instance(self, instance_id: str, scale_op_id: str | None) -> str | None:
        if scale_op_id in self.ops and so.concerns(self.ops[scale_op_id], instance_id):
            return scale_op_id
        return next((i for i, op in self.ops.items() if so.concerns(op, instance_id)), None)

    async def on_instance(self, ev: m.InstanceEvent) -> None:
        self.views.mark_stale()
        iid = ev.instance.instance_id
        op_id = self._op_of_instance(iid, ev.instance.scale_op_id)
        if op_id is not None:
            await self.feed(op_id, so.InstanceReported(ev.instance))
        # A serving instance's own operation is not the one that paired it: that one hears it too.
        for other in [i for i, op in self.ops.items() if i != op_id and so.concerns(op, iid)]:
            await self.feed(other, so.InstanceReported(ev.instance))

    async def on_block(self, ev: m.BlockEvent) -> None:
        if ev.scale_op_id in self.ops:
            await self.feed(ev.scale_op_id, so.BlockReported(ev))

    async def on_transfer(self, report: m.TransferReport) -> None:
        """A receiver's part ended (the registry records its timings; its load goes on by itself)."""
        if not report.ok and report.scale_op_id in self.open_ops():
            log.warning("scale-up %s: transfer to %s failed (%s); it loads what is missing from disk",
                        report.scale_op_id, report.worker_id, report.error)

    async def on_worker_expired(self, ev: m.WorkerExpired) -> None:
        self.views.mark_stale()
        self._load.pop(ev.worker_id, None)
        self._last_refusal.pop(ev.worker_id, None)
        for op_id in list(self.ops):
            await self.feed(op_id, so.WorkerLost(ev.worker_id))
        await self.check_pool()

    async def on_model(self, ev: m.ModelEvent) -> None:
        self.views.mark_stale()
        if ev.kind == "deleted":
            await self.reconcile(m.ScaleRequest(model=ev.model.name, desired_instances=0, reason="model deleted"))
            await self._release_pool(ev.model)
            return
        if ev.model.min_instances > 0:
            await self.reconcile(m.ScaleRequest(model=ev.model.name, desired_instances=ev.model.min_instances,
                                                reason="min_instances at deploy"))
        await self.check_pool(ev.model.name)

    def on_worker_metrics(self, ev: m.WorkerMetrics) -> None:
        self._load[ev.worker_id] = ev.running_requests
        if ev.busy_refusals:
            self._last_refusal[ev.worker_id] = time.monotonic()
            BUSY_REPORTS.labels(ev.worker_id).inc()

    def _subscribe(self) -> None:
        b = self.broker

        @b.subscriber(subjects.SCALE_REQUEST)
        @on_event(m.ScaleRequest)
        async def scale(req: m.ScaleRequest) -> None:
            await self.reconcile(req)

        @b.subscriber(subjects.EVENT_INSTANCE)
        @on_event(m.InstanceEvent)
        async def instance(ev: m.InstanceEvent) -> None:
            await self.on_instance(ev)

        @b.subscriber(subjects.EVENT_BLOCK)
        @on_event(m.BlockEvent)
        async def block(ev: m.BlockEvent) -> None:
            await self.on_block(ev)

        @b.subscriber(subjects.EVENT_TRANSFER)
        @on_event(m.TransferReport)
        async def transferred(report: m.TransferReport) -> None:
            await self.on_transfer(report)

        @b.subscriber(subjects.EVENT_WORKER_EXPIRED)
        @on_event(m.WorkerExpired)
        async def worker_expired(ev: m.WorkerExpired) -> None:
            await self.on_worker_expired(ev)

        @b.subscriber(subjects.EVENT_MODEL)
        @on_event(m.ModelEvent)
        async def model(ev: m.ModelEvent) -> None:
            await self.on_model(ev)

        @b.subscriber(subjects.EVENT_CLUSTER_CHANGED)
        @on_event(m.ClusterChanged)
        async def cluster_changed(ev: m.ClusterChanged) -> None:
            self.views.announced(ev)

        @b.subscriber(subjects.METRICS_WORKER)
        @on_event(m.WorkerMetrics)
        async def worker_metrics(ev: m.WorkerMetrics) -> None:
            self.on_worker_metrics(ev)
