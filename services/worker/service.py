"""Worker: holds model blocks in tiers, runs engines, streams tokens.

Talks to the registry (registration, heartbeats, block and instance events),
takes load/unload commands from the planner and generate requests from the
gateway. Loads run in loading.py, multicasts in transfers.py, torch work on the
engine thread (runtime.py); this file is the service's shell around them.
"""

import asyncio
import concurrent.futures
import logging
import os
import shutil
import socket
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

import psutil
import torch
from opentelemetry import trace
from prometheus_client import Counter, Gauge

from libs.checkpoint import CheckpointIndex, is_block_checkpoint
from libs.checkpoint.hostmem import HostArena
from libs.checkpoint.pacing import make_pacer
from libs.checkpoint.fastload import (
    DEFAULT_CHUNK_BYTES,
    DEFAULT_THREADS,
    BlockLoader,
    LoaderConfig,
    host_buffer,
)
from libs.engine import TokenOutput, grammar_tokenizer, warm_up
from libs.planning import instance as lifecycle
from libs.protocol import messages as m
from libs.protocol import subjects
from libs.bus.broker import DomainError, RemoteError, call, on_event, publish, rpc
from libs.bus.plans import consume_parts
from libs.telemetry import tracer, unsampled
from libs.transfer.base import Transport, TransferError
from libs.transfer.transports import make_transport
from services.common.runner import Service
from services.worker.host_cache import HostBlockCache
from services.worker.loading import Instance, InstanceLoading, WorkerEvents
from services.worker.mesh import PREEMPTIONS, Admitted
from services.worker.livepairs import LivePairs
from services.worker.pipelines import PipelineStages
from services.worker.runtime import EngineRuntime
from services.worker.sharing import WorkerPorts, make_sharing
from services.worker.transfers import TransferAgent

log = logging.getLogger(__name__)
_tracer = tracer("worker")

TOKENS = Counter("layercast_worker_generated_tokens_total", "Tokens generated (mode: local instance or execution "
                 "pipeline)", ["model", "mode"])
LOAD_BANDWIDTH = Gauge("layercast_worker_load_bandwidth_bytes_per_second", "Measured load bandwidth (moving average)",
                       ["link"])
BANDWIDTH_EWMA_ALPHA = 0.3  # weight of the newest load in the per-link moving average
WORKER_THREADS = 64  # threads for the worker's blocking waits (see start())
RUNNING = Gauge("layercast_worker_running_requests", "Requests running on this worker")
UNREACHABLE_REPORTS = Counter("layercast_worker_unreachable_reports_total",
                              "Data-plane peers this worker reported unreachable to the registry, by its answer "
                              "(dead: it agreed; refuted: it found them alive or not yet dead)", ["answer"])
PEER_REPORT_INTERVAL_S = 1.0  # one report per peer at most this often (a dead peer breaks many connections)


def advertised_data_host(c: "WorkerConfig") -> str:
    """The data-plane address peers dial. A wildcard bind (0.0.0.0 in a container) cannot be
    dialled, so it advertises this host's own address (the pod or container IP)."""
    if c.data_advertise_host:
        return c.data_advertise_host
    if c.data_host in ("0.0.0.0", "::", ""):
        return socket.gethostbyname(socket.gethostname())
    return c.data_host


