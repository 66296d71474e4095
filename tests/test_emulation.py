"""EmulatedCluster: connectivity, link rate caps, CPU quotas and cleanup.

Needs root, iproute2 and netns support; skipped with can_emulate()'s reason
otherwise. Every test checks that nothing named with its prefix is left over.
"""

import os
import socket
import subprocess
import sys
import threading
import uuid
from pathlib import Path

import pytest

from services.cli.emulation import CPU_CGROUP_ROOT, EmulatedCluster, EmulationError, can_emulate, cleanup_stale

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
    if CPU_CGROUP_ROOT.is_dir():
        found += [str(p) for p in CPU_CGROUP_ROOT.iterdir() if p.name.startswith(prefix)]
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
                "from services.cli.emulation import EmulatedCluster\n"
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
