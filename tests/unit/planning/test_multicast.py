"""Property tests for the block-multicast schedules (libs/planning/multicast.py).

The single-port rules are checked twice: by ``validate_schedule`` (which the
executors use) and by an independent re-implementation here, so a bug in the
validator cannot hide a bug in a schedule.  A mutation test makes sure the
validator rejects broken schedules.
"""

from collections import Counter

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from libs.planning.multicast import (
    ScheduleError,
    Transfer,
    arrival_steps,
    binary_tree_schedule,
    binomial_schedule,
    ceil_log2,
    chain_schedule,
    execution_pipelines,
    first_pipeline_step,
    kway_block_orders,
    kway_schedule,
    kway_subgroups,
    pipeline_ready_steps,
    pipeline_stages,
    schedule_steps,
    star_schedule,
    validate_schedule,
)

FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
THOROUGH = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])

nodes = st.integers(min_value=2, max_value=64)
blocks = st.integers(min_value=1, max_value=64)


def independent_check(schedule: list[Transfer], n_nodes: int, n_blocks: int, sources: set[int]) -> None:
    """Re-implementation of the rules, deliberately written differently."""
    sends = Counter((t.step, t.src) for t in schedule)
    recvs = Counter((t.step, t.dst) for t in schedule)
    assert max(sends.values(), default=1) == 1, "a node sends two blocks in one step"
    assert max(recvs.values(), default=1) == 1, "a node receives two blocks in one step"
    got = Counter((t.dst, t.block) for t in schedule)
    for v in range(n_nodes):
        for b in range(n_blocks):
            expected = 0 if v in sources else 1
            assert got[(v, b)] == expected, f"node {v} receives block {b} {got[(v, b)]} times"
    first = {(t.dst, t.block): t.step for t in schedule}
    for t in schedule:
        if t.src not in sources:
            assert (t.src, t.block) in first and first[(t.src, t.block)] < t.step, f"{t} sent before held"


# ---------------------------------------------------------------------------
# binomial pipeline
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("n_nodes", range(2, 65))
def test_binomial_exact_step_count_every_n(n_nodes: int) -> None:
    # Every N in 2..64, powers of two or not, with short and long pipelines.
    for n_blocks in (1, 2, 3, 16, 64):
        sched = binomial_schedule(n_nodes, n_blocks)
        assert validate_schedule(sched, n_nodes, n_blocks) == n_blocks + ceil_log2(n_nodes) - 1
        assert schedule_steps(sched) == n_blocks + ceil_log2(n_nodes) - 1


@THOROUGH
@given(n_nodes=nodes, n_blocks=blocks)
def test_binomial_properties(n_nodes: int, n_blocks: int) -> None:
    sched = binomial_schedule(n_nodes, n_blocks)
    independent_check(sched, n_nodes, n_blocks, {0})
    assert validate_schedule(sched, n_nodes, n_blocks, sources=[0]) == n_blocks + ceil_log2(n_nodes) - 1
    assert all(t.step >= 0 for t in sched)


@FAST
@given(n_nodes=nodes, n_blocks=blocks)
def test_binomial_twins_differ_by_at_most_one_block(n_nodes: int, n_blocks: int) -> None:
    # The invariant behind the non-power-of-two construction: after every step
    # each node of a twin pair {v, v + 2^l - 1} lacks at most one block its twin
    # has, so the single extra step can complete both.
    cube = 1 << (n_nodes.bit_length() - 1)
    pairs = [(v, v + cube - 1) for v in range(1, n_nodes - cube + 1)]
    sched = binomial_schedule(n_nodes, n_blocks)
    last = schedule_steps(sched) - 1
    held: dict[int, set[int]] = {v: set() for v in range(n_nodes)}
    for step in range(last + 1):
        for t in sched:
            if t.step == step:
                held[t.dst].add(t.block)
        for p, q in pairs:
            assert len(held[p] - held[q]) <= 1 and len(held[q] - held[p]) <= 1
            if step == last - 1:
                assert held[p] | held[q] == set(range(n_blocks))  # the pair holds everything
    if pairs:  # the extra step only swaps between twins
        assert {(t.src, t.dst) for t in sched if t.step == last} <= {x for p in pairs for x in (p, p[::-1])}


