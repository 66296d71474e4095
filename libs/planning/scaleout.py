"""The planner's scale decisions, per scaling mode, as pure functions of the registry's view.

A deployment's scaling mode decides how its scale-outs move blocks, so the baselines
run in the same system as layercast (:data:`MODES`):

- ``layercast``: the planner's choice (:func:`~libs.planning.multicast_choice.choose_multicast`,
  earliest serving capacity) among binomial, k-way binomial and chains; while a multicast
  whose schedule lets them runs (binomial, k-way), its receivers serve as execution
  pipelines (libs.planning.pipelines) and switch to local instances once they hold the
  whole model;
- ``chain`` (BlitzScale §5.1, Fig. 11): chains planned on the cluster's topology
  (:func:`chain_multicast`): busy sources pruned, one chain per source within its leaf, a
  scale-up group as one node;
- ``chain-blind``: chains from the same sources over the targets in worker-id order, blind
  to leaves and groups (the baseline for ``chain``);
- ``blitzscale`` (BlitzScale §5.1-5.3): ``chain``'s topology-aware chains from every source,
  the parameter pool, targets loading stop-the-world, and live pairs: each serving instance
  pairs with a chain target still receiving the model (the slowest first,
  :func:`plan_live_pairs`) and runs its prefills' first blocks there until the target holds
  every block; its deployments get the ``threshold`` policy unless they name one;
- ``blitzscale-fixed``: ``blitzscale`` whose live pairs split every prefill batch as the first
  one (what the target held then: a fixed best-effort split) instead of ZigZag's per-batch
  choice at run time (the comparison for ZigZag, Fig. 15);
- ``blitzscale-nopairs``: ``blitzscale`` without live pairs (the comparison);
- ``binomial`` (λScale's multicast, serving only on complete copies: the baseline for
  pipelines): k-way binomial pipeline, k = the number of sources;
- ``faasnet``: a binary tree from one source;
- ``serverlessllm``: no multicast, every target loads from its own host cache or disk;
- ``static``: a fixed number of instances (min_instances), no scaling;
- ``ideal``: every worker holds every block, activation costs nothing (the lower bound).

:func:`decide` turns a ScaleRequest and the view into a :class:`ScalePlan` (scale-out), a
:class:`ScaleIn` or nothing; the planner service only carries them out. Operation and
instance ids are the service's: the plans here are deterministic.

Nodes of a multicast plan are numbered 0..N-1 with the k sources first (each holds every
block); :data:`~libs.planning.multicast.MULTICAST_ALGORITHMS` registers each algorithm (its
schedule, cost model and properties) under the one name plans and records carry.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field

from libs.planning.chain import CHAIN_ALGORITHMS, Gpu, plan_multicast_chains

# The registry's names are re-exported: callers plan through this module.
from libs.planning.multicast import (
    MULTICAST_ALGORITHMS,
    MulticastAlgorithm,
    MulticastPlan,
    arrival_steps,
    build_plan,
    chain_schedule,
    multicast_algorithm,
    plan_bound_s,
    schedule_steps,
)
from libs.planning.multicast_choice import DEFAULT_CHUNK_BYTES, choose_multicast
from libs.planning.livepair import Receiving, Serving, choose_live_pairs
from libs.planning.load_estimate import estimated_load_s
from libs.planning.pipelines import plan_pipelines
from libs.planning.placement import (
    Candidate,
    Held,
    LiveInstance,
    Resident,
    full_copies,
    pick_dedicated_targets,
    pick_targets,
    pick_victims,
)
from libs.protocol import messages as m

# The `serverlessllm` baseline's host cache keeps a stopped model's blocks this long (λScale §2.3
# measured 15 s on multi-tenant hosts; BlitzScale assumes 5 min): the planner's --serverlessllm-keep-alive.
SERVERLESSLLM_KEEP_ALIVE_S = 15.0
# What a block step of the data plane costs beyond its bytes (the receiver's grant, framing):
# `bench multicast` measured binomial at 1.008x its bound over 18 steps of 0.34 s (README), ≈3 ms.
STEP_OVERHEAD_S = 0.003
LIVE = (m.InstanceState.loading, m.InstanceState.ready)  # instances a scale decision counts


# --- multicast algorithms (registered in libs.planning.multicast) ---------------------------


def plan_nodes(plan: MulticastPlan, sources: Sequence[str], targets: Sequence[str]) -> list[str]:
    """Worker ids for the plan's nodes: its k sources (the first of `sources`), then the targets."""
    if len(sources) < plan.k:
        raise ValueError(f"the plan needs {plan.k} sources, got {len(sources)}")
    return [*sources[: plan.k], *targets]


