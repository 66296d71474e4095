"""`layercast bench plan --json`: the benchmark runs every planner and reports in one JSON object.

Times are reported, not asserted (a shared machine is noisy); the JSON says
whether 64 workers stayed under the bound (50 ms unless --bound-ms)."""

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


def bench_plan(*args: str) -> dict:
    result = CliRunner().invoke(app, ["bench", "plan", "--json", *args])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_bench_plan_json() -> None:
    out = bench_plan("--sizes", "8,64", "--repeat", "3", "--n-blocks", "4")
    assert set(out["plan_ms"]) == PLANNERS  # every planner, named independently above
    for name, row in out["plan_ms"].items():
        assert set(row) == {"8", "64"}, name  # every size asked for, no other
        assert all(ms >= 0 for ms in row.values()), name
    # The options are what was run, not the defaults (16 blocks, 5 runs, 50 ms).
    assert (out["n_blocks"], out["repeat"], out["bound_ms"]) == (4, 3, 50.0)
    assert out["zigzag_ilp_7x7_ms"] > 0


def test_bench_plan_under_bound_follows_the_bound_and_needs_a_64_worker_point() -> None:
    """The verdict is checked against bounds whose answer is known without the report's times
    (recomputing it from the report's own numbers could not fail): no plan of 4 blocks for 64
    workers takes 1000 s, every one takes more than 0 ms; and with no 64-worker point measured
    there is nothing to claim."""
    args = ("--repeat", "1", "--n-blocks", "4")
    assert bench_plan("--sizes", "8,64", "--bound-ms", "1000000", *args)["all_64_under_bound"] is True
    assert bench_plan("--sizes", "8,64", "--bound-ms", "0", *args)["all_64_under_bound"] is False
    assert bench_plan("--sizes", "8", "--bound-ms", "1000000", *args)["all_64_under_bound"] is False
