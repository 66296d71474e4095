"""The leaf-spine emulation's pure parts, no root needed: which worker goes to which leaf and
scale-up group, the address plan, the worker labels, the profile's flags and the tc commands
(libs/cluster/emulation.py). The root test that runs them is tests/emulated/test_leafspine_emulated.py."""

from collections import Counter

import pytest
from hypothesis import given
from hypothesis import strategies as st

from libs.cluster.emulation import (
    DEFAULT_PROFILE,
    EmulatedCluster,
    EmulationProfile,
    _tbf_args,
    link_shaping_cmds,
    place_nodes,
    requested_profile,
    scaleup_peers,
    uplink_shaping_cmds,
)
from libs.cluster.launcher import ClusterSpec, worker_args

SUBNET = "10.99.0.0/24"  # given, so no route table is read


def test_round_robin_leaves_and_consecutive_groups_of_a_leaf():
    p = place_nodes(8, leaves=2, scaleup_group_size=2)
    assert [x.leaf for x in p] == ["leaf-0", "leaf-1"] * 4
    # leaf 0 holds workers 0, 2, 4, 6: groups {0, 2} and {4, 6}; leaf 1 likewise with 1, 3, 5, 7.
    assert [x.scaleup_group for x in p] == ["leaf-0/g0", "leaf-1/g0", "leaf-0/g0", "leaf-1/g0",
                                            "leaf-0/g1", "leaf-1/g1", "leaf-0/g1", "leaf-1/g1"]
    assert scaleup_peers(p, 0) == (2,) and scaleup_peers(p, 5) == (7,)
    # A short last group: 3 workers per leaf in groups of 2.
    p = place_nodes(6, leaves=2, scaleup_group_size=2)
    assert scaleup_peers(p, 4) == () and p[4].scaleup_group == "leaf-0/g1"


def test_the_flat_default_places_every_worker_on_leaf_0_without_a_group():
    p = place_nodes(5)
    assert {x.leaf for x in p} == {"leaf-0"} and {x.scaleup_group for x in p} == {""}
    assert all(scaleup_peers(p, i) == () for i in range(5))