# --- scaling modes ----------------------------------------------------------------------------

# (n_sources, n_targets, model_bytes, n_blocks, link_gbps) -> (algorithm, k)
MulticastChoiceFn = Callable[[int, int, int, int, float], tuple[str, int]]


def _one_source(algorithm: str) -> MulticastChoiceFn:
    return lambda n_sources, n_targets, *_: (algorithm, 1)


def _every_source(algorithm: str) -> MulticastChoiceFn:
    return lambda n_sources, n_targets, *_: (algorithm, min(n_sources, n_targets))


def _earliest_capacity(n_sources: int, n_targets: int, model_bytes: int, n_blocks: int,
                       link_gbps: float) -> tuple[str, int]:
    # λScale's live objective: the earliest serving capacity (a pipeline or a first copy).
    choice = choose_multicast(n_sources, n_targets, model_bytes, n_blocks, link_gbps, live=True,
                              step_overhead_s=STEP_OVERHEAD_S)
    return multicast_algorithm(choice.algorithm).name, choice.k


def _schedule_prediction(plan: MulticastPlan, n_targets: int, model_bytes: int, n_blocks: int,
                         link_gbps: float) -> dict[str, float | None]:
    # Read off the plan's own schedule (chains the topology planner built need not be the
    # even split choose_multicast weighed); chains form no pipelines.
    alg = multicast_algorithm(plan.algorithm)
    arr = arrival_steps(plan.schedule, plan.k + n_targets, n_blocks, range(plan.k))

    def at(step: int) -> float:
        return alg.cost.done_s(step, n_blocks, model_bytes, link_gbps * 1e9 / 8, DEFAULT_CHUNK_BYTES,
                               STEP_OVERHEAD_S)

    first_copy = min(max(s for s in row if s is not None) for row in arr[plan.k:])
    return {"first_pipeline_s": None, "first_copy_s": at(first_copy),
            "completion_s": at(schedule_steps(plan.schedule) - 1)}


def predicted(plan: MulticastPlan, n_targets: int, model_bytes: int, n_blocks: int,
              link_gbps: float) -> dict[str, float | None]:
    """What the cost model predicts for `plan` (seconds from its first byte): the first
    pipeline, the first complete copy, the last copy (the scale operation records it beside
    what happened); for chains, read off the plan's own chains; nothing for another algorithm
    choose_multicast does not weigh."""
    if plan.algorithm in CHAIN_ALGORITHMS:
        return _schedule_prediction(plan, n_targets, model_bytes, n_blocks, link_gbps)
    choice = choose_multicast(plan.k, n_targets, model_bytes, n_blocks, link_gbps, live=True,
                              step_overhead_s=STEP_OVERHEAD_S)
    p = choice.prediction_for(plan.algorithm, plan.k)
    if p is None:
        return {}
    return {"first_pipeline_s": p.first_pipeline_s, "first_copy_s": p.first_copy_s, "completion_s": p.completion_s}


