"""The worker's load path (services/worker/loading.py) without NATS: real host tier, disk
loader, engine thread and checkpoint blocks, and a recording fake of its one I/O port (the
events it publishes). Loads cancelled mid-way and unloads racing a load."""

import asyncio
import os
import time
from dataclasses import dataclass

import pytest

from libs.checkpoint import CheckpointIndex, convert_checkpoint, load_block
from libs.checkpoint import fastload
from libs.checkpoint import loader as loader_module
from libs.checkpoint.fastload import BlockLoader, LoaderConfig
from libs.planning import instance as lifecycle
from libs.protocol import messages as m
from services.worker.host_cache import HostBlockCache
from services.worker.loading import InstanceLoading
from services.worker.runtime import EngineRuntime
from services.worker.sharing import ExclusiveSharing

MODEL = "demo"


@dataclass
class Settings:
    worker_id: str = "w-test"
    device: str = "cpu"
    max_batch_size: int = 2
    max_seq_len: int = 64
    kv_cache_bytes: int = 8 << 20
    serve_while_loading: bool = True
    load_chunk_bytes: int = 1 << 20


class RecordedEvents:
    """The WorkerEvents port, recording what the worker would publish."""

    def __init__(self):
        self.instances: list[m.InstanceEvent] = []
        self.blocks: list[m.BlockEvent] = []

    async def instance(self, info, reason, switched_to=()):
        self.instances.append(m.InstanceEvent(instance=info, reason=reason, switched_to=list(switched_to)))

    async def block(self, model, block_id, tier, state, nbytes=0, seconds=0.0, scale_op_id=None, from_tier=None):
        self.blocks.append(m.BlockEvent(model=model, block_id=block_id, worker_id="w-test", tier=tier, state=state,
                                        nbytes=nbytes, seconds=seconds, scale_op_id=scale_op_id, from_tier=from_tier))

    async def evicted(self, keys):
        for model, block_id in keys:
            await self.block(model, block_id, m.Tier.host, m.ReplicaState.evicted)

    def bandwidth(self, link, nbytes, seconds):
        pass

    def states(self, instance_id: str) -> list[m.InstanceState]:
        return [ev.instance.state for ev in self.instances if ev.instance.instance_id == instance_id]

    def reasons(self, instance_id: str) -> list[str]:
        return [ev.reason for ev in self.instances if ev.instance.instance_id == instance_id]


@pytest.fixture(scope="module")
def four_blocks(tiny_checkpoint, tmp_path_factory):
    """The tiny demo model in 4 blocks: a load with blocks still to come after it attaches."""
    out = tmp_path_factory.mktemp("four-blocks")
    convert_checkpoint(tiny_checkpoint.parent / "hf", out, 4)
    return out


