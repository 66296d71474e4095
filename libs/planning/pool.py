"""The parameter pool (BlitzScale §5.3): every model keeps a complete copy of its blocks in
the host memory of the cluster, so a scale-out always has a source to multicast from,
however far the model was scaled in.

Pure: the planner feeds it the registry's view and carries out what it returns.
"""

from collections import defaultdict
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field

from libs.planning.placement import Held, full_copies
from libs.planning.scaleout import alive_workers, held_blocks, live_instances, mode_spec
from libs.protocol import messages as m


@dataclass(frozen=True)
class PoolFill:
    """Bring blocks into `worker`'s host tier and keep them there: each block in `from_peers`
    from that surviving holder (over the data plane), the rest from the worker's own disk."""

    worker: str
    blocks: tuple[int, ...]  # every block the worker keeps for the pool (held or brought)
    from_peers: Mapping[int, str] = field(default_factory=dict)
    from_disk: tuple[int, ...] = ()


def host_holdings(held: Iterable[Held], workers: Iterable[str]) -> dict[str, set[int]]:
    """worker -> the blocks it holds in its host tier (only the given, alive, workers)."""
    alive = set(workers)
    have: dict[str, set[int]] = {}
    for h in held:
        if h.tier == "host" and h.worker_id in alive:
            have.setdefault(h.worker_id, set()).add(h.block_id)
    return have


def pool_repair(block_bytes: Mapping[int, int], held: Iterable[Held],
                free_host_bytes: Mapping[str, int], serving: Collection[str] = ()) -> list[PoolFill]:
    """What gives one model a complete host copy off its serving workers, or [] if it has one.

    `free_host_bytes` names the alive workers and the host memory each can still give;
    `serving` the workers running an instance of the model. A serving worker's copy is a
    multicast source anyway, so the pool's copy belongs elsewhere: then a scale-out has one
    more source (λScale's k-way multicast, k = 2 from a single instance) and the copy does
    not go with a scaled-in instance's memory. A copy on a serving worker is kept only when
    no other worker has room.

    The copy goes to one worker when one can hold it (a multicast needs a whole copy at its
    source): a worker not serving the model, then the one already holding most of the model,
    then the one with most room, then by id. Its missing blocks come from surviving holders
    where there are any (re-replication over the network, faster than a disk), else from its
    disk. When no single worker has room, the blocks held nowhere are spread over the workers
    with most room.
    """
    workers = sorted(free_host_bytes)
    have = host_holdings(held, workers)
    wanted = set(block_bytes)
    holders = [w for w in workers if wanted <= have.get(w, set())]
    if not wanted or any(w not in serving for w in holders):
        return []

    def bytes_of(blocks: Iterable[int]) -> int:
        return sum(block_bytes[b] for b in blocks)

    holder = {b: w for w in workers for b in sorted(have.get(w, ())) if b in wanted}
    fits = [w for w in workers if bytes_of(wanted - have.get(w, set())) <= free_host_bytes[w]]
    if holders:  # every copy is on a serving worker: move one off only to a worker that is not
        fits = [w for w in fits if w not in serving]
        if not fits:
            return []
    if fits:
        w = min(fits, key=lambda w: (w in serving, -bytes_of(wanted & have.get(w, set())), -free_host_bytes[w], w))
        missing = sorted(wanted - have.get(w, set()))
        from_peers = {b: holder[b] for b in missing if b in holder}
        return [PoolFill(w, tuple(sorted(wanted)), from_peers, tuple(b for b in missing if b not in holder))]
    # Spread: only the blocks held nowhere, biggest first, each to the worker with most room left.
    room = dict(free_host_bytes)
    fills: dict[str, list[int]] = {}
    for b in sorted(wanted - set(holder), key=lambda b: (-block_bytes[b], b)):
        w = min(workers, key=lambda w: (-room[w], w), default=None)
        if w is None or room[w] < block_bytes[b]:
            continue  # no room anywhere: the caller sees the copy is still incomplete
        room[w] -= block_bytes[b]
        fills.setdefault(w, []).append(b)
    return [PoolFill(w, tuple(sorted(bs)), {}, tuple(sorted(bs))) for w, bs in sorted(fills.items())]


def free_host_bytes(view: m.ClusterView) -> dict[str, int]:
    """Alive worker -> the host memory it can still give (capacity less its ready host replicas)."""
    sizes = {(x.name, b.block_id): b.nbytes for x in view.models for b in x.blocks}
    used: dict[str, int] = defaultdict(int)
    for r in view.replicas:
        if r.tier == m.Tier.host and r.state == m.ReplicaState.ready:
            used[r.worker_id] += sizes.get((r.model, r.block_id), 0)
    return {w: max(0, info.capacities.get(m.Tier.host, 0) - used[w]) for w, info in alive_workers(view).items()}


def plan_pool_fills(view: m.ClusterView, open_models: Collection[str] = (),
                    only_model: str | None = None) -> list[tuple[m.ModelInfo, PoolFill]]:
    """The fills that keep every model's complete host copy, off the workers serving it where
    there is room (or, for a mode that wants it, a copy on every alive worker), model by model
    in the view's order. Modes without a pool are left out, and so are `open_models`: their
    scale-outs' loads are bringing copies into host tiers."""
    alive = alive_workers(view)
    free: dict[str, int] | None = None  # computed once, when a model needs it
    out: list[tuple[m.ModelInfo, PoolFill]] = []
    for model in view.models:
        spec = mode_spec(model.scaling_mode)
        if not spec.keeps_pool or only_model not in (None, model.name) or model.name in open_models:
            continue
        held = held_blocks(view, model.name)
        block_bytes = {b.block_id: b.nbytes for b in model.blocks}
        if spec.pool_on_every_worker:
            have = set(full_copies(block_bytes, held, alive))
            fills = [PoolFill(w, tuple(block_bytes), {}, tuple(block_bytes)) for w in alive if w not in have]
        else:
            free = free_host_bytes(view) if free is None else free
            serving = {s.worker_id for i in live_instances(view, model.name) for s in i.stages}
            fills = pool_repair(block_bytes, held, free, serving)
        out += [(model, fill) for fill in fills]
    return out
