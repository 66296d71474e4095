"""The registry against real NATS and real Postgres: persistence, heartbeats,
bad input, migrations."""

import asyncio
import time

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import create_engine

from libs.db.session import migrate, sync_url
from libs.db.models import Base
from libs.protocol import messages as m
from libs.protocol import subjects
from libs.bus.broker import RemoteError, call, make_broker, publish, request_body, start_broker
from services.registry.service import RegistryService


def registration(worker_id: str = "w1") -> m.RegisterWorker:
    return m.RegisterWorker(worker_id=worker_id, data_address="127.0.0.1:7000",
                            topology=m.Topology(host="h1", leaf="leaf-a", link_gbps=25),
                            capacities={m.Tier.gpu: 1 << 30, m.Tier.host: 4 << 30, m.Tier.ssd: 100 << 30})


def deployment(name: str = "demo", **extra) -> m.DeployModel:
    return m.DeployModel(name=name, path="/models/demo", arch="LlamaForCausalLM", n_layers=4, blocks=[
        m.BlockInfo(block_id=0, nbytes=1000, checksum="0000abcd", layer_start=0, layer_end=2),
        m.BlockInfo(block_id=1, nbytes=900, checksum="0000abce", layer_start=2, layer_end=4)],
        min_instances=0, max_instances=2, keep_alive_s=30, **extra)


SLO = {"policy": "slo", "policy_params": {"ttft_slo_s": 0.5, "tpot_slo_s": 0.05}}


@pytest.fixture
async def client(nats_url):
    broker = make_broker(nats_url)
    await start_broker(broker)
    yield broker
    await broker.stop()


async def collect(client, subject: str, kind: type[m.Message], into: list) -> object:
    """Append every `kind` event on `subject` to `into`; returns the started subscriber (stop it)."""
    sub = client.subscriber(subject)

    @sub
    async def on_event(body: dict) -> None:
        into.append(kind.model_validate(body))

    await sub.start()
    return sub


async def started(database_url: str, nats_url: str, ttl: float = 5.0) -> RegistryService:
    reg = RegistryService(database_url, nats_url, heartbeat_ttl_s=ttl)
    await reg.start()
    return reg


async def test_state_survives_a_registry_restart(database_url, nats_url, client):
    reg = await started(database_url, nats_url)
    try:
        await call(client, subjects.REGISTRY_WORKER_REGISTER, registration(), m.WorkerInfo)
        await call(client, subjects.REGISTRY_MODEL_DEPLOY, deployment(**SLO), m.ModelInfo)
        await publish(client, subjects.EVENT_BLOCK, m.BlockEvent(model="demo", block_id=1, worker_id="w1",
                                                                 tier=m.Tier.host, state=m.ReplicaState.ready))
        await call(client, subjects.REGISTRY_SCALEOP_RECORD, m.RecordScaleOp(
            scale_op_id="op-1", model="demo", direction="up", reason="test", from_instances=0, to_instances=1,
            state="running", timings={"decided": 1.0}), m.ScaleOpInfo)
        await asyncio.sleep(0.3)  # the block event is fire-and-forget
    finally:
        await reg.stop()
    with pytest.raises(TimeoutError):  # really down
        await call(client, subjects.REGISTRY_MODEL_GET, m.ModelRef(name="demo"), m.ModelInfo, timeout=0.5)

    reg = await started(database_url, nats_url)
    try:
        info = await call(client, subjects.REGISTRY_MODEL_GET, m.ModelRef(name="demo"), m.ModelInfo)
        assert [b.checksum for b in info.blocks] == ["0000abcd", "0000abce"]
        assert info.total_bytes == 1900 and info.max_instances == 2
        assert {"policy": info.policy, "policy_params": info.policy_params} == SLO
        view = await call(client, subjects.REGISTRY_CLUSTER, m.GetCluster(), m.ClusterView)
        assert [w.worker_id for w in view.workers] == ["w1"]
        assert view.workers[0].topology.leaf == "leaf-a"
        assert [(r.worker_id, r.block_id, r.tier) for r in view.replicas] == [("w1", 1, m.Tier.host)]
        assert view.scale_ops[0].scale_op_id == "op-1" and view.scale_ops[0].timings == {"decided": 1.0}
    finally:
        await reg.stop()


