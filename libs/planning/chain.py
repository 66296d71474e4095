"""BlitzScale's online multicast-chain planner (§5.1, Fig. 11).

Network model (§5.1): GPUs joined by a scale-up fabric (NVLink) form a group
that acts as one logical node, because broadcasting inside it is almost free;
every GPU has its own scale-out link (``bandwidth_gbps``) to a leaf switch;
GPUs on one leaf are a full mesh, leaves are joined by a spine that we do not
model.  The planner builds serial forwarding chains S→T1→T2→…, which are
optimal for bandwidth-bound broadcast because every hop streams at link speed
while the next hop forwards (Fig. 13a).

Fig. 11, step by step (line numbers refer to the figure):

1. Prune sources whose egress already carries serving traffic (e.g. a prefill
   instance pushing KV caches); scaling traffic in the same direction on the
   same link would interfere (§4, Fig. 7).  Group the rest by leaf, order the
   leaves by aggregate bandwidth (fastest first), flatten.
2. Group targets by scale-up domain, order the groups by aggregate bandwidth
   (fastest first: they turn into serving capacity soonest, Fig. 13b), then
   order leaves by where their first source sits in the source list.
3-10. Pop target groups in that order.  If the group's own leaf has enough
   source bandwidth, rotate the source list to a source on that leaf (lines
   6-7: one chain per leaf avoids slow inter-leaf hops).  Take sources from
   the front until their bandwidth covers the group (line 8: several GPUs can
   feed one group in parallel, Fig. 14), record the hop, then push the group
   to the *front* of the source list (line 10), so the next target is fed by
   it: that is what makes chains.

Pure and deterministic: ties keep input order.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

from libs.planning.multicast import MulticastPlan, chain_schedule

__all__ = ["Gpu", "ChainHop", "plan_chain_hops", "plan_chains", "chain_ids", "usable_sources",
           "plan_multicast_chains", "chains_over_nodes", "CHAIN_ALGORITHMS", "chain_plan_over_nodes"]


@dataclass(frozen=True, slots=True)
class Gpu:
    """One accelerator as the planner sees it.

    ``scaleup_group`` names its NVLink domain (None: a domain of its own);
    ``busy_egress`` says its outgoing link carries serving traffic now.
    """

    id: int
    host: str
    leaf: Hashable
    scaleup_group: Hashable | None
    bandwidth_gbps: float
    busy_egress: bool = False


@dataclass(frozen=True, slots=True)
class ChainHop:
    """Fig. 11's plan entry (G_src, G_tgt): ``sources`` feed the ``targets`` group."""

    sources: tuple[Gpu, ...]
    targets: tuple[Gpu, ...]


def _bw(gpus: Sequence[Gpu]) -> float:
    return sum(g.bandwidth_gbps for g in gpus)


def _group_key(g: Gpu) -> Hashable:
    return ("group", g.scaleup_group) if g.scaleup_group is not None else ("gpu", g.id)


def _group_by(items: Sequence[Gpu], key: Callable[[Gpu], Hashable]) -> list[list[Gpu]]:
    # Group preserving first-appearance order (determinism without sorting keys
    # that may have mixed types).
    order: list[Hashable] = []
    groups: dict[Hashable, list[Gpu]] = {}
    for g in items:
        k = key(g)
        if k not in groups:
            groups[k] = []
            order.append(k)
        groups[k].append(g)
    return [groups[k] for k in order]


