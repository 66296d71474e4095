"""`layercast bench serve --json`: streams through a real one-worker cluster against the engine's
decode rate on the same checkpoint. A behaviour test: the JSON has its shape, every stream got
its tokens, the percentiles are ordered, the ratios are the rates' quotients."""

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


def test_bench_serve_reports_every_concurrency_against_the_engine(tmp_path, tiny_checkpoint):
    cmd = [sys.executable, "-c", "from services.cli import main; main()", "bench", "serve", "--model",
           str(tiny_checkpoint), "--new-tokens", "32", "--repeat", "1", "--torch-threads", "1", "--json",
           "--state-dir", str(tmp_path)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=400)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["new_tokens"] == 32 and out["repeat"] == 1 and out["torch_threads"] == 1
    assert set(out["concurrency"]) == {"1", "4", "16"}
    for c, row in out["concurrency"].items():
        (trial,) = row["trials"]
        assert int(c) <= trial["tokens"] <= 32 * int(c)  # a chunk per token; a stream may end early (EOS)
        assert 0 < row["ttft_p50_s"] <= row["ttft_p99_s"] and 0 < row["itl_p50_s"] <= row["itl_p99_s"]
        assert row["tokens_per_s"] > 0 and len(row["engine_trials"]) == 1
        # (the ratio is rounded to 3 decimals, the rates to 4 and 2)
        assert row["serve_over_engine"] == pytest.approx(row["tokens_per_s"] / row["engine_tokens_per_s"], abs=1e-3)
