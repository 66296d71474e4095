"""Tests for trace replay's pure part (benchmarks/trace_replay.py)."""

import math
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from benchmarks.trace_replay import (
    ReplayRequest,
    TraceRow,
    Transform,
    apply_transform,
    attains_slo,
    fit_tokens,
    instance_intervals,
    instance_seconds,
    instance_steps,
    parse_trace,
    percentiles,
    rate_series,
    slo_attainment,
    step_integral,
    transform_summary,
)

SHARED_TRACE = Path(__file__).resolve().parents[4] / "shared" / "traces" / "azure_llm_code_2023_first30min.csv"

CSV = """TIMESTAMP,ContextTokens,GeneratedTokens
2023-11-16 18:17:03.9799600,4808,10
2023-11-16 18:17:04.0319600,3180,8
2023-11-16 18:17:04.0781490,110,27
2023-11-16 18:17:05.5000000,7433,14
"""

rows_st = st.lists(
    st.builds(TraceRow, st.floats(0, 3600, allow_nan=False), st.integers(0, 10_000), st.integers(0, 3_000)),
    max_size=200,
).map(lambda rs: sorted(rs, key=lambda r: r.t_s))
caps = st.none() | st.integers(1, 4096)
transforms = st.builds(
    Transform,
    time_scale=st.floats(0.1, 100, allow_nan=False),
    rate_scale=st.floats(0.01, 1.0, allow_nan=False),
    max_prompt_tokens=caps,
    max_output_tokens=caps,
    prompt_scaling=st.sampled_from(["scale", "clip"]),
    output_scaling=st.sampled_from(["scale", "clip"]),
    start_s=st.floats(0, 600, allow_nan=False),
    duration_s=st.none() | st.floats(1, 3600, allow_nan=False),
    seed=st.integers(0, 2**32),
)


def test_parse_azure_rows_relative_times():
    rows = parse_trace(CSV.splitlines(keepends=True))
    assert [r.prompt_tokens for r in rows] == [4808, 3180, 110, 7433]
    assert rows[0].t_s == 0.0
    assert rows[1].t_s == pytest.approx(0.052, abs=1e-6)
    assert rows[3].t_s == pytest.approx(1.52004, abs=1e-6)


def test_parse_plain_seconds_and_sorts():
    rows = parse_trace(["TIMESTAMP,ContextTokens,GeneratedTokens\n", "5.5,10,2\n", "1.5,20,3\n"])
    assert rows == [TraceRow(0.0, 20, 3), TraceRow(4.0, 10, 2)]


def test_parse_rejects_missing_columns():
    with pytest.raises(ValueError, match="GeneratedTokens"):
        parse_trace(["TIMESTAMP,ContextTokens\n", "1,2\n"])


@pytest.mark.skipif(not SHARED_TRACE.exists(), reason="shared trace not present")
def test_shared_trace_transform():
    rows = parse_trace(SHARED_TRACE)
    assert len(rows) == 5740
    tf = Transform(time_scale=10, rate_scale=0.2, max_prompt_tokens=512, max_output_tokens=64, duration_s=600)
    reqs = apply_transform(rows, tf)
    assert 0 < len(reqs) < sum(1 for r in rows if r.t_s < 600)
    assert all(0 <= r.send_at_s < 60 for r in reqs)
    assert max(r.prompt_tokens for r in reqs) <= 512 and max(r.output_tokens for r in reqs) <= 64
    summary = transform_summary(rows, tf, reqs)
    assert summary["requests"] == len(reqs) and summary["replay_duration_s"] == 60
    assert summary["window_max_prompt_tokens"] > 512


def test_transform_rejects_bad_parameters():
    for kw in ({"time_scale": 0}, {"rate_scale": 0}, {"rate_scale": 1.5}, {"max_prompt_tokens": 0},
               {"output_scaling": "squash"}, {"duration_s": 0}, {"start_s": -1}):
        with pytest.raises(ValueError):
            Transform(**kw)


