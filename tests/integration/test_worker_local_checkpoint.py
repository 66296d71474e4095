"""A worker reports the checkpoints on its local disk in the ssd tier, so the registry records
them and the planner's load-time estimate (ServerlessLLM §6.2) tells a worker that would read
the model locally from one that has nothing (against real NATS, Postgres and a checkpoint)."""

import asyncio

from libs.bus.broker import call
from libs.checkpoint import CheckpointIndex
from libs.protocol import messages as m
from libs.protocol import subjects
from services.worker.service import WorkerConfig, WorkerService, local_checkpoint
from test_registry import client, collect, started  # noqa: F401 - the client fixture
from test_worker_unload import until


def deployment(name: str, path, index: CheckpointIndex) -> m.DeployModel:
    return m.DeployModel(name=name, path=str(path), arch=index.arch, n_layers=index.n_layers, blocks=[
        m.BlockInfo(block_id=b.id, nbytes=b.nbytes, checksum=b.checksum, layer_start=b.layer_start,
                    layer_end=b.layer_end) for b in index.blocks])


def ssd_blocks(events: list[m.BlockEvent], worker_id: str, model: str) -> set[int]:
    return {ev.block_id for ev in events if (ev.worker_id, ev.model, ev.tier, ev.state)
            == (worker_id, model, m.Tier.ssd, m.ReplicaState.ready)}


async def test_a_worker_reports_a_deployed_checkpoint_it_can_read_in_the_ssd_tier(  # noqa: F811
        database_url, nats_url, client, tiny_checkpoint):
    index = CheckpointIndex.load(tiny_checkpoint)
    blocks = {b.id for b in index.blocks}
    seen: list[m.BlockEvent] = []
    sub = await collect(client, subjects.EVENT_BLOCK, m.BlockEvent, seen)
    reg = await started(database_url, nats_url)
    # Deployed before the worker starts: the worker finds it by listing the models.
    await call(client, subjects.REGISTRY_MODEL_DEPLOY, deployment("early", tiny_checkpoint, index), m.ModelInfo)
    worker = WorkerService(WorkerConfig(worker_id="w-local", kv_cache_bytes=8 << 20), nats_url)
    await worker.start()
    try:
        await until(lambda: ssd_blocks(seen, "w-local", "early") == blocks, 15)
        assert ssd_blocks(seen, "w-local", "early") == blocks
        # Deployed while it runs: the model event makes it report.
        await call(client, subjects.REGISTRY_MODEL_DEPLOY, deployment("late", tiny_checkpoint, index), m.ModelInfo)
        await until(lambda: ssd_blocks(seen, "w-local", "late") == blocks, 15)
        assert ssd_blocks(seen, "w-local", "late") == blocks

        def recorded(view: m.ClusterView) -> set[tuple[str, int]]:
            return {(r.model, r.block_id) for r in view.replicas
                    if r.worker_id == "w-local" and r.tier == m.Tier.ssd and r.state == m.ReplicaState.ready}

        want = {(name, b) for name in ("early", "late") for b in blocks}
        for _ in range(100):  # the registry records the events it heard in its own time
            view = await call(client, subjects.REGISTRY_CLUSTER, m.GetCluster(), m.ClusterView)
            if recorded(view) == want:
                break
            await asyncio.sleep(0.1)
        assert recorded(view) == want
        sizes = {b.id: b.nbytes for b in index.blocks}
        assert all(ev.nbytes == sizes[ev.block_id] for ev in seen if ev.tier == m.Tier.ssd)
    finally:
        await sub.stop()
        await worker.stop()
        await reg.stop()


def test_a_checkpoint_outside_the_local_checkpoint_dirs_is_not_local(tiny_checkpoint, tmp_path):
    # No directories given: readable means local.
    assert local_checkpoint(str(tiny_checkpoint)) is not None
    # Given: only what lies under one of them (a path on a network volume elsewhere is not).
    assert local_checkpoint(str(tiny_checkpoint), [str(tiny_checkpoint.parent)]) is not None
    assert local_checkpoint(str(tiny_checkpoint), [str(tmp_path)]) is None
    # Not a block checkpoint (or not readable here): nothing to report.
    assert local_checkpoint(str(tmp_path)) is None