async def test_heartbeats_keep_a_worker_alive_and_their_absence_expires_it(database_url, nats_url, client):
    reg = await started(database_url, nats_url, ttl=0.6)
    expired: list[m.WorkerExpired] = []
    sub = await collect(client, subjects.EVENT_WORKER_EXPIRED, m.WorkerExpired, expired)
    try:
        await call(client, subjects.REGISTRY_WORKER_REGISTER, registration("w1"), m.WorkerInfo)
        await call(client, subjects.REGISTRY_WORKER_REGISTER, registration("w2"), m.WorkerInfo)
        # w1 heartbeats, w2 stays silent.
        for _ in range(8):
            await publish(client, subjects.EVENT_HEARTBEAT, m.Heartbeat(**registration("w1").model_dump()))
            await asyncio.sleep(0.2)
        view = await call(client, subjects.REGISTRY_CLUSTER, m.GetCluster(), m.ClusterView)
        assert [w.worker_id for w in view.workers] == ["w1"]
        assert [e.worker_id for e in expired] == ["w2"]
        dead = await call(client, subjects.REGISTRY_CLUSTER, m.GetCluster(include_dead=True), m.ClusterView)
        assert {w.worker_id: w.state for w in dead.workers} == {"w1": "alive", "w2": "dead"}
        # A heartbeat from an expired worker re-admits it (w1 heartbeats on: its TTL is short).
        for worker_id in ("w1", "w2"):
            await publish(client, subjects.EVENT_HEARTBEAT, m.Heartbeat(**registration(worker_id).model_dump()))
        await asyncio.sleep(0.2)
        view = await call(client, subjects.REGISTRY_CLUSTER, m.GetCluster(), m.ClusterView)
        assert {w.worker_id for w in view.workers} == {"w1", "w2"}
    finally:
        await sub.stop()
        await reg.stop()


async def test_a_heartbeat_sent_before_a_workers_death_does_not_bring_it_back(database_url, nats_url, client):
    """Its supervisor saw the process exit; a heartbeat it sent just before, delivered late (a
    busy registry, a queue in the bus), would mark it alive again, and the next report of its
    death would count it dead twice. Only a heartbeat sent after the death re-admits it (a
    restarted worker's, as after an expiry)."""
    reg = await started(database_url, nats_url, ttl=60.0)
    try:
        await call(client, subjects.REGISTRY_WORKER_REGISTER, registration("w1"), m.WorkerInfo)
        before_death = m.Heartbeat(**registration("w1").model_dump())  # sent_at: now, before the exit
        await asyncio.sleep(0.01)
        ack = await call(client, subjects.REGISTRY_WORKER_EXITED, m.WorkerExited(worker_id="w1", reason="killed"),
                         m.CommandAck)
        assert ack.accepted and ack.detail == "dead"
        await publish(client, subjects.EVENT_HEARTBEAT, before_death)
        await asyncio.sleep(0.3)
        view = await call(client, subjects.REGISTRY_CLUSTER, m.GetCluster(), m.ClusterView)
        assert view.workers == []
        again = await call(client, subjects.REGISTRY_WORKER_EXITED, m.WorkerExited(worker_id="w1"), m.CommandAck)
        assert not again.accepted  # already dead: counted once
        await publish(client, subjects.EVENT_HEARTBEAT, m.Heartbeat(**registration("w1").model_dump()))
        await asyncio.sleep(0.3)
        view = await call(client, subjects.REGISTRY_CLUSTER, m.GetCluster(), m.ClusterView)
        assert [w.worker_id for w in view.workers] == ["w1"]
    finally:
        await reg.stop()


async def test_worker_expiry_fails_its_instances(database_url, nats_url, client):
    reg = await started(database_url, nats_url, ttl=0.5)
    try:
        await call(client, subjects.REGISTRY_WORKER_REGISTER, registration("w1"), m.WorkerInfo)
        await call(client, subjects.REGISTRY_MODEL_DEPLOY, deployment(), m.ModelInfo)
        await call(client, subjects.REGISTRY_INSTANCE_CREATE, m.CreateInstance(
            instance_id="i1", model="demo", stages=[m.Stage(worker_id="w1", block_start=0, block_end=2)]),
            m.InstanceInfo)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            view = await call(client, subjects.REGISTRY_CLUSTER, m.GetCluster(), m.ClusterView)
            if not view.instances and not view.workers:
                break
            await asyncio.sleep(0.1)
        assert view.instances == [] and view.workers == []
    finally:
        await reg.stop()


