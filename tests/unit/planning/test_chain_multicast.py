"""The chains the planner runs (libs.planning.chain.plan_multicast_chains): one MulticastPlan on
the cluster's topology (BlitzScale §5.1, Fig. 11; interference pruning §4, Fig. 8)."""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from libs.planning.chain import Gpu, chain_ids, chain_plan_over_nodes, chains_over_nodes, plan_multicast_chains
from libs.planning.multicast import chain_schedule, validate_schedule

FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _gpu(i: int, leaf: str, group: str | None = None, busy: bool = False, bw: float = 100.0) -> Gpu:
    return Gpu(i, f"h{i}", leaf, group, bw, busy)


def _crossings(chain: list[Gpu]) -> int:
    return sum(a.leaf != b.leaf for a, b in zip(chain, chain[1:]))


@st.composite
def topologies(draw, every_leaf_has_a_source: bool = False):  # type: ignore[no-untyped-def]
    """Nodes 0..N-1, the first k sources: any leaves, scale-up groups (within a leaf), busy links."""
    n_leaves = draw(st.integers(1, 4))
    k = draw(st.integers(1, 5))
    n_targets = draw(st.integers(0, 14))
    nodes = []
    for i in range(k + n_targets):
        leaf = draw(st.integers(0, n_leaves - 1))
        group = draw(st.sampled_from([None, "g0", "g1"]))
        nodes.append(Gpu(i, f"h{i}", f"leaf{leaf}", None if group is None else f"{group}@{leaf}",
                         draw(st.sampled_from([25.0, 100.0, 400.0])), draw(st.booleans())))
    if every_leaf_has_a_source:
        # One quiet source on every leaf a target sits on.
        leaves = sorted({g.leaf for g in nodes[k:]})
        extra = [Gpu(0, "h", leaf, None, 100.0, False) for leaf in leaves]
        nodes = extra + nodes
        k += len(extra)
        nodes = [Gpu(i, f"h{i}", g.leaf, g.scaleup_group, g.bandwidth_gbps, g.busy_egress if i >= len(extra) else False)
                 for i, g in enumerate(nodes)]
    return nodes, k


@FAST
@given(topologies(), st.booleans(), st.integers(1, 6))
def test_a_chain_plan_is_a_valid_multicast_plan_where_every_target_gets_each_block_once_from_one_parent(
        topology, topology_aware, n_blocks):
    nodes, k = topology
    chains = chains_over_nodes(nodes, k, topology_aware=topology_aware)
    schedule = chain_schedule(chains, n_blocks)
    # Sources 0..k-1 hold the model; every other node ends with every block, received once
    # (validate_schedule refuses a second copy), under the single-port model.
    validate_schedule(schedule, len(nodes), n_blocks, sources=range(k))
    parents: dict[int, set[int]] = {}
    for t in schedule:
        parents.setdefault(t.dst, set()).add(t.src)
    assert set(parents) == set(range(k, len(nodes)))
    assert all(len(p) == 1 for p in parents.values())  # one parent per target
    assert all(c[0] < k and all(v >= k for v in c[1:]) for c in chains)  # heads are sources, the rest targets


@FAST
@given(topologies(every_leaf_has_a_source=True))
def test_no_chain_crosses_the_spine_when_every_leaf_has_a_source(topology):
    nodes, k = topology
    for chain in plan_multicast_chains(nodes[:k], nodes[k:]):
        assert _crossings(chain) == 0, [(g.id, g.leaf) for g in chain]


@FAST
@given(topologies())
def test_a_chain_crosses_the_spine_at_most_once_while_there_are_no_more_sourceless_leaves_than_chains(topology):
    nodes, k = topology
    sources, targets = nodes[:k], nodes[k:]
    chains = plan_multicast_chains(sources, targets)
    orphan_leaves = {g.leaf for g in targets} - {c[0].leaf for c in chains}
    if len(orphan_leaves) <= len(chains):
        assert all(_crossings(c) <= 1 for c in chains)


@FAST
@given(topologies())
def test_busy_sources_send_only_when_every_source_is_busy(topology):
    nodes, k = topology
    heads = {c[0] for c in chains_over_nodes(nodes, k)}
    if any(not g.busy_egress for g in nodes[:k]):
        assert not any(nodes[h].busy_egress for h in heads)


@FAST
@given(topologies())
def test_a_scaleup_group_is_entered_once_and_its_members_are_fed_inside_it(topology):
    nodes, k = topology
    schedule = chain_schedule(chains_over_nodes(nodes, k), 3)
    group_of = {g.id: (g.leaf, g.scaleup_group) for g in nodes[k:] if g.scaleup_group is not None}
    members: dict[tuple, set[int]] = {}
    for v, grp in group_of.items():
        members.setdefault(grp, set()).add(v)
    for grp, ids in members.items():
        fed_from_outside = {t.dst for t in schedule if t.dst in ids and group_of.get(t.src) != grp}
        assert len(fed_from_outside) == 1  # one entry member; the others get their blocks from the group