def test_binomial_small_cases_by_hand() -> None:
    assert binomial_schedule(1, 5) == []
    # 1→2: the source streams the blocks in order.
    assert binomial_schedule(2, 3) == [Transfer(0, 0, 1, 0), Transfer(1, 0, 1, 1), Transfer(2, 0, 1, 2)]
    # 1→4, one block: two doubling steps.
    s = binomial_schedule(4, 1)
    assert schedule_steps(s) == 2 and len(s) == 3
    # 1→3 (not a power of two): b + 1 steps.
    assert schedule_steps(binomial_schedule(3, 4)) == 5


def test_binomial_rejects_bad_sizes() -> None:
    with pytest.raises(ValueError):
        binomial_schedule(0, 4)
    with pytest.raises(ValueError):
        binomial_schedule(4, 0)


# ---------------------------------------------------------------------------
# validator must be able to fail
# ---------------------------------------------------------------------------


@FAST
@given(
    n_nodes=st.integers(min_value=3, max_value=24),
    n_blocks=st.integers(min_value=1, max_value=12),
    pick=st.integers(min_value=0, max_value=10_000),
    kind=st.sampled_from(["drop", "duplicate", "too_early", "double_send", "resend", "bad_block", "self"]),
)
def test_validator_rejects_broken_schedules(n_nodes: int, n_blocks: int, pick: int, kind: str) -> None:
    sched = binomial_schedule(n_nodes, n_blocks)
    t = sched[pick % len(sched)]
    broken = list(sched)
    if kind == "drop":
        broken.remove(t)
    elif kind == "duplicate":
        broken.append(t)
    elif kind == "too_early":
        forwarded = [x for x in sched if x.src != 0]
        assume(forwarded)
        t = forwarded[pick % len(forwarded)]
        got_at = arrival_steps(sched, n_nodes, n_blocks)[t.src][t.block]
        broken.remove(t)
        broken.append(Transfer(got_at, t.src, t.dst, t.block))  # not held *before* that step
    elif kind == "double_send":
        other = next((x for x in range(n_nodes) if x not in (t.src, t.dst)), None)
        broken.append(Transfer(t.step, t.src, other, t.block))
    elif kind == "resend":
        broken.append(Transfer(schedule_steps(sched), 0, t.dst, t.block))
    elif kind == "bad_block":
        broken.remove(t)
        broken.append(Transfer(t.step, t.src, t.dst, n_blocks))
    else:
        broken.remove(t)
        broken.append(Transfer(t.step, t.dst, t.dst, t.block))
    with pytest.raises(ScheduleError):
        validate_schedule(broken, n_nodes, n_blocks)


def test_validator_rejects_source_receiving_and_missing_target() -> None:
    with pytest.raises(ScheduleError):  # a source receives a block it holds
        validate_schedule([Transfer(0, 1, 0, 0)], 2, 1, sources=[0, 1])
    assert validate_schedule([Transfer(0, 1, 0, 0)], 2, 1, sources=[1]) == 1
    with pytest.raises(ScheduleError):
        validate_schedule([Transfer(0, 0, 1, 0), Transfer(1, 1, 0, 0)], 2, 1)
    with pytest.raises(ScheduleError):
        validate_schedule([], 3, 1)
    assert validate_schedule([], 1, 5) == 0


# ---------------------------------------------------------------------------
# k-way (Alg. 1) and execution pipelines (Alg. 2)
# ---------------------------------------------------------------------------


