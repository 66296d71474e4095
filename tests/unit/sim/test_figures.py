"""The papers' figures (libs.sim.figures): closed forms where there are, the planner's decisions where not."""

import json
import math

import pytest
from typer.testing import CliRunner

import libs.sim.figures as figures
from libs.sim.figures import fig_burst, fig_chain_topology, fig_mesh_capacity, fig_multicast_vs_n, fig_placement
from services.cli.app import app
from sim_profile import profile  # noqa: F401  (fixture)


def _row(d, alg, n):
    return next(r for r in d["rows"] if r["algorithm"] == alg and r["n"] == n)


def test_multicast_completion_against_n_matches_the_closed_forms(profile):
    d = fig_multicast_vs_n(profile, ns=(8, 16))
    M, B, R, o, c = profile.model_bytes, profile.n_blocks, profile.link_gbps * 1e9 / 8, profile.step_overhead_s, \
        profile.chunk_bytes
    step = M / B / R + o
    for n in (8, 16):
        assert _row(d, "binomial", n)["completion_s"] == pytest.approx((B + math.ceil(math.log2(n)) - 1) * step,
                                                                        abs=1e-4)
        assert _row(d, "k-way (k=4)", n)["completion_s"] == pytest.approx(
            (B + math.ceil(math.log2(n / 4)) - 1) * step, abs=1e-4)
        assert _row(d, "star", n)["completion_s"] == pytest.approx((n - 1) * B * step, abs=1e-4)
        assert _row(d, "chain", n)["completion_s"] == pytest.approx((M + (n - 2) * c) / R + (B + n - 2) * o, abs=1e-4)
        assert all(r["over_bound"] >= 1 - 1e-9 for r in d["rows"])
    assert 1.5 < d["binary_tree_over_binomial"][16] < 2.5  # the paper's "up to 1.82x"


def test_topology_aware_chains_stay_on_their_leaf_and_blind_ones_cross(profile):
    d = fig_chain_topology(profile, ns=(8, 16, 32), leaves=4)
    for r in d["topology"]:
        assert r["chain_spine_hops"] == 0
        assert r["chain"] <= r["chain-blind"] + 1e-9
    big = d["topology"][-1]
    assert big["chain-blind_spine_hops"] > 0 and big["aware_over_blind"] < 0.7
    # one chain grows only by a chunk and a block step's overhead per extra hop (BlitzScale Fig. 13a)
    flat = [r["completion_s"] for r in d["flat"] if r["algorithm"] == "chain"]
    per_hop = profile.chunk_bytes / (profile.link_gbps * 1e9 / 8) + profile.step_overhead_s
    assert flat[-1] - flat[0] == pytest.approx((32 - 8) * per_hop, abs=1e-3)


def test_the_burst_figure_runs_the_fleet_per_mode(profile):
    d = fig_burst(profile, ns=(8,), modes=("layercast", "serverlessllm"), max_batches=(8,))
    rows = {r["mode"]: r for r in d["rows"]}
    assert all(r["served"] == 50 for r in rows.values())
    # from cold: layercast multicasts the one host copy; serverlessllm reads every copy from disk (2 GB/s, 1 GB)
    assert rows["serverlessllm"]["whole_burst_first_token_s"] > 1.4 * rows["layercast"]["whole_burst_first_token_s"]
    assert d["over_layercast"]["max_batch=8 n=8"]["serverlessllm"] > 1
    assert "overhead_over_ideal_s" not in d  # no ideal run, no overheads


def test_the_burst_figure_gives_each_modes_overhead_over_ideal(profile):
    d = fig_burst(profile, ns=(8,), modes=("layercast", "serverlessllm", "ideal"), max_batches=(8,))
    first = {r["mode"]: r["whole_burst_first_token_s"] for r in d["rows"]}
    over = d["overhead_over_ideal_s"]["max_batch=8 n=8"]
    assert over == {m: pytest.approx(first[m] - first["ideal"], abs=1e-3) for m in ("layercast", "serverlessllm")}
    assert 0 < over["layercast"] < over["serverlessllm"]  # ideal holds the model everywhere already
    ratio = d["layercast_overhead_over"]["max_batch=8 n=8"]["serverlessllm"]
    assert ratio == pytest.approx(over["layercast"] / over["serverlessllm"], abs=1e-3)