async def test_a_worker_reported_unreachable_dies_only_when_the_registrys_own_check_agrees(
        database_url, nats_url, client):
    """Issue 40: a data-plane peer's report (WorkerUnreachable) stops a worker long before its
    heartbeats expire (TTL 60 s here), but only once the registry's own connect to its data-plane
    address is refused, or enough peers agree: one peer's false report kills no live worker."""
    import socket

    from libs.transfer.tcp.transport import TcpTransport

    reg = await started(database_url, nats_url, ttl=60.0)
    expired: list[m.WorkerExpired] = []
    sub = await collect(client, subjects.EVENT_WORKER_EXPIRED, m.WorkerExpired, expired)
    live = TcpTransport("live")  # a worker's data plane, listening
    gone = socket.create_server(("127.0.0.1", 0))  # a port where nothing listens once closed
    gone_address = "127.0.0.1:%d" % gone.getsockname()[1]
    gone.close()

    def at(worker_id: str, address: str) -> m.RegisterWorker:
        return registration(worker_id).model_copy(update={"data_address": address})

    async def report(worker_id: str, reporter: str) -> m.CommandAck:
        return await call(client, subjects.REGISTRY_WORKER_UNREACHABLE,
                          m.WorkerUnreachable(worker_id=worker_id, reporter=reporter, reason="test"), m.CommandAck)
    try:
        await call(client, subjects.REGISTRY_WORKER_REGISTER, at("alive", live.address), m.WorkerInfo)
        await call(client, subjects.REGISTRY_WORKER_REGISTER, at("killed", gone_address), m.WorkerInfo)
        await call(client, subjects.REGISTRY_WORKER_REGISTER, at("rdma", "rdma://rdma/mlx5_0/1"), m.WorkerInfo)
        for peer in ("w2", "w3", "w4"):  # the reporters: live workers
            await call(client, subjects.REGISTRY_WORKER_REGISTER, at(peer, live.address), m.WorkerInfo)
        await call(client, subjects.REGISTRY_MODEL_DEPLOY, deployment(), m.ModelInfo)
        await call(client, subjects.REGISTRY_INSTANCE_CREATE, m.CreateInstance(
            instance_id="i1", model="demo", stages=[m.Stage(worker_id="killed", block_start=0, block_end=2)]),
            m.InstanceInfo)

        assert not (await report("killed", "nobody")).accepted  # a name no live worker has counts for nothing
        for reporter in ("w2", "w3", "w4"):  # however many say so: its data plane answers
            assert not (await report("alive", reporter)).accepted
        ack = await report("killed", "w2")  # refused at its address: dead at once
        assert ack.accepted and "refused" in ack.detail, ack
        ack = await report("rdma", "w2")  # no address a connect can test: a second peer needed
        assert not ack.accepted and "1 of 2" in ack.detail, ack
        assert not (await report("rdma", "w2")).accepted  # the same peer again is still one
        assert not (await report("rdma", "rdma")).accepted  # nor does a worker count for itself
        assert (await report("rdma", "w3")).accepted
        assert not (await report("killed", "w3")).accepted  # dead already: nothing more happens

        view = await call(client, subjects.REGISTRY_CLUSTER, m.GetCluster(include_dead=True), m.ClusterView)
        assert {w.worker_id: w.state for w in view.workers} == {
            "alive": "alive", "killed": "dead", "rdma": "dead", "w2": "alive", "w3": "alive", "w4": "alive"}
        assert [i.state for i in view.instances if i.instance_id == "i1"] in ([], [m.InstanceState.failed])
        await asyncio.sleep(0.2)  # events are fire-and-forget
        assert sorted(e.worker_id for e in expired) == ["killed", "rdma"]
    finally:
        await sub.stop()
        await reg.stop()
        live.close()


