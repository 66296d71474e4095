"""Registry: the parameter pool and cluster state. The only service with a
database connection; everyone else asks over NATS (subjects.REGISTRY_*)."""

import asyncio
import logging
import time

from prometheus_client import Counter, Gauge

from libs.db.session import make_engine, migrate
from libs.bus.broker import DomainError, on_event, publish, rpc
from libs.db.store import RegistryStore
from libs.planning import liveness
from libs.planning.autoscale import check_policy
from libs.planning.mesh_profiles import InvalidProfile, profile_from_message
from libs.protocol import messages as m
from libs.protocol import subjects
from services.common.runner import Service

WORKERS = Gauge("layercast_registry_workers", "Registered workers with a live heartbeat")
INSTANCES = Gauge("layercast_registry_instances", "Live instances per model and state", ["model", "state"])
EXPIRED = Counter("layercast_registry_worker_expirations_total", "Workers declared dead (heartbeats stopped)")
EXITED = Counter("layercast_registry_worker_exits_total",
                 "Workers declared dead because their supervisor saw their process exit")
UNREACHABLE = Counter("layercast_registry_worker_unreachable_deaths_total",
                      "Workers declared dead because a data-plane peer reported them unreachable and the "
                      "registry's own check agreed (libs/planning/liveness.py)")
UNREACHABLE_REPORTS = Counter("layercast_registry_unreachable_reports_total",
                              "WorkerUnreachable reports by what became of them", ["verdict"])
STALE_HEARTBEATS = Counter("layercast_registry_stale_heartbeats_total",
                           "Heartbeats a worker sent before it was declared dead that came after: ignored")

PROBE_TIMEOUT_S = 1.0  # a connect to a worker's data-plane address not answered by then: cannot tell

log = logging.getLogger(__name__)

