"""Multicasts and a dev cluster on an emulated cluster: network namespaces, a bridge, tc-capped links.

Root only (skipped with the reason elsewhere); CI runs as root.
"""

import uuid

import httpx
import pytest

from benchmarks.bench_multicast import ALGORITHMS, run_multicast_benchmark
from libs.cluster.emulation import EmulatedCluster, can_emulate
from conftest import running_cluster

_ok, _why = can_emulate()
pytestmark = [pytest.mark.root, pytest.mark.slow, pytest.mark.skipif(not _ok, reason=_why)]


def test_every_algorithm_on_capped_links_respects_physics_and_its_schedule():
    """Small but real: 5 nodes, 16 MiB in 8 blocks over 200 Mbit/s links."""
    r = run_multicast_benchmark(nodes=5, size_mb=16, blocks=8, link_mbit=200, algorithms=ALGORITHMS, ks=(1, 2))
    by = {(e["algorithm"], e["k"]): e for e in r["results"]}
    assert set(by) == {("star", 1), ("binary-tree", 1), ("chain", 1), ("chain", 2), ("binomial", 1),
                       ("binomial", 2)}
    for e in r["results"]:
        # The caps hold: nobody takes in M bytes faster than its link allows (tbf's first burst aside).
        assert min(e["node_completion_s"]) >= 0.95 * e["lower_bound_s"], e
        # Loose (CI machines are shared): the executor follows its schedule's step structure.
        assert e["ratio_to_schedule_bound"] < 1.6, e
    assert by[("star", 1)]["completion_s"] > 2.5 * by[("binomial", 1)]["completion_s"]
    assert by[("binary-tree", 1)]["completion_s"] > by[("binomial", 1)]["completion_s"]
    assert by[("binomial", 2)]["first_copy_s"] < by[("binomial", 2)]["completion_s"]


def test_chains_on_a_leaf_spine_fabric_are_bounded_by_its_shared_uplinks():
    """2 leaves x 4 nodes, uplinks of 1.5 links: chain-blind crosses the spine, chain does not.
    No run beats its fabric bound (the uplinks' even share), and the benchmark reports how
    close chain/chain-blind came to the best ratio the fabric allows."""
    r = run_multicast_benchmark(nodes=8, size_mb=16, blocks=8, link_mbit=200, algorithms=("chain", "chain-blind"),
                                ks=(2,), leaves=2, uplink_mbit=300)
    by = {e["algorithm"]: e for e in r["results"]}
    assert by["chain-blind"]["fabric_bound_s"] > 1.3 * by["chain"]["fabric_bound_s"]
    for e in r["results"]:
        assert e["completion_s"] >= 0.95 * e["fabric_bound_s"], e
    ratios = r["chain_vs_blind"]["k=2"]
    assert ratios["at_fabric_bounds"] == round(by["chain"]["fabric_bound_s"] / by["chain-blind"]["fabric_bound_s"], 4)
    assert ratios["measured"] == round(by["chain"]["completion_s"] / by["chain-blind"]["completion_s"], 4)


def test_dev_cluster_with_workers_in_namespaces_serves(tmp_path, postgres_server_url, tiny_checkpoint):
    """`layercast up --emulate`: workers reach NATS over the bridge and serve through the gateway."""
    with EmulatedCluster(2, link_mbit=500) as emulation, running_cluster(
            postgres_server_url, tiny_checkpoint, dict(min_instances=0, max_instances=1), emulation=emulation,
            state_dir=tmp_path, api_key="k", admin_key="a", workers=2,
            namespace=f"lcem{uuid.uuid4().hex[:6]}") as state:
        with httpx.Client(base_url=state.gateway_url, timeout=60) as c:
            r = c.post("/v1/completions", headers={"Authorization": "Bearer k"},
                       json={"model": "tiny", "prompt": "hi", "max_tokens": 3})
            assert r.status_code == 200, r.text
            workers = c.get("/admin/v1/cluster", headers={"Authorization": "Bearer a"}).json()["workers"]
        node_ips = {n.ip for n in emulation.nodes}
        assert {w["data_address"].rsplit(":", 1)[0] for w in workers} == node_ips
