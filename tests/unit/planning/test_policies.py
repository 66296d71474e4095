"""Tests for the scaling policies (libs/planning/policies.py)."""

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from libs.planning.policies import (
    ConcurrencyPolicy,
    MetricsSample,
    SloPolicy,
    ThresholdPolicy,
    concurrency_policy,
    percentile,
    slo_policy,
    threshold_policy,
)


def window(loads: list[float], ready: int, dt: float = 0.1, warming: int = 0, **kw) -> list[MetricsSample]:  # type: ignore[no-untyped-def]
    return [MetricsSample(t=i * dt, ready=ready, warming=warming, load_tps=x, **kw) for i, x in enumerate(loads)]


# ---------------------------------------------------------------------------
# threshold (BlitzScale §5.3)
# ---------------------------------------------------------------------------

CFG = ThresholdPolicy(capacity_tps=1000.0, upper=0.8, lower=0.3, scale_down_timeout_s=0.5, average_s=0.3)


def test_threshold_scales_up_to_meet_demand() -> None:
    # 2 instances, demand 4000 tok/s: 4000 / 800 = 5 instances.
    assert threshold_policy(window([4000.0] * 5, ready=2), CFG) == 5
    # Under the upper bound: keep.
    assert threshold_policy(window([1500.0] * 5, ready=2), CFG) == 2
    # Warming instances count: 3 ready + 2 warming already meet 4000.
    assert threshold_policy(window([4000.0] * 5, ready=3, warming=2), CFG) == 5


def test_threshold_scales_down_only_after_timeout() -> None:
    calm = [200.0] * 10  # 0.9 s of samples at 100 ms, 200 tok/s over 4 instances
    assert threshold_policy(window(calm, ready=4), CFG) == 1
    # Only 0.3 s of calm: the sub-second timeout has not elapsed.
    assert threshold_policy(window([200.0] * 4, ready=4), CFG) == 4
    # A spike inside the timeout cancels the scale-down.
    spiky = [200.0] * 6 + [1400.0] + [200.0] * 3
    assert threshold_policy(window(spiky, ready=4), CFG) == 4
    # Idle → min_instances (0: scale to zero).
    assert threshold_policy(window([0.0] * 10, ready=1), CFG) == 0
    assert threshold_policy(window([0.0] * 10, ready=1), ThresholdPolicy(1000.0, min_instances=1)) == 1
    assert threshold_policy([], CFG) == 0


@settings(max_examples=80, deadline=None)
@given(
    loads=st.lists(st.floats(min_value=0, max_value=20000), min_size=1, max_size=30),
    ready=st.integers(min_value=0, max_value=20),
)
def test_threshold_invariants(loads: list[float], ready: int) -> None:
    cfg = ThresholdPolicy(capacity_tps=1000.0, max_instances=16)
    d = threshold_policy(window(loads, ready=ready), cfg)
    assert 0 <= d <= 16
    recent = loads[-10:]  # average_s = 1 s of 100 ms samples, half-open window
    need = math.ceil(sum(recent) / len(recent) / 800 - 1e-9)
    if ready == 0 and loads[-1] > 0:
        need = max(need, 1)  # any load with no instance asks for one
    if d > ready:  # scaled up: exactly enough (capped) for the recent average at the upper bound
        assert d == min(16, need)
    elif need > ready and ready < 16:
        pytest.fail("demand above the upper bound must scale up")


def test_threshold_scales_from_zero_on_the_first_request() -> None:
    # One small request with no instance: far under the upper bound, still one instance at once.
    assert threshold_policy(window([16.0], ready=0), CFG) == 1
    # Queued with no load reported yet (e.g. max_tokens unknown): one instance too.
    assert threshold_policy(window([0.0], ready=0, in_flight=1), CFG) == 1
    assert threshold_policy(window([0.0], ready=0), CFG) == 0
    assert threshold_policy(window([16.0], ready=0), ThresholdPolicy(1000.0, max_instances=0)) == 0


