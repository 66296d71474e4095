"""The registry's queries and updates, translating between rows and protocol messages."""

import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from datetime import UTC, datetime

from sqlalchemy import delete, or_, select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession

from libs.db.session import make_sessionmaker, write_sessionmaker
from libs.db.models import (ApiKey, BlockReplica, Instance, KeyUsage, Model, ModelBlock, ModelProfileRow,
                             ScaleOperation, Worker)
from libs.protocol import messages as m


def to_dt(ts: float) -> datetime:
    return datetime.fromtimestamp(ts, UTC)


def to_ts(dt: datetime | None) -> float | None:
    if dt is None:
        return None
    if dt.tzinfo is None:  # SQLite returns naive datetimes; they were stored as UTC
        dt = dt.replace(tzinfo=UTC)
    return dt.timestamp()


def _worker_info(w: Worker) -> m.WorkerInfo:
    return m.WorkerInfo(
        worker_id=w.worker_id,
        data_address=w.data_address,
        topology=m.Topology(host=w.host, leaf=w.leaf, scaleup_group=w.scaleup_group, link_gbps=w.link_gbps),
        capacities=w.capacities,
        bandwidths_gbps=w.bandwidths_gbps or {},
        state=w.state,
        last_heartbeat=to_ts(w.last_heartbeat),
    )


def _model_info(row: Model, blocks: list[ModelBlock]) -> m.ModelInfo:
    return m.ModelInfo(
        name=row.name,
        path=row.path,
        arch=row.arch,
        n_layers=row.n_layers,
        blocks=[
            m.BlockInfo(block_id=b.block_id, nbytes=b.nbytes, checksum=b.checksum, layer_start=b.layer_start,
                        layer_end=b.layer_end)
            for b in sorted(blocks, key=lambda b: b.block_id)
        ],
        min_instances=row.min_instances,
        max_instances=row.max_instances,
        keep_alive_s=row.keep_alive_s,
        max_queue=row.max_queue,
        scaling_mode=row.scaling_mode,
        policy=row.policy,
        policy_params=row.policy_params or {},
        ttft_slo_s=row.ttft_slo_s,
        tpot_slo_s=row.tpot_slo_s,
        state=row.state,
        created_at=to_ts(row.created_at),
    )


def _instance_info(row: Instance) -> m.InstanceInfo:
    return m.InstanceInfo(
        instance_id=row.instance_id,
        model=row.model,
        mode=row.mode,
        stages=[m.Stage.model_validate(s) for s in row.stages],
        state=row.state,
        created_at=to_ts(row.created_at),
        ready_at=to_ts(row.ready_at),
        loaded_at=to_ts(row.loaded_at),
        scale_op_id=row.scale_op_id,
        max_batch=row.max_batch,
        device=row.device,
    )


def _profile_message(row: ModelProfileRow) -> m.ModelProfile:
    return m.ModelProfile(model=row.model, device=row.device, prefill_lengths=row.prefill_lengths,
                          prefill_s=row.prefill_s, batches=row.batches, lengths=row.lengths, decode_s=row.decode_s,
                          measured_at=to_ts(row.measured_at), source=row.source)


# A scale operation whose events reached the registry before the planner's record of it: not
# listed until that record comes.
UNRECORDED = "unrecorded"


def _scale_op_info(row: ScaleOperation) -> m.ScaleOpInfo:
    return m.ScaleOpInfo(
        scale_op_id=row.scale_op_id,
        model=row.model,
        direction=row.direction,
        reason=row.reason,
        from_instances=row.from_instances,
        to_instances=row.to_instances,
        state=row.state,
        plan=row.plan,
        timings=row.timings,
        error=row.error,
    )


def _key_info(row: ApiKey) -> m.ApiKeyInfo:
    return m.ApiKeyInfo(key_id=row.key_id, name=row.name, prefix=row.prefix, models=row.models,
                        requests_per_minute=row.requests_per_minute, tokens_per_minute=row.tokens_per_minute,
                        created_at=to_ts(row.created_at), revoked_at=to_ts(row.revoked_at))


