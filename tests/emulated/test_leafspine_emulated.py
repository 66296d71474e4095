"""The leaf-spine emulation on a real kernel: traffic crossing the spine shares the leaf's
uplink, traffic inside a leaf gets the link rate, traffic inside a scale-up group the faster
scale-up rate, the tc counters show which path each flow took, the workers register their
leaf and group labels, and close() leaves nothing behind.

Needs root, iproute2 and netns support; skipped with can_emulate()'s reason otherwise.
"""

import re
import subprocess
import sys
import time
import uuid

import httpx
import pytest

from libs.cluster.emulation import EmulatedCluster, can_emulate
from libs.cluster.launcher import ClusterSpec, free_port, start_cluster, stop_processes

pytestmark = [pytest.mark.root, pytest.mark.slow]


@pytest.fixture(scope="module", autouse=True)
def _need_emulation():
    ok, why = can_emulate()
    if not ok:
        pytest.skip(why)


def leftovers(prefix: str) -> list[str]:
    out = subprocess.run(["ip", "-o", "link", "show"], check=True, capture_output=True, text=True).stdout
    found = [line.split(":", 2)[1].strip().split("@")[0] for line in out.splitlines()]
    found = [name for name in found if name.startswith(prefix)]
    netns = subprocess.run(["ip", "netns", "list"], check=True, capture_output=True, text=True).stdout
    return found + [line.split()[0] for line in netns.splitlines() if line.startswith(prefix)]


# Accepts one connection, prints "ready", waits for a line on stdin, says "go" to the sender,
# reads to EOF and prints "<bytes> <seconds from go>".
RECEIVER = r"""
import socket, sys, time
srv = socket.create_server((sys.argv[1], int(sys.argv[2])))
conn = srv.accept()[0]
print("ready", flush=True)
sys.stdin.readline()
t0 = time.monotonic()
conn.sendall(b"g")
total = 0
while data := conn.recv(1 << 20):
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
s.close()
"""


def flows(cluster: EmulatedCluster, pairs: list[tuple[int, int]], nbytes: int) -> float:
    """Run src -> dst flows of nbytes each, started together; their aggregate rate in Mbit/s."""
    port = 7300
    receivers, senders = [], []
    for src, dst in pairs:
        ip = cluster.nodes[dst].ip
        receivers.append(cluster.popen(dst, [sys.executable, "-c", RECEIVER, ip, str(port)],
                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True))
        senders.append(cluster.popen(src, [sys.executable, "-c", SENDER, ip, str(port), str(nbytes)]))
    for r in receivers:
        assert r.stdout.readline().strip() == "ready"
    for r in receivers:  # every sender is connected: release them at once
        r.stdin.write("go\n")
        r.stdin.flush()
    results = []
    for r in receivers:
        out, _ = r.communicate(timeout=60)
        total, seconds = out.split()
        assert int(total) == nbytes
        results.append(float(seconds))
    for s in senders:
        assert s.wait(10) == 0
    return len(pairs) * nbytes * 8 / max(results) / 1e6


def tbf_bytes(dev: str, netns: str | None = None) -> dict[str, int]:
    """Bytes each tbf on dev has sent, by its handle ("10:", "20:", or "root")."""
    cmd = ["tc", *(["-n", netns] if netns else []), "-s", "qdisc", "show", "dev", dev]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    sent = {}
    for m in re.finditer(r"qdisc tbf (\S+) (parent \S+|root).*?\n\s*Sent (\d+) bytes", out):
        sent[m.group(1)] = int(m.group(3))
    return sent


