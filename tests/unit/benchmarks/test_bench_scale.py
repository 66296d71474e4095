"""`bench scale`'s aggregation: medians over trials, and a trial that breaks (a cluster that
does not come up, a deploy the gateway does not answer) is reported, not fatal to the run.
The trials themselves need root and minutes each: the benchmark runs them (docs/bench_scale)."""

from pathlib import Path

import pytest

from benchmarks import bench_scale
from libs.cluster.launcher import ClusterError


def trial(mode: str, all_ready: float, first_byte: float) -> dict:
    return {"mode": mode, "plan": {"kind": "multicast"}, "first_byte_s": first_byte, "instance_ready_s": [all_ready],
            "all_ready_s": all_ready, "bound_s": 4.0, "ratio_to_bound": all_ready / 4.0,
            "tokens_per_s_timeline": [], "failed_requests": 0, "model_bytes": 1, "timings_s": {"decided": 0.0}}


def test_a_broken_trial_is_reported_and_the_others_still_count(monkeypatch, tmp_path):
    outcomes = iter([trial("layercast", 5.0, 0.04), ClusterError("the gateway did not answer the deploy"),
                     trial("layercast", 6.0, 0.03)])

    def run_once(mode: str, **_kw) -> dict:
        out = next(outcomes)
        if isinstance(out, Exception):
            raise out
        return out

    monkeypatch.setattr(bench_scale, "run_once", run_once)
    report = bench_scale.run_scale_benchmark(modes=["layercast"], workers=4, from_n=1, to_n=4,
                                             model_path=Path("unused"), state_dir=tmp_path, emulate=False, repeat=3)
    (layercast,) = report["results"]
    assert [t.get("error") for t in layercast["trials"]] == [
        None, "ClusterError: the gateway did not answer the deploy", None]
    assert layercast["all_ready_s"] == pytest.approx(5.5) and layercast["first_byte_s"] == pytest.approx(0.035)
    assert layercast["ratio_to_bound"] == pytest.approx(5.5 / 4.0)


def test_a_burst_reports_when_every_request_and_new_capacity_got_a_first_token():
    burst = bench_scale._Burst("http://unused", "k", "m", n=3, max_tokens=4)
    burst.requests = [(10.1, 10.5, 10.9, 4, "warm-1"), (10.2, 12.0, 12.5, 4, "pipe-1"), (10.2, 11.0, 11.5, 4, "inst-2")]
    assert burst.first_tokens(10.0, warm={"warm-1"}) == {
        "burst_first_token_s": 2.0, "new_capacity_first_token_s": 1.0, "burst_served_by_new_capacity": 2,
        # (routed, first token, last token, tokens, instance: warm ones first, then by id)
        "burst_requests": [(0.1, 0.5, 0.9, 4, "warm0"), (0.2, 1.0, 1.5, 4, "new1"), (0.2, 2.0, 2.5, 4, "new2")]}
    burst.requests.pop()  # a request that never got a token: the burst has no first-token time
    assert burst.first_tokens(10.0, warm={"warm-1"})["burst_first_token_s"] is None


def test_burst_comparisons_are_ratios_of_the_medians(monkeypatch, tmp_path):
    def run_once(mode: str, **_kw) -> dict:
        t = trial(mode, {"layercast": 6.0, "binomial": 6.0}[mode], 0.1)
        t |= {"burst_first_token_s": {"layercast": 2.0, "binomial": 4.0}[mode],
              "new_capacity_first_token_s": {"layercast": 1.5, "binomial": 6.0}[mode]}
        return t

    monkeypatch.setattr(bench_scale, "run_once", run_once)
    report = bench_scale.run_scale_benchmark(modes=["layercast", "binomial"], workers=4, from_n=1, to_n=4,
                                             model_path=Path("unused"), state_dir=tmp_path, emulate=False, repeat=1,
                                             burst=50)
    assert report["burst"] == 50
    assert report["comparison"]["layercast_over_binomial_burst_first_token"] == pytest.approx(0.5)
    assert report["comparison"]["layercast_new_capacity_first_token_over_all_ready"] == pytest.approx(0.25)