def test_threshold_keeps_an_instance_while_requests_run() -> None:
    # Under the lower bound for the whole timeout, but a request still runs: not to zero.
    assert threshold_policy(window([0.0] * 10, ready=2, in_flight=1), CFG) == 1
    assert threshold_policy(window([0.0] * 10, ready=2, in_flight=0), CFG) == 0


@settings(max_examples=150, deadline=None)
@given(
    loads=st.lists(st.floats(min_value=0, max_value=20000), min_size=1, max_size=30),
    in_flight=st.lists(st.integers(min_value=0, max_value=5), min_size=1, max_size=30),
    ready=st.integers(min_value=0, max_value=20),
    max_instances=st.integers(min_value=1, max_value=16),
)
def test_threshold_serves_demand_with_at_least_one_instance(loads: list[float], in_flight: list[int], ready: int,
                                                            max_instances: int) -> None:
    # Invariant: load or requests at the last sample never leave the model without an instance.
    n = min(len(loads), len(in_flight))
    w = [MetricsSample(t=i * 0.1, ready=ready, load_tps=loads[i], in_flight=in_flight[i]) for i in range(n)]
    d = threshold_policy(w, ThresholdPolicy(capacity_tps=1000.0, max_instances=max_instances))
    if w[-1].load_tps > 0 or w[-1].in_flight > 0:
        assert d >= 1


# ---------------------------------------------------------------------------
# concurrency + keep-alive
# ---------------------------------------------------------------------------


def conc(in_flight: list[int], ready: int, dt: float = 1.0) -> list[MetricsSample]:
    return [MetricsSample(t=i * dt, ready=ready, in_flight=x) for i, x in enumerate(in_flight)]


def test_concurrency_target_panic_and_keep_alive() -> None:
    cfg = ConcurrencyPolicy(target=4, stable_s=6, panic_s=1, keep_alive_s=10)
    assert concurrency_policy(conc([8] * 7, ready=1), cfg) == 2
    # Burst in the last second: panic follows it right away, never shrinks.
    assert concurrency_policy(conc([4] * 6 + [40], ready=1), cfg) == 10
    # Cold start: queued requests and no instance → scale from zero.
    assert concurrency_policy(conc([3], ready=0), cfg) == 1
    # Idle but within keep-alive: keep one.
    assert concurrency_policy(conc([2] + [0] * 8, ready=2), cfg) == 1
    # A full keep-alive of silence: scale to zero.
    assert concurrency_policy(conc([0] * 12, ready=1), cfg) == 0
    # Short window, caller tracks the last request.
    short = conc([0] * 3, ready=1)
    assert concurrency_policy(short, cfg, last_request_at=-20.0) == 0
    assert concurrency_policy(short, cfg, last_request_at=-5.0) == 1
    assert concurrency_policy(conc([40], ready=1), ConcurrencyPolicy(target=4, max_instances=3)) == 3


# ---------------------------------------------------------------------------
# SLO saturation
# ---------------------------------------------------------------------------

SLO = SloPolicy(ttft_slo_s=1.0, tpot_slo_s=0.1, quantile=90, target=0.8, warming_credit=0.5)


def slo_window(ttft: float, tpot: float, ready: int, warming: int = 0, n: int = 10) -> list[MetricsSample]:
    return [
        MetricsSample(t=i * 0.25, ready=ready, warming=warming, in_flight=5, ttft_s=(ttft,) * 5, tpot_s=(tpot,) * 5)
        for i in range(n)
    ]


def test_slo_scales_with_saturation_and_credits_warming() -> None:
    # p90 TTFT at 2× the SLO on 2 instances: need 2 · 2 / 0.8 = 5.
    assert slo_policy(slo_window(2.0, 0.05, ready=2), SLO) == 5
    # TPOT is the worse one here: 1.5× → 2 · 1.5 / 0.8 = 3.75 → 4.
    assert slo_policy(slo_window(0.5, 0.15, ready=2), SLO) == 4
    # Two instances already warming count as one: 5 needed, 2 + 1 effective → 2 more.
    assert slo_policy(slo_window(2.0, 0.05, ready=2, warming=2), SLO) == 6
    # Enough warming capacity on the way: do not scale again.
    assert slo_policy(slo_window(2.0, 0.05, ready=2, warming=6), SLO) == 8
    # Within target: keep.
    assert slo_policy(slo_window(0.7, 0.07, ready=3), SLO) == 3


