"""`layercast simulate --validate` end to end, without root: a profile measured here by
`layercast simulate-profile`, one short real `layercast bench trace` run (loopback cluster, its
own NATS, SQLite registry) of a slice of the trace, and the simulator's figures beside it. A
behaviour test: every compared figure has both sides and its relative error, the benchmark
recorded its scale-outs' times, the setting the simulator ran is the benchmark's."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import shared_or_synthetic_trace
from libs.planning.trace import Transform, apply_transform, parse_trace

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
CLI = [sys.executable, "-c", "from services.cli import main; main()"]


@pytest.fixture(scope="module")
def trace_csv(tmp_path_factory) -> Path:
    """The real trace where the checkout has it, else two bursts of 30 requests 20 s apart."""
    return shared_or_synthetic_trace(tmp_path_factory.mktemp("trace"), 60, 20, 0.05, 37)


@pytest.mark.timeout(660)
def test_validate_measures_a_profile_runs_the_benchmark_and_compares(tmp_path, trace_csv):
    state, prof, kept = tmp_path / "state", tmp_path / "profile.json", tmp_path / "measured"
    proc = subprocess.run([*CLI, "simulate-profile", "--preset", "tiny", "--blocks", "2", "--cpu-quota", "0",
                           "--link-mbit", "0", "--disk-mbit", "0", "--host-to-device-mbit", "0", "--max-len", "16",
                           "--max-batch", "2", "--repeats", "1", "--out", str(prof), "--state-dir", str(state)],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    written = json.loads(prof.read_text())
    assert written["measured_for"]["preset"] == "tiny" and written["values"]["nats_hop_s"]["value"] > 0
    assert all(x > 0 for x in written["compute"]["prefill_s"])

    flags = ["--duration-s", "60", "--time-scale", "20", "--rate-scale", "0.2", "--max-prompt-tokens", "64",
             "--max-output-tokens", "8", "--seed", "0"]
    proc = subprocess.run([*CLI, "simulate", str(trace_csv), "--validate", "--runs", "1", "--modes", "layercast",
                           "--nodes", "1", "--keep-alive-s", "3", "--target-concurrency", "2", *flags,
                           "--profile", str(prof), "--measured-out", str(kept), "--json", "--bench-args",
                           f"--preset tiny --blocks 2 --slo-ttft-s 1 --slo-tbt-s 0.5 --state-dir {state}"],
                          cwd=REPO, capture_output=True, text=True, timeout=480)  # a busy CI machine
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout[proc.stdout.index("{"):])

    bench = json.loads((kept / "run1.json").read_text())
    expected = apply_transform(parse_trace(trace_csv), Transform(
        time_scale=20, rate_scale=0.2, duration_s=60, seed=0, max_prompt_tokens=64, max_output_tokens=8))
    assert bench["transform"]["requests"] == len(expected) == out["setting"]["requests"] > 0
    assert out["setting"]["workers"] == 1 and out["setting"]["keep_alive_s"] == 3
    assert out["profile_warnings"] == []  # measured for the setting it predicts
    measured = bench["results"][0]
    assert measured["scale_outs"] and measured["scale_out_s"]["mean"] > 0  # the benchmark timed its scale-outs

    (row,) = out["modes"]
    assert row["mode"] == "layercast" and row["runs"] == 1
    assert row["sim_summary"]["requests"] == len(expected) and row["sim_summary"]["requests_lost"] == 0
    fig = row["figures"]
    assert fig["instance_seconds"]["runs"] == [measured["instance_seconds"]]
    assert fig["scale_out_s"]["runs"] == [measured["scale_out_s"]["mean"]]
    assert fig["ttft_p99"]["runs"] == [measured["ttft_s"]["p99"]]
    for key in ("instance_seconds", "scale_out_s", "ttft_p50", "ttft_p99"):
        e = fig[key]
        assert e["sim"] > 0 and e["rel_err"] == pytest.approx(e["sim"] / e["median"] - 1, abs=1e-4)
        assert isinstance(e["within"], bool)
    assert sum(out["verdicts"].values()) == 6
