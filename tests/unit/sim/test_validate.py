"""`layercast simulate --validate`'s pure part (libs/sim/validate.py): the benchmark's setting read
back, the comparison against the real runs' median and range, and the report."""

import copy
import json
from pathlib import Path

import pytest

from libs.planning.trace import Transform, apply_transform, parse_trace
from libs.sim import validate as v
from libs.sim.fleet import RunResult, Request, simulate
from sim_profile import profile  # noqa: F401  (fixture)

REPO = Path(__file__).resolve().parents[3]
COMMITTED = [REPO / "docs" / "bench_trace" / f"code_4workers_cpu04_run{i}.json" for i in (1, 2, 3)]

TRANSFORM = {"time_scale": 20.0, "rate_scale": 0.5, "max_prompt_tokens": 256, "max_output_tokens": 16,
             "prompt_scaling": "scale", "output_scaling": "clip", "start_s": 0.0, "duration_s": 60.0, "seed": 0,
             "requests": 0, "replay_duration_s": 3.0}


def bench_json(**results) -> dict:
    """A `bench trace --json` result of the shape the benchmark writes (only what --validate reads)."""
    return {"trace": "t.csv", "transform": dict(TRANSFORM),
            "settings": {"workers": 2, "max_instances": 2, "keep_alive_s": 3.0, "scale_down_delay_s": 5.0,
                         "target_concurrency": 2, "policy": "concurrency", "policy_params": {},
                         "serverlessllm_keep_alive_s": 0.75, "emulated": True, "model_preset": "tiny", "blocks": 2,
                         "emulation_profile": {"link_mbit": 400, "disk_read_mbit": 40, "host_to_device_mbit": 500,
                                               "cpu_quota": 0.4}},
            "slo": {"ttft_s": 0.5, "tbt_s": 0.2},
            "results": [{"mode": mode, **row} for mode, row in results.items()]}


def row(inst_s=100.0, out_s=2.0, p50=0.2, p99=3.0, tbt50=0.05, tbt99=0.3) -> dict:
    return {"instance_seconds": inst_s, "scale_out_s": {"mean": out_s}, "ttft_s": {"p50": p50, "p99": p99},
            "tbt_s": {"p50": tbt50, "p99": tbt99}}


def test_the_setting_is_read_back_from_the_benchmarks_json():
    s = v.bench_setting(bench_json(layercast=row(), ideal=row()))
    assert s.transform == Transform(time_scale=20, rate_scale=0.5, max_prompt_tokens=256, max_output_tokens=16,
                                    duration_s=60, seed=0)
    assert (s.workers, s.max_instances, s.keep_alive_s, s.scale_down_delay_s, s.target_concurrency) == (2, 2, 3, 5, 2)
    assert s.serverlessllm_keep_alive_s == 0.75 and (s.slo_ttft_s, s.slo_tpot_s) == (0.5, 0.2)
    assert (s.cpu_quota, s.link_mbit, s.disk_mbit, s.h2d_mbit) == (0.4, 400, 40, 500)
    assert s.modes == ("layercast", "ideal") and s.replay_s == 3.0
    cfg = v.fleet_config(s, "serverlessllm")
    assert (cfg.nodes, cfg.max_instances, cfg.keep_alive_s, cfg.target_concurrency, cfg.scale_down_delay_s,
            cfg.serverlessllm_keep_alive_s, cfg.policy) == (2, 2, 3.0, 2, 5.0, 0.75, "concurrency")


@pytest.mark.skipif(not all(p.exists() for p in COMMITTED), reason="the committed bench trace runs")
def test_the_committed_runs_are_one_setting_and_replay_the_requests_they_sent():
    data = [json.loads(p.read_text()) for p in COMMITTED]
    s = v.same_setting([v.bench_setting(d) for d in data])
    assert (s.workers, s.cpu_quota, s.preset, s.blocks, s.target_concurrency) == (4, 0.4, "small-40k", 4, 2)
    trace = REPO.parent / "shared" / "traces" / "azure_llm_code_2023_first30min.csv"
    if trace.exists():
        assert len(apply_transform(parse_trace(trace), s.transform)) == s.requests == 146


def test_bad_input_is_a_clear_error():
    with pytest.raises(v.ValidationError, match="not a JSON object"):
        v.bench_setting([1, 2])
    bad = bench_json(layercast=row())
    del bad["transform"]["seed"]
    with pytest.raises(v.ValidationError, match="transform.seed"):
        v.bench_setting(bad)
    bad = bench_json(layercast=row())
    del bad["settings"]["keep_alive_s"]
    with pytest.raises(v.ValidationError, match="settings.keep_alive_s"):
        v.bench_setting(bad)
    with pytest.raises(v.ValidationError, match="no mode was measured"):
        v.bench_setting(bench_json())
    with pytest.raises(v.ValidationError, match="no slo.ttft_s"):
        v.bench_setting({k: x for k, x in bench_json(layercast=row()).items() if k != "slo"})