@dataclass(frozen=True)
class ModeSpec:
    """What a scaling mode does."""

    multicast: MulticastChoiceFn | None = None  # scale-outs multicast from full copies; None: each target loads
    keeps_pool: bool = True  # the planner keeps a complete host copy in the cluster (the parameter pool)
    pool_on_every_worker: bool = False  # ... on every alive worker instead of one
    preheld: bool = False  # loads count the blocks as already in engine memory
    serve_while_loading: bool = True  # False: stop-the-world, ready once every block is loaded
    fixed_at_min: bool = False  # the instance count is min_instances whatever is asked
    host_keep_alive_on_scale_in: bool = False  # a stopped instance's blocks stay in the host cache a while
    # The multicast's receivers serve as execution pipelines while the blocks arrive, where its
    # schedule lets them (MulticastAlgorithm.forms_pipelines); those in a pipeline then load
    # stop-the-world: the pipelines are their early capacity, λScale §4.3-4.4.
    pipelines: bool = False
    # BlitzScale §5.2: a scale-out pairs the model's serving instances with chain targets still
    # receiving it (plan_live_pairs); the targets load stop-the-world (serve_while_loading=False).
    live_pairs: bool = False
    live_pair_split: str = "zigzag"  # how a pair's source splits its prefill batches (livepair.SPLIT_POLICIES)
    # The load-monitor's policy a deployment of this mode gets when it names none (deploy_policy),
    # with these parameters where it gives none; None: the deploy's own default (concurrency).
    default_policy: str | None = None
    default_policy_params: Mapping[str, float] = field(default_factory=dict)


# BlitzScale §5.3's policy needs the output tokens/s one instance sustains, profiled offline:
# where a blitzscale deployment gives none, this placeholder (not measured for any model; the
# value README's threshold examples use). Profile yours and pass --policy-param capacity_tps=N.
BLITZSCALE_CAPACITY_TPS = 200.0
_BLITZSCALE_POLICY = {"default_policy": "threshold", "default_policy_params": {"capacity_tps": BLITZSCALE_CAPACITY_TPS}}

MODES: dict[str, ModeSpec] = {
    "layercast": ModeSpec(multicast=_earliest_capacity, pipelines=True),
    "chain": ModeSpec(multicast=_every_source("chain")),  # topology-aware chains (libs.planning.chain)
    "chain-blind": ModeSpec(multicast=_every_source("chain-blind")),  # the same, blind to leaves: the baseline
    "blitzscale": ModeSpec(multicast=_every_source("chain"), serve_while_loading=False, live_pairs=True,
                           **_BLITZSCALE_POLICY),
    "blitzscale-fixed": ModeSpec(multicast=_every_source("chain"), serve_while_loading=False, live_pairs=True,
                                 live_pair_split="fixed", **_BLITZSCALE_POLICY),
    "blitzscale-nopairs": ModeSpec(multicast=_every_source("chain"), serve_while_loading=False, **_BLITZSCALE_POLICY),
    "binomial": ModeSpec(multicast=_every_source("binomial"), serve_while_loading=False),
    "faasnet": ModeSpec(multicast=_one_source("binary-tree")),
    "serverlessllm": ModeSpec(keeps_pool=False, serve_while_loading=False, host_keep_alive_on_scale_in=True),
    "static": ModeSpec(keeps_pool=False, fixed_at_min=True),
    "ideal": ModeSpec(pool_on_every_worker=True, preheld=True),
}


def mode_spec(mode: str) -> ModeSpec:
    try:
        return MODES[mode]
    except KeyError:
        raise ValueError(f"unknown scaling mode {mode!r}; choose from {', '.join(MODES)}") from None


def deploy_policy(scaling_mode: str, policy: str | None, params: Mapping[str, float]) -> tuple[str, dict[str, float]]:
    """The scaling policy and parameters a deployment gets: those it names; where it names no
    policy, its mode's default (blitzscale: BlitzScale's threshold policy, with
    BLITZSCALE_CAPACITY_TPS unless it gives capacity_tps), else concurrency."""
    if policy is not None:
        return policy, dict(params)
    spec = mode_spec(scaling_mode)
    if spec.default_policy is None:
        return "concurrency", dict(params)
    return spec.default_policy, {**spec.default_policy_params, **params}


def scaleout_choice(mode: str, n_sources: int, n_targets: int, model_bytes: int, n_blocks: int,
                    link_gbps: float) -> tuple[str, int] | None:
    """The multicast algorithm and source count `mode` picks for a scale-out from `n_sources`
    full copies to `n_targets` new workers; None when it does not multicast or cannot."""
    choose = mode_spec(mode).multicast
    if choose is None or n_sources < 1 or n_targets < 1:
        return None
    return choose(n_sources, n_targets, model_bytes, n_blocks, link_gbps)