async def test_malformed_requests_get_errors_and_the_registry_keeps_serving(database_url, nats_url, client):
    reg = await started(database_url, nats_url)
    try:
        for bad in (b"not json", {"worker_id": "w 1"}, {"worker_id": "w1", "data_address": 3}, [1, 2]):
            body = await request_body(client, subjects.REGISTRY_WORKER_REGISTER, bad, timeout=15, grace=15)
            assert body["code"] == "invalid" and "RegisterWorker" in body["error"]
        await publish(client, subjects.EVENT_HEARTBEAT, m.ModelRef(name="not a heartbeat"))
        with pytest.raises(RemoteError, match="not found"):
            await call(client, subjects.REGISTRY_MODEL_GET, m.ModelRef(name="nope"), m.ModelInfo)
        await call(client, subjects.REGISTRY_MODEL_DEPLOY, deployment(), m.ModelInfo)
        with pytest.raises(RemoteError, match="already deployed"):
            await call(client, subjects.REGISTRY_MODEL_DEPLOY, deployment(), m.ModelInfo)
        # A parameter the scaling policy does not have is refused, and nothing is stored.
        with pytest.raises(RemoteError, match="unknown parameter 'tarjet' for scaling policy 'concurrency'"):
            await call(client, subjects.REGISTRY_MODEL_DEPLOY, deployment("other", policy_params={"tarjet": 4}),
                       m.ModelInfo)
        with pytest.raises(RemoteError, match="not found"):
            await call(client, subjects.REGISTRY_MODEL_GET, m.ModelRef(name="other"), m.ModelInfo)
        info = await call(client, subjects.REGISTRY_WORKER_REGISTER, registration(), m.WorkerInfo)
        assert info.state == "alive"
    finally:
        await reg.stop()


async def test_deleted_model_is_hidden_and_can_be_redeployed(database_url, nats_url, client):
    reg = await started(database_url, nats_url)
    try:
        await call(client, subjects.REGISTRY_MODEL_DEPLOY, deployment(), m.ModelInfo)
        deleted = await call(client, subjects.REGISTRY_MODEL_DELETE, m.ModelRef(name="demo"), m.ModelInfo)
        assert deleted.state == m.ModelState.deleted
        models = await call(client, subjects.REGISTRY_MODEL_LIST, m.ListModels(), m.ModelList)
        assert models.models == []
        again = await call(client, subjects.REGISTRY_MODEL_DEPLOY, deployment(), m.ModelInfo)
        assert again.state == m.ModelState.deployed
    finally:
        await reg.stop()


@pytest.mark.parametrize("kind", ["postgres", "sqlite"])
def test_migrations_match_the_models_on_both_databases(kind, database_url, tmp_path):
    url = database_url if kind == "postgres" else f"sqlite:///{tmp_path / 'r.db'}"
    migrate(url)
    migrate(url)  # idempotent: every start runs it
    engine = create_engine(sync_url(url))
    with engine.connect() as conn:
        diff = compare_metadata(MigrationContext.configure(conn), Base.metadata)
    engine.dispose()
    assert diff == []


@pytest.mark.parametrize("kind", ["postgres", "sqlite"])
async def test_concurrent_timing_reports_on_one_scale_op_are_all_kept(kind, database_url, tmp_path):
    """The planner and the registry's event handlers add timings to one scale operation at
    the same moment (a block event and the instance-ready event): none may be lost. SQLite
    ignores FOR UPDATE: there a write transaction holds the write lock from its start."""
    from libs.db.session import make_engine
    from libs.db.store import RegistryStore

    url = database_url if kind == "postgres" else f"sqlite:///{tmp_path / 'r.db'}"
    migrate(url)
    engine = make_engine(url)
    try:
        store = RegistryStore(engine)
        op = m.ScaleOpInfo(scale_op_id="op-race", model="demo", direction="up", reason="test", from_instances=0,
                           to_instances=1, state="running", timings={"decided": 1.0})
        await store.record_scale_op(op)
        events = [f"block:w{i % 3}:{i}" for i in range(24)]
        await asyncio.gather(
            *(store.add_scale_op_timing("op-race", e, float(i)) for i, e in enumerate(events)),
            store.record_scale_op(op.model_copy(update={"state": "done", "timings": {"done": 99.0}})),
        )
        (stored,) = [o for o in await store.recent_scale_ops(10) if o.scale_op_id == "op-race"]
        assert set(stored.timings) == {"decided", "done", *events} and stored.state == "done"
    finally:
        await engine.dispose()


