"""`layercast bench plan --json`: the benchmark runs every planner and reports in one JSON object.

Times are reported, not asserted (a shared machine is noisy); the JSON says
whether 64 workers stayed under the 50 ms bound."""

import json

from typer.testing import CliRunner

from services.cli.app import app

PLANNERS = {
    "binomial",
    "kway",
    "kway_pipelines",
    "chain",
    "star",
    "binary_tree",
    "choose_multicast",
    "choose_server",
    "zigzag_queue",
}


def test_bench_plan_json() -> None:
    result = CliRunner().invoke(app, ["bench", "plan", "--json", "--sizes", "8,64", "--repeat", "3"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert set(out["plan_ms"]) == PLANNERS
    for name, row in out["plan_ms"].items():
        assert set(row) == {"8", "64"}, name
        assert all(ms > 0 for ms in row.values()), name
    assert out["bound_ms"] == 50.0
    assert out["all_64_under_bound"] == all(row["64"] < 50.0 for row in out["plan_ms"].values())
    assert out["n_blocks"] == 16 and out["zigzag_ilp_7x7_ms"] > 0
