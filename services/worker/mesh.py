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
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from prometheus_client import Counter

from libs.bus.broker import RemoteError, call
from libs.checkpoint import CheckpointIndex
from libs.engine import Engine
from libs.engine.profiling import measure_profile
from libs.planning.mesh import (
    DEFAULT_TPOT_SLO_S,
    MeshInstance,
    Profile,
    RunningRequest,
    Validation,
    default_ttft_slo,
    plan_preemption,
    profile_samples,
    refreshed,
    shadow_validate,
)
from libs.planning.mesh_profiles import device_kind, profile_from_message, profile_to_message
from libs.protocol import messages as m
from libs.protocol import subjects

if TYPE_CHECKING:
    from services.worker.loading import Instance
    from services.worker.service import WorkerService

log = logging.getLogger(__name__)

ADMISSIONS = Counter("layercast_worker_mesh_admissions_total", "Requests by shadow validation's verdict "
                     "(admitted, unvalidated: no profile yet, or the Fig. 6 case that refused it)",
                     ["model", "verdict"])
REFRESHES = Counter("layercast_worker_mesh_profile_refreshes_total", "Profiles refreshed from live steps",
                    ["model"])
PREEMPTIONS = Counter("layercast_worker_mesh_preemptions_total", "Requests moved elsewhere by a preemption "
                      "(§7.1: a larger instance took their instance's share of this worker)", ["model"])
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


class MeshNode:
    def __init__(self, worker: WorkerService, validate: bool = True):
        self.worker = worker
        self.validate = validate
        self.kind = device_kind(worker.config.device)
        self.profiles: dict[str, Profile] = {}  # model -> its profile on this device kind
        # Models with a ready instance on another worker (from the registry, every
        # ELSEWHERE_REFRESH_S): where a preemption's requests can go on (§7.1).
        self.elsewhere: frozenset[str] = frozenset()
        self._profiling: dict[str, asyncio.Task] = {}

    # --- admission ------------------------------------------------------------------------------
    def _node(self, now: float) -> list[MeshInstance]:
        """This worker's instances with a profile, each with the requests running there."""
        w = self.worker
        rows: dict[str, list[RunningRequest]] = {}
        for rid, req in w.requests.items():
            if req.admitted is not None and req.next_index:
                rows.setdefault(req.instance_id, []).extend(req.admitted.rows(rid, req.next_index.values()))
        out = []
        for iid, inst in w.instances.items():
            profile = self.profiles.get(inst.info.model)
            if profile is not None and inst.info.mode == "local":
                out.append(MeshInstance(iid, inst.info.model, profile, tuple(rows.get(iid, ())), self.kind))
        return out

    def admit(self, inst: Instance, request_id: str, prompt_len: int, n: int, slo: Slo, now: float,
              preempt: bool = True) -> Verdict:
        """Whether a request of `n` choices may join `inst` now (shadow validation, §5.3), and
        if not, whether preempting smaller neighbours makes room (§7.1)."""
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
        verdict = shadow_validate(node, target, joined[0], now)
        victims = () if verdict.ok or not preempt else plan_preemption(node, target, joined[0], now, self.elsewhere)
        ADMISSIONS.labels(model, "admitted" if verdict.ok else "preempting" if victims else verdict.case).inc()
        return Verdict(verdict, tuple(v.id for v in victims))

    async def refresh_elsewhere(self) -> None:
        """The models served on other workers too, from the registry's view."""
        view = await call(self.worker.broker, subjects.REGISTRY_CLUSTER, m.GetCluster(recent_scale_ops=0),
                          m.ClusterView, timeout=5.0)
        me = self.worker.config.worker_id
        self.elsewhere = frozenset(i.model for i in view.instances
                                   if i.state == m.InstanceState.ready and i.entry_worker != me)

    # --- profiles -------------------------------------------------------------------------------
    def ensure_profile(self, inst: Instance) -> None:
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
        w = self.worker
        steps: dict[str, list[tuple[int, float, int, int, float]]] = {}
        times = w.runtime.step_times
        while times:
            instance_id, shape, seconds = times.popleft()
            inst = w.instances.get(instance_id)
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
                await call(w.broker, subjects.REGISTRY_PROFILE_PUT,
                           profile_to_message(model, self.kind, self.profiles[model], w.config.worker_id),
                           m.ModelProfile, timeout=5.0)
            except (TimeoutError, RemoteError) as e:
                log.warning("could not store the refreshed profile of %s: %s", model, e)
        return models

    async def _profile(self, model: str, path: str) -> None:
        w = self.worker
        try:
            stored = await call(w.broker, subjects.REGISTRY_PROFILE_GET, m.ProfileRef(model=model, device=self.kind),
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
            await call(w.broker, subjects.REGISTRY_PROFILE_PUT,
                       profile_to_message(model, self.kind, profile, w.config.worker_id), m.ModelProfile, timeout=5.0)
        except (TimeoutError, RemoteError) as e:
            log.warning("could not store the profile of %s: %s", model, e)

    async def _measure(self, model: str, path: str) -> Profile:
        """Measure on the engine thread (between steps: the numbers are what serving sees, and
        profiling never races the engines for the cores), over the blocks already in engine memory."""
        w = self.worker
        c = w.config
        index = await asyncio.to_thread(CheckpointIndex.load, path)
        blocks = w.loading.blocks_in_engine(model)
        max_len = max(1, min(c.profile_max_len, c.max_seq_len - PROFILE_REPEATS - 2))

        def make_engine(max_batch: int, max_seq_len: int) -> Engine:
            return Engine(index, blocks, device=c.device, max_batch_size=max_batch, max_seq_len=max_seq_len,
                          kv_cache_bytes=1 << 62)

        started = time.monotonic()
        profile = await w.runtime.call(lambda: measure_profile(make_engine, max_len, c.max_batch_size,
                                                               PROFILE_REPEATS))
        log.info("profiled %s on %s in %.1f s", model, self.kind, time.monotonic() - started)
        return profile