def plan_chain_hops(sources: Sequence[Gpu], targets: Sequence[Gpu], n: int) -> list[ChainHop]:
    """Fig. 11: the hop list (G_src, G_tgt) for loading ``n`` target GPUs.

    Targets are consumed a scale-up group at a time; the last group is cut
    to the GPUs still needed.  A target group with a busy egress is served
    but forwards only as a last resort (pruning, line 1, applied to the GPUs
    that will serve live while still loading, Fig. 12).  If every source is
    busy the planner falls back to the busy ones: scaling with interference
    beats not scaling.
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if not sources:
        raise ValueError("plan_chains needs at least one source")
    ids = [g.id for g in sources] + [g.id for g in targets]
    if len(set(ids)) != len(ids):
        raise ValueError("GPU ids must be unique across sources and targets")
    if n == 0 or not targets:
        return []

    # Line 1: prune, group by leaf, fastest leaves first, flatten.
    usable = [g for g in sources if not g.busy_egress] or list(sources)
    leaves = _group_by(usable, lambda g: g.leaf)
    leaves = sorted(leaves, key=lambda grp: -_bw(grp))  # stable: ties keep input order
    # Each element of the source list is a logical node (tuple of GPUs).
    d_src: list[tuple[Gpu, ...]] = [
        (g,) for grp in leaves for g in sorted(grp, key=lambda g: -g.bandwidth_gbps)
    ]

    # Line 2: group targets by scale-up domain, fastest first; leaves with
    # sources first, in the order their first source appears.
    tgroups = sorted(_group_by(targets, _group_key), key=lambda grp: -_bw(grp))
    first_src: dict[Hashable, int] = {}
    for idx, unit in enumerate(d_src):
        first_src.setdefault(unit[0].leaf, idx)
    by_leaf = _group_by([grp[0] for grp in tgroups], lambda g: g.leaf)  # leaf order of first group
    leaf_order = [grp[0].leaf for grp in by_leaf]
    leaf_rank = {leaf: (first_src.get(leaf, len(d_src)), pos) for pos, leaf in enumerate(leaf_order)}
    d_tgt = sorted(tgroups, key=lambda grp: leaf_rank[grp[0].leaf])

    plan: list[ChainHop] = []
    m = 0
    for grp in d_tgt:  # line 4
        if m >= n:
            break
        g_tgt = tuple(grp[: n - m])
        need = _bw(g_tgt)
        leaf = g_tgt[0].leaf
        # Lines 6-7: enough source bandwidth on the target's own leaf → rotate
        # the list so a local source comes first.
        local = sum(_bw(u) for u in d_src if u[0].leaf == leaf)
        if local >= need and any(u[0].leaf == leaf for u in d_src):
            k = next(i for i, u in enumerate(d_src) if u[0].leaf == leaf)
            d_src = d_src[k:] + d_src[:k]
        # Line 8: take sources from the front until they cover the group.
        g_src: list[tuple[Gpu, ...]] = []
        got = 0.0
        while d_src and (not g_src or got < need):
            unit = d_src.pop(0)
            g_src.append(unit)
            got += _bw(unit)
        plan.append(ChainHop(sources=tuple(g for u in g_src for g in u), targets=g_tgt))  # line 9
        m += len(g_tgt)
        # Line 10: the fresh group feeds the next target.  Sources taken for
        # this hop are spent.  A group that must keep its egress quiet goes to
        # the back instead: it forwards only if nothing else is left.
        if any(g.busy_egress for g in g_tgt):
            d_src.append(g_tgt)
        else:
            d_src.insert(0, g_tgt)
    return plan


def plan_chains(sources: Sequence[Gpu], targets: Sequence[Gpu], n: int) -> list[list[Gpu]]:
    """Chains ``[source, t1, t2, …]`` from :func:`plan_chain_hops`.

    A hop extends the chain whose tail is the first GPU of its source set (a
    group forwards as one logical node, so its GPUs sit next to each other);
    a hop fed by an original source starts a new chain.  Extra sources that
    only added bandwidth to a hop (Fig. 14) are visible in the hop list, not
    here.  Every selected target appears exactly once, every chain starts at
    a source.
    """
    hops = plan_chain_hops(sources, targets, n)
    source_ids = {g.id for g in sources}
    chains: list[list[Gpu]] = []
    chain_of_tail: dict[int, int] = {}  # GPU id of a chain's last group member → chain index
    group_tail: dict[int, int] = {}  # any GPU id of a target group → id of that group's last GPU
    for hop in hops:
        head = hop.sources[0]
        if head.id in source_ids:
            idx = len(chains)
            chains.append([head])
        else:
            idx = chain_of_tail[group_tail[head.id]]
        chains[idx].extend(hop.targets)
        tail = hop.targets[-1].id
        for g in hop.targets:
            group_tail[g.id] = tail
        chain_of_tail[tail] = idx
    return chains


def chain_ids(chains: Sequence[Sequence[Gpu]]) -> list[list[int]]:
    """GPU ids of each chain, ready for :func:`libs.planning.multicast.chain_schedule`."""
    return [[g.id for g in chain] for chain in chains]


# ---------------------------------------------------------------------------
# Chains the executors carry out: one MulticastPlan (libs.planning.multicast)
# ---------------------------------------------------------------------------
#
# plan_chain_hops follows Fig. 11 literally, and a hop there may take several
# sources to cover one group's bandwidth (Fig. 14).  The data plane runs a
# MulticastPlan under the single-port model instead: a node receives each block
# once, from one sender.  plan_multicast_chains keeps Fig. 11's decisions that
# fit that model (prune busy sources, a scale-up group is one logical node,
# chains stay on their leaf, a group that must keep its egress quiet sits at a
# chain's tail) and uses every local source for chains of its own leaf.

# The registry's chain algorithms (libs.planning.multicast.MULTICAST_ALGORITHMS) planned here:
# name -> whether the planner reads leaves and scale-up groups (chain-blind: the baseline).
CHAIN_ALGORITHMS: dict[str, bool] = {"chain": True, "chain-blind": False}


def usable_sources(sources: Sequence[Gpu]) -> list[Gpu]:
    """Fig. 11 line 1: sources whose egress is quiet; all of them when none is (scaling with
    interference beats not scaling)."""
    return [g for g in sources if not g.busy_egress] or list(sources)


def _units(targets: Sequence[Gpu]) -> list[list[Gpu]]:
    """Target scale-up groups (one logical node each), fastest first (Fig. 11 line 2); a group
    with a busy member goes last, and that member last in it: it forwards only as a last resort.
    A group never spans leaves (NVLink does not), so its key includes the leaf."""
    groups = _group_by(targets, lambda g: ("group", g.leaf, g.scaleup_group) if g.scaleup_group is not None
                       else ("gpu", g.id))
    groups = [sorted(grp, key=lambda g: g.busy_egress) for grp in groups]  # stable
    return sorted(groups, key=lambda grp: (any(g.busy_egress for g in grp), -_bw(grp)))


def _topology_chains(sources: Sequence[Gpu], targets: Sequence[Gpu]) -> list[list[Gpu]]:
    units = _units(targets)
    units_by_leaf: dict[Hashable, list[list[Gpu]]] = {}
    for unit in units:
        units_by_leaf.setdefault(unit[0].leaf, []).append(unit)
    sources_by_leaf: dict[Hashable, list[Gpu]] = {}
    for g in usable_sources(sources):
        sources_by_leaf.setdefault(g.leaf, []).append(g)

    chains: list[list[Gpu]] = []
    crossed: list[bool] = []  # the chain already left its head's leaf (crossed the spine)
    used: set[int] = set()
    orphans: list[Hashable] = []  # leaves with targets and no usable source
    for leaf, leaf_units in units_by_leaf.items():  # leaves in the order of their fastest group
        local = sources_by_leaf.get(leaf, [])
        if not local:
            orphans.append(leaf)
            continue
        # One chain per local source (as many as there are groups), groups dealt to the
        # chain with the fewest GPUs so far: chains of a leaf never leave it (lines 6-7).
        mine = list(range(len(chains), len(chains) + min(len(local), len(leaf_units))))
        for head in local[: len(mine)]:
            chains.append([head])
            crossed.append(False)
            used.add(head.id)
        for unit in leaf_units:
            chains[min(mine, key=lambda i: len(chains[i]))].extend(unit)
    spare = [g for leaf_sources in sources_by_leaf.values() for g in leaf_sources if g.id not in used]
    for leaf in orphans:
        leaf_units = units_by_leaf[leaf]
        gpus = [g for unit in leaf_units for g in unit]
        if spare:  # a source left over on another leaf: its chain crosses the spine once
            chains.append([spare.pop(0), *gpus])
            crossed.append(True)
            continue
        # No source left: the whole leaf hangs off the shortest chain that has not crossed yet
        # (one spine crossing for the leaf), else off the shortest chain.
        local_chains = [i for i in range(len(chains)) if not crossed[i]] or list(range(len(chains)))
        i = min(local_chains, key=lambda i: len(chains[i]))
        chains[i].extend(gpus)
        crossed[i] = True
    return chains


def _blind_chains(sources: Sequence[Gpu], targets: Sequence[Gpu]) -> list[list[Gpu]]:
    # The same sources, targets in id order cut into contiguous runs whose sizes differ by at
    # most one (kway_subgroups' split): what a planner that ignores leaves and groups does.
    heads = usable_sources(sources)[: len(targets)]
    ordered = sorted(targets, key=lambda g: g.id)
    base, rem = divmod(len(ordered), len(heads))
    chains, nxt = [], 0
    for i, head in enumerate(heads):
        size = base + (1 if i < rem else 0)
        chains.append([head, *ordered[nxt: nxt + size]])
        nxt += size
    return chains


def plan_multicast_chains(sources: Sequence[Gpu], targets: Sequence[Gpu], *,
                          topology_aware: bool = True) -> list[list[Gpu]]:
    """Chains ``[source, t1, t2, …]`` that together reach every target once.

    Topology-aware: busy sources pruned while a quiet one exists; each leaf with sources gets
    one chain per local source (up to its number of scale-up groups) over its own groups, so
    those chains never cross the spine; a leaf without a source is fed by a source left over
    elsewhere, else appended to a chain that has not crossed yet (one crossing).  A scale-up
    group's GPUs sit next to each other in one chain: the chain enters at one member, the
    others are fed inside the group, its last member forwards.

    ``topology_aware=False`` (the ``chain-blind`` baseline): the same sources, targets in id
    order split evenly among them, leaves and groups ignored.
    """
    if not sources:
        raise ValueError("plan_multicast_chains needs at least one source")
    ids = [g.id for g in sources] + [g.id for g in targets]
    if len(set(ids)) != len(ids):
        raise ValueError("GPU ids must be unique across sources and targets")
    if not targets:
        return []
    return _topology_chains(sources, targets) if topology_aware else _blind_chains(sources, targets)


def chains_over_nodes(nodes: Sequence[Gpu], k: int, *, topology_aware: bool = True) -> list[list[int]]:
    """Chains of node indices for a plan over ``nodes`` whose first ``k`` hold the model
    (``nodes[i].id == i``, as a multicast benchmark numbers its nodes); a pruned source sends
    nothing.  Feed to :func:`libs.planning.multicast.chain_schedule`."""
    if any(g.id != i for i, g in enumerate(nodes)):
        raise ValueError("nodes[i].id must be i")
    return chain_ids(plan_multicast_chains(nodes[:k], nodes[k:], topology_aware=topology_aware))


def chain_plan_over_nodes(algorithm: str, nodes: Sequence[Gpu], k: int, n_blocks: int) -> MulticastPlan:
    """The MulticastPlan of a chain algorithm (a name in CHAIN_ALGORITHMS) over ``nodes``, the
    first ``k`` holding the model (see chains_over_nodes): what a multicast benchmark over an
    emulated topology runs for ``chain`` and ``chain-blind``."""
    chains = chains_over_nodes(nodes, k, topology_aware=CHAIN_ALGORITHMS[algorithm])
    return MulticastPlan(algorithm, k, chain_schedule(chains, n_blocks))
