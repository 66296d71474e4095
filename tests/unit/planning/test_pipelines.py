"""Execution pipelines during a multicast (libs/planning/pipelines.py): which form, when, with which stages."""

from hypothesis import given, settings
from hypothesis import strategies as st

from libs.planning.multicast import arrival_steps, kway_schedule
from libs.planning.pipelines import multicast_pipelines, pipelines_to_form, pipelines_to_retire


def test_alg2_groups_take_one_node_per_subgroup():
    # 2 sources, 6 receivers: sub-groups [r0 r1 r2] and [r3 r4 r5] -> pipelines across them (Alg. 2).
    nodes = ["s0", "s1", "r0", "r1", "r2", "r3", "r4", "r5"]
    assert multicast_pipelines(nodes, 2) == [("r0", "r3"), ("r1", "r4"), ("r2", "r5")]
    # One source: its receivers are one sub-group, so they form one pipeline.
    assert multicast_pipelines(["s0", "a", "b", "c"], 1) == [("a", "b", "c")]
    assert multicast_pipelines(["s0"], 1) == []


def test_a_group_forms_once_it_jointly_holds_every_block_and_none_holds_them_alone():
    groups = [("a", "b"), ("c", "d")]
    holdings = {"a": {0, 1}, "b": {2, 3}, "c": {0, 1, 2}, "d": set()}
    [formed] = pipelines_to_form(groups, holdings, 4)
    assert formed.members == ("a", "b") and formed.workers == ("a", "b")
    assert [(s.block_start, s.block_end) for s in formed.stages] == [(0, 2), (2, 4)]
    assert pipelines_to_form(groups, holdings, 4, started=[("a", "b")]) == []
    # A member that holds the whole model is about to serve on its own: no pipeline for it.
    assert pipelines_to_form([("a", "b")], {"a": {0, 1, 2, 3}, "b": {0}}, 4) == []


def test_fewest_stages_even_when_a_middle_worker_holds_more():
    [p] = pipelines_to_form([("a", "b", "c")], {"a": {0}, "b": {0, 1, 2}, "c": {3}}, 4)
    assert [(s.worker_id, s.block_start, s.block_end) for s in p.stages] == [("b", 0, 3), ("c", 3, 4)]


@st.composite
def _case(draw):
    n_blocks = draw(st.integers(1, 8))
    workers = [f"w{i}" for i in range(draw(st.integers(1, 6)))]
    holdings = {w: set(draw(st.sets(st.integers(0, n_blocks - 1)))) for w in workers}
    cut = draw(st.lists(st.integers(0, len(workers)), max_size=3))
    bounds = sorted({0, len(workers), *cut})
    groups = [tuple(workers[a:b]) for a, b in zip(bounds, bounds[1:]) if b > a]
    started = draw(st.sets(st.sampled_from(groups))) if groups else set()
    return n_blocks, holdings, groups, started


@settings(max_examples=300, deadline=None)
@given(_case())
def test_formed_pipelines_cover_the_model_with_blocks_their_stages_hold(case):
    n_blocks, holdings, groups, started = case
    formed = pipelines_to_form(groups, holdings, n_blocks, started)
    everything = set(range(n_blocks))
    for p in formed:
        assert p.members in groups and p.members not in started
        assert set(p.workers) <= set(p.members) and len(set(p.workers)) == len(p.workers) >= 2
        assert p.stages[0].block_start == 0 and p.stages[-1].block_end == n_blocks
        assert all(a.block_end == b.block_start for a, b in zip(p.stages, p.stages[1:]))
        assert all(set(range(s.block_start, s.block_end)) <= holdings[s.worker_id] for s in p.stages)
    # And every group that qualifies is formed.
    qualifying = [g for g in groups if g not in started and len(g) >= 2
                  and not any(holdings[w] == everything for w in g) and _has_cover(g, holdings, n_blocks)]
    assert [p.members for p in formed] == qualifying


def _has_cover(group, holdings, n_blocks) -> bool:
    """Brute force: some order of some of the workers covers the blocks, each over one held run."""
    def go(start, left):
        if start == n_blocks:
            return True
        return any(go(end, left - {w}) for w in left
                   for end in range(start + 1, n_blocks + 1) if set(range(start, end)) <= holdings[w])
    return go(0, frozenset(group))


def test_a_worker_serves_one_stage_so_a_cover_that_needs_it_twice_waits():
    # a holds 0 and 2, b holds 1: a would be needed twice.
    assert pipelines_to_form([("a", "b")], {"a": {0, 2}, "b": {1}}, 3) == []
    [p] = pipelines_to_form([("a", "b", "c")], {"a": {0, 2}, "b": {1}, "c": {1, 2}}, 3)
    assert [(s.worker_id, s.block_start, s.block_end) for s in p.stages] == [("a", 0, 1), ("c", 1, 3)]


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 3), st.integers(1, 9), st.integers(2, 16))
def test_during_a_kway_multicast_a_pipeline_forms_no_later_than_the_first_full_copy(k, extra, n_blocks):
    """Replays a k-way schedule step by step: the first pipeline forms no later than the step at
    which a receiver first holds every block (λScale: about b/k steps instead of b)."""
    n_targets = k + extra
    n = k + n_targets
    nodes = [f"n{i}" for i in range(n)]
    groups = multicast_pipelines(nodes, k)
    arr = arrival_steps(kway_schedule(n, n_blocks, k), n, n_blocks, set(range(k)))
    first_copy = min(max(arr[v]) for v in range(k, n))
    formed_at = None
    for step in range(first_copy + 1):
        holdings = {nodes[v]: {b for b in range(n_blocks) if arr[v][b] is not None and arr[v][b] <= step}
                    for v in range(k, n)}
        if pipelines_to_form(groups, holdings, n_blocks):
            formed_at = step
            break
    if formed_at is not None:
        assert formed_at <= first_copy


def _first_formed_step(k: int, n_targets: int, n_blocks: int) -> tuple[int, int]:
    n = k + n_targets
    nodes = [f"n{i}" for i in range(n)]
    groups = multicast_pipelines(nodes, k)
    arr = arrival_steps(kway_schedule(n, n_blocks, k), n, n_blocks, set(range(k)))
    first_copy = min(max(arr[v]) for v in range(k, n))
    for step in range(first_copy + 1):
        holdings = {nodes[v]: {b for b in range(n_blocks) if arr[v][b] is not None and arr[v][b] <= step}
                    for v in range(k, n)}
        if pipelines_to_form(groups, holdings, n_blocks):
            return step, first_copy
    return -1, first_copy


def test_kway_pipelines_form_after_about_b_over_k_steps():
    """λScale §4.2: in a 2 -> 8 k-way multicast of 16 blocks the receivers jointly hold the model
    after about b/k = 8 steps, long before the first receiver holds all 16 alone."""
    formed, first_copy = _first_formed_step(2, 6, 16)
    assert 0 <= formed <= 16 // 2 + 1 < first_copy
    # One source: the binomial pipeline's receivers, one group, still beat the first full copy.
    formed, first_copy = _first_formed_step(1, 3, 12)
    assert 0 <= formed < first_copy


def test_a_pipeline_retires_once_every_stage_worker_is_local():
    pipelines = {"p1": ("a", "b"), "p2": ("c", "d")}
    assert pipelines_to_retire(pipelines, {"a"}) == []
    assert pipelines_to_retire(pipelines, {"a", "b", "c"}) == ["p1"]
    assert pipelines_to_retire(pipelines, {"a", "b", "c", "d"}) == ["p1", "p2"]