def test_runs_of_another_setting_are_refused_naming_what_differs():
    a = bench_json(layercast=row())
    b = copy.deepcopy(a)
    b["settings"]["workers"] = 4
    with pytest.raises(v.ValidationError, match="run 2 has another workers"):
        v.same_setting([v.bench_setting(a), v.bench_setting(b)])
    c = copy.deepcopy(a)
    c["transform"]["rate_scale"] = 0.25
    with pytest.raises(v.ValidationError, match="another transform"):
        v.same_setting([v.bench_setting(a), v.bench_setting(c)])
    assert v.same_setting([v.bench_setting(a), v.bench_setting(copy.deepcopy(a))]).workers == 2


def test_each_figure_is_judged_by_its_own_tolerance():
    runs = [v.measured_row(row(inst_s=x, out_s=o, p50=p, p99=q))
            for x, o, p, q in ((90.0, 1.0, 0.2, 3.0), (100.0, 2.0, 0.3, 4.0), (120.0, 3.0, 0.6, 5.0))]
    sim = {"instance_seconds": 114.9, "scale_out_s": 2.31, "ttft_p50": 0.55, "ttft_p99": 5.9, "tpot_p50": 9.0,
           "tpot_p99": None}
    out = v.compare(sim, runs)
    inst = out["instance_seconds"]
    assert (inst["median"], inst["min"], inst["max"], inst["rel_err"]) == (100.0, 90.0, 120.0, 0.149)
    assert inst["within"] is True  # 14.9 % of the median
    assert out["scale_out_s"]["within"] is False  # 15.5 % beyond the median; the range does not count here
    assert out["ttft_p50"]["rel_err"] == pytest.approx(0.8333, abs=1e-4)
    assert out["ttft_p50"]["within"] is True  # 83 % off the median, but inside the real runs' range
    assert out["ttft_p99"]["within"] is False  # +47.5 % and above the range [3, 5]
    sim["ttft_p99"] = 4.9  # +22.5 %: within 25 %
    assert v.compare(sim, runs)["ttft_p99"]["within"] is True
    sim["ttft_p99"] = 5.1  # +27.5 % and just above the range
    assert v.compare(sim, runs)["ttft_p99"]["within"] is False


def test_a_figure_the_runs_did_not_record_gets_no_verdict():
    runs = [v.measured_row({k: x for k, x in row().items() if k != "scale_out_s"})]
    out = v.compare({"instance_seconds": 100.0, "scale_out_s": 2.0}, runs)
    assert out["scale_out_s"]["median"] is None and out["scale_out_s"]["within"] is None
    assert out["tpot_p50"]["within"] is None  # reported only: no tolerance
    assert out["ttft_p50"]["within"] is None  # nothing simulated


def test_instance_seconds_stop_where_the_benchmark_stops_counting():
    # one instance from 1 s to 30 s (its keep-alive tail), the replay 10 s, the last request done at 12 s
    reqs = [Request("r0", "m", 0.5, 10, 4, first_token=1.0, done=12.0)]
    res = RunResult("layercast", reqs, [(0.0, 0), (1.0, 1), (30.0, 0)], [], 0, 30.0, [])
    assert v.sim_instance_seconds(res, 10.0) == pytest.approx(11.0)
    assert v.sim_instance_seconds(res, 20.0) == pytest.approx(19.0)


def test_a_validation_row_per_simulated_mode_with_the_report_lines(profile):
    data = [bench_json(layercast=row(), serverlessllm=row(inst_s=50.0)),
            bench_json(layercast=row(inst_s=120.0), serverlessllm=row(inst_s=60.0))]
    s = v.same_setting([v.bench_setting(d) for d in data])
    reqs = [(0.1 * i, 64, 8) for i in range(20)]
    sims = {m: simulate(v.fleet_config(s, m), profile, reqs) for m in ("layercast", "serverlessllm")}
    rows = v.validate_rows(s, data, sims)
    assert [r["mode"] for r in rows] == ["layercast", "serverlessllm"]
    assert rows[1]["figures"]["instance_seconds"]["runs"] == [50.0, 60.0]
    assert rows[0]["figures"]["instance_seconds"]["median"] == 110.0
    assert rows[0]["sim_summary"]["requests"] == 20
    counts = v.verdicts(rows)
    assert sum(counts.values()) == 2 * len(v.METRICS) and counts["no_verdict"] >= 4
    text = "\n".join(v.table(rows))
    assert "instance-s" in text and "TTFT p99" in text and ("ok" in text or "BEYOND" in text)
    with pytest.raises(v.ValidationError, match="no measured run has the mode 'ideal'"):
        v.validate_rows(s, data, {"ideal": sims["layercast"]})