@given(n=st.integers(1, 64), leaves=st.integers(1, 8), g=st.integers(1, 9))
def test_placement_invariants(n, leaves, g):
    leaves = min(leaves, n)
    p = place_nodes(n, leaves, g)
    # Leaves are balanced: sizes differ by at most one.
    sizes = Counter(x.leaf_index for x in p)
    assert max(sizes.values()) - min(sizes.values()) <= 1 and len(sizes) == leaves
    groups: dict[str, list[int]] = {}
    for x in p:
        if g > 1:
            assert x.scaleup_group.startswith(x.leaf + "/")  # a group never spans leaves
            groups.setdefault(x.scaleup_group, []).append(x.index)
        else:
            assert x.scaleup_group == ""
    for members in groups.values():
        assert 1 <= len(members) <= g
        # Consecutive on their leaf: positions (index // L) form a run.
        pos = [i // leaves for i in members]
        assert pos == list(range(pos[0], pos[0] + len(pos)))
        for i in members:  # peers: the group less the worker itself, symmetric
            assert set(scaleup_peers(p, i)) == set(members) - {i}
    # Every group but a leaf's last is full.
    per_leaf = Counter(x.leaf for x in p)
    for name, members in groups.items():
        leaf = name.split("/")[0]
        last = (per_leaf[leaf] - 1) // g
        if int(name.rsplit("/g", 1)[1]) < last:
            assert len(members) == g


def test_address_plan_and_names_of_a_leaf_spine_cluster():
    c = EmulatedCluster(4, link_mbit=80, leaves=2, uplink_mbit=40, scaleup_group_size=2, prefix="lcx", subnet=SUBNET)
    # One L2 segment over every leaf: the host (on the spine) first, then the workers in order.
    assert c.host_ip == "10.99.0.1"
    assert [n.ip for n in c.nodes] == ["10.99.0.2", "10.99.0.3", "10.99.0.4", "10.99.0.5"]
    assert c.bridge == "lcxbr" and c.leaf_bridges == ["lcxl0", "lcxl1"]
    assert [n.leaf_index for n in c.nodes] == [0, 1, 0, 1]
    assert [n.scaleup_peers for n in c.nodes] == [(2,), (3,), (0,), (1,)]
    assert c.scaleup_mbit == 320  # 4x the link by default
    assert c.topology()[1] == {"index": 1, "ip": "10.99.0.3", "leaf": "leaf-1", "scaleup_group": "leaf-1/g0"}
    # The flat default has no leaf bridges: workers stay on the one bridge.
    flat = EmulatedCluster(3, prefix="lcy", subnet=SUBNET)
    assert flat.leaf_bridges == [] and all(n.leaf == "leaf-0" and not n.scaleup_peers for n in flat.nodes)
    with pytest.raises(ValueError, match="no worker"):
        EmulatedCluster(2, leaves=3, subnet=SUBNET)


def test_workers_are_started_with_their_leaf_and_group_labels():
    spec = ClusterSpec(state_dir=".", workers=4)
    c = EmulatedCluster(4, leaves=2, scaleup_group_size=2, subnet=SUBNET)
    args = worker_args(spec, 3, c)
    assert args[args.index("--leaf") + 1] == "leaf-1"
    assert args[args.index("--scaleup-group") + 1] == "leaf-1/g0"
    # Flat: leaf-0 (the worker's own default) and no group flag; not emulated: neither.
    args = worker_args(spec, 1, EmulatedCluster(2, subnet=SUBNET))
    assert args[args.index("--leaf") + 1] == "leaf-0" and "--scaleup-group" not in args
    assert "--leaf" not in worker_args(spec, 1)


def test_a_link_without_peers_keeps_the_lone_tbf():
    assert link_shaping_cmds("v0", "ns0", 80, 9000, match="dst") == [
        ["tc", "-n", "ns0", "qdisc", "add", "dev", "v0", "root", *_tbf_args(80, 9000)]]
    assert link_shaping_cmds("h0", None, None, 9000, match="src", scaleup_peer_ips=["10.0.0.3"],
                             scaleup_mbit=None) == []  # an uncapped link: nothing to shape


def test_a_link_with_scaleup_peers_splits_into_two_independent_shapers():
    cmds = link_shaping_cmds("h0", None, 80, 9000, match="src", scaleup_peer_ips=["10.0.0.3", "10.0.0.4"],
                             scaleup_mbit=320)
    assert cmds[0] == ["tc", "qdisc", "add", "dev", "h0", "root", "handle", "1:", "htb", "default", "2"]
    classes = [c for c in cmds if c[1] == "class"]
    assert [c[c.index("classid") + 1] for c in classes] == ["1:1", "1:2"]
    assert all(c[c.index("parent") + 1] == "1:" for c in classes)  # both root classes: neither borrows
    tbfs = {c[c.index("parent") + 1]: c[c.index("tbf"):] for c in cmds if "tbf" in c}
    assert tbfs == {"1:1": _tbf_args(320, 9000), "1:2": _tbf_args(80, 9000)}
    filters = [c for c in cmds if c[1] == "filter"]
    assert [c[c.index("match") + 2:c.index("match") + 4] for c in filters] == [
        ["src", "10.0.0.3/32"], ["src", "10.0.0.4/32"]]
    assert {c[-1] for c in filters} == {"1:1"}
    # The worker's own end matches destinations, inside its namespace.
    up = link_shaping_cmds("v0", "ns0", 80, 9000, match="dst", scaleup_peer_ips=["10.0.0.3"], scaleup_mbit=320)
    assert all(c[:3] == ["tc", "-n", "ns0"] for c in up)
    assert [c for c in up if "filter" in c][0][-4:] == ["dst", "10.0.0.3/32", "flowid", "1:1"]


def test_an_uplink_caps_worker_traffic_and_lets_the_host_through():
    cmds = uplink_shaping_cmds("u0", 40, 9000, host_ip="10.0.0.1", match="dst")
    tbfs = {c[c.index("parent") + 1]: c[c.index("tbf"):] for c in cmds if "tbf" in c}
    assert tbfs == {"1:2": _tbf_args(40, 9000)}  # 1:1, the host's class, has no shaper
    (f,) = [c for c in cmds if c[1] == "filter"]
    assert f[f.index("match"):] == ["match", "ip", "dst", "10.0.0.1/32", "flowid", "1:1"]
    assert uplink_shaping_cmds("u0", None, 9000, host_ip="10.0.0.1", match="dst") == []
    with pytest.raises(ValueError, match="match"):
        uplink_shaping_cmds("u0", 40, 9000, host_ip="10.0.0.1", match="both")


def test_profile_topology_fields_defaults_overrides_and_flags():
    assert DEFAULT_PROFILE.flat and DEFAULT_PROFILE.leaves == 1 and DEFAULT_PROFILE.uplink_mbit is None
    assert "leaves" not in DEFAULT_PROFILE.describe()  # the flat profile reads as it always did
    p = DEFAULT_PROFILE.with_overrides(leaves=2, uplink_mbit=100, scaleup_group_size=4)
    assert (p.leaves, p.uplink_mbit, p.scaleup_group_size) == (2, 100, 4) and not p.flat
    assert p.describe().endswith("2 leaves with uplinks 100 Mbit/s, scale-up groups of 4 at 1600 Mbit/s")
    assert p.with_overrides(uplink_mbit=0).uplink_mbit is None  # 0 uncaps, as every rate flag
    with pytest.raises(ValueError, match="uplink_mbit needs leaves"):
        EmulationProfile(uplink_mbit=100)
    with pytest.raises(ValueError, match="leaves"):
        DEFAULT_PROFILE.with_overrides(leaves=0)
    with pytest.raises(ValueError, match="scaleup_group_size"):
        EmulationProfile(scaleup_group_size=0)
    with pytest.raises(ValueError, match="--leaves, --uplink-mbit"):
        requested_profile(False, leaves=2, uplink_mbit=10)
    assert requested_profile(True, leaves=2).leaves == 2
    # A cluster built from the profile applies it.
    c = EmulatedCluster.from_profile(4, p.with_overrides(disk_read_mbit=0), subnet=SUBNET)
    assert c.profile.leaves == 2 and c.uplink_mbit == 100 and c.scaleup_mbit == 1600


def test_commands_take_the_topology_flags_and_refuse_bad_combinations(tmp_path):
    from typer.testing import CliRunner

    from benchmarks.cli import bench_app
    from services.cli.app import app

    runner = CliRunner()
    r = runner.invoke(bench_app, ["multicast", "--workers", "4", "--modes", "chain", "--uplink-mbit", "10"])
    assert r.exit_code == 2 and "uplink_mbit needs leaves" in " ".join(r.output.split())
    r = runner.invoke(bench_app, ["multicast", "--workers", "2", "--leaves", "3"])
    assert r.exit_code == 2 and "a leaf would have no node" in " ".join(r.output.split())
    r = runner.invoke(bench_app, ["scale", "--no-emulate", "--leaves", "2"])
    assert r.exit_code == 2 and "only apply with --emulate" in " ".join(r.output.split())
    r = runner.invoke(app, ["up", "--state-dir", str(tmp_path), "--leaves", "2", "--scaleup-group-size", "2"])
    assert r.exit_code == 1 and "--leaves, --scaleup-group-size" in " ".join(r.output.split())
