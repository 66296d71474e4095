"""A worker's loads and instances: blocks into engine memory (LoadModel) or into the host tier
(FetchBlocks), and each instance's lifecycle carried out.

An instance's lifecycle is decided by libs/planning/instance.py (pure): this module feeds it
what it observes (a LoadModel, a block in the host tier or in engine memory, a disk read
started or done, the engine built, an unload, a drain's deadline; the worker's generate path
feeds its requests' admissions and ends) and carries out the effects it returns (pin, read
from disk, cancel a read, attach, report loaded or stopped, release pins). A drain waits on
the lifecycle: it ends when the lifecycle says the last request ended, or at its deadline.
Where each block comes from is chosen by libs/planning/block_sources.py (pure); the load task
here carries the choice out: waits for blocks a transfer brings, builds the engine over the
arriving blocks. It reaches the rest of the worker only through what it is constructed with:
the host tier, the loader, the engine runtime, the instance table and a `WorkerEvents` port.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch
from prometheus_client import Counter

from libs.bus.broker import DomainError
from libs.checkpoint import CheckpointIndex
from libs.checkpoint.fastload import BlockLoader, LoadJob, copy_to_device
from libs.engine import Engine
from libs.planning import instance as lifecycle
from libs.planning.block_sources import BlockSource, choose_block_sources, reread_lost
from libs.planning.instance import Lifecycle
from libs.protocol import messages as m
from libs.telemetry import tracer
from services.worker.host_cache import HostBlockCache

if TYPE_CHECKING:
    from services.worker.runtime import EngineRuntime
    from services.worker.sharing import EngineSizing, Sharing

log = logging.getLogger(__name__)
_tracer = tracer("worker")

BLOCK_BYTES = Counter("layercast_worker_block_load_bytes_total", "Bytes of blocks made ready", ["tier"])


class LoadSettings(Protocol):
    """The worker settings a load reads (WorkerConfig has them)."""

    worker_id: str
    device: str
    max_batch_size: int
    max_seq_len: int
    kv_cache_bytes: int
    serve_while_loading: bool
    load_chunk_bytes: int


class WorkerEvents(Protocol):
    """What the worker tells the cluster about its instances and blocks (NATS events in the
    worker; recorded in tests)."""

    async def instance(self, info: m.InstanceInfo, reason: str, switched_to: Sequence[str] = ()) -> None:
        """An instance changed state."""

    async def block(self, model: str, block_id: int, tier: m.Tier, state: m.ReplicaState, nbytes: int = 0,
                    seconds: float = 0.0, scale_op_id: str | None = None, from_tier: m.Tier | None = None) -> None:
        """A block replica here changed state (`from_tier`: where a block now in engine memory came from)."""

    async def evicted(self, keys: Sequence[tuple[str, int]]) -> None:
        """These blocks left the host tier."""

    def bandwidth(self, link: str, nbytes: int, seconds: float) -> None:
        """A measured transfer over `link` (ssd_to_host, host_to_device)."""


@dataclass
class Instance:
    info: m.InstanceInfo
    path: str
    keys: list[tuple[str, int]] = field(default_factory=list)  # unused: the lifecycle holds the pins
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


@dataclass
class _DrainWait:
    """A drain under way: set `over` with the teardown's effects once the last request ended."""

    over: asyncio.Event = field(default_factory=asyncio.Event)
    teardown: list[lifecycle.Effect] = field(default_factory=list)

    def end(self, effects: list[lifecycle.Effect]) -> None:
        self.teardown = effects
        self.over.set()


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


def _raise_if_ended(effects: list[lifecycle.Effect]) -> None:
    for e in effects:
        if isinstance(e, lifecycle.EndLoad):
            raise _LoadStopped(e.reason)