def scaleout_plan(mode: str, n_sources: int, n_targets: int, model_bytes: int, n_blocks: int,
                  link_gbps: float) -> MulticastPlan | None:
    """The multicast a scale-out of `mode` runs from `n_sources` full copies to `n_targets`
    new workers, knowing nothing of the topology (chains: the even split); None when the mode
    does not multicast or there is nothing to send from. plan_scale_out plans chains on the view."""
    choice = scaleout_choice(mode, n_sources, n_targets, model_bytes, n_blocks, link_gbps)
    if choice is None:
        return None
    algorithm, k = choice
    return build_plan(algorithm, k + n_targets, n_blocks, k)


# --- the topology the chain planner sees -----------------------------------------------------

# Instances whose stages stream activations to each other while in these states.
_STREAMING = (m.InstanceState.loading, m.InstanceState.ready, m.InstanceState.draining)


def worker_link_gbps(worker: m.WorkerInfo) -> float:
    """A worker's network link rate in Gbit/s: what it measured receiving over the network
    (bandwidths_gbps["network_to_host"], GB/s), else its configured topology.link_gbps."""
    measured = worker.bandwidths_gbps.get("network_to_host")
    return measured * 8 if measured else worker.topology.link_gbps


def cost_link_gbps(workers: Sequence[m.WorkerInfo]) -> float:
    """The one link rate the multicast cost model assumes for a scale-out: the median of its
    workers' rates (worker_link_gbps), so one slow or unmeasured link does not set it."""
    return statistics.median(worker_link_gbps(w) for w in workers)


def live_pair_workers(view: m.ClusterView) -> set[str]:
    """The workers of the live pairs open now (BlitzScale §5.2: a loading instance runs the first
    blocks of a serving one's prefills and sends it hidden states and KV): both sides' links
    carry serving traffic, so the chain planner prunes them as sources like pipeline stages.
    The pairs are those the planner formed (ClusterView.live_pairs)."""
    return {w for p in view.live_pairs for w in (p.source_worker, p.target_worker)}


def egress_busy_workers(view: m.ClusterView) -> set[str]:
    """Workers whose outgoing link carries serving traffic (BlitzScale §4, Fig. 8): every stage
    of a multi-stage instance (an execution pipeline streams activations between its stages)
    that is loading, serving or draining, and the workers of live pairs. Scaling traffic
    from them would slow serving; the chain planner prunes them as sources while another exists."""
    busy = {s.worker_id for i in view.instances if i.state in _STREAMING and (i.mode == "pipeline" or len(i.stages) > 1)
            for s in i.stages}
    return busy | live_pair_workers(view)


def worker_gpu(gpu_id: int, worker: m.WorkerInfo, busy_egress: bool) -> Gpu:
    """The chain planner's view of a worker: its leaf, its scale-up group ("" is a group of its
    own), its link rate (worker_link_gbps) and whether its egress is busy."""
    t = worker.topology
    return Gpu(gpu_id, t.host, t.leaf, t.scaleup_group or None, worker_link_gbps(worker), busy_egress)


def chain_multicast(algorithm: str, workers: Mapping[str, m.WorkerInfo], sources: Sequence[str],
                    receivers: Sequence[str], n_blocks: int, busy: Collection[str] = ()
                    ) -> tuple[MulticastPlan, list[str]]:
    """Chains from `sources` (full copies, in preference order) to `receivers`, planned by
    libs.planning.chain on the workers' topology (`algorithm` in CHAIN_ALGORITHMS; `busy`:
    egress_busy_workers). Returns the plan and the sources reordered so its k chain heads come
    first (the plan's nodes are then plan_nodes(plan, sources, receivers), the receivers in
    the given order): the executors carry it out like any other plan."""
    topology_aware = CHAIN_ALGORITHMS[algorithm]
    # Receivers' ids follow worker-id order: the order chain-blind walks them.
    rank = {w: i for i, w in enumerate(sorted(receivers))}
    src = [worker_gpu(i, workers[w], w in busy) for i, w in enumerate(sources)]
    tgt = [worker_gpu(len(sources) + rank[w], workers[w], w in busy) for w in receivers]
    name = {g.id: w for g, w in zip([*src, *tgt], [*sources, *receivers])}
    chains = [[name[g.id] for g in chain] for chain in
              plan_multicast_chains(src, tgt, topology_aware=topology_aware)]
    heads = [c[0] for c in chains]
    node = {w: i for i, w in enumerate([*heads, *receivers])}
    schedule = chain_schedule([[node[w] for w in c] for c in chains], n_blocks)
    return MulticastPlan(algorithm, len(heads), schedule), [*heads, *(s for s in sources if s not in heads)]


