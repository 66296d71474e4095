"""A scale-in that picks an instance still loading: the worker ends the load early and the
instance is stopped, never served (against real NATS, Postgres and a real checkpoint)."""

import asyncio
import os
import shutil
import time

from libs.checkpoint import CheckpointIndex
from libs.checkpoint import fastload
from libs.checkpoint import loader as loader_module
from libs.protocol import messages as m
from libs.protocol import subjects
from libs.bus.broker import call
from services.gateway.workers import NatsWorkerClient
from services.worker.service import WorkerConfig, WorkerService
from test_registry import client, collect, started  # noqa: F401 - the client fixture

LOAD_S = 4.0  # the paced load's length: long enough to be stopped in the middle


def of_instance(events: list[m.InstanceEvent], instance_id: str) -> list[m.InstanceEvent]:
    return [ev for ev in events if ev.instance.instance_id == instance_id]


def stopped(events: list[m.InstanceEvent], instance_id: str) -> bool:
    return any(ev.instance.state == m.InstanceState.stopped for ev in of_instance(events, instance_id))


async def until(condition, timeout_s: float) -> None:
    """Wait for `condition()` (or the timeout: the assertions after it say what was missing)."""
    deadline = time.monotonic() + timeout_s
    while not condition() and time.monotonic() < deadline:
        await asyncio.sleep(0.01)


async def test_unloading_a_loading_instance_stops_its_load(database_url, nats_url, client, tiny_checkpoint):  # noqa: F811
    index = CheckpointIndex.load(tiny_checkpoint)
    total = sum(index.block(b).nbytes for b in range(index.n_blocks))
    seen: list[m.InstanceEvent] = []
    sub = await collect(client, subjects.EVENT_INSTANCE, m.InstanceEvent, seen)
    reg = await started(database_url, nats_url)
    worker = WorkerService(WorkerConfig(
        worker_id="w-cut", serve_while_loading=False, kv_cache_bytes=8 << 20,
        emulated_host_to_device_mbit=total * 8 / 1e6 / LOAD_S), nats_url)
    await worker.start()
    try:
        command = subjects.worker_command("w-cut")
        load = m.LoadModel(instance_id="i-cut", model="demo", path=str(tiny_checkpoint),
                           block_start=0, block_end=index.n_blocks)
        assert (await call(client, command, load, m.CommandAck)).accepted
        await asyncio.sleep(0.3)
        ack = await call(client, command, m.UnloadModel(instance_id="i-cut"), m.CommandAck)
        assert ack.accepted and ack.detail == "load cancelled"
        await until(lambda: stopped(seen, "i-cut"), LOAD_S * 2)
        await asyncio.sleep(0.5)  # anything the load would still publish
        states = [ev.instance.state for ev in of_instance(seen, "i-cut")]
        assert states[-1] == m.InstanceState.stopped, states
        assert m.InstanceState.ready not in states and "i-cut" not in worker.instances
        assert not worker._loading and not worker._unload_asked
        # Its blocks are not pinned any more: the host tier may evict them.
        assert all(not worker.cache.pinned((load.model, b)) for b in range(index.n_blocks))
        again = await call(client, command, m.UnloadModel(instance_id="i-cut"), m.CommandAck)
        assert not again.accepted
    finally:
        await sub.stop()
        await worker.stop()
        await reg.stop()


async def test_a_stop_the_world_load_serves_only_once_every_block_is_loaded(database_url, nats_url, client,  # noqa: F811
                                                                             tiny_checkpoint):
    """By default an instance serves from its first block on; a LoadModel that says
    stop-the-world (the serverlessllm baseline's) is ready only after its last block."""
    index = CheckpointIndex.load(tiny_checkpoint)
    total = sum(index.block(b).nbytes for b in range(index.n_blocks))
    seen: list[m.InstanceEvent] = []
    sub = await collect(client, subjects.EVENT_INSTANCE, m.InstanceEvent, seen)

    def first_ready(iid: str) -> m.InstanceEvent | None:
        return next((ev for ev in of_instance(seen, iid) if ev.instance.state == m.InstanceState.ready), None)

    def loaded_at(iid: str) -> float | None:
        return next((ev.instance.loaded_at for ev in of_instance(seen, iid) if ev.instance.loaded_at), None)
    reg = await started(database_url, nats_url)
    worker = WorkerService(WorkerConfig(worker_id="w-stw", kv_cache_bytes=8 << 20,
                                        emulated_host_to_device_mbit=total * 8 / 1e6 / 2.0), nats_url)
    await worker.start()
    try:
        command = subjects.worker_command("w-stw")
        for iid, serve in (("i-early", True), ("i-stw", False)):
            load = m.LoadModel(instance_id=iid, model="demo", path=str(tiny_checkpoint), block_start=0,
                               block_end=index.n_blocks, serve_while_loading=serve)
            assert (await call(client, command, load, m.CommandAck)).accepted
            await until(lambda: first_ready(iid) and loaded_at(iid), 10)
            assert first_ready(iid) and loaded_at(iid), (iid, of_instance(seen, iid))
            await call(client, command, m.UnloadModel(instance_id=iid), m.CommandAck)
        early, stw = first_ready("i-early"), first_ready("i-stw")
        assert early.reason == "serving, rest loading"
        assert early.instance.ready_at < loaded_at("i-early") - 0.3  # the paced last block came later
        assert stw.reason == "loaded"
        assert stw.instance.ready_at <= loaded_at("i-stw")
    finally:
        await sub.stop()
        await worker.stop()
        await reg.stop()