class RegistryService(Service):
    name = "registry"

    def __init__(self, database_url: str, nats_url: str | None = None, heartbeat_ttl_s: float = 5.0,
                 liveness_rule: liveness.LivenessRule = liveness.LivenessRule()):
        super().__init__(nats_url)
        self.database_url = database_url
        self.heartbeat_ttl_s = heartbeat_ttl_s
        self.liveness_rule = liveness_rule
        self._unreachable: dict[str, tuple[liveness.Report, ...]] = {}  # worker -> reports that count
        # worker -> when it was last declared dead: a heartbeat sent before that (late in the bus)
        # is its dead incarnation's, and must not bring it back to life
        self._died_at: dict[str, float] = {}
        self.engine = None
        self.store: RegistryStore | None = None
        self._changed = asyncio.Event()  # the store counted a change not yet announced
        self._subscribe()

    def background(self) -> list:
        return [self.every(min(1.0, self.heartbeat_ttl_s / 3), self._expire_pass, "heartbeat expiry pass"),
                self.every(None, self.announce, "announcing a cluster change", wake=self._changed)]

    async def start(self) -> None:
        # Alembic is synchronous; run it off the event loop.
        await asyncio.to_thread(migrate, self.database_url)
        self.engine = make_engine(self.database_url)
        self.store = RegistryStore(self.engine, on_change=self._changed.set)
        await super().start()
        log.info("registry ready (database migrated)")

    async def stop(self) -> None:
        await super().stop()
        if self.engine is not None:
            await self.engine.dispose()

    async def _expire_pass(self) -> None:
        await self.expire_once()
        await self.update_gauges()

    async def announce(self) -> None:
        """Publish the change count after changes (several at once go out as one): planners
        keep their cluster view until it is behind this count."""
        await publish(self.broker, subjects.EVENT_CLUSTER_CHANGED,
                      m.ClusterChanged(epoch=self.store.epoch, changes=self.store.changes))

    async def update_gauges(self) -> None:
        WORKERS.set(len(await self.store.list_workers()))
        counts: dict[tuple[str, str], int] = {}
        for inst in await self.store.list_instances():
            key = (inst.model, inst.state.value)
            counts[key] = counts.get(key, 0) + 1
        INSTANCES.clear()  # a model that scaled to zero must read 0, not its last count
        for model in await self.store.list_models():
            INSTANCES.labels(model.name, "ready").set(0)
        for (model, state), n in counts.items():
            INSTANCES.labels(model, state).set(n)

    async def expire_once(self, exited: m.WorkerExited | None = None, *,
                          unreachable: m.WorkerUnreachable | None = None, why: str = "") -> list[m.WorkerInfo]:
        """Declare dead the workers whose heartbeats stopped, or the one whose process `exited`,
        or the one found `unreachable` (`why`: the verdict)."""
        named = exited or unreachable
        dead = await self.store.expire_workers(time.time() - self.heartbeat_ttl_s,
                                               None if named is None else [named.worker_id])
        if dead:
            (EXPIRED if named is None else EXITED if exited is not None else UNREACHABLE).inc(len(dead))
            failed = await self.store.stop_instances_on([w.worker_id for w in dead])
            died_at = time.time()
            for w in dead:
                self._unreachable.pop(w.worker_id, None)
                self._died_at[w.worker_id] = died_at
                if named is None:
                    log.warning("worker %s expired (no heartbeat for %.1fs)", w.worker_id, self.heartbeat_ttl_s)
                elif exited is not None:
                    log.warning("worker %s exited (%s): dead", w.worker_id, exited.reason or "its supervisor says")
                else:
                    log.warning("worker %s unreachable (reported by %s: %s; %s): dead", w.worker_id,
                                unreachable.reporter, unreachable.reason or "connection broke", why)
                await publish(self.broker, subjects.EVENT_WORKER_EXPIRED,
                              m.WorkerExpired(worker_id=w.worker_id, last_heartbeat=w.last_heartbeat))
            reason = ("worker expired" if named is None else "worker exited" if exited is not None
                      else "worker unreachable")
            for inst in failed:
                await publish(self.broker, subjects.EVENT_INSTANCE, m.InstanceEvent(instance=inst, reason=reason))
        return dead

    async def on_unreachable(self, req: m.WorkerUnreachable) -> m.CommandAck:
        """A peer could not reach `req.worker_id` on the data plane: check it (liveness.verdict)
        and, dead, stop it as an expiry would. Not alive here (unknown, dead already): ignored."""
        workers = {w.worker_id: w for w in await self.store.list_workers()}
        target = workers.get(req.worker_id)
        if target is None or req.reporter == req.worker_id or req.reporter not in workers:
            # (a reporter must be a live worker: a quorum of names nobody registered counts for nothing)
            UNREACHABLE_REPORTS.labels("ignored").inc()
            return m.CommandAck(accepted=False, detail="not a live worker" if target is None else
                                "a self-report" if req.reporter == req.worker_id else "the reporter is not a live worker")
        rule, now = self.liveness_rule, time.time()
        reports = liveness.add_report(self._unreachable.get(req.worker_id, ()), req.worker_id,
                                      liveness.Report(req.reporter, now), now, rule)
        self._unreachable[req.worker_id] = reports
        probe = await probe_data_plane(target.data_address)
        verdict = liveness.verdict(req.worker_id, reports, probe, time.time(), rule)
        if not verdict.dead:
            UNREACHABLE_REPORTS.labels("alive" if probe is liveness.Probe.accepted else "pending").inc()
            log.info("worker %s reported unreachable by %s (%s): %s", req.worker_id, req.reporter,
                     req.reason or "connection broke", verdict.why)
            return m.CommandAck(accepted=False, detail=verdict.why)
        UNREACHABLE_REPORTS.labels("dead").inc()
        dead = await self.expire_once(unreachable=req, why=verdict.why)
        return m.CommandAck(accepted=bool(dead), detail=verdict.why if dead else "not a live worker")

    def _subscribe(self) -> None:
        b = self.broker

        @b.subscriber(subjects.REGISTRY_WORKER_REGISTER)
        @rpc(m.RegisterWorker)
        async def register(req: m.RegisterWorker) -> m.WorkerInfo:
            info = await self.store.upsert_worker(req)
            log.info("worker %s registered at %s", req.worker_id, req.data_address)
            return info

        @b.subscriber(subjects.REGISTRY_WORKER_EXITED)
        @rpc(m.WorkerExited)
        async def exited(req: m.WorkerExited) -> m.CommandAck:
            dead = await self.expire_once(req)
            return m.CommandAck(accepted=bool(dead), detail="dead" if dead else "not a live worker")

        @b.subscriber(subjects.REGISTRY_WORKER_UNREACHABLE)
        @rpc(m.WorkerUnreachable)
        async def unreachable(req: m.WorkerUnreachable) -> m.CommandAck:
            return await self.on_unreachable(req)

        @b.subscriber(subjects.EVENT_HEARTBEAT)
        @on_event(m.Heartbeat)
        async def heartbeat(hb: m.Heartbeat) -> None:
            if hb.sent_at < self._died_at.get(hb.worker_id, 0.0):
                STALE_HEARTBEATS.inc()
                log.info("a heartbeat worker %s sent before it was declared dead came late: ignored", hb.worker_id)
                return
            await self.store.upsert_worker(hb)

        @b.subscriber(subjects.REGISTRY_MODEL_DEPLOY)
        @rpc(m.DeployModel)
        async def deploy(req: m.DeployModel) -> m.ModelInfo:
            if req.min_instances > req.max_instances:
                raise DomainError("min_instances must not exceed max_instances")
            try:
                check_policy(req.policy, req.policy_params, min_instances=req.min_instances,
                             max_instances=req.max_instances, keep_alive_s=req.keep_alive_s)
            except ValueError as e:
                raise DomainError(str(e)) from e  # before anything is stored; a bad deployment, not a conflict
            try:
                info = await self.store.deploy_model(req)
            except ValueError as e:
                raise DomainError(str(e), code="conflict") from e
            await publish(b, subjects.EVENT_MODEL, m.ModelEvent(kind="deployed", model=info))
            return info

        @b.subscriber(subjects.REGISTRY_MODEL_GET)
        @rpc(m.ModelRef)
        async def get_model(req: m.ModelRef) -> m.ModelInfo:
            info = await self.store.get_model(req.name)
            if info is None:
                raise DomainError(f"model {req.name!r} not found", code="not_found")
            return info

        @b.subscriber(subjects.REGISTRY_MODEL_LIST)
        @rpc(m.ListModels)
        async def list_models(req: m.ListModels) -> m.ModelList:
            return m.ModelList(models=await self.store.list_models(req.include_deleted))

        @b.subscriber(subjects.REGISTRY_MODEL_DELETE)
        @rpc(m.ModelRef)
        async def delete_model(req: m.ModelRef) -> m.ModelInfo:
            info = await self.store.delete_model(req.name)
            if info is None:
                raise DomainError(f"model {req.name!r} not found", code="not_found")
            await publish(b, subjects.EVENT_MODEL, m.ModelEvent(kind="deleted", model=info))
            return info

        @b.subscriber(subjects.REGISTRY_CLUSTER)
        @rpc(m.GetCluster)
        async def cluster(req: m.GetCluster) -> m.ClusterView:
            return await self.store.cluster_view(req.include_dead, req.recent_scale_ops)

        @b.subscriber(subjects.REGISTRY_INSTANCE_CREATE)
        @rpc(m.CreateInstance)
        async def create_instance(req: m.CreateInstance) -> m.InstanceInfo:
            return await self.store.create_instance(req)

        @b.subscriber(subjects.REGISTRY_SCALEOP_RECORD)
        @rpc(m.RecordScaleOp)
        async def record_scale_op(req: m.RecordScaleOp) -> m.ScaleOpInfo:
            return await self.store.record_scale_op(req)

        # --- LLM-Mesh profiles (workers and the CLI measure; schedulers fetch) ---
        @b.subscriber(subjects.REGISTRY_PROFILE_PUT)
        @rpc(m.ModelProfile)
        async def put_profile(req: m.ModelProfile) -> m.ModelProfile:
            if not m.is_model_name(req.model):  # a deployment's name (DeployModel.name)
                raise DomainError(f"invalid profile: model: {req.model!r} is not a model name", code="invalid")
            try:
                profile_from_message(req)  # a profile no scheduler could use is never stored
            except InvalidProfile as e:
                raise DomainError(f"invalid profile: {e}", code="invalid") from e
            stored = await self.store.put_profile(req)
            log.info("profile of %s on %s stored (from %s)", req.model, req.device, req.source or "?")
            return stored

        @b.subscriber(subjects.REGISTRY_PROFILE_GET)
        @rpc(m.ProfileRef)
        async def get_profile(req: m.ProfileRef) -> m.ModelProfile:
            profile = await self.store.get_profile(req.model, req.device)
            if profile is None:
                raise DomainError(f"no profile of model {req.model!r} on {req.device}", code="not_found")
            return profile

        # --- API keys and usage (the gateway asks; it alone ever sees a secret) ---
        @b.subscriber(subjects.REGISTRY_KEY_CREATE)
        @rpc(m.CreateApiKey)
        async def create_key(req: m.CreateApiKey) -> m.ApiKeyInfo:
            try:
                info = await self.store.create_key(req)
            except ValueError as e:
                raise DomainError(str(e), code="conflict") from e
            log.info("API key %s (%s) created", info.key_id, info.name)
            return info

        @b.subscriber(subjects.REGISTRY_KEY_LIST)
        @rpc(m.ListApiKeys)
        async def list_keys(req: m.ListApiKeys) -> m.ApiKeyList:
            return m.ApiKeyList(keys=await self.store.list_keys(req.include_revoked))

        @b.subscriber(subjects.REGISTRY_KEY_REVOKE)
        @rpc(m.ApiKeyRef)
        async def revoke_key(req: m.ApiKeyRef) -> m.ApiKeyInfo:
            info = await self.store.revoke_key(req.key_id)
            if info is None:
                raise DomainError(f"API key {req.key_id!r} not found", code="not_found")
            log.info("API key %s (%s) revoked", info.key_id, info.name)
            return info

        @b.subscriber(subjects.REGISTRY_KEY_LOOKUP)
        @rpc(m.LookupApiKey)
        async def lookup_key(req: m.LookupApiKey) -> m.ApiKeyInfo:
            info = await self.store.lookup_key(req.key_hash)
            if info is None:
                raise DomainError("no such API key", code="not_found")
            return info

        @b.subscriber(subjects.REGISTRY_USAGE_RECORD)
        @rpc(m.RecordUsage)
        async def record_usage(req: m.RecordUsage) -> m.UsageRecorded:
            await self.store.record_usage(req.entries)
            return m.UsageRecorded(entries=len(req.entries))

        @b.subscriber(subjects.REGISTRY_USAGE_GET)
        @rpc(m.GetUsage)
        async def usage(req: m.GetUsage) -> m.UsageReport:
            return m.UsageReport(usage=await self.store.usage(req.key, req.model))

        @b.subscriber(subjects.EVENT_BLOCK)
        @on_event(m.BlockEvent)
        async def block(ev: m.BlockEvent) -> None:
            await self.store.record_block(ev)
            if ev.scale_op_id and ev.state == m.ReplicaState.ready:
                await self.store.add_scale_op_timing(ev.scale_op_id, f"block:{ev.worker_id}:{ev.block_id}",
                                                     time.time())

        @b.subscriber(subjects.EVENT_TRANSFER)
        @on_event(m.TransferReport)
        async def transferred(report: m.TransferReport) -> None:
            # The registry, not the planner, records a receiver's part: its report may come after
            # the planner closed the operation (the last instance loaded first), or to a new planner.
            if not report.scale_op_id or not report.bytes_received and report.ok:
                return
            events = {f"transferred:{report.worker_id}": report.finished_at}
            if report.first_byte_at:
                events["first_byte"] = report.first_byte_at
            if report.block_arrived_at:
                events["first_block"] = min(report.block_arrived_at.values())
            await self.store.add_scale_op_timings(report.scale_op_id, events)

        @b.subscriber(subjects.EVENT_INSTANCE)
        @on_event(m.InstanceEvent)
        async def instance(ev: m.InstanceEvent) -> None:
            await self.store.record_instance(ev.instance)
            # A scale-out's local instances are timed here; its pipelines by the planner (pipeline_ready:).
            if ev.instance.scale_op_id and ev.instance.state == m.InstanceState.ready and ev.instance.mode == "local":
                await self.store.add_scale_op_timing(ev.instance.scale_op_id,
                                                     f"ready:{ev.instance.instance_id}",
                                                     ev.instance.ready_at or time.time())
                if ev.instance.loaded_at:
                    await self.store.add_scale_op_timing(ev.instance.scale_op_id,
                                                         f"loaded:{ev.instance.instance_id}", ev.instance.loaded_at)


async def probe_data_plane(data_address: str, timeout_s: float = PROBE_TIMEOUT_S) -> liveness.Probe:
    """Connect to a worker's registered data-plane address and hang up (its transport reads an
    empty hello and drops the connection): what liveness.verdict needs to know."""
    target = liveness.probe_target(data_address)
    if target is None:
        return liveness.Probe.untestable
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(*target), timeout_s)
    except ConnectionRefusedError:
        return liveness.Probe.refused
    except (OSError, TimeoutError):
        return liveness.Probe.silent  # no answer, host or network unreachable, name not resolved
    writer.close()
    try:
        await writer.wait_closed()
    except OSError:
        pass
    return liveness.Probe.accepted
