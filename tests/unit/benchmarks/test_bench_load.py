"""`layercast bench load --json` runs every method on a real checkpoint and reports one JSON object.

A behaviour test, not a timing test: the fields are there, the bandwidths are positive, and the
three "ready" paths computed the same first token (so the comparison is between equals)."""

import json

from typer.testing import CliRunner

from services.cli.app import app

FIELDS = {
    "raw_gbps", "layercast_cold_gbps", "layercast_warm_gbps", "host_tier_gbps", "safetensors_cold_gbps",
    "torch_load_cold_gbps", "first_block_ms", "layercast_ready_s", "from_pretrained_ready_s",
    "safetensors_ready_s", "model_bytes", "chunk_bytes", "threads",
}


def test_bench_load_json(tiny_checkpoint):
    result = CliRunner().invoke(app, ["bench", "load", str(tiny_checkpoint), "--repeat", "1", "--chunk-mib", "1",
                                      "--threads", "2", "--no-peers", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert FIELDS <= set(report)
    assert report["chunk_bytes"] == 1 << 20 and report["threads"] == 2
    for name in FIELDS - {"model_bytes", "chunk_bytes", "threads"}:
        assert report[name] > 0, name
    assert report["same_first_token"] is True
    # --no-peers: every peer is listed with why it did not run, never silently absent.
    assert {name: peer["skipped"] for name, peer in report["peers"].items() if name != "layercast"} == {
        "runai_model_streamer": "not run (--no-peers)", "fastsafetensors": "not run (--no-peers)"}
    assert report["outside_arena_bytes"] == 0  # every layercast trial loaded into the reserved arena
    assert set(report["ratios"]) >= {"layercast_cold_vs_raw", "from_pretrained_vs_layercast_ready"}
    # No scratch files (the torch.save copy) are left next to the checkpoint.
    assert not list(tiny_checkpoint.parent.glob(".bench-load-*"))


def test_bench_load_rejects_a_folder_that_is_not_a_block_checkpoint(tmp_path):
    result = CliRunner().invoke(app, ["bench", "load", str(tmp_path), "--json"])
    assert result.exit_code != 0
    flat = " ".join(result.output.replace("│", " ").split())  # rich wraps the error box at any width
    assert "not a block checkpoint" in flat


def test_a_measured_load_starts_after_the_peak_rss_reset(monkeypatch):
    """Resetting the RSS mark runs gc and malloc_trim (tenths of a second on a big heap): done
    after the load started, it was counted in the load's GB/s (layercast's cold figure halved)."""
    from benchmarks import bench_load

    events = []
    monkeypatch.setattr(bench_load, "_reset_peak_rss", lambda: events.append("reset") or 0)
    monkeypatch.setattr(bench_load, "_proc_status_bytes", lambda field: 0)

    class Job:
        def result(self):
            events.append("waited")
            return {"blocks": 1}

    class Loader:
        def start(self, ckpt, index):
            events.append("started")
            return Job()

    job, peak, result = bench_load._measured_load(Loader(), "ckpt", "index")
    assert events == ["reset", "started", "waited"]
    assert isinstance(job, Job) and result == {"blocks": 1} and peak == 0