async def test_unloading_a_load_from_a_slow_disk_stops_its_reads_at_once(database_url, nats_url, client,  # noqa: F811
                                                                         tiny_checkpoint, monkeypatch):
    """A stop-the-world load from a slow disk (serverlessllm's, on a throttled disk): the unload
    cancels the disk reads at once, within the read piece each reader is in, instead of at the
    end of the block being read; the disk is free for the next load."""
    index = CheckpointIndex.load(tiny_checkpoint)
    piece = 64 << 10
    monkeypatch.setattr(fastload, "READ_PIECE_BYTES", piece)
    real, reads = os.preadv, []

    def slow_preadv(fd, buffers, offset):
        reads.append(time.monotonic())
        time.sleep(0.05)  # 64 KiB per 50 ms and reader: the whole model takes many seconds
        return real(fd, buffers, offset)

    monkeypatch.setattr(loader_module.os, "preadv", slow_preadv)
    seen: list[m.InstanceEvent] = []
    sub = await collect(client, subjects.EVENT_INSTANCE, m.InstanceEvent, seen)
    reg = await started(database_url, nats_url)
    worker = WorkerService(WorkerConfig(worker_id="w-disk", kv_cache_bytes=8 << 20), nats_url)
    await worker.start()
    try:
        command = subjects.worker_command("w-disk")
        load = m.LoadModel(instance_id="i-disk", model="demo", path=str(tiny_checkpoint), block_start=0,
                           block_end=index.n_blocks, serve_while_loading=False)
        assert (await call(client, command, load, m.CommandAck)).accepted
        await until(lambda: len(reads) >= 8, 30)
        ack = await call(client, command, m.UnloadModel(instance_id="i-disk"), m.CommandAck)
        unloaded_at = time.monotonic()
        assert ack.accepted and ack.detail == "load cancelled"
        await until(lambda: stopped(seen, "i-disk"), 10)
        states = [ev.instance.state for ev in of_instance(seen, "i-disk")]
        assert states[-1] == m.InstanceState.stopped, states
        assert not worker._loading and not worker._disk_jobs
        # Reads in flight at the unload finish (one piece per reader); none start later.
        late = [t for t in reads if t > unloaded_at + 0.2]
        assert late == [], f"{len(late)} reads after the unload; {len(reads)} in all"
        assert len(reads) * piece < index.total_nbytes
    finally:
        await sub.stop()
        await worker.stop()
        await reg.stop()


def test_a_workers_free_disk_moving_within_a_gib_is_not_a_change(monkeypatch, nats_url):
    """Heartbeats re-register the worker, and a registration that differs counts as a change to
    the cluster view (the planner's kept view goes stale). Free disk moves with every log line,
    so it is reported in whole GiB."""
    worker = WorkerService(WorkerConfig(worker_id="w-disk-free"), nats_url)
    usage = shutil.disk_usage(".")
    for free in ((7 << 30) + 12345, (7 << 30) + (900 << 20), 7 << 30):
        monkeypatch.setattr(shutil, "disk_usage", lambda _path, free=free: usage._replace(free=free))
        assert worker._registration()["capacities"][m.Tier.ssd] == 7 << 30
    monkeypatch.setattr(shutil, "disk_usage", lambda _path: usage._replace(free=(8 << 30) + 1))
    assert worker._registration()["capacities"][m.Tier.ssd] == 8 << 30