# --- the view ---------------------------------------------------------------------------------


def find_model(view: m.ClusterView, name: str) -> m.ModelInfo | None:
    return next((x for x in view.models if x.name == name), None)


def alive_workers(view: m.ClusterView) -> dict[str, m.WorkerInfo]:
    return {w.worker_id: w for w in view.workers if w.state == "alive"}


def live_instances(view: m.ClusterView, model: str) -> list[m.InstanceInfo]:
    """The model's local instances, loading or serving. Execution pipelines are left out: they
    are the early capacity of targets that count already, and retire once those are loaded."""
    return [i for i in view.instances if i.model == model and i.state in LIVE and i.mode == "local"]


def held_blocks(view: m.ClusterView, model: str) -> list[Held]:
    """The model's ready block replicas."""
    ready = m.ReplicaState.ready  # looked up once: the view holds every worker's replicas
    return [Held(r.worker_id, r.block_id, str(r.tier)) for r in view.replicas
            if r.model == model and r.state == ready]


def desired_instances(model: m.ModelInfo | None, requested: int) -> int:
    """What a request for `requested` instances comes to: within [min, max]; a static fleet
    stays at min_instances; a deleted (or never deployed) model keeps none."""
    if model is None:
        return 0
    if mode_spec(model.scaling_mode).fixed_at_min:
        return model.min_instances
    return max(model.min_instances, min(requested, model.max_instances))


# --- decisions --------------------------------------------------------------------------------


@dataclass(frozen=True)
class TargetLoad:
    """What one scale-out target loads (its LoadModel, less the ids the service gives it)."""

    worker_id: str
    block_start: int
    block_end: int
    preheld: bool = False
    serve_while_loading: bool = True
    receives: bool = False  # its blocks come by the plan's multicast (LoadModel.incoming_transfer)

    def command(self, model: m.ModelInfo, instance_id: str, scale_op_id: str | None) -> m.LoadModel:
        return m.LoadModel(instance_id=instance_id, model=model.name, path=model.path,
                           block_start=self.block_start, block_end=self.block_end, scale_op_id=scale_op_id,
                           preheld=self.preheld, serve_while_loading=self.serve_while_loading)


def target_load(mode: str, worker_id: str, block_start: int, block_end: int, receives: bool = False,
                in_pipeline: bool = False) -> TargetLoad:
    """`in_pipeline`: the target serves in an execution pipeline while it loads, and on its own
    only once it holds every block."""
    spec = mode_spec(mode)
    return TargetLoad(worker_id, block_start, block_end, preheld=spec.preheld,
                      serve_while_loading=spec.serve_while_loading and not in_pipeline, receives=receives)


@dataclass(frozen=True)
class PlannedPair:
    """A live pair a scale-out forms: a serving instance and a target (by worker: its instance id
    is the service's) still receiving the model by chain."""

    source_instance: str
    source_worker: str
    target_worker: str


# The source's SLO where the deployment names no ttft_slo_s: the least of LLM-Mesh's
# max(2, prompt tokens / 512) s (libs.planning.mesh).
DEFAULT_TTFT_SLO_S = 2.0


def receivers_done_s(plan: MulticastPlan, n_receivers: int, model_bytes: int, n_blocks: int,
                     link_gbps: float) -> list[float]:
    """Seconds from the multicast's first byte until each receiver (in plan_nodes order) holds
    every block, read off the plan's schedule with its algorithm's cost model."""
    alg = multicast_algorithm(plan.algorithm)
    arr = arrival_steps(plan.schedule, plan.k + n_receivers, n_blocks, range(plan.k))
    return [alg.cost.done_s(max(s for s in row if s is not None), n_blocks, model_bytes, link_gbps * 1e9 / 8,
                            DEFAULT_CHUNK_BYTES, STEP_OVERHEAD_S) for row in arr[plan.k:]]


