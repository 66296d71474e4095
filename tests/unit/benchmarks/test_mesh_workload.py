"""The workload builder of `layercast bench mesh` (benchmarks/mesh_workload.py): a seeded,
deterministic Zipf mapping of the Azure LLM trace's requests onto K models that keeps the
trace's temporal shape. Trace: Azure LLM inference traces 2023 (Azure/AzurePublicDataset),
CC-BY-4.0."""

import os
from collections import Counter
from pathlib import Path

import pytest

from benchmarks.mesh_workload import (
    MeshWorkloadSpec,
    build_workload,
    counts_per_bin,
    load_workload,
    pearson,
    resolve_trace,
    zipf_mapping,
    zipf_weights,
)
from benchmarks.trace_replay import parse_trace


@pytest.fixture(scope="module")
def code_rows():
    try:
        return parse_trace(resolve_trace("code"))
    except FileNotFoundError as e:
        pytest.skip(str(e))


def test_zipf_weights_sum_to_one_and_decrease():
    w = zipf_weights(8, 1.0)
    assert sum(w) == pytest.approx(1.0)
    assert all(a > b for a, b in zip(w, w[1:]))
    assert w[0] / w[1] == pytest.approx(2.0)
    assert zipf_weights(3, 0.0) == pytest.approx([1 / 3] * 3)
    with pytest.raises(ValueError):
        zipf_weights(0)


def test_zipf_mapping_is_seeded_and_deterministic():
    a = zipf_mapping(2000, 8, seed=3)
    assert a == zipf_mapping(2000, 8, seed=3)
    assert a != zipf_mapping(2000, 8, seed=4)
    assert set(a) <= set(range(8))
    counts = Counter(a).most_common()
    # The most popular model gets about 1/H_8 = 37% of the requests, the least about 4.6%.
    assert 0.30 < counts[0][1] / 2000 < 0.45
    assert counts[-1][1] / 2000 < 0.08
    # A prefix of a longer mapping is the shorter mapping: the draws do not depend on n.
    assert zipf_mapping(500, 8, seed=3) == a[:500]


def test_build_workload_is_deterministic_and_fits_the_duration(code_rows):
    spec = MeshWorkloadSpec(models=4, duration_s=30, target_rps=5, seed=1, max_prompt_tokens=64,
                            max_output_tokens=8)
    reqs, summary = build_workload(code_rows, spec)
    assert (reqs, summary) == build_workload(code_rows, spec)
    assert reqs != build_workload(code_rows, MeshWorkloadSpec(models=4, duration_s=30, target_rps=5, seed=2))[0]
    assert 0.7 * 150 < len(reqs) < 1.3 * 150  # target_rps * duration_s on average
    assert all(0 <= r.send_at_s <= 30 for r in reqs)
    assert [r.send_at_s for r in reqs] == sorted(r.send_at_s for r in reqs)
    assert all(1 <= r.prompt_tokens <= 64 and 1 <= r.output_tokens <= 8 for r in reqs)
    assert {r.model for r in reqs} == {0, 1, 2, 3}
    assert summary["requests_per_model"] == [sum(r.model == k for r in reqs) for k in range(4)]
    assert summary["time_scale"] == pytest.approx(code_rows[-1].t_s / 30, rel=1e-6)


@pytest.mark.parametrize("rps", [3.0, 10.0])
def test_per_second_counts_follow_the_trace(code_rows, rps):
    """The replay's per-second request counts correlate with the trace's counts in the same
    (compressed) bins: the thinning is uniform, so the bursts stay where they were."""
    spec = MeshWorkloadSpec(models=8, duration_s=30, target_rps=rps, seed=0)
    reqs, summary = build_workload(code_rows, spec)
    replay = counts_per_bin([r.send_at_s for r in reqs], 1.0, 30)
    trace = counts_per_bin([r.t_s / summary["time_scale"] for r in code_rows], 1.0, 30)
    assert len(replay) == len(trace) == 30
    assert pearson(replay, trace) > 0.8


def test_trace_path_does_not_depend_on_the_cwd(tmp_path, monkeypatch):
    try:
        expected = resolve_trace("code")
    except FileNotFoundError as e:
        pytest.skip(str(e))
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("LAYERCAST_TRACES_DIR", raising=False)
    assert resolve_trace("code") == expected
    _, summary, path = load_workload("code", MeshWorkloadSpec(models=2, duration_s=5, target_rps=1))
    assert path == expected and "CC-BY-4.0" in summary["attribution"]
    monkeypatch.setenv("LAYERCAST_TRACES_DIR", str(expected.parent))
    assert resolve_trace("code") == expected
    assert resolve_trace(str(expected)) == expected
    with pytest.raises(FileNotFoundError):
        resolve_trace(os.fspath(Path(tmp_path) / "missing.csv"))


def test_pearson():
    assert pearson([1, 2, 3], [2, 4, 6]) == pytest.approx(1.0)
    assert pearson([1, 2, 3], [3, 2, 1]) == pytest.approx(-1.0)
    assert pearson([1, 1, 1], [1, 2, 3]) == 0.0
