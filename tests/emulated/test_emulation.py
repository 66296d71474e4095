"""EmulatedCluster: connectivity, link rate caps, CPU quotas, disk read caps, the
emulation profile (`layercast up --emulate`) and cleanup.

Needs root, iproute2 and netns support; skipped with can_emulate()'s reason
otherwise. Every test checks that nothing named with its prefix is left over.
"""

import os
import re
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from libs.cluster.launcher import ClusterSpec, free_port, start_cluster, stop_processes, worker_args
from libs.cluster.emulation import (
    BLKIO_CGROUP_ROOT,
    CPU_CGROUP_ROOT,
    DEFAULT_PROFILE,
    EmulatedCluster,
    EmulationError,
    EmulationProfile,
    block_device_of,
    can_emulate,
    cleanup_stale,
)

pytestmark = [pytest.mark.root, pytest.mark.slow]


@pytest.fixture(scope="module", autouse=True)
def _need_emulation():
    ok, why = can_emulate()
    if not ok:
        pytest.skip(why)


def leftovers(prefix: str) -> list[str]:
    found = [line.split()[0] for line in _out(["ip", "netns", "list"]).splitlines() if line.startswith(prefix)]
    for line in _out(["ip", "-o", "link", "show"]).splitlines():
        name = line.split(":", 2)[1].strip().split("@")[0]
        if name.startswith(prefix):
            found.append(name)
    for root in (CPU_CGROUP_ROOT, BLKIO_CGROUP_ROOT):
        if root.is_dir():
            found += [str(p) for p in root.iterdir() if p.name.startswith(prefix)]
    found += [str(p) for p in Path("/run").glob(f"layercast-emu-{prefix}*.owner")]
    return found


def _out(cmd: list[str]) -> str:
    return subprocess.run(cmd, check=True, capture_output=True, text=True).stdout


def _mtu(cmd_prefix: list[str], ifname: str) -> int:
    words = _out([*cmd_prefix, "link", "show", ifname]).split()
    return int(words[words.index("mtu") + 1])


# Serves a TCP echo on its own address, then echoes a message off every target
# ("ip:port"), printing the targets it reached; stays up until stdin closes.
ECHO_NODE = r"""
import socket, sys, threading, time
me, port, targets = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
srv = socket.create_server((me, port))
def serve():
    while True:
        c, _ = srv.accept()
        with c:
            c.sendall(c.recv(64))
threading.Thread(target=serve, daemon=True).start()
reached = []
for target in targets:
    ip, p = target.rsplit(":", 1)
    deadline = time.monotonic() + 10
    while True:
        try:
            with socket.create_connection((ip, int(p)), timeout=2) as s:
                msg = f"hello from {me}".encode()
                s.sendall(msg)
                assert s.recv(64) == msg
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    reached.append(ip)
print(" ".join(reached), flush=True)
sys.stdin.read()
"""


def _echo_once(ip: str, port: int) -> None:
    with socket.create_connection((ip, port), timeout=5) as s:
        s.sendall(b"ping")
        assert s.recv(64) == b"ping"