@dataclass
class WorkerConfig:
    worker_id: str
    data_host: str = "127.0.0.1"
    data_port: int = 0
    data_advertise_host: str | None = None  # what peers dial; None: see advertised_data_host()
    host: str = field(default_factory=socket.gethostname)
    leaf: str = "leaf-0"
    scaleup_group: str = ""
    link_gbps: float = 10.0
    host_capacity_bytes: int = 8 << 30
    host_cache_models: int = 0  # models the host tier keeps at most (LRU; 0: bounded by bytes only)
    engine_capacity_bytes: int = 8 << 30
    heartbeat_interval_s: float = 1.0
    torch_threads: int = 0  # 0: torch's default
    max_batch_size: int = 16
    max_seq_len: int = 2048
    device: str = "cpu"  # where engines run: "cpu" or "cuda[:n]"
    load_chunk_bytes: int = DEFAULT_CHUNK_BYTES
    load_threads: int = DEFAULT_THREADS
    # A full-model instance is announced ready once its first block is verified; requests then
    # run each block as it arrives. Off: ready only when every block is there.
    serve_while_loading: bool = True
    # Host memory reserved and faulted in at start for loaded blocks (0: allocate per load). Loads
    # into it skip a page fault per 4 KiB; production workers size it like host_capacity_bytes.
    host_arena_bytes: int = 0
    kv_cache_bytes: int = 1 << 30  # per instance: pre-allocated KV slots (min(max_batch_size, budget / slot))
    transport: str = "tcp"  # block transfers: a key of libs.transfer.transports.TRANSPORTS (rdma: pyverbs, a device)
    rdma_device: str | None = None
    # Emulation only (off: 0): the copy from the host tier into engine memory is paced to this
    # rate, standing in for PCIe on a CPU-only worker, where no OS knob throttles memcpy.
    emulated_host_to_device_mbit: float = 0.0
    # Emulation without root (tests): this worker's block sends leave at most at this rate (tcp).
    emulated_link_mbit: float = 0.0
    # The cluster's sharing setting (libs/planning/sharing.py; its strategy: services/worker/sharing.py).
    # "exclusive": engines step in turn, fixed KV. "mesh" (LLM-Mesh): one headroom-driven schedule
    # over every instance here, admission by shadow validation against profiled iteration times
    # (off: `shadow_validation`). "dedicated": one model at a time, another model's load unloads it first.
    sharing: str = "exclusive"
    shadow_validation: bool = True
    # With shadow validation: a refused request may preempt smaller instances here whose
    # requests can still meet their SLOs elsewhere (LLM-Mesh §7.1); they are handed over.
    preemption: bool = True
    profile_max_len: int = 512  # the longest prompt a profile samples (longer ones extrapolate)
    # Live steps refresh the profiles this often (0: never). Off by default: on, it left a
    # validated model later than the measured profile did (tests/integration/test_mesh_e2e.py).
    profile_refresh_s: float = 0.0
    # sharing=mesh, hazard-aware memory (LLM-Mesh §6.3-6.4): the bytes this worker's engines may
    # hold, weights and KV (0: the memory available when the worker starts); the KV watermark w
    # (grow to M_require * (1 + w), shrink only below M_recommend * (1 + w)); L_min in KV slots,
    # 0: no elastic KV, every instance's KV fixed at its ceiling (still charged). A growth's copy
    # holds the engine thread; shadow validation counts it (MeshNode.growth_stall). 0 by default:
    # on, bench mesh at 32 models on 4 capped workers refused twice as many requests as busy,
    # scaled out to 3x the instance-seconds and let requests time out (KV fixed: none).
    memory_capacity_bytes: int = 0
    # On CUDA, what the default capacity leaves free: the forward pass's working memory (activations,
    # cuBLAS workspaces: 32 MiB per engine thread on Hopper), which the mesh does not charge. The GPU
    # check found a capped burst peaking 32 MiB over its cap (docs/gpu/2026-11-26-h100).
    device_working_bytes: int = 1 << 30
    kv_watermark: float = 0.2
    kv_min_slots: int = 0
    # Directories on this worker's local disk holding checkpoints. A deployed model whose path lies
    # under one (and that this worker can read) is reported in the ssd tier, so the planner's
    # load-time estimate counts it as local; empty: every deployed model path this worker can
    # read is local (the loader reads it from this disk: a single host, a hostPath volume).
    local_checkpoint_dirs: tuple[str, ...] = ()


def local_checkpoint(path: str, local_dirs: Sequence[str] = ()) -> CheckpointIndex | None:
    """The block index of the checkpoint at `path` when it is on this worker's local disk (see
    WorkerConfig.local_checkpoint_dirs); None when it is not, or cannot be read here."""
    if local_dirs:
        real = os.path.realpath(path)
        dirs = [os.path.realpath(d) for d in local_dirs]
        if not any(os.path.commonpath([real, d]) == d for d in dirs):
            return None
    if not is_block_checkpoint(path):
        return None
    try:
        return CheckpointIndex.load(path)
    except (OSError, ValueError) as e:
        log.warning("checkpoint at %s unreadable here: %s", path, e)
        return None


def fold_bandwidth(bandwidths_gbps: dict[str, float], link: str, nbytes: int, seconds: float) -> None:
    """Fold one measured transfer into the link's moving average (reported with heartbeats)."""
    if nbytes <= 0 or seconds <= 0:
        return
    measured = nbytes / seconds / 1e9
    old = bandwidths_gbps.get(link)
    new = measured if old is None else (1 - BANDWIDTH_EWMA_ALPHA) * old + BANDWIDTH_EWMA_ALPHA * measured
    bandwidths_gbps[link] = new
    LOAD_BANDWIDTH.labels(link).set(new * 1e9)


class BusEvents:
    """The worker's WorkerEvents port on NATS: instance and block events, the bandwidths it measured."""

    def __init__(self, broker, worker_id: str, bandwidths_gbps: dict[str, float]):
        self.broker = broker
        self.worker_id = worker_id
        self.bandwidths_gbps = bandwidths_gbps

    async def instance(self, info: m.InstanceInfo, reason: str, switched_to=()) -> None:
        await publish(self.broker, subjects.EVENT_INSTANCE, m.InstanceEvent(instance=info, reason=reason,
                                                                            switched_to=list(switched_to)))

    async def block(self, model: str, block_id: int, tier: m.Tier, state: m.ReplicaState, nbytes: int = 0,
                    seconds: float = 0.0, scale_op_id: str | None = None, from_tier: m.Tier | None = None) -> None:
        await publish(self.broker, subjects.EVENT_BLOCK, m.BlockEvent(
            model=model, block_id=block_id, worker_id=self.worker_id, tier=tier, state=state,
            nbytes=nbytes, seconds=seconds, scale_op_id=scale_op_id, from_tier=from_tier))

    async def evicted(self, keys) -> None:
        for model, block_id in keys:
            await self.block(model, block_id, m.Tier.host, m.ReplicaState.evicted)

    def bandwidth(self, link: str, nbytes: int, seconds: float) -> None:
        fold_bandwidth(self.bandwidths_gbps, link, nbytes, seconds)


def memory_capacity(c: WorkerConfig) -> int:
    """The bytes this worker's engines may hold (sharing=mesh): as configured, else the memory
    free at start (the device's, less its working memory, for a CUDA worker)."""
    if c.memory_capacity_bytes > 0:
        return c.memory_capacity_bytes
    device = torch.device(c.device)
    if device.type == "cuda":
        return max(0, torch.cuda.mem_get_info(device)[0] - c.device_working_bytes)
    return psutil.virtual_memory().available


