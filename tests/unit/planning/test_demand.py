"""Tests for the gateways' reports turned into per-tick demand (libs/planning/demand.py)."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from libs.planning.demand import GatewayReports, ModelReport


def test_load_is_the_served_rate_plus_the_queued_work_to_drain() -> None:
    reports = GatewayReports(drain_s=2.0)
    reports.add("gw-a", 0.0, [("m", ModelReport(in_flight=3, tokens_generated=50, interval_s=0.5))])
    reports.add("gw-b", 0.0, [("m", ModelReport(queued=2, queued_tokens=64, interval_s=0.5))])
    d = reports.take("m", 0.1)
    assert d.requests == 5
    assert d.load_tps == pytest.approx(50 / 0.5 + 64 / 2.0)
    # Levels hold until the next report: the next tick sees the same load.
    assert reports.take("m", 0.2).load_tps == pytest.approx(d.load_tps)
    # A report without an interval (an old gateway) gives no served rate.
    assert ModelReport(tokens_generated=10).load_tps(1.0) == 0.0


def test_a_first_request_for_a_cold_model_is_demand() -> None:
    # Nothing served yet (no instance), one request of 16 tokens waiting: a positive load.
    reports = GatewayReports()
    reports.add("gw", 0.0, [("m", ModelReport(queued=1, queued_tokens=16, interval_s=0.5))])
    assert reports.take("m", 0.0).load_tps > 0


def test_a_silent_gateway_stops_counting() -> None:
    reports = GatewayReports(stale_s=5.0)
    reports.add("gw", 0.0, [("m", ModelReport(in_flight=4, tokens_generated=10, interval_s=1.0,
                                              last_request_at=100.0))])
    assert reports.take("m", 4.0).requests == 4
    d = reports.take("m", 5.5)
    assert (d.requests, d.load_tps, d.last_requests) == (0, 0.0, ())


def test_samples_of_undeployed_models_are_dropped() -> None:
    reports = GatewayReports()
    reports.add("gw", 0.0, [("gone", ModelReport(ttft_s=(0.1,)))])
    reports.forget(["m"])
    assert reports.take("gone", 0.0).ttft_s == ()


@settings(max_examples=200, deadline=None)
@given(st.lists(st.one_of(
    st.tuples(st.just("report"), st.sampled_from(["gw-a", "gw-b"]), st.sampled_from(["m", "n"]),
              st.lists(st.floats(0.001, 5.0), max_size=4), st.lists(st.floats(0.001, 1.0), max_size=4)),
    st.tuples(st.just("tick")),
), max_size=40))
def test_every_latency_sample_reaches_exactly_one_tick(events) -> None:  # type: ignore[no-untyped-def]
    # Reports and ticks in any order (several reports between two ticks, or none): each TTFT/TPOT
    # sample is in exactly one tick's demand, of its own model.
    reports = GatewayReports()
    sent: dict[str, list[float]] = {"m": [], "n": []}
    taken: dict[str, list[float]] = {"m": [], "n": []}
    for i, ev in enumerate([*events, ("tick",)]):
        if ev[0] == "report":
            _, gw, model, ttft, tpot = ev
            reports.add(gw, float(i), [(model, ModelReport(ttft_s=tuple(ttft), tpot_s=tuple(tpot)))])
            sent[model] += ttft + tpot
        else:
            for model in ("m", "n"):
                d = reports.take(model, float(i))
                taken[model] += [*d.ttft_s, *d.tpot_s]
    for model in ("m", "n"):
        assert sorted(taken[model]) == sorted(sent[model])