@pytest.mark.parametrize("kind", ["postgres", "sqlite"])
async def test_timings_that_come_before_the_operation_is_recorded_are_kept(kind, database_url, tmp_path):
    """The planner records a scale-up in the background while its transfers start: a receiver's
    report (or a block event) can reach the registry first, several at once, and the planner's
    record at the same moment. Every event is kept; the operation is listed once recorded."""
    from libs.db.session import make_engine
    from libs.db.store import RegistryStore

    url = database_url if kind == "postgres" else f"sqlite:///{tmp_path / 'r.db'}"
    migrate(url)
    engine = make_engine(url)
    try:
        store = RegistryStore(engine)
        early = {"transferred:w1": 5.0, "first_byte": 3.0}
        await store.add_scale_op_timings("op-early", early)
        assert "op-early" not in {o.scale_op_id for o in await store.recent_scale_ops(10)}  # not recorded yet
        op = m.ScaleOpInfo(scale_op_id="op-early", model="demo", direction="up", reason="test", from_instances=1,
                           to_instances=3, state="running", timings={"decided": 1.0})
        racing = [f"transferred:w{i}" for i in range(2, 8)]
        await asyncio.gather(store.record_scale_op(op),
                             *(store.add_scale_op_timing("op-early", e, 6.0) for e in racing))
        (stored,) = [o for o in await store.recent_scale_ops(10) if o.scale_op_id == "op-early"]
        assert set(stored.timings) == {"decided", *early, *racing}
        assert (stored.model, stored.state, stored.to_instances) == ("demo", "running", 3)
        # The first writers of a new operation's row may also race each other.
        await asyncio.gather(*(store.add_scale_op_timing("op-new", f"block:w1:{b}", 1.0) for b in range(6)),
                             store.record_scale_op(op.model_copy(update={"scale_op_id": "op-new"})))
        (new,) = [o for o in await store.recent_scale_ops(10) if o.scale_op_id == "op-new"]
        assert set(new.timings) == {"decided", *(f"block:w1:{b}" for b in range(6))}
    finally:
        await engine.dispose()


async def test_transfer_reports_stamp_the_operation_even_after_it_closed(database_url, nats_url, client):
    """Receivers' reports give the op its first byte (the earliest), first block and each
    receiver's end, also when they come after the planner's closing record."""
    reg = await started(database_url, nats_url)
    try:
        op = m.RecordScaleOp(scale_op_id="op-late", model="demo", direction="up", reason="test", from_instances=1,
                             to_instances=3, state="done", timings={"decided": 1.0, "done": 9.0})
        await call(client, subjects.REGISTRY_SCALEOP_RECORD, op, m.ScaleOpInfo)
        for worker, first_byte, finished in (("w2", 2.5, 8.0), ("w1", 2.0, 7.0)):
            await publish(client, subjects.EVENT_TRANSFER, m.TransferReport(
                transfer_id="t", worker_id=worker, model="demo", ok=True, started_at=1.5, finished_at=finished,
                first_byte_at=first_byte, block_arrived_at={0: first_byte + 1}, bytes_received=1900,
                scale_op_id="op-late"))
        await publish(client, subjects.EVENT_TRANSFER, m.TransferReport(  # a source's report: nothing received
            transfer_id="t", worker_id="w0", model="demo", ok=True, started_at=1.5, finished_at=8.0,
            bytes_sent=1900, scale_op_id="op-late"))

        def stamped(view: m.ClusterView) -> dict | None:
            t = next(o for o in view.scale_ops if o.scale_op_id == "op-late").timings
            return t if "transferred:w1" in t and "transferred:w2" in t else None

        deadline = time.monotonic() + 5
        while not (t := stamped(await call(client, subjects.REGISTRY_CLUSTER, m.GetCluster(), m.ClusterView))):
            assert time.monotonic() < deadline, "the reports were not recorded"
            await asyncio.sleep(0.05)
        assert t["first_byte"] == 2.0 and t["first_block"] == 3.0 and t["done"] == 9.0
        assert t["transferred:w1"] == 7.0 and t["transferred:w2"] == 8.0 and "transferred:w0" not in t
    finally:
        await reg.stop()