class _HostTierBlocks:
    """The TransferAgent's view of the worker's host tier: send from it, receive into it."""

    def __init__(self, cache: HostBlockCache, loader: BlockLoader, device: str,
                 incoming: dict[tuple[str, int], asyncio.Future], events: WorkerEvents):
        self.cache, self.loader, self.device = cache, loader, device
        self.incoming = incoming  # (model, block) -> its arrival, which a load may wait on
        self.events = events

    def take(self, model: str, block_id: int) -> torch.Tensor | None:
        buf = self.cache.get((model, block_id))
        if buf is not None:
            self.cache.pin((model, block_id))  # not evicted while it is being sent
        return buf

    async def release(self, model: str, block_id: int) -> None:
        await self.events.evicted(self.cache.unpin((model, block_id)))

    async def missing(self, model: str, block_id: int) -> None:
        # Say so, so the registry drops the replica it thought was here and the next plan
        # does not pick this worker as a source again (a lost eviction report, a restart).
        await self.events.evicted([(model, block_id)])

    def allocate(self, nbytes: int) -> torch.Tensor:
        return host_buffer(self.loader.arena, nbytes, pin=torch.device(self.device).type == "cuda")

    async def store(self, model: str, block_id: int, buffer: torch.Tensor) -> None:
        await self.events.evicted(self.cache.put((model, block_id), buffer))
        arrival = self.incoming.get((model, block_id))
        if arrival is not None and not arrival.done():
            arrival.set_result(buffer)  # a load waiting for this block goes on

    def expect(self, part: m.TransferPart) -> None:
        """Before the part starts: loads may wait for the blocks it receives (LoadModel.incoming_transfer)."""
        loop = asyncio.get_running_loop()
        for hop in part.receives:
            self.incoming.setdefault((part.model, hop.block), loop.create_future())

    async def part_ended(self, part: m.TransferPart, ok: bool) -> None:
        # What did not arrive never will: waiting loads read it from disk.
        for hop in part.receives:
            arrival = self.incoming.pop((part.model, hop.block), None)
            if arrival is not None and not arrival.done():
                arrival.set_result(None)


@dataclass
class _Request:
    instance_id: str
    model: str
    mode: str  # the instance's: local or pipeline
    reply_subject: str
    span: trace.Span
    next_index: dict[int, int]  # per choice still running: the index of its next token
    streamed: bool = False  # a token went out (its hop is in the trace)
    sent: int = 0
    admitted: Admitted | None = None  # sharing=mesh: its SLO clock, for shadow validation
    submitted: bool = False  # handed to the engine (sharing=mesh: its KV may be there, a resize copies it)
    attempt: int = 0  # GenerateRequest.attempt
    # Its id in the engine (run_id): one per attempt, so the output of a step of an attempt the
    # request left (handed over back to this instance) is told from the new attempt's.
    run: str = ""


def run_id(request_id: str, attempt: int) -> str:
    return f"{request_id}@{attempt}"


def split_run_id(run: str) -> tuple[str, int | None]:
    request_id, sep, attempt = run.rpartition("@")
    return (request_id, int(attempt)) if sep and attempt.isdigit() else (run, None)


class CancelledAttempts:
    """Attempts cancelled before their generate came (the gateway stopped waiting for the answer,
    the request went elsewhere): their generate, should it come yet, is refused. Each is kept
    `ttl_s`, far longer than a generate waits in a starved worker's inbox."""

    def __init__(self, ttl_s: float = 120.0):
        self.ttl_s = ttl_s
        self._until: dict[tuple[str, int], float] = {}  # in insertion order: oldest first

    def add(self, request_id: str, attempt: int, now: float) -> None:
        while self._until:  # the oldest first: stop at the first still kept
            key, until = next(iter(self._until.items()))
            if until > now:
                break
            del self._until[key]
        self._until[(request_id, attempt)] = now + self.ttl_s

    def take(self, request_id: str, attempt: int) -> bool:
        """Whether this attempt was cancelled (forgotten once asked: an attempt comes once)."""
        return self._until.pop((request_id, attempt), None) is not None

    def __len__(self) -> int:
        return len(self._until)


