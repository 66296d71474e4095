"""How this worker's instances share it: the strategy of the cluster's sharing setting, chosen
once by name from :data:`STRATEGIES` (the names are libs/planning/sharing.py's).

The worker calls its strategy where sharing matters, and never asks which one it has: a full
load's engine is sized and charged (`charge_load`), an attached instance is taken in
(`attached`), a loaded one profiled (`loaded`), a request admitted (`admit`, then `fit_kv` once
registered) and ended (`request_ended`), an instance's engine released as it stops
(`release`), room made for a load (`make_room`, before it starts), plus the background
refreshes the strategy runs (`periodic`).

- ``exclusive``: engines step in turn on fixed KV caches; every request is admitted; nothing
  is charged.
- ``dedicated``: one model per worker at a time (ServerlessLLM's allocation, LLM-Mesh's
  baseline): as exclusive, and before a load of a model starts, every instance here of another
  model is unloaded (its requests in flight end first, within EVICT_DRAIN_TIMEOUT_S; new ones
  are refused as the instance stops serving, and the gateway sends them elsewhere or waits).
- ``mesh`` (LLM-Mesh): services/worker/mesh.py's MeshNode and the MemoryOrchestrator of
  services/worker/memory.py: one headroom schedule, admission by shadow validation (with
  preemption), elastic KV within the worker's memory budget.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Protocol

import torch
from faststream.nats import NatsBroker
from prometheus_client import Counter

from libs.checkpoint import CheckpointIndex
from libs.engine import Engine
from libs.planning.sharing import sharing_setting
from libs.protocol import messages as m
from services.worker.memory import MemoryOrchestrator
from services.worker.mesh import (
    ELSEWHERE_REFRESH_S,
    Admitted,
    EngineThread,
    HostedInstance,
    MeshConfig,
    MeshNode,
    RequestRecord,
    Slo,
)
from services.worker.runtime import Schedule

DEDICATED_UNLOADS = Counter("layercast_worker_dedicated_unloads_total",
                            "Instances unloaded to load another model (sharing=dedicated)")
# How long an instance unloaded for another model (sharing=dedicated) may take to finish its
# requests in flight: the planner's drain timeout (UnloadModel's default). Past it they fail.
EVICT_DRAIN_TIMEOUT_S = 30.0

log = logging.getLogger(__name__)

# (period in seconds, the refresh, what it is for the logs): run by the worker's `every`
Periodic = tuple[float, Callable[[], Awaitable[object]], str]


@dataclass(frozen=True)
class EngineSizing:
    """How big a full load's engine starts, as its sharing strategy charged it."""

    max_batch_size: int
    kv_cache_bytes: int
    max_queue: int | None = None  # None: the engine's default
    # Elastic KV (mesh): the KV slots the instance may grow to, advertised as its max_batch
    # (its engine starts smaller); None: the engine's own max_batch_size is all it holds.
    ceiling: int | None = None
    slot_bytes: int = 0
    weights_bytes: int = 0

    def advertised_batch(self, engine: Engine) -> int:
        """The max_batch the instance advertises (the gateway's slots on it)."""
        return engine.max_batch_size if self.ceiling is None else self.ceiling


@dataclass(frozen=True)
class Admission:
    """A request's admission: may it join, which neighbours' requests move out first (§7.1),
    and its SLO clock (shadow validation simulates it; the headroom schedule orders by it)."""

    ok: bool
    why: str = ""  # refused: why, for the "busy" answer
    preempt: tuple[str, ...] = ()  # instance ids whose requests are preempted before it joins
    admitted: Admitted | None = None


