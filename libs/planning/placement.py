"""Where a new instance goes and which instances a scale-in removes.

Pure functions over plain data. The least estimated load time first (ServerlessLLM §6.4;
the estimate: load_estimate.py), then locality: a worker that already holds a model's
blocks in a nearer tier (engine memory, then host memory, then its own disk) starts it
faster than one that must fetch them.
"""

import math
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass

# Nearer tiers first; a block held in several tiers counts in its nearest.
TIER_ORDER = ("gpu", "host", "ssd")


@dataclass(frozen=True)
class Candidate:
    worker_id: str
    running_requests: int = 0
    instances: int = 0  # instances of any model on the worker
    saturated: bool = False  # it refused requests as busy lately (sharing=mesh; see `saturated_workers`)


# How long a worker counts as saturated after its last "busy" refusal: a few of its reports, so
# a worker the gateway stopped asking (its refused routes wait) is not taken for free at once.
SATURATION_MEMORY_S = 5.0


def saturated_workers(last_refusal: Mapping[str, float], now: float,
                      memory_s: float = SATURATION_MEMORY_S) -> frozenset[str]:
    """The workers that refused a request as busy (LLM-Mesh shadow validation, or no memory for
    its KV) within `memory_s` before `now`: what runs there leaves no room for more."""
    return frozenset(w for w, t in last_refusal.items() if now - t <= memory_s)


@dataclass(frozen=True)
class Held:
    """A ready block replica: `worker_id` holds `block_id` in `tier`."""

    worker_id: str
    block_id: int
    tier: str


def locality(block_bytes: Mapping[int, int], held: Iterable[Held], worker_id: str) -> tuple[int, ...]:
    """Bytes of the model a worker holds per tier, nearest tier first, each block
    counted once in its nearest tier."""
    nearest: dict[int, int] = {}
    for h in held:
        if h.worker_id == worker_id and h.block_id in block_bytes and h.tier in TIER_ORDER:
            rank = TIER_ORDER.index(h.tier)
            nearest[h.block_id] = min(rank, nearest.get(h.block_id, rank))
    per_tier = [0] * len(TIER_ORDER)
    for block_id, rank in nearest.items():
        per_tier[rank] += block_bytes[block_id]
    return tuple(per_tier)


def full_copies(block_ids: Collection[int], held: Iterable[Held], workers: Iterable[str],
                tier: str = "host") -> list[str]:
    """The workers (in the given order) holding every block in `tier`: the sources a
    multicast can send from (the data plane sends from the host tier)."""
    have: dict[str, set[int]] = {}
    for h in held:
        if h.tier == tier:
            have.setdefault(h.worker_id, set()).add(h.block_id)
    wanted = set(block_ids)
    return [w for w in workers if wanted <= have.get(w, set())]


# Estimates closer than this count as equal (ServerlessLLM §7.3 measured its SSD load estimates
# off by up to 40 ms; measured bandwidths drift by more than a tenth between loads): the
# workers' order then falls back to locality and load, so noise in the measurements does not
# decide where instances go.
LOAD_ESTIMATE_RESOLUTION_S = 0.04
LOAD_ESTIMATE_RESOLUTION_REL = 0.1


