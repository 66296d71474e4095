"""The GPU check itself, checked on the CPU: scripts/gpu-check installs exactly the list that
scripts/gpu-wheels downloads, pinned to the versions tested here; `scripts/gpu-check --dry` runs
every step end to end (the gpu tests on the CPU, bench load, bench engine) and writes JSON that
parses; and the wheels cover every distribution those steps imported beyond what the GPU
machine provides. Not marked gpu: they run in CI (and `pytest -m gpu` on the GPU machine leaves
them out, so the check does not run itself)."""

from __future__ import annotations

import importlib.metadata as md
import json
import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

REPO = Path(__file__).parents[2]
WHEEL_LIST = REPO / "scripts" / "gpu-wheels.txt"
# Installed only where the GPU machine's transformers is not the 5.x the engine is written for.
TRANSFORMERS_LIST = REPO / "scripts" / "gpu-wheels-transformers.txt"


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def wheel_pins(path: Path = WHEEL_LIST) -> dict[str, str]:
    pins = {}
    for line in path.read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, sep, version = line.partition("==")
            assert sep and version, f"{line!r}: every wheel is pinned name==version"
            pins[_norm(name)] = version
    return pins


def _comment_list(key: str) -> set[str]:
    (line,) = [x for x in WHEEL_LIST.read_text().splitlines() if x.startswith(f"# {key}:")]
    return {_norm(n) for n in line.split(":", 1)[1].split("(")[0].split()}


def test_the_check_installs_the_list_the_wheels_script_downloads_pinned_to_the_tested_versions():
    wheels_script = (REPO / "scripts" / "gpu-wheels").read_text()
    check_script = (REPO / "scripts" / "gpu-check").read_text()
    assert "-r scripts/gpu-wheels.txt -r scripts/gpu-wheels-transformers.txt" in wheels_script
    assert "--no-deps" in wheels_script
    assert "lists=(scripts/gpu-wheels.txt)" in check_script
    assert "lists+=(scripts/gpu-wheels-transformers.txt)" in check_script
    assert "--no-index" in check_script and "--no-deps" in check_script  # nothing outside the lists is resolved
    pins = wheel_pins()
    assert len(pins) > 20
    assert "transformers" in wheel_pins(TRANSFORMERS_LIST)
    for name, version in {**pins, **wheel_pins(TRANSFORMERS_LIST)}.items():
        assert md.version(name) == version, f"{name}: the list pins {version}, the tests ran with {md.version(name)}"
    assert not set(pins) & _comment_list("provided")
    assert ".gpu-wheels/" in (REPO / ".gitignore").read_text().split()


def _wheels_dir(tmp_path_factory) -> Path:
    """The repository's wheel folder where it holds the list; else a fresh download (PyPI)."""
    here = REPO / ".gpu-wheels"
    have = {_norm(w.name.split("-")[0]) for w in here.glob("*.whl")} if here.is_dir() else set()
    if set(wheel_pins()) | set(wheel_pins(TRANSFORMERS_LIST)) <= have:
        return here
    fresh = tmp_path_factory.mktemp("gpu-wheels")
    try:
        done = subprocess.run([str(REPO / "scripts" / "gpu-wheels"), str(fresh)], capture_output=True, text=True,
                              env={**os.environ, "PYTHON": sys.executable}, timeout=300)
    except subprocess.TimeoutExpired:  # pip retrying an index it cannot reach
        pytest.skip("scripts/gpu-wheels could not download the wheels within 300 s (no PyPI here?)")
    if done.returncode != 0:
        pytest.skip(f"scripts/gpu-wheels could not download the wheels (no PyPI here?): {done.stderr[-500:]}")
    return fresh


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("gpu-check-dry")
    wheels = _wheels_dir(tmp_path_factory)
    env = {**os.environ, "PYTHON": sys.executable, "GPU_WHEELS": str(wheels),
           "GPU_SITE": str(tmp_path_factory.mktemp("gpu-site"))}
    env.pop("LAYERCAST_GPU_DEVICE", None)
    done = subprocess.run([str(REPO / "scripts" / "gpu-check"), "--dry", str(out)], capture_output=True, text=True,
                          env=env, timeout=1800, cwd=REPO)
    assert done.returncode == 0, f"gpu-check --dry failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return out


@pytest.mark.slow
@pytest.mark.timeout(2000)  # the dry run is its fixture: ~1-2 min, 8 on a crowded 2-core machine
def test_the_dry_check_runs_every_step_and_writes_json_that_parses(dry_run):
    summary = json.loads((dry_run / "summary.json").read_text())
    assert summary["ok"] and summary["dry"] and summary["device"] == "cpu"
    assert list(summary["steps"]) == ["install", "pytest", "model", "bench_engine", "bench_load"]
    load = json.loads((dry_run / "bench_load.json").read_text())
    assert load["device"] == "cpu" and load["same_first_token"]
    assert load["ratios"]["layercast_cold_vs_raw"] > 0 and load["ratios"]["from_pretrained_vs_layercast_ready"] > 0
    engine = json.loads((dry_run / "bench_engine.json").read_text())
    assert engine["device"] == "cpu" and engine["decode_tokens_per_s"]["16"] > 0 and engine["hf_generate_tokens_per_s"] > 0
    assert summary["load"]["layercast_cold_vs_raw"] == load["ratios"]["layercast_cold_vs_raw"]
    suite = ET.parse(dry_run / "pytest.xml").getroot().find("testsuite")
    # Every gpu test ran on the CPU: none failed, none skipped.
    assert int(suite.get("tests")) >= 20 and suite.get("failures") == suite.get("errors") == suite.get("skipped") == "0"


@pytest.mark.slow
@pytest.mark.timeout(2000)
def test_the_wheels_cover_what_the_check_imported(dry_run):
    modules = set()
    for f in (dry_run / "imports").glob("*.txt"):
        modules |= set(f.read_text().split())
    assert {"pytest", "benchmarks", "libs", "services", "nats", "sqlalchemy"} <= modules
    by_module = md.packages_distributions()
    imported = {_norm(d) for m in modules for d in by_module.get(m, [])}
    allowed = set(wheel_pins()) | _comment_list("provided") | _comment_list("optional") | {"layercast"}
    assert imported - allowed == set(), "imported, but neither in scripts/gpu-wheels.txt nor provided"