@given(rows_st, transforms)
@settings(max_examples=200, deadline=None)
def test_transform_properties(rows, tf):
    reqs = apply_transform(rows, tf)
    # a subset of the rows, in order, each inside the window
    idx = [r.row for r in reqs]
    assert idx == sorted(set(idx))
    end = math.inf if tf.duration_s is None else tf.start_s + tf.duration_s
    for r in reqs:
        src = rows[r.row]
        assert tf.start_s <= src.t_s < end
        # time scale divides offsets from the window start
        assert r.send_at_s == pytest.approx((src.t_s - tf.start_s) / tf.time_scale)
        assert r.send_at_s >= 0
        # token caps respected, lengths positive
        assert r.prompt_tokens >= 1 and r.output_tokens >= 1
        if tf.max_prompt_tokens is not None:
            assert r.prompt_tokens <= tf.max_prompt_tokens
        if tf.max_output_tokens is not None:
            assert r.output_tokens <= tf.max_output_tokens
    assert [r.send_at_s for r in reqs] == sorted(r.send_at_s for r in reqs)
    # deterministic
    assert apply_transform(rows, tf) == reqs


@given(rows_st, transforms, st.floats(0.01, 1.0))
@settings(max_examples=100, deadline=None)
def test_thinning_nests_and_rate_one_keeps_all(rows, tf, other_rate):
    import dataclasses

    lo, hi = sorted((tf.rate_scale, other_rate))
    kept_lo = {r.row for r in apply_transform(rows, dataclasses.replace(tf, rate_scale=lo))}
    kept_hi = {r.row for r in apply_transform(rows, dataclasses.replace(tf, rate_scale=hi))}
    assert kept_lo <= kept_hi
    everything = apply_transform(rows, dataclasses.replace(tf, rate_scale=1.0))
    end = math.inf if tf.duration_s is None else tf.start_s + tf.duration_s
    assert len(everything) == sum(1 for r in rows if tf.start_s <= r.t_s < end)


@given(rows_st, transforms)
@settings(max_examples=100, deadline=None)
def test_time_scale_only_changes_send_times(rows, tf):
    import dataclasses

    a = apply_transform(rows, dataclasses.replace(tf, time_scale=1.0))
    b = apply_transform(rows, tf)
    assert [(r.row, r.prompt_tokens, r.output_tokens) for r in a] == [(r.row, r.prompt_tokens, r.output_tokens)
                                                                      for r in b]
    for x, y in zip(a, b):
        assert y.send_at_s == pytest.approx(x.send_at_s / tf.time_scale)


@given(st.lists(st.integers(0, 10_000), max_size=100), st.integers(1, 5000))
def test_fit_tokens(values, cap):
    clipped = fit_tokens(values, cap, "clip")
    scaled = fit_tokens(values, cap, "scale")
    assert all(1 <= v <= cap for v in clipped + scaled)
    assert clipped == [max(1, min(v, cap)) for v in values]
    # scaling keeps the order of the lengths (a monotone map)
    for (a, b), (sa, sb) in zip(zip(values, values[1:]), zip(scaled, scaled[1:])):
        if a <= b:
            assert sa <= sb
    if values and max(values) <= cap:
        assert scaled == clipped
    if values and max(values) > cap:
        assert max(scaled) == cap


def test_fit_tokens_scale_example():
    assert fit_tokens([7437, 3718, 10, 0], 512, "scale") == [512, 256, 1, 1]
    assert fit_tokens([5, 0], None, "clip") == [5, 1]


@given(st.lists(st.floats(0, 1e3, allow_nan=False), max_size=300))
def test_percentiles_monotone(values):
    p = percentiles(values, digits=None)
    if not values:
        assert p == {"p50": None, "p90": None, "p99": None}
        return
    assert min(values) <= p["p50"] <= p["p90"] <= p["p99"] <= max(values)


def test_percentiles_values():
    assert percentiles(range(101)) == {"p50": 50.0, "p90": 90.0, "p99": 99.0}
    assert percentiles([1.0, None, 3.0]) == {"p50": 2.0, "p90": 2.8, "p99": 2.98}


def test_slo_attainment():
    assert attains_slo(1.0, 0.1, 1.0, 0.1)
    assert not attains_slo(1.01, 0.1, 1.0, 0.1)
    assert not attains_slo(0.5, 0.2, 1.0, 0.1)
    assert attains_slo(0.5, None, 1.0, 0.1)  # one-token answer
    assert not attains_slo(None, None, 1.0, 0.1)  # failed
    assert slo_attainment([(0.5, 0.05), (2.0, 0.05), (None, None), (0.1, None)], 1.0, 0.1) == 0.5
    assert slo_attainment([], 1.0, 0.1) is None


