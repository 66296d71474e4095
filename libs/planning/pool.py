"""The parameter pool (BlitzScale §5.3): every model keeps a complete copy of its blocks in
the host memory of the cluster, so a scale-out always has a source to multicast from,
however far the model was scaled in.

Pure: the planner feeds it the registry's view and carries out what it returns.
"""

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from libs.planning.placement import Held


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
                free_host_bytes: Mapping[str, int]) -> list[PoolFill]:
    """What restores a complete host copy of one model, or [] if one worker already holds it.

    `free_host_bytes` names the alive workers and the host memory each can still give. The
    copy goes to one worker when one can hold it (a multicast needs a whole copy at its
    source): the one already holding most of the model, then the one with most room, then by
    id. Its missing blocks come from surviving holders where there are any (re-replication
    over the network, faster than a disk), else from its disk. When no single worker has
    room, the blocks held nowhere are spread over the workers with most room.
    """
    workers = sorted(free_host_bytes)
    have = host_holdings(held, workers)
    wanted = set(block_bytes)
    if not wanted or any(wanted <= have.get(w, set()) for w in workers):
        return []

    def bytes_of(blocks: Iterable[int]) -> int:
        return sum(block_bytes[b] for b in blocks)

    holder = {b: w for w in workers for b in sorted(have.get(w, ())) if b in wanted}
    fits = [w for w in workers if bytes_of(wanted - have.get(w, set())) <= free_host_bytes[w]]
    if fits:
        w = min(fits, key=lambda w: (-bytes_of(wanted & have.get(w, set())), -free_host_bytes[w], w))
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