class _SlowStage:
    """A hosted stage whose forward pass takes `seconds` more (in-process throttle): the switch
    below comes while the entry's step waits on it."""

    def __init__(self, stage, seconds: float):
        self.stage, self.seconds, self.slots = stage, seconds, stage.slots
        self.calls = 0

    def open(self, request_id):
        self.stage.open(request_id)

    def close(self, request_id):
        self.stage.close(request_id)

    def forward(self, request_ids, inputs, q_len, logits_to_keep=0):
        self.calls += 1
        time.sleep(self.seconds)
        return self.stage.forward(request_ids, inputs, q_len, logits_to_keep)


async def test_a_mode_switch_lets_the_pipelines_step_in_flight_deliver_its_tokens(database_url, nats_url, client,  # noqa: F811
                                                                                  tiny_checkpoint):
    """λScale §4.4: a pipeline that retires because its workers hold the model locally does not
    throw away the step its stages are computing. The entry's unload with `switched_to` waits
    for it, its token goes out, and only then are the requests handed over ("instance
    stopped"); a failure's unload (no `switched_to`) aborts the wait instead."""
    index = CheckpointIndex.load(tiny_checkpoint)
    seen: list[m.InstanceEvent] = []
    tokens: list[m.TokenEvent] = []
    sub = await collect(client, subjects.EVENT_INSTANCE, m.InstanceEvent, seen)
    token_sub = await collect(client, subjects.tokens("gw-switch", "r-switch"), m.TokenEvent, tokens)
    reg = await started(database_url, nats_url)
    workers = [WorkerService(WorkerConfig(worker_id=wid, kv_cache_bytes=8 << 20), nats_url)
               for wid in ("w-entry", "w-stage")]
    for w in workers:
        await w.start()
    try:
        for w in workers:  # both hold the model in engine memory, as the receivers of a multicast would
            iid = f"i-{w.config.worker_id}"
            load = m.LoadModel(instance_id=iid, model="demo", path=str(tiny_checkpoint), block_start=0,
                               block_end=index.n_blocks)
            assert (await call(client, subjects.worker_command(w.config.worker_id), load, m.CommandAck)).accepted
            await until(lambda: any(ev.instance.loaded_at for ev in of_instance(seen, iid)), 30)
        entry, stage = workers
        start = m.StartPipeline(instance_id="i-pipe", model="demo", path=str(tiny_checkpoint),
                                stages=[m.Stage(worker_id="w-entry", block_start=0, block_end=1),
                                        m.Stage(worker_id="w-stage", block_start=1, block_end=index.n_blocks)],
                                peers={w.config.worker_id: w.transport.address for w in workers})
        for w in (stage, entry):  # later stages first, the entry last (as the planner sends them)
            assert (await call(client, subjects.worker_command(w.config.worker_id), start, m.CommandAck)).accepted
        slow = _SlowStage(stage.pipelines.server.stages["i-pipe/1"], seconds=1.5)
        # (its caller named again, as the worker named it: replacing a stage revokes its caller's messages)
        stage.pipelines.server.add("i-pipe/1", slow, caller="w-entry", address=entry.transport.address)

        # Sent as the gateway sends it (its worker client), tokens to the gateway's reply subject.
        gateway = NatsWorkerClient(client, gateway_id="gw-switch")
        request = m.GenerateRequest(request_id="r-switch", instance_id="i-pipe", model="demo", prompt_ids=[1, 2, 3],
                                    sampling=m.SamplingSpec(temperature=0, max_tokens=8),
                                    reply_subject=gateway.reply_subject("r-switch"))
        await gateway.generate("w-entry", request, timeout_s=5.0)
        await until(lambda: slow.calls >= 1, 10)  # the prefill's step is in the slow stage now
        assert slow.calls == 1 and tokens == []
        unload = m.UnloadModel(instance_id="i-pipe", drain_timeout_s=0.0, switched_to=["i-w-entry", "i-w-stage"])
        assert (await call(client, subjects.worker_command("w-entry"), unload, m.CommandAck)).accepted
        await until(lambda: any(ev.instance.instance_id == "i-pipe" and ev.instance.state == m.InstanceState.stopped
                                for ev in seen), 10)
        await asyncio.sleep(0.3)  # the last token events
        stop = next(ev for ev in of_instance(seen, "i-pipe") if ev.instance.state == m.InstanceState.stopped)
        assert stop.switched_to == ["i-w-entry", "i-w-stage"]
        # The step in flight delivered its token; then the request was handed back, unfinished.
        assert tokens[0].error is None and tokens[0].index == 0 and tokens[0].token_id is not None, tokens
        assert tokens[-1].finished and tokens[-1].finish_reason == "error", tokens
        assert all(ev.error is None for ev in tokens[:-1])
    finally:
        await sub.stop()
        await token_sub.stop()
        for w in workers:
            await w.stop()
        await reg.stop()