def test_the_burst_figure_replays_bench_scale_from_one_warm_instance(profile):
    """`bench scale --burst`'s own setting (one instance serving, the planner asked for N as the
    burst arrives), as `simulate --validate` replays it: each mode's overheads over ideal, and
    new capacity's first token, which no mode gives before a new instance could hold the whole
    model (here both modes' come from the pool copy's local load)."""
    d = fig_burst(profile, ns=(8,), modes=("layercast", "binomial", "ideal"), max_batches=(8,))
    row = d["from_one_warm"]["max_batch=8 n=8"]
    firsts = {m: row[m]["burst_first_token_s"] for m in ("layercast", "binomial", "ideal")}
    assert row["overhead_over_ideal_s"] == {m: pytest.approx(firsts[m] - firsts["ideal"], abs=1e-3)
                                            for m in ("layercast", "binomial")}
    assert row["layercast_overhead_over"]["binomial"] == pytest.approx(
        row["overhead_over_ideal_s"]["layercast"] / row["overhead_over_ideal_s"]["binomial"], abs=1e-3)
    new = {m: row[m]["new_capacity_first_token_s"] for m in ("layercast", "binomial")}
    assert row["new_capacity_bound_s"] == pytest.approx(
        profile.model_bytes / max(profile.h2d_gbytes_per_s * 1e9, profile.link_gbps * 1e9 / 8), abs=1e-3)
    assert 0 < row["new_capacity_bound_s"] < min(new.values())
    assert row["bound_over_binomial_new_capacity_first_token"] == pytest.approx(
        row["new_capacity_bound_s"] / new["binomial"], abs=1e-3)
    assert row["layercast_over_binomial_new_capacity_first_token"] == pytest.approx(
        row["layercast"]["new_capacity_first_token_s"] / row["binomial"]["new_capacity_first_token_s"], abs=1e-3)


def test_locality_aware_placement_avoids_the_ssd_and_random_does_not(profile, monkeypatch):
    d = fig_placement(profile, rates=(0.05,), requests=200)
    r = d["rows"][0]
    assert r["locality"]["from_ssd"] == 0.0
    assert r["random"]["from_ssd"] == pytest.approx(1 - 10 / 16, abs=0.1)  # 10 of 16 models cached per worker
    assert r["random"]["mean_s"] > r["locality"]["mean_s"]
    # the choice is the planner's pick_targets: reversing its order makes "locality" the worst
    real = figures.pick_targets
    monkeypatch.setattr(figures, "pick_targets", lambda *a, **kw: real(*a[:3], 99, **kw)[::-1][:1])
    assert fig_placement(profile, rates=(0.05,), requests=200)["rows"][0]["locality"]["from_ssd"] > 0.3


def test_the_mesh_figure_compares_sharing_with_one_model_per_device(profile):
    trace = [(0.5 * i, 256, 16) for i in range(30)]
    d = fig_mesh_capacity(profile, trace, model_counts=(3,), nodes=2)
    row = d["rows"][0]
    assert row["dedicated"]["evicted"] > 0 and row["mesh"]["evicted"] == 0
    assert 0 <= row["mesh"]["slo_requests"] <= 30 and 0 <= row["dedicated"]["slo_requests"] <= 30


def test_simulate_figures_writes_json_and_png_and_refuses_unknown_names(tmp_path):
    res = CliRunner().invoke(app, ["simulate-figures", "--only", "chain_topology", "--out", str(tmp_path)])
    assert res.exit_code == 0, res.output
    data = json.loads((tmp_path / "chain_topology.json").read_text())
    assert data["profile"] == "h100-200g" and "BlitzScale" in data["paper"]["source"]
    assert (tmp_path / "chain_topology.png").stat().st_size > 0
    bad = CliRunner().invoke(app, ["simulate-figures", "--only", "nope", "--out", str(tmp_path)])
    assert bad.exit_code == 1 and "unknown figure" in bad.output