class RegistryStore:
    def __init__(self, engine: AsyncEngine, on_change: Callable[[], None] | None = None):
        self._insert = postgresql.insert if engine.dialect.name == "postgresql" else sqlite.insert
        self.sessions = make_sessionmaker(engine)  # reads
        self.writes = write_sessionmaker(engine)
        # Committed changes to what cluster_view shows (workers, models, replicas, instances),
        # counted by this process: a view read after the count was n holds at least n changes.
        self.epoch = uuid.uuid4().hex[:12]
        self.changes = 0
        self.on_change = on_change  # called after each counted commit

    def _counted(self) -> None:
        self.changes += 1
        if self.on_change is not None:
            self.on_change()

    @asynccontextmanager
    async def _changing(self) -> AsyncIterator[AsyncSession]:
        """A write session that changes the cluster view: counted once it commits (a rolled back
        one is not)."""
        async with self.writes.begin() as s:
            yield s
        self._counted()

    # --- workers -------------------------------------------------------------------

    async def upsert_worker(self, reg: m.RegisterWorker, now: float | None = None) -> m.WorkerInfo:
        now_dt = to_dt(now or time.time())
        async with self.writes.begin() as s:
            w = await s.get(Worker, reg.worker_id)
            before = None
            if w is None:
                w = Worker(worker_id=reg.worker_id, registered_at=now_dt)
                s.add(w)
            else:
                before = _worker_info(w).model_copy(update={"last_heartbeat": 0.0})
            w.data_address = reg.data_address
            w.host, w.leaf = reg.topology.host, reg.topology.leaf
            w.scaleup_group, w.link_gbps = reg.topology.scaleup_group, reg.topology.link_gbps
            w.capacities = {str(k): v for k, v in reg.capacities.items()}
            w.bandwidths_gbps = dict(reg.bandwidths_gbps)
            w.state = "alive"
            w.last_heartbeat = now_dt
            await s.flush()
            info = _worker_info(w)
        # A heartbeat that only moves the heartbeat time is not a change (it would make every
        # cached view stale once a second per worker).
        if before != info.model_copy(update={"last_heartbeat": 0.0}):
            self._counted()
        return info

    async def expire_workers(self, older_than: float, worker_ids: list[str] | None = None) -> list[m.WorkerInfo]:
        """Mark workers whose last heartbeat is older than `older_than` dead (or, given
        `worker_ids`, those workers whatever their heartbeat: their process exited), drop
        their replicas and stop their instances. Returns the newly dead workers."""
        async with self.writes.begin() as s:  # runs every second: counted only when someone died
            which = (Worker.worker_id.in_(worker_ids) if worker_ids is not None
                     else Worker.last_heartbeat < to_dt(older_than))
            rows = (await s.scalars(select(Worker).where(Worker.state == "alive", which))).all()
            dead = [w.worker_id for w in rows]
            if not dead:
                return []
            for w in rows:
                w.state = "dead"
            await s.execute(delete(BlockReplica).where(BlockReplica.worker_id.in_(dead)))
            infos = [_worker_info(w) for w in rows]
        self._counted()
        return infos

    async def list_workers(self, include_dead: bool = False) -> list[m.WorkerInfo]:
        async with self.sessions() as s:
            return await _workers(s, include_dead)

    # --- models ---------------------------------------------------------------------------

    async def deploy_model(self, req: m.DeployModel) -> m.ModelInfo:
        async with self._changing() as s:
            row = await s.get(Model, req.name)
            if row is not None and row.state == "deployed":
                raise ValueError(f"model {req.name!r} is already deployed")
            await s.execute(delete(ModelBlock).where(ModelBlock.model == req.name))
            await s.execute(delete(BlockReplica).where(BlockReplica.model == req.name))
            if row is None:
                row = Model(name=req.name)
                s.add(row)
            row.path, row.arch, row.n_layers = req.path, req.arch, req.n_layers
            row.n_blocks = len(req.blocks)
            row.total_bytes = sum(b.nbytes for b in req.blocks)
            row.min_instances, row.max_instances = req.min_instances, req.max_instances
            row.keep_alive_s, row.max_queue = req.keep_alive_s, req.max_queue
            row.scaling_mode = req.scaling_mode
            row.policy, row.policy_params = req.policy, dict(req.policy_params)
            row.ttft_slo_s, row.tpot_slo_s = req.ttft_slo_s, req.tpot_slo_s
            row.state, row.created_at = "deployed", to_dt(time.time())
            blocks = [ModelBlock(model=req.name, **b.model_dump()) for b in req.blocks]
            s.add_all(blocks)
            await s.flush()
            return _model_info(row, blocks)

    async def get_model(self, name: str) -> m.ModelInfo | None:
        async with self.sessions() as s:
            row = await s.get(Model, name)
            if row is None:
                return None
            blocks = (await s.scalars(select(ModelBlock).where(ModelBlock.model == name))).all()
            return _model_info(row, list(blocks))

    async def list_models(self, include_deleted: bool = False) -> list[m.ModelInfo]:
        async with self.sessions() as s:
            return await _models(s, include_deleted)

    async def delete_model(self, name: str) -> m.ModelInfo | None:
        async with self._changing() as s:
            row = await s.get(Model, name)
            if row is None or row.state == "deleted":
                return None
            row.state = "deleted"
        return await self.get_model(name)

    # --- replicas ------------------------------------------------------------------------------

    async def record_block(self, ev: m.BlockEvent) -> None:
        async with self._changing() as s:
            if await s.get(Worker, ev.worker_id) is None:
                return  # a block report from a worker we never saw: ignore until it registers
            existing = await s.scalar(
                select(BlockReplica).where(
                    BlockReplica.model == ev.model,
                    BlockReplica.block_id == ev.block_id,
                    BlockReplica.worker_id == ev.worker_id,
                    BlockReplica.tier == ev.tier.value,
                )
            )
            if ev.state == m.ReplicaState.evicted:
                if existing is not None:
                    await s.delete(existing)
                return
            if existing is None:
                existing = BlockReplica(model=ev.model, block_id=ev.block_id, worker_id=ev.worker_id,
                                        tier=ev.tier.value)
                s.add(existing)
            existing.state = ev.state.value
            existing.updated_at = to_dt(time.time())

    async def list_replicas(self) -> list[m.ReplicaInfo]:
        async with self.sessions() as s:
            return await _replicas(s)

    # --- instances --------------------------------------------------------------------------------

    async def create_instance(self, req: m.CreateInstance) -> m.InstanceInfo:
        async with self._changing() as s:
            row = Instance(
                instance_id=req.instance_id,
                model=req.model,
                mode="local" if len(req.stages) == 1 else "pipeline",
                stages=[st.model_dump() for st in req.stages],
                state="loading",
                scale_op_id=req.scale_op_id,
                created_at=to_dt(time.time()),
                device=req.device,
            )
            s.add(row)
            await s.flush()
            return _instance_info(row)

    async def record_instance(self, info: m.InstanceInfo) -> None:
        """Apply an instance event; stopped/failed is final and never revived."""
        async with self._changing() as s:
            # Row lock: the worker's and the planner's events for one instance can arrive together.
            row = await s.get(Instance, info.instance_id, with_for_update=True)
            if row is None:
                row = Instance(instance_id=info.instance_id, model=info.model, mode=info.mode,
                               stages=[st.model_dump() for st in info.stages], scale_op_id=info.scale_op_id,
                               created_at=to_dt(info.created_at), state=info.state.value)
                s.add(row)
            elif row.state in ("stopped", "failed"):
                return
            elif info.state == m.InstanceState.loading and row.state != "loading":
                return  # a late "loading" (the planner's) never undoes the worker's "ready"
            if row.state == "draining" and info.state == m.InstanceState.ready:
                # A drain was asked for: a late "ready" (an attach racing the drain, or the
                # worker's "every block loaded") only adds its times, never routes it again.
                info = info.model_copy(update={"state": m.InstanceState.draining})
            row.state = info.state.value
            if row.ready_at is None and (info.ready_at is not None or info.state == m.InstanceState.ready):
                row.ready_at = to_dt(info.ready_at or time.time())
            if info.loaded_at is not None and row.loaded_at is None:
                row.loaded_at = to_dt(info.loaded_at)
            if info.max_batch is not None:
                row.max_batch = info.max_batch
            if info.device != "cpu":
                # "cpu" is also what a sender that does not know says (the planner's events); an
                # instance's device never changes, so only another kind, from its worker, is news.
                row.device = info.device
            if info.state in (m.InstanceState.stopped, m.InstanceState.failed):
                row.stopped_at = to_dt(time.time())

    async def stop_instances_on(self, worker_ids: list[str]) -> list[m.InstanceInfo]:
        """Instances with a stage on a dead worker are gone: mark them failed."""
        async with self._changing() as s:
            rows = (
                await s.scalars(select(Instance).where(Instance.state.in_(("loading", "ready", "draining"))))
            ).all()
            hit = [r for r in rows if any(st["worker_id"] in worker_ids for st in r.stages)]
            for r in hit:
                r.state, r.stopped_at = "failed", to_dt(time.time())
            return [_instance_info(r) for r in hit]

    async def list_instances(self, live_only: bool = True) -> list[m.InstanceInfo]:
        async with self.sessions() as s:
            return await _instances(s, live_only)

    # --- scale operations ---------------------------------------------------------------------------

    async def record_scale_op(self, op: m.ScaleOpInfo) -> m.ScaleOpInfo:
        """Create or update; timings are merged so several reporters can add events."""
        now = to_dt(time.time())
        async with self.writes.begin() as s:
            row = await self._scale_op_row(s, op.scale_op_id, now)
            row.model, row.direction, row.reason = op.model, op.direction, op.reason
            row.from_instances, row.to_instances = op.from_instances, op.to_instances
            row.state, row.plan, row.error = op.state, op.plan or row.plan or {}, op.error
            row.timings = {**(row.timings or {}), **op.timings}
            row.updated_at = now
            await s.flush()
            return _scale_op_info(row)

    async def add_scale_op_timing(self, scale_op_id: str, event: str, at: float) -> None:
        await self.add_scale_op_timings(scale_op_id, {event: at})

    async def add_scale_op_timings(self, scale_op_id: str, events: dict[str, float]) -> None:
        """Add events to an operation's timings; an event already there keeps the earlier time
        (several reporters stamp first_byte: the first one is the operation's). The planner
        records an operation in the background while its transfers start, so an event may come
        first: it is kept on a row not yet listed, which the planner's record completes."""
        async with self.writes.begin() as s:
            row = await self._scale_op_row(s, scale_op_id, to_dt(time.time()))
            timings = dict(row.timings or {})
            for event, at in events.items():
                timings[event] = min(timings.get(event, at), at)
            row.timings = timings

    async def _scale_op_row(self, s: AsyncSession, scale_op_id: str, now) -> ScaleOperation:
        """The operation's row, locked: the planner and the registry's event handlers merge
        timings into it concurrently, and without the lock one read-modify-write loses the
        other's events. Inserted first if missing (a no-op if another writer just did), so two
        first writers do not collide on the key."""
        await s.execute(self._insert(ScaleOperation).values(
            scale_op_id=scale_op_id, model="", direction="", reason="", from_instances=0, to_instances=0,
            state=UNRECORDED, plan={}, timings={}, created_at=now, updated_at=now,
        ).on_conflict_do_nothing(index_elements=[ScaleOperation.scale_op_id]))
        return await s.get(ScaleOperation, scale_op_id, with_for_update=True, populate_existing=True)

    async def recent_scale_ops(self, limit: int) -> list[m.ScaleOpInfo]:
        async with self.sessions() as s:
            return await _recent_scale_ops(s, limit)

    async def cluster_view(self, include_dead: bool = False, recent_scale_ops: int = 20) -> m.ClusterView:
        """Everything a planner decides on, read in one session: a scale decision waits on this,
        and one connection checkout instead of five keeps it short."""
        changes = self.changes  # before the read: the snapshot holds at least these
        async with self.sessions() as s:
            return m.ClusterView(workers=await _workers(s, include_dead), models=await _models(s),
                                 replicas=await _replicas(s), instances=await _instances(s),
                                 scale_ops=await _recent_scale_ops(s, recent_scale_ops),
                                 epoch=self.epoch, changes=changes)


    # --- LLM-Mesh performance profiles ----------------------------------------------------------------

    async def put_profile(self, profile: m.ModelProfile) -> m.ModelProfile:
        """Store a model's profile on a device kind, replacing the one measured before."""
        async with self.writes.begin() as s:
            row = await s.get(ModelProfileRow, (profile.model, profile.device), with_for_update=True)
            if row is None:
                row = ModelProfileRow(model=profile.model, device=profile.device)
                s.add(row)
            row.prefill_lengths, row.prefill_s = list(profile.prefill_lengths), list(profile.prefill_s)
            row.batches, row.lengths = list(profile.batches), list(profile.lengths)
            row.decode_s = [list(r) for r in profile.decode_s]
            row.measured_at, row.source = to_dt(profile.measured_at), profile.source
            await s.flush()
            return _profile_message(row)

    async def get_profile(self, model: str, device: str) -> m.ModelProfile | None:
        async with self.sessions() as s:
            row = await s.get(ModelProfileRow, (model, device))
            return None if row is None else _profile_message(row)

    # --- API keys and usage ---------------------------------------------------------------------------

    async def create_key(self, req: m.CreateApiKey) -> m.ApiKeyInfo:
        """A new key; a name another live key has is a ValueError (keys are told apart by name
        in usage reports and metrics)."""
        async with self.writes.begin() as s:
            taken = await s.scalar(select(ApiKey.key_id).where(ApiKey.name == req.name, ApiKey.revoked_at.is_(None)))
            if taken is not None or req.name == m.STATIC_KEY_ID:
                raise ValueError(f"an API key named {req.name!r} exists already")
            row = ApiKey(key_id=f"key-{uuid.uuid4().hex[:16]}", name=req.name, prefix=req.prefix,
                         key_hash=req.key_hash, models=req.models, requests_per_minute=req.requests_per_minute,
                         tokens_per_minute=req.tokens_per_minute, created_at=to_dt(time.time()))
            s.add(row)
            await s.flush()
            return _key_info(row)

    async def list_keys(self, include_revoked: bool = False) -> list[m.ApiKeyInfo]:
        q = select(ApiKey).order_by(ApiKey.created_at)
        if not include_revoked:
            q = q.where(ApiKey.revoked_at.is_(None))
        async with self.sessions() as s:
            return [_key_info(r) for r in (await s.scalars(q)).all()]

    async def revoke_key(self, key_id: str) -> m.ApiKeyInfo | None:
        """Revoke a live key; None if there is none by that id."""
        async with self.writes.begin() as s:
            row = await s.get(ApiKey, key_id, with_for_update=True)
            if row is None or row.revoked_at is not None:
                return None
            row.revoked_at = to_dt(time.time())
            return _key_info(row)

    async def lookup_key(self, key_hash: str) -> m.ApiKeyInfo | None:
        """The live key with this hash, if any."""
        async with self.sessions() as s:
            row = await s.scalar(select(ApiKey).where(ApiKey.key_hash == key_hash, ApiKey.revoked_at.is_(None)))
            return None if row is None else _key_info(row)

    async def record_usage(self, entries: list[m.UsageEntry]) -> None:
        """Add each entry's counts to its (key, model) totals, in one transaction. An upsert that
        adds in the database: gateways record concurrently and none of their counts is lost."""
        now = to_dt(time.time())
        async with self.writes.begin() as s:
            for e in entries:
                ins = self._insert(KeyUsage).values(key_id=e.key_id, model=e.model, requests=e.requests,
                                                    prompt_tokens=e.prompt_tokens,
                                                    completion_tokens=e.completion_tokens, updated_at=now)
                await s.execute(ins.on_conflict_do_update(
                    index_elements=[KeyUsage.key_id, KeyUsage.model],
                    set_={"requests": KeyUsage.requests + ins.excluded.requests,
                          "prompt_tokens": KeyUsage.prompt_tokens + ins.excluded.prompt_tokens,
                          "completion_tokens": KeyUsage.completion_tokens + ins.excluded.completion_tokens,
                          "updated_at": ins.excluded.updated_at}))

    async def usage(self, key: str | None = None, model: str | None = None) -> list[m.UsageEntry]:
        """Totals per key and model; `key` is a key id or a key name (every key of that name)."""
        q = (select(KeyUsage, ApiKey.name).outerjoin(ApiKey, ApiKey.key_id == KeyUsage.key_id)
             .order_by(KeyUsage.key_id, KeyUsage.model))
        if key is not None:
            q = q.where(or_(KeyUsage.key_id == key, ApiKey.name == key))
        if model is not None:
            q = q.where(KeyUsage.model == model)
        async with self.sessions() as s:
            return [m.UsageEntry(key_id=u.key_id, key_name=name or u.key_id, model=u.model, requests=u.requests,
                                 prompt_tokens=u.prompt_tokens, completion_tokens=u.completion_tokens)
                    for u, name in (await s.execute(q)).all()]


