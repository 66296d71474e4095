"""The worker's LLM-Mesh shell (sharing=mesh): its models' profiles and admission by shadow
validation. The decisions are libs/planning/mesh.py's; this carries them out.

- Profiles (§5.2): per (model, device kind), from the registry, else measured on the engine
  thread once the model's blocks are all in engine memory, then stored in the registry for the
  next worker. Until an instance's profile is known, its requests are admitted unvalidated (and
  counted so).
- Live refresh (§5.2): the engine thread times every step; each `profile_refresh_s` the
  steps that were pure decodes or a single prefill pull the profile toward what they took
  (`libs.planning.mesh.refreshed`), and the refreshed profile is stored in the registry.
- Shadow validation (§5.3): a request joins an instance only if a simulated future of this
  worker's iterations, every instance's requests included, keeps every headroom non-negative;
  otherwise the generate RPC is answered "busy" and the gateway tries another instance or waits.
- Proactive defragmentation (§7.1): before answering "busy", an instance may preempt smaller
  neighbours whose requests can still meet their SLOs elsewhere; those requests end here with
  a `preempted` error event and the gateway hands them over with their tokens so far.
- Elastic KV and hazard-aware memory (§6): a load charges its weights and the smallest KV cache
  (`kv_min_slots`) to the worker's memory budget (services/worker/memory.py) before it
  allocates; the engine starts that small and advertises its ceiling as max_batch. A request,
  once validated and registered, joins only if its instance's KV fits its rows (`kv_fit`: the
  watermark's early scale-up, else the compromise to the requirement, against the budget; a
  resize copies, so it is charged old + new while it runs); else "busy". A growth holds the
  engine thread while it copies: shadow validation counts it (`growth_stall`, its cost learned
  from the resizes measured here; a shrink's copy is not counted yet). When a request ends
  the cache shrinks lazily (the watermark rule). One KV change per instance at a time. No
  eviction: §6.4's last resort (evict and reschedule the request with the longest headroom)
  is not done, since a request never joins without its KV.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Protocol

import torch
from faststream.nats import NatsBroker
from prometheus_client import Counter, Gauge

from libs.bus.broker import RemoteError, call
from libs.checkpoint import CheckpointIndex
from libs.engine import Engine, kv_slot_bytes_of
from libs.engine.profiling import measure_profile
from libs.planning.mesh import (
    DEFAULT_TPOT_SLO_S,
    MeshInstance,
    Profile,
    ResizeCost,
    RunningRequest,
    Validation,
    default_ttft_slo,
    plan_preemption,
    kv_fit,
    profile_samples,
    refreshed,
    shadow_validate,
)
from libs.planning.mesh_profiles import device_kind, profile_from_message, profile_to_message
from libs.protocol import messages as m
from libs.protocol import subjects
from services.worker.memory import REFUSALS, MemoryOrchestrator, OutOfMemory

log = logging.getLogger(__name__)

ADMISSIONS = Counter("layercast_worker_mesh_admissions_total", "Requests by shadow validation's verdict "
                     "(admitted, unvalidated: no profile yet, or the Fig. 6 case that refused it)",
                     ["model", "verdict"])
REFRESHES = Counter("layercast_worker_mesh_profile_refreshes_total", "Profiles refreshed from live steps",
                    ["model"])
PREEMPTIONS = Counter("layercast_worker_mesh_preemptions_total", "Requests moved elsewhere by a preemption "
                      "(§7.1: a larger instance took their instance's share of this worker)", ["model"])
KV_RESIZES = Counter("layercast_worker_mesh_kv_resizes_total", "KV cache resizes (elastic KV, §6.2)",
                     ["model", "direction"])
KV_SLOTS = Gauge("layercast_worker_mesh_kv_slots", "KV slots an instance holds now", ["instance"])
HELD_PEAK = Gauge("layercast_worker_mesh_memory_held_peak_bytes",
                  "The most this worker's engines held at once, measured from them: weights and KV "
                  "pools (a resize's old and new pools together)")
PROFILE_REPEATS = 3
ELSEWHERE_REFRESH_S = 2.0  # a preempted request that finds no room there waits at the gateway, not lost
REFRESH_RATE = 0.05  # each live step moves the profile 5% of the way: noise averages out over ~20 steps


@dataclass(frozen=True)
class Slo:
    ttft_s: float
    tpot_s: float

    @classmethod
    def of(cls, req: m.GenerateRequest) -> Slo:
        """The deployment's SLOs carried by the request, the paper's defaults where absent."""
        return cls(req.ttft_slo_s or default_ttft_slo(len(req.prompt_ids)), req.tpot_slo_s or DEFAULT_TPOT_SLO_S)


@dataclass(frozen=True)
class Admitted:
    """What shadow validation simulates of a request running here: its rows (choices) and clock."""

    instance_id: str
    start: float  # time.monotonic() on arrival
    prompt_len: int
    slo: Slo
    movable: bool = True  # not handed over here already: a preemption may move it (once)

    def rows(self, request_id: str, generated: Iterable[int]) -> list[RunningRequest]:
        return [RunningRequest(f"{request_id}#{i}", self.start, self.prompt_len, g, self.slo.ttft_s, self.slo.tpot_s,
                               self.movable)
                for i, g in enumerate(generated)]


@dataclass(frozen=True)
class Verdict:
    """Admission: shadow validation's, and when it refused, the neighbours whose requests move
    elsewhere to make room (§7.1), which admits the request once they are preempted."""

    validation: Validation
    preempt: tuple[str, ...] = ()  # instance ids

    @property
    def ok(self) -> bool:
        return self.validation.ok or bool(self.preempt)


def kv_floor(min_slots: int, ceiling: int) -> int:
    """L_min in KV slots: `min_slots` up to the ceiling; 0 keeps the KV fixed at the ceiling."""
    return ceiling if min_slots <= 0 else min(min_slots, ceiling)


@dataclass(frozen=True)
class KvSizing:
    """A mesh instance's memory, charged before its load allocates."""

    ceiling: int  # KV slots at most (the advertised max_batch)
    slot_bytes: int
    slots: int  # KV slots it starts with (kv_min_slots)
    weights_bytes: int

    @property
    def kv_bytes(self) -> int:
        return self.slots * self.slot_bytes


