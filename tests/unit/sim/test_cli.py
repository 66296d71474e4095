"""`layercast simulate` end to end on a short slice of the shared trace (or a written one)."""

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from services.cli.app import app

SHARED = Path("/work/shared/traces/azure_llm_code_2023_first30min.csv")


def trace(tmp_path: Path) -> Path:
    if SHARED.exists():
        return SHARED
    p = tmp_path / "t.csv"
    rows = ["TIMESTAMP,ContextTokens,GeneratedTokens"] + [f"{i * 0.2:.3f},{500 + i},{20}" for i in range(60)]
    p.write_text("\n".join(rows) + "\n")
    return p


@pytest.mark.slow
def test_simulate_prints_every_modes_figures_as_json(tmp_path):
    res = CliRunner().invoke(app, ["simulate", str(trace(tmp_path)), "--nodes", "4", "--profile", "h100-200g",
                                   "--modes", "layercast,serverlessllm", "--duration-s", "12", "--tick", "0.5", "--horizon-s", "90",
                                   "--json", "--plot", str(tmp_path / "plots")])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout[res.stdout.index("{"):])
    assert [m["mode"] for m in out["modes"]] == ["layercast", "serverlessllm"]
    for m in out["modes"]:
        assert m["requests"] == out["requests"] > 0
        assert set(m["ttft_s"]) == {"p50", "p90", "p99"} and m["instance_seconds"] > 0
        assert m["requests_lost"] == 0 and m["scale_outs"] >= 1
    assert "CC-BY-4.0" in out["attribution"]
    assert (tmp_path / "plots" / "simulate.png").stat().st_size > 0


def test_simulate_refuses_bad_input_clearly(tmp_path):
    r = CliRunner().invoke(app, ["simulate", str(trace(tmp_path)), "--modes", "nope"])
    assert r.exit_code == 1 and "unknown scaling mode 'nope'" in r.output
    bad = tmp_path / "p.json"
    bad.write_text(json.dumps({"values": {"link_gbps": -1}}))
    r = CliRunner().invoke(app, ["simulate", str(trace(tmp_path)), "--profile", str(bad)])
    assert r.exit_code == 1 and "values.link_gbps" in r.output
    r = CliRunner().invoke(app, ["simulate", str(tmp_path / "missing.csv")])
    assert r.exit_code == 1 and "missing.csv" in r.output


REPO = Path(__file__).resolve().parents[3]
RUNS = [str(REPO / "docs" / "bench_trace" / f"code_4workers_cpu04_run{i}.json") for i in (1, 2, 3)]
MEASURED_PROFILE = str(REPO / "libs" / "sim" / "profiles" / "measured-here-small40k-cpu04.json")


@pytest.mark.skipif(not SHARED.exists(), reason="the shared trace the committed runs replayed")
def test_validate_prints_simulated_beside_the_committed_runs():
    r = CliRunner().invoke(app, ["simulate", str(SHARED), "--validate", "--profile", MEASURED_PROFILE,
                                 "--measured", *RUNS, "--modes", "layercast", "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout[r.stdout.index("{"):])
    assert [m["mode"] for m in out["modes"]] == ["layercast"] and out["profile_warnings"] == []
    inst = out["modes"][0]["figures"]["instance_seconds"]
    assert inst["runs"] == [293.399, 255.566, 260.387] and inst["median"] == 260.387
    assert inst["rel_err"] == pytest.approx(inst["sim"] / 260.387 - 1, abs=1e-4)
    assert out["setting"]["requests"] == 146 and out["setting"]["cpu_quota"] == 0.4


def test_validate_refuses_bad_input_clearly(tmp_path):
    t = str(trace(tmp_path))
    r = CliRunner().invoke(app, ["simulate", t, "--measured", RUNS[0]])
    assert r.exit_code == 1 and "go with --validate" in r.output
    r = CliRunner().invoke(app, ["simulate", t, "--validate", "--measured", str(tmp_path / "none.json")])
    assert r.exit_code == 1 and "no measured file" in r.output
    other = json.loads(Path(RUNS[0]).read_text())
    other["settings"]["workers"] = 2
    (tmp_path / "other.json").write_text(json.dumps(other))
    r = CliRunner().invoke(app, ["simulate", t, "--validate", "--measured", RUNS[0], str(tmp_path / "other.json")])
    assert r.exit_code == 1 and "another workers" in r.output
    (tmp_path / "bad.json").write_text("{}")
    r = CliRunner().invoke(app, ["simulate", t, "--validate", "--measured", str(tmp_path / "bad.json")])
    assert r.exit_code == 1 and "not a `layercast bench trace --json` result" in r.output
    # a trace that is not the one the runs replayed gives other requests
    p = tmp_path / "t.csv"
    p.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n0.0,10,5\n1.0,20,5\n")
    r = CliRunner().invoke(app, ["simulate", str(p), "--validate", "--measured", RUNS[0], "--profile",
                                 MEASURED_PROFILE])
    assert r.exit_code == 1 and "not the trace they replayed" in r.output


S3_RUNS = [str(REPO / "docs" / "bench_trace" / f"code_4workers_cpu04_s3_run{i}.json") for i in (1, 2, 3)]
S3_PROFILE = str(REPO / "libs" / "sim" / "profiles" / "measured-here-small40k-cpu04-s3-serving.json")


@pytest.mark.skipif(not SHARED.exists(), reason="the shared trace the committed runs replayed")
def test_the_simulator_stays_within_issue_39s_tolerances_of_the_committed_quiet_runs():
    """The fidelity the simulator was validated at (docs/sim/README.md, session 3): a change to the
    time models or to the decisions that moves a figure out of tolerance fails here."""
    r = CliRunner().invoke(app, ["simulate", str(SHARED), "--validate", "--profile", S3_PROFILE,
                                 "--measured", *S3_RUNS, "--modes", "layercast,binomial,serverlessllm", "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout[r.stdout.index("{"):])
    assert out["profile_warnings"] == []
    beyond = [(m["mode"], k, f["rel_err"]) for m in out["modes"] for k, f in m["figures"].items() if f["within"] is False]
    assert beyond == [] and out["verdicts"]["within"] == 12


S5_RUNS = [str(REPO / "docs" / "bench_trace" / f"code_4workers_cpu04_s5_run{i}.json") for i in (1, 2, 3)]
S5_PROFILE = str(REPO / "libs" / "sim" / "profiles" / "measured-here-small40k-cpu04-s5-serving.json")


@pytest.mark.skipif(not SHARED.exists(), reason="the shared trace the committed runs replayed")
def test_the_simulated_execute_while_loading_stays_within_tolerance_of_the_runs_made_with_it():
    """Session 4's runs, the workers running prefills ahead of their loads (settings.prefill_ahead),
    against a profile measured just before them: every layercast figure within issue 39's
    tolerances (its TTFT p99 is where execute-while-load shows, 2.05 s simulated against 2.23-2.33 s
    measured; simulated without it, the p99 goes beyond), and 11 of 12 in all (serverlessllm's
    mean scale-out is 16 % over, its runs' range 13.8-19.4 s)."""
    r = CliRunner().invoke(app, ["simulate", str(SHARED), "--validate", "--profile", S5_PROFILE,
                                 "--measured", *S5_RUNS, "--modes", "layercast,binomial,serverlessllm", "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout[r.stdout.index("{"):])
    assert out["profile_warnings"] == []
    layercast = next(m for m in out["modes"] if m["mode"] == "layercast")["figures"]
    assert all(layercast[k]["within"] for k in ("instance_seconds", "scale_out_s", "ttft_p50", "ttft_p99"))
    assert out["verdicts"]["within"] >= 11