def plan_live_pairs(view: m.ClusterView, model: m.ModelInfo, multicast: MulticastPlan | None,
                    receivers: Sequence[str], link_gbps: float, load: Mapping[str, int]) -> tuple[PlannedPair, ...]:
    """BlitzScale §5.2 at a scale-out's start: the model's serving instances (every block in,
    alone on their worker's stage) pair with its receivers (the targets still receiving the model
    by the multicast), by :func:`~libs.planning.livepair.choose_live_pairs`: the receiver that
    will take longest first, only one whose load outlasts the source's TTFT SLO, one pair per
    source and per target, none with an instance already paired (ClusterView.live_pairs).

    The scale-out itself is the overload signal (the policy asked for it because load passed
    its bound), so every serving instance counts as overloaded; the most loaded (running
    requests on its worker) pairs first."""
    if not mode_spec(model.scaling_mode).live_pairs or multicast is None or not receivers:
        return ()
    n_blocks = len(model.blocks)
    paired = {i for p in view.live_pairs for i in (p.source_instance, p.target_instance)}
    paired_workers = live_pair_workers(view)
    slo = model.ttft_slo_s or DEFAULT_TTFT_SLO_S
    serving = [Serving(i.instance_id, i.entry_worker, model.name, queue_wait_s=math.inf, slo_s=slo,
                       paired=i.instance_id in paired or i.entry_worker in paired_workers,
                       load=load.get(i.entry_worker, 0))
               for i in live_instances(view, model.name)
               if i.state == m.InstanceState.ready and i.loaded_at is not None and len(i.stages) == 1
               and (i.stages[0].block_start, i.stages[0].block_end) == (0, n_blocks)]
    done_s = receivers_done_s(multicast, len(receivers), model.total_bytes, n_blocks, link_gbps)
    # A receiver has no instance yet: its worker names it until the scale operation creates it.
    receiving = [Receiving(w, w, model.name, load_left_s=s, paired=w in paired_workers)
                 for w, s in zip(receivers, done_s)]
    return tuple(PlannedPair(p.source.instance_id, p.source.worker_id, p.target.worker_id)
                 for p in choose_live_pairs(serving, receiving))


@dataclass(frozen=True)
class ScalePlan:
    """A scale-out. No `loads`: more instances are wanted but no worker is free (or only
    `held_back` ones)."""

    model: m.ModelInfo
    from_instances: int
    desired: int
    loads: tuple[TargetLoad, ...]
    sources: tuple[str, ...] = ()  # full host copies (targets that hold one too), least loaded first
    receivers: tuple[str, ...] = ()  # targets without a full copy of their own
    multicast: MulticastPlan | None = None  # from the first k sources to the receivers
    link_gbps: float = 0.0  # the cost model's link rate: cost_link_gbps of sources and receivers
    # Alg. 2's groups of receivers that may serve as execution pipelines while the blocks arrive
    pipelines: tuple[tuple[str, ...], ...] = ()
    prediction: Mapping[str, float | None] = field(default_factory=dict)  # see predicted()
    held_back: tuple[str, ...] = ()  # free workers passed over as saturated (see pick_targets)
    # target -> its estimated load time when chosen (ServerlessLLM §6.2, libs.planning.load_estimate)
    load_estimates: Mapping[str, float] = field(default_factory=dict)
    # Live pairs to form once each target's load is accepted (modes with live_pairs): plan_live_pairs
    live_pairs: tuple[PlannedPair, ...] = ()
    # sharing=dedicated: target -> the instances (of other models) its worker unloads first
    evicts: Mapping[str, tuple[str, ...]] = field(default_factory=dict)

    @property
    def targets(self) -> tuple[str, ...]:
        return tuple(load.worker_id for load in self.loads)

    @property
    def to_instances(self) -> int:
        return self.from_instances + len(self.loads)

    @property
    def senders(self) -> tuple[str, ...]:
        """The sources the multicast sends from."""
        return self.sources[: self.multicast.k] if self.multicast else ()

    def nodes(self) -> list[str]:
        """Worker ids of the multicast's nodes (see plan_nodes)."""
        if self.multicast is None:
            return []
        return plan_nodes(self.multicast, self.sources, self.receivers)

    def record(self) -> dict:
        """The plan as the scale operation records it."""
        plan = {"kind": "multicast" if self.multicast else "local-load", "mode": self.model.scaling_mode,
                "targets": list(self.targets), "blocks": [0, len(self.model.blocks)]}
        if self.multicast:
            plan |= {"algorithm": self.multicast.algorithm, "k": self.multicast.k, "sources": list(self.senders),
                     "receivers": list(self.receivers)}
        if self.pipelines:
            plan["pipelines"] = [list(p) for p in self.pipelines]
        if self.prediction:
            plan["predicted"] = dict(self.prediction)
        if self.live_pairs:
            plan["live_pairs"] = [{"source_instance": p.source_instance, "source_worker": p.source_worker,
                                   "target_worker": p.target_worker} for p in self.live_pairs]
        if self.evicts:
            plan["evicts"] = {w: list(ids) for w, ids in self.evicts.items()}
        if self.load_estimates:
            # Beside what happens: the operation adds measured_load_s when it closes (scaleop).
            plan["estimated_load_s"] = {w: round(s, 6) for w, s in self.load_estimates.items()}
        return plan


