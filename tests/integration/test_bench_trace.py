"""`layercast bench trace --json --plot`: a short slice of a real trace replayed against two scaling
modes, each on its own fresh loopback cluster (SQLite registry, its own NATS), with the SLO
calibrated first. A behaviour test: the JSON has its shape, every request was sent and
answered, the scaling modes used instances, the percentiles are ordered, the plot is a PNG."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.trace_replay import Transform, apply_transform, parse_trace
from conftest import SHARED_TRACE, shared_or_synthetic_trace

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
MODES = ["layercast", "serverlessllm"]
ARGS = {"--duration-s": "60", "--time-scale": "20", "--rate-scale": "0.2", "--seed": "0",
        "--max-prompt-tokens": "128", "--max-output-tokens": "16"}


@pytest.fixture(scope="module")
def trace_csv(tmp_path_factory) -> Path:
    """The real trace where the checkout has it, else two bursts of 50 requests 30 s apart, with
    the trace's own timestamps (dates)."""
    return shared_or_synthetic_trace(tmp_path_factory.mktemp("trace"), 100, 30, 0.02, 97,
                                     stamp=lambda t: f"2023-11-16 18:17:{int(t):02d}.{int((t % 1) * 1e7):07d}")


def test_bench_trace_two_modes(tmp_path, trace_csv):
    plot = tmp_path / "trace.png"
    cmd = [sys.executable, "-c", "from services.cli import main; main()", "bench", "trace", str(trace_csv),
           "--modes", ",".join(MODES), *[x for kv in ARGS.items() for x in kv], "--calibration-requests", "3",
           "--json", "--plot", str(plot), "--state-dir", str(tmp_path / "state")]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1, proc.stdout[-2000:]  # exactly one JSON object on stdout
    report = json.loads(lines[0])

    expected = apply_transform(parse_trace(trace_csv), Transform(
        time_scale=20, rate_scale=0.2, duration_s=60, seed=0, max_prompt_tokens=128, max_output_tokens=16))
    assert expected, "the slice must hold requests"
    assert set(report) >= {"trace", "attribution", "transform", "settings", "slo", "results", "plot"}
    tf = report["transform"]
    assert tf["time_scale"] == 20 and tf["rate_scale"] == 0.2 and tf["duration_s"] == 60 and tf["seed"] == 0
    assert tf["max_prompt_tokens"] == 128 and tf["max_output_tokens"] == 16
    assert tf["requests"] == len(expected) and tf["replay_duration_s"] == 3
    if trace_csv == SHARED_TRACE:
        assert "CC-BY-4.0" in report["attribution"]
    slo = report["slo"]
    assert slo["calibrated"] and slo["factor"] == 5
    # The report rounds each figure to 1e-6 s (TTFT's SLO to 1e-5): five times a rounded figure is within
    # five roundings of the rounded SLO (a 12 us TBT once gave 6.1e-05 against 5 x 1.2e-05).
    assert slo["ttft_s"] == pytest.approx(5 * slo["unloaded_ttft_s"], rel=1e-3, abs=1e-5)
    assert slo["tbt_s"] == pytest.approx(5 * slo["unloaded_tbt_s"], rel=1e-3, abs=3e-6)
    assert slo["ttft_s"] > 0 and slo["tbt_s"] > 0
    settings = report["settings"]
    assert settings["keep_alive_s"] > 0 and settings["eos_ids"] == []
    # serverlessllm's host keep-alive is λScale's 15 s of trace time, compressed like the trace
    assert settings["serverlessllm_keep_alive_s"] == pytest.approx(15 / 20)
    assert settings["service_env"]["LAYERCAST_SERVERLESSLLM_KEEP_ALIVE"] == "0.75"
    assert settings["bench_model"]["visible_tokens"] > 100

    assert [r["mode"] for r in report["results"]] == MODES
    for r in report["results"]:
        assert set(r) >= {"mode", "ttft_s", "tbt_s", "slo_attainment", "instance_seconds", "scale_ops", "requests",
                          "failed"}
        assert r["requests"] == len(expected)
        assert r["failed"] == 0, r["failures"]
        assert r["early_stops"] == 0  # the benchmark's model has no EOS: every answer runs to max_tokens
        assert r["tokens_without_chunk"] == 0  # ... and streams a chunk per token (what TTFT/TBT are timed on)
        assert r["completion_tokens"] == sum(x.output_tokens for x in expected)
        rows = [dict(zip(r["per_request_columns"], row)) for row in r["per_request"]]  # every request, in order
        assert [x["index"] for x in rows] == list(range(len(expected)))
        assert [x["prompt_tokens"] for x in rows] == [x.prompt_tokens for x in expected]
        assert all(x["error"] is None and x["ttft_s"] > 0 for x in rows)
        assert max(x["ttft_s"] for x in rows) >= r["ttft_s"]["p99"]
        assert r["instance_seconds"] > 0  # scaled from zero and served
        assert r["scale_ops"] >= 1 and r["scale_ops_up"] >= 1
        for key in ("ttft_s", "tbt_s"):
            p = r[key]
            assert 0 < p["p50"] <= p["p90"] <= p["p99"], (key, p)
        assert 0.0 <= r["slo_attainment"] <= 1.0

    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert plot.stat().st_size > 10_000
