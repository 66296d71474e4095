"""Properties of the placement decisions (libs/planning/placement.py)."""

from hypothesis import given
from hypothesis import strategies as st

from libs.planning.placement import (
    TIER_ORDER,
    Candidate,
    Held,
    LiveInstance,
    locality,
    pick_targets,
    pick_victims,
    saturated_workers,
)

workers = st.lists(st.sampled_from([f"w{i}" for i in range(6)]), min_size=1, max_size=6, unique=True)
saturated = st.booleans()


@st.composite
def cluster(draw):
    ids = draw(workers)
    n_blocks = draw(st.integers(1, 6))
    block_bytes = {b: draw(st.integers(1, 1000)) for b in range(n_blocks)}
    held = draw(st.lists(st.builds(Held, st.sampled_from(ids), st.integers(0, n_blocks + 1),
                                   st.sampled_from(list(TIER_ORDER) + ["tape"])), max_size=20))
    cands = [Candidate(w, draw(st.integers(0, 5)), draw(st.integers(0, 3)), draw(saturated)) for w in ids]
    return block_bytes, cands, held


@given(cluster(), st.integers(0, 8), st.booleans())
def test_targets_are_distinct_candidates_and_at_most_n(c, n, first):
    block_bytes, cands, held = c
    chosen = pick_targets(block_bytes, cands, held, n, first=first)
    usable = [x for x in cands if first or not x.saturated]
    assert len(chosen) == min(n, len(usable)) and len(set(chosen)) == len(chosen)
    assert set(chosen) <= {x.worker_id for x in usable}


@given(cluster(), st.integers(0, 8))
def test_a_saturated_worker_gets_only_a_first_instance_and_after_every_other(c, n):
    block_bytes, cands, held = c
    assert not {x.worker_id for x in cands if x.saturated} & set(pick_targets(block_bytes, cands, held, n))
    chosen = pick_targets(block_bytes, cands, held, n, first=True)
    is_saturated = {x.worker_id: x.saturated for x in cands}
    assert [is_saturated[w] for w in chosen] == sorted(is_saturated[w] for w in chosen)


@given(cluster())
def test_no_unchosen_worker_holds_more_in_a_nearer_tier(c):
    block_bytes, cands, held = c
    cands = [Candidate(x.worker_id, x.running_requests, x.instances) for x in cands]
    (first,) = pick_targets(block_bytes, cands, held, 1)
    best = locality(block_bytes, held, first)
    for other in cands:
        assert locality(block_bytes, held, other.worker_id) <= best


def test_a_worker_is_saturated_for_a_while_after_its_last_busy_refusal():
    last = {"a": 100.0, "b": 96.0, "c": 90.0}
    assert saturated_workers(last, 101.0, memory_s=5.0) == {"a", "b"}
    assert saturated_workers(last, 106.0, memory_s=5.0) == set()


@given(cluster())
def test_locality_counts_each_block_once_in_its_nearest_tier(c):
    block_bytes, cands, held = c
    for cand in cands:
        per_tier = locality(block_bytes, held, cand.worker_id)
        assert sum(per_tier) <= sum(block_bytes.values())
        mine = {h.block_id for h in held if h.worker_id == cand.worker_id and h.tier in TIER_ORDER
                and h.block_id in block_bytes}
        assert sum(per_tier) == sum(block_bytes[b] for b in mine)


def test_host_copy_beats_disk_and_busy_breaks_ties():
    block_bytes = {0: 100, 1: 100}
    held = [Held("a", 0, "ssd"), Held("a", 1, "ssd"), Held("b", 0, "host")]
    cands = [Candidate("a"), Candidate("b"), Candidate("c")]
    assert pick_targets(block_bytes, cands, held, 3) == ["b", "a", "c"]
    assert pick_targets(block_bytes, [Candidate("x", 3), Candidate("y", 1)], [], 1) == ["y"]


@given(st.lists(st.builds(LiveInstance, st.uuids().map(str), st.sampled_from(["loading", "ready"]),
                          st.integers(0, 10)), max_size=8, unique_by=lambda i: i.instance_id), st.integers(0, 10))
def test_victims_prefer_loading_then_least_loaded(instances, n):
    victims = pick_victims(instances, n)
    assert len(victims) == min(n, len(instances))
    chosen = [i for i in instances if i.instance_id in victims]
    kept = [i for i in instances if i.instance_id not in victims]
    for v in chosen:
        for k in kept:
            assert (v.state != "loading", v.in_flight) <= (k.state != "loading", k.in_flight)
