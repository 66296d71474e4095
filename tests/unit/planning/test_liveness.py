"""libs/planning/liveness.py: when a worker its data-plane peers could not reach is dead."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from libs.planning.liveness import LivenessRule, Probe, Report, add_report, probe_target, verdict

W = "worker-1"
RULE = LivenessRule(quorum=2, window_s=10.0)
peers = st.sampled_from(["worker-1", "worker-2", "worker-3", "worker-4"])
reports_st = st.lists(st.tuples(peers, st.floats(0, 30)), max_size=12)


def fold(reports, now=30.0, rule=RULE):
    kept = ()
    for reporter, at in reports:
        kept = add_report(kept, W, Report(reporter, at), now, rule)
    return kept


@given(reports_st, st.sampled_from(list(Probe)))
def test_a_worker_whose_data_plane_takes_a_connection_is_never_dead(reports, probe):
    assert not verdict(W, fold(reports), Probe.accepted, 30.0, RULE).dead
    if probe is Probe.refused:
        assert verdict(W, fold(reports), probe, 30.0, RULE).dead  # nothing listens: dead, whoever said it


@given(st.lists(st.floats(20, 30), min_size=1, max_size=20), st.sampled_from([Probe.silent, Probe.untestable]))
def test_one_peer_alone_never_kills_a_worker_the_probe_cannot_judge(times, probe):
    reports = fold([("worker-2", t) for t in times])
    assert len(reports) == 1  # one per reporter
    assert not verdict(W, reports, probe, 30.0, RULE).dead


@given(reports_st, peers, st.floats(20, 30), st.sampled_from(list(Probe)))
def test_another_report_never_brings_a_dead_worker_back(reports, reporter, at, probe):
    before = verdict(W, fold(reports), probe, 30.0, RULE).dead
    after = verdict(W, fold([*reports, (reporter, at)]), probe, 30.0, RULE).dead
    assert after or not before


@given(reports_st)
def test_the_worker_itself_and_old_reports_do_not_count(reports):
    kept = fold(reports)
    assert all(r.reporter != W and 30.0 - r.at <= RULE.window_s for r in kept)
    assert len({r.reporter for r in kept}) == len(kept)


def test_two_distinct_peers_within_the_window_make_a_death_when_the_probe_cannot_tell():
    one = fold([("worker-2", 25.0), ("worker-2", 29.0)])
    assert not verdict(W, one, Probe.silent, 30.0, RULE).dead
    two = fold([("worker-2", 25.0), ("worker-3", 29.0)])
    assert verdict(W, two, Probe.silent, 30.0, RULE).dead
    assert verdict(W, two, Probe.untestable, 30.0, RULE).dead
    stale = fold([("worker-2", 15.0), ("worker-3", 29.0)])  # worker-2's is 15 s old
    assert not verdict(W, stale, Probe.silent, 30.0, RULE).dead
    assert not verdict(W, two, Probe.silent, 40.0, RULE).dead  # both aged out by then


def test_what_a_connect_can_probe():
    assert probe_target("127.0.0.1:7001") == ("127.0.0.1", 7001)
    assert probe_target("[::1]:7001") == ("::1", 7001)
    assert probe_target("worker-3.layercast:7001") == ("worker-3.layercast", 7001)
    for address in ("rdma://worker-1/mlx5_0/1", "127.0.0.1", "host:0", "host:99999", ":80", ""):
        assert probe_target(address) is None, address


def test_bad_rules_are_refused():
    with pytest.raises(ValueError):
        LivenessRule(quorum=0)
    with pytest.raises(ValueError):
        LivenessRule(window_s=0)
