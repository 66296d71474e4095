"""Locality-aware server selection (ServerlessLLM §6).

* Loading time (§6.2): q + n / b — the wait in the worker's loading queue plus
  the bytes to move over the bandwidth of the *slowest* tier on the path,
  because the multi-tier loader pipelines SSD→host→device and the slowest
  stage sets the pace.  layercast tracks locality per block, so the bytes of
  each block are charged to the path from the tier that block sits in
  (loads on one worker are sequential, §6.2 (i), so the per-block times add).
* Migration time (§6.3): a·(t_in + t_out) + b, the KV-cache recompute on the
  destination; t_out is not asked from the servers but inferred as
  elapsed / time-per-token.
* Server choice (§6.4): the worker with the lowest estimated startup time; if
  no worker has a free accelerator, consider freeing one by live-migrating the
  instances running there (token-based, §5) — chosen by dynamic programming
  over the candidate instances (§6.3) — and pay the migration before loading.
* Bandwidth estimates are refined from measured loads (§6.2 (iii)).

All functions are pure; cluster state comes in as immutable views.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from enum import Enum

__all__ = [
    "Tier",
    "Bandwidths",
    "ModelSpec",
    "RunningRequest",
    "RunningInstance",
    "WorkerView",
    "Migration",
    "Placement",
    "path_bandwidth",
    "load_time",
    "inferred_output_tokens",
    "migration_time",
    "instance_resume_time",
    "choose_server",
    "observe_load",
]


class Tier(str, Enum):
    """Where a block sits on a worker (fastest first)."""

    DEVICE = "device"  # already in accelerator memory: nothing to load
    HOST = "host"  # host memory → device over PCIe
    SSD = "ssd"  # local SSD → host → device
    NETWORK = "network"  # not on the worker: peer / remote store → host → device


@dataclass(frozen=True)
class Bandwidths:
    """Measured bandwidths of one worker's links, in bytes per second."""

    host_to_device: float
    ssd_to_host: float
    network_to_host: float

    def __post_init__(self) -> None:
        for name in ("host_to_device", "ssd_to_host", "network_to_host"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0")


def path_bandwidth(bw: Bandwidths, tier: Tier) -> float:
    """Bandwidth of the slowest link between ``tier`` and device memory (§6.2 (ii))."""
    if tier is Tier.DEVICE:
        return math.inf
    if tier is Tier.HOST:
        return bw.host_to_device
    if tier is Tier.SSD:
        return min(bw.ssd_to_host, bw.host_to_device)
    return min(bw.network_to_host, bw.host_to_device)


def _bottleneck_field(bw: Bandwidths, tier: Tier) -> str:
    if tier is Tier.HOST:
        return "host_to_device"
    slow = "ssd_to_host" if tier is Tier.SSD else "network_to_host"
    return slow if getattr(bw, slow) <= bw.host_to_device else "host_to_device"


def observe_load(bw: Bandwidths, tier: Tier, nbytes: int, seconds: float, alpha: float = 0.3) -> Bandwidths:
    """Fold one measured load into the estimate (§6.2 (iii)).

    The measured rate updates the link that is currently the bottleneck of
    that tier's path, by an exponentially weighted moving average, so a
    single outlier moves the estimate by at most ``alpha``.
    """
    if tier is Tier.DEVICE or nbytes <= 0 or seconds <= 0:
        return bw
    if not 0 < alpha <= 1:
        raise ValueError(f"alpha must be in (0, 1], got {alpha}")
    name = _bottleneck_field(bw, tier)
    measured = nbytes / seconds
    return replace(bw, **{name: (1 - alpha) * getattr(bw, name) + alpha * measured})


@dataclass(frozen=True)
class ModelSpec:
    """A deployable model: block sizes and profiled migration parameters."""

    name: str
    block_bytes: tuple[int, ...]
    gpus: int = 1
    resume_a_s: float = 0.0  # a: seconds per token of KV recompute (§6.3)
    resume_b_s: float = 0.0  # b: fixed resume overhead (§6.3)
    time_per_token_s: float = 0.05  # average decode time per output token

    @property
    def total_bytes(self) -> int:
        return sum(self.block_bytes)


@dataclass(frozen=True)
class RunningRequest:
    input_tokens: int
    elapsed_s: float


@dataclass(frozen=True)
class RunningInstance:
    """An instance on a worker: its model, accelerators and running requests."""

    model: str
    gpus: int
    requests: tuple[RunningRequest, ...] = ()


@dataclass(frozen=True)
class WorkerView:
    """The planner's view of one worker (from the registry)."""

    id: Hashable
    bandwidth: Bandwidths
    free_gpus: int
    blocks: Mapping[str, Mapping[int, Tier]] = field(default_factory=dict)  # model → block → tier
    queue_s: float = 0.0  # pending work in the worker's loading queue (q, §6.2)
    running: tuple[RunningInstance, ...] = ()


@dataclass(frozen=True)
class Migration:
    """Move ``instance`` (index into the source worker's ``running``) to ``dest``."""

    source: Hashable
    instance: int
    dest: Hashable
    estimate_s: float


@dataclass(frozen=True)
class Placement:
    """Result of :func:`choose_server`."""

    worker: Hashable
    estimate_s: float  # estimated time until the model is loaded there
    load_s: float  # the load itself (queue wait included)
    migrations: tuple[Migration, ...] = ()


def load_time(worker: WorkerView, model: ModelSpec, extra_queue_s: float = 0.0) -> float:
    """Estimated time to have ``model`` in device memory on ``worker`` (§6.2).

    q (the worker's loading queue, plus ``extra_queue_s`` for loads the caller
    is about to add) + Σ over blocks of bytes / bandwidth of the slowest tier
    on that block's path; a block the worker lacks comes over the network.
    Zero if every block is already on the device.
    """
    transfer = _transfer_time(worker, model)
    if transfer == 0.0:
        return 0.0
    return worker.queue_s + extra_queue_s + transfer


def _transfer_time(worker: WorkerView, model: ModelSpec) -> float:
    tiers = worker.blocks.get(model.name, {})
    total = 0.0
    if not tiers:  # nothing of the model here (most workers of a large cluster): every block over the network
        rate = path_bandwidth(worker.bandwidth, Tier.NETWORK)
        for nbytes in model.block_bytes:  # the same sum, in the same order, as below
            total += nbytes / rate
        return total
    rates: dict[Tier, float] = {}  # each tier's path once (the planner ranks every worker per decision)
    for idx, nbytes in enumerate(model.block_bytes):
        tier = tiers.get(idx, Tier.NETWORK)
        if tier is not Tier.DEVICE:
            rate = rates.get(tier)
            if rate is None:
                rate = rates[tier] = path_bandwidth(worker.bandwidth, tier)
            total += nbytes / rate
    return total


def inferred_output_tokens(elapsed_s: float, time_per_token_s: float) -> int:
    """t_out = elapsed / time per token (§6.3): no round trip to the server."""
    if time_per_token_s <= 0:
        raise ValueError("time_per_token_s must be > 0")
    # Divide then floor with a small tolerance: 2.0 // 0.05 is 39.0 in binary
    # floating point, but 2 s at 50 ms per token is 40 tokens.
    return max(0, math.floor(elapsed_s / time_per_token_s + 1e-9))


def migration_time(input_tokens: int, output_tokens: int, a: float, b: float) -> float:
    """Resume time a·(t_in + t_out) + b (§6.3)."""
    return a * (input_tokens + output_tokens) + b


def instance_resume_time(instance: RunningInstance, model: ModelSpec) -> float:
    """Resume time of a whole instance: its requests are recomputed as one batch.

    a and b are profiled per model and batch (§6.3), so the batch costs
    a·Σ(t_in + t_out) + b; an idle instance costs b.
    """
    tokens = sum(
        r.input_tokens + inferred_output_tokens(r.elapsed_s, model.time_per_token_s) for r in instance.requests
    )
    return migration_time(tokens, 0, model.resume_a_s, model.resume_b_s)


def _best_dest(
    inst: RunningInstance,
    spec: ModelSpec,
    source: WorkerView,
    workers: Sequence[WorkerView],
    free: Mapping[Hashable, int],
    extra_q: Mapping[Hashable, float],
) -> tuple[Hashable, float, float] | None:
    # Cheapest destination with room: (id, total estimate, its load part).
    best: tuple[Hashable, float, float] | None = None
    resume = instance_resume_time(inst, spec)
    for w in workers:
        if w.id == source.id or free[w.id] < inst.gpus:
            continue
        load = load_time(w, spec, extra_q[w.id])
        total = load + resume
        if best is None or total < best[1]:
            best = (w.id, total, load)
    return best


def _migration_plan(
    worker: WorkerView,
    need: int,
    workers: Sequence[WorkerView],
    models: Mapping[str, ModelSpec],
) -> tuple[float, tuple[Migration, ...]] | None:
    """Free ``need`` accelerators on ``worker`` at the least total migration time.

    §6.3's dynamic program: a 0/1 knapsack over the worker's instances, where
    an instance weighs its accelerators and costs its cheapest migration
    (destination load + resume); dp[g] is the least cost to free g (capped at
    ``need``).  Destinations are then assigned in the chosen order with their
    free capacity and loading queues updated, so two migrations never count
    on the same free slot.  Returns (time until the slots are free, plan):
    migrations to different workers run in parallel, so the time is the
    slowest one.
    """
    free = {w.id: w.free_gpus for w in workers}
    by_id = {w.id: w for w in workers}
    zero_q = {w.id: 0.0 for w in workers}
    items: list[tuple[int, int, float]] = []  # (instance index, gpus, cost)
    for idx, inst in enumerate(worker.running):
        spec = models.get(inst.model)
        if spec is None or inst.gpus <= 0:
            continue
        dest = _best_dest(inst, spec, worker, workers, free, zero_q)
        if dest is not None:
            items.append((idx, inst.gpus, dest[1]))
    inf = math.inf
    dp: list[float] = [0.0] + [inf] * need
    choice: list[list[int]] = [[] for _ in range(need + 1)]
    for item_no, (_, gpus, cost) in enumerate(items):
        for g in range(need, -1, -1):  # 0/1 knapsack: iterate capacity downwards
            if dp[g] == inf:
                continue
            ng = min(need, g + gpus)
            if dp[g] + cost < dp[ng]:
                dp[ng] = dp[g] + cost
                choice[ng] = choice[g] + [item_no]
    if dp[need] == inf:
        return None
    # Assign destinations for real, cheapest instance first.
    chosen = sorted(choice[need], key=lambda k: (items[k][2], items[k][0]))
    extra_q = dict(zero_q)
    migrations: list[Migration] = []
    for k in chosen:
        idx = items[k][0]
        inst = worker.running[idx]
        spec = models[inst.model]
        dest = _best_dest(inst, spec, worker, workers, free, extra_q)
        if dest is None:
            return None
        dest_id, total, _ = dest
        free[dest_id] -= inst.gpus
        # Loads on one worker are sequential (§6.2 (i)): the next migration
        # to the same worker queues behind this one.
        extra_q[dest_id] += _transfer_time(by_id[dest_id], spec)
        migrations.append(Migration(worker.id, idx, dest_id, total))
    return max(m.estimate_s for m in migrations), tuple(migrations)


def choose_server(
    model: ModelSpec,
    workers: Sequence[WorkerView],
    models: Mapping[str, ModelSpec] | None = None,
    *,
    always_consider_migration: bool = False,
) -> Placement | None:
    """Pick the worker with the lowest estimated startup time (§6.4).

    Workers with enough free accelerators are ranked by :func:`load_time`.
    Only when none has room, each worker is also considered with live
    migration of its running instances (``models`` gives their specs): its
    estimate is the time to free the slots plus the model's load there
    (ServerlessLLM loads the new model once the migration finished).  Ties go
    to the earlier worker in ``workers``.  None means: keep the request
    pending and retry when accelerators are released.

    ``always_consider_migration`` weighs migration even when some worker is
    free (ServerlessLLM Fig. 5: migrate model C away to load B where it is
    cached, rather than load B from a slow tier elsewhere).
    """
    if model.gpus < 1:
        raise ValueError("a model needs at least one accelerator")
    best: Placement | None = None
    for w in workers:
        if w.free_gpus >= model.gpus:
            t = load_time(w, model)
            if best is None or t < best.estimate_s:
                best = Placement(worker=w.id, estimate_s=t, load_s=t)
    if not models or (best is not None and not always_consider_migration):
        return best
    for w in workers:
        if w.free_gpus >= model.gpus:
            continue  # already ranked above without migration
        plan = _migration_plan(w, model.gpus - w.free_gpus, workers, models)
        if plan is None:
            continue
        wait, migs = plan
        load = load_time(w, model)
        total = wait + load
        if best is None or total < best.estimate_s:
            best = Placement(worker=w.id, estimate_s=total, load_s=load, migrations=migs)
    return best