def test_two_leaves_with_a_source_each_get_one_chain_each():
    # Round-robin leaves (consecutive workers alternate), a source on each leaf.
    sources = [_gpu(0, "A"), _gpu(1, "B")]
    targets = [_gpu(2 + i, "AB"[i % 2]) for i in range(6)]
    chains = chain_ids(plan_multicast_chains(sources, targets))
    assert chains == [[0, 2, 4, 6], [1, 3, 5, 7]]


def test_blind_chains_follow_worker_id_order_across_leaves():
    sources = [_gpu(0, "A"), _gpu(1, "B")]
    targets = [_gpu(2 + i, "AB"[i % 2]) for i in reversed(range(6))]  # given in any order
    chains = plan_multicast_chains(sources, targets, topology_aware=False)
    assert chain_ids(chains) == [[0, 2, 3, 4], [1, 5, 6, 7]]
    assert [_crossings(c) for c in chains] == [2, 2]  # the topology-aware chains cross none


def test_a_leaf_without_a_source_hangs_off_one_local_chain():
    sources = [_gpu(0, "A"), _gpu(1, "A")]
    targets = [_gpu(2, "A"), _gpu(3, "A"), _gpu(4, "A"), _gpu(5, "B"), _gpu(6, "B")]
    chains = plan_multicast_chains(sources, targets)
    assert chain_ids(chains) == [[0, 2, 4], [1, 3, 5, 6]]  # the shorter chain takes leaf B
    assert [_crossings(c) for c in chains] == [0, 1]


def test_a_spare_source_on_another_leaf_feeds_a_sourceless_leaf():
    sources = [_gpu(0, "A"), _gpu(1, "C")]  # no target on leaf C
    targets = [_gpu(2, "A"), _gpu(3, "B"), _gpu(4, "B")]
    assert chain_ids(plan_multicast_chains(sources, targets)) == [[0, 2], [1, 3, 4]]


def test_a_busy_source_is_pruned_while_a_quiet_one_exists_even_on_another_leaf():
    sources = [_gpu(0, "A", busy=True), _gpu(1, "B")]
    targets = [_gpu(2, "A"), _gpu(3, "A")]
    assert chain_ids(plan_multicast_chains(sources, targets)) == [[1, 2, 3]]
    # Every source busy: scaling with interference beats not scaling.
    assert chain_ids(plan_multicast_chains([_gpu(0, "A", busy=True)], targets)) == [[0, 2, 3]]


def test_a_scaleup_group_is_one_node_its_members_side_by_side_and_a_busy_member_last():
    sources = [_gpu(0, "A")]
    targets = [_gpu(1, "A", "nv"), _gpu(2, "A"), _gpu(3, "A", "nv", busy=True), _gpu(4, "A", "nv")]
    # The group (300 Gbit/s together) goes first as one unit... unless a member must keep its
    # egress quiet: then the group goes last, that member at its end.
    assert chain_ids(plan_multicast_chains(sources, targets)) == [[0, 2, 1, 4, 3]]
    quiet = [_gpu(1, "A", "nv"), _gpu(2, "A"), _gpu(3, "A", "nv"), _gpu(4, "A", "nv")]
    assert chain_ids(plan_multicast_chains(sources, quiet)) == [[0, 1, 3, 4, 2]]


def test_local_sources_split_their_leaf_into_balanced_chains():
    sources = [_gpu(0, "A"), _gpu(1, "A"), _gpu(2, "A")]
    targets = [_gpu(3 + i, "A") for i in range(5)]
    assert chain_ids(plan_multicast_chains(sources, targets)) == [[0, 3, 6], [1, 4, 7], [2, 5]]
    # More sources than targets: one chain per target.
    assert chain_ids(plan_multicast_chains(sources, targets[:2])) == [[0, 3], [1, 4]]


def test_bad_input_is_refused():
    with pytest.raises(ValueError):
        plan_multicast_chains([], [_gpu(1, "A")])
    with pytest.raises(ValueError):
        plan_multicast_chains([_gpu(1, "A")], [_gpu(1, "A")])
    with pytest.raises(ValueError):
        chains_over_nodes([_gpu(1, "A"), _gpu(0, "A")], 1)
    assert plan_multicast_chains([_gpu(0, "A")], []) == []


