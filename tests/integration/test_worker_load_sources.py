"""A load that waits on a running transfer (LoadModel.incoming_transfer): blocks the transfer
delivers come from the host tier, and when it ends without one, that block and every later
one it has not delivered are read from disk (against real NATS, Postgres and a checkpoint)."""

import asyncio

from libs.bus.broker import call
from libs.checkpoint import CheckpointIndex
from libs.protocol import messages as m
from libs.protocol import subjects
from services.worker.loading import BLOCK_BYTES
from services.worker.service import WorkerConfig, WorkerService
from test_registry import client, collect, started  # noqa: F401 - the client fixture
from test_worker_unload import of_instance, until


def loaded(events: list[m.InstanceEvent], instance_id: str) -> bool:
    return any(ev.instance.loaded_at for ev in of_instance(events, instance_id))


def tier_bytes() -> dict[str, float]:
    return {t: BLOCK_BYTES.labels(t)._value.get() for t in ("host", "ssd")}


async def test_blocks_a_transfer_did_not_deliver_are_read_from_disk(database_url, nats_url, client,  # noqa: F811
                                                                    tiny_checkpoint):
    index = CheckpointIndex.load(tiny_checkpoint)
    assert index.n_blocks == 2
    size = [index.block(b).nbytes for b in range(2)]
    seen: list[m.InstanceEvent] = []
    sub = await collect(client, subjects.EVENT_INSTANCE, m.InstanceEvent, seen)
    reg = await started(database_url, nats_url)
    worker = WorkerService(WorkerConfig(worker_id="w-src", kv_cache_bytes=8 << 20), nats_url)
    await worker.start()
    loop = asyncio.get_running_loop()
    try:
        job = await asyncio.to_thread(worker.loader.start, str(tiny_checkpoint), index, [0])
        block0 = await asyncio.to_thread(job.wait, 0)
        block0 = job.host[0][: block0.numel()] if job.host else block0
        command = subjects.worker_command("w-src")

        # Block 0 arrives; the transfer ends without block 1: it alone is read from disk.
        delivered, lost = loop.create_future(), loop.create_future()
        delivered.set_result(block0)
        lost.set_result(None)
        worker._incoming.update({("demo", 0): delivered, ("demo", 1): lost})
        before = tier_bytes()
        load = m.LoadModel(instance_id="i-one", model="demo", path=str(tiny_checkpoint), block_start=0,
                           block_end=2, incoming_transfer="t-1")
        assert (await call(client, command, load, m.CommandAck)).accepted
        await until(lambda: loaded(seen, "i-one"), 15)
        assert loaded(seen, "i-one"), of_instance(seen, "i-one")
        after = tier_bytes()
        assert (after["host"] - before["host"], after["ssd"] - before["ssd"]) == (size[0], size[1])

        # Block 0 is lost and block 1 still on its way: both are read from disk, the load does
        # not wait for block 1 (the transfer that ended never brings it).
        lost, pending = loop.create_future(), loop.create_future()
        lost.set_result(None)
        worker._incoming.update({("demo", 0): lost, ("demo", 1): pending})
        before = tier_bytes()
        load = load.model_copy(update={"instance_id": "i-two"})
        assert (await call(client, command, load, m.CommandAck)).accepted
        await until(lambda: loaded(seen, "i-two"), 15)
        assert loaded(seen, "i-two"), of_instance(seen, "i-two")
        after = tier_bytes()
        assert (after["host"] - before["host"], after["ssd"] - before["ssd"]) == (0, sum(size))
        assert not pending.done()
        worker._incoming.clear()
    finally:
        await sub.stop()
        await worker.stop()
        await reg.stop()