class Sharing(Protocol):
    schedule: Schedule  # the engine thread's (services/worker/runtime.py)

    def periodic(self) -> list[Periodic]: ...

    async def charge_load(self, instance_id: str, index: CheckpointIndex) -> EngineSizing:
        """A full load's engine size, charged before it allocates (refused: raises, nothing charged)."""
        ...

    async def release_load(self, instance_id: str) -> None:
        """A load charged by `charge_load` failed or stopped before its instance stopped."""
        ...

    def attached(self, inst: HostedInstance, engine: Engine, sizing: EngineSizing) -> None:
        """A full load's instance now serves here, on `engine`."""
        ...

    def loaded(self, inst: HostedInstance) -> None:
        """Every block of the instance is in engine memory."""
        ...

    async def release(self, inst: HostedInstance, detach: Callable[[], Awaitable[None]]) -> None:
        """The instance stops: `detach()` takes its engine off the engine thread (called once)."""
        ...

    def admit(self, inst: HostedInstance, req: m.GenerateRequest, choices: Mapping[int, list[int]],
              now: float) -> Admission:
        """Whether the request may join `inst` now. Synchronous: the worker registers an admitted
        request before its next await, so the next admission counts it."""
        ...

    async def fit_kv(self, inst: HostedInstance) -> bool:
        """With the request registered: room for its KV on `inst` (False: it cannot join now)."""
        ...

    async def request_ended(self, instance_id: str) -> None: ...

    async def make_room(self, instance_id: str, model: str) -> None:
        """A load of `model` (instance `instance_id`) is about to start here (dedicated: what
        else this worker holds is unloaded first)."""
        ...


class SharingConfig(MeshConfig, Protocol):
    """The worker settings a strategy reads (WorkerConfig has them)."""

    sharing: str
    shadow_validation: bool
    preemption: bool
    profile_refresh_s: float


@dataclass(frozen=True)
class WorkerPorts:
    """What a strategy may read of the worker (its own containers, read live) and reach."""

    broker: NatsBroker
    instances: Mapping[str, HostedInstance]
    requests: Mapping[str, RequestRecord]
    engine_thread: Callable[[], EngineThread]  # the engine thread, once the worker started it
    blocks_in_engine: Callable[[str], dict[int, torch.Tensor]]  # model -> blocks its loads made ready
    memory_capacity: Callable[[], int]  # the bytes its engines may hold (asked only by a strategy that budgets)
    # instance id -> model, every instance here (loading, serving or draining) that has not stopped
    residents: Callable[[], Mapping[str, str]] = dict
    # the instances here whose unload was asked (draining, or a load being cancelled): not stopped yet
    stopping: Callable[[], Collection[str]] = frozenset
    # unload an instance (reason, drain timeout): it stops serving at once (before this returns);
    # the awaitable returned ends once it stopped
    unload: Callable[[str, str, float], Awaitable[None]] | None = None


class ExclusiveSharing:
    """Each instance on its own: engines step in turn, fixed KV, every request admitted."""

    schedule: Schedule = "turns"

    def __init__(self, config: SharingConfig, ports: WorkerPorts):
        self.config = config

    def periodic(self) -> list[Periodic]:
        return []

    async def charge_load(self, instance_id: str, index: CheckpointIndex) -> EngineSizing:
        return EngineSizing(self.config.max_batch_size, self.config.kv_cache_bytes)

    async def release_load(self, instance_id: str) -> None:
        pass

    def attached(self, inst: HostedInstance, engine: Engine, sizing: EngineSizing) -> None:
        pass

    def loaded(self, inst: HostedInstance) -> None:
        pass

    async def release(self, inst: HostedInstance, detach: Callable[[], Awaitable[None]]) -> None:
        await detach()

    def admit(self, inst: HostedInstance, req: m.GenerateRequest, choices: Mapping[int, list[int]],
              now: float) -> Admission:
        return Admission(True)

    async def fit_kv(self, inst: HostedInstance) -> bool:
        return True

    async def request_ended(self, instance_id: str) -> None:
        pass

    async def make_room(self, instance_id: str, model: str) -> None:
        pass


class DedicatedSharing(ExclusiveSharing):
    """One model per worker at a time: before a load of model B starts, every instance here of
    another model is unloaded (drained of its requests in flight, then stopped); B's load waits
    for that. Otherwise as exclusive."""

    def __init__(self, config: SharingConfig, ports: WorkerPorts):
        super().__init__(config, ports)
        self.ports = ports
        self._room = asyncio.Lock()  # one load makes room at a time: two never both find the worker free

    async def make_room(self, instance_id: str, model: str) -> None:
        # Decided one load at a time (two loads never both find the worker free), but waited for
        # outside the lock: a load that another one unloads meanwhile (it is cancelled) must
        # reach its next step, which ends it, while that other load waits for it.
        async with self._room:
            residents = self.ports.residents()
            if instance_id not in residents or instance_id in self.ports.stopping():
                return  # unloaded while it waited (another model's load): its load ends at its next step
            others = sorted(iid for iid, held in residents.items() if iid != instance_id and held != model)
            if others:
                log.info("sharing=dedicated: unloading %s to load %s (%s)", ", ".join(others), model, instance_id)
            stops = [self.ports.unload(iid, f"unloaded for {model} (sharing=dedicated)", EVICT_DRAIN_TIMEOUT_S)
                     for iid in others]
            DEDICATED_UNLOADS.inc(len(others))
        await asyncio.gather(*stops)