def test_burst_figures_are_also_reported_as_overheads_over_ideal_in_the_same_run(monkeypatch, tmp_path):
    """Issue 41: a mode's burst first token minus ideal's (every worker already holding the
    model), and layercast's overhead as a multiple of binomial's and serverlessllm's."""
    burst_first = {"layercast": 5.0, "binomial": 6.0, "serverlessllm": 12.0, "ideal": 4.0}
    new_first = {"layercast": 3.0, "binomial": 4.0, "serverlessllm": None, "ideal": 0.5}

    def run_once(mode: str, **_kw) -> dict:
        return trial(mode, 5.0, 0.1) | {"burst_first_token_s": burst_first[mode],
                                        "new_capacity_first_token_s": new_first[mode]}

    monkeypatch.setattr(bench_scale, "run_once", run_once)
    report = bench_scale.run_scale_benchmark(modes=list(burst_first), workers=4, from_n=1, to_n=4,
                                             model_path=Path("unused"), state_dir=tmp_path, emulate=False, repeat=1,
                                             burst=50)
    c = report["comparison"]
    assert c["layercast_burst_first_token_over_ideal_s"] == pytest.approx(1.0)
    assert c["binomial_burst_first_token_over_ideal_s"] == pytest.approx(2.0)
    assert c["serverlessllm_burst_first_token_over_ideal_s"] == pytest.approx(8.0)
    assert c["layercast_new_capacity_first_token_over_ideal_s"] == pytest.approx(2.5)
    assert "serverlessllm_new_capacity_first_token_over_ideal_s" not in c  # it never got new capacity
    assert c["layercast_over_binomial_burst_overhead"] == pytest.approx(0.5)
    assert c["layercast_over_serverlessllm_burst_overhead"] == pytest.approx(0.125)
    assert c["layercast_over_binomial_new_capacity_first_token"] == pytest.approx(0.75)
    # Without ideal in the run there is nothing to subtract.
    assert not any(k.endswith("_over_ideal_s") for k in bench_scale.burst_overheads(
        {m: r for m, r in {r["mode"]: r for r in report["results"]}.items() if m != "ideal"}))


def test_the_timeline_marks_when_pipelines_formed_and_switched():
    timings = {"decided": 0.0, "pipeline_ready:pipe-1": 2.67, "loaded:inst-1": 3.1, "switched:pipe-1": 5.09,
               "pipeline_ready:pipe-2": 2.9, "done": 5.1}
    assert bench_scale.timeline_marks(timings) == [("pipeline formed", 2.67), ("pipeline formed", 2.9),
                                                   ("switched", 5.09)]
    assert bench_scale.timeline_marks({"decided": 0.0, "done": 1.0}) == []


def test_the_timeline_plot_is_written(tmp_path):
    out = tmp_path / "timeline.png"
    bench_scale.plot_timelines(out, {"layercast": [0, 5, 10], "binomial": [0, 0, 10]}, step_s=0.1, title="t",
                               marks={"layercast": [("pipeline formed", 0.1), ("switched", 0.2)]})
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_overload_comparisons_are_p90_ratios_pairs_over_nopairs_and_each_over_ideal():
    def mode(name: str, first_p90: float, last_p90: float) -> dict:
        return {"mode": name, "overload_latency": {"first_token_p90_s": first_p90, "last_token_p90_s": last_p90}}
    by = {r["mode"]: r for r in (mode("blitzscale", 2.0, 4.0), mode("blitzscale-nopairs", 4.0, 5.0),
                                 mode("ideal", 1.0, 2.0))}
    c = bench_scale.overload_comparison(by)
    assert c["blitzscale_over_blitzscale-nopairs_first_token_p90_s"] == 0.5
    assert c["blitzscale_over_blitzscale-nopairs_last_token_p90_s"] == 0.8
    assert c["blitzscale_over_ideal_first_token_p90_s"] == 2.0
    assert c["blitzscale-nopairs_over_ideal_last_token_p90_s"] == 2.5
    assert "ideal_over_ideal_first_token_p90_s" not in c


def test_zigzag_against_the_fixed_split_is_compared_on_the_worst_request_too():
    def mode(name: str, worst: float) -> dict:
        return {"mode": name, "overload_latency": {"first_token_p90_s": 1.0, "first_token_max_s": worst}}
    c = bench_scale.overload_comparison({r["mode"]: r for r in (mode("blitzscale", 3.0), mode("blitzscale-fixed", 4.0))})
    assert c["blitzscale_over_blitzscale-fixed_first_token_max_s"] == 0.75


def test_the_sources_splits_are_read_off_the_workers_metrics_pages():
    from prometheus_client import CollectorRegistry, Counter, generate_latest

    from services.worker.livepairs import SPLITS

    pages = []
    for counts in ({("zigzag", "2"): 3, ("zigzag", "10"): 1}, {("fixed", "1"): 4, ("zigzag", "2"): 1}):
        registry = CollectorRegistry()  # one worker's page, the worker's own metric
        c = Counter(SPLITS._name, SPLITS._documentation, SPLITS._labelnames, registry=registry)
        for labels, n in counts.items():
            c.labels(*labels).inc(n)
        pages.append(generate_latest(registry).decode())
    assert bench_scale.live_pair_splits(pages) == {"fixed:1": 4, "zigzag:2": 4, "zigzag:10": 1}
    assert bench_scale.live_pair_splits(["# no pair here\n"]) == {}