@given(st.lists(st.tuples(st.floats(0, 100), st.floats(0, 100)), max_size=50),
       st.lists(st.tuples(st.floats(0, 100), st.floats(0, 100)), max_size=50))
def test_instance_seconds_additive(a, b):
    a = [(min(x), max(x)) for x in a]
    b = [(min(x), max(x)) for x in b]
    assert instance_seconds(a + b) == pytest.approx(instance_seconds(a) + instance_seconds(b))
    assert instance_seconds(a) >= 0


events_st = st.lists(st.tuples(st.sampled_from(["i1", "i2", "i3", "i4"]),
                               st.sampled_from(["loading", "ready", "draining", "stopped", "failed"]),
                               st.floats(0, 100, allow_nan=False)), max_size=40)


@given(events_st, st.floats(0, 50), st.floats(0, 60))
@settings(max_examples=200)
def test_intervals_and_steps_agree(events, t_start, length):
    t_end = t_start + length
    iv = instance_intervals(events, t_start, t_end)
    for s, e in iv.values():
        assert t_start <= s < e <= t_end
    steps = instance_steps(iv.values(), t_start, t_end)
    assert steps[0][0] == t_start and steps[-1][0] == t_end
    assert all(n >= 0 for _, n in steps)
    assert [t for t, _ in steps] == sorted(t for t, _ in steps)
    assert step_integral(steps) == pytest.approx(instance_seconds(iv.values()), abs=1e-6)
    assert max(n for _, n in steps) <= len(iv)


def test_instance_intervals_example():
    events = [("a", "loading", 1.0), ("a", "ready", 2.0), ("a", "draining", 5.0), ("a", "stopped", 6.0),
              ("b", "loading", 4.0), ("b", "ready", 4.5),  # still running at the end
              ("c", "loading", -5.0), ("c", "ready", -4.0),  # began before the window
              ("d", "loading", 0.5), ("d", "failed", 0.8)]  # failed before the window
    iv = instance_intervals(events, 0.0 + 1.0, 10.0)
    assert iv == {"a": (1.0, 6.0), "b": (4.0, 10.0), "c": (1.0, 10.0)}
    assert instance_seconds(iv.values()) == 5.0 + 6.0 + 9.0
    assert instance_steps(iv.values(), 1.0, 10.0) == [(1.0, 2), (4.0, 3), (6.0, 2), (10.0, 2)]


def test_rate_series():
    assert rate_series([0.1, 0.2, 1.5, 9.9], 2.0, 10.0) == [(0.0, 1.5), (2.0, 0.0), (4.0, 0.0), (6.0, 0.0),
                                                          (8.0, 0.5)]
    assert sum(r for _, r in rate_series([0.5] * 7, 0.5, 3.0)) * 0.5 == 7


def test_replay_request_is_hashable():
    assert len({ReplayRequest(0.0, 1, 1, 0), ReplayRequest(0.0, 1, 1, 0)}) == 1


def test_scale_out_times_are_the_simulators_decision_to_capacity_and_to_end():
    from benchmarks.trace_replay import scale_out_summary, scale_out_times

    ops = [("up", {"decided": 10.0, "planned": 10.2, "ready:i1": 11.5, "pipeline_ready:p1": 11.0,
                   "loaded:i1": 11.4, "done": 12.0}, {"algorithm": "binomial"}),
           ("up", {"planned": 20.0, "ready:i2": 24.0, "done": 26.0}, {"kind": "local-load"}),
           ("down", {"decided": 30.0, "done": 30.5}, {}),  # a scale-in: not a scale-out
           ("up", {"decided": 40.0, "ready:i3": 41.0}, {})]  # still running at the window's end
    times = scale_out_times(ops)
    assert times == [{"algorithm": "binomial", "first_capacity_s": 1.0, "done_s": 2.0},
                     {"algorithm": "local-load", "first_capacity_s": 4.0, "done_s": 6.0}]
    summary = scale_out_summary(times)
    assert summary["n"] == 2 and summary["mean"] == 4.0 and summary["p50"] == 4.0
    assert scale_out_summary([]) == {"n": 0, "mean": None, "p50": None, "p90": None, "p99": None}