class Worker:
    """The pieces a worker builds its loading from, with the events recorded."""

    def __init__(self, serve_while_loading: bool = True):
        self.events = RecordedEvents()
        self.cache = HostBlockCache(1 << 30)
        self.instances = {}
        self.incoming: dict[tuple[str, int], asyncio.Future] = {}
        self.tasks: set[asyncio.Task] = set()
        settings = Settings(serve_while_loading=serve_while_loading)
        self.loading = InstanceLoading(settings, self.events, self.cache,
                                       BlockLoader("cpu", LoaderConfig(chunk_bytes=1 << 20, threads=2)),
                                       self.instances, incoming=self.incoming,
                                       sharing=ExclusiveSharing(settings, None),  # exclusive reads no port
                                       spawn=self.spawn)
        self.runtime = EngineRuntime(asyncio.get_running_loop(), lambda batch: None)
        self.runtime.start()
        self.loading.runtime = self.runtime

    def spawn(self, coro) -> asyncio.Task:
        task = asyncio.ensure_future(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task

    async def unload(self, instance_id: str, **asked) -> lifecycle.Answer:
        effects = self.loading.step(instance_id, lifecycle.UnloadAsked(**asked))
        self.spawn(self.loading.run(instance_id, effects))
        return next(e for e in effects if isinstance(e, lifecycle.Answer))

    async def until(self, condition, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not condition():
            assert time.monotonic() < deadline, "timed out"
            await asyncio.sleep(0.01)

    async def settle(self) -> None:
        """Every task it started has ended."""
        await self.until(lambda: not self.tasks)

    def close(self) -> None:
        self.runtime.stop()


def load_model(path, iid: str, n_blocks: int, **kw) -> m.LoadModel:
    return m.LoadModel(instance_id=iid, model=MODEL, path=str(path), block_start=0, block_end=n_blocks, **kw)


def nothing_left(w: Worker, iid: str, n_blocks: int) -> None:
    assert iid not in w.loading.lifecycles and not w.loading.loads_running() and not w.loading.disk_reads()
    assert iid not in w.instances and iid not in w.runtime._engines
    assert not any(w.cache.pinned((MODEL, b)) for b in range(n_blocks)), "a pin leaked"
    assert iid not in w.loading.in_engine


async def test_a_load_model_loads_attaches_and_reports_loaded_once(four_blocks):
    w = Worker()
    try:
        ack = await w.loading.on_load(load_model(four_blocks, "i-1", 4))
        assert ack.accepted and ack.detail == "loading"
        again = await w.loading.on_load(load_model(four_blocks, "i-1", 4))
        assert again.detail == "already loaded or loading"
        await w.until(lambda: "i-1" in w.instances and w.instances["i-1"].info.loaded_at)
        await w.settle()
        assert w.loading.lifecycles["i-1"].phase is lifecycle.Phase.serving
        assert w.events.reasons("i-1").count("every block loaded") == 1
        assert all(w.cache.pinned((MODEL, b)) for b in range(4))  # in use by the engine
        resent = await w.loading.on_load(load_model(four_blocks, "i-1", 4))
        assert resent.detail == "already loaded"  # and said again, for the planner that asked
        assert w.events.reasons("i-1").count("every block loaded") == 2
    finally:
        w.close()


async def test_a_load_cancelled_mid_way_from_disk_stops_its_reads_and_is_stopped_not_failed(
        four_blocks, monkeypatch):
    piece = 16 << 10
    monkeypatch.setattr(fastload, "READ_PIECE_BYTES", piece)
    real, reads = os.preadv, []

    def slow_preadv(fd, buffers, offset):
        reads.append(time.monotonic())
        time.sleep(0.05)
        return real(fd, buffers, offset)

    monkeypatch.setattr(loader_module.os, "preadv", slow_preadv)
    w = Worker(serve_while_loading=False)
    try:
        await w.loading.on_load(load_model(four_blocks, "i-disk", 4))
        await w.until(lambda: len(reads) >= 4)
        assert w.loading.disk_reads() == {"i-disk": frozenset({1})}
        answer = await w.unload("i-disk")
        unloaded_at = time.monotonic()
        assert answer == lifecycle.Answer(True, "load cancelled")
        assert not w.loading.disk_reads()  # cancelled at once, not at the load's next step
        await w.until(lambda: m.InstanceState.stopped in w.events.states("i-disk"))
        await w.settle()
        assert w.events.states("i-disk") == [m.InstanceState.stopped]  # never ready, never failed
        nothing_left(w, "i-disk", 4)
        assert [t for t in reads if t > unloaded_at + 0.3] == []  # no read started after the unload
        assert len(reads) * piece < CheckpointIndex.load(four_blocks).total_nbytes
    finally:
        w.close()


async def test_an_unload_before_the_load_s_first_step_starts_no_read(four_blocks):
    w = Worker()
    started = []
    real_start = w.loading.loader.start
    w.loading.loader.start = lambda *a: started.append(a) or real_start(*a)
    try:
        await w.loading.on_load(load_model(four_blocks, "i-early", 4))
        assert (await w.unload("i-early")).detail == "load cancelled"
        await w.settle()
        assert started == []
        assert w.events.states("i-early") == [m.InstanceState.stopped]
        assert not [ev for ev in w.events.blocks if ev.state == m.ReplicaState.ready]
        nothing_left(w, "i-early", 4)
    finally:
        w.close()


async def test_an_unload_racing_a_load_that_serves_early_drains_it_and_stops_it_once(four_blocks):
    """Blocks come from a transfer the test holds: the instance attaches while blocks are still
    to come, the unload comes, and the block after it lands on a stopped instance."""
    index = CheckpointIndex.load(four_blocks)
    bufs = {b: load_block(four_blocks, index, b) for b in range(4)}
    w = Worker()
    loop = asyncio.get_running_loop()
    try:
        for b in range(4):
            w.incoming[(MODEL, b)] = loop.create_future()

        def arrive(b: int) -> None:
            w.cache.put((MODEL, b), bufs[b])  # as the transfer's store does, then the load goes on
            w.incoming[(MODEL, b)].set_result(bufs[b])

        await w.loading.on_load(load_model(four_blocks, "i-race", 4, incoming_transfer="t-1"))
        landed = 0
        while "i-race" not in w.instances:  # one block at a time until its engine is attached
            assert landed < 3, "the engine was not built before the last block"
            arrive(landed)
            landed += 1
            await asyncio.sleep(0.5)
        assert w.events.reasons("i-race")[-1] == "serving, rest loading"
        answer = await w.unload("i-race", keep_alive_s=0.5)
        assert answer == lifecycle.Answer(True, "draining")
        assert w.instances["i-race"].draining  # takes no request from the unload on
        await w.until(lambda: m.InstanceState.stopped in w.events.states("i-race"))
        assert "i-race" not in w.instances and "i-race" not in w.runtime._engines
        assert "i-race" in w.loading.loads_unloaded()  # its load task waits for a block still
        for b in range(landed, 4):
            arrive(b)  # lands on a stopped instance: not pinned, not announced
        await w.settle()
        states = w.events.states("i-race")
        assert states == [m.InstanceState.ready, m.InstanceState.stopped], states  # stopped once, never loaded
        gpu_ready = {ev.block_id for ev in w.events.blocks
                     if ev.tier == m.Tier.gpu and ev.state == m.ReplicaState.ready}
        assert gpu_ready == set(range(landed))
        nothing_left(w, "i-race", 4)
        # Its blocks' keep-alive ran out: they left the host tier.
        assert not any((MODEL, b) in w.cache for b in range(landed))
    finally:
        w.close()


async def test_an_unload_of_a_serving_instance_waits_for_its_running_request_s_end_then_detaches(four_blocks):
    """The drain waits on the lifecycle, not on the engine thread's count: the request's end
    (RequestEnded, as the worker feeds it when the request leaves its table) ends the drain at
    once, long before its deadline; nothing polls meanwhile."""
    w = Worker()
    order: list[str] = []
    detach, running = w.runtime.detach, w.runtime.running

    async def recorded_detach(instance_id):
        order.append(f"detach {instance_id}")
        await detach(instance_id)

    def recorded_running(instance_id=None):
        order.append("polled")
        return running(instance_id)

    w.runtime.detach, w.runtime.running = recorded_detach, recorded_running
    try:
        await w.loading.on_load(load_model(four_blocks, "i-busy", 4))
        await w.until(lambda: "i-busy" in w.instances and w.instances["i-busy"].info.loaded_at)
        await w.settle()
        assert w.loading.admit("i-busy", "r-1") is None  # the generate handler's RequestAdmitted
        answer = await w.unload("i-busy", drain_timeout_s=600.0)
        assert answer == lifecycle.Answer(True, "draining")
        assert not w.loading.serving("i-busy")
        refused = w.loading.admit("i-busy", "r-2")  # draining: no new request
        assert refused == lifecycle.Refuse(lifecycle.NOT_SERVING, code="unavailable")
        for _ in range(20):  # the drain runs and waits: the request still runs
            await asyncio.sleep(0.01)
        assert w.loading.lifecycles["i-busy"].phase is lifecycle.Phase.draining
        assert "i-busy" in w.instances and m.InstanceState.stopped not in w.events.states("i-busy")
        assert order == []  # neither detached nor polled the engine thread
        order.append("request ended")
        w.loading.request_ended("i-busy", "r-1")  # as the worker does when its last token went out
        # Within the until's 30 s, far inside the drain's 600 s deadline.
        await w.until(lambda: m.InstanceState.stopped in w.events.states("i-busy"))
        order.append("stopped reported")
        await w.settle()
        assert order == ["request ended", "detach i-busy", "stopped reported"]
        assert w.events.reasons("i-busy")[-1] == "unloaded by planner"
        nothing_left(w, "i-busy", 4)
    finally:
        w.close()


async def test_an_unload_of_a_serving_instance_with_no_request_running_detaches_at_once(four_blocks):
    """No request to wait for: the drain ends at once, whatever its deadline."""
    w = Worker()
    try:
        await w.loading.on_load(load_model(four_blocks, "i-idle", 4))
        await w.until(lambda: "i-idle" in w.instances and w.instances["i-idle"].info.loaded_at)
        await w.settle()
        assert w.loading.admit("i-idle", "r-1") is None
        w.loading.request_ended("i-idle", "r-1")  # ended before the unload: nothing runs
        assert (await w.unload("i-idle", drain_timeout_s=600.0)) == lifecycle.Answer(True, "draining")
        await w.until(lambda: m.InstanceState.stopped in w.events.states("i-idle"), timeout_s=10.0)
        await w.settle()
        nothing_left(w, "i-idle", 4)
    finally:
        w.close()


async def test_a_block_made_ready_in_engine_memory_says_which_tier_it_was_loaded_from(four_blocks):
    w = Worker()

    def from_tiers(iid: str) -> dict[int, m.Tier]:
        scale_op = f"op-{iid}"
        return {ev.block_id: ev.from_tier for ev in w.events.blocks
                if ev.tier == m.Tier.gpu and ev.state == m.ReplicaState.ready and ev.scale_op_id == scale_op}

    try:
        # Nothing in the host tier: every block comes from the disk.
        await w.loading.on_load(load_model(four_blocks, "i-1", 4, scale_op_id="op-i-1"))
        await w.until(lambda: "i-1" in w.instances and w.instances["i-1"].info.loaded_at)
        assert from_tiers("i-1") == dict.fromkeys(range(4), m.Tier.ssd)
        # Now they are in the host tier: a second instance takes them from there.
        await w.loading.on_load(load_model(four_blocks, "i-2", 4, scale_op_id="op-i-2"))
        await w.until(lambda: "i-2" in w.instances and w.instances["i-2"].info.loaded_at)
        assert from_tiers("i-2") == dict.fromkeys(range(4), m.Tier.host)
        await w.settle()
    finally:
        w.close()