def test_nodes_reach_each_other_and_host_and_close_leaves_nothing():
    port = 7100
    with EmulatedCluster(3) as cluster:
        prefix = cluster.prefix
        # MTU 9000 on the bridge and on both ends of every veth.
        assert _mtu(["ip"], cluster.bridge) == 9000
        for node in cluster.nodes:
            assert _mtu(["ip"], f"{prefix}h{node.index}") == 9000
            assert _mtu(["ip", "-n", node.netns], f"{prefix}v{node.index}") == 9000
            # Nothing routes anywhere but the cluster's own subnet.
            assert "default" not in _out(["ip", "-n", node.netns, "route"])

        # An echo server on the host side of the bridge (root namespace).
        host_srv = socket.create_server((cluster.host_ip, 0))
        host_port = host_srv.getsockname()[1]

        def serve_host():
            for _ in range(len(cluster.nodes)):
                c, _ = host_srv.accept()
                with c:
                    c.sendall(c.recv(64))

        server = threading.Thread(target=serve_host, daemon=True)
        server.start()

        procs = []
        for node in cluster.nodes:
            targets = [f"{n.ip}:{port}" for n in cluster.nodes if n is not node] + [f"{cluster.host_ip}:{host_port}"]
            procs.append(cluster.popen(node.index, [sys.executable, "-c", ECHO_NODE, node.ip, str(port), *targets],
                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True))
        for node, proc in zip(cluster.nodes, procs):
            reached = proc.stdout.readline().split()
            expected = [n.ip for n in cluster.nodes if n is not node] + [cluster.host_ip]
            assert reached == expected, f"node {node.index} reached {reached}"
        # The root namespace reaches every node through the bridge.
        for node in cluster.nodes:
            _echo_once(node.ip, port)
        server.join(5)
        host_srv.close()
        for proc in procs:
            proc.stdin.close()
            assert proc.wait(5) == 0
            proc.stdout.close()

        # A child still running at close() gets killed; a live cluster is not "stale".
        sleeper = cluster.popen(0, ["sleep", "60"])
        assert cleanup_stale(prefix) == []
        assert leftovers(prefix)
    assert sleeper.poll() is not None
    assert leftovers(prefix) == []
    cluster.close()  # a second close is harmless


# Accepts n connections, says "go" to all at once, reads to EOF on all and
# prints "<bytes> <seconds>" counted from the "go".
RECEIVER = r"""
import selectors, socket, sys, time
ip, port, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
srv = socket.create_server((ip, port))
conns = [srv.accept()[0] for _ in range(n)]
t0 = time.monotonic()
for c in conns:
    c.sendall(b"g")
sel = selectors.DefaultSelector()
for c in conns:
    sel.register(c, selectors.EVENT_READ)
total, still_open = 0, n
while still_open:
    for key, _ in sel.select():
        data = key.fileobj.recv(1 << 20)
        if not data:
            sel.unregister(key.fileobj)
            still_open -= 1
        total += len(data)
print(total, time.monotonic() - t0, flush=True)
"""

# Connects (retrying until the receiver listens), waits for "go", sends nbytes.
SENDER = r"""
import socket, sys, time
ip, port, nbytes = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
deadline = time.monotonic() + 10
while True:
    try:
        s = socket.create_connection((ip, port))
        break
    except OSError:
        if time.monotonic() > deadline:
            raise
        time.sleep(0.02)
assert s.recv(1) == b"g"
chunk = b"x" * (1 << 20)
while nbytes > 0:
    s.sendall(chunk[:nbytes])
    nbytes -= len(chunk)
s.shutdown(socket.SHUT_WR)
s.recv(1)
s.close()
"""


def _transfer(cluster: EmulatedCluster, senders: list[int], dst: int, nbytes: int) -> tuple[int, float]:
    port = 7200
    ip = cluster.nodes[dst].ip
    receiver = cluster.popen(dst, [sys.executable, "-c", RECEIVER, ip, str(port), str(len(senders))],
                             stdout=subprocess.PIPE, text=True)
    procs = [cluster.popen(s, [sys.executable, "-c", SENDER, ip, str(port), str(nbytes)]) for s in senders]
    out, _ = receiver.communicate(timeout=30)
    for p in procs:
        assert p.wait(10) == 0
    assert receiver.returncode == 0
    total, seconds = out.split()
    return int(total), float(seconds)


def test_link_rate_is_capped_both_directions():
    mbit, nbytes = 80, 6_000_000
    with EmulatedCluster(3, link_mbit=mbit) as cluster:
        prefix = cluster.prefix
        # Upload of node 0 and download of node 1.
        total, seconds = _transfer(cluster, [0], 1, nbytes)
        assert total == nbytes
        ratio = total * 8 / seconds / (mbit * 1e6)
        print(f"one stream: {total} B in {seconds:.3f} s = {ratio:.3f} x {mbit} Mbit/s")
        assert 0.85 <= ratio <= 1.05

        # Two uploads at full rate converge on node 2: its download caps the sum.
        total, seconds = _transfer(cluster, [0, 1], 2, nbytes)
        assert total == 2 * nbytes
        ratio = total * 8 / seconds / (mbit * 1e6)
        print(f"two streams into one node: {total} B in {seconds:.3f} s = {ratio:.3f} x {mbit} Mbit/s")
        assert 0.85 <= ratio <= 1.05
    assert leftovers(prefix) == []


