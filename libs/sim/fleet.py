"""The fleet simulator: layercast's control plane and data plane as discrete events.

What is layercast's own code, unchanged (imported, called as the services call it):

* the load-monitor's tick: :func:`libs.planning.autoscale.model_observation` and
  :func:`libs.planning.autoscale.step` with the deployment's policy;
* the planner: :func:`libs.planning.scaleout.decide` on a :class:`~libs.protocol.messages.ClusterView`
  of the simulated registry (with :func:`libs.planning.scaleop.open_live_pairs`), then
  :func:`libs.planning.scaleop.open_scale_up` / ``open_scale_down`` / ``step``: every effect the
  operation returns is carried out here and its answer fed back (pipelines to form and to retire
  are the operation's own :func:`~libs.planning.pipelines.pipelines_to_form` / ``_retire``);
* the worker's instance lifecycle :func:`libs.planning.instance.step` (when an instance serves,
  admits a request, drains, stops);
* the gateway's routing order (:mod:`libs.planning.sharing`);
* the planner's parameter-pool check (:func:`libs.planning.pool.plan_pool_fills`, admitted by
  :func:`libs.planning.scaleop.admit_pool_fill`, every ``Timers.pool_check_s``): the pool's host
  copy moves off the workers serving the model, over the fabric from its holder.

What is modelled (libs.sim.timemodel): how long transfers, disk reads, copies to engine memory,
prefills and decode iterations take, and the control plane's latencies. What is simplified
(documented where it is done): an instance's batch advances as a fluid between changes of its
membership (iteration time from the profile at the batch's mean length); while prompts wait,
the instance runs the engine's steps (one decode pass, then one batched prefill pass over the
waiting prompts, shortest remainder first: `_schedule`); workers never fail.

Execute while loading (the worker's Engine.prefill_ahead; FleetConfig.prefill_ahead): a
serve-while-loading instance's prefill step that starts before its last block is in engine
memory takes the waiting prompts whole, in the engine's passes (libs.planning.ahead: nothing
decodes yet, so no chunks), and runs them through each block but the last once it has landed,
one pass at a time, the first admitted that is behind (a block's share of a pass's compute by its
bytes), until every block is in; then the step finishes the passes that fit the token budget,
first admitted first, and the other rows go on in the next steps with the rest of their prefill
(`_ahead_done`, `_prefilled`). Prompts that come meanwhile join that step
as the engine's late passes catch up through the landed blocks (`_join_ahead`; their compute
counts from the step's start, a small optimism when the load is much longer than the prefill, as
it is on a GPU).

Live pairs (BlitzScale §5.2, modes blitzscale / blitzscale-fixed): the planner's pairs
(:func:`libs.planning.scaleout.plan_live_pairs`, carried by the scale operation) reach both
instances' lifecycles (``PairFormed``: pair_source / pair_target; ``EndPair`` / ``PairEnded``
when the target's last block dissolves the pair), and each prefill of the source is split by
the real :class:`libs.planning.livepair.PrefillSplitter` over the ZigZag queue: its first k
blocks run on the target (k/n of the prefill, plus one call for the hand-off; the source
decodes meanwhile), the other n-k on the source. sharing=dedicated: the planner places by
``decide(dedicated=True)`` and a worker unloads another model's instances (drained) before a
load starts, as services/worker/sharing.py's DedicatedSharing does.
"""

from __future__ import annotations

import dataclasses
import random
from collections import defaultdict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from libs.planning import autoscale, instance as lc, scaleop as so
from libs.planning.ahead import AHEAD_TOKEN_LIMIT, ahead_passes, passes_to_finish
from libs.planning.livepair import PrefillSplitter, leading_blocks
from libs.planning.pool import plan_pool_fills
from libs.planning.scaleout import SERVERLESSLLM_KEEP_ALIVE_S, ScaleIn, ScalePlan, decide, mode_spec
from libs.planning.sharing import sharing_setting
from libs.protocol import messages as m
from libs.sim.clock import EventQueue
from libs.sim.profile import SimProfile
from libs.sim.timemodel import Compute, Control, Fabric, Storage, multicast_arrivals

__all__ = ["FleetConfig", "Request", "RunResult", "Simulation", "simulate"]

EPS = 1e-9
EVICT_DRAIN_TIMEOUT_S = 30.0  # services/worker/sharing.py: an instance unloaded for another model drains this long
# The serving engine's step (libs/engine/engine.py DEFAULT_TOKEN_BUDGET, DEFAULT_PREFILL_CHUNK): the
# simulator is pure and does not import the engine (torch); a unit test keeps these equal.
ENGINE_TOKEN_BUDGET = 2048
ENGINE_PREFILL_CHUNK = 512
HOST, GPU, READY = m.Tier.host, m.Tier.gpu, m.ReplicaState.ready


@dataclass(frozen=True)
class FleetConfig:
    nodes: int
    mode: str
    leaves: int = 1
    uplink_gbps: float | None = None  # a leaf's uplink in all; None: non-blocking
    scaleup_group: int = 1  # workers per scale-up group (1: none)
    models: int = 1
    sharing: str = "exclusive"
    max_instances: int | None = None  # per model; None: nodes
    min_instances: int = 0
    keep_alive_s: float = 60.0
    policy: str | None = None  # None: the mode's default (deploy_policy)
    policy_params: tuple[tuple[str, float], ...] = ()  # the deployment's --policy-param K=V
    target_concurrency: int = 8  # the load-monitor's --target-concurrency
    scale_down_delay_s: float = 5.0  # the load-monitor's default
    tick_s: float = 0.1  # the load-monitor's tick
    report_interval_s: float = 0.5  # the gateway's metrics_interval_s: its reports' cadence
    resend_s: float = 2.0
    window_s: float = 10.0
    drain_timeout_s: float = 30.0
    max_queue: int = 256
    slo_ttft_s: float = 2.0
    slo_tpot_s: float = 0.25
    serverlessllm_keep_alive_s: float = SERVERLESSLLM_KEEP_ALIVE_S
    seed: int = 0
    horizon_after_s: float = 600.0  # requests unfinished this long after the last arrival are lost
    # The worker's Engine.prefill_ahead: a serve-while-loading instance's first prefills run each
    # block as it lands. False: workers before it (their first step waited for every block).
    prefill_ahead: bool = True

    def __post_init__(self) -> None:
        mode_spec(self.mode)  # ValueError naming the modes
        sharing_setting(self.sharing)
        if self.nodes < 1 or self.models < 1 or self.leaves < 1 or self.scaleup_group < 1:
            raise ValueError("nodes, models, leaves and scaleup_group must be >= 1")
        if self.nodes < self.leaves:
            raise ValueError(f"{self.leaves} leaves need at least as many nodes, got {self.nodes}")


@dataclass
class Request:
    rid: str
    model: str
    arrive: float
    prompt: int
    output: int
    first_token: float | None = None
    done: float | None = None
    lost: str | None = None
    # serving state
    instance: str | None = None
    left: float = 0.0  # output tokens still to decode
    generated: float = 0.0
    recompute: int = 0  # tokens whose KV a handed-over request rebuilds
    prefilled: int = 0  # prompt (or rebuilt) tokens prefilled so far

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrive

    @property
    def tpot(self) -> float | None:
        if self.done is None or self.first_token is None:
            return None
        return (self.done - self.first_token) / max(1, self.output - 1)