@dataclass
class _Load:
    """One LoadModel's run: what its load task and its effects share."""

    cmd: m.LoadModel
    span: Any = None
    index: CheckpointIndex | None = None
    jobs: dict[int, LoadJob] = field(default_factory=dict)  # the lifecycle's disk-read id -> the read
    job_of: dict[int, LoadJob] = field(default_factory=dict)  # block -> the read bringing it
    engine: Engine | None = None
    sizing: EngineSizing | None = None  # a full load's, as its sharing strategy charged it
    # block -> (tier it came from, engine buffer, host buffer, seconds): announced by AnnounceBlock
    landed: dict[int, tuple[m.Tier, torch.Tensor, torch.Tensor, float]] = field(default_factory=dict)
    loaded_bytes: int = 0


class InstanceLoading:
    """The worker's loads and its instances' lifecycles, run on its event loop."""

    def __init__(self, config: LoadSettings, events: WorkerEvents, cache: HostBlockCache, loader: BlockLoader,
                 instances: dict[str, Instance], *, incoming: dict[tuple[str, int], asyncio.Future] | None = None,
                 kept: set[tuple[str, int]] | None = None, sharing: Sharing, pacer: Any = None,
                 spawn: Callable[[Coroutine], asyncio.Task] = asyncio.ensure_future):
        self.config = config
        self.events = events
        self.cache = cache
        self.loader = loader
        self.instances = instances  # attached instances (serving or draining): shared with the worker
        # (model, block) -> future of its host buffer, for blocks a running transfer brings
        self.incoming = incoming if incoming is not None else {}
        self.kept = kept if kept is not None else set()  # pinned by FetchBlocks (the parameter pool)
        self.sharing = sharing
        self.pacer = pacer
        self.spawn = spawn
        self.runtime: EngineRuntime | None = None  # the worker's engine thread, set when it starts
        self.lifecycles: dict[str, Lifecycle] = {}  # every instance here that has not ended
        self._loads: dict[str, _Load] = {}  # instance -> its load task's run
        self._info: dict[str, m.InstanceInfo] = {}  # instance -> its latest record (reported as it stops)
        # instance -> (model, block -> its engine-memory buffer): what this worker's loads have
        # made ready so far, which execution-pipeline stages run on (views: no copy)
        self.in_engine: dict[str, tuple[str, dict[int, torch.Tensor]]] = {}
        self._drains: dict[str, _DrainWait] = {}  # instance -> its drain under way
        self._stopped: dict[str, asyncio.Event] = {}  # instance -> set once it reported stopped (`stopped`)
        # Carries out a live pair's end (EndPair): set by the worker, which runs its live pairs.
        self.on_pair_end: Callable[[str, lifecycle.EndPair], Awaitable[None]] | None = None

    # --- the lifecycle ------------------------------------------------------------------------------
    def step(self, instance_id: str, event: lifecycle.Event) -> list[lifecycle.Effect]:
        """Feed one event to the instance's lifecycle (at once: no await between the decision and
        the next event); the effects are for run()."""
        before = self.lifecycles.get(instance_id) or Lifecycle(instance_id)
        after, effects = lifecycle.step(before, event)
        if before.serving and not after.serving and (inst := self.instances.get(instance_id)) is not None:
            inst.draining = True  # the mesh takes no new request for it from this step on
        if any(isinstance(e, lifecycle.Drain) for e in effects):
            self._drains[instance_id] = _DrainWait()  # from this step on, not from when its drain runs
        if after.phase is lifecycle.Phase.absent or after.forgettable:
            self.lifecycles.pop(instance_id, None)
        else:
            self.lifecycles[instance_id] = after
        return effects

    async def run(self, instance_id: str, effects: list[lifecycle.Effect]) -> None:
        """Carry out a step's effects, in order (answers are the caller's)."""
        for effect in effects:
            await self._carry_out(instance_id, effect)
        if instance_id not in self.lifecycles and instance_id not in self._loads:
            self._info.pop(instance_id, None)

    async def feed(self, instance_id: str, event: lifecycle.Event) -> list[lifecycle.Effect]:
        effects = self.step(instance_id, event)
        await self.run(instance_id, effects)
        return effects

    def serving(self, instance_id: str) -> bool:
        """The instance takes requests (its lifecycle says so)."""
        lc = self.lifecycles.get(instance_id)
        return lc is not None and lc.serving

    def admit(self, instance_id: str, request_id: str) -> lifecycle.Refuse | None:
        """A request admitted by the sharing strategy joins the instance's lifecycle: None, or
        its refusal (the instance does not serve)."""
        effects = self.step(instance_id, lifecycle.RequestAdmitted(request_id))
        return next((e for e in effects if isinstance(e, lifecycle.Refuse)), None)

    def request_ended(self, instance_id: str, request_id: str) -> None:
        """A request of the instance ended (any way: finished, failed, cancelled, preempted,
        handed over, its engine gone). The last one of a draining instance ends its drain: the
        drain, woken, carries out the teardown. Synchronous: no await between the end and the step."""
        effects = self.step(instance_id, lifecycle.RequestEnded(request_id))
        if not effects:
            return
        wait = self._drains.get(instance_id)
        if wait is not None:
            wait.end(effects)
        else:  # (no drain without a Drain effect; kept safe all the same)
            self.spawn(self.run(instance_id, effects))

    def residents(self) -> dict[str, str]:
        """instance -> model, for every instance here that has not stopped (loading, serving, draining)."""
        return {iid: self._info[iid].model for iid in self.lifecycles if iid in self._info}

    def stopping(self) -> set[str]:
        """The instances here whose unload was asked and that have not stopped yet."""
        return {iid for iid, lc in self.lifecycles.items() if lc.phase in lifecycle.STOPPING}

    async def stopped(self, instance_id: str, timeout_s: float) -> bool:
        """Wait until the instance reported stopped (at once if it has no lifecycle here); False:
        still there after `timeout_s`."""
        if instance_id not in self.lifecycles:
            return True
        ev = self._stopped.setdefault(instance_id, asyncio.Event())
        try:
            await asyncio.wait_for(ev.wait(), timeout_s)
            return True
        except TimeoutError:
            return instance_id not in self.lifecycles

    def loads_running(self) -> set[str]:
        return {iid for iid, lc in self.lifecycles.items() if lc.load_running}

    def loads_unloaded(self) -> set[str]:
        """Loads still running whose instance was unloaded (they end at their next step)."""
        return {iid for iid, lc in self.lifecycles.items()
                if lc.load_running and lc.phase in lifecycle.STOPPING | lifecycle.ENDED}

    def disk_reads(self) -> dict[str, frozenset[int]]:
        """Instance -> its disk reads not done nor cancelled."""
        return {iid: lc.disk_jobs for iid, lc in self.lifecycles.items() if lc.disk_jobs}

    # --- commands -------------------------------------------------------------------------------------
    async def on_load(self, cmd: m.LoadModel) -> m.CommandAck:
        iid = cmd.instance_id
        effects = self.step(iid, lifecycle.LoadAsked(
            tuple(range(cmd.block_start, cmd.block_end)),
            serve_while_loading=self.config.serve_while_loading and cmd.serve_while_loading,
            readable=os.path.isdir(cmd.path)))
        answer = None
        for e in effects:
            match e:
                case lifecycle.Refuse():
                    raise DomainError(f"checkpoint path {cmd.path!r} is not readable on {self.config.worker_id}",
                                      code=e.code)
                case lifecycle.StartLoad():
                    self._info[iid] = m.InstanceInfo(
                        instance_id=iid, model=cmd.model, state=m.InstanceState.loading, created_at=time.time(),
                        scale_op_id=cmd.scale_op_id, stages=[m.Stage(
                            worker_id=self.config.worker_id, block_start=cmd.block_start, block_end=cmd.block_end)])
                    self._loads[iid] = _Load(cmd)
                    self.spawn(self.load(iid))
                case lifecycle.Answer():
                    answer = m.CommandAck(accepted=e.accepted, detail=e.detail)
                case _:
                    await self._carry_out(iid, e)
        return answer

    def pipeline_started(self, instance_id: str, entry: bool) -> None:
        """A StartPipeline made this worker the pipeline's entry (its instance attached) or a stage."""
        self.step(instance_id, lifecycle.PipelineStarted(entry))
        if entry and (inst := self.instances.get(instance_id)) is not None:
            self._info[instance_id] = inst.info

    # --- effects --------------------------------------------------------------------------------------
    async def _carry_out(self, iid: str, e: lifecycle.Effect) -> None:
        match e:
            case lifecycle.Pin(block=b):
                self.cache.pin((self._info[iid].model, b))
            case lifecycle.ReadFromDisk(job=job, blocks=blocks):
                load = self._loads[iid]
                started = await asyncio.to_thread(self.loader.start, load.cmd.path, load.index, list(blocks))
                load.jobs[job] = started
                load.job_of |= dict.fromkeys(blocks, started)
                await self.feed(iid, lifecycle.DiskReadStarted(job))
            case lifecycle.CancelRead(job=job):
                # Within a read piece, off the loop; one not started yet is cancelled as it starts.
                load = self._loads.get(iid)
                if load is not None and (read := load.jobs.get(job)) is not None:
                    self.spawn(asyncio.to_thread(read.cancel))
            case lifecycle.AnnounceBlock(block=b):
                await self._announce(iid, b)
            case lifecycle.Attach(reason=reason):
                await self._attach(iid, reason)
            case lifecycle.ReportLoaded():
                await self._loaded(iid)
            case lifecycle.ReannounceLoaded():
                inst = self.instances.get(iid)
                if inst is not None:
                    await self.events.instance(inst.info, "every block loaded")
            case lifecycle.Drain():
                await self._drain(iid, e)
            case lifecycle.Detach():
                await self._detach(iid)
            case lifecycle.EvictFromEngine(blocks=blocks):
                for b in blocks:
                    await self.events.block(self._info[iid].model, b, m.Tier.gpu, m.ReplicaState.evicted)
            case lifecycle.ReleasePins(blocks=blocks, keep_alive_s=keep_alive_s):
                keys = [(self._info[iid].model, b) for b in blocks]
                for key in keys:
                    await self.events.evicted(self.cache.unpin(key))
                if keep_alive_s is not None:
                    self.spawn(self._expire_after(keys, keep_alive_s))
            case lifecycle.ReportStopped():
                self.forget(iid)
                if (ev := self._stopped.pop(iid, None)) is not None:
                    ev.set()
                info = self._info[iid].model_copy(update={
                    "state": m.InstanceState.failed if e.failed else m.InstanceState.stopped})
                await self.events.instance(info, e.reason, e.switched_to)
                log.info("instance %s %s (%s)", iid, info.state.value, e.reason)
            case lifecycle.EndLoad():
                pass  # the load task raises it (_raise_if_ended)
            case lifecycle.EndPair():
                if self.on_pair_end is not None:  # the worker's live pairs (services/worker/livepairs.py)
                    await self.on_pair_end(iid, e)
            case lifecycle.Answer() | lifecycle.Refuse() | lifecycle.StopHosting() | lifecycle.StartLoad():
                pass  # the command's caller answers, stops hosting, starts the load

    async def _announce(self, iid: str, b: int) -> None:
        load = self._loads[iid]
        tier, device_buf, host_buf, seconds = load.landed.pop(b)
        BLOCK_BYTES.labels(tier.value).inc(device_buf.numel())
        load.span.add_event("block_ready", {"layercast.block": b, "layercast.from_tier": tier.value,
                                            "layercast.bytes": device_buf.numel()})
        load.loaded_bytes += device_buf.numel()
        load.span.set_attribute("layercast.bytes", load.loaded_bytes)
        model = load.cmd.model
        await self.events.block(model, b, m.Tier.gpu, m.ReplicaState.ready, device_buf.numel(), seconds,
                                load.cmd.scale_op_id, from_tier=tier)
        await self.events.block(model, b, m.Tier.host, m.ReplicaState.ready, host_buf.numel())

    async def _attach(self, iid: str, reason: str) -> None:
        load = self._loads[iid]
        engine, sizing, cmd = load.engine, load.sizing, load.cmd
        self.runtime.attach(iid, engine)
        # Elastic KV (mesh): the engine starts with few slots; it advertises its ceiling.
        max_batch = sizing.advertised_batch(engine)
        info = self._info[iid].model_copy(update={"state": m.InstanceState.ready, "ready_at": time.time(),
                                                  "max_batch": max_batch, "device": engine.device.type})
        self._info[iid] = info
        inst = Instance(info=info, path=cmd.path)
        self.instances[iid] = inst
        self.sharing.attached(inst, engine, sizing)  # mesh: its engine's KV is elastic from now on
        log.info("instance %s of %s ready (%s)", iid, cmd.model, reason)
        await self.events.instance(info, reason)

    async def _loaded(self, iid: str) -> None:
        """Every block is in engine memory: say so (the planner times scale operations by it)."""
        inst = self.instances[iid]
        inst.info = self._info[iid] = inst.info.model_copy(update={"loaded_at": time.time()})
        await self.events.instance(inst.info, "every block loaded")
        self.sharing.loaded(inst)

    async def _drain(self, iid: str, drain: lifecycle.Drain) -> None:
        """Wait for the lifecycle to say the drain is over (its last request ended: `request_ended`
        wakes it with the teardown's effects), or for its deadline (then it feeds Drained); no
        request running: at once. No polling."""
        inst = self.instances.get(iid)
        if inst is not None:
            inst.draining = True  # the mesh takes no new request for it
        wait = self._drains.get(iid) or _DrainWait()
        lc = self.lifecycles.get(iid)
        if (drain.timeout_s > 0 and not wait.over.is_set() and lc is not None
                and lc.phase is lifecycle.Phase.draining and lc.requests):
            try:
                await asyncio.wait_for(wait.over.wait(), drain.timeout_s)
            except TimeoutError:
                pass
        # No await from here to the teardown's step: a request ending now finds no drain to wake.
        self._drains.pop(iid, None)
        if drain.abort_stages:
            # A stage may be gone (why it stops): never wait on it. A mode switch lets the step
            # in flight finish instead (the detach waits for it; a stage gone meanwhile fails it
            # at its timeout).
            self.runtime.abort_remote_stages(iid, drain.reason)
        effects = wait.teardown if wait.over.is_set() else self.step(iid, lifecycle.Drained())
        await self.run(iid, effects)

    async def _detach(self, iid: str) -> None:
        inst = self.instances.get(iid)
        if inst is None:
            return
        # Its running requests end with an error; mesh: its memory is released as the engine goes.
        await self.sharing.release(inst, lambda: self.runtime.detach(iid))
        self.instances.pop(iid, None)
        self._info[iid] = inst.info

    async def _expire_after(self, keys: list[tuple[str, int]], keep_alive_s: float) -> None:
        """The host-cache keep-alive: blocks unused for keep_alive_s leave the host tier."""
        await asyncio.sleep(keep_alive_s)
        gone = [k for k in keys if self.cache.remove(k)]
        await self.events.evicted(gone)

    # --- the load task --------------------------------------------------------------------------------
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

    async def load(self, iid: str) -> None:
        """Load blocks nearest tier first; a full-model instance starts serving after its first block
        (after its last where the command says stop-the-world).

        Each block comes from the host tier, from a running transfer (`cmd.incoming_transfer`:
        the load waits for its blocks as they arrive, instead of waiting for the whole
        multicast), or from disk. The engine is built over the arriving blocks (they are bound
        as its forward pass reaches them), so a first request overlaps its prefill with the
        rest of the load. A block that fails its checksum fails the instance: no request ever
        runs on unverified bytes. What each step means for the instance (attach, report, stop)
        is the lifecycle's (libs/planning/instance.py).
        """
        load = self._loads[iid]
        cmd = load.cmd
        config = self.config
        with _tracer.start_as_current_span("worker.load", attributes={
            "layercast.model": cmd.model, "layercast.worker": config.worker_id,
            "layercast.blocks": f"[{cmd.block_start},{cmd.block_end})"}) as span:
            load.span = span
            wanted = list(range(cmd.block_start, cmd.block_end))
            arriving = _BlockFutures(wanted)
            building: asyncio.Future | None = None
            sizing: EngineSizing | None = None
            try:
                index = load.index = await asyncio.to_thread(CheckpointIndex.load, cmd.path)
                for b in wanted:
                    index.block(b)
                # The sharing strategy makes room first (dedicated: another model here is unloaded).
                await self.sharing.make_room(iid, cmd.model)
                full = (cmd.block_start, cmd.block_end) == (0, index.n_blocks)
                # Sized and charged by the sharing strategy first (mesh: weights and the smallest KV
                # against the memory budget; refused: the load fails, nothing allocated).
                sizing = await self.sharing.charge_load(iid, index) if full else None
                load.sizing = sizing
                plan = choose_block_sources(
                    wanted, in_host={b for b in wanted if (cmd.model, b) in self.cache},
                    arriving={b for b in wanted if (cmd.model, b) in self.incoming},
                    incoming_transfer=bool(cmd.incoming_transfer))
                incoming = {b: self.incoming[(cmd.model, b)] for b in plan.blocks(BlockSource.transfer)}
                # Blocks in the host tier are pinned at once (not evicted while the rest load);
                # those neither there nor on their way stream from disk through the loader.
                cached: dict[int, torch.Tensor] = {}
                for b in plan.blocks(BlockSource.host):
                    cached[b] = self.cache.get((cmd.model, b))
                    await self.feed(iid, lifecycle.BlockInHost(b))
                if plan.disk:
                    _raise_if_ended(await self.feed(iid, lifecycle.DiskNeeded(tuple(plan.disk))))
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
                            _raise_if_ended(await self.feed(iid, lifecycle.DiskNeeded(tuple(lost))))
                        else:
                            await self.feed(iid, lifecycle.BlockInHost(b))
                    if host_buf is not None:
                        tier = m.Tier.host
                        device_buf = await asyncio.to_thread(self.host_to_device, b, host_buf, cmd.preheld)
                    else:
                        # Blocks are announced in order, each only once its checksum is verified.
                        tier = m.Tier.ssd
                        read = load.job_of[b]
                        device_buf = await asyncio.to_thread(read.wait, b)
                        host_buf = read.host[b][: device_buf.numel()] if read.host else device_buf
                        await self.feed(iid, lifecycle.BlockInHost(b))  # pinned first: the put keeps it
                        await self.events.evicted(self.cache.put((cmd.model, b), host_buf))
                        await asyncio.to_thread(self.pace, device_buf.numel(), cmd.preheld)
                    arriving.set(b, device_buf)
                    self.in_engine.setdefault(iid, (cmd.model, {}))[1][b] = device_buf
                    self.runtime.wake()  # an attached engine that waited for this block may run now
                    load.landed[b] = (tier, device_buf, host_buf, time.perf_counter() - t0)
                    _raise_if_ended(await self.feed(iid, lifecycle.BlockInEngine(b)))
                    if building is not None and building.done() and load.engine is None:
                        load.engine = building.result()
                        _raise_if_ended(await self.feed(iid, lifecycle.EngineBuilt()))
                for job, read in load.jobs.items():
                    self.events.bandwidth("ssd_to_host", read.stats.bytes, read.stats.finished_s or 0.0)
                    span.set_attribute("layercast.disk_gbps", round(read.stats.gbps, 3))
                    span.set_attribute("layercast.o_direct", read.stats.direct)
                    await self.feed(iid, lifecycle.DiskReadDone(job))
                if not full:
                    # Pipeline stages run over blocks a full load has made ready (StartPipeline).
                    raise DomainError("a LoadModel loads the whole model; execution-pipeline stages start "
                                      "with a StartPipeline over blocks already loaded")
                if load.engine is None:
                    load.engine = await building
                    _raise_if_ended(await self.feed(iid, lifecycle.EngineBuilt()))
                await self.feed(iid, lifecycle.LoadFinished())
            except Exception as e:
                unloaded = iid in self.loads_unloaded()
                if unloaded:  # an unload cancels the disk reads too: their failure is the stop, not an error
                    log.info("load of %s as %s ended: %s", cmd.model, iid, e)
                else:
                    log.exception("loading %s failed", cmd.model)
                    span.record_exception(e)
                arriving.fail(e)
                self.forget(iid)
                if building is not None:
                    building.add_done_callback(lambda f: f.exception())  # its outcome no longer matters
                lc = self.lifecycles.get(iid)
                if sizing is not None and not (lc is not None and lc.attached):
                    await self.sharing.release_load(iid)  # an attached engine's goes with it (Detach)
                await self.feed(iid, lifecycle.LoadFailed(str(e)))
            finally:
                self._loads.pop(iid, None)
                if iid not in self.lifecycles:
                    self._info.pop(iid, None)

    def pace(self, nbytes: int, preheld: bool) -> None:
        """Emulation only: hold a block's host-to-device copy to the emulated PCIe rate (blocks an
        `ideal` deployment pre-holds cost nothing)."""
        if self.pacer is not None and not preheld:
            self.pacer.pace(nbytes)

    def host_to_device(self, block_id: int, host_buf: torch.Tensor, preheld: bool = False) -> torch.Tensor:
        """A cached host block made engine-ready: zero-copy on the CPU, one measured copy to a GPU."""
        config = self.config
        if torch.device(config.device).type == "cpu":
            self.pace(host_buf.numel() * host_buf.element_size(), preheld)
            return host_buf
        t0 = time.perf_counter()
        device_buf = copy_to_device({block_id: host_buf}, config.device, config.load_chunk_bytes)[block_id]
        self.events.bandwidth("host_to_device", host_buf.numel(), time.perf_counter() - t0)
        return device_buf

    async def fetch(self, cmd: m.FetchBlocks) -> None:
        """Disk to host tier, without an engine: the parameter pool's copy (kept: pinned)."""
        with _tracer.start_as_current_span("worker.fetch", attributes={
                "layercast.model": cmd.model, "layercast.worker": self.config.worker_id,
                "layercast.blocks": ",".join(map(str, cmd.blocks))}):
            try:
                index = await asyncio.to_thread(CheckpointIndex.load, cmd.path)
                # Blocks a transfer is bringing (a pool re-replication) are waited for; what it
                # does not deliver, and what is nowhere in the host tier, is read from disk.
                await asyncio.gather(*(f for b in cmd.blocks if (f := self.incoming.get((cmd.model, b)))))
                todo = [b for b in cmd.blocks if (cmd.model, b) not in self.cache]
                job = await asyncio.to_thread(self.loader.start, cmd.path, index, todo) if todo else None
                for b in cmd.blocks:
                    key = (cmd.model, b)
                    if cmd.keep and key not in self.kept:
                        self.kept.add(key)
                        self.cache.pin(key)
                    if b in todo:
                        device_buf = await asyncio.to_thread(job.wait, b)
                        host_buf = job.host[b][: device_buf.numel()] if job.host else device_buf
                        await self.events.evicted(self.cache.put(key, host_buf))
                    buf = self.cache.get(key)
                    await self.events.block(cmd.model, b, m.Tier.host, m.ReplicaState.ready, buf.numel())
                if job is not None:
                    self.events.bandwidth("ssd_to_host", job.stats.bytes, job.stats.finished_s or 0.0)
            except Exception:
                log.exception("fetching blocks %s of %s failed", cmd.blocks, cmd.model)
                for b in cmd.blocks:
                    if (cmd.model, b) in self.kept:
                        self.kept.discard((cmd.model, b))
                        await self.events.evicted(self.cache.unpin((cmd.model, b)))