def test_cleanup_when_body_raises_after_failed_start_and_of_stale_leftovers():
    with pytest.raises(RuntimeError, match="boom"):
        with EmulatedCluster(2, link_mbit=100, cpu_quota=0.5) as cluster:
            assert leftovers(cluster.prefix)
            raise RuntimeError("boom")
    assert leftovers(cluster.prefix) == []

    # start() failing halfway (the bridge name is taken) undoes what it made
    # and leaves alone what it did not make.
    cluster = EmulatedCluster(2, link_mbit=100)
    prefix = cluster.prefix
    subprocess.run(["ip", "link", "add", f"{prefix}br", "type", "bridge"], check=True)
    try:
        with pytest.raises(EmulationError, match=f"{prefix}br"):
            cluster.start()
        assert leftovers(prefix) == [f"{prefix}br"]

        # Leftovers of a "crashed" run: a netns, a link and a cgroup.
        subprocess.run(["ip", "netns", "add", f"{prefix}n0"], check=True)
        (CPU_CGROUP_ROOT / f"{prefix}n0").mkdir()
        removed = cleanup_stale(prefix)
        assert sorted(removed) == sorted([f"netns {prefix}n0", f"link {prefix}br",
                                          f"cgroup {CPU_CGROUP_ROOT / f'{prefix}n0'}"])
    finally:
        cleanup_stale(prefix)
    assert leftovers(prefix) == []


def test_cleanup_at_exit_and_after_a_crash():
    def run_and(prefix: str, ending: str) -> None:
        code = ("import os\n"
                "from libs.cluster.emulation import EmulatedCluster\n"
                f"c = EmulatedCluster(2, link_mbit=100, cpu_quota=0.5, prefix={prefix!r}).start()\n"
                "c.popen(1, ['sleep', '60'])\n" + ending)
        subprocess.run([sys.executable, "-c", code], check=False, timeout=30)

    # Exiting with the cluster still open: the atexit hook closes it.
    prefix = f"lc{uuid.uuid4().hex[:4]}"
    run_and(prefix, "")
    assert leftovers(prefix) == []

    # SIGKILLed: no hook runs; the leftovers (its sleeper included) are stale
    # because the marker's owner is dead, and cleanup_stale() removes them.
    prefix = f"lc{uuid.uuid4().hex[:4]}"
    try:
        run_and(prefix, "os.kill(os.getpid(), 9)")
        assert leftovers(prefix)
        removed = cleanup_stale(prefix)
        assert {r.split()[0] for r in removed} == {"netns", "link", "cgroup"}
    finally:
        cleanup_stale(prefix)
    assert leftovers(prefix) == []


# Spins for 1 s of wall time; prints the CPU seconds it got meanwhile.
BUSY = r"""
import os, time
t0, w0 = os.times(), time.monotonic()
while time.monotonic() - w0 < 1.0:
    pass
t1 = os.times()
print(t1.user + t1.system - t0.user - t0.system, flush=True)
"""


@pytest.mark.skipif(not (CPU_CGROUP_ROOT / "cpu.cfs_quota_us").exists(), reason="no cgroup v1 cpu controller")
def test_cpu_quota_caps_a_busy_loop():
    with EmulatedCluster(1, cpu_quota=0.25) as cluster:
        prefix = cluster.prefix
        cgroup = Path(cluster.nodes[0].cgroup)
        assert (cgroup / "cpu.cfs_quota_us").read_text().strip() == "25000"
        assert (cgroup / "cpu.cfs_period_us").read_text().strip() == "100000"
        proc = cluster.popen(0, [sys.executable, "-c", BUSY], stdout=subprocess.PIPE, text=True)
        out, _ = proc.communicate(timeout=20)
        assert proc.returncode == 0
        cpu_s = float(out)
        print(f"busy loop got {cpu_s:.3f} CPU s in 1 s wall with a 0.25-CPU quota")
        assert 0.1 <= cpu_s <= 0.35
    assert leftovers(prefix) == []
    assert os.path.exists(CPU_CGROUP_ROOT) and not cgroup.exists()


