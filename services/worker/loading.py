"""A worker's loads: blocks into engine memory (LoadModel) or into the host tier (FetchBlocks).

Where each block comes from is chosen by libs/planning/block_sources.py (pure); this module
carries the choice out: pins host-tier blocks, waits for blocks a transfer brings, starts the
disk reads, builds the engine over the arriving blocks and announces each block and the
instance. The state it shares with the rest of the worker (the host tier, the loads in
progress, the blocks on their way) stays on the WorkerService.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from prometheus_client import Counter

from libs.bus.broker import DomainError, publish
from libs.checkpoint import CheckpointIndex
from libs.checkpoint.fastload import LoadJob, copy_to_device
from libs.engine import Engine
from libs.planning.block_sources import BlockSource, choose_block_sources, reread_lost
from libs.protocol import messages as m
from libs.protocol import subjects
from libs.telemetry import tracer

if TYPE_CHECKING:
    from services.worker.service import WorkerService
    from services.worker.sharing import EngineSizing

log = logging.getLogger(__name__)
_tracer = tracer("worker")

BLOCK_BYTES = Counter("layercast_worker_block_load_bytes_total", "Bytes of blocks made ready", ["tier"])


@dataclass
class Instance:
    info: m.InstanceInfo
    path: str
    keys: list[tuple[str, int]]
    draining: bool = False
    # sharing=mesh (elastic KV): the engine, its KV ceiling (the advertised max_batch) and the
    # bytes of one KV slot and of its weights, as charged to the worker's memory budget
    engine: Engine | None = None
    kv_ceiling: int = 0
    kv_slot_bytes: int = 0
    weights_bytes: int = 0


class _BlockFutures:
    """The engine's BlockSource during a load: each block's engine-ready tensor, set by the load
    as the block lands (from the host tier, a transfer or the disk); a failed load fails them all."""

    def __init__(self, blocks: list[int]):
        self.futures = {b: concurrent.futures.Future() for b in blocks}

    def set(self, block_id: int, tensor: torch.Tensor) -> None:
        self.futures[block_id].set_result(tensor)

    def fail(self, error: BaseException) -> None:
        for f in self.futures.values():
            if not f.done():
                f.set_exception(error)

    def ready(self, block_id: int) -> bool:
        """Arrived (or failed): waiting for it would not block."""
        return block_id in self.futures and self.futures[block_id].done()

    def wait(self, block_id: int, timeout: float | None = None) -> torch.Tensor:
        if block_id not in self.futures:
            raise KeyError(f"block {block_id} is not part of this load")
        try:
            return self.futures[block_id].result(timeout)
        except concurrent.futures.TimeoutError:
            raise TimeoutError(f"block {block_id} not ready after {timeout} s") from None


async def _next_ready(remaining: list[int], plan, incoming: dict[int, asyncio.Future]) -> int:
    """The next block of a load to take: one the host tier holds, else one a transfer has
    brought, else the next disk read (the loader reads in order), else the first to arrive."""
    for source in (BlockSource.host, BlockSource.transfer, BlockSource.disk):
        for b in remaining:
            if plan.of(b) is source and (source is not BlockSource.transfer or incoming[b].done()):
                return b
    waiting = {incoming[b]: b for b in remaining}
    done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
    return min(waiting[f] for f in done)


class _LoadStopped(Exception):
    """A load ended on purpose (the instance was unloaded before it finished), not a failure."""


class InstanceLoading:
    """The worker's loads, run on its event loop."""

    def __init__(self, worker: WorkerService):
        self.worker = worker
        # instance -> (model, block -> its engine-memory buffer): what this worker's loads have
        # made ready so far, which execution-pipeline stages run on (views: no copy)
        self.in_engine: dict[str, tuple[str, dict[int, torch.Tensor]]] = {}

    def blocks_in_engine(self, model: str) -> dict[int, torch.Tensor]:
        """Every block of `model` in this worker's engine memory, whichever load brought it."""
        out: dict[int, torch.Tensor] = {}
        for name, blocks in self.in_engine.values():
            if name == model:
                out.update(blocks)
        return out

    def forget(self, instance_id: str) -> None:
        """The instance stopped: its buffers are no longer this worker's to run stages on."""
        self.in_engine.pop(instance_id, None)

    async def load(self, cmd: m.LoadModel, info: m.InstanceInfo) -> None:
        """Load blocks nearest tier first; a full-model instance starts serving after its first block
        (after its last where the command says stop-the-world).

        Each block comes from the host tier, from a running transfer (`cmd.incoming_transfer`:
        the load waits for its blocks as they arrive, instead of waiting for the whole
        multicast), or from disk. The engine is built over the arriving blocks (they are bound
        as its forward pass reaches them), so a first request overlaps its prefill with the
        rest of the load. A block that fails its checksum fails the instance: no request ever
        runs on unverified bytes.
        """
        w = self.worker
        config = w.config
        iid = cmd.instance_id
        with _tracer.start_as_current_span("worker.load", attributes={
            "layercast.model": cmd.model, "layercast.worker": config.worker_id,
            "layercast.blocks": f"[{cmd.block_start},{cmd.block_end})"}) as span:
            jobs: list[LoadJob] = w._disk_jobs.setdefault(iid, [])
            wanted = list(range(cmd.block_start, cmd.block_end))
            pinned: list[tuple[str, int]] = []  # this load's pins; the instance releases them when it stops
            on_gpu: list[int] = []
            attached = False
            loaded_bytes = 0
            arriving = _BlockFutures(wanted)
            building: asyncio.Future | None = None
            sizing: EngineSizing | None = None  # a full load's, as its sharing strategy charged it
            try:
                index = await asyncio.to_thread(CheckpointIndex.load, cmd.path)
                for b in wanted:
                    index.block(b)
                full = (cmd.block_start, cmd.block_end) == (0, index.n_blocks)
                # Sized and charged by the sharing strategy first (mesh: weights and the smallest KV
                # against the memory budget; refused: the load fails, nothing allocated).
                sizing = await w.sharing.charge_load(iid, index) if full else None
                plan = choose_block_sources(
                    wanted, in_host={b for b in wanted if (cmd.model, b) in w.cache},
                    arriving={b for b in wanted if (cmd.model, b) in w._incoming},
                    incoming_transfer=bool(cmd.incoming_transfer))
                incoming = {b: w._incoming[(cmd.model, b)] for b in plan.blocks(BlockSource.transfer)}
                # Blocks in the host tier are pinned at once (not evicted while the rest load);
                # those neither there nor on their way stream from disk through the loader.
                cached: dict[int, torch.Tensor] = {}
                for b in plan.blocks(BlockSource.host):
                    cached[b] = w.cache.get((cmd.model, b))
                    w.cache.pin((cmd.model, b))
                    pinned.append((cmd.model, b))
                job_of: dict[int, LoadJob] = {}
                if plan.disk:
                    jobs.append(await asyncio.to_thread(w.loader.start, cmd.path, index, plan.disk))
                    job_of |= dict.fromkeys(plan.disk, jobs[-1])
                # The engine is built beside the loop below (not before it): its construction (KV
                # cache allocation, model skeleton) overlaps with the blocks' arrival and copies.
                building = asyncio.ensure_future(asyncio.to_thread(
                    Engine, index, arriving, device=config.device,
                    max_batch_size=sizing.max_batch_size, max_seq_len=config.max_seq_len,
                    kv_cache_bytes=sizing.kv_cache_bytes, max_queue=sizing.max_queue,
                    tokenizer_dir=cmd.path)) if full else None
                remaining = list(wanted)
                while remaining:
                    # In the order the blocks land, not block order: a multicast brings each receiver
                    # its own order, and a pipeline stage can run a block as soon as it is in.
                    b = await _next_ready(remaining, plan, incoming)
                    remaining.remove(b)
                    t0 = time.perf_counter()
                    host_buf = cached.get(b)
                    if plan.of(b) is BlockSource.transfer:
                        host_buf = await incoming[b]
                        if host_buf is None:
                            # The transfer ended without it: read it, and what else did not come, from disk.
                            arrived = {x for x in wanted if plan.of(x) is BlockSource.transfer
                                       and incoming[x].done() and incoming[x].result() is not None}
                            plan, lost = reread_lost(plan, b, arrived)
                            log.info("load of %s: blocks %s did not arrive; reading them from disk", cmd.model, lost)
                            jobs.append(await asyncio.to_thread(w.loader.start, cmd.path, index, lost))
                            job_of |= dict.fromkeys(lost, jobs[-1])
                        else:
                            w.cache.pin((cmd.model, b))
                            pinned.append((cmd.model, b))
                    if host_buf is not None:
                        tier = m.Tier.host
                        device_buf = await asyncio.to_thread(self.host_to_device, b, host_buf, cmd.preheld)
                    else:
                        # Blocks are announced in order, each only once its checksum is verified.
                        tier = m.Tier.ssd
                        device_buf = await asyncio.to_thread(job_of[b].wait, b)
                        host_buf = job_of[b].host[b][: device_buf.numel()] if job_of[b].host else device_buf
                        w.cache.pin((cmd.model, b))
                        pinned.append((cmd.model, b))
                        await w._report_evicted(w.cache.put((cmd.model, b), host_buf))
                        await asyncio.to_thread(self.pace, device_buf.numel(), cmd.preheld)
                    arriving.set(b, device_buf)
                    self.in_engine.setdefault(iid, (cmd.model, {}))[1][b] = device_buf
                    w.runtime.wake()  # an attached engine that waited for this block may run now
                    if iid in w._unload_asked or attached and iid not in w.instances:
                        raise _LoadStopped("unloaded by planner while loading")
                    seconds = time.perf_counter() - t0
                    BLOCK_BYTES.labels(tier.value).inc(device_buf.numel())
                    span.add_event("block_ready", {"layercast.block": b, "layercast.from_tier": tier.value,
                                                   "layercast.bytes": device_buf.numel()})
                    loaded_bytes += device_buf.numel()
                    span.set_attribute("layercast.bytes", loaded_bytes)
                    on_gpu.append(b)
                    await w._block_event(cmd.model, b, m.Tier.gpu, m.ReplicaState.ready,
                                         device_buf.numel(), seconds, cmd.scale_op_id)
                    await w._block_event(cmd.model, b, m.Tier.host, m.ReplicaState.ready, host_buf.numel())
                    if building is not None and building.done() and not attached and \
                            config.serve_while_loading and cmd.serve_while_loading:
                        await self._attach(building.result(), info, cmd, pinned, "serving, rest loading", sizing)
                        attached = True
                for done in jobs:
                    w._observe_bandwidth("ssd_to_host", done.stats.bytes, done.stats.finished_s or 0.0)
                    span.set_attribute("layercast.disk_gbps", round(done.stats.gbps, 3))
                    span.set_attribute("layercast.o_direct", done.stats.direct)
                if not full:
                    # Pipeline stages run over blocks a full load has made ready (StartPipeline).
                    raise DomainError("a LoadModel loads the whole model; execution-pipeline stages start "
                                      "with a StartPipeline over blocks already loaded")
                if not attached:
                    engine = await building
                    if iid in w._unload_asked:
                        raise _LoadStopped("unloaded by planner while loading")
                    await self._attach(engine, info, cmd, pinned, "loaded", sizing)
                await self._loaded(cmd.instance_id)
            except Exception as e:
                # An unload cancels the disk reads too: their failure is the stop, not an error.
                stopped = isinstance(e, _LoadStopped) or iid in w._unload_asked
                if stopped:
                    log.info("load of %s as %s ended: %s", cmd.model, iid, e)
                else:
                    log.exception("loading %s failed", cmd.model)
                    span.record_exception(e)
                arriving.fail(e)
                self.forget(iid)
                if building is not None:
                    building.add_done_callback(lambda f: f.exception())  # its outcome no longer matters
                for j in jobs:
                    await asyncio.to_thread(j.cancel)
                if attached and w.instances.pop(iid, None) is not None:
                    await w.runtime.detach(iid)  # its running requests end with an error
                for b in on_gpu:
                    await w._block_event(cmd.model, b, m.Tier.gpu, m.ReplicaState.evicted)
                while pinned:
                    await w._report_evicted(w.cache.unpin(pinned.pop()))
                if sizing is not None:
                    await w.sharing.release_load(iid)
                info = info.model_copy(update={"state": m.InstanceState.stopped if stopped
                                               else m.InstanceState.failed})
                await publish(w.broker, subjects.EVENT_INSTANCE, m.InstanceEvent(instance=info, reason=str(e)))
                return
            finally:
                w._loading.discard(iid)
                w._unload_asked.discard(iid)
                w._disk_jobs.pop(iid, None)

    async def _loaded(self, instance_id: str) -> None:
        """Every block is in engine memory: say so (the planner times scale operations by it)."""
        inst = self.worker.instances.get(instance_id)
        if inst is None:
            return
        inst.info = inst.info.model_copy(update={"loaded_at": time.time()})
        await publish(self.worker.broker, subjects.EVENT_INSTANCE, m.InstanceEvent(instance=inst.info,
                                                                                   reason="every block loaded"))
        self.worker.sharing.loaded(inst)

    async def _attach(self, engine: Engine, info: m.InstanceInfo, cmd: m.LoadModel,
                      pinned: list[tuple[str, int]], reason: str, sizing: EngineSizing) -> None:
        w = self.worker
        w.runtime.attach(cmd.instance_id, engine)
        # Elastic KV (mesh): the engine starts with few slots; it advertises its ceiling.
        max_batch = sizing.advertised_batch(engine)
        info = info.model_copy(update={"state": m.InstanceState.ready, "ready_at": time.time(),
                                       "max_batch": max_batch, "device": engine.device.type})
        # The instance shares this load's pin list: stopping it releases what has been pinned so far.
        inst = Instance(info=info, path=cmd.path, keys=pinned)
        w.instances[cmd.instance_id] = inst
        w.sharing.attached(inst, engine, sizing)  # mesh: its engine's KV is elastic from now on
        log.info("instance %s of %s ready (%s)", cmd.instance_id, cmd.model, reason)
        await publish(w.broker, subjects.EVENT_INSTANCE, m.InstanceEvent(instance=info, reason=reason))

    def pace(self, nbytes: int, preheld: bool) -> None:
        """Emulation only: hold a block's host-to-device copy to the emulated PCIe rate (blocks an
        `ideal` deployment pre-holds cost nothing)."""
        if self.worker.pacer is not None and not preheld:
            self.worker.pacer.pace(nbytes)

    def host_to_device(self, block_id: int, host_buf: torch.Tensor, preheld: bool = False) -> torch.Tensor:
        """A cached host block made engine-ready: zero-copy on the CPU, one measured copy to a GPU."""
        config = self.worker.config
        if torch.device(config.device).type == "cpu":
            self.pace(host_buf.numel() * host_buf.element_size(), preheld)
            return host_buf
        t0 = time.perf_counter()
        device_buf = copy_to_device({block_id: host_buf}, config.device, config.load_chunk_bytes)[block_id]
        self.worker._observe_bandwidth("host_to_device", host_buf.numel(), time.perf_counter() - t0)
        return device_buf

    async def fetch(self, cmd: m.FetchBlocks) -> None:
        """Disk to host tier, without an engine: the parameter pool's copy (kept: pinned)."""
        w = self.worker
        with _tracer.start_as_current_span("worker.fetch", attributes={
                "layercast.model": cmd.model, "layercast.worker": w.config.worker_id,
                "layercast.blocks": ",".join(map(str, cmd.blocks))}):
            try:
                index = await asyncio.to_thread(CheckpointIndex.load, cmd.path)
                # Blocks a transfer is bringing (a pool re-replication) are waited for; what it
                # does not deliver, and what is nowhere in the host tier, is read from disk.
                await asyncio.gather(*(f for b in cmd.blocks if (f := w._incoming.get((cmd.model, b)))))
                todo = [b for b in cmd.blocks if (cmd.model, b) not in w.cache]
                job = await asyncio.to_thread(w.loader.start, cmd.path, index, todo) if todo else None
                for b in cmd.blocks:
                    key = (cmd.model, b)
                    if cmd.keep and key not in w._kept:
                        w._kept.add(key)
                        w.cache.pin(key)
                    if b in todo:
                        device_buf = await asyncio.to_thread(job.wait, b)
                        host_buf = job.host[b][: device_buf.numel()] if job.host else device_buf
                        await w._report_evicted(w.cache.put(key, host_buf))
                    buf = w.cache.get(key)
                    await w._block_event(cmd.model, b, m.Tier.host, m.ReplicaState.ready, buf.numel())
                if job is not None:
                    w._observe_bandwidth("ssd_to_host", job.stats.bytes, job.stats.finished_s or 0.0)
            except Exception:
                log.exception("fetching blocks %s of %s failed", cmd.blocks, cmd.model)
                for b in cmd.blocks:
                    if (cmd.model, b) in w._kept:
                        w._kept.discard((cmd.model, b))
                        await w._report_evicted(w.cache.unpin((cmd.model, b)))