def load_time_rank(load_s: Mapping[str, float]) -> dict[str, int]:
    """worker -> its estimate in steps of the resolution (max of the absolute one and the
    relative one of the fastest estimate): equal steps are ties."""
    if not load_s:
        return {}
    step = max(LOAD_ESTIMATE_RESOLUTION_S, LOAD_ESTIMATE_RESOLUTION_REL * min(load_s.values()))
    return {w: int(t // step) for w, t in load_s.items()}


def pick_targets(block_bytes: Mapping[int, int], candidates: Iterable[Candidate], held: Iterable[Held],
                 n: int, *, first: bool = False, load_s: Mapping[str, float] | None = None) -> list[str]:
    """Up to `n` distinct workers for new instances: the least estimated load time first
    (`load_s`, ServerlessLLM §6.4; see load_time_rank), then most bytes in the nearest tier
    (lexicographic over tiers), then the least busy, then by id so the choice is deterministic.
    Without `load_s` the estimate does not tell workers apart; a worker missing from it goes after
    those in it.

    A saturated worker gets a model's first instance only (`first`: it has none live, and an
    instance anywhere is what lets its requests in as room frees), and only after every other:
    more instances there add no capacity (LLM-Mesh §5.3 creates one only on a node that passes
    validation) and their loads take the compute its requests are refused for."""
    # Each worker's replicas once (not every replica per candidate: quadratic at 512 workers).
    by_worker: dict[str, list[Held]] = {}
    for h in held:
        by_worker.setdefault(h.worker_id, []).append(h)
    candidates = [c for c in candidates if first or not c.saturated]
    rank = load_time_rank(load_s or {})
    ranked = sorted(
        candidates,
        key=lambda c: (c.saturated, rank.get(c.worker_id, math.inf),
                       tuple(-b for b in locality(block_bytes, by_worker.get(c.worker_id, ()), c.worker_id)),
                       c.instances, c.running_requests, c.worker_id),
    )
    return [c.worker_id for c in ranked[: max(0, n)]]


@dataclass(frozen=True)
class LiveInstance:
    instance_id: str
    state: str  # loading | ready
    in_flight: int = 0


def pick_victims(instances: Iterable[LiveInstance], n: int) -> list[str]:
    """Up to `n` instances to remove: still-loading ones first (they serve
    nobody yet), then the least loaded, ties by id."""
    ranked = sorted(instances, key=lambda i: (i.state != "loading", i.in_flight, i.instance_id))
    return [i.instance_id for i in ranked[: max(0, n)]]


# --- sharing=dedicated: one model per worker at a time -------------------------------------------


@dataclass(frozen=True)
class Resident:
    """An instance (or a pipeline stage) a worker holds: what `dedicated` placement must clear."""

    instance_id: str
    model: str
    state: str  # loading | ready | draining
    in_flight: int = 0  # requests running on its worker
    model_instances: int = 1  # live instances of its model in the cluster, this one included


@dataclass(frozen=True)
class DedicatedPick:
    targets: tuple[str, ...]
    evicts: Mapping[str, tuple[str, ...]]  # target -> the instances its worker unloads first


def eviction_key(residents: Iterable[Resident]) -> tuple:
    """How costly it is to take this worker from the models it holds, least first: models that
    keep an instance elsewhere before a model's last instance (that one's requests then wait
    for a load), then the fewest requests in flight (they drain before the unload)."""
    residents = list(residents)
    return (any(r.model_instances <= 1 for r in residents), sum(r.in_flight for r in residents))


def pick_dedicated_targets(model: str, ranked: Sequence[str], residents: Mapping[str, Sequence[Resident]], n: int,
                           *, first: bool) -> DedicatedPick:
    """Where `dedicated` sharing puts up to `n` new instances of `model` (ServerlessLLM's
    allocation: one model per worker at a time). `ranked`: the candidate workers (none holds
    `model`) in pick_targets' order; `residents`: worker -> what it holds.

    1. Idle workers first (nothing there, or only instances already draining away), in `ranked`
       order: a new instance never shares a worker with another model's.
    2. None idle and `first` (the model has no live instance: its requests wait at the gateway
       with nowhere to go): one worker is taken from the models it holds; the worker unloads them
       (after their requests in flight end) before it loads `model`. The worker chosen is the
       cheapest by :func:`eviction_key`, ties in `ranked` order. A worker with an instance still
       loading is never taken (its model's first requests are waiting for it).
    3. Otherwise (the model has an instance already) nothing is evicted for more of it: a
       scale-out takes idle workers only."""
    if n <= 0:
        return DedicatedPick((), {})
    ranked = list(dict.fromkeys(w for w in ranked if not any(r.model == model for r in residents.get(w, ()))))

    def staying(w: str) -> list[Resident]:
        return [r for r in residents.get(w, ()) if r.state != "draining"]

    idle = [w for w in ranked if not staying(w)]
    if idle:
        return DedicatedPick(tuple(idle[:n]), {})
    if not first:
        return DedicatedPick((), {})
    takeable = [w for w in ranked if all(r.state == "ready" for r in staying(w))]
    if not takeable:
        return DedicatedPick((), {})
    order = {w: i for i, w in enumerate(ranked)}
    victim = min(takeable, key=lambda w: (eviction_key(staying(w)), order[w]))
    return DedicatedPick((victim,), {victim: tuple(sorted(r.instance_id for r in staying(victim)))})
