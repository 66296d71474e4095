"""The serving overheads a profile gets from `bench trace`'s SLO calibration (unloaded, end to end):
what the client saw beyond the compute profile, per request and per token."""

import json

import pytest
from typer.testing import CliRunner

from libs.planning.mesh import Profile
from libs.sim.profile import ProfileError, load_profile, serving_overheads
from services.cli.app import app
from sim_profile import PROFILE

COMPUTE = Profile((1, 1024), (0.01, 0.5), (1, 8), (16, 1024), ((0.02, 0.03), (0.04, 0.08)))


def cal(ttft, tbt, prompt=64, output=16):
    return {"unloaded_ttft_s": ttft, "unloaded_tbt_s": tbt, "prompt_tokens": prompt, "output_tokens": output,
            "calibrated": True}


def test_the_overheads_are_what_unloaded_serving_took_beyond_the_compute_profile():
    pre, dec = COMPUTE.prefill_time(64), COMPUTE.decode_time(1, 72)
    out = serving_overheads(COMPUTE, [cal(pre + 0.03, dec + 0.004)])
    assert out == {"request_overhead_s": pytest.approx(0.03, abs=1e-6), "token_overhead_s": pytest.approx(0.004, abs=1e-6)}
    # the median over calibrations: one outlier does not move it; never below zero
    many = [cal(pre + 0.03, dec + 0.004), cal(pre - 0.01, dec + 0.005), cal(pre + 0.04, dec * 0.5)]
    assert serving_overheads(COMPUTE, many) == {"request_overhead_s": pytest.approx(0.03, abs=1e-6),
                                                "token_overhead_s": pytest.approx(0.004, abs=1e-6)}
    assert serving_overheads(COMPUTE, [cal(0.0, 0.0)]) == {"request_overhead_s": 0.0, "token_overhead_s": 0.0}


def test_bad_calibrations_are_refused_naming_what_is_wrong():
    with pytest.raises(ProfileError, match="at least one"):
        serving_overheads(COMPUTE, [])
    with pytest.raises(ProfileError, match="calibration 0: needs"):
        serving_overheads(COMPUTE, [{"unloaded_ttft_s": 0.1}])
    with pytest.raises(ProfileError, match="calibration 1: lengths"):
        serving_overheads(COMPUTE, [cal(0.1, 0.01), cal(0.1, 0.01, prompt=0)])
    with pytest.raises(ProfileError, match="finite"):
        serving_overheads(COMPUTE, [cal(float("nan"), 0.01)])


def test_simulate_profile_adds_them_to_a_profile_measured_before(tmp_path):
    base, out = tmp_path / "base.json", tmp_path / "out.json"
    base.write_text(json.dumps(PROFILE))
    runs = []
    for i, ttft in enumerate((0.2, 0.25, 0.3)):
        f = tmp_path / f"run{i}.json"
        f.write_text(json.dumps({"slo": cal(ttft, 0.05)}))
        runs += ["--serving-from", str(f)]
    r = CliRunner().invoke(app, ["simulate-profile", "--base", str(base), "--out", str(out), "--name", "x", *runs])
    assert r.exit_code == 0, r.output
    written = json.loads(out.read_text())
    assert written["name"] == "x" and written["compute"] == PROFILE["compute"]
    prof = load_profile(out)
    assert prof.request_overhead_s == pytest.approx(0.25 - prof.compute.prefill_time(64), abs=1e-6)
    assert prof.token_overhead_s == pytest.approx(0.05 - prof.compute.decode_time(1, 72), abs=1e-6)
    assert "run0.json" in written["values"]["token_overhead_s"]["cite"]
    for k, v in PROFILE["values"].items():
        assert prof.values[k] == v


def test_simulate_profile_refuses_a_run_without_a_calibration(tmp_path):
    base, given = tmp_path / "base.json", tmp_path / "given.json"
    base.write_text(json.dumps(PROFILE))
    given.write_text(json.dumps({"slo": {"ttft_s": 1.0, "tbt_s": 0.1, "calibrated": False}}))
    r = CliRunner().invoke(app, ["simulate-profile", "--base", str(base), "--out", str(tmp_path / "o.json"),
                                 "--serving-from", str(given)])
    assert r.exit_code == 1 and "not calibrated" in r.output
    r = CliRunner().invoke(app, ["simulate-profile", "--base", str(base), "--out", str(tmp_path / "o.json")])
    assert r.exit_code == 1 and "--base goes with --serving-from" in r.output