class WorkerService(Service):
    name = "worker"

    def __init__(self, config: WorkerConfig, nats_url: str | None = None):
        super().__init__(nats_url)
        self.config = config
        self.cache = HostBlockCache(config.host_capacity_bytes, config.host_cache_models)
        self.loader = BlockLoader(config.device, LoaderConfig(chunk_bytes=config.load_chunk_bytes,
                                                              threads=config.load_threads))
        self.bandwidths_gbps: dict[str, float] = {}
        self.instances: dict[str, Instance] = {}
        self.requests: dict[str, _Request] = {}
        self.cancelled_attempts = CancelledAttempts()
        self.runtime: EngineRuntime | None = None
        self.transport: Transport | None = None
        self.transfers: TransferAgent | None = None
        self._registered = False
        # (model, block) -> future of its host buffer, for blocks a running transfer brings
        self._incoming: dict[tuple[str, int], asyncio.Future] = {}
        self.pacer = make_pacer(config.emulated_host_to_device_mbit)
        self._kept: set[tuple[str, int]] = set()  # pinned by FetchBlocks (the parameter pool)
        self._plan_parts = None  # the JetStream subscription for scale-operation parts
        self._tokens_since = 0
        self._busy_refusals = 0  # since the last WorkerMetrics
        self._peer_reported: dict[str, float] = {}  # peer -> when this worker last reported it unreachable
        self.events = BusEvents(self.broker, config.worker_id, self.bandwidths_gbps)
        # Chosen once: the worker calls its strategy and never asks which one it is.
        self.sharing = make_sharing(config, WorkerPorts(
            broker=self.broker, instances=self.instances, requests=self.requests,
            engine_thread=lambda: self.runtime, blocks_in_engine=lambda model: self.loading.blocks_in_engine(model),
            memory_capacity=lambda: memory_capacity(config),
            residents=lambda: self.loading.residents(), stopping=lambda: self.loading.stopping(),
            unload=self._unload_here))
        # Loads and every instance's lifecycle (libs/planning/instance.py); `instances` holds the attached ones.
        self.loading = InstanceLoading(config, self.events, self.cache, self.loader, self.instances,
                                       incoming=self._incoming, kept=self._kept, sharing=self.sharing,
                                       pacer=self.pacer, spawn=self.spawn)
        self.pipelines = PipelineStages(
            config, broker=self.broker, instances=self.instances, blocks_in_engine=self.loading.blocks_in_engine,
            require_checkpoint=self._require_checkpoint, engine_thread=lambda: self.runtime,
            transport=lambda: self.transport)
        self.livepairs = LivePairs(
            config, broker=self.broker, loading=self.loading, pipelines=self.pipelines,
            engine_thread=lambda: self.runtime, transport=lambda: self.transport)
        # One handler per member of m.WorkerCommand.
        self._handlers: dict[type, Callable[..., Awaitable[m.CommandAck]]] = {
            m.TransferPart: self._on_transfer_part,
            m.LoadModel: self._on_load,
            m.CancelTransfer: self._on_cancel_transfer,
            m.FetchBlocks: self._on_fetch,
            m.ReleaseBlocks: self._on_release,
            m.UnloadModel: self._on_unload,
            m.StartPipeline: self._on_start_pipeline,
            m.FormLivePair: self.livepairs.form,
            m.EndLivePair: self.livepairs.end,
        }
        self._subscribe()

    def healthy(self) -> bool:
        return self._registered

    # Views of the lifecycles (the integration tests read them).
    @property
    def _loading(self) -> set[str]:
        """Instances whose load task runs."""
        return self.loading.loads_running()

    @property
    def _unload_asked(self) -> set[str]:
        """Loads still running whose instance was unloaded (they end at their next step)."""
        return self.loading.loads_unloaded()

    @property
    def _disk_jobs(self) -> dict[str, frozenset[int]]:
        """Instance -> its disk reads running (cancelled on unload)."""
        return self.loading.disk_reads()

    # --- lifecycle ------------------------------------------------------------------------------
    def _registration(self) -> dict:
        c = self.config
        # Free disk in whole GiB: its bytes move with every log line, and a registration that
        # differs is a change to the cluster view, which makes the planner's kept view stale.
        disk = shutil.disk_usage(os.getcwd()).free >> 30 << 30
        return dict(
            worker_id=c.worker_id,
            data_address=self.transport.address if self.transport else f"{c.data_host}:{c.data_port}",
            topology=m.Topology(host=c.host, leaf=c.leaf, scaleup_group=c.scaleup_group, link_gbps=c.link_gbps),
            capacities={m.Tier.gpu: c.engine_capacity_bytes, m.Tier.host: c.host_capacity_bytes, m.Tier.ssd: disk},
            bandwidths_gbps=dict(self.bandwidths_gbps),
        )

    async def start(self) -> None:
        # Blocking waits (transfer runs, disk blocks, paced copies, engine builds) go to threads;
        # asyncio's default pool (cpu_count + 4: 6 on 2 cores) would queue a load behind them.
        asyncio.get_running_loop().set_default_executor(
            concurrent.futures.ThreadPoolExecutor(max_workers=WORKER_THREADS, thread_name_prefix="worker"))
        if self.config.torch_threads:
            torch.set_num_threads(self.config.torch_threads)
        if self.config.host_arena_bytes:
            pin = torch.device(self.config.device).type == "cuda"
            self.loader.arena = await asyncio.to_thread(HostArena, self.config.host_arena_bytes, pin)
            log.info("host arena of %d bytes reserved for block buffers", self.loader.arena.capacity_bytes)
        self.runtime = EngineRuntime(asyncio.get_running_loop(), self._on_outputs, self._on_engine_failure,
                                     schedule=self.sharing.schedule)
        self.runtime.start()
        self.loading.runtime = self.runtime
        self.transport = self._make_transport(asyncio.get_running_loop())
        self.transport.on_peer_lost = self._peer_lost_threadsafe(asyncio.get_running_loop())
        self.transfers = TransferAgent(self.broker, self.transport, self.config.worker_id, _HostTierBlocks(
            self.cache, self.loader, self.config.device, self._incoming, self.events),
            on_received=lambda nbytes, seconds: self.events.bandwidth("network_to_host", nbytes, seconds))
        log.info("data plane listening on %s", self.transport.address)
        await super().start()
        # Scale-out parts come through JetStream (kept until taken); other commands as RPCs.
        self._plan_parts = await consume_parts(self.broker._connection, self.config.worker_id,
                                               rpc(m.WorkerCommand)(self._command))
        # The registry may start after us: retry until it answers.
        while True:
            try:
                await call(self.broker, subjects.REGISTRY_WORKER_REGISTER, m.RegisterWorker(**self._registration()),
                           m.WorkerInfo, timeout=2.0)
                break
            except TimeoutError:
                log.info("registry not answering yet; retrying")
                await asyncio.sleep(0.5)
        self._registered = True
        log.info("worker %s registered", self.config.worker_id)
        self.spawn(self._report_local_checkpoints())
        self._last_beat = time.monotonic()
        self.spawn(self.every(self.config.heartbeat_interval_s, self._heartbeat, "heartbeat", first_now=True))
        # Beside the first commands, not before registering: a cluster comes up no later for it.
        self.spawn(self._warm_up())
        for period, refresh, what in self.sharing.periodic():
            self.spawn(self.every(period, refresh, what))

    async def _warm_up(self) -> None:
        """transformers' first-use costs paid now, not by the first instance (libs/engine warm_up)."""
        started = time.monotonic()
        try:
            await asyncio.to_thread(warm_up)
        except Exception:  # noqa: BLE001 - only a lost optimisation: the first build pays instead
            log.warning("engine warm-up failed", exc_info=True)
        else:
            log.info("engine warm-up took %.2f s", time.monotonic() - started)

    def _make_transport(self, loop: asyncio.AbstractEventLoop) -> Transport:
        c = self.config

        def exchange(peer: str, info: dict) -> dict:
            # rdma's handshake, called on a transfer thread: the NATS round trip runs on the service's loop.
            reply = asyncio.run_coroutine_threadsafe(call(
                self.broker, subjects.worker_rdma_connect(peer), m.RdmaConnect(node_id=c.worker_id, info=info),
                m.RdmaConnect, timeout=10.0), loop).result(15.0)
            return reply.info

        return make_transport(c.transport, c.worker_id, host=c.data_host, port=c.data_port,
                              advertise_host=advertised_data_host(c), exchange=exchange,
                              rdma_device=c.rdma_device, egress_mbit=c.emulated_link_mbit)

    async def stop(self) -> None:
        if self._plan_parts is not None:
            await self._plan_parts.unsubscribe()
        for iid in list(self.instances):
            await self.loading.run(iid, self.loading.step(iid, lifecycle.UnloadAsked("worker shutting down")))
        self.pipelines.close()
        if self.transfers:
            await self.transfers.stop()
        if self.transport:
            self.transport.close()
        await super().stop()
        if self.runtime:
            await asyncio.to_thread(self.runtime.stop)

    async def _heartbeat(self) -> None:
        running = self.runtime.running()
        RUNNING.set(running)
        await publish(self.broker, subjects.EVENT_HEARTBEAT, m.Heartbeat(
            **self._registration(), instances=list(self.instances), running_requests=running))
        now = time.monotonic()
        tps = self._tokens_since / max(now - self._last_beat, 1e-6)
        self._tokens_since, self._last_beat = 0, now
        refusals, self._busy_refusals = self._busy_refusals, 0
        await publish(self.broker, subjects.METRICS_WORKER, m.WorkerMetrics(
            worker_id=self.config.worker_id, running_requests=running, tokens_per_s=tps,
            instances=list(self.instances), busy_refusals=refusals))

    def _peer_lost_threadsafe(self, loop: asyncio.AbstractEventLoop) -> Callable[[str, str], None]:
        def lost(peer: str, why: str) -> None:  # on a transport thread
            try:
                loop.call_soon_threadsafe(self._peer_lost, peer, why)
            except RuntimeError:
                pass  # the loop is closed: this worker is shutting down
        return lost

    def _peer_lost(self, peer: str, why: str) -> None:
        """The data plane lost `peer` (a connection broke, a send failed): tell the registry,
        which checks and, if it is dead, stops it now rather than at its heartbeats' expiry."""
        now = time.monotonic()
        if now - self._peer_reported.get(peer, -PEER_REPORT_INTERVAL_S) < PEER_REPORT_INTERVAL_S:
            return
        self._peer_reported[peer] = now
        try:
            report = m.WorkerUnreachable(worker_id=peer, reporter=self.config.worker_id, reason=why[:500])
        except ValueError:
            return  # not a worker id (a bare data-plane node of a benchmark): no registry knows it
        self.spawn(self._report_unreachable(report))

    async def _report_unreachable(self, report: m.WorkerUnreachable) -> None:
        try:
            ack = await call(self.broker, subjects.REGISTRY_WORKER_UNREACHABLE, report, m.CommandAck, timeout=5.0)
        except (TimeoutError, RemoteError) as e:
            log.warning("could not report %s unreachable to the registry: %s", report.worker_id, e)
            return
        UNREACHABLE_REPORTS.labels("dead" if ack.accepted else "refuted").inc()
        log.warning("reported %s unreachable (%s): the registry says %s", report.worker_id, report.reason,
                    ack.detail)

    def _busy(self, why: str) -> DomainError:
        """A "busy" answer (sharing=mesh: no room within the SLOs or memory now), counted for the
        next WorkerMetrics: the planner puts no new instance on a worker that refuses."""
        self._busy_refusals += 1
        return DomainError(why, code="busy")

    # --- blocks and instances -------------------------------------------------------------------------
    async def report_checkpoint(self, model: str, path: str) -> bool:
        """Report every block of `model` in the ssd tier if its checkpoint is on this worker's
        local disk (the registry records the replicas; the planner's estimate reads them)."""
        index = await asyncio.to_thread(local_checkpoint, path, self.config.local_checkpoint_dirs)
        if index is None:
            return False
        for block in index.blocks:
            await self.events.block(model, block.id, m.Tier.ssd, m.ReplicaState.ready, block.nbytes)
        return True

    async def _report_local_checkpoints(self) -> None:
        """At start: the models deployed before this worker came (those deployed later come as
        ModelEvents)."""
        try:
            deployed = await call(self.broker, subjects.REGISTRY_MODEL_LIST, m.ListModels(), m.ModelList,
                                  timeout=self.config.heartbeat_interval_s * 5)
        except (TimeoutError, RemoteError) as e:
            log.warning("could not list the deployed models to report local checkpoints: %s", e)
            return
        for model in deployed.models:
            await self.report_checkpoint(model.name, model.path)

    async def _report_evicted(self, keys: list[tuple[str, int]]) -> None:
        await self.events.evicted(keys)

    def _on_engine_failure(self, instance_id: str, error: Exception) -> None:
        """A step failed. A pipeline's stage is elsewhere: its worker died or its link broke, so
        the pipeline fails (its requests already got the error: the gateway hands them over)."""
        effects = self.loading.step(instance_id, lifecycle.StagePeerLost(str(error)))
        if effects:
            self.spawn(self.loading.run(instance_id, effects))

    # --- generation -----------------------------------------------------------------------------------------
    def _on_outputs(self, batch: list[tuple[str, str, TokenOutput | None, str | None]]) -> None:
        """Called on the event loop with a step's outputs; publishes them in order."""
        asyncio.ensure_future(self._publish_outputs(batch))

    async def _publish_outputs(self, batch: list[tuple[str, str, TokenOutput | None, str | None]]) -> None:
        for instance_id, run, out, error in batch:
            request_id, _ = split_run_id(run)
            req = self.requests.get(request_id)
            if req is None or req.instance_id != instance_id or req.run != run:
                # Ended, or handed over to another instance here or to another attempt on this one:
                # what the run it left computed is stale (it would take the new attempt's place).
                continue
            if error is not None:  # the whole request (every choice) failed
                choice = min(req.next_index)
                ev = m.TokenEvent(request_id=request_id, index=req.next_index[choice], finished=True,
                                  finish_reason="error", error=error, instance_id=instance_id, choice=choice,
                                  attempt=req.attempt)
                req.next_index.clear()
            else:
                ev = m.TokenEvent(request_id=request_id, index=req.next_index[out.choice], token_id=out.token_id,
                                  finished=out.finished, finish_reason=out.finish_reason,
                                  prompt_tokens=out.prompt_tokens, instance_id=instance_id,
                                  logprob=out.logprob, top_logprobs=list(out.top_logprobs), choice=out.choice,
                                  attempt=req.attempt)
                self._tokens_since += 1
                req.sent += 1
                TOKENS.labels(req.model, req.mode).inc()
                req.next_index[out.choice] += 1
                if out.finished:
                    del req.next_index[out.choice]
            # A request's trace shows the first and the last token's hop back to the gateway; the
            # ones between still carry its traceparent but unsampled (no spans per token).
            done = not req.next_index  # its last choice ended
            traced = not req.streamed or done
            req.streamed = True
            with trace.use_span(req.span if traced else unsampled(req.span)):
                await publish(self.broker, req.reply_subject, ev)
            if done:  # finished, failed (an engine error, its engine detached, refused by the engine)
                req.span.set_attribute("layercast.completion_tokens", req.sent)
                req.span.end()
                del self.requests[request_id]
                self.loading.request_ended(instance_id, request_id)  # a drain may end with it
                self.spawn(self.sharing.request_ended(instance_id))  # mesh: KV shrinks lazily, by the watermark

    def _preempt(self, instance_id: str, by: str) -> None:
        """§7.1: end every request of `instance_id` here with a `preempted` error event; the
        gateway hands each over with its tokens so far (a planned move, not a failure). No await
        before the last one is gone, so the admission that asked for it sees the room."""
        why = f"preempted by instance {by} (LLM-Mesh §7.1)"
        for request_id, req in list(self.requests.items()):
            if req.instance_id != instance_id or not req.next_index or not req.submitted:
                continue  # (one not submitted yet waits for its KV: it goes on as admitted)
            del self.requests[request_id]
            self.loading.request_ended(instance_id, request_id)
            self.runtime.cancel(instance_id, req.run)
            choice = min(req.next_index)
            ev = m.TokenEvent(request_id=request_id, index=req.next_index[choice], finished=True,
                              finish_reason="error", error=why, preempted=True, instance_id=instance_id,
                              choice=choice, attempt=req.attempt)
            req.span.add_event("preempted", {"layercast.by": by})
            req.span.end()
            PREEMPTIONS.labels(req.model).inc()
            self.spawn(publish(self.broker, req.reply_subject, ev))
        log.info("instance %s preempted by %s", instance_id, by)
        self.spawn(self.sharing.request_ended(instance_id))  # its KV shrinks lazily, as when requests end

    def _deregister(self, request_id: str, registered: _Request) -> None:
        """A registered request that never reached its engine leaves (if still this run of it)."""
        if self.requests.get(request_id) is registered:
            del self.requests[request_id]
            self.loading.request_ended(registered.instance_id, request_id)

    def _require_checkpoint(self, path: str) -> None:
        if not os.path.isdir(path):
            raise DomainError(f"checkpoint path {path!r} is not readable on {self.config.worker_id}",
                              code="not_found")

    async def _command(self, cmd: m.WorkerCommand) -> m.CommandAck:
        """One planner command, whether it came as an RPC or as a plan part from JetStream."""
        op = cmd.root
        return await self._handlers[type(op)](op)

    async def _on_transfer_part(self, op: m.TransferPart) -> m.CommandAck:
        self.transfers.blocks.expect(op)
        try:
            return await self.transfers.accept(op)
        except BaseException:
            await self.transfers.blocks.part_ended(op, False)
            raise

    async def _on_load(self, op: m.LoadModel) -> m.CommandAck:
        return await self.loading.on_load(op)

    async def _on_start_pipeline(self, op: m.StartPipeline) -> m.CommandAck:
        ack = await self.pipelines.start(op)
        if op.instance_id in self.instances or op.instance_id in self.pipelines.hosted:
            self.loading.pipeline_started(op.instance_id, entry=op.instance_id in self.instances)
        return ack

    async def _on_cancel_transfer(self, op: m.CancelTransfer) -> m.CommandAck:
        stopped = self.transfers.cancel(op.transfer_id, op.reason)
        return m.CommandAck(accepted=True, detail="cancelled" if stopped else "not running")

    async def _on_fetch(self, op: m.FetchBlocks) -> m.CommandAck:
        self._require_checkpoint(op.path)
        self.spawn(self.loading.fetch(op))
        return m.CommandAck(accepted=True, detail="fetching")

    async def _on_release(self, op: m.ReleaseBlocks) -> m.CommandAck:
        for b in op.blocks:
            if (op.model, b) in self._kept:
                self._kept.discard((op.model, b))
                await self._report_evicted(self.cache.unpin((op.model, b)))
        return m.CommandAck(accepted=True, detail="released")

    async def _on_unload(self, op: m.UnloadModel) -> m.CommandAck:
        reason = f"switched to {', '.join(op.switched_to)}" if op.switched_to else "unloaded by planner"
        effects = self.loading.step(op.instance_id, lifecycle.UnloadAsked(
            reason, tuple(op.switched_to), op.drain_timeout_s, op.host_keep_alive_s))
        if any(isinstance(e, lifecycle.StopHosting) for e in effects):
            self.pipelines.stop_hosting(op.instance_id)
        # Its reads are cancelled, its drain and stop go on beside the answer.
        self.spawn(self.loading.run(op.instance_id, effects))
        answer = next(e for e in effects if isinstance(e, lifecycle.Answer))
        if not answer.accepted:
            return m.CommandAck(accepted=False, detail=f"instance {op.instance_id} is not on {self.config.worker_id}")
        return m.CommandAck(accepted=True, detail=answer.detail)

    def _unload_here(self, instance_id: str, reason: str, drain_timeout_s: float) -> asyncio.Task:
        """Unload an instance on this worker's own decision (sharing=dedicated: another model is
        to load here): it stops serving now, then is drained, stopped and reported as the
        planner's UnloadModel would have it; the task returned ends once it stopped."""
        effects = self.loading.step(instance_id, lifecycle.UnloadAsked(reason, (), drain_timeout_s, None))
        if any(isinstance(e, lifecycle.StopHosting) for e in effects):
            self.pipelines.stop_hosting(instance_id)

        async def stop() -> None:
            await self.loading.run(instance_id, effects)
            if not await self.loading.stopped(instance_id, drain_timeout_s + 10.0):
                log.warning("instance %s did not stop within %.0f s of its unload", instance_id,
                            drain_timeout_s + 10.0)

        return self.spawn(stop())

    def _subscribe(self) -> None:
        b = self.broker
        wid = self.config.worker_id

        @b.subscriber(subjects.worker_command(wid))
        @rpc(m.WorkerCommand)
        async def command(cmd: m.WorkerCommand) -> m.CommandAck:
            return await self._command(cmd)

        @b.subscriber(subjects.worker_peer(wid))  # the other side of a live pair (not the planner's subject)
        @rpc(m.EndLivePair)
        async def peer(op: m.EndLivePair) -> m.CommandAck:
            return await self.livepairs.end(op)

        @b.subscriber(subjects.EVENT_MODEL)
        @on_event(m.ModelEvent)
        async def model(ev: m.ModelEvent) -> None:
            if ev.kind == "deployed":
                await self.report_checkpoint(ev.model.name, ev.model.path)

        @b.subscriber(subjects.worker_generate(wid))
        @rpc(m.GenerateRequest)
        async def generate(req: m.GenerateRequest) -> m.GenerateAccepted:
            inst = self.instances.get(req.instance_id)
            if inst is None or not self.loading.serving(req.instance_id):  # its lifecycle says whether it serves
                raise DomainError(f"instance {req.instance_id} is not serving on {wid}", code="unavailable")
            s = req.sampling  # the engine takes it as it is (validated with the request)
            try:
                if s.grammar is not None:
                    # Read the tokenizer for grammars here, off the engine thread (once per model).
                    await asyncio.to_thread(grammar_tokenizer, inst.path)
            except (ValueError, OSError) as e:
                raise DomainError(str(e)) from e
            if inst.info.max_batch is not None and s.n > inst.info.max_batch:
                raise DomainError(f"n={s.n} choices need as many KV slots; instance {req.instance_id} has "
                                  f"{inst.info.max_batch}")
            if s.n > 1 and req.generated_ids:
                raise DomainError("an n > 1 request resumes with `choices`, not generated_ids")
            # After the last await before registration: a cancel that came during one is seen here
            # (one that comes after finds the request registered under this attempt).
            if self.cancelled_attempts.take(req.request_id, req.attempt):
                raise DomainError(f"attempt {req.attempt} of request {req.request_id} was cancelled", code="conflict")
            # The choices to run, and the index of each one's next token.
            choices = req.choices or ({0: req.generated_ids} if s.n == 1 else {c: [] for c in range(s.n)})
            # No await from here to the registration below: the next request is admitted against
            # a worker that includes this one.
            admission = self.sharing.admit(inst, req, choices, time.monotonic())
            if not admission.ok:
                raise self._busy(f"{wid} cannot take it within its SLOs now ({admission.why})")
            # Its instance's lifecycle takes it, or refuses it (it stopped serving during an await above).
            if (refusal := self.loading.admit(req.instance_id, req.request_id)) is not None:
                raise DomainError(f"instance {req.instance_id} is not serving on {wid}", code=refusal.code)
            for victim in admission.preempt:
                self._preempt(victim, by=req.instance_id)
            admitted = admission.admitted
            span = _tracer.start_span("worker.generate", attributes={
                "layercast.model": req.model, "layercast.worker": wid, "layercast.instance": req.instance_id,
                "layercast.prompt_tokens": len(req.prompt_ids)})
            if req.generated_ids:
                span.set_attribute("layercast.resumed_tokens", len(req.generated_ids))
            if (old := self.requests.get(req.request_id)) is not None:
                old.span.end()  # handed over from another instance here: that run is over
                if old.instance_id != req.instance_id:  # (on the same one: it was admitted again above)
                    self.loading.request_ended(old.instance_id, req.request_id)
                if old.submitted:
                    # Handed over here, to another instance or to the one it runs on (its tokens
                    # were lost on the way, a NATS restart): the old run stops now, whenever the
                    # gateway's cancel comes; what it computed meanwhile is dropped by its run id.
                    self.runtime.cancel(old.instance_id, old.run)
            registered = _Request(req.instance_id, req.model, inst.info.mode, req.reply_subject, span,
                                  next_index={c: len(ids) for c, ids in choices.items()}, admitted=admitted,
                                  attempt=req.attempt, run=run_id(req.request_id, req.attempt))
            self.requests[req.request_id] = registered
            try:
                fitted = await self.sharing.fit_kv(inst)
            except BaseException:
                self._deregister(req.request_id, registered)
                span.end()
                raise
            if not fitted:
                # Validated and registered, but its KV cannot be granted now (§6.4): busy, as a
                # refusal by validation, so the gateway tries elsewhere or waits.
                self._deregister(req.request_id, registered)
                span.set_attribute("layercast.kv_refused", True)
                span.end()
                raise self._busy(f"{wid} has no memory for the KV of another request on {req.instance_id} now")
            if self.requests.get(req.request_id) is not registered:  # cancelled while its KV grew
                span.end()
                raise DomainError(f"request {req.request_id} was cancelled", code="conflict")
            registered.submitted = True
            self.runtime.submit(req.instance_id, registered.run, req.prompt_ids, s, req.generated_ids,
                                req.choices or None,
                                None if admitted is None else (admitted.start, admitted.slo.ttft_s, admitted.slo.tpot_s))
            return m.GenerateAccepted(request_id=req.request_id, queued=self.runtime.running(req.instance_id))

        @b.subscriber(subjects.worker_rdma_connect(wid))
        @rpc(m.RdmaConnect)
        async def rdma_connect(req: m.RdmaConnect) -> m.RdmaConnect:
            accept = getattr(self.transport, "accept_exchange", None)
            if accept is None:
                raise DomainError(f"{wid} runs the {self.config.transport} transport, not rdma", code="conflict")
            try:
                info = await asyncio.to_thread(accept, req.node_id, req.info)
            except (ValueError, TransferError) as e:
                raise DomainError(f"rdma connection from {req.node_id} refused: {e}") from e
            return m.RdmaConnect(node_id=wid, info=info)

        @b.subscriber(subjects.worker_cancel(wid))
        @on_event(m.CancelRequest)
        async def cancel(ev: m.CancelRequest) -> None:
            req = self.requests.get(ev.request_id)
            if ev.attempt is not None and (req is None or req.attempt != ev.attempt):
                # Not here, or not this attempt: its generate may still be on the way (refused then).
                self.cancelled_attempts.add(ev.request_id, ev.attempt, time.monotonic())
                return
            if ev.instance_id is not None and req is not None and req.instance_id != ev.instance_id:
                # A hand-over within this worker: the request runs on another instance now (its
                # run there was stopped when the new attempt came).
                return
            req = self.requests.pop(ev.request_id, None)
            if req is not None:
                self.loading.request_ended(req.instance_id, ev.request_id)
                self.runtime.cancel(req.instance_id, req.run)
                req.span.set_attribute("layercast.cancelled", True)
                req.span.end()
                self.spawn(self.sharing.request_ended(req.instance_id))