def test_a_profile_measured_for_another_setting_is_named():
    s = v.bench_setting(bench_json(layercast=row()))
    from libs.sim.profile import profile_from_dict

    from_conftest = profile_from_dict({"values": {}, "compute": {
        "prefill_lengths": [1], "prefill_s": [0.01], "batches": [1], "lengths": [1], "decode_s": [[0.01]]}})
    assert v.check_profile(s, from_conftest, {"preset": "tiny", "blocks": 2, "cpu_quota": 0.4}) == []
    assert v.check_profile(s, from_conftest, {"preset": "small-40k", "cpu_quota": 1.0}) == [
        "profile measured for preset='small-40k', the benchmark ran preset='tiny'",
        "profile measured for cpu_quota=1.0, the benchmark ran cpu_quota=0.4"]
    assert "no measured_for" in v.check_profile(s, from_conftest, None)[0]


def scale_json(**trials) -> dict:
    return {"workers": 4, "from": 1, "to": 4, "burst": 20, "max_tokens": 8,
            "profile": {"link_mbit": 400, "disk_read_mbit": 40, "host_to_device_mbit": 500, "cpu_quota": 0.5},
            "results": [{"mode": mode, "trials": ts} for mode, ts in trials.items()]}


def test_a_burst_case_is_read_from_bench_scale_and_judged_per_trial():
    t = [{"all_ready_s": x, "burst_first_token_s": x + 1, "new_capacity_first_token_s": x - 1} for x in (4.0, 5.0, 6.0)]
    data = scale_json(layercast=t + [{"error": "TimeoutError"}])
    s = v.burst_setting(data)
    assert (s.workers, s.from_n, s.to_n, s.burst, s.max_tokens, s.cpu_quota) == (4, 1, 4, 20, 8, 0.5)
    trials = v.burst_trials(data, "layercast")
    assert [x["all_ready_s"] for x in trials] == [4.0, 5.0, 6.0]  # the failed trial left out
    out = v.compare_burst({"all_ready_s": 5.8, "burst_first_token_s": 6.9, "new_capacity_first_token_s": None}, trials)
    assert out["all_ready_s"]["rel_err"] == pytest.approx(0.16) and out["all_ready_s"]["within"] is False
    assert out["burst_first_token_s"]["within"] is True  # +15 %
    assert out["new_capacity_first_token_s"]["within"] is None
    with pytest.raises(v.ValidationError, match="no mode 'ideal'"):
        v.burst_trials(data, "ideal")
    with pytest.raises(v.ValidationError, match="without --burst"):
        v.burst_setting({**data, "burst": 0})
    with pytest.raises(v.ValidationError, match="no workers"):
        v.burst_setting({k: x for k, x in data.items() if k != "workers"})


def test_the_simulated_burst_is_served_by_the_warm_instance_then_new_capacity(profile):
    s = v.burst_setting(scale_json(layercast=[], binomial=[]))
    lc = v.simulate_burst(s, "layercast", profile)
    assert 0 < lc["new_capacity_first_token_s"] < lc["burst_first_token_s"]
    assert lc["all_ready_s"] > 0
    # ideal's targets hold the model already: new capacity serves sooner than after a multicast
    ideal = v.simulate_burst(s, "ideal", profile)
    assert ideal["new_capacity_first_token_s"] < lc["new_capacity_first_token_s"]
    assert v.simulate_burst(s, "layercast", profile) == lc  # deterministic


def test_the_burst_comes_once_the_from_instances_loaded_even_from_disk(profile):
    # serverlessllm's first instance reads the model from disk (0.5 s at 2 GB/s): the warm instance
    # serves the burst's first requests at once, not after its own load
    s = v.burst_setting(scale_json(serverlessllm=[]))
    out = v.simulate_burst(s, "serverlessllm", profile.with_values(disk_gbytes_per_s=0.02))  # a 50 s read
    assert out["all_ready_s"] > 45.0  # the targets read from disk
    assert out["burst_first_token_s"] < 2.0  # the warm instance served the whole burst meanwhile
    assert out["new_capacity_first_token_s"] is None
