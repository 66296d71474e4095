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
