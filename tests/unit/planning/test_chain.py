"""Tests for BlitzScale's chain planner (libs/planning/chain.py, Fig. 11)."""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from libs.planning.chain import Gpu, chain_ids, plan_chain_hops, plan_chains
from libs.planning.multicast import chain_schedule, validate_schedule

FAST = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def clusters(draw):  # type: ignore[no-untyped-def]
    n_src = draw(st.integers(min_value=1, max_value=6))
    n_tgt = draw(st.integers(min_value=0, max_value=40))
    leaves = draw(st.integers(min_value=1, max_value=4))
    gpus = []
    for i in range(n_src + n_tgt):
        gpus.append(
            Gpu(
                id=i,
                host=f"h{i // 4}",
                leaf=f"leaf{draw(st.integers(min_value=0, max_value=leaves - 1))}",
                scaleup_group=draw(st.sampled_from([None, f"nv{i // 4}", f"nv{i // 2}"])),
                bandwidth_gbps=draw(st.sampled_from([100.0, 200.0, 400.0])),
                busy_egress=draw(st.booleans()),
            )
        )
    n = draw(st.integers(min_value=0, max_value=n_tgt + 2))
    return gpus[:n_src], gpus[n_src:], n


@FAST
@given(clusters())
def test_chains_cover_targets_once_and_start_at_sources(cluster) -> None:  # type: ignore[no-untyped-def]
    sources, targets, n = cluster
    chains = plan_chains(sources, targets, n)
    source_ids = {g.id for g in sources}
    target_ids = {g.id for g in targets}
    covered = [g.id for c in chains for g in c[1:]]
    # Every selected target exactly once; as many as asked for (or all there are).
    assert len(covered) == len(set(covered)) == min(n, len(targets))
    assert set(covered) <= target_ids
    for c in chains:
        assert c[0].id in source_ids, "a chain must start at a source"
        assert len(c) >= 2
        assert all(g.id in target_ids for g in c[1:])
    # Heads are distinct, so the chains run side by side under the port model.
    ids = chain_ids(chains)
    sched = chain_schedule(ids, 8)
    heads = {c[0] for c in ids}
    validate_schedule(sched, len(sources) + len(targets), 8, sources=heads, targets=set(covered))


@FAST
@given(clusters())
def test_hops_prune_busy_sources_and_cover_bandwidth(cluster) -> None:  # type: ignore[no-untyped-def]
    sources, targets, n = cluster
    hops = plan_chain_hops(sources, targets, n)
    idle = [g for g in sources if not g.busy_egress]
    used_sources = {g.id for h in hops for g in h.sources if g.id in {s.id for s in sources}}
    if idle:
        # Line 1: a source whose egress serves traffic is never used while others exist.
        assert used_sources <= {g.id for g in idle}
    # A scale-up group is loaded as one logical node: its GPUs arrive together.
    for h in hops:
        groups = {g.scaleup_group for g in h.targets}
        assert len(groups) == 1
        if None in groups:
            assert len(h.targets) == 1
    # Each original source feeds at most one hop (its egress is spent).
    feeds = [g.id for h in hops for g in h.sources if g.id in {s.id for s in sources}]
    assert len(feeds) == len(set(feeds))


def _gpu(i: int, leaf: str, bw: float = 100.0, group: str | None = None, busy: bool = False) -> Gpu:
    return Gpu(i, f"h{i}", leaf, group, bw, busy)


def test_one_chain_per_leaf_when_leaves_have_sources() -> None:
    sources = [_gpu(0, "A"), _gpu(1, "B"), _gpu(2, "B", busy=True)]
    targets = [_gpu(10 + i, "A" if i % 2 else "B") for i in range(8)]
    chains = chain_ids(plan_chains(sources, targets, 8))
    assert len(chains) == 2
    by_head = {c[0]: c for c in chains}
    assert set(by_head) == {0, 1}  # the busy source 2 is pruned
    assert all(t % 2 == 1 for t in by_head[0][1:])  # leaf A targets fed by A's source
    assert all(t % 2 == 0 for t in by_head[1][1:])


def test_targets_ordered_by_aggregate_bandwidth() -> None:
    # Fig. 13b: the faster target first, so its downtime is shortest.
    sources = [_gpu(0, "A", 400.0)]
    targets = [_gpu(1, "A", 100.0), _gpu(2, "A", 200.0), _gpu(3, "A", 400.0)]
    assert chain_ids(plan_chains(sources, targets, 3)) == [[0, 3, 2, 1]]


def test_scaleup_group_is_one_logical_node_and_sharded_sources() -> None:
    # Fig. 14: a 4-GPU NVLink group needs 4× a single link; two 200G sources
    # together feed it (parallel sharded transfer), then the group forwards.
    sources = [_gpu(0, "A", 200.0), _gpu(1, "A", 200.0)]
    targets = [_gpu(10 + i, "A", 100.0, group="nv0") for i in range(4)] + [_gpu(20, "A", 100.0)]
    hops = plan_chain_hops(sources, targets, 5)
    assert [g.id for g in hops[0].sources] == [0, 1]
    assert [g.id for g in hops[0].targets] == [10, 11, 12, 13]
    assert [g.id for g in hops[1].sources] == [10, 11, 12, 13]
    assert chain_ids(plan_chains(sources, targets, 5)) == [[0, 10, 11, 12, 13, 20]]


def test_n_limits_targets_and_cuts_last_group() -> None:
    sources = [_gpu(0, "A")]
    targets = [_gpu(10 + i, "A", group="nv") for i in range(4)]
    chains = chain_ids(plan_chains(sources, targets, 3))
    assert chains == [[0, 10, 11, 12]]
    assert plan_chains(sources, targets, 0) == []


def test_busy_target_forwards_only_as_last_resort() -> None:
    # Target 1 will serve live traffic (busy egress, Fig. 12): it ends its chain.
    sources = [_gpu(i, "A") for i in (0, 5, 6, 7, 8)]
    targets = [_gpu(1, "A", 400.0, busy=True), _gpu(2, "A", 100.0), _gpu(3, "A", 100.0)]
    hops = plan_chain_hops(sources, targets, 3)
    assert [g.id for g in hops[0].sources] == [0, 5, 6, 7]
    assert all(1 not in [g.id for g in h.sources] for h in hops)
    assert chain_ids(plan_chains(sources, targets, 3)) == [[0, 1], [8, 2, 3]]
    # With nothing else left it does forward rather than leave a target out.
    lone = plan_chains([_gpu(0, "A")], targets, 3)
    assert chain_ids(lone) == [[0, 1, 2, 3]]


def test_all_sources_busy_falls_back() -> None:
    sources = [_gpu(0, "A", busy=True)]
    assert chain_ids(plan_chains(sources, [_gpu(1, "A")], 1)) == [[0, 1]]


def test_rejects_bad_input() -> None:
    with pytest.raises(ValueError):
        plan_chains([], [_gpu(1, "A")], 1)
    with pytest.raises(ValueError):
        plan_chains([_gpu(1, "A")], [_gpu(1, "A")], 1)
    with pytest.raises(ValueError):
        plan_chains([_gpu(0, "A")], [_gpu(1, "A")], -1)