@dataclass
class SimInstance:
    iid: str
    model: str
    workers: tuple[str, ...]
    kind: str  # local | pipeline
    life: lc.Lifecycle
    compute_from: float = float("inf")  # its first iteration cannot start before (every block in)
    # a serve-while-loading instance's blocks' arrivals in engine memory and its engine's
    # construction: its first prefill runs each block as it lands (Engine.prefill_ahead)
    blocks_at: tuple[float, ...] = ()
    built_at: float = 0.0
    ahead_from: float | None = None  # the prefill step in progress runs ahead of the load, from then
    ahead_groups: list = field(default_factory=list)  # its passes (libs.planning.ahead): indices into step_rows
    ahead_left: dict = field(default_factory=dict)  # rid -> the share of its prefill left once every block is in
    ahead_first: frozenset = frozenset()  # the rows (ids) the first step after the load finishes
    prefilling: deque = field(default_factory=deque)  # requests waiting for / in their prefill
    decoding: dict = field(default_factory=dict)  # rid -> Request
    busy_until: float = 0.0  # the prefill step in progress ends
    front_until: float = 0.0  # the head's first blocks run on a live pair's target until then
    last: float = 0.0  # decoding advanced up to here
    version: int = 0
    step_rows: tuple = ()  # (request, tokens) prefilled by the step in progress
    step_decodes: tuple = ()  # requests that decode a token in it

    @property
    def load(self) -> int:
        return len(self.prefilling) + len(self.decoding)


@dataclass
class RunResult:
    mode: str
    requests: list[Request]
    instance_series: list[tuple[float, int]]  # (t, local instances loading/ready/draining) at each change
    scale_ops: list[dict]  # closed scale-ups: decided, first_ready, done, targets, algorithm
    events: int
    end: float
    notes: list[str]
    # live pairs formed / refused, and each paired prefill's blocks run on the target (BlitzScale §5.2)
    pairs: dict = field(default_factory=dict)
    evicted: int = 0  # sharing=dedicated: instances unloaded for another model's load
    # the parameter pool's fills (the planner's check_pool): model, worker, sent_s, done_s, from_peers
    pool_fills: list[dict] = field(default_factory=list)


