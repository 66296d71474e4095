"""`layercast bench mesh --json` at a tiny size: K=2 models on one worker, a few seconds of the
Azure LLM trace (Azure/AzurePublicDataset, CC-BY-4.0) mapped onto them by a seeded Zipf draw,
run once with sharing=exclusive and once with sharing=mesh, each on its own fresh cluster of
real processes. A behaviour test: one JSON object, both settings, every request answered
(0 lost), 0 OOMs, the unavailable metrics marked as such rather than made up."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
KEYS = {"sharing", "slo_compliant_requests", "slo_compliant_mean_tpot", "slo_misses", "requests", "ttft_p50",
        "ttft_p99", "tpot_p50", "tpot_p99", "models_served", "instance_seconds", "preemptions", "kv_resizes",
        "reservation_waits", "ooms", "lost", "failure_reasons", "unavailable"}


def _trace(tmp_path: Path) -> str:
    """The real trace where the checkout has it next to it, else a synthetic one with its columns."""
    from benchmarks.mesh_workload import resolve_trace

    try:
        resolve_trace("code")
        return "code"
    except FileNotFoundError:
        rows = ["TIMESTAMP,ContextTokens,GeneratedTokens"]
        for i in range(100):  # two bursts of 50 requests, 30 s apart
            t = (i % 50) * 0.02 + (30 if i >= 50 else 0)
            rows.append(f"2023-11-16 18:17:{int(t):02d}.{int((t % 1) * 1e7):07d},{100 + 97 * i},{5 + i}")
        path = tmp_path / "synthetic.csv"
        path.write_text("\n".join(rows) + "\n")
        return str(path)


def test_bench_mesh_tiny(tmp_path):
    trace = _trace(tmp_path)
    plot = tmp_path / "mesh.png"
    cmd = [sys.executable, "-c", "from services.cli import main; main()", "bench", "mesh", "--trace", trace,
           "--models", "2",
           "--workers", "1", "--trials", "1", "--duration-s", "4", "--rps", "2", "--max-prompt-tokens", "32",
           "--settings", "exclusive,mesh",
           "--max-output-tokens", "6", "--json", "--plot", str(plot), "--state-dir", str(tmp_path / "state")]
    # From another directory: the trace is found relative to the checkout, not the cwd.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=420)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1, proc.stdout[-2000:]
    report = json.loads(lines[0])

    assert {r["sharing"] for r in report["results"]} == {"mesh", "exclusive"}
    # a fixed rate: its multiple of the capacity measured at the start is reported beside it
    offered = report["offered_load"]
    assert offered["rps"] == 2 and offered["capacity_rps"] > 0
    assert offered["multiple_of_capacity"] == round(2 / offered["capacity_rps"], 4)
    assert report["median_of"] == 1 and len(report["trials"]) == 2
    assert "CC-BY-4.0" in report["attribution"] or trace != "code"
    n = report["workload"]["requests"]
    assert n > 0 and sum(report["workload"]["requests_per_model"]) == n
    for r in report["results"]:
        assert KEYS <= set(r), KEYS - set(r)
        assert r["requests"] == n
        assert r["lost"] == 0, r["failure_reasons"]
        assert r["ooms"] == 0
        assert r["workers_dead"] == []
        assert 0 <= r["slo_compliant_requests"] <= n and 0 <= r["slo_compliant_mean_tpot"] <= n
        # every answered request that missed is counted once by what it missed first
        assert r["slo_misses"]["first_token"] + r["slo_misses"]["later_token"] == (
            n - r["lost"] - r["slo_compliant_requests"])
        assert r["ttft_p50"] <= r["ttft_p99"] and r["tpot_p50"] <= r["tpot_p99"]
        assert 1 <= r["models_served"] <= 2
        assert r["instance_seconds"] > 0
        for key in ("preemptions", "kv_resizes", "reservation_waits"):  # not exported: 0, and said so
            assert r[key] >= 0
            if key in r["unavailable"]:
                assert r[key] == 0
    mesh = next(r for r in report["results"] if r["sharing"] == "mesh")
    assert sum(mesh["mesh_admissions"].values()) >= n  # the mesh worker ran shadow validation
    exclusive = next(r for r in report["results"] if r["sharing"] == "exclusive")
    assert report["ratio"] == (round(mesh["slo_compliant_requests"] / exclusive["slo_compliant_requests"], 4)
                               if exclusive["slo_compliant_requests"] else None)
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