@dataclass(frozen=True)
class ScaleIn:
    model: str
    from_instances: int
    desired: int
    victims: tuple[m.InstanceInfo, ...]  # in the view's order
    host_keep_alive_s: float | None = None  # the victims' workers keep their blocks in host memory this long

    def record(self) -> dict:
        return {"kind": "drain", "victims": sorted(i.instance_id for i in self.victims)}


def residents(view: m.ClusterView, load: Mapping[str, int]) -> dict[str, list[Resident]]:
    """worker -> the instances (and pipeline stages) on it that have not stopped."""
    live = Counter(i.model for i in view.instances if i.state in LIVE and i.mode == "local")
    out: dict[str, list[Resident]] = {}
    for i in view.instances:
        if i.state in (*LIVE, m.InstanceState.draining):
            for w in dict.fromkeys(s.worker_id for s in i.stages):
                out.setdefault(w, []).append(Resident(i.instance_id, i.model, i.state.value, load.get(w, 0),
                                                      live[i.model]))
    return out


def plan_scale_out(view: m.ClusterView, request: m.ScaleRequest, load: Mapping[str, int] | None = None,
                   saturated: Collection[str] = (), *, dedicated: bool = False) -> ScalePlan | None:
    """The scale-out `request` needs (None: it needs none). `load`: worker -> running requests;
    `saturated`: workers refusing requests as busy (:func:`saturated_workers`; see
    :func:`pick_targets`). `dedicated` (sharing=dedicated): one model per worker at a time, the
    targets by :func:`pick_dedicated_targets` (idle workers, or for a first instance one worker
    taken from another model)."""
    load = load or {}
    model = find_model(view, request.model)
    live = live_instances(view, request.model)
    desired = desired_instances(model, request.desired_instances)
    if model is None or desired <= len(live):
        return None
    busy = {s.worker_id for i in live for s in i.stages}
    per_worker = Counter(s.worker_id for i in view.instances for s in i.stages)
    alive = alive_workers(view)
    candidates = [Candidate(w, load.get(w, 0), per_worker[w], w in saturated) for w in alive if w not in busy]
    held = held_blocks(view, model.name)
    block_bytes = {b.block_id: b.nbytes for b in model.blocks}
    # Each candidate's estimated load time (its measured bandwidths, where it holds the blocks,
    # the loads already running there) ranks it first (ServerlessLLM §6.4).
    load_s = estimated_load_s(view, model, [c.worker_id for c in candidates])
    evicts: Mapping[str, tuple[str, ...]] = {}
    if dedicated:
        ranked = pick_targets(block_bytes, candidates, held, len(candidates), first=True, load_s=load_s)
        pick = pick_dedicated_targets(model.name, ranked, residents(view, load), desired - len(live), first=not live)
        targets, evicts = list(pick.targets), pick.evicts
    else:
        targets = pick_targets(block_bytes, candidates, held, desired - len(live), first=not live, load_s=load_s)
    held_back = tuple(c.worker_id for c in candidates if c.saturated and c.worker_id not in targets)
    if not targets:
        return ScalePlan(model, len(live), desired, (), held_back=held_back)
    # Workers holding a whole copy in host memory send it (the data plane sends from the host
    # tier); a target that holds one itself loads it locally, and sends too: its link is idle
    # (the parameter pool keeps its copy off the serving workers for this: one more source).
    # The least loaded sources go first (they interfere least with serving, BlitzScale §5.2).
    copies = full_copies(block_bytes, held, alive)
    sources = sorted(copies, key=lambda w: (load.get(w, 0), w in targets))
    receivers = [t for t in targets if t not in copies]
    link_gbps = cost_link_gbps([alive[w] for w in [*sources, *receivers]]) if sources and receivers else 0
    choice = scaleout_choice(model.scaling_mode, len(sources), len(receivers), model.total_bytes,
                             len(model.blocks), link_gbps) if link_gbps else None
    multicast = None
    if choice is not None and choice[0] in CHAIN_ALGORITHMS:
        # Chains are planned on the topology: which sources send, and who forwards to whom.
        multicast, sources = chain_multicast(choice[0], alive, sources, receivers, len(model.blocks),
                                             egress_busy_workers(view))
    elif choice is not None:
        multicast = build_plan(choice[0], choice[1] + len(receivers), len(model.blocks), choice[1])
    pipelines: tuple[tuple[str, ...], ...] = ()
    prediction: dict[str, float | None] = {}
    if multicast is not None:
        prediction = predicted(multicast, len(receivers), model.total_bytes, len(model.blocks), link_gbps)
        if mode_spec(model.scaling_mode).pipelines:
            pipelines = tuple(plan_pipelines(multicast, plan_nodes(multicast, sources, receivers)))
    in_pipeline = {w for p in pipelines for w in p}
    loads = tuple(target_load(model.scaling_mode, w, 0, len(model.blocks),
                              receives=multicast is not None and w in receivers, in_pipeline=w in in_pipeline)
                  for w in targets)
    return ScalePlan(model, len(live), desired, loads, tuple(sources), tuple(receivers), multicast, link_gbps,
                     pipelines, prediction, held_back,
                     load_estimates={w: load_s[w] for w in targets if w in load_s},
                     live_pairs=plan_live_pairs(view, model, multicast, receivers, link_gbps, load), evicts=evicts)