def test_uplink_is_shared_across_the_spine_and_scaleup_groups_are_faster():
    link, uplink = 80, 40
    # 8 workers on 2 leaves: leaf 0 holds 0, 2, 4, 6 (groups {0, 2}, {4, 6}), leaf 1 holds 1, 3, 5, 7.
    with EmulatedCluster(8, link_mbit=link, leaves=2, uplink_mbit=uplink, scaleup_group_size=2) as c:
        prefix = c.prefix
        up0, down1 = f"{prefix}u0", f"{prefix}s1"  # leaf 0 -> spine, spine -> leaf 1

        # Inside a leaf, outside a group: the link rate, and not a byte over the uplink.
        before = tbf_bytes(up0)["20:"]
        intra = flows(c, [(0, 4)], 8_000_000)
        print(f"intra-leaf 0->4: {intra:.1f} Mbit/s (link {link})")
        assert 0.8 <= intra / link <= 1.1
        assert tbf_bytes(up0)["20:"] - before < 100_000  # ARP and the like at most

        # Two flows from leaf 0 to leaf 1, each from and to its own worker: links would carry
        # 2 x 80, the uplink carries 40 between them.
        before_up, before_down = tbf_bytes(up0)["20:"], tbf_bytes(down1)["20:"]
        cross = flows(c, [(0, 1), (4, 5)], 3_000_000)
        print(f"two cross-leaf flows 0->1, 4->5: {cross:.1f} Mbit/s together (uplink {uplink})")
        # The cap is the claim (unshaped, two flows would carry 2 x 80); below it, TCP over a
        # shared tbf can lose a retransmission timeout or two (CI once measured 22 of 40).
        assert 0.4 <= cross / uplink <= 1.15
        assert tbf_bytes(up0)["20:"] - before_up >= 6_000_000  # both went over the uplink, both ways shaped
        assert tbf_bytes(down1)["20:"] - before_down >= 6_000_000

        # Inside a scale-up group: 4x the link, through the group's class on both veth ends.
        sender_if, receiver_port = f"{prefix}v0", f"{prefix}h2"
        before_fast = tbf_bytes(sender_if, c.nodes[0].netns)["10:"], tbf_bytes(receiver_port)["10:"]
        before_link = tbf_bytes(sender_if, c.nodes[0].netns)["20:"]
        fast = flows(c, [(0, 2)], 24_000_000)
        print(f"scale-up group 0->2: {fast:.1f} Mbit/s (scale-up {c.scaleup_mbit})")
        assert 0.7 <= fast / c.scaleup_mbit <= 1.1
        assert tbf_bytes(sender_if, c.nodes[0].netns)["10:"] - before_fast[0] >= 24_000_000
        assert tbf_bytes(receiver_port)["10:"] - before_fast[1] >= 24_000_000
        assert tbf_bytes(sender_if, c.nodes[0].netns)["20:"] - before_link < 100_000
    assert leftovers(prefix) == []


def test_workers_register_their_leaf_and_scaleup_group(tmp_path, database_url):
    """start_cluster on a 2-leaf emulation: the registry (the admin cluster view) holds each
    worker's leaf and scale-up group as the emulator placed it."""
    spec = ClusterSpec(state_dir=tmp_path, port=free_port(), workers=3, database_url=database_url,
                       admin_key="a", namespace=f"lcls{uuid.uuid4().hex[:6]}")
    with EmulatedCluster(3, leaves=2, scaleup_group_size=2) as emulation:
        prefix = emulation.prefix
        state = start_cluster(spec, emulation=emulation)
        try:
            with httpx.Client(base_url=state.gateway_url, timeout=30) as client:
                for _ in range(300):  # healthy workers may still be registering
                    workers = client.get("/admin/v1/cluster", headers={"Authorization": "Bearer a"}).json()["workers"]
                    if len(workers) == 3:
                        break
                    time.sleep(0.1)
            got = {w["worker_id"]: (w["topology"]["leaf"], w["topology"]["scaleup_group"]) for w in workers}
            assert got == {"worker-0": ("leaf-0", "leaf-0/g0"), "worker-1": ("leaf-1", "leaf-1/g0"),
                           "worker-2": ("leaf-0", "leaf-0/g0")}
        finally:
            stop_processes(state.processes)
    assert leftovers(prefix) == []