class MeshSharing:
    """LLM-Mesh: every change of the engines' memory goes through the orchestrator (§6.3); the
    decisions are the MeshNode's (services/worker/mesh.py)."""

    schedule: Schedule = "headroom"

    def __init__(self, config: SharingConfig, ports: WorkerPorts):
        self.config = config
        self.memory = MemoryOrchestrator(ports.memory_capacity())
        self.node = MeshNode(config, broker=ports.broker, instances=ports.instances, requests=ports.requests,
                             engine_thread=ports.engine_thread, blocks_in_engine=ports.blocks_in_engine,
                             validate=config.shadow_validation, memory=self.memory)

    def periodic(self) -> list[Periodic]:
        out: list[Periodic] = []
        if self.node.validate and self.config.preemption:
            out.append((ELSEWHERE_REFRESH_S, self.node.refresh_elsewhere, "models served elsewhere"))
        if self.config.profile_refresh_s > 0:
            out.append((self.config.profile_refresh_s, self.node.refresh_profiles, "profile refresh"))
        return out

    async def charge_load(self, instance_id: str, index: CheckpointIndex) -> EngineSizing:
        # Weights and the smallest KV charged to the memory budget first (refused: the load
        # fails, nothing allocated); the KV grows with its requests.
        kv = await self.node.charge_load(instance_id, index)
        return EngineSizing(kv.ceiling, kv.kv_bytes, max_queue=4 * kv.ceiling, ceiling=kv.ceiling,
                            slot_bytes=kv.slot_bytes, weights_bytes=kv.weights_bytes)

    async def release_load(self, instance_id: str) -> None:
        await self.node.release_load(instance_id)

    def attached(self, inst: HostedInstance, engine: Engine, sizing: EngineSizing) -> None:
        inst.engine, inst.kv_ceiling = engine, sizing.ceiling
        inst.kv_slot_bytes, inst.weights_bytes = sizing.slot_bytes, sizing.weights_bytes
        self.node.observe_held()

    def loaded(self, inst: HostedInstance) -> None:
        self.node.ensure_profile(inst)

    async def release(self, inst: HostedInstance, detach: Callable[[], Awaitable[None]]) -> None:
        if inst.engine is None:  # nothing charged (a pipeline's entry): only the engine goes
            await detach()
            return
        # Its memory is released as the engine goes.
        await self.node.release_load(inst.info.instance_id, detach)
        inst.engine = None

    def admit(self, inst: HostedInstance, req: m.GenerateRequest, choices: Mapping[int, list[int]],
              now: float) -> Admission:
        slo = Slo.of(req)
        verdict = self.node.admit(inst, req.request_id, len(req.prompt_ids) + min(map(len, choices.values())),
                                  len(choices), slo, now, preempt=self.config.preemption,
                                  overdue=req.queued_s > slo.ttft_s)
        if not verdict.ok:
            v = verdict.validation
            return Admission(False, why=f"{v.case}: {v.detail}")
        resumed = bool(req.generated_ids) or any(req.choices.values())
        return Admission(True, preempt=verdict.preempt,
                         admitted=Admitted(req.instance_id, now, len(req.prompt_ids), slo, movable=not resumed))

    async def fit_kv(self, inst: HostedInstance) -> bool:
        return await self.node.fit_kv(inst)

    async def request_ended(self, instance_id: str) -> None:
        await self.node.request_ended(instance_id)

    async def make_room(self, instance_id: str, model: str) -> None:
        pass


# name -> factory; the names are libs.planning.sharing.SHARINGS' (a test checks they agree)
STRATEGIES: dict[str, Callable[[SharingConfig, WorkerPorts], Sharing]] = {
    "exclusive": ExclusiveSharing,
    "mesh": MeshSharing,
    "dedicated": DedicatedSharing,
}


def make_sharing(config: SharingConfig, ports: WorkerPorts) -> Sharing:
    """The strategy of `config.sharing` (ValueError for a name the cluster does not know)."""
    sharing_setting(config.sharing)
    return STRATEGIES[config.sharing](config, ports)