# Reads a file with O_DIRECT (past the page cache, as the checkpoint loader does);
# prints "<bytes> <seconds>".
DIRECT_READ = r"""
import mmap, os, sys, time
fd = os.open(sys.argv[1], os.O_RDONLY | os.O_DIRECT)
buf = mmap.mmap(-1, 1 << 20)  # page-aligned, as O_DIRECT wants
total, t0 = 0, time.monotonic()
while n := os.readv(fd, [buf]):
    total += n
print(total, time.monotonic() - t0, flush=True)
"""


def _direct_read(popen, path: Path) -> tuple[int, float]:
    proc = popen([sys.executable, "-c", DIRECT_READ, str(path)], stdout=subprocess.PIPE, text=True)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0
    total, seconds = out.split()
    return int(total), float(seconds)


@pytest.mark.skipif(not (BLKIO_CGROUP_ROOT / "blkio.throttle.read_bps_device").exists(),
                    reason="no cgroup v1 blkio controller")
def test_disk_reads_are_capped_in_a_node_and_close_removes_the_blkio_groups(tmp_path):
    try:
        device = block_device_of(tmp_path)
    except EmulationError as e:
        pytest.skip(f"tmp dir not on a block device: {e}")
    mbit, nbytes = 40, 10_000_000
    data = tmp_path / "blob"
    with open(data, "wb") as f:
        f.write(os.urandom(nbytes))
        f.flush()
        os.fsync(f.fileno())

    with EmulatedCluster(2, disk_read_mbit=mbit, disk_path=tmp_path) as cluster:
        prefix = cluster.prefix
        groups = [Path(n.blkio_cgroup) for n in cluster.nodes]
        for g in groups:
            assert (g / "blkio.throttle.read_bps_device").read_text().split() == [device, "5000000"]
        total, seconds = _direct_read(lambda argv, **kw: cluster.popen(0, argv, **kw), data)
        assert total == nbytes
        ratio = total * 8 / seconds / (mbit * 1e6)
        print(f"O_DIRECT read in a node: {total} B in {seconds:.3f} s = {ratio:.3f} x {mbit} Mbit/s")
        assert 0.75 <= ratio <= 1.25

        # The same read outside the emulated nodes is not capped.
        total, outside_s = _direct_read(subprocess.Popen, data)
        print(f"O_DIRECT read outside: {total * 8 / outside_s / 1e6:.0f} Mbit/s")
        assert outside_s < seconds / 3

        # A node's child sits in its node's blkio group (and in no other node's).
        sleeper = cluster.popen(1, ["sleep", "60"])
        deadline = time.monotonic() + 5
        while str(sleeper.pid) not in (groups[1] / "cgroup.procs").read_text().split():
            assert time.monotonic() < deadline, "child never joined its blkio group"
            time.sleep(0.02)
        assert str(sleeper.pid) not in (groups[0] / "cgroup.procs").read_text().split()
        assert leftovers(prefix)
    assert sleeper.poll() is not None
    assert not any(g.exists() for g in groups)
    assert leftovers(prefix) == []


def test_disk_cap_needs_a_block_device_and_a_path():
    with pytest.raises(ValueError, match="disk_path"):
        EmulatedCluster(1, disk_read_mbit=40)
    cluster = EmulatedCluster(1, disk_read_mbit=40, disk_path="/proc")  # procfs: no block device
    with pytest.raises(EmulationError, match="no block device"):
        cluster.start()
    assert leftovers(cluster.prefix) == []


def test_stale_blkio_groups_are_cleaned_up():
    prefix = f"lc{uuid.uuid4().hex[:4]}"
    (BLKIO_CGROUP_ROOT / f"{prefix}n0").mkdir()
    try:
        assert cleanup_stale(prefix) == [f"cgroup {BLKIO_CGROUP_ROOT / f'{prefix}n0'}"]
    finally:
        cleanup_stale(prefix)
    assert leftovers(prefix) == []


