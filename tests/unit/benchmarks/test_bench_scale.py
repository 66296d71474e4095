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