def test_a_benchmark_gets_each_chain_algorithms_plan_over_its_numbered_nodes():
    # Nodes 0, 1 hold the model (one per leaf); 2..7 alternate leaves, as round-robin placement does.
    nodes = [_gpu(i, "AB"[i % 2]) for i in range(8)]
    aware, blind = (chain_plan_over_nodes(a, nodes, 2, 4) for a in ("chain", "chain-blind"))
    assert (aware.algorithm, aware.k, blind.algorithm, blind.k) == ("chain", 2, "chain-blind", 2)
    for plan in (aware, blind):
        validate_schedule(plan.schedule, 8, 4, sources=range(2))

    def spine_hops(plan):
        return sum(nodes[t.src].leaf != nodes[t.dst].leaf for t in plan.schedule if t.block == 0)
    assert (spine_hops(aware), spine_hops(blind)) == (0, 4)


def test_every_chain_algorithm_is_registered_as_a_multi_source_chunk_relay():
    from libs.planning.chain import CHAIN_ALGORITHMS
    from libs.planning.multicast import CHUNK_RELAY, MULTICAST_ALGORITHMS

    for name in CHAIN_ALGORITHMS:
        assert MULTICAST_ALGORITHMS[name].multi_source and MULTICAST_ALGORITHMS[name].cost is CHUNK_RELAY


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(["binomial", "star", "binary-tree", "chain", "kway", "chain-blind"]),
       st.integers(3, 12), st.integers(1, 6), st.integers(1, 3), st.integers(1, 3))
def test_a_fabric_without_a_bottleneck_bounds_a_plan_as_its_cost_model_does(algorithm, n, blocks, k, leaves):
    """fabric_bound_s with no uplink cap (any number of leaves), or with one leaf, is plan_bound_s."""
    from libs.planning.multicast import build_plan, fabric_bound_s, multicast_algorithm, plan_bound_s

    k = min(k, n // 2) if multicast_algorithm(algorithm).multi_source else 1
    nodes = [_gpu(i, "ABC"[i % leaves]) for i in range(n)]
    plan = chain_plan_over_nodes(algorithm, nodes, k, blocks) if algorithm.startswith("chain") \
        else build_plan(algorithm, n, blocks, k)
    total, rate, chunk = 1 << 20, 1e6, 1 << 16
    expected = plan_bound_s(plan, blocks, total, rate, chunk)
    assert fabric_bound_s(plan, blocks, total, rate, chunk, [g.leaf for g in nodes], None) == pytest.approx(expected)
    assert fabric_bound_s(plan, blocks, total, rate, chunk, ["A"] * n, rate / 4) == pytest.approx(expected)


def test_chains_that_cross_an_oversubscribed_spine_share_its_uplinks():
    """2 leaves x 4 nodes, a source per leaf, uplinks of 1.5 links (issue 38's setting): the
    topology-aware chains stay in their leaves (one link's rate, M/R plus two chunks of fill);
    the blind chains in node order cross the spine on 4 hops, 2 out of each leaf at once, so
    each runs at 0.75 R: no run of chain-blind can take less than M / (0.75 R), and the best
    chain/chain-blind ratio this fabric allows is about 0.75."""
    from libs.planning.multicast import fabric_bound_s

    nodes = [_gpu(i, "AB"[i % 2]) for i in range(8)]
    leaf_of = [g.leaf for g in nodes]
    total, rate, chunk, blocks = 64 << 20, 25e6, 1 << 20, 16
    aware, blind = (chain_plan_over_nodes(a, nodes, 2, blocks) for a in ("chain", "chain-blind"))
    aware_s = fabric_bound_s(aware, blocks, total, rate, chunk, leaf_of, 1.5 * rate)
    blind_s = fabric_bound_s(blind, blocks, total, rate, chunk, leaf_of, 1.5 * rate)
    assert aware_s == pytest.approx((total + 2 * chunk) / rate)
    assert blind_s == pytest.approx((total + 2 * chunk) / (0.75 * rate))
    assert aware_s / blind_s == pytest.approx(0.75)
    # A scale-up group's fast path (here a group per leaf): the aware chains run at its rate.
    faster = fabric_bound_s(aware, blocks, total, rate, chunk, leaf_of, 1.5 * rate, leaf_of, 4 * rate)
    assert faster == pytest.approx((total + 2 * chunk) / (4 * rate))


def test_a_block_step_plan_pays_each_steps_slowest_spine_share():
    """A binomial 1->4 over two leaves (nodes 0, 2 on A; 1, 3 on B), uplinks at half a link:
    each step costs one block at its slowest transfer's rate."""
    from libs.planning.multicast import Transfer, MulticastPlan, fabric_bound_s

    # step 0: 0->1 (crosses, alone: half a link); step 1: 0->2 (in leaf A) and 1->3 (in leaf B): full rate
    plan = MulticastPlan("binomial", 1, [Transfer(0, 0, 1, 0), Transfer(1, 0, 2, 0), Transfer(1, 1, 3, 0)])
    block = 1000.0
    got = fabric_bound_s(plan, 1, int(block), 10.0, 1, ["A", "B", "A", "B"], 5.0)
    assert got == pytest.approx(block / 5.0 + block / 10.0)