def plan_scale_in(view: m.ClusterView, request: m.ScaleRequest, load: Mapping[str, int] | None = None, *,
                  host_keep_alive_s: float = SERVERLESSLLM_KEEP_ALIVE_S) -> ScaleIn | None:
    """The scale-in `request` needs (None: it needs none). `host_keep_alive_s` applies to the
    modes whose host cache outlives a stopped instance."""
    load = load or {}
    model = find_model(view, request.model)
    live = live_instances(view, request.model)
    desired = desired_instances(model, request.desired_instances)
    if desired >= len(live):
        return None
    instances = [LiveInstance(i.instance_id, i.state.value, load.get(i.entry_worker, 0)) for i in live]
    victims = set(pick_victims(instances, len(live) - desired))
    keeps = model is not None and mode_spec(model.scaling_mode).host_keep_alive_on_scale_in
    return ScaleIn(request.model, len(live), desired, tuple(i for i in live if i.instance_id in victims),
                   host_keep_alive_s if keeps else None)


def decide(view: m.ClusterView, request: m.ScaleRequest, load: Mapping[str, int] | None = None, *,
           saturated: Collection[str] = (), dedicated: bool = False,
           host_keep_alive_s: float = SERVERLESSLLM_KEEP_ALIVE_S) -> ScalePlan | ScaleIn | None:
    """What reconciling `request` against the view takes; None: the model is already there.
    `dedicated`: sharing=dedicated's placement (see plan_scale_out)."""
    out = plan_scale_out(view, request, load, saturated, dedicated=dedicated)
    if out is not None:
        return out
    return plan_scale_in(view, request, load, host_keep_alive_s=host_keep_alive_s)
