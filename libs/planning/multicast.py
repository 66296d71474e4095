"""Block-multicast schedules: binomial pipeline, k-way, star, binary tree, chain.

Every schedule is a flat list of :class:`Transfer` under the single-port model
used by the papers: steps are numbered from 0, in one step a node sends at most
one block and receives at most one block, and a transfer at step ``s`` may only
send a block the sender held *before* step ``s`` (sources hold every block from
the start).  Executors run schedules data-driven (a worker sends a block as soon
as it holds it and its schedule says so), so the step number is an ordering,
not a barrier.

Sources: λScale §4.2 (binomial pipeline, k-way order, Alg. 1 and Alg. 2),
FaaScale §4, Derecho RDMC (Behrens et al., DSN'18) for the hypercube schedule
and its "twin" handling of node counts that are not powers of two, FaaSNet for
the binary tree baseline, BlitzScale §5.1 for chains.

:data:`MULTICAST_ALGORITHMS` registers each algorithm once, under the one name plans,
records, transfer parts and benchmarks use: its schedule, its cost model (time bound and
step timing), whether it sends from several sources, how choose_multicast weighs it, and
its execution-pipeline groups; whether those groups can serve at all is read off the
schedule (:func:`holds_jointly_before_alone`).

Everything here is pure and deterministic.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property

__all__ = [
    "Transfer",
    "ScheduleError",
    "binomial_schedule",
    "kway_block_orders",
    "kway_subgroups",
    "kway_schedule",
    "star_schedule",
    "binary_tree_schedule",
    "chain_schedule",
    "execution_pipelines",
    "arrival_steps",
    "pipeline_ready_steps",
    "first_pipeline_step",
    "pipeline_stages",
    "schedule_steps",
    "validate_schedule",
    "ceil_log2",
    "NodePart",
    "node_parts",
    "step_bound_s",
    "chain_bound_s",
    "holds_jointly_before_alone",
    "kway_pipeline_groups",
    "receivers_as_one_group",
    "kway_chain_schedule",
    "CostModel",
    "BLOCK_STEPS",
    "CHUNK_RELAY",
    "MulticastPlan",
    "ChoiceCandidate",
    "MulticastAlgorithm",
    "MULTICAST_ALGORITHMS",
    "ALGORITHM_ALIASES",
    "multicast_algorithm",
    "build_plan",
    "plan_bound_s",
    "fabric_bound_s",
    "plan_pipeline_groups",
]


@dataclass(frozen=True, slots=True, order=True)
class Transfer:
    """Node ``src`` sends block ``block`` to node ``dst`` in step ``step``."""

    step: int
    src: int
    dst: int
    block: int


class ScheduleError(ValueError):
    """A schedule breaks the single-port / causality / completeness rules."""


def ceil_log2(n: int) -> int:
    """⌈log2 n⌉ for n ≥ 1, exact on integers (no float rounding)."""
    if n < 1:
        raise ValueError(f"ceil_log2 needs n >= 1, got {n}")
    return (n - 1).bit_length()


def _check_sizes(n_nodes: int, n_blocks: int) -> None:
    if n_nodes < 1:
        raise ValueError(f"n_nodes must be >= 1, got {n_nodes}")
    if n_blocks < 1:
        raise ValueError(f"n_blocks must be >= 1, got {n_blocks}")


def _sorted(transfers: Iterable[Transfer]) -> list[Transfer]:
    # One canonical order so equal plans compare equal and executors can
    # stream a node's part in step order.
    return sorted(transfers, key=lambda t: (t.step, t.src, t.dst, t.block))


# ---------------------------------------------------------------------------
# Binomial pipeline (λScale §4.2, RDMC's hypercube schedule)
# ---------------------------------------------------------------------------


def _hypercube_block(v: int, step: int, dims: int) -> int | None:
    """Block vertex ``v`` receives in ``step`` of the 2^dims binomial pipeline.

    RDMC's rule: in step s every vertex exchanges with its neighbour across
    dimension i = s mod dims; what v receives depends only on v's label
    rotated right by i (bit i of v becomes bit 0).  Vertex 1<<i is fed fresh
    blocks by the source (block s); a vertex whose bit i is clear receives the
    block that entered the cube dims steps ago; otherwise the lowest other set
    bit j says how far behind the front its copy is.  Block numbers are
    unclamped here; the caller clamps to the last block and drops repeats.
    """
    i = step % dims
    mask = (1 << dims) - 1
    r = ((v >> i) | (v << (dims - i))) & mask
    if r & 1 == 0:
        return step - dims if step >= dims else None
    if r == 1:
        return step
    j = ((r >> 1) & -(r >> 1)).bit_length()  # index of the lowest set bit above bit 0
    return step + j - dims if step + j >= dims else None


def _hypercube_steps(dims: int, n_blocks: int) -> list[list[tuple[int, int, int]]]:
    """Per step, the (sender, receiver, block) vertex transfers of a 2^dims cube.

    ``n_blocks + dims - 1`` steps.  Clamping to the last block (as RDMC does)
    creates repeats near the end; a vertex never receives a block twice here,
    the first copy wins (it is the one the pipeline proof relies on).
    """
    n_vertices = 1 << dims
    held: list[set[int]] = [set() for _ in range(n_vertices)]
    held[0] = set(range(n_blocks))
    steps: list[list[tuple[int, int, int]]] = []
    for step in range(n_blocks + dims - 1):
        moves: list[tuple[int, int, int]] = []
        bit = 1 << (step % dims)
        for v in range(1, n_vertices):
            blk = _hypercube_block(v, step, dims)
            if blk is None:
                continue
            blk = min(blk, n_blocks - 1)
            if blk in held[v]:
                continue
            u = v ^ bit
            if blk not in held[u]:  # pragma: no cover - guarded by the property tests
                raise AssertionError(f"hypercube: vertex {u} lacks block {blk} at step {step}")
            moves.append((u, v, blk))
        for _, v, blk in moves:
            held[v].add(blk)
        steps.append(moves)
    return steps


def binomial_schedule(n_nodes: int, n_blocks: int) -> list[Transfer]:
    """1→N binomial pipeline with node 0 the source (λScale §4.2, RDMC).

    Takes exactly ``n_blocks + ceil(log2 n_nodes) - 1`` steps for n_nodes ≥ 2,
    which is optimal: the block the source sends last leaves it at step
    ≥ n_blocks-1 and its holders at most double per step.

    Node counts that are not powers of two use RDMC's twin construction: the
    hypercube has 2^l vertices with l = ⌊log2 N⌋; vertex 0 is the source alone
    and vertex v in 1..N-2^l is a *pair* of nodes {v, v + 2^l - 1}.  A pair
    acts as one vertex of the cube and uses its two ports to keep both nodes
    fed: in each step one node of the pair (E) sends the vertex's outgoing
    block while the other (F) takes the vertex's incoming block and hands E
    the one block only F has.  Invariant (checked by the property tests): each
    node of a pair lacks at most one block its twin holds, so one extra step
    where the twins swap their last exclusive blocks completes both.  The cube
    takes n_blocks + l - 1 steps, the swap one more: n_blocks + ⌈log2 N⌉ - 1.
    (RDMC flips the inter-vertex receiver on a fixed parity rule; choosing E
    from what each twin holds gives the same step count with a simpler proof.)
    """
    _check_sizes(n_nodes, n_blocks)
    if n_nodes == 1:
        return []
    dims = n_nodes.bit_length() - 1  # ⌊log2 N⌋
    cube = 1 << dims
    extra = n_nodes - cube  # vertices 1..extra are doubled

    def twin(v: int) -> int:
        return v + cube - 1

    # exclusive[v] = (block only p=v holds, block only q=twin(v) holds)
    excl_p: dict[int, int | None] = {v: None for v in range(1, extra + 1)}
    excl_q: dict[int, int | None] = {v: None for v in range(1, extra + 1)}
    out: list[Transfer] = []

    for step, moves in enumerate(_hypercube_steps(dims, n_blocks)):
        send_of: dict[int, tuple[int, int]] = {u: (v, b) for u, v, b in moves}
        recv_of: dict[int, int] = {v: b for _, v, b in moves}
        sender_node: dict[int, int] = {}
        receiver_node: dict[int, int] = {}
        intra: list[tuple[int, int, int]] = []  # (src node, dst node, block)
        new_excl: dict[int, tuple[int | None, int | None]] = {}

        for v in range(1, extra + 1):
            p, q = v, twin(v)
            ep, eq = excl_p[v], excl_q[v]
            out_blk = send_of[v][1] if v in send_of else None
            in_blk = recv_of.get(v)
            if out_blk is not None:
                # E must hold the outgoing block; when both do, let the twin
                # with an exclusive block be F so that block gets shared.
                if out_blk == ep:
                    e_is_p = True
                elif out_blk == eq:
                    e_is_p = False
                else:
                    e_is_p = not (ep is not None and eq is None)
                e, f = (p, q) if e_is_p else (q, p)
                ef = eq if e_is_p else ep
                ee = ep if e_is_p else eq
                sender_node[v] = e
                receiver_node[v] = f
                if ef is not None:
                    intra.append((f, e, ef))
                # E keeps its exclusive; F's old one is now shared, F's new
                # exclusive is what it just received.
                after_e, after_f = ee, in_blk
                new_excl[v] = (after_e, after_f) if e_is_p else (after_f, after_e)
            elif in_blk is not None:
                # Only receiving: the receiver R shares its exclusive with the twin.
                r_is_p = not (eq is not None and ep is None)
                r, o = (p, q) if r_is_p else (q, p)
                er = ep if r_is_p else eq
                eo = eq if r_is_p else ep
                receiver_node[v] = r
                if er is not None:
                    intra.append((r, o, er))
                new_excl[v] = (in_blk, eo) if r_is_p else (eo, in_blk)
            else:
                # Idle vertex: the twins swap whatever only one of them holds.
                if ep is not None:
                    intra.append((p, q, ep))
                if eq is not None:
                    intra.append((q, p, eq))
                new_excl[v] = (None, None)

        for u, v, blk in moves:
            out.append(Transfer(step, sender_node.get(u, u), receiver_node.get(v, v), blk))
        out.extend(Transfer(step, s, d, b) for s, d, b in intra)
        for v, (a, b) in new_excl.items():
            excl_p[v], excl_q[v] = a, b

    if extra:
        last = n_blocks + dims - 1  # the one extra step of the twin construction
        for v in range(1, extra + 1):
            if excl_p[v] is not None:
                out.append(Transfer(last, v, twin(v), excl_p[v]))  # type: ignore[arg-type]
            if excl_q[v] is not None:
                out.append(Transfer(last, twin(v), v, excl_q[v]))  # type: ignore[arg-type]
    return _sorted(out)


# ---------------------------------------------------------------------------
# k-way transmission (λScale Alg. 1) and execution pipelines (Alg. 2)
# ---------------------------------------------------------------------------


def kway_block_orders(n_blocks: int, k: int) -> list[list[int]]:
    """λScale Alg. 1: cut the blocks into k chunks of ⌈b/k⌉, shift circularly.

    Sub-group i sends chunk i first, then i+1, …, so the k sub-groups fill
    complementary parts of the model at the same time and cross-group
    pipelines hold a full model after about b/k steps.  With b < k some chunks
    are empty (Alg. 1 as written); those sub-groups then share an order.
    """
    if n_blocks < 1:
        raise ValueError(f"n_blocks must be >= 1, got {n_blocks}")
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    size = -(-n_blocks // k)  # l = ⌈b/k⌉ (Alg. 1 line 1)
    chunks = [list(range(size * i, min(size * (i + 1), n_blocks))) for i in range(k)]
    return [[b for j in range(k) for b in chunks[(i + j) % k]] for i in range(k)]


def kway_subgroups(n_nodes: int, k: int) -> list[list[int]]:
    """Target nodes of each k-way sub-group (sources 0..k-1 excluded).

    Targets k..N-1 are split into k contiguous runs whose sizes differ by at
    most one, the first (N-k) mod k runs taking the extra node (λScale §4.2:
    "evenly divides the N nodes into k sub-groups"; Fig. 5 uses contiguous
    runs: nodes 3-5 and 6-8 for 2→8).
    """
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    n_targets = n_nodes - k
    if n_targets < k:
        raise ValueError(
            f"k-way needs at least one target per sub-group: k={k}, targets={max(n_targets, 0)}"
        )
    base, rem = divmod(n_targets, k)
    groups: list[list[int]] = []
    nxt = k
    for i in range(k):
        size = base + (1 if i < rem else 0)
        groups.append(list(range(nxt, nxt + size)))
        nxt += size
    return groups


def _subgroup_schedule(n_nodes: int, n_blocks: int, k: int, orders: Sequence[Sequence[int]]) -> list[Transfer]:
    out: list[Transfer] = []
    for i, targets in enumerate(kway_subgroups(n_nodes, k)):
        members = [i, *targets]  # local node 0 is sub-group i's source
        order = orders[i]
        for t in binomial_schedule(len(members), n_blocks):
            out.append(Transfer(t.step, members[t.src], members[t.dst], order[t.block]))
    return _sorted(out)


def kway_schedule(n_nodes: int, n_blocks: int, k: int) -> list[Transfer]:
    """k→N scaling (λScale §4.2): k full sources, k binomial sub-groups.

    Nodes 0..k-1 hold the model; the other nodes are split by
    :func:`kway_subgroups`; sub-group i runs a 1→L_i binomial pipeline from
    source i in the block order O_i of :func:`kway_block_orders`.  With k = 1
    this is exactly :func:`binomial_schedule`.  Steps:
    n_blocks + ⌈log2 max L_i⌉ - 1 where L_i counts the source.
    """
    _check_sizes(n_nodes, n_blocks)
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    if k >= n_nodes:
        raise ValueError(f"k={k} sources leave no target among {n_nodes} nodes")
    return _subgroup_schedule(n_nodes, n_blocks, k, kway_block_orders(n_blocks, k))


def execution_pipelines(subgroups: Sequence[Sequence[int]]) -> list[list[int]]:
    """λScale Alg. 2: build execution pipelines from the k sub-groups.

    While more than one sub-group has unassigned nodes, take the a = min
    remaining size and form a pipelines, the t-th taking the t-th unassigned
    node of every such sub-group (nodes in equal positions of differently
    shifted sub-groups hold complementary chunks).  When one sub-group is
    left, its remaining nodes form one pipeline.
    """
    remaining = [list(g) for g in subgroups if len(g) > 0]
    pipelines: list[list[int]] = []
    while remaining:
        if len(remaining) == 1:  # lines 3-5
            pipelines.append(list(remaining[0]))
            break
        a = min(len(g) for g in remaining)  # line 7
        for t in range(a):  # lines 8-12
            pipelines.append([g[t] for g in remaining])
        remaining = [g[a:] for g in remaining if len(g) > a]  # line 13
    return pipelines


# ---------------------------------------------------------------------------
# Baselines and chains
# ---------------------------------------------------------------------------


def star_schedule(n_nodes: int, n_blocks: int) -> list[Transfer]:
    """Baseline: source 0 sends the whole model to each target in turn."""
    _check_sizes(n_nodes, n_blocks)
    return [
        Transfer((dst - 1) * n_blocks + blk, 0, dst, blk)
        for dst in range(1, n_nodes)
        for blk in range(n_blocks)
    ]


def binary_tree_schedule(n_nodes: int, n_blocks: int) -> list[Transfer]:
    """Baseline (FaaSNet): block-pipelined binary tree rooted at source 0.

    Heap layout (children of i are 2i+1, 2i+2).  Each node forwards blocks in
    order, each block to its children in turn; with one send port a parent
    needs two steps per block, which is why the tree trails the binomial
    pipeline (λScale §7).
    """
    _check_sizes(n_nodes, n_blocks)
    queues: list[list[tuple[int, int]]] = []
    for v in range(n_nodes):
        kids = [c for c in (2 * v + 1, 2 * v + 2) if c < n_nodes]
        queues.append([(c, b) for b in range(n_blocks) for c in kids])
    got_at: list[list[int | None]] = [[None] * n_blocks for _ in range(n_nodes)]
    head = [0] * n_nodes
    out: list[Transfer] = []
    step = 0
    pending = sum(len(q) for q in queues)
    while pending:
        for v in range(n_nodes):
            if head[v] == len(queues[v]):
                continue
            child, blk = queues[v][head[v]]
            held = v == 0 or (got_at[v][blk] is not None and got_at[v][blk] < step)  # type: ignore[operator]
            if held:
                out.append(Transfer(step, v, child, blk))
                got_at[child][blk] = step
                head[v] += 1
                pending -= 1
        step += 1
    return _sorted(out)


def chain_schedule(chains: Sequence[Sequence[int]], n_blocks: int) -> list[Transfer]:
    """Serial forwarding chains S→T1→…→Tn (BlitzScale §5.1, Fig. 13a).

    Each chain's head holds the model; position p forwards block j in step
    j + p, so a chain of m targets takes n_blocks + m - 1 steps whatever m's
    links are.  Chains run side by side and must not share nodes.
    """
    if n_blocks < 1:
        raise ValueError(f"n_blocks must be >= 1, got {n_blocks}")
    seen: set[int] = set()
    for chain in chains:
        for node in chain:
            if node in seen:
                raise ValueError(f"node {node} appears in more than one chain position")
            seen.add(node)
    out = [
        Transfer(blk + p, chain[p], chain[p + 1], blk)
        for chain in chains
        for p in range(len(chain) - 1)
        for blk in range(n_blocks)
    ]
    return _sorted(out)


# ---------------------------------------------------------------------------
# Analysis helpers shared by tests, the planner and the executors
# ---------------------------------------------------------------------------


def schedule_steps(schedule: Iterable[Transfer]) -> int:
    """Number of steps a schedule spans (last step + 1; 0 when empty)."""
    return max((t.step for t in schedule), default=-1) + 1


def validate_schedule(
    schedule: Iterable[Transfer],
    n_nodes: int,
    n_blocks: int,
    sources: Collection[int] = (0,),
    targets: Collection[int] | None = None,
) -> int:
    """Check a schedule under the single-port model; return its step count.

    Raises :class:`ScheduleError` when a node id or block is out of range, a
    node sends to itself, a node sends or receives more than one block in a
    step, a sender did not hold the block before the step, a node receives a
    block it already has (or a source receives at all), or a target (default:
    every non-source node) ends without some block.
    """
    src_set = set(sources)
    for s in src_set:
        if not 0 <= s < n_nodes:
            raise ScheduleError(f"source {s} outside 0..{n_nodes - 1}")
    tgt_set = set(range(n_nodes)) - src_set if targets is None else set(targets)
    held: list[set[int]] = [set(range(n_blocks)) if v in src_set else set() for v in range(n_nodes)]
    by_step: dict[int, list[Transfer]] = {}
    for t in schedule:
        if t.step < 0:
            raise ScheduleError(f"negative step in {t}")
        if not (0 <= t.src < n_nodes and 0 <= t.dst < n_nodes):
            raise ScheduleError(f"node outside 0..{n_nodes - 1} in {t}")
        if not 0 <= t.block < n_blocks:
            raise ScheduleError(f"block outside 0..{n_blocks - 1} in {t}")
        if t.src == t.dst:
            raise ScheduleError(f"self transfer {t}")
        by_step.setdefault(t.step, []).append(t)
    for step in sorted(by_step):
        senders: set[int] = set()
        receivers: set[int] = set()
        for t in by_step[step]:
            if t.src in senders:
                raise ScheduleError(f"node {t.src} sends twice in step {step}")
            if t.dst in receivers:
                raise ScheduleError(f"node {t.dst} receives twice in step {step}")
            senders.add(t.src)
            receivers.add(t.dst)
            if t.block not in held[t.src]:
                raise ScheduleError(f"node {t.src} sends block {t.block} in step {step} before holding it")
            if t.block in held[t.dst]:
                raise ScheduleError(f"node {t.dst} receives block {t.block} again in step {step}")
        for t in by_step[step]:
            held[t.dst].add(t.block)
    for v in sorted(tgt_set):
        if not 0 <= v < n_nodes:
            raise ScheduleError(f"target {v} outside 0..{n_nodes - 1}")
        if len(held[v]) != n_blocks:
            missing = sorted(set(range(n_blocks)) - held[v])
            raise ScheduleError(f"node {v} never receives blocks {missing[:8]}")
    return max(by_step, default=-1) + 1


def arrival_steps(
    schedule: Iterable[Transfer], n_nodes: int, n_blocks: int, sources: Collection[int] = (0,)
) -> list[list[int | None]]:
    """``arr[node][block]``: step after which the node holds the block.

    -1 for sources (held from the start), ``None`` if never received.
    """
    arr: list[list[int | None]] = [
        [-1] * n_blocks if v in sources else [None] * n_blocks for v in range(n_nodes)
    ]
    for t in schedule:
        cur = arr[t.dst][t.block]
        if cur is None or t.step < cur:
            arr[t.dst][t.block] = t.step
    return arr


def pipeline_ready_steps(
    schedule: Iterable[Transfer],
    n_blocks: int,
    pipelines: Sequence[Sequence[int]],
    sources: Collection[int] = (),
) -> list[int]:
    """For each pipeline, the step after which its nodes jointly hold every block.

    -1 when a member is a source (ready from the start).  Raises ValueError
    if a pipeline never becomes complete under the schedule.
    """
    nodes = {v for p in pipelines for v in p}
    first: dict[tuple[int, int], int] = {}
    for t in schedule:
        if t.dst in nodes:
            key = (t.dst, t.block)
            if key not in first or t.step < first[key]:
                first[key] = t.step
    ready: list[int] = []
    for p in pipelines:
        if any(v in sources for v in p):
            ready.append(-1)
            continue
        worst = -1
        for blk in range(n_blocks):
            steps = [first[(v, blk)] for v in p if (v, blk) in first]
            if not steps:
                raise ValueError(f"pipeline {list(p)} never holds block {blk}")
            worst = max(worst, min(steps))
        ready.append(worst)
    return ready


def first_pipeline_step(
    schedule: Iterable[Transfer],
    n_blocks: int,
    pipelines: Sequence[Sequence[int]],
    sources: Collection[int] = (),
) -> int:
    """The step after which *each* pipeline jointly holds every block.

    This is the max of :func:`pipeline_ready_steps`; the first pipeline to
    become usable is its min.
    """
    return max(pipeline_ready_steps(schedule, n_blocks, pipelines, sources), default=-1)


def pipeline_stages(
    pipeline: Sequence[int], holdings: Mapping[int, Collection[int]], n_blocks: int
) -> list[tuple[int, int, int]]:
    """Stages ``(node, first_block, last_block)`` covering blocks 0..b-1.

    Greedy interval cover over the pipeline's nodes: at each uncovered block,
    take the node whose held run from there reaches furthest (ties: earlier
    in the pipeline).  This gives the fewest stages, i.e. the fewest
    activation hops (λScale §4.3 keeps cross-node traffic low).  Raises
    ValueError if the nodes do not jointly hold every block.
    """
    stages: list[tuple[int, int, int]] = []
    blk = 0
    while blk < n_blocks:
        best_node, best_end = None, blk - 1
        for node in pipeline:
            have = holdings.get(node, ())
            end = blk - 1
            while end + 1 < n_blocks and (end + 1) in have:
                end += 1
            if end > best_end:
                best_node, best_end = node, end
        if best_node is None:
            raise ValueError(f"pipeline {list(pipeline)} lacks block {blk}")
        stages.append((best_node, blk, best_end))
        blk = best_end + 1
    return stages


# ---------------------------------------------------------------------------
# Executor hand-off and time bounds
# ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class NodePart:
    """One node's share of a schedule: what it sends and what it receives, each in step order.

    A node sends one block at a time in this order, each as soon as it holds it
    (single send port); receives may complete in any order.
    """

    sends: tuple[Transfer, ...]
    receives: tuple[Transfer, ...]


def node_parts(schedule: Iterable[Transfer], n_nodes: int) -> list[NodePart]:
    """Split a schedule into per-node parts (index = node)."""
    sends: list[list[Transfer]] = [[] for _ in range(n_nodes)]
    receives: list[list[Transfer]] = [[] for _ in range(n_nodes)]
    for t in _sorted(schedule):
        if not (0 <= t.src < n_nodes and 0 <= t.dst < n_nodes):
            raise ScheduleError(f"node outside 0..{n_nodes - 1} in {t}")
        sends[t.src].append(t)
        receives[t.dst].append(t)
    return [NodePart(tuple(s), tuple(r)) for s, r in zip(sends, receives)]


def step_bound_s(n_steps: int, n_blocks: int, total_bytes: int, rate_bytes_per_s: float) -> float:
    """Time a block-granular schedule needs at best: each step moves one block (M/B) per link.

    1→N binomial: (M/R)·(B + ⌈log2 N⌉ − 1)/B; star: (N − 1)·M/R; a block-pipelined
    binary tree: about 2M/R plus its depth's fill (the step count says exactly).
    """
    if n_blocks < 1 or rate_bytes_per_s <= 0:
        raise ValueError("need n_blocks >= 1 and a positive rate")
    return n_steps * (total_bytes / n_blocks) / rate_bytes_per_s


def chain_bound_s(n_nodes: int, total_bytes: int, chunk_bytes: int, rate_bytes_per_s: float) -> float:
    """A chain of n nodes (source included) forwarding cut-through in chunks of c: (M + (n − 2)·c)/R."""
    if n_nodes < 2 or rate_bytes_per_s <= 0:
        raise ValueError("a chain needs at least 2 nodes and a positive rate")
    return (total_bytes + (n_nodes - 2) * min(chunk_bytes, total_bytes)) / rate_bytes_per_s



# ---------------------------------------------------------------------------
# When receivers can serve jointly (execution pipelines)
# ---------------------------------------------------------------------------


def holds_jointly_before_alone(
    schedule: Iterable[Transfer],
    n_nodes: int,
    n_blocks: int,
    group: Collection[int],
    sources: Collection[int] = (0,),
) -> bool:
    """Whether the group's nodes jointly hold every block after some step at which none of
    them holds every block alone: the window in which they can serve as one execution
    pipeline (λScale §4.3) while no member could serve on its own.

    Read off the arrival steps: the step after which the group's union first covers the
    model comes strictly before the group's first complete copy. A chain's (or a star's, or
    a binary tree's) receivers each hold a prefix of the blocks their sender holds, so the
    union is one member's holding and the window never opens; nor does it for a group with
    a source in it (the source holds everything from the start)."""
    members = list(group)
    if not members:
        return False
    arr = arrival_steps(schedule, n_nodes, n_blocks, sources)
    never = math.inf  # a block a node never receives
    steps = {v: [never if s is None else s for s in arr[v]] for v in members}
    jointly = max(min(steps[v][b] for v in members) for b in range(n_blocks))
    first_copy = min(max(row) for row in steps.values())
    return jointly < first_copy


def kway_pipeline_groups(n_nodes: int, k: int) -> list[list[int]]:
    """λScale Alg. 2 over the k-way sub-groups: the receiver groups that may serve as pipelines."""
    return execution_pipelines(kway_subgroups(n_nodes, k))


def receivers_as_one_group(n_nodes: int, k: int) -> list[list[int]]:
    """Every receiver in one group: the pipeline groups of an algorithm that names none."""
    return [list(range(k, n_nodes))]


def kway_chain_schedule(n_nodes: int, n_blocks: int, k: int) -> list[Transfer]:
    """BlitzScale's chains from k sources: one chain per source over its share of the targets
    (the :func:`kway_subgroups` split)."""
    chains = [[i, *group] for i, group in enumerate(kway_subgroups(n_nodes, k))]
    return chain_schedule(chains, n_blocks)


# ---------------------------------------------------------------------------
# Cost models: how long a schedule's steps take on uniform links
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class CostModel:
    """What a schedule's structure costs on links of R bytes/s, two ways.

    ``bound_s(schedule, n_blocks, total_bytes, rate, chunk_bytes)``: the time the whole
    schedule needs (what the multicast benchmark compares a run with).
    ``done_s(step, n_blocks, total_bytes, bytes_per_s, chunk_bytes, overhead_s)``: when what
    holds after ``step`` holds, with a fixed overhead per step (choose_multicast's model;
    ``chunk_bytes=None`` relays block by block)."""

    name: str
    bound_s: Callable[[Sequence[Transfer], int, int, float, int], float]
    done_s: Callable[[int, int, int, float, int | None, float], float]


def _block_steps_bound_s(schedule: Sequence[Transfer], n_blocks: int, total_bytes: int, rate: float,
                         chunk_bytes: int) -> float:
    return step_bound_s(schedule_steps(schedule), n_blocks, total_bytes, rate)


def _block_steps_done_s(step: int, n_blocks: int, total_bytes: int, bytes_per_s: float, chunk_bytes: int | None,
                        overhead_s: float) -> float:
    # Every port busy every step: a node forwards a block only once it holds all of it.
    return (step + 1) * (total_bytes / n_blocks / bytes_per_s + overhead_s)


def _chunk_relay_bound_s(schedule: Sequence[Transfer], n_blocks: int, total_bytes: int, rate: float,
                         chunk_bytes: int) -> float:
    # The deepest relay: a node at hop d receives its last block at step n_blocks + d - 2.
    return chain_bound_s(schedule_steps(schedule) - n_blocks + 2, total_bytes, chunk_bytes, rate)


def _chunk_relay_done_s(step: int, n_blocks: int, total_bytes: int, bytes_per_s: float, chunk_bytes: int | None,
                        overhead_s: float) -> float:
    # A relay forwards exactly the stream it receives while receiving the next chunk (cut-through):
    # each hop past the first costs one chunk, not one block (BlitzScale §5.1).
    block = total_bytes / n_blocks
    chunk = block if chunk_bytes is None else min(float(chunk_bytes), block)
    streamed = total_bytes * min(step + 1, n_blocks) / n_blocks
    return (streamed + max(0, step - n_blocks + 1) * chunk) / bytes_per_s + (step + 1) * overhead_s


BLOCK_STEPS = CostModel("block-steps", _block_steps_bound_s, _block_steps_done_s)
CHUNK_RELAY = CostModel("chunk-relay", _chunk_relay_bound_s, _chunk_relay_done_s)


# ---------------------------------------------------------------------------
# The algorithm registry: the one vocabulary of multicast names
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class MulticastPlan:
    """One algorithm's schedule over nodes 0..N-1, sources 0..k-1 (each holds every block)."""

    algorithm: str  # a name in MULTICAST_ALGORITHMS
    k: int
    schedule: list[Transfer]


@dataclass(frozen=True)
class ChoiceCandidate:
    """One way choose_multicast weighs an algorithm: under ``label`` (its name, or an alias
    when it weighs the algorithm twice), from one source or from every source (k = min(S, T)).
    Ties between candidates go to the lower ``prefer``."""

    label: str
    every_source: bool
    prefer: int


@dataclass(frozen=True)
class MulticastAlgorithm:
    """A multicast algorithm: its schedule and what the planner needs to know about it."""

    name: str
    # (n_nodes, n_blocks, k) -> transfers from sources 0..k-1 to every other node
    schedule: Callable[[int, int, int], list[Transfer]]
    multi_source: bool = False  # sends from k sources; otherwise from source 0 whatever k is
    cost: CostModel = BLOCK_STEPS
    # (n_nodes, k) -> receiver groups that may serve as execution pipelines while blocks arrive
    pipeline_groups: Callable[[int, int], list[list[int]]] = receivers_as_one_group
    candidates: tuple[ChoiceCandidate, ...] = ()  # how choose_multicast weighs it (none: never chosen)

    @cached_property
    def forms_pipelines(self) -> bool:
        """Whether its receivers can jointly hold the model before each holds it alone: read off
        its own schedules for small scale-outs (up to 2 sources, 6 receivers, 6 blocks), so a
        new algorithm gets execution pipelines by what its schedule does, not by its name."""
        for k in (1, 2) if self.multi_source else (1,):
            for n_targets in range(k, 7):
                for n_blocks in range(1, 7):
                    n_nodes = k + n_targets
                    schedule = self.schedule(n_nodes, n_blocks, k)
                    if holds_jointly_before_alone(schedule, n_nodes, n_blocks, range(k, n_nodes), range(k)):
                        return True
        return False


def _from_one_source(schedule: Callable[[int, int], list[Transfer]]) -> Callable[[int, int, int], list[Transfer]]:
    return lambda n_nodes, n_blocks, k: schedule(n_nodes, n_blocks)


# Name -> algorithm; the order is the benchmarks' default order. These names are the ones
# plans, scale-operation records, TransferParts and benchmarks carry
# (libs.protocol.messages.MulticastAlgorithmName; a test checks they agree).
MULTICAST_ALGORITHMS: dict[str, MulticastAlgorithm] = {a.name: a for a in (
    MulticastAlgorithm("star", _from_one_source(star_schedule)),
    MulticastAlgorithm("binary-tree", _from_one_source(binary_tree_schedule)),
    MulticastAlgorithm("chain", kway_chain_schedule, multi_source=True, cost=CHUNK_RELAY,
                       candidates=(ChoiceCandidate("chain", every_source=True, prefer=2),)),
    # Chains that ignore the topology (targets in worker-id order): the baseline the
    # topology-aware chains (libs.planning.chain, scaling mode `chain`) are measured against.
    # Without a topology both schedules are this one; the planner builds them from the view.
    MulticastAlgorithm("chain-blind", kway_chain_schedule, multi_source=True, cost=CHUNK_RELAY),
    MulticastAlgorithm("binomial", kway_schedule, multi_source=True, pipeline_groups=kway_pipeline_groups,
                       candidates=(ChoiceCandidate("binomial", every_source=False, prefer=0),
                                   ChoiceCandidate("kway", every_source=True, prefer=1))),
)}

# Other spellings, accepted wherever a name is read (choose_multicast's labels, the plan
# benchmark's rows, older records): each resolves to its registered name.
ALGORITHM_ALIASES: dict[str, str] = {
    "kway": "binomial",  # λScale's k-way transmission: the binomial pipeline from k sources
    "k-way": "binomial",
    "binary_tree": "binary-tree",
}


def multicast_algorithm(name: str) -> MulticastAlgorithm:
    """The registered algorithm of a name or an alias."""
    algorithm = MULTICAST_ALGORITHMS.get(ALGORITHM_ALIASES.get(name, name))
    if algorithm is None:
        raise ValueError(f"unknown algorithm {name!r}; choose from {', '.join(MULTICAST_ALGORITHMS)}")
    return algorithm


def build_plan(algorithm: str, n_nodes: int, n_blocks: int, k: int) -> MulticastPlan:
    """The schedule of one algorithm (a name or an alias) over nodes 0..N-1, sources 0..k-1;
    a single-source algorithm sends from source 0 only (k = 1)."""
    alg = multicast_algorithm(algorithm)
    k = k if alg.multi_source else 1
    return MulticastPlan(alg.name, k, alg.schedule(n_nodes, n_blocks, k))


def plan_bound_s(plan: MulticastPlan, n_blocks: int, total_bytes: int, rate_bytes_per_s: float,
                 chunk_bytes: int) -> float:
    """The time the plan's structure needs at link rate R (its algorithm's cost model)."""
    return multicast_algorithm(plan.algorithm).cost.bound_s(plan.schedule, n_blocks, total_bytes, rate_bytes_per_s,
                                                            chunk_bytes)


def fabric_bound_s(plan: MulticastPlan, n_blocks: int, total_bytes: int, rate_bytes_per_s: float, chunk_bytes: int,
                   leaf_of: Sequence[Hashable], uplink_bytes_per_s: float | None,
                   group_of: Sequence[Hashable | None] | None = None, scaleup_bytes_per_s: float = 0.0) -> float:
    """plan_bound_s on a leaf-spine fabric: a transfer between leaves crosses its source leaf's
    uplink and its destination leaf's downlink (``uplink_bytes_per_s`` each way; None: not a
    bottleneck), and the transfers on one of them at once share it evenly (the fluid fair
    share); a transfer inside a scale-up group (``group_of[v]`` equal, not None) runs at
    ``scaleup_bytes_per_s`` when that is set. Node v sits on leaf ``leaf_of[v]``.

    Chunk-relay plans (chains) run every hop at once for the whole transfer: a chain finishes
    in (M + (h - 1)·c) / r, h its hops and r its slowest hop's share. Block-step plans take
    their steps one after another, each as long as its slowest transfer of one block M/B.
    With one leaf, or no uplink cap, and no scale-up groups this is plan_bound_s."""
    groups = group_of or [None] * len(leaf_of)

    def share_rates(transfers: Sequence[tuple[int, int]]) -> list[float]:
        up: dict[Hashable, int] = {}
        down: dict[Hashable, int] = {}
        for src, dst in transfers:
            if leaf_of[src] != leaf_of[dst]:
                up[leaf_of[src]] = up.get(leaf_of[src], 0) + 1
                down[leaf_of[dst]] = down.get(leaf_of[dst], 0) + 1
        rates = []
        for src, dst in transfers:
            r = rate_bytes_per_s
            if scaleup_bytes_per_s > 0 and groups[src] is not None and groups[src] == groups[dst]:
                r = scaleup_bytes_per_s
            if uplink_bytes_per_s is not None and leaf_of[src] != leaf_of[dst]:
                r = min(r, uplink_bytes_per_s / up[leaf_of[src]], uplink_bytes_per_s / down[leaf_of[dst]])
            rates.append(r)
        return rates

    if multicast_algorithm(plan.algorithm).cost is CHUNK_RELAY:
        hops = sorted({(t.src, t.dst) for t in plan.schedule})
        rate_of = dict(zip(hops, share_rates(hops)))
        nxt = dict(hops)
        chunk = min(chunk_bytes, total_bytes)
        worst = 0.0
        for head in sorted(set(nxt) - set(nxt.values())):
            chain, v = [], head
            while v in nxt:
                chain.append(rate_of[(v, nxt[v])])
                v = nxt[v]
            worst = max(worst, (total_bytes + (len(chain) - 1) * chunk) / min(chain))
        return worst
    block = total_bytes / n_blocks
    by_step: dict[int, list[tuple[int, int]]] = {}
    for t in plan.schedule:
        by_step.setdefault(t.step, []).append((t.src, t.dst))
    return sum(block / (min(share_rates(by_step[step])) if step in by_step else rate_bytes_per_s)
               for step in range(schedule_steps(plan.schedule)))


def plan_pipeline_groups(plan: MulticastPlan, n_nodes: int) -> list[list[int]]:
    """The plan's receiver groups (of two or more) that may serve as execution pipelines while
    its blocks arrive: those whose members jointly hold the model before each holds it alone in
    this plan's own schedule (a binomial multicast from one source to two receivers is a chain:
    its group never forms, so its targets serve while they load instead of waiting for it)."""
    alg = multicast_algorithm(plan.algorithm)
    if n_nodes - plan.k < 1 or not alg.forms_pipelines or not plan.schedule:
        return []
    n_blocks = 1 + max(t.block for t in plan.schedule)
    return [list(g) for g in alg.pipeline_groups(n_nodes, plan.k)
            if len(g) >= 2 and holds_jointly_before_alone(plan.schedule, n_nodes, n_blocks, g, range(plan.k))]