# --- reads shared by the list methods and cluster_view (one session each call) ---------------

async def _workers(s: AsyncSession, include_dead: bool = False) -> list[m.WorkerInfo]:
    q = select(Worker).order_by(Worker.worker_id)
    if not include_dead:
        q = q.where(Worker.state == "alive")
    return [_worker_info(w) for w in (await s.scalars(q)).all()]


async def _models(s: AsyncSession, include_deleted: bool = False) -> list[m.ModelInfo]:
    q = select(Model).order_by(Model.name)
    if not include_deleted:
        q = q.where(Model.state == "deployed")
    rows = (await s.scalars(q)).all()
    by_model: dict[str, list[ModelBlock]] = {}
    for b in (await s.scalars(select(ModelBlock))).all():
        by_model.setdefault(b.model, []).append(b)
    return [_model_info(r, by_model.get(r.name, [])) for r in rows]


async def _replicas(s: AsyncSession) -> list[m.ReplicaInfo]:
    rows = (await s.scalars(select(BlockReplica).order_by(BlockReplica.id))).all()
    return [m.ReplicaInfo(model=r.model, block_id=r.block_id, worker_id=r.worker_id, tier=r.tier, state=r.state)
            for r in rows]


async def _instances(s: AsyncSession, live_only: bool = True) -> list[m.InstanceInfo]:
    q = select(Instance).order_by(Instance.created_at)
    if live_only:
        q = q.where(Instance.state.in_(("loading", "ready", "draining")))
    return [_instance_info(r) for r in (await s.scalars(q)).all()]


async def _recent_scale_ops(s: AsyncSession, limit: int) -> list[m.ScaleOpInfo]:
    q = (select(ScaleOperation).where(ScaleOperation.state != UNRECORDED)
         .order_by(ScaleOperation.created_at.desc()).limit(limit))
    return [_scale_op_info(r) for r in (await s.scalars(q)).all()]