async def test_instance_states_only_move_forward(database_url):
    """Late events never undo later ones: a planner's late "loading" does not undo "ready",
    a worker's "ready" or "every block loaded" does not route a draining instance again,
    and stopped is final. Both times (serving, loaded) are kept."""
    from libs.db.session import make_engine
    from libs.db.store import RegistryStore

    migrate(database_url)
    engine = make_engine(database_url)
    try:
        store = RegistryStore(engine)
        base = m.InstanceInfo(instance_id="i-forward", model="demo", state=m.InstanceState.loading,
                              stages=[m.Stage(worker_id="w1", block_start=0, block_end=2)], created_at=time.time())

        async def state_after(**update) -> m.InstanceInfo:
            await store.record_instance(base.model_copy(update=update))
            (row,) = [i for i in await store.list_instances(live_only=False) if i.instance_id == "i-forward"]
            return row

        assert (await state_after()).state == m.InstanceState.loading
        ready = await state_after(state=m.InstanceState.ready, ready_at=100.0)
        assert ready.state == m.InstanceState.ready and ready.ready_at == pytest.approx(100.0)
        assert (await state_after(state=m.InstanceState.loading)).state == m.InstanceState.ready
        assert (await state_after(state=m.InstanceState.draining)).state == m.InstanceState.draining
        late = await state_after(state=m.InstanceState.ready, ready_at=100.0, loaded_at=105.0)
        assert late.state == m.InstanceState.draining and late.loaded_at == pytest.approx(105.0)
        assert (await state_after(state=m.InstanceState.stopped)).state == m.InstanceState.stopped
        assert (await state_after(state=m.InstanceState.ready)).state == m.InstanceState.stopped
    finally:
        await engine.dispose()


async def test_changes_to_the_cluster_view_are_counted_and_announced(database_url, nats_url, client):
    """The registry counts committed changes to workers, models, replicas and instances and
    announces the count; a heartbeat that only moves the heartbeat time, a scale-op record and a
    refused deploy are not changes. A view carries the count it was read at."""
    announced: list[m.ClusterChanged] = []
    sub = await collect(client, subjects.EVENT_CLUSTER_CHANGED, m.ClusterChanged, announced)
    reg = await started(database_url, nats_url)
    try:
        store = reg.store

        async def counted(write) -> int:
            before = store.changes
            await write
            return store.changes - before

        assert await counted(store.upsert_worker(registration("w1"))) == 1  # a new worker
        assert await counted(store.upsert_worker(m.Heartbeat(**registration("w1").model_dump()))) == 0
        moved = registration("w1").model_copy(update={"data_address": "127.0.0.1:7001"})
        assert await counted(store.upsert_worker(moved)) == 1  # re-registered elsewhere
        assert await counted(store.deploy_model(deployment())) == 1
        with pytest.raises(ValueError):
            await store.deploy_model(deployment())  # already deployed: rolled back, not counted
        assert store.changes == 3
        assert await counted(store.record_block(m.BlockEvent(
            worker_id="w1", model="demo", block_id=0, tier=m.Tier.host, state=m.ReplicaState.ready))) == 1
        assert await counted(store.create_instance(m.CreateInstance(
            instance_id="i-1", model="demo", stages=[m.Stage(worker_id="w1", block_start=0, block_end=2)]))) == 1
        op = m.RecordScaleOp(scale_op_id="op-1", model="demo", direction="up", reason="test", from_instances=0,
                             to_instances=1, state="running")
        assert await counted(store.record_scale_op(op)) == 0
        assert await counted(store.expire_workers(time.time() - 60)) == 0  # nobody is that late

        view = await store.cluster_view()
        assert (view.epoch, view.changes) == (store.epoch, 5)
        deadline = time.monotonic() + 5
        while not (announced and announced[-1].changes == 5) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert announced and announced[-1] == m.ClusterChanged(epoch=store.epoch, changes=5)
        assert [a.changes for a in announced] == sorted(a.changes for a in announced)

        view = await call(client, subjects.REGISTRY_CLUSTER, m.GetCluster(), m.ClusterView)
        assert (view.epoch, view.changes) == (store.epoch, 5)
    finally:
        await sub.stop()
        await reg.stop()