def test_slo_scale_down_and_idle() -> None:
    cfg = SloPolicy(ttft_slo_s=1.0, tpot_slo_s=0.1, scale_down_timeout_s=2.0, idle_s=5.0)
    # Saturation 0.2 for > 2 s on 8 instances: 8 · 0.2 / 0.8 = 2.
    assert slo_policy(slo_window(0.2, 0.02, ready=8, n=10), cfg) == 2
    # Not for long enough yet.
    assert slo_policy(slo_window(0.2, 0.02, ready=8, n=4), cfg) == 8
    # Nothing observed and nothing in flight for the keep-alive: to min_instances.
    idle = [MetricsSample(t=float(i), ready=2) for i in range(7)]
    assert slo_policy(idle, cfg) == 0
    assert slo_policy(idle[:3], cfg) == 2
    # Queued requests and no instance at all: ask for one.
    assert slo_policy([MetricsSample(t=0.0, ready=0, in_flight=3)], cfg) == 1


def test_slo_scales_down_under_light_load_where_most_ticks_observe_nothing() -> None:
    # 0.1 s ticks, one request's TTFT/TPOT every 0.5 s at saturation 0.2, on 8 instances: the
    # saturation over window_s (2 s) stays 0.2 through the timeout, so 8 · 0.2 / 0.8 = 2.
    cfg = SloPolicy(ttft_slo_s=1.0, tpot_slo_s=0.1, scale_down_timeout_s=2.0, window_s=2.0)
    w = [MetricsSample(t=i * 0.1, ready=8, in_flight=1, ttft_s=(0.2,) if i % 5 == 0 else (),
                       tpot_s=(0.02,) if i % 5 == 0 else ()) for i in range(50)]
    assert slo_policy(w, cfg) == 2
    # A saturated observation inside the timeout keeps them all.
    hot = [*w[:45], MetricsSample(t=4.5, ready=8, in_flight=1, ttft_s=(0.9,)), *w[46:]]
    assert slo_policy(hot, cfg) == 8


def test_percentile() -> None:
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile([5], 90) == 5
    assert percentile([1, 2, 3, 4, 5, 6, 7, 8, 9, 10], 90) == pytest.approx(9.1)
    with pytest.raises(ValueError):
        percentile([], 50)


def test_policy_config_validation() -> None:
    with pytest.raises(ValueError):
        ThresholdPolicy(capacity_tps=0)
    with pytest.raises(ValueError):
        ThresholdPolicy(capacity_tps=1, lower=0.9, upper=0.5)
    with pytest.raises(ValueError):
        ConcurrencyPolicy(target=0)
    with pytest.raises(ValueError):
        SloPolicy(ttft_slo_s=0, tpot_slo_s=1)
    with pytest.raises(ValueError, match="quantile"):
        SloPolicy(ttft_slo_s=1, tpot_slo_s=1, quantile=101)


@settings(max_examples=60, deadline=None)
@given(steps=st.lists(st.floats(0, 2), min_size=1, max_size=40), seconds=st.floats(0, 10))
def test_the_averaging_window_is_the_samples_after_now_minus_its_length(steps, seconds):
    from libs.planning.policies import _last

    t, ts = 0.0, []
    for dt in steps:  # a window in time order, repeats allowed
        t += dt
        ts.append(t)
    w = [MetricsSample(t=x, ready=1) for x in ts]
    start = w[-1].t - seconds
    assert _last(w, seconds) == ([s for s in w if s.t > start + 1e-12] or [w[-1]])