@FAST
@given(n_blocks=blocks, k=st.integers(min_value=1, max_value=8))
def test_kway_block_orders_are_shifted_permutations(n_blocks: int, k: int) -> None:
    orders = kway_block_orders(n_blocks, k)
    assert len(orders) == k
    size = -(-n_blocks // k)
    chunks = [list(range(size * i, min(size * (i + 1), n_blocks))) for i in range(k)]
    for i, order in enumerate(orders):
        assert sorted(order) == list(range(n_blocks))
        # O_i starts with chunk i and continues circularly (Alg. 1 line 4).
        assert order == [b for j in range(k) for b in chunks[(i + j) % k]]
    assert orders[0] == list(range(n_blocks))


def test_kway_block_orders_paper_example() -> None:
    # λScale Fig. 5: 4 blocks, 2 sub-groups: (1-2, 3-4) and (3-4, 1-2).
    assert kway_block_orders(4, 2) == [[0, 1, 2, 3], [2, 3, 0, 1]]


@THOROUGH
@given(n_nodes=nodes, n_blocks=blocks, k=st.integers(min_value=1, max_value=4))
def test_kway_properties(n_nodes: int, n_blocks: int, k: int) -> None:
    assume(n_nodes - k >= k)
    sched = kway_schedule(n_nodes, n_blocks, k)
    sources = set(range(k))
    independent_check(sched, n_nodes, n_blocks, sources)
    groups = kway_subgroups(n_nodes, k)
    largest = max(len(g) for g in groups) + 1
    assert validate_schedule(sched, n_nodes, n_blocks, sources=sources) == n_blocks + ceil_log2(largest) - 1
    # Sub-groups: contiguous, sizes differ by at most one, cover the targets.
    assert sorted(v for g in groups for v in g) == list(range(k, n_nodes))
    assert max(map(len, groups)) - min(map(len, groups)) <= 1
    # Each source feeds only its own sub-group, in its own shifted order.
    orders = kway_block_orders(n_blocks, k)
    for i, g in enumerate(groups):
        members = {i, *g}
        assert all(t.dst in members for t in sched if t.src in members)
        sent: list[int] = []
        for t in sorted(sched):
            if t.src == i and t.block not in sent:
                sent.append(t.block)
        assert sent == orders[i][: len(sent)]
        assert sent[0] == orders[i][0]


@FAST
@given(n_nodes=nodes, n_blocks=blocks)
def test_kway_with_one_source_is_binomial(n_nodes: int, n_blocks: int) -> None:
    assert kway_schedule(n_nodes, n_blocks, 1) == binomial_schedule(n_nodes, n_blocks)


def test_kway_rejects_bad_k() -> None:
    with pytest.raises(ValueError):
        kway_schedule(5, 4, 3)  # 2 targets for 3 sub-groups
    with pytest.raises(ValueError):
        kway_schedule(5, 4, 0)
    with pytest.raises(ValueError):
        kway_block_orders(4, 0)
    with pytest.raises(ValueError):
        kway_subgroups(3, 2)


def test_execution_pipelines_paper_example() -> None:
    # λScale Fig. 5 (2→8): pipelines (3,6), (4,7), (5,8) — here 0-based.
    groups = kway_subgroups(8, 2)
    assert groups == [[2, 3, 4], [5, 6, 7]]
    assert execution_pipelines(groups) == [[2, 5], [3, 6], [4, 7]]
    # Unequal groups: cross-group pipelines first, leftovers of the last group together.
    assert execution_pipelines([[1, 2, 3], [4]]) == [[1, 4], [2, 3]]
    assert execution_pipelines([[1, 2], [3, 4, 5], [6, 7, 8]]) == [[1, 3, 6], [2, 4, 7], [5, 8]]
    assert execution_pipelines([]) == []


@FAST
@given(n_nodes=nodes, n_blocks=blocks, k=st.integers(min_value=1, max_value=4))
def test_every_pipeline_holds_all_blocks_at_first_pipeline_step(n_nodes: int, n_blocks: int, k: int) -> None:
    assume(n_nodes - k >= k)
    sched = kway_schedule(n_nodes, n_blocks, k)
    groups = kway_subgroups(n_nodes, k)
    pipelines = execution_pipelines(groups)
    # Alg. 2 uses every target exactly once.
    assert sorted(v for p in pipelines for v in p) == list(range(k, n_nodes))
    step = first_pipeline_step(sched, n_blocks, pipelines)
    held: dict[int, set[int]] = {}
    for t in sched:
        if t.step <= step:
            held.setdefault(t.dst, set()).add(t.block)
    for p in pipelines:
        union = set().union(*(held.get(v, set()) for v in p))
        assert union == set(range(n_blocks)), f"pipeline {p} incomplete after step {step}"
        stages = pipeline_stages(p, held, n_blocks)
        assert [s[1] for s in stages][0] == 0 and stages[-1][2] == n_blocks - 1
        assert all(a[2] + 1 == b[1] for a, b in zip(stages, stages[1:]))
        assert all(set(range(lo, hi + 1)) <= held[v] for v, lo, hi in stages)
    # Each pipeline's own ready step is tight: one step earlier it is not complete.
    for p, r in zip(pipelines, pipeline_ready_steps(sched, n_blocks, pipelines)):
        before = set().union(*({t.block for t in sched if t.dst == v and t.step < r} for v in p))
        assert before != set(range(n_blocks))


def test_kway_builds_pipelines_before_full_copies() -> None:
    # The point of Alg. 1 + Alg. 2: serving capacity long before completion.
    sched = kway_schedule(20, 16, 4)
    ready = pipeline_ready_steps(sched, 16, execution_pipelines(kway_subgroups(20, 4)))
    arr = arrival_steps(sched, 20, 16, set(range(4)))
    first_copy = min(max(row) for row in arr[4:])  # type: ignore[type-var]
    assert min(ready) < first_copy / 2
    assert min(ready) <= 16 // 4 + ceil_log2(5)


def test_pipeline_stages_minimal_and_errors() -> None:
    held = {1: {0, 1, 2}, 2: {2, 3}, 3: {1, 2, 3}}
    assert pipeline_stages([1, 2, 3], held, 4) == [(1, 0, 2), (2, 3, 3)]
    with pytest.raises(ValueError):
        pipeline_stages([2], held, 4)


def test_pipeline_with_source_is_ready_from_start() -> None:
    sched = binomial_schedule(4, 3)
    assert pipeline_ready_steps(sched, 3, [[0, 1]], sources={0}) == [-1]
    with pytest.raises(ValueError):
        pipeline_ready_steps([], 3, [[1]])


# ---------------------------------------------------------------------------
# baselines and chains
# ---------------------------------------------------------------------------


@FAST
@given(n_nodes=nodes, n_blocks=blocks)
def test_star_and_binary_tree(n_nodes: int, n_blocks: int) -> None:
    star = star_schedule(n_nodes, n_blocks)
    independent_check(star, n_nodes, n_blocks, {0})
    assert validate_schedule(star, n_nodes, n_blocks) == (n_nodes - 1) * n_blocks
    tree = binary_tree_schedule(n_nodes, n_blocks)
    independent_check(tree, n_nodes, n_blocks, {0})
    steps = validate_schedule(tree, n_nodes, n_blocks)
    # Never better than the binomial optimum.
    assert steps >= n_blocks + ceil_log2(n_nodes) - 1
    # Tree edges only: parent (v-1)//2 → v.
    assert all(t.src == (t.dst - 1) // 2 for t in tree)


@FAST
@given(
    perm=st.permutations(list(range(40))),
    cuts=st.lists(st.integers(min_value=1, max_value=39), max_size=6, unique=True),
    n_blocks=st.integers(min_value=1, max_value=32),
)
def test_chain_schedule(perm: list[int], cuts: list[int], n_blocks: int) -> None:
    bounds = [0, *sorted(cuts), 40]
    chains = [perm[a:b] for a, b in zip(bounds, bounds[1:]) if b > a]
    heads = {c[0] for c in chains}
    sched = chain_schedule(chains, n_blocks)
    targets = {v for c in chains for v in c[1:]}
    independent_check(sched, 40, n_blocks, heads | (set(range(40)) - targets - heads))
    longest = max(len(c) - 1 for c in chains)
    steps = validate_schedule(sched, 40, n_blocks, sources=heads, targets=targets)
    assert steps == (n_blocks + longest - 1 if longest else 0)


def test_chain_schedule_rejects_shared_nodes() -> None:
    with pytest.raises(ValueError):
        chain_schedule([[0, 1, 2], [3, 2]], 4)
