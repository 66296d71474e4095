"""Live pairs (libs/planning/livepair.py, BlitzScale §5.2): which instances pair, and the
per-batch split of a pair's prefills over the ZigZag queue."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from libs.planning.livepair import (
    PrefillSplitter,
    Receiving,
    Serving,
    choose_live_pairs,
    form_live_pair,
    leading_blocks,
)
from libs.protocol import messages as m


def test_leading_blocks_counts_only_the_unbroken_prefix():
    assert leading_blocks([]) == 0
    assert leading_blocks([1, 2]) == 0  # block 0 missing: nothing of a prefill can run there
    assert leading_blocks([0, 1, 3]) == 2
    assert leading_blocks(range(5)) == 5


def test_the_split_follows_the_blocks_the_target_holds_up_to_half_the_model():
    split = PrefillSplitter(n_blocks=8)
    assert split(["a"]) == 0  # nothing held: the source runs the whole batch
    split.held(1)
    assert split(["b", "c"]) == 1
    split.held(3)
    assert split(["d"]) == 3
    split.held(7)
    assert split(["e"]) == 4  # capped at half: the target, still receiving, must not be the bottleneck
    assert split.splits == [0, 1, 3, 4]
    assert len(split.queue) == 0  # every batch pulled by the source: nothing left queued


def test_a_splitter_never_leaves_the_source_without_a_block():
    with pytest.raises(ValueError):
        PrefillSplitter(4, cap=4)
    with pytest.raises(ValueError):
        PrefillSplitter(1)
    assert PrefillSplitter(4, held=4, cap=3)() == 3


@settings(max_examples=100, deadline=None)
@given(n=st.integers(2, 12), helds=st.lists(st.integers(0, 12), max_size=12), cap=st.integers(0, 11))
def test_splits_grow_with_the_blocks_held_and_stay_within_them(n, helds, cap):
    cap = min(cap, n - 1)
    split = PrefillSplitter(n, cap=cap)
    held = 0
    for h in helds:
        held = max(held, min(h, n))
        split.held(held)
        assert split() == min(held, cap)
    assert split.splits == sorted(split.splits)


def src(i, wait, slo=1.0, worker=None, model="m", paired=False):
    return Serving(f"s{i}", worker or f"ws{i}", model, wait, slo, paired)


def tgt(i, left, worker=None, model="m", paired=False):
    return Receiving(f"t{i}", worker or f"wt{i}", model, left, paired)


def test_the_most_overloaded_instance_takes_the_slowest_target_of_its_model():
    pairs = choose_live_pairs([src(1, 3.0), src(2, 9.0), src(3, 0.5)], [tgt(1, 5.0), tgt(2, 20.0)])
    assert [(p.source.instance_id, p.target.instance_id) for p in pairs] == [("s2", "t2"), ("s1", "t1")]


def test_no_pair_without_need_or_partner():
    # Not overloaded; a target of another model; a load that ends within the SLO (stop-the-world is fine);
    # already paired on either side; the same worker.
    assert choose_live_pairs([src(1, 0.9)], [tgt(1, 50.0)]) == []
    assert choose_live_pairs([src(1, 9.0)], [tgt(1, 50.0, model="other")]) == []
    assert choose_live_pairs([src(1, 9.0, slo=1.0)], [tgt(1, 0.5)]) == []
    assert choose_live_pairs([src(1, 9.0, paired=True)], [tgt(1, 50.0)]) == []
    assert choose_live_pairs([src(1, 9.0)], [tgt(1, 50.0, paired=True)]) == []
    assert choose_live_pairs([src(1, 9.0, worker="w")], [tgt(1, 50.0, worker="w")]) == []


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.floats(0, 10), st.floats(0.1, 5), st.sampled_from("ab"), st.booleans()), max_size=6),
       st.lists(st.tuples(st.floats(0, 30), st.sampled_from("ab"), st.booleans()), max_size=6))
def test_pairs_are_disjoint_of_one_model_and_only_where_needed(sources, targets):
    serving = [Serving(f"s{i}", f"ws{i}", m, w, slo, p) for i, (w, slo, m, p) in enumerate(sources)]
    receiving = [Receiving(f"t{i}", f"wt{i}", m, left, p) for i, (left, m, p) in enumerate(targets)]
    pairs = choose_live_pairs(serving, receiving)
    assert len({p.source.instance_id for p in pairs}) == len(pairs)
    assert len({p.target.instance_id for p in pairs}) == len(pairs)
    for p in pairs:
        assert p.source.overloaded and not p.source.paired and not p.target.paired
        assert p.source.model == p.target.model and p.target.load_left_s > p.source.slo_s
    # Maximal: an overloaded source left alone has no free target of its model that would do.
    taken = {p.target.instance_id for p in pairs}
    for s in serving:
        if s.overloaded and not s.paired and s.instance_id not in {p.source.instance_id for p in pairs}:
            assert not [r for r in receiving if r.instance_id not in taken and not r.paired and r.model == s.model
                        and r.load_left_s > s.slo_s]


def test_a_pair_becomes_the_command_both_workers_get():
    (pair,) = choose_live_pairs([src(1, 9.0)], [tgt(1, 50.0)])
    cmd = form_live_pair(pair, "/ckpt", {"ws1": "a:1", "wt1": "b:2", "other": "c:3"}, max_target_blocks=2)
    assert (cmd.source_instance, cmd.source_worker, cmd.target_instance, cmd.target_worker) == ("s1", "ws1", "t1", "wt1")
    assert cmd.peers == {"ws1": "a:1", "wt1": "b:2"} and cmd.max_target_blocks == 2 and cmd.model == "m"
    # It goes on the worker command subject as any command.
    assert isinstance(m.WorkerCommand.model_validate(cmd.model_dump()).root, m.FormLivePair)
    with pytest.raises(ValueError):
        m.FormLivePair(model="m", path="/p", source_instance="a", source_worker="w", target_instance="b",
                       target_worker="w", peers={"w": "a:1"})


def test_a_fixed_split_keeps_the_first_split_above_zero_and_an_unknown_policy_is_refused():
    split = PrefillSplitter(n_blocks=8, policy="fixed")
    assert split() == 0 and split.fixed is None  # nothing held yet: no split decided
    split.held(2)
    assert split() == 2 and split.fixed == 2
    split.held(6)
    assert [split(), split()] == [2, 2]  # blocks landed; the split stays
    assert split.splits == [0, 2, 2, 2]
    zigzag = PrefillSplitter(n_blocks=8, held=2)
    zigzag.held(6)
    assert zigzag() == 4 and zigzag.fixed is None  # ZigZag's grows (up to half the model)
    with pytest.raises(ValueError, match="split policy"):
        PrefillSplitter(8, policy="greedy")