def test_profile_defaults_overrides_and_what_a_cluster_applies(tmp_path):
    # The papers' ratios: network 10x disk, host->device 1.25x network.
    # A node's host memory holds 3 models (lambdaScale 2.3).
    assert DEFAULT_PROFILE == EmulationProfile(link_mbit=400, disk_read_mbit=40, host_to_device_mbit=500,
                                               host_cache_models=3)
    assert DEFAULT_PROFILE.describe() == ("links 400 Mbit/s, disk reads 40 Mbit/s, host->device 500 Mbit/s, "
                                          "CPU uncapped, host cache 3 models")
    # Command-line style: None keeps the default, 0 uncaps.
    assert DEFAULT_PROFILE.with_overrides() == DEFAULT_PROFILE
    p = DEFAULT_PROFILE.with_overrides(link_mbit=100, disk_read_mbit=0, host_to_device_mbit=0, cpu_quota=0.5,
                                       host_cache_models=0)
    assert p == EmulationProfile(link_mbit=100, disk_read_mbit=None, host_to_device_mbit=None, cpu_quota=0.5,
                                 host_cache_models=None)
    assert p.describe().endswith("host cache bounded by bytes only")
    with pytest.raises(ValueError, match="link_mbit"):
        DEFAULT_PROFILE.with_overrides(link_mbit=-1)
    with pytest.raises(ValueError, match="host_cache_models"):
        DEFAULT_PROFILE.with_overrides(host_cache_models=-2)

    cluster = EmulatedCluster.from_profile(2, DEFAULT_PROFILE, disk_path=tmp_path)
    assert cluster.profile == DEFAULT_PROFILE
    assert all(n.blkio_cgroup and not n.cgroup for n in cluster.nodes)
    # The old call style still works, and records what it applies.
    assert EmulatedCluster(3, link_mbit=100, cpu_quota=0.5).profile == EmulationProfile(
        link_mbit=100, disk_read_mbit=None, host_to_device_mbit=None, cpu_quota=0.5, host_cache_models=None)


def test_workers_get_the_host_to_device_rate_and_cache_bound_only_when_emulated(tmp_path):
    spec = ClusterSpec(state_dir=tmp_path, workers=2)
    cluster = EmulatedCluster(2, host_to_device_mbit=500, host_cache_models=3)
    args = worker_args(spec, 1, cluster)
    assert args[args.index("--emulated-host-to-device-mbit") + 1] == "500"
    assert args[args.index("--host-cache-models") + 1] == "3"
    assert args[args.index("--data-host") + 1] == cluster.nodes[1].ip
    for args in (worker_args(spec, 1, EmulatedCluster(2)), worker_args(spec, 1)):
        assert "--emulated-host-to-device-mbit" not in args and "--host-cache-models" not in args


def test_up_rejects_emulation_flags_without_emulate(tmp_path):
    from typer.testing import CliRunner

    from services.cli.app import app

    r = CliRunner().invoke(app, ["up", "--state-dir", str(tmp_path), "--disk-mbit", "40"])
    assert r.exit_code == 1
    assert "only apply with --emulate" in " ".join(r.output.split())  # rich wraps lines


def test_emulated_cluster_start_runs_workers_with_the_profile(tmp_path):
    """start_cluster under the default profile: each worker runs in its node's blkio group with the
    host->device flag, and comes up healthy (it accepts the flag)."""
    spec = ClusterSpec(state_dir=tmp_path, port=free_port(), workers=2, namespace=f"lcem{uuid.uuid4().hex[:6]}")
    with EmulatedCluster.from_profile(2, DEFAULT_PROFILE, disk_path=tmp_path) as emulation:
        prefix = emulation.prefix
        state = start_cluster(spec, emulation=emulation)
        try:
            for i, node in enumerate(emulation.nodes):
                pid = next(p.pid for p in state.processes if p.name == f"worker-{i}")
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
                assert argv[argv.index(b"--emulated-host-to-device-mbit") + 1] == b"500"
                assert re.search(rf"blkio[^:]*:/{node.blkio_cgroup.rsplit('/', 1)[1]}$",
                                 Path(f"/proc/{pid}/cgroup").read_text(), re.M)
        finally:
            stop_processes(state.processes)
    assert leftovers(prefix) == []
