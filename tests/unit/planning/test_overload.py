"""`bench scale --overload-rps` measures (libs/planning/overload.py): the requests in the
scale-out window, their percentiles, and the first throughput rise after the first block."""

from hypothesis import given
from hypothesis import strategies as st

from libs.planning.overload import first_rise_s, mean_rate, percentile, window_latencies


def test_percentile_is_nearest_rank():
    values = [float(v) for v in range(1, 11)]  # 1..10
    assert percentile(values, 0.5) == 5.0
    assert percentile(values, 0.9) == 9.0
    assert percentile([3.0], 0.9) == 3.0
    assert percentile([], 0.9) is None


@given(st.lists(st.floats(0, 100), min_size=1, max_size=50), st.floats(0.01, 1.0))
def test_percentile_is_a_value_with_at_least_q_at_or_below(values, q):
    p = percentile(values, q)
    assert p in values
    assert sum(v <= p for v in values) >= q * len(values) - 1e-9


def test_window_keeps_only_requests_sent_inside_it():
    requests = [
        (9.0, 9.1, 9.5),     # before the window: left out however slow
        (10.0, 11.0, 12.0),  # at the window's start: in
        (11.0, 14.0, 15.0),  # in
        (12.0, None, None),  # in, never got a token
        (13.0, 13.5, 20.0),  # at the window's end: in
        (13.1, 30.0, 40.0),  # after: left out
    ]
    w = window_latencies(requests, 10.0, 13.0)
    assert w["requests"] == 4 and w["without_token"] == 1
    # first-token latencies 1.0, 3.0, 0.5; last-token 2.0, 4.0, 7.0
    assert w["first_token_p50_s"] == 1.0 and w["first_token_p90_s"] == 3.0
    assert w["last_token_p50_s"] == 4.0 and w["last_token_p90_s"] == 7.0
    assert w["first_token_max_s"] == 3.0 and w["last_token_max_s"] == 7.0  # the worst request inside


def test_first_rise_is_the_first_bucket_after_the_block_above_the_margin():
    step = 0.1
    # a spike before the first block (at 0.3 s) does not count; 130 is under 100 * 1.5
    timeline = [100.0, 200.0, 100.0, 100.0, 130.0, 160.0, 200.0]
    assert first_rise_s(timeline, step, 0.3, 100.0, 0.5) == 0.5
    assert first_rise_s(timeline, step, 0.3, 100.0, 1.0) is None
    assert first_rise_s(timeline, step, 0.0, 100.0, 0.5) == 0.1


def test_mean_rate_over_buckets_starting_in_the_range():
    assert mean_rate([10.0, 20.0, 30.0, 40.0], 0.1, 0.1, 0.3) == 25.0
    assert mean_rate([10.0], 0.1, 1.0, 2.0) is None