class Simulation:
    def __init__(self, cfg: FleetConfig, profile: SimProfile, requests: Sequence[tuple[float, int, int]],
                 *, decide_fn: Callable | None = None):
        self.cfg, self.p = cfg, profile
        self.q = EventQueue()
        self.rng = random.Random(cfg.seed)
        self.decide = decide_fn or decide
        self.ctl = Control(profile.nats_hop_s, profile.registry_read_s)
        self.storage = Storage(profile.disk_gbytes_per_s * 1e9, profile.disk_read_latency_s,
                               profile.h2d_gbytes_per_s * 1e9, profile.h2d_latency_s)
        self.compute = Compute(profile.compute, profile.pipeline_hop_s, profile.token_overhead_s)
        self.route_key = sharing_setting(cfg.sharing).route_key
        self.notes: list[str] = []
        # --- the cluster: workers, models, the registry's replicas and instances
        ids = [f"w{i:04d}" for i in range(cfg.nodes)]
        leaf = {w: f"leaf-{i * cfg.leaves // cfg.nodes}" for i, w in enumerate(ids)}
        group = {w: (f"g{i // cfg.scaleup_group}" if cfg.scaleup_group > 1 else "") for i, w in enumerate(ids)}
        self.fabric = Fabric(profile.link_gbps, leaf, group, cfg.uplink_gbps, profile.scaleup_gbps)
        self.workers = {w: m.WorkerInfo.model_construct(
            worker_id=w, data_address=f"{w}:0", state="alive", last_heartbeat=0.0,
            topology=m.Topology.model_construct(host=w, leaf=leaf[w], scaleup_group=group[w],
                                                link_gbps=profile.link_gbps),
            capacities={HOST: 1 << 50, GPU: 1 << 50},
            bandwidths_gbps={"network_to_host": profile.link_gbps / 8, "host_to_device": profile.h2d_gbytes_per_s,
                             "ssd_to_host": profile.disk_gbytes_per_s}) for w in ids}
        nb = profile.n_blocks
        sizes = [profile.model_bytes // nb + (1 if i < profile.model_bytes % nb else 0) for i in range(nb)]
        self.block_bytes = sizes
        # the share of the model's bytes in blocks before each block (and in all: 1.0)
        self.block_cum = [sum(sizes[:k]) / sum(sizes) for k in range(nb + 1)]
        max_inst = cfg.max_instances or cfg.nodes
        self.models: dict[str, m.ModelInfo] = {}
        n_req = max(1, len(requests))
        mean_prompt = sum(p for _, p, _ in requests) / n_req if requests else 512.0
        mean_output = sum(o for _, _, o in requests) / n_req if requests else 128.0
        for k in range(cfg.models):
            name = f"model-{k}"
            policy, params = autoscale_policy(cfg, profiled_capacity_tps(profile, mean_prompt, max(1.0, mean_output)))
            self.models[name] = m.ModelInfo.model_construct(
                name=name, path=f"/models/{name}", arch="sim", n_layers=nb, state=m.ModelState.deployed,
                created_at=0.0, min_instances=cfg.min_instances, max_instances=max_inst,
                keep_alive_s=cfg.keep_alive_s, max_queue=cfg.max_queue, scaling_mode=cfg.mode, policy=policy,
                policy_params=params, ttft_slo_s=cfg.slo_ttft_s, tpot_slo_s=cfg.slo_tpot_s,
                blocks=[m.BlockInfo.model_construct(block_id=i, nbytes=s, checksum="", layer_start=i, layer_end=i + 1)
                        for i, s in enumerate(sizes)], version=1)
        self.replicas: dict[tuple[str, str, int, str], m.ReplicaInfo] = {}
        self.registry: dict[str, m.InstanceInfo] = {}  # instance id -> as the registry has it
        self.insts: dict[str, SimInstance] = {}  # what runs on the workers
        self.ops: dict[str, so.ScaleOp] = {}
        self.transfers: dict[str, dict[str, list[float]]] = {}
        self._view: m.ClusterView | None = None
        self._ids = 0
        # indexes (the simulator's bookkeeping, kept in step with registry and insts)
        self.live_states: dict[str, dict[str, m.InstanceState]] = defaultdict(dict)  # model -> iid -> state
        self.n_local = 0
        self.ended: set[str] = set()
        self.by_model: dict[str, dict[str, SimInstance]] = defaultdict(dict)
        self.on_worker: dict[str, dict[str, SimInstance]] = defaultdict(dict)
        self.running: dict[str, int] = defaultdict(int)
        self._forced = False
        self._ended_requests = 0
        # live pairs: source instance -> (target instance, its splitter); request -> blocks run on a target
        self.pairs: dict[str, tuple[str, PrefillSplitter]] = {}
        self.fronted: dict[str, int] = {}
        self.pair_stats = {"formed": 0, "refused": 0, "splits": [], "splits_by_pair": defaultdict(list)}
        # sharing=dedicated: loads waiting on a worker for another model's instances to stop
        self.dedicated = sharing_setting(cfg.sharing).one_model_per_worker
        self.room_wait: dict[str, list[tuple[str, str, m.LoadModel]]] = defaultdict(list)
        self.evicted = 0
        self.reported: dict[str, tuple[float, float]] = {}  # model -> (the gateway's last report, its load_tps)
        self.monitor_until = float("inf")  # the load-monitor decides until then
        # The planner reconciles one request per model at a time (its per-model lock): a request
        # waits while the previous one's operation is still creating its instances in the registry.
        self.locked: dict[str, str | None] = {}  # model -> the op holding the lock
        self.waiting: dict[str, deque] = defaultdict(deque)
        # --- the parameter pool at deploy time: one host copy (every worker's for `ideal`)
        spec = mode_spec(cfg.mode)
        self.threshold_models = {n for n, x in self.models.items() if x.policy == "threshold"}
        for k, name in enumerate(self.models):
            holders = ids if spec.pool_on_every_worker else [ids[k % cfg.nodes]] if spec.keeps_pool else []
            for w in holders:
                for b in range(nb):
                    self._replica(name, w, b, HOST, True)
        # --- the gateway and the load-monitor
        self.queue: dict[str, deque[Request]] = {name: deque() for name in self.models}
        self.requests: list[Request] = []
        names = list(self.models)
        for i, (t, prompt, output) in enumerate(requests):
            r = Request(f"r{i}", names[self.rng.randrange(len(names))] if len(names) > 1 else names[0], t,
                        max(1, prompt), max(1, output))
            self.requests.append(r)
            self.q.at(t + profile.request_overhead_s, self._arrive, r)  # r.arrive stays t: its TTFT counts it
        self.autoscale = autoscale.AutoscaleState(autoscale.AutoscaleConfig(
            window_s=cfg.window_s, scale_down_delay_s=cfg.scale_down_delay_s, resend_s=cfg.resend_s,
            defaults={"concurrency": {"target": cfg.target_concurrency}}))
        self.latencies: dict[str, tuple[list[float], list[float]]] = defaultdict(lambda: ([], []))
        self.tokens_since: dict[str, float] = defaultdict(float)
        self.last_request: dict[str, float] = {}
        self.series: list[tuple[float, int]] = [(0.0, 0)]
        self.closed_ops: list[dict] = []
        # The planner's parameter-pool check (services/planner/service.py check_pool), every pool_check_s.
        self.pool_sent: so.PoolFills = {}
        self.pool_fills: list[dict] = []
        self.next_pool_check = 0.0
        self.last_arrival = max((t for t, _, _ in requests), default=0.0)
        self.q.at(0.0, self._tick)
        if cfg.min_instances:
            self.q.at(0.0, self._force_tick)

    # ------------------------------------------------------------------ registry
    def _new_id(self, prefix: str) -> str:
        self._ids += 1
        return f"{prefix}-{self._ids:06d}"

    def _replica(self, model: str, worker: str, block: int, tier: m.Tier, present: bool) -> None:
        key = (model, worker, block, tier.value)
        if present:
            if key not in self.replicas:
                self.replicas[key] = m.ReplicaInfo.model_construct(model=model, block_id=block, worker_id=worker,
                                                                   tier=tier, state=READY)
                self._view = None
        elif self.replicas.pop(key, None) is not None:
            self._view = None

    def _holds_host(self, model: str, worker: str) -> list[bool]:
        return [(model, worker, b, "host") in self.replicas for b in range(self.p.n_blocks)]

    def _set_instance(self, info: m.InstanceInfo) -> None:
        iid = info.instance_id
        if iid in self.ended:
            return  # a late event of an instance that ended (the services drop them alike: EndedInstances)
        prev = self.registry.get(iid)
        self.registry[iid] = info
        self._view = None
        if info.mode == "local":
            alive = (m.InstanceState.loading, m.InstanceState.ready, m.InstanceState.draining)
            self.n_local += (info.state in alive) - (prev is not None and prev.state in alive)
            if self.n_local != self.series[-1][1]:
                self.series.append((self.q.now, self.n_local))
            if info.state in (m.InstanceState.loading, m.InstanceState.ready):
                self.live_states[info.model][iid] = info.state
            else:
                self.live_states[info.model].pop(iid, None)
        if info.state in (m.InstanceState.stopped, m.InstanceState.failed):
            self.registry.pop(iid, None)
            self.ended.add(iid)

    def _add_inst(self, inst: SimInstance) -> None:
        self.insts[inst.iid] = inst
        self.by_model[inst.model][inst.iid] = inst
        self.on_worker[inst.workers[0]][inst.iid] = inst

    def _drop_inst(self, inst: SimInstance) -> None:
        self.insts.pop(inst.iid, None)
        self.by_model[inst.model].pop(inst.iid, None)
        self.on_worker[inst.workers[0]].pop(inst.iid, None)

    def view(self) -> m.ClusterView:
        if self._view is None:
            self._view = m.ClusterView.model_construct(
                workers=list(self.workers.values()), models=list(self.models.values()),
                replicas=list(self.replicas.values()), instances=list(self.registry.values()), scale_ops=[],
                live_pairs=[], epoch="sim", changes=0, version=1)
        pairs = so.open_live_pairs(self.ops.values())
        return self._view.model_copy(update={"live_pairs": pairs}) if pairs else self._view

    def _load_by_worker(self) -> dict[str, int]:
        out: dict[str, int] = defaultdict(int)
        for w, insts in self.on_worker.items():
            for i in insts.values():
                out[w] += i.load
        return out

    # ------------------------------------------------------------------ gateway
    def _arrive(self, r: Request) -> None:
        self.last_request[r.model] = self.q.now
        if len(self.queue[r.model]) >= self.cfg.max_queue:
            r.lost = "queue full (429)"
            self._ended_requests += 1
            return
        self.queue[r.model].append(r)
        self._dispatch(r.model)
        if self.queue[r.model] and not self._forced and not any(i.life.serving
                                                                for i in self.by_model[r.model].values()):
            self._forced = True  # demand for a cold model: the monitor acts now (once per gateway report)
            self.q.after(self.ctl.nats_hop_s, self._force_tick)

    def _routes(self, model: str) -> list[SimInstance]:
        free = [i for i in self.by_model[model].values() if i.life.serving and i.load < self.p.max_batch]
        # loading ones last, then the sharing setting's order (libs.planning.sharing)
        return sorted(free, key=lambda i: (i.life.phase is lc.Phase.serving_while_loading,
                                           self.route_key("cuda", i.load, i.iid)))

    def _dispatch(self, model: str) -> None:
        q = self.queue[model]
        while q:
            routes = self._routes(model)
            if not routes:
                return
            inst = routes[0]
            r = q[0]
            inst.life, effects = lc.step(inst.life, lc.RequestAdmitted(r.rid))
            if any(isinstance(e, lc.Refuse) for e in effects):
                return
            q.popleft()
            self._start_request(inst, r)

    # ------------------------------------------------------------------ serving (fluid batches)
    def _sharing(self, inst: SimInstance) -> int:
        w = inst.workers[0]
        return sum(1 for i in self.on_worker[w].values() if i.load > 0) or 1

    def _iter_s(self, inst: SimInstance) -> float:
        n = len(inst.decoding)
        if not n:
            return 0.0
        mean = sum(r.prompt + r.generated for r in inst.decoding.values()) / n
        return self.compute.iteration_s(n, mean, len(inst.workers), self._sharing(inst))

    def _advance(self, inst: SimInstance) -> None:
        """Decode from inst.last to now, except while a prefill runs or before the blocks are in."""
        now = self.q.now
        begin = max(inst.last, inst.busy_until, inst.compute_from)
        if inst.decoding and now > begin:
            it = self._iter_s(inst)
            steps = (now - begin) / it if it > 0 else float("inf")
            for r in inst.decoding.values():
                done = min(steps, r.left)
                r.left -= done
                r.generated += done
                self.tokens_since[inst.model] += done
        inst.last = max(inst.last, now)

    def _start_request(self, inst: SimInstance, r: Request) -> None:
        self._advance(inst)
        r.instance = inst.iid
        self.running[r.model] += 1
        inst.prefilling.append(r)
        self._schedule(inst)

    def _schedule(self, inst: SimInstance) -> None:
        """Start the next prefill step if none runs; plan the next decode event.

        A step with prompts waiting is the engine's (libs/engine/engine.py `step`,
        `_prefill_passes`): one decode pass over the running rows, then one batched prefill pass
        over the waiting prompts within the token budget, each taking the next `n` tokens, `n`
        the shortest remainder (at most the prefill chunk): prompts finished by it give their
        first token at the step's end, longer ones go on in the next step. The pass reads every
        weight once, so it costs the profile's prefill time of its tokens (rows x n); the decode
        pass an iteration of the running batch."""
        inst.version += 1
        now = self.q.now
        if inst.prefilling and inst.front_until > now + EPS:
            # the head's first blocks run on the live pair's target: the source decodes meanwhile
            self.q.at(inst.front_until, self._front_done, inst.iid, inst.version)
        elif inst.prefilling and inst.busy_until <= now + EPS and inst.compute_from < float("inf"):
            start = max(now, inst.compute_from)
            r = inst.prefilling[0]
            front = self._pair_front(inst, r, r.recompute or r.prompt) if self.pairs else None
            if front is not None:
                inst.front_until = start + front
                self.q.at(inst.front_until, self._front_done, inst.iid, inst.version)
            else:
                self._advance(inst)
                waiting = list(inst.prefilling)
                budget = ENGINE_TOKEN_BUDGET - len(inst.decoding)
                ahead = bool(inst.blocks_at) and now < inst.compute_from and not inst.decoding
                n = max(1, min(ENGINE_PREFILL_CHUNK, *(self._pending(r) for r in waiting)))
                rows = waiting[:max(1, budget // n)]
                n = max(1, min(n, budget))
                decodes = tuple(r for r in inst.decoding.values() if r.left > 1e-6)
                # ahead of the load: every waiting prompt whole (Engine.prefill_ahead's passes)
                step_rows = self._ahead_rows(waiting, ()) if ahead else tuple((r, n) for r in rows)
                # a row whose first blocks ran on a live pair's target costs only its other blocks here
                tokens = sum(k * self._own_share(r) for r, k in step_rows)
                took = self.compute.prefill_s(max(1, round(tokens)), len(inst.workers), self._sharing(inst))
                if decodes:
                    took += self._iter_s(inst)
                inst.step_rows = step_rows
                inst.step_decodes = decodes
                inst.busy_until = start + took
                if ahead:
                    inst.ahead_from = now
                    inst.ahead_groups = self._ahead_groups(step_rows, 0)
                    inst.busy_until = self._ahead_done(inst, now, took)
                self.q.at(inst.busy_until, self._prefilled, inst.iid, inst.version)
                return
        elif inst.prefilling and inst.busy_until > now + EPS:
            if inst.ahead_from is not None and now < inst.compute_from:  # once all is in, it waits its turn
                self._join_ahead(inst)
            self.q.at(inst.busy_until, self._prefilled, inst.iid, inst.version)
            return
        if inst.decoding:
            it = self._iter_s(inst)
            left = min(r.left for r in inst.decoding.values())
            begin = max(now, inst.busy_until, inst.compute_from)
            self.q.at(begin + max(0.0, left) * it, self._decoded, inst.iid, inst.version)

    def _join_ahead(self, inst: SimInstance) -> None:
        """Requests that reach an instance whose prefill runs ahead of its load catch up through
        the blocks landed (in a pass of their own, Engine.prefill_ahead): the step takes their
        prompts too, its compute spread over the same block arrivals."""
        stepping = {r.rid for r, _ in inst.step_rows}
        new = [r for r in inst.prefilling if r.rid not in stepping]
        if not new:
            return
        joined = self._ahead_rows(new, inst.step_rows)
        inst.ahead_groups = inst.ahead_groups + self._ahead_groups(joined, len(inst.step_rows))
        inst.step_rows += joined
        tokens = sum(n * self._own_share(r) for r, n in inst.step_rows)
        took = self.compute.prefill_s(max(1, round(tokens)), len(inst.workers), self._sharing(inst))
        inst.busy_until = self._ahead_done(inst, inst.ahead_from, took)

    def _ahead_rows(self, waiting: Sequence[Request], taken: Sequence[tuple[Request, int]]
                    ) -> tuple[tuple[Request, int], ...]:
        """The prompts a step ahead of the load takes whole, in order while they fit the engine's
        limit beside those it took already (a first one always does): libs.planning.ahead."""
        pending = [self._pending(r) for r in waiting]
        room = AHEAD_TOKEN_LIMIT - sum(n for _, n in taken)
        passes = ahead_passes(pending, room, ENGINE_TOKEN_BUDGET, first_fits=not taken)
        return tuple((waiting[i], pending[i]) for i in sorted(i for p in passes for i in p))

    @staticmethod
    def _ahead_groups(rows: Sequence[tuple[Request, int]], offset: int) -> list[list[int]]:
        """The engine's passes over `rows` (a pass per length, at most a step's budget), as
        indices into the step's rows, which hold `offset` rows before these."""
        passes = ahead_passes([n for _, n in rows], float("inf"), ENGINE_TOKEN_BUDGET, first_fits=True)
        return [[offset + i for i in p] for p in passes]

    def _ahead_done(self, inst: SimInstance, start: float, took: float) -> float:
        """When the first step after the load ends, for a prefill that runs ahead of it
        (Engine.prefill_ahead): one pass at a time, the first admitted that is behind, runs
        through every block but the last that has landed in engine memory (once the engine is
        built), a block's share of the pass's compute by its bytes, until every block is in; then
        the step finishes the passes that fit its budget through their remaining blocks
        (libs.planning.ahead), their rows' first tokens at its end. The other rows go on in the
        steps after with the rest of their prefill (`_prefilled`); `took` is the whole step's
        compute, each pass's share by its tokens."""
        nb, cum = len(self.block_bytes), self.block_cum
        tokens = [sum(inst.step_rows[i][1] for i in g) for g in inst.ahead_groups]
        whole = max(1, sum(tokens))
        compute = [took * n / whole for n in tokens]
        done = [0] * len(tokens)  # blocks each pass has run
        t = max(start, inst.built_at)
        while t < inst.compute_from - EPS:
            landed = next((k for k, at in enumerate(inst.blocks_at[:nb - 1]) if at > t + EPS), nb - 1)
            g = next((g for g, d in enumerate(done) if d < landed), None)
            if g is None:  # every pass is through what has landed: the next block, or the load's end
                t = inst.blocks_at[landed] if landed < nb - 1 else inst.compute_from
                continue
            t += compute[g] * (cum[landed] - cum[done[g]])
            done[g] = landed
        t = max(t, inst.compute_from)
        left = [1.0 - cum[d] for d in done]
        k = passes_to_finish(tokens, left, ENGINE_TOKEN_BUDGET)
        inst.ahead_left = {inst.step_rows[i][0].rid: f for g, f in zip(inst.ahead_groups, left) for i in g}
        inst.ahead_first = frozenset(inst.step_rows[i][0].rid for g in inst.ahead_groups[:k] for i in g)
        return t + sum(c * f for c, f in zip(compute[:k], left[:k]))

    def _own_share(self, r: Request) -> float:
        """The share of `r`'s prefill this instance runs: all of it, less the blocks a live pair's
        target ran for it (_pair_front)."""
        return 1.0 - self.fronted.get(r.rid, 0) / self.p.n_blocks if self.fronted else 1.0

    def _pending(self, r: Request) -> int:
        """Prompt tokens still to prefill (a handed-over request rebuilds its KV: prompt + tokens so far)."""
        return max(1, (r.recompute or r.prompt) - r.prefilled)

    def _prefilled(self, iid: str, version: int) -> None:
        inst = self.insts.get(iid)
        if inst is None or version != inst.version:
            return
        now = self.q.now
        if inst.step_rows and inst.busy_until <= now + EPS:
            self._advance(inst)
            for r in inst.step_decodes:  # the step's decode pass: one token each
                if inst.decoding.get(r.rid) is r and r.left > 1e-6:
                    step = min(1.0, r.left)
                    r.left -= step
                    r.generated += step
                    self.tokens_since[r.model] += step
            rows, inst.step_rows, inst.step_decodes = inst.step_rows, (), ()
            # a step ahead of the load: the rows it did not finish ran all but `ahead_left` of theirs
            ahead, left, first_rows = inst.ahead_from is not None, inst.ahead_left, inst.ahead_first
            inst.ahead_from, inst.ahead_groups, inst.ahead_left, inst.ahead_first = None, [], {}, frozenset()
            for r, n in rows:
                if r.instance != inst.iid or r not in inst.prefilling:
                    continue
                r.prefilled += n if not ahead or r.rid in first_rows else int(n * (1.0 - left.get(r.rid, 1.0)))
                if r.prefilled >= (r.recompute or r.prompt):
                    inst.prefilling.remove(r)
                    self.fronted.pop(r.rid, None)
                    if r.first_token is None:
                        r.first_token = now
                        self.latencies[r.model][0].append(now - r.arrive)
                        r.left, r.generated = r.output - 1, 1
                    r.recompute = r.prefilled = 0
                    self.tokens_since[r.model] += 1
                    inst.decoding[r.rid] = r
            self._finish_done(inst)
        self._schedule(inst)

    def _decoded(self, iid: str, version: int) -> None:
        inst = self.insts.get(iid)
        if inst is None or version != inst.version:
            return
        self._advance(inst)
        self._finish_done(inst)
        self._schedule(inst)

    def _finish_done(self, inst: SimInstance) -> None:
        done = [r for r in inst.decoding.values() if r.left <= 1e-6]
        for r in done:
            del inst.decoding[r.rid]
            self.running[r.model] -= 1
            self._ended_requests += 1
            r.done = self.q.now
            if r.tpot is not None:
                self.latencies[r.model][1].append(r.tpot)
            inst.life, effects = lc.step(inst.life, lc.RequestEnded(r.rid))
            self._worker_effects(inst, effects)
        if done:
            self._dispatch(inst.model)

    # ------------------------------------------------------------------ load-monitor
    def _observation(self, now: float) -> autoscale.Observation:
        obs = {}
        for name, model in self.models.items():
            if name in self.threshold_models:
                # the tokens streamed up to now (a worker reports what it generated each interval): without
                # this the fluid batches' tokens arrive in lumps at their events, and the threshold
                # policy, which reads load_tps, sees ticks of zero load between them and flaps
                for inst in self.by_model[name].values():
                    self._advance(inst)
            states = list(self.live_states[name].values())
            running = self.running[name]
            queued = self.queue[name]
            ttft, tpot = self.latencies.pop(name, ([], []))
            load_tps = self._load_tps(name, now)
            last = (self.last_request[name],) if name in self.last_request else ()
            obs[name] = autoscale.model_observation(model, now, states, len(queued) + running, load_tps, ttft, tpot,
                                                    last)
        return autoscale.Observation(obs)

    def _load_tps(self, name: str, now: float) -> float:
        """Demand in tokens/s as the load-monitor sees it (libs.planning.demand): the gateway's latest
        report, every report_interval_s (its metrics_interval_s), holds the completion tokens streamed
        over that interval / the interval plus the queued requests' output tokens / drain_s (1 s)."""
        last = self.reported.get(name)
        if last is None or now - last[0] >= self.cfg.report_interval_s - EPS:
            interval = self.cfg.tick_s if last is None else now - last[0]
            load = self.tokens_since.pop(name, 0.0) / interval + sum(r.output for r in self.queue[name])
            last = self.reported[name] = (now, load)
        return last[1]

    def _tick(self) -> None:
        self._monitor()
        if self.q.now >= self.next_pool_check:
            self.next_pool_check = self.q.now + so.Timers().pool_check_s
            self._check_pool()
        if self.q.now < self.last_arrival + self.cfg.horizon_after_s and not self._over():
            self.q.after(self.cfg.tick_s, self._tick)

    def _over(self) -> bool:
        """Nothing can happen any more: every request arrived and ended, no instance or operation is left."""
        return (self.q.now > self.last_arrival and self._ended_requests == len(self.requests)
                and not self.registry and not self.insts and not self.ops)

    def _force_tick(self) -> None:
        self._forced = False
        self._monitor()

    def _monitor(self) -> None:
        now = self.q.now
        if now >= self.monitor_until:
            return  # kept out (a controlled scale-out, as `bench scale` runs it: `force_scale`)
        self.autoscale, decisions = autoscale.step(self.autoscale, self._observation(now), now)
        for d in decisions:
            req = m.ScaleRequest.model_construct(model=d.model, desired_instances=d.desired, reason=d.reason,
                                                 sent_at=now, version=1)
            self.q.after(self.ctl.nats_hop_s + self.ctl.registry_read_s, self._reconcile, req)

    # ------------------------------------------------------------------ the parameter pool
    def _check_pool(self) -> None:
        """The planner's check_pool: the fills that keep each model's complete host copy off the
        workers serving it (libs.planning.pool), admitted as the planner admits them."""
        open_models = {op.info.model for op in self.ops.values() if not op.ended}
        for model, fill in plan_pool_fills(self.view(), open_models):
            self.pool_sent, send = so.admit_pool_fill(self.pool_sent, model.name, fill.worker, open_models,
                                                      self.q.now)
            if send:
                self._fill(model.name, fill.worker, fill.from_peers, fill.from_disk)

    def _fill(self, model: str, worker: str, from_peers: dict[int, str], from_disk: tuple[int, ...]) -> None:
        """A pool fill's blocks land in `worker`'s host tier: each peer sends its blocks one after
        another over the fabric (one TransferPart per peer), the rest come from the worker's disk."""
        start = self.q.now + self.ctl.call_s
        done = start
        by_peer: dict[str, list[int]] = defaultdict(list)
        for b, peer in sorted(from_peers.items()):
            by_peer[peer].append(b)
        for peer, blocks in by_peer.items():
            t, rate = start, self.fabric.rate_Bps(peer, worker)
            for b in blocks:
                t += self.block_bytes[b] / rate + self.p.step_overhead_s
                self.q.at(t, self._replica, model, worker, b, HOST, True)
            done = max(done, t)
        for b, t in zip(from_disk, self.storage.disk_reads([self.block_bytes[b] for b in from_disk], start)):
            self.q.at(t, self._replica, model, worker, b, HOST, True)
            done = max(done, t)
        self.pool_fills.append({"model": model, "worker": worker, "sent_s": self.q.now, "done_s": done,
                                "from_peers": len(from_peers)})

    # ------------------------------------------------------------------ planner
    def _reconcile(self, req: m.ScaleRequest) -> None:
        if self.locked.get(req.model):
            self.waiting[req.model].append(req)
            return
        now = self.q.now
        view = self.view()
        decision = self.decide(view, req, self._load_by_worker(), dedicated=self.dedicated,
                               host_keep_alive_s=self.cfg.serverlessllm_keep_alive_s)
        if isinstance(decision, ScalePlan):
            if not decision.loads:
                return
            info = m.ScaleOpInfo(scale_op_id=self._new_id("op"), model=decision.model.name, direction="up",
                                 reason=req.reason, from_instances=decision.from_instances,
                                 to_instances=decision.to_instances, state="running",
                                 timings={"decided": req.sent_at, "planned": now}, plan=decision.record())
            ids = {t.worker_id: self._new_id("inst") for t in decision.loads}
            op, effects = so.open_scale_up(info, decision, ids, {w: f"{w}:0" for w in self.workers}, now)
        elif isinstance(decision, ScaleIn):
            info = m.ScaleOpInfo(scale_op_id=self._new_id("op"), model=decision.model, direction="down",
                                 reason=req.reason, from_instances=decision.from_instances,
                                 to_instances=decision.desired, state="running",
                                 timings={"decided": req.sent_at, "planned": now}, plan=decision.record())
            op, effects = so.open_scale_down(info, decision, self.cfg.drain_timeout_s, req.reason, now)
        else:
            return
        self.ops[op.op_id] = op
        self.locked[req.model] = op.op_id
        self._op_effects(op.op_id, effects)
        self._view = None
        self.q.after(so.Timers().tick_s, self._op_tick, op.op_id)
        self._unlock_when_created(op.op_id)

    def _unlock_when_created(self, op_id: str) -> None:
        """The planner's reconcile ends once its operation's instances are in the registry (every
        target created, or the operation over): the next request for the model goes then."""
        op = self.ops.get(op_id)
        model = op.info.model if op is not None else None
        if op is not None and not op.ended and any(t.state == "creating" for t in op.targets.values()):
            return
        for name, holder in list(self.locked.items()):
            if holder == op_id:
                model = name
                self.locked[name] = None
        if model is not None and self.waiting[model]:
            self.q.at(self.q.now, self._reconcile, self.waiting[model].popleft())

    def _op_event(self, op_id: str, event: object) -> None:
        op = self.ops.get(op_id)
        if op is None:
            return
        op, effects = so.step(op, event, self.q.now)
        self.ops[op_id] = op
        self._op_effects(op_id, effects)
        if op.settled:
            self.ops.pop(op_id, None)
        if self.locked.get(op.info.model) == op_id:
            self._unlock_when_created(op_id)

    def _op_tick(self, op_id: str) -> None:
        if op_id in self.ops:
            self._op_event(op_id, so.Tick())
            self.q.after(so.Timers().tick_s, self._op_tick, op_id)

    def _to_op(self, op_id: str | None, event: object, delay: float | None = None) -> None:
        if op_id is not None:
            self.q.after(self.ctl.nats_hop_s if delay is None else delay, self._op_event, op_id, event)

    def _op_effects(self, op_id: str, effects: list) -> None:
        hop, call = self.ctl.nats_hop_s, self.ctl.call_s
        for e in effects:
            if isinstance(e, so.SendParts):
                nodes = e.scale.nodes()
                self.transfers[e.transfer_id] = multicast_arrivals(
                    e.scale.multicast, nodes, self.block_bytes, self.fabric, self.q.now + call,
                    step_overhead_s=self.p.step_overhead_s, chunk_bytes=self.p.chunk_bytes)
                self._to_op(op_id, so.PartsAnswered(tuple(nodes)), call)
            elif isinstance(e, so.CreateInstance):
                info = m.InstanceInfo.model_construct(
                    instance_id=e.load.instance_id, model=e.load.model, mode="local", state=m.InstanceState.loading,
                    created_at=self.q.now, stages=[m.Stage.model_construct(worker_id=e.worker_id, block_start=0,
                                                                           block_end=self.p.n_blocks)],
                    scale_op_id=e.load.scale_op_id, ready_at=None, loaded_at=None, max_batch=self.p.max_batch,
                    device="cuda", version=1)
                self._set_instance(info)  # the planner awaits the registry's create (its lock holds meanwhile)
                self._to_op(op_id, so.InstanceCreated(e.load.instance_id), call)
            elif isinstance(e, so.SendLoad):
                self.q.after(hop, self._worker_load, op_id, e.worker_id, e.load)
            elif isinstance(e, so.Announce):
                self.q.after(hop, self._announced, e.instance)
            elif isinstance(e, so.FormPipeline):
                self.q.after(hop, self._set_instance, e.instance)
                self._to_op(op_id, so.PipelineRegistered(e.instance.instance_id), call)
            elif isinstance(e, so.StartPipeline):
                self.q.after(call, self._start_pipeline, op_id, e.workers, e.start)
            elif isinstance(e, so.SwitchPipeline):
                self.q.after(hop, self._unload, op_id, e.unload, True)
            elif isinstance(e, so.Drain):
                self.q.after(hop, self._unload, op_id, e.unload, False)
            elif isinstance(e, so.FormPair):
                self.q.after(hop, self._form_pair, op_id, e.form)
            elif isinstance(e, so.CheckInstances):
                for iid in e.instance_ids:
                    if iid in self.registry:
                        self._to_op(op_id, so.InstanceReported(self.registry[iid]), self.ctl.registry_read_s)
            elif isinstance(e, so.Ended):
                self._closed(e.info)
            # Record, Trace, Log, UnloadStages (a stage only hosts blocks), CancelParts: nothing to time

    def _closed(self, info: m.ScaleOpInfo) -> None:
        if info.direction != "up":
            return
        t = info.timings
        ready = [v for k, v in t.items() if k.startswith(("ready:", "pipeline_ready:"))]
        loaded = [v for k, v in t.items() if k.startswith("loaded:")]
        self.closed_ops.append({
            "op": info.scale_op_id, "model": info.model, "algorithm": info.plan.get("algorithm", info.plan.get("kind")),
            "targets": info.to_instances - info.from_instances, "decided": t["decided"],
            "first_capacity_s": (min(ready) - t["decided"]) if ready else None,
            "first_loaded_s": (min(loaded) - t["decided"]) if loaded else None,
            "last_loaded_s": (max(loaded) - t["decided"]) if loaded else None,
            "done_s": t["done"] - t["decided"],
            "pipelines": sum(1 for k in t if k.startswith("pipeline_ready:"))})

    def _announced(self, info: m.InstanceInfo) -> None:
        self._set_instance(info)

    # ------------------------------------------------------------------ live pairs (BlitzScale §5.2)
    def _form_pair(self, op_id: str, form: m.FormLivePair) -> None:
        """Both workers get the FormLivePair, the target first (services/worker/livepairs.py): each
        lifecycle decides whether it can pair; the source splits its prefills from then on."""
        error: str | None = None
        formed: list[SimInstance] = []
        if self.p.n_blocks < 2:
            error = "a live pair needs a model of at least 2 blocks"
        for role, iid, peer in (("target", form.target_instance, f"{form.source_worker}/{form.source_instance}"),
                                ("source", form.source_instance, f"{form.target_worker}/{form.target_instance}")):
            inst = self.insts.get(iid)
            if error is not None:
                break
            if inst is None:
                error = f"instance {iid} is not here"
                break
            self._advance(inst)
            inst.life, effects = lc.step(inst.life, lc.PairFormed(role, peer))
            refused = [e for e in effects if isinstance(e, lc.Refuse)]
            if refused:
                error = refused[0].detail
                break
            formed.append(inst)
        if error is None:
            n = self.p.n_blocks
            cap = min(form.max_target_blocks or n // 2, n - 1)
            self.pairs[form.source_instance] = (form.target_instance, PrefillSplitter(n, cap=cap, policy=form.split))
            self.pair_stats["formed"] += 1
        else:
            self.pair_stats["refused"] += 1
            for inst in formed:  # the target's part was formed: it ends again
                inst.life, effects = lc.step(inst.life, lc.PairEnded(f"could not start: {error}"))
                self._worker_effects(inst, effects)
        self._to_op(op_id, so.PairAnswered(form.target_instance, error), self.ctl.call_s)

    def _pair_ended(self, iid: str, reason: str) -> None:
        inst = self.insts.get(iid)
        if inst is None:
            return
        self._advance(inst)
        inst.life, effects = lc.step(inst.life, lc.PairEnded(reason))
        self._worker_effects(inst, effects)
        self._dispatch(inst.model)  # a target that attached meanwhile takes requests
        self._schedule(inst)

    def _pair_front(self, inst: SimInstance, r: Request, tokens: int) -> float | None:
        """Seconds the head request's first blocks take on the live pair's target (the split is
        the PrefillSplitter's, over what the target holds now); None: no pair, or split already."""
        pair = self.pairs.get(inst.iid)
        if pair is None or r.rid in self.fronted:
            return None
        target = self.insts.get(pair[0])
        if target is None:
            return None
        splitter = pair[1]
        if splitter.fixed is None:
            splitter.held(leading_blocks(target.life.in_engine))
        k = splitter([r.rid])
        self.fronted[r.rid] = k
        self.pair_stats["splits"].append(k)
        self.pair_stats["splits_by_pair"][f"{inst.iid}->{pair[0]}"].append(k)
        if k <= 0:
            return None
        # the target's share of the prefill, then its hidden state and KV back (one call)
        return k / self.p.n_blocks * self.compute.prefill_s(tokens, 1, self._sharing(target)) + self.ctl.call_s

    def _front_done(self, iid: str, version: int) -> None:
        inst = self.insts.get(iid)
        if inst is None or version != inst.version:
            return
        self._advance(inst)
        self._schedule(inst)

    # ------------------------------------------------------------------ workers
    def _worker_load(self, op_id: str, worker: str, load: m.LoadModel) -> None:
        if self.dedicated and self._make_room(op_id, worker, load):
            return
        self._start_load(op_id, worker, load)

    def _make_room(self, op_id: str, worker: str, load: m.LoadModel) -> bool:
        """sharing=dedicated (DedicatedSharing.make_room): another model's instances on the worker
        are unloaded (drained) first; the load waits for them. True: it waits."""
        others = [i for i in self.on_worker[worker].values() if i.model != load.model]
        if not others and not self.room_wait.get(worker):
            return False
        self.room_wait[worker].append((op_id, worker, load))
        for inst in others:
            if inst.life.phase in lc.STOPPING or inst.life.phase in lc.ENDED:
                continue  # already on its way out
            self._advance(inst)
            self.evicted += 1
            inst.life, effects = lc.step(inst.life, lc.UnloadAsked(
                reason=f"unloaded for {load.model} (sharing=dedicated)", drain_timeout_s=EVICT_DRAIN_TIMEOUT_S))
            self._worker_effects(inst, effects)
        if not others:
            self._room_made(worker)
        return True

    def _room_made(self, worker: str) -> None:
        waiting = self.room_wait.get(worker, [])
        if not waiting or any(i.model != waiting[0][2].model for i in self.on_worker[worker].values()):
            return
        op_id, _, load = waiting.pop(0)
        self._start_load(op_id, worker, load)
        if waiting:  # the next one (another model's) unloads this one first
            nxt = waiting.pop(0)
            self._worker_load(*nxt)

    def _start_load(self, op_id: str, worker: str, load: m.LoadModel) -> None:
        now = self.q.now
        blocks = tuple(range(load.block_start, load.block_end))
        life, effects = lc.step(lc.Lifecycle(load.instance_id), lc.LoadAsked(blocks, load.serve_while_loading))
        inst = SimInstance(load.instance_id, load.model, (worker,), "local", life)
        self._add_inst(inst)
        self._to_op(op_id, so.LoadAnswered(load.instance_id))
        sizes = self.block_bytes
        # Every mode builds an engine (KV slots, the model's skeleton: services/worker/loading.py),
        # beside the blocks' load; `ideal` (preheld) only skips the blocks' copies.
        build = now + self.p.engine_build_s
        if load.preheld:
            engine = [now] * len(sizes)
        else:
            arrivals = self.transfers.get(load.incoming_transfer or "", {}).get(worker)
            held = self._holds_host(load.model, worker)
            if arrivals is not None:
                in_host = [now if h else a for h, a in zip(held, arrivals)]
            elif all(held):
                in_host = [now] * len(sizes)
            else:
                disk = self.storage.disk_reads([s for s, h in zip(sizes, held) if not h], now)
                it = iter(disk)
                in_host = [now if h else next(it) for h in held]
            for b, t in enumerate(in_host):
                self.q.at(t, self._replica, load.model, worker, b, HOST, True)
                # pinned while the instance uses it, as the worker's loader feeds it
                # (services/worker/loading.py): its teardown then releases the pins with the
                # scale-in's host keep-alive (serverlessllm's), after which the copy leaves
                self.q.at(t, self._worker_event, inst.iid, op_id, lc.BlockInHost(b))
            engine = self.storage.to_engine(in_host, sizes, now)
        inst.compute_from = max(max(engine), build)
        if load.serve_while_loading and self.cfg.prefill_ahead:
            inst.blocks_at, inst.built_at = tuple(engine), build
        self.q.at(build, self._worker_event, inst.iid, op_id, lc.EngineBuilt())
        for b, t in enumerate(engine):
            self.q.at(t, self._worker_event, inst.iid, op_id, lc.BlockInEngine(b))
        # the load task ends after its last block (and the engine's construction)
        self.q.at(inst.compute_from, self._worker_event, inst.iid, op_id, lc.LoadFinished())

    def _worker_event(self, iid: str, op_id: str, event: object) -> None:
        inst = self.insts.get(iid)
        if inst is None:
            return
        inst.life, effects = lc.step(inst.life, event)
        self._worker_effects(inst, effects, op_id)
        if isinstance(event, lc.BlockInEngine):
            self._replica(inst.model, inst.workers[0], event.block, GPU, True)
            op = self.ops.get(op_id)
            if op is not None and op.watch is not None and not op.watch.closed:
                ev = m.BlockEvent.model_construct(model=inst.model, block_id=event.block, worker_id=inst.workers[0],
                                                  tier=GPU, state=READY, nbytes=self.block_bytes[event.block],
                                                  seconds=0.0, scale_op_id=op_id, from_tier=HOST, version=1)
                self._to_op(op_id, so.BlockReported(ev))

    def _worker_effects(self, inst: SimInstance, effects: list, op_id: str | None = None) -> None:
        now = self.q.now
        op_id = op_id or self.registry.get(inst.iid, m.InstanceInfo.model_construct(scale_op_id=None)).scale_op_id
        for e in effects:
            if isinstance(e, lc.Attach):
                self._report(inst, op_id, m.InstanceState.ready, ready_at=now)
                self._dispatch(inst.model)
            elif isinstance(e, lc.ReportLoaded):
                self._report(inst, op_id, m.InstanceState.ready, loaded_at=now)
            elif isinstance(e, lc.Drain):
                if not inst.life.requests:
                    self.q.at(now, self._worker_event, inst.iid, op_id, lc.Drained())
                else:
                    self.q.after(e.timeout_s, self._worker_event, inst.iid, op_id, lc.Drained())
            elif isinstance(e, lc.EvictFromEngine):
                for b in e.blocks:
                    self._replica(inst.model, inst.workers[0], b, GPU, False)
            elif isinstance(e, lc.ReleasePins) and e.keep_alive_s is not None:
                self.q.after(e.keep_alive_s, self._expire_host, inst.model, inst.workers[0])
            elif isinstance(e, lc.Detach):
                self._hand_over(inst)
            elif isinstance(e, lc.EndLoad):
                # unloaded while loading: the load task stops at this step, and says so
                self.q.at(now, self._worker_event, inst.iid, op_id, lc.LoadFailed(e.reason))
            elif isinstance(e, lc.ReportStopped):
                self._drop_inst(inst)
                self._report(inst, op_id, m.InstanceState.failed if e.failed else m.InstanceState.stopped)
                if self.room_wait.get(inst.workers[0]):
                    self._room_made(inst.workers[0])
            elif isinstance(e, lc.EndPair):
                self.pairs.pop(inst.iid, None)  # a source runs every block itself again
                if e.notify_peer:  # this side ended it: the other side hears (EndLivePair)
                    self.q.after(self.ctl.call_s, self._pair_ended, e.peer.split("/", 1)[-1], e.reason)

    def _expire_host(self, model: str, worker: str) -> None:
        # the host cache's keep-alive ran out, unless an instance of the model runs there again
        if any(i.model == model and i.kind == "local" for i in self.on_worker[worker].values()):
            return
        for b in range(self.p.n_blocks):
            self._replica(model, worker, b, HOST, False)

    def _report(self, inst: SimInstance, op_id: str | None, state: m.InstanceState, **times: float) -> None:
        prev = self.registry.get(inst.iid)
        if prev is None:
            return
        info = prev.model_copy(update={"state": state, **times})
        self.q.after(self.ctl.nats_hop_s, self._set_instance, info)
        self._to_op(op_id, so.InstanceReported(info))

    def _start_pipeline(self, op_id: str, workers: tuple[str, ...], start: m.StartPipeline) -> None:
        life, _ = lc.step(lc.Lifecycle(start.instance_id), lc.PipelineStarted(entry=True))
        inst = SimInstance(start.instance_id, start.model, tuple(workers), "pipeline", life, compute_from=self.q.now)
        self._add_inst(inst)
        prev = self.registry.get(inst.iid)
        if prev is not None:
            self._set_instance(prev.model_copy(update={"state": m.InstanceState.ready, "ready_at": self.q.now}))
        self._to_op(op_id, so.PipelineStartAnswered(inst.iid))
        self._dispatch(inst.model)

    def _unload(self, op_id: str, unload: m.UnloadModel, switch: bool) -> None:
        inst = self.insts.get(unload.instance_id)
        if inst is None:
            self._to_op(op_id, (so.SwitchAnswered if switch else so.DrainAnswered)(unload.instance_id, lc.NOT_HERE))
            return
        self._advance(inst)
        inst.life, effects = lc.step(inst.life, lc.UnloadAsked(
            switched_to=tuple(unload.switched_to), drain_timeout_s=unload.drain_timeout_s,
            keep_alive_s=unload.host_keep_alive_s))
        if switch:
            # λScale §4.4: the entry finishes its step, its requests move to the local instances
            self._hand_over(inst)
            inst.life, more = lc.step(inst.life, lc.Drained())
            effects += more
        self._worker_effects(inst, effects, op_id)
        self._to_op(op_id, (so.SwitchAnswered if switch else so.DrainAnswered)(unload.instance_id))

    def _hand_over(self, inst: SimInstance) -> None:
        """Requests still on an instance that stops go back to the gateway's queue, first; they
        rebuild their KV (a prefill of prompt + tokens so far) where they land."""
        moved = [*inst.prefilling, *inst.decoding.values()]
        inst.prefilling.clear()
        inst.decoding.clear()
        inst.step_rows, inst.step_decodes = (), ()
        inst.version += 1
        inst.front_until = 0.0
        for r in moved:
            self.fronted.pop(r.rid, None)  # a front run for the old instance does not count where it lands
        for r in reversed(moved):
            self.running[r.model] -= 1
            r.prefilled = 0
            if r.first_token is not None:
                r.recompute = r.prompt + int(r.generated)
            inst.life, _ = lc.step(inst.life, lc.RequestEnded(r.rid))
            self.queue[r.model].appendleft(r)
        if moved:
            self.q.at(self.q.now, self._dispatch, inst.model)

    def force_scale(self, at: float, desired: int, model: str | None = None) -> None:
        """From `at` on, the load-monitor is kept out and the planner is asked once for `desired`
        instances at `at` (`layercast bench scale`'s controlled scale-out: its decision)."""
        self.monitor_until = at
        req = m.ScaleRequest.model_construct(model=model or next(iter(self.models)), desired_instances=desired,
                                             reason="forced", sent_at=at, version=1)
        self.q.at(at, self._reconcile, req)

    def serving_instances(self, model: str | None = None) -> set[str]:
        """The instances that serve now (warm ones, before a forced scale-out)."""
        return {i.iid for i in self.by_model[model or next(iter(self.models))].values() if i.life.serving}

    # ------------------------------------------------------------------ run
    def run(self, progress: Callable[[float], None] | None = None) -> RunResult:
        end = self.last_arrival + self.cfg.horizon_after_s
        self.q.run(until=end, progress=progress)
        for r in self.requests:
            if r.done is None and r.lost is None:
                r.lost = "unfinished at the end"
        if mode_spec(self.cfg.mode).live_pairs:
            splits = self.pair_stats["splits"]
            on_target = [k for k in splits if k > 0]
            self.notes.append(
                f"live pairs: {self.pair_stats['formed']} formed, {self.pair_stats['refused']} refused; "
                f"{len(on_target)} of {len(splits)} paired prefills ran blocks on the target"
                + (f" (mean {sum(on_target) / len(on_target):.1f} of {self.p.n_blocks})" if on_target else ""))
        if self.evicted:
            self.notes.append(f"sharing=dedicated: {self.evicted} instances unloaded for another model's load")
        return RunResult(self.cfg.mode, self.requests, self.series, self.closed_ops, self.q.processed,
                         min(end, self.q.now), self.notes, dict(self.pair_stats), self.evicted, self.pool_fills)


def profiled_capacity_tps(profile: SimProfile, mean_prompt: float, mean_output: float) -> float:
    """The output tokens/s one instance sustains, profiled offline as BlitzScale §5.3 asks (the
    threshold policy's ``capacity_tps``), on the workload's mix: requests of the mean prompt and
    output back to back, each costing its prefill plus its share of full-batch decode iterations
    (max_batch at the mean sequence length, each row's token overhead t_o included):
    O / (prefill(P) + O · (decode(B, P + O/2) / B + t_o))."""
    batch = profile.max_batch
    per_request = (profile.compute.prefill_time(max(1, round(mean_prompt)))
                   + mean_output * (profile.compute.decode_time(batch, max(1.0, mean_prompt + mean_output / 2)) / batch
                                    + profile.token_overhead_s))
    return mean_output / per_request


def autoscale_policy(cfg: FleetConfig, capacity_tps: float | None = None) -> tuple[str, dict[str, float]]:
    """The deployment's policy as `layercast model deploy` would give it (deploy_policy); a
    threshold policy gets the profiled `capacity_tps` (what an operator passes with
    --policy-param capacity_tps=N) instead of the mode's placeholder."""
    from libs.planning.scaleout import deploy_policy

    given = dict(cfg.policy_params)
    policy, params = deploy_policy(cfg.mode, cfg.policy, given)
    if policy == "threshold" and capacity_tps is not None and "capacity_tps" not in given:
        params = {**params, "capacity_tps": capacity_tps}
    return policy, params


def simulate(cfg: FleetConfig, profile: SimProfile, requests: Sequence[tuple[float, int, int]],
             progress: Callable[[float], None] | None = None) -> RunResult:
    return Simulation(cfg, profile, requests).run(progress)
