"""Tests for the choice of each block's source in a worker's load (libs/planning/block_sources.py)."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from libs.planning.block_sources import BlockSource, choose_block_sources, reread_lost


@st.composite
def loads(draw):
    """A load's wanted range, and which blocks the host tier holds and a transfer brings."""
    start = draw(st.integers(min_value=0, max_value=20))
    wanted = list(range(start, start + draw(st.integers(min_value=0, max_value=24))))
    # Either set may also name blocks outside the range (another load's): they do not matter.
    universe = st.integers(min_value=0, max_value=50)
    ours = st.sets(st.sampled_from(wanted)) if wanted else st.just(set())
    in_host = draw(ours) | draw(st.sets(universe, max_size=3))
    arriving = draw(ours) | draw(st.sets(universe, max_size=3))
    return wanted, in_host, arriving, draw(st.booleans())


@given(loads())
def test_every_wanted_block_gets_exactly_one_source(load):
    wanted, in_host, arriving, incoming = load
    plan = choose_block_sources(wanted, in_host, arriving, incoming)
    assert list(plan.wanted) == wanted and set(plan.sources) == set(wanted)
    parts = [plan.blocks(s) for s in BlockSource]
    assert sorted(b for part in parts for b in part) == sorted(wanted)


@given(loads())
def test_sources_follow_the_tiers(load):
    wanted, in_host, arriving, incoming = load
    plan = choose_block_sources(wanted, in_host, arriving, incoming)
    for b in wanted:
        if incoming and b in arriving:
            assert plan.of(b) is BlockSource.transfer  # awaited, never read from disk
        elif b in in_host:
            assert plan.of(b) is BlockSource.host  # not re-read
        else:
            assert plan.of(b) is BlockSource.disk
    if not incoming:
        assert plan.blocks(BlockSource.transfer) == []


@given(loads())
def test_the_disk_reads_are_in_load_order(load):
    wanted, in_host, arriving, incoming = load
    plan = choose_block_sources(wanted, in_host, arriving, incoming)
    assert plan.disk == sorted(plan.disk)
    assert plan.disk == [b for b in wanted if b not in in_host and not (incoming and b in arriving)]


def test_a_block_in_the_host_tier_and_on_its_way_is_awaited():
    plan = choose_block_sources([0, 1], in_host={0, 1}, arriving={1}, incoming_transfer=True)
    assert plan.of(0) is BlockSource.host and plan.of(1) is BlockSource.transfer
    assert choose_block_sources([0, 1], {0, 1}, {1}, False).of(1) is BlockSource.host


def test_repeated_blocks_are_refused():
    with pytest.raises(ValueError, match="repeat"):
        choose_block_sources([1, 1], set(), set(), False)


@given(loads(), st.data())
def test_a_transfer_that_ends_short_sends_only_its_undelivered_blocks_to_disk(load, data):
    wanted, in_host, arriving, _ = load
    plan = choose_block_sources(wanted, in_host, arriving, True)
    from_transfer = plan.blocks(BlockSource.transfer)
    if not from_transfer:
        return
    lost_block = data.draw(st.sampled_from(from_transfer))
    arrived = data.draw(st.sets(st.sampled_from(from_transfer))) - {lost_block}
    replanned, lost = reread_lost(plan, lost_block, arrived)
    assert lost[0] == lost_block and lost == sorted(lost)
    assert replanned.disk == sorted(plan.disk + lost)
    for b in wanted:
        if b in lost:
            assert plan.of(b) is BlockSource.transfer and replanned.of(b) is BlockSource.disk
        else:
            assert replanned.of(b) is plan.of(b)  # host blocks stay, arrived blocks are not re-read
        if plan.of(b) is BlockSource.transfer and b > lost_block:
            # A later block goes to disk exactly when it did not arrive.
            assert (b in lost) == (b not in arrived)
        if b < lost_block:
            assert b not in lost  # already loaded


def test_losing_a_block_not_expected_from_a_transfer_is_refused():
    plan = choose_block_sources([0, 1], in_host={0}, arriving=set(), incoming_transfer=True)
    with pytest.raises(ValueError):
        reread_lost(plan, 0, set())


def test_lost_blocks_are_replanned_once():
    plan = choose_block_sources(range(5), in_host={1}, arriving={0, 2, 3, 4}, incoming_transfer=True)
    plan, lost = reread_lost(plan, 2, arrived={3})
    assert lost == [2, 4] and plan.disk == [2, 4]
    assert [plan.of(b) for b in range(5)] == [BlockSource.transfer, BlockSource.host, BlockSource.disk,
                                              BlockSource.transfer, BlockSource.disk]
    with pytest.raises(ValueError):
        reread_lost(plan, 4, set())