# --- what the mesh reads of the worker (narrow ports, not the WorkerService) -------------------
class MeshConfig(Protocol):
    """The worker settings the mesh reads (WorkerConfig has them)."""

    worker_id: str
    device: str
    max_batch_size: int
    max_seq_len: int
    kv_cache_bytes: int
    kv_min_slots: int
    kv_watermark: float
    profile_max_len: int


class HostedInstance(Protocol):
    """An instance on this worker as the mesh sees it (services/worker/loading.py's Instance);
    `engine` and the KV fields are the mesh's own (set when it charged the load)."""

    info: m.InstanceInfo
    path: str
    draining: bool
    engine: Engine | None
    kv_ceiling: int
    kv_slot_bytes: int
    weights_bytes: int


class RequestRecord(Protocol):
    """A request running on this worker, as the mesh sees it."""

    instance_id: str
    next_index: dict[int, int]  # per choice still running: the KV rows it holds
    submitted: bool  # handed to the engine: its KV may be there (a resize copies it)
    admitted: Admitted | None


class EngineThread(Protocol):
    """The worker's engine thread (services/worker/runtime.py's EngineRuntime)."""

    step_times: deque | None

    def call(self, fn: Callable[[], object]) -> asyncio.Future: ...


class MeshNode:
    def __init__(self, config: MeshConfig, *, broker: NatsBroker, instances: Mapping[str, HostedInstance],
                 requests: Mapping[str, RequestRecord], engine_thread: Callable[[], EngineThread],
                 blocks_in_engine: Callable[[str], dict[int, torch.Tensor]], validate: bool = True,
                 memory: MemoryOrchestrator | None = None):
        """`instances` and `requests` are the worker's own (read live); `engine_thread` gives the
        engine thread once the worker has started it; `blocks_in_engine(model)` the blocks its
        loads made ready (profiles are measured over them)."""
        self.config = config
        self.broker = broker
        self.instances = instances
        self.requests = requests
        self.engine_thread = engine_thread
        self.blocks_in_engine = blocks_in_engine
        self.validate = validate
        self.kind = device_kind(config.device)
        self.profiles: dict[str, Profile] = {}  # model -> its profile on this device kind
        # Models with a ready instance on another worker (from the registry, every
        # ELSEWHERE_REFRESH_S): where a preemption's requests can go on (§7.1).
        self.elsewhere: frozenset[str] = frozenset()
        self._profiling: dict[str, asyncio.Task] = {}
        self.memory = memory
        # Elastic KV (kv_min_slots >= 1): off, every instance's KV stays at its ceiling, charged
        # once at load, and admission and request ends leave it alone.
        self.elastic = config.kv_min_slots > 0
        self._shrink_deferred: set[str] = set()  # instances whose shrink found no room for its copy
        self._kv_locks: dict[str, asyncio.Lock] = {}  # instance -> one KV change at a time
        self._kv_slots_seen: set[str] = set()  # instances with a KV_SLOTS sample
        self.resize_cost = ResizeCost()  # learned from the resizes measured here
        self.held_peak = 0

    # --- memory (§6) ----------------------------------------------------------------------------
    async def charge_load(self, instance_id: str, index: CheckpointIndex) -> KvSizing:
        """Charge a full load's weights and smallest KV to the budget before it allocates
        (OutOfMemory: refused, nothing charged)."""
        c = self.config
        slot_bytes = await asyncio.to_thread(kv_slot_bytes_of, index, c.max_seq_len)
        ceiling = min(c.max_batch_size, c.kv_cache_bytes // slot_bytes)
        if ceiling < 1:
            raise ValueError(f"a KV budget of {c.kv_cache_bytes} bytes cannot hold one request of "
                             f"{c.max_seq_len} tokens ({slot_bytes} bytes)")
        sizing = KvSizing(ceiling, slot_bytes, kv_floor(c.kv_min_slots, ceiling), index.total_nbytes)
        await self.memory.change(f"{instance_id}:weights", sizing.weights_bytes)
        try:
            await self.memory.change(f"{instance_id}:kv", sizing.kv_bytes)
        except BaseException:
            await self.memory.release(f"{instance_id}:weights")
            raise
        return sizing

    async def release_load(self, instance_id: str, detach=None) -> None:
        """The instance's memory goes: its KV by `detach()` (the budget drops as it starts, so
        a waiting scale-up may be issued against it), then its weights."""
        async with self._kv_lock(instance_id):
            await self.memory.release(f"{instance_id}:kv", detach)
        await self.memory.release(f"{instance_id}:weights")
        self._kv_locks.pop(instance_id, None)
        if instance_id in self._kv_slots_seen:
            self._kv_slots_seen.discard(instance_id)
            KV_SLOTS.remove(instance_id)

    def _kv_lock(self, instance_id: str) -> asyncio.Lock:
        return self._kv_locks.setdefault(instance_id, asyncio.Lock())

    def _rows(self, instance_id: str, submitted_only: bool = False) -> int:
        """The sequences (choices) this worker's requests run on the instance: the KV slots they
        need (`submitted_only`: those the engine may hold KV of, so a resize copies them)."""
        return sum(len(r.next_index) for r in self.requests.values()
                   if r.instance_id == instance_id and (r.submitted or not submitted_only))

    def _kv_target(self, inst: HostedInstance) -> int | None:
        c = self.config
        iid = inst.info.instance_id
        return kv_fit(inst.engine.kv_slots, self._rows(iid), slot_bytes=inst.kv_slot_bytes,
                      watermark=c.kv_watermark, min_slots=kv_floor(c.kv_min_slots, inst.kv_ceiling),
                      max_slots=inst.kv_ceiling, available=self.memory.available,
                      copies=self._rows(iid, submitted_only=True) > 0)

    async def fit_kv(self, inst: HostedInstance) -> bool:
        """Admission's last step, with the request registered: grow the instance's KV to hold
        its rows (the watermark's recommendation, else the requirement); False when the budget
        cannot grant it (the request cannot join now)."""
        if inst.engine is None or not self.elastic:  # KV fixed (or a pipeline's): nothing to fit
            return True
        async with self._kv_lock(inst.info.instance_id):
            if inst.draining or self.instances.get(inst.info.instance_id) is not inst:
                return False
            current = inst.engine.kv_slots
            target = self._kv_target(inst)
            if target is None:
                REFUSALS.inc()
                return False
            if target <= current:
                return True  # shrinks are lazy: only when a request ends
            try:
                await self._resize(inst, target)
            except OutOfMemory:
                return False
            except Exception:  # noqa: BLE001 - taken back; the request is refused, the instance serves on
                log.exception("growing the KV cache of %s failed", inst.info.instance_id)
                return False
            return True

    async def request_ended(self, instance_id: str) -> None:
        """A request ended on the instance: its KV may shrink (lazily, by the watermark), and so
        may those whose shrink was refused earlier for want of room for its copy."""
        if not self.elastic:
            return
        for iid in [instance_id, *sorted(self._shrink_deferred - {instance_id})]:
            await self.shrink_kv(iid)

    async def shrink_kv(self, instance_id: str) -> None:
        """Shrink the instance's KV if the watermark says so."""
        inst = self.instances.get(instance_id)
        if inst is None or inst.engine is None:
            self._shrink_deferred.discard(instance_id)
            return
        async with self._kv_lock(instance_id):
            if inst.draining or self.instances.get(instance_id) is not inst:
                return
            self._shrink_deferred.discard(instance_id)
            target = self._kv_target(inst)
            if target is None or target >= inst.engine.kv_slots:
                return
            try:
                await self._resize(inst, target)
            except OutOfMemory:
                self._shrink_deferred.add(instance_id)
                log.info("shrinking the KV cache of %s waits: no room for its copy now", instance_id)
            except Exception:  # noqa: BLE001 - taken back: the cache keeps its size
                log.warning("shrinking the KV cache of %s failed", instance_id, exc_info=True)

    async def _resize(self, inst: HostedInstance, slots: int) -> None:
        engine, iid = inst.engine, inst.info.instance_id
        old = engine.kv_slots
        # With KV to keep the cache copies it into the new pool, holding both; an empty cache
        # drops its pool first (SlotKVCache.resize).
        copies = self._rows(iid, submitted_only=True) > 0

        def resize() -> int:
            """The bytes of the old pool held beside the new one (0: dropped first)."""
            before, live = _kv_nbytes(engine), engine.max_batch_size - engine.free_slots
            started = time.perf_counter()
            engine.resize_kv(slots)
            # Read on the event loop (the next admission's stall): one float, swapped whole.
            self.resize_cost = self.resize_cost.observed(live, time.perf_counter() - started)
            return before if live else 0

        both = await self.memory.change(
            f"{iid}:kv", slots * inst.kv_slot_bytes, lambda: self.engine_thread().call(resize),
            during=(old + slots) * inst.kv_slot_bytes if copies else None)
        KV_RESIZES.labels(inst.info.model, "up" if slots > old else "down").inc()
        KV_SLOTS.labels(iid).set(slots)
        self._kv_slots_seen.add(iid)
        if both and not copies:
            log.error("the KV cache of %s held live slots the worker did not know of: its resize was "
                      "charged without its copy", iid)
        self.observe_held(during=both)  # the old pool, where it was held beside the new one
        log.debug("KV cache of %s: %d -> %d slots", iid, old, slots)

    def observe_held(self, during: int = 0) -> int:
        """What this worker's engines hold now, measured from them (plus `during`: a pool a
        resize held beside the new one); the peak is kept (the OOM check of the tests)."""
        held = during
        for inst in self.instances.values():
            if inst.engine is not None:
                held += inst.weights_bytes + _kv_nbytes(inst.engine)
        self.held_peak = max(self.held_peak, held)
        HELD_PEAK.set(self.held_peak)
        return held

    # --- admission ------------------------------------------------------------------------------
    def _node(self, now: float) -> list[MeshInstance]:
        """This worker's instances with a profile, each with the requests running there."""
        rows: dict[str, list[RunningRequest]] = {}
        for rid, req in self.requests.items():
            if req.admitted is not None and req.next_index:
                rows.setdefault(req.instance_id, []).extend(req.admitted.rows(rid, req.next_index.values()))
        out = []
        for iid, inst in self.instances.items():
            profile = self.profiles.get(inst.info.model)
            if profile is not None and inst.info.mode == "local":
                out.append(MeshInstance(iid, inst.info.model, profile, tuple(rows.get(iid, ())), self.kind))
        return out

    def admit(self, inst: HostedInstance, request_id: str, prompt_len: int, n: int, slo: Slo, now: float,
              preempt: bool = True, overdue: bool = False) -> Verdict:
        """Whether a request of `n` choices may join `inst` now (shadow validation, §5.3), and
        if not, whether preempting smaller neighbours makes room (§7.1). `overdue`: it waited
        past its TTFT SLO before it came here (see `shadow_validate`)."""
        model = inst.info.model
        if not self.validate:
            return Verdict(Validation(True))
        node = self._node(now)
        target = next((i for i in node if i.id == inst.info.instance_id), None)
        if target is None:
            ADMISSIONS.labels(model, "unvalidated").inc()
            return Verdict(Validation(True, detail="no profile yet"))
        # n choices are n rows; validate the first, the others join with it (as the batch grows).
        joined = Admitted(inst.info.instance_id, now, prompt_len, slo).rows(request_id, [0] * n)
        others = joined[1:]
        if others:
            target_with = MeshInstance(target.id, target.model, target.profile, (*target.requests, *others),
                                       target.device)
            node = [target_with if i.id == target.id else i for i in node]
            target = target_with
        stall = self.growth_stall(inst, n)
        verdict = shadow_validate(node, target, joined[0], now, stall_s=stall, overdue=overdue)
        victims = () if verdict.ok or not preempt else plan_preemption(node, target, joined[0], now, self.elsewhere,
                                                                       stall_s=stall, overdue=overdue)
        ADMISSIONS.labels(model, "admitted" if verdict.ok else "preempting" if victims else verdict.case).inc()
        return Verdict(verdict, tuple(v.id for v in victims))

    def growth_stall(self, inst: HostedInstance, n: int) -> float:
        """Seconds the engine thread will spend growing `inst`'s KV cache (copying its live KV
        into a bigger pool) before `n` more rows can run there; 0 when its KV holds them already
        (or is fixed). Shadow validation counts it: every instance's next iteration waits."""
        if not self.elastic or inst.engine is None:
            return 0.0
        iid = inst.info.instance_id
        rows = self._rows(iid) + n
        if rows <= inst.engine.kv_slots or inst.engine.kv_slots >= inst.kv_ceiling:
            return 0.0
        return self.resize_cost.seconds(self._rows(iid, submitted_only=True))

    async def refresh_elsewhere(self) -> None:
        """The models served on other workers too, from the registry's view."""
        view = await call(self.broker, subjects.REGISTRY_CLUSTER, m.GetCluster(recent_scale_ops=0),
                          m.ClusterView, timeout=5.0)
        me = self.config.worker_id
        self.elsewhere = frozenset(i.model for i in view.instances
                                   if i.state == m.InstanceState.ready and i.entry_worker != me)

    # --- profiles -------------------------------------------------------------------------------
    def ensure_profile(self, inst: HostedInstance) -> None:
        """Get `inst`'s model profile (registry, else measure) unless known or under way."""
        model = inst.info.model
        if model in self.profiles or model in self._profiling:
            return
        task = asyncio.ensure_future(self._profile(model, inst.path))
        self._profiling[model] = task
        task.add_done_callback(lambda _: self._profiling.pop(model, None))

    async def refresh_profiles(self) -> list[str]:
        """Fold the steps timed since the last call into the profiles of their models
        (`profile_samples`: mixed steps are left out), and store the refreshed ones; the models
        refreshed."""
        steps: dict[str, list[tuple[int, float, int, int, float]]] = {}
        times = self.engine_thread().step_times
        while times:
            instance_id, shape, seconds = times.popleft()
            inst = self.instances.get(instance_id)
            if inst is not None and inst.info.mode == "local" and inst.info.model in self.profiles:
                steps.setdefault(inst.info.model, []).append(
                    (shape.decode_rows, shape.decode_mean_len, shape.prefill_tokens, shape.prefill_rows, seconds))
        models = []
        for model, taken in sorted(steps.items()):
            decodes, prefills = profile_samples(taken)
            if not decodes and not prefills:
                continue
            models.append(model)
            self.profiles[model] = refreshed(self.profiles[model], decodes, prefills, REFRESH_RATE)
            REFRESHES.labels(model).inc()
            try:
                await call(self.broker, subjects.REGISTRY_PROFILE_PUT,
                           profile_to_message(model, self.kind, self.profiles[model], self.config.worker_id),
                           m.ModelProfile, timeout=5.0)
            except (TimeoutError, RemoteError) as e:
                log.warning("could not store the refreshed profile of %s: %s", model, e)
        return models

    async def _profile(self, model: str, path: str) -> None:
        try:
            stored = await call(self.broker, subjects.REGISTRY_PROFILE_GET, m.ProfileRef(model=model, device=self.kind),
                                m.ModelProfile, timeout=5.0)
            self.profiles[model] = profile_from_message(stored)
            log.info("profile of %s on %s from the registry (measured by %s)", model, self.kind, stored.source)
            return
        except (TimeoutError, RemoteError) as e:
            log.info("no stored profile of %s on %s (%s): measuring it", model, self.kind, e)
        except ValueError as e:
            log.warning("the registry's profile of %s on %s is invalid (%s): measuring it", model, self.kind, e)
        try:
            profile = await self._measure(model, path)
        except Exception:  # noqa: BLE001 - the instance serves on, unvalidated; say why
            log.exception("profiling %s failed", model)
            return
        self.profiles[model] = profile
        try:
            await call(self.broker, subjects.REGISTRY_PROFILE_PUT,
                       profile_to_message(model, self.kind, profile, self.config.worker_id), m.ModelProfile, timeout=5.0)
        except (TimeoutError, RemoteError) as e:
            log.warning("could not store the profile of %s: %s", model, e)

    async def _measure(self, model: str, path: str) -> Profile:
        """Measure on the engine thread (between steps: the numbers are what serving sees, and
        profiling never races the engines for the cores), over the blocks already in engine memory."""
        c = self.config
        index = await asyncio.to_thread(CheckpointIndex.load, path)
        blocks = self.blocks_in_engine(model)
        max_len = max(1, min(c.profile_max_len, c.max_seq_len - PROFILE_REPEATS - 2))

        def make_engine(max_batch: int, max_seq_len: int) -> Engine:
            return Engine(index, blocks, device=c.device, max_batch_size=max_batch, max_seq_len=max_seq_len,
                          kv_cache_bytes=1 << 62)

        started = time.monotonic()
        measure = lambda: self.engine_thread().call(lambda: measure_profile(make_engine, max_len, c.max_batch_size,  # noqa: E731
                                                                 PROFILE_REPEATS))
        if self.memory is None:
            profile = await measure()
        else:  # its engine's KV is charged while it runs (refused: OutOfMemory, not profiled)
            kv = c.max_batch_size * await asyncio.to_thread(kv_slot_bytes_of, index, max_len + PROFILE_REPEATS + 2)
            alloc = f"profile:{model}"
            await self.memory.change(alloc, kv)
            try:
                self.observe_held(during=kv)
                profile = await measure()
            finally:
                await self.memory.release(alloc)
        log.info("profiled %s on %s in %.1f s", model, self.kind, time.monotonic() - started)
        return profile


def _kv_nbytes(engine: Engine) -> int:
    """The bytes of an engine's KV pools (its local stages' caches)."""
    return sum(st.kv.nbytes for st in engine.stages if hasattr(st, "kv"))
