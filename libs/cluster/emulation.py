"""Emulate a small cluster on one Linux machine: one network namespace per node,
all joined by a Linux bridge, each node's link rate-capped with tc (both
directions) and, optionally, its CPU capped with a cgroup v1 quota and its disk
reads with a cgroup v1 blkio throttle.

    with EmulatedCluster(3, link_mbit=100, cpu_quota=0.5) as cluster:
        proc = cluster.popen(0, [sys.executable, "-m", "worker", "--bind", cluster.nodes[0].ip])

    # The papers' ratios (network ~10x disk): see EmulationProfile.
    with EmulatedCluster.from_profile(3, DEFAULT_PROFILE, disk_path=state_dir) as cluster: ...

Layout for prefix P (every name starts with P so `cleanup_stale(P)` finds it):

    root netns:  bridge Pbr (host_ip)  <- Ph<i> (veth, tbf = node i's download)
    netns Pn<i>: lo, Pv<i> (veth peer, node ip, tbf = node i's upload)
    cgroup:      /sys/fs/cgroup/cpu/Pn<i> (only with cpu_quota)
    cgroup:      /sys/fs/cgroup/blkio/Pn<i> (only with disk_read_mbit)

Leaf-spine (leaves L >= 2; `place_nodes`): Pbr is the spine and holds the host
address; worker i's Ph<i> joins leaf bridge Pl<i % L> instead, and each leaf
reaches the spine through a veth pair Pu<l> (on the leaf) / Ps<l> (on the spine),
tbf-capped at uplink_mbit in each direction for traffic between workers (traffic
to and from the host, i.e. NATS, the gateway and health checks, is not: as if the
host sat on every leaf). Scale-up groups (scaleup_group_size G >= 2): G
consecutive workers of one leaf; each worker's two veth ends carry an htb qdisc
whose u32 filters send traffic between group members to a tbf at
scaleup_speedup x the link rate, all else to the link's tbf (`link_shaping_cmds`).

Disk caps throttle reads from the whole disk holding `disk_path`; they only see
I/O that reaches the disk, so page-cache hits are not slowed (the checkpoint
loader reads with O_DIRECT). The host->device rate is not applied here: it is
recorded in `profile` for the launcher to hand to workers, which pace the copy
in software (libs/checkpoint/pacing.py).

Needs root, iproute2 (`ip`, `tc`) and, for CPU and disk caps, cgroup v1's cpu
and blkio controllers.
Nothing is routed or NATed out of the subnet: nodes get no default route and
forwarding is left as it is, so emulated traffic can never leave the machine.
"""

from __future__ import annotations

import atexit
import hashlib
import ipaddress
import logging
import os
import re
import shlex
import shutil
import signal
import subprocess
import time
import uuid
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

CPU_CGROUP_ROOT = Path("/sys/fs/cgroup/cpu")
BLKIO_CGROUP_ROOT = Path("/sys/fs/cgroup/blkio")
CFS_PERIOD_US = 100_000
# Ownership markers /run/layercast-emu-<prefix>.owner ("<pid> <starttime>") so
# cleanup_stale() can tell a crashed run's leftovers from a cluster another live
# process is using right now. /run is a tmpfs: markers do not outlive a reboot.
MARKER_DIR = Path("/run")
MARKER_GLOB = "layercast-emu-*.owner"
IFNAMSIZ = 15  # longest Linux interface name
# tbf parameters (see _tbf_args for the reasoning).
TBF_LATENCY_MS = 50
TBF_BURST_S = 0.004
GSO_MAX_BYTES = 65536 + 256


class EmulationError(RuntimeError):
    """A command failed; the message carries the command line and its stderr."""


def _check_cap(name: str, value: float | None) -> None:
    if value is not None and value <= 0:
        raise ValueError(f"{name} must be > 0 or None")


@dataclass(frozen=True)
class EmulationProfile:
    """Per-worker resources of an emulated cluster; None: not capped.

    The defaults keep the papers' ratios: the network ~10x faster than the
    disks, host->device (PCIe) ~1.25x the network (BlitzScale Table 1,
    lambdaScale Table 1), scaled down so that a laptop's disk and memory are
    faster than every emulated rate.
    """

    link_mbit: float | None = 400            # tc tbf on each worker's veth, both directions
    disk_read_mbit: float | None = 40        # cgroup v1 blkio read throttle on the checkpoint disk
    host_to_device_mbit: float | None = 500  # workers pace host tier -> engine copies in software
    cpu_quota: float | None = None           # CPUs per worker (cgroup v1 cpu quota)
    # Models a worker's host memory keeps (LRU), as lambdaScale 2.3 sizes a node: "up to 3 models".
    # It bounds serverlessllm's host cache; the workers apply it (--host-cache-models).
    host_cache_models: int | None = 3
    # Leaf-spine topology (BlitzScale 5.1's model); the defaults are one flat switch.
    leaves: int = 1                      # workers spread round-robin over this many leaf bridges
    uplink_mbit: float | None = None     # each leaf's uplink to the spine, each direction (needs leaves >= 2)
    scaleup_group_size: int = 1          # G consecutive workers of a leaf share a faster scale-up path
    scaleup_speedup: float = 4.0         # the scale-up path's rate: this x link_mbit

    def __post_init__(self) -> None:
        for name in ("link_mbit", "disk_read_mbit", "host_to_device_mbit", "cpu_quota", "host_cache_models",
                     "uplink_mbit"):
            _check_cap(name, getattr(self, name))
        for name in ("leaves", "scaleup_group_size"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be an integer >= 1")
        if self.scaleup_speedup <= 0:
            raise ValueError("scaleup_speedup must be > 0")
        if self.uplink_mbit is not None and self.leaves < 2:
            raise ValueError("uplink_mbit needs leaves >= 2 (one leaf has no uplink between workers)")

    @property
    def flat(self) -> bool:
        """One switch, no scale-up groups: the profile before leaf-spine existed."""
        return self.leaves == 1 and self.scaleup_group_size == 1

    def with_overrides(self, *, link_mbit: float | None = None, disk_read_mbit: float | None = None,
                       host_to_device_mbit: float | None = None, cpu_quota: float | None = None,
                       host_cache_models: int | None = None, leaves: int | None = None,
                       uplink_mbit: float | None = None, scaleup_group_size: int | None = None) -> EmulationProfile:
        """This profile with the given values replaced: None keeps a value, 0 uncaps it (command-line style);
        leaves and scaleup_group_size are counts (None keeps them, 0 is refused)."""
        given = dict(link_mbit=link_mbit, disk_read_mbit=disk_read_mbit, host_to_device_mbit=host_to_device_mbit,
                     cpu_quota=cpu_quota, host_cache_models=host_cache_models, uplink_mbit=uplink_mbit)
        changes: dict[str, Any] = {k: (v or None) for k, v in given.items() if v is not None}
        changes.update({k: v for k, v in dict(leaves=leaves, scaleup_group_size=scaleup_group_size).items()
                        if v is not None})
        return replace(self, **changes)

    def describe(self) -> str:
        def rate(v: float | None) -> str:
            return f"{v:g} Mbit/s" if v else "uncapped"
        cpu = f"{self.cpu_quota:g} per worker" if self.cpu_quota else "uncapped"
        cache = f"{self.host_cache_models} models" if self.host_cache_models else "bounded by bytes only"
        text = (f"links {rate(self.link_mbit)}, disk reads {rate(self.disk_read_mbit)}, "
                f"host->device {rate(self.host_to_device_mbit)}, CPU {cpu}, host cache {cache}")
        if self.leaves > 1:
            text += f", {self.leaves} leaves with uplinks {rate(self.uplink_mbit)}"
        if self.scaleup_group_size > 1:
            fast = rate(self.link_mbit * self.scaleup_speedup) if self.link_mbit else "uncapped"
            text += f", scale-up groups of {self.scaleup_group_size} at {fast}"
        return text


DEFAULT_PROFILE = EmulationProfile()

# The profile's command-line flags (`up --emulate`, `bench scale`, `bench trace`).
PROFILE_FLAGS = {"link_mbit": "--link-mbit", "disk_read_mbit": "--disk-mbit",
                 "host_to_device_mbit": "--host-to-device-mbit", "cpu_quota": "--cpu-quota",
                 "host_cache_models": "--host-cache-models", "leaves": "--leaves", "uplink_mbit": "--uplink-mbit",
                 "scaleup_group_size": "--scaleup-group-size"}


def requested_profile(emulate: bool, **overrides: float | None) -> EmulationProfile | None:
    """The default profile with a command's overrides (None keeps a value, 0 uncaps it); None
    when not emulating. ValueError: an override without --emulate, or a bad value."""
    if not emulate:
        given = [PROFILE_FLAGS[k] for k, v in overrides.items() if v is not None]
        if given:
            raise ValueError(f"emulation flags only apply with --emulate (given: {', '.join(given)})")
        return None
    return DEFAULT_PROFILE.with_overrides(**overrides)


@dataclass(frozen=True)
class EmulatedNode:
    index: int
    netns: str          # network namespace name
    ip: str             # the node's address on the bridge
    cgroup: str | None  # cgroup v1 cpu group path if a CPU quota is set
    blkio_cgroup: str | None = None  # cgroup v1 blkio group path if disk reads are capped
    leaf_index: int = 0              # which leaf bridge it hangs off (0 in the flat layout)
    leaf: str = "leaf-0"             # the worker's --leaf label
    scaleup_group: str = ""          # the worker's --scaleup-group label ("": a domain of its own)
    scaleup_peers: tuple[int, ...] = ()  # indices of the other members of its scale-up group


@dataclass(frozen=True)
class Placement:
    """Where worker `index` sits in a leaf-spine topology (pure: see place_nodes)."""

    index: int
    leaf_index: int
    group_index: int | None  # its scale-up group within the leaf; None when groups have one member

    @property
    def leaf(self) -> str:
        return f"leaf-{self.leaf_index}"

    @property
    def scaleup_group(self) -> str:
        return "" if self.group_index is None else f"{self.leaf}/g{self.group_index}"


def place_nodes(n_nodes: int, leaves: int = 1, scaleup_group_size: int = 1) -> list[Placement]:
    """Worker i goes to leaf i % L (round-robin, so the first L workers sit on different leaves);
    on its leaf it is the (i // L)-th worker, and G consecutive workers of a leaf form scale-up
    group (i // L) // G. With G = 1 no worker has a group (its own domain, the worker's default)."""
    if n_nodes < 1 or leaves < 1 or scaleup_group_size < 1:
        raise ValueError("n_nodes, leaves and scaleup_group_size must be >= 1")
    return [Placement(i, i % leaves, None if scaleup_group_size == 1 else (i // leaves) // scaleup_group_size)
            for i in range(n_nodes)]


def scaleup_peers(placements: list[Placement], index: int) -> tuple[int, ...]:
    """The other members of worker `index`'s scale-up group (always on its own leaf)."""
    me = placements[index]
    if me.group_index is None:
        return ()
    return tuple(p.index for p in placements
                 if p.index != index and p.leaf_index == me.leaf_index and p.group_index == me.group_index)


def _tc(netns: str | None) -> list[str]:
    return ["tc", *(["-n", netns] if netns else [])]


# The split root: htb (the only classful qdisc many minimal kernels build besides none) with two
# root classes, 1:1 and 1:2, that never borrow from each other; unclassified packets go to 1:2
# (`default 2`), a u32 filter moves a packet to 1:1. The classes themselves run at a rate no
# emulated link reaches, with an explicit burst (tc computes 0 for 64-bit rates), so each
# class's tbf child does the shaping exactly as a lone tbf would; the two paths stay independent.
_CLASS_UNCAPPED = ["rate", "100gbit", "ceil", "100gbit", "burst", "4mb", "cburst", "4mb", "quantum", "131072"]


def _split_cmds(netns: str | None, dev: str, match: str, addresses: list[str], class1: list[str] | None,
                class2: list[str] | None) -> list[list[str]]:
    """An htb root on dev: IPv4 packets whose `match` (src|dst) address is one of `addresses` go to
    class 1:1 (under qdisc `class1`, or htb's default fifo if None), all else to class 1:2
    (under `class2`, likewise)."""
    if match not in ("src", "dst"):
        raise ValueError("match must be 'src' or 'dst'")
    tc = _tc(netns)
    cmds = [[*tc, "qdisc", "add", "dev", dev, "root", "handle", "1:", "htb", "default", "2"]]
    for cls, qdisc in ((1, class1), (2, class2)):
        cmds.append([*tc, "class", "add", "dev", dev, "parent", "1:", "classid", f"1:{cls}", "htb", *_CLASS_UNCAPPED])
        if qdisc is not None:
            cmds.append([*tc, "qdisc", "add", "dev", dev, "parent", f"1:{cls}", "handle", f"{cls}0:", *qdisc])
    for addr in addresses:
        cmds.append([*tc, "filter", "add", "dev", dev, "parent", "1:", "protocol", "ip", "prio", "1", "u32",
                     "match", "ip", match, f"{addr}/32", "flowid", "1:1"])
    return cmds


def link_shaping_cmds(dev: str, netns: str | None, link_mbit: float | None, mtu: int, *, match: str,
                      scaleup_peer_ips: list[str] = (), scaleup_mbit: float | None = None) -> list[list[str]]:
    """tc commands shaping one direction of a worker's link (empty: nothing to shape).

    Without scale-up peers: one tbf at link_mbit, as the flat profile always had. With them:
    traffic whose `match` address (dst on the worker's own end = its upload, src on the
    bridge's end = its download) is a peer's takes a tbf at scaleup_mbit, the rest the link's
    tbf; the two do not share a budget, as NVLink and the NIC are separate wires."""
    if link_mbit is None:
        return []  # the scale-up path is a multiple of an uncapped link: nothing to tell apart
    if not scaleup_peer_ips:
        return [[*_tc(netns), "qdisc", "add", "dev", dev, "root", *_tbf_args(link_mbit, mtu)]]
    if scaleup_mbit is None:
        raise ValueError("scale-up peers need scaleup_mbit")
    return _split_cmds(netns, dev, match, list(scaleup_peer_ips), _tbf_args(scaleup_mbit, mtu),
                       _tbf_args(link_mbit, mtu))


def uplink_shaping_cmds(dev: str, uplink_mbit: float | None, mtu: int, *, host_ip: str,
                        match: str) -> list[list[str]]:
    """tc commands capping one direction of a leaf's uplink (a root-namespace veth) at uplink_mbit,
    except traffic to (match=dst, leaf->spine) or from (match=src, spine->leaf) the host: the
    control plane (NATS, gateway, health checks) is not the data fabric being emulated."""
    if uplink_mbit is None:
        return []
    return _split_cmds(None, dev, match, [host_ip], None, _tbf_args(uplink_mbit, mtu))


def block_device_of(path: str | os.PathLike) -> str:
    """"major:minor" of the whole disk holding `path`: the kernel throttles whole
    disks only, so a partition is mapped to its parent disk."""
    st_dev = os.stat(path).st_dev
    dev = f"{os.major(st_dev)}:{os.minor(st_dev)}"
    sysfs = Path("/sys/dev/block") / dev
    if not sysfs.exists():
        raise EmulationError(f"{path} is on device {dev}, which is no block device (tmpfs, overlayfs, a "
                             "btrfs subvolume, a network filesystem?): disk throttling needs it on a real disk")
    if (sysfs / "partition").exists():
        dev = (sysfs.resolve().parent / "dev").read_text().strip()
    return dev


def _run(cmd: list[str], *, check: bool = True) -> subprocess.CompletedProcess[str]:
    log.debug("run: %s", shlex.join(cmd))
    try:
        return subprocess.run(cmd, check=True, capture_output=True, text=True)
    except subprocess.CalledProcessError as e:
        if not check:
            log.debug("ignored failure (rc=%s) of %s: %s", e.returncode, shlex.join(cmd), e.stderr.strip())
            return subprocess.CompletedProcess(cmd, e.returncode, e.stdout, e.stderr)
        raise EmulationError(f"command failed (rc={e.returncode}): {shlex.join(cmd)}: {e.stderr.strip()}") from None
    except FileNotFoundError as e:
        if not check:
            return subprocess.CompletedProcess(cmd, 127, "", str(e))
        raise EmulationError(f"command not found: {shlex.join(cmd)}: {e}") from None


def _tbf_args(link_mbit: float, mtu: int) -> list[str]:
    """tbf parameters for one direction of a node's link.

    burst: tbf drops any frame larger than the bucket, so it holds at least
    two full frames (MTU 9000 + Ethernet header). TCP over veth hands tbf GSO
    super-packets of up to 64 KiB; tbf splits those in software when they do
    not fit, so the bucket holds one whole. At high rates it holds 4 ms of
    traffic: tokens that would overflow the bucket while the qdisc watchdog
    timer fires late (busy machine) are lost, which would undershoot the rate.
    A full bucket at the start lets one burst through unshaped: ~1% of a
    multi-MB transfer.

    latency (queue limit = rate * 50 ms + burst): on the bridge-side veth the
    packets come from another namespace, so TCP Small Queues no longer hold the
    sender back and overflow is a tail drop. 50 ms is several times the BDP of
    an emulated LAN (sub-ms RTT), enough for TCP to keep the link busy through
    a loss, while bounding queueing delay like a switch buffer would.
    """
    rate_bytes = link_mbit * 1e6 / 8
    burst = int(max(2 * (mtu + 14), GSO_MAX_BYTES, rate_bytes * TBF_BURST_S))
    return ["tbf", "rate", f"{int(link_mbit * 1e6)}bit", "burst", str(burst), "latency", f"{TBF_LATENCY_MS}ms"]


def _used_networks() -> list[ipaddress.IPv4Network]:
    """Destinations of every IPv4 route on the machine (all tables, default excluded)."""
    out = _run(["ip", "-4", "route", "show", "table", "all"]).stdout
    nets = []
    for line in out.splitlines():
        words = line.split()
        if words and words[0] in ("local", "broadcast", "unicast", "anycast", "multicast", "blackhole",
                                   "unreachable", "prohibit", "throw", "nat"):
            words = words[1:]
        if not words or words[0] == "default":
            continue
        try:
            nets.append(ipaddress.ip_network(words[0], strict=False))
        except ValueError:
            continue
    return nets


def _pick_subnet(prefix: str) -> ipaddress.IPv4Network:
    """A free /24 in 10.64.0.0/11 derived from the prefix. That range avoids the
    ranges docker/kubernetes like to use (10.0/16, 10.96/12, 10.244/16)."""
    used = _used_networks()
    h = int(hashlib.sha256(prefix.encode()).hexdigest(), 16)
    count = 32 * 256
    for k in range(count):
        idx = (h + k) % count
        net = ipaddress.ip_network(f"10.{64 + idx // 256}.{idx % 256}.0/24")
        if not any(net.overlaps(u) for u in used):
            return net
    raise EmulationError("no free /24 left in 10.64.0.0/11")


def _proc_starttime(pid: int) -> str | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]  # field 22: start time since boot


def _live_prefixes() -> set[str]:
    """Prefixes of clusters whose owning process still runs."""
    live = set()
    for marker in MARKER_DIR.glob(MARKER_GLOB):
        try:
            pid, start = marker.read_text().split()
        except (OSError, ValueError):
            continue
        if _proc_starttime(int(pid)) == start:
            live.add(_marker_prefix(marker))
    return live


def _marker(prefix: str) -> Path:
    return MARKER_DIR / MARKER_GLOB.replace("*", prefix)


def _marker_prefix(marker: Path) -> str:
    return marker.name.removeprefix("layercast-emu-").removesuffix(".owner")


def _kill_pids(pids: list[int]) -> None:
    for pid in pids:
        if pid == os.getpid():
            continue  # never ourselves, whatever netns/cgroup we sit in
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _netns_pids(netns: str) -> list[int]:
    return [int(p) for p in _run(["ip", "netns", "pids", netns], check=False).stdout.split()]


def _cgroup_pids(path: Path) -> list[int]:
    try:
        return [int(p) for p in (path / "cgroup.procs").read_text().split()]
    except OSError:
        return []


def _remove_cgroup(path: Path) -> bool:
    """Kill whatever still runs in the group, then rmdir it (retrying while the
    killed tasks finish exiting, during which the kernel answers EBUSY)."""
    if not path.exists():
        return False
    _kill_pids(_cgroup_pids(path))
    deadline = time.monotonic() + 3
    while True:
        try:
            path.rmdir()
            log.debug("removed cgroup %s", path)
            return True
        except FileNotFoundError:
            return False
        except OSError as e:
            if time.monotonic() > deadline:
                log.warning("could not remove cgroup %s: %s", path, e)
                return False
            _kill_pids(_cgroup_pids(path))
            time.sleep(0.02)


def _delete_netns(netns: str) -> bool:
    # Processes left in the namespace would keep it (and its veth end) alive.
    _kill_pids(_netns_pids(netns))
    return _run(["ip", "netns", "del", netns], check=False).returncode == 0


class EmulatedCluster:
    def __init__(self, n_nodes: int, link_mbit: float | None = None, *, cpu_quota: float | None = None,
                 disk_read_mbit: float | None = None, disk_path: str | os.PathLike | None = None,
                 host_to_device_mbit: float | None = None, host_cache_models: int | None = None,
                 leaves: int = 1, uplink_mbit: float | None = None, scaleup_group_size: int = 1,
                 scaleup_speedup: float = 4.0,
                 mtu: int = 9000, prefix: str | None = None, subnet: str | None = None) -> None:
        if n_nodes < 1:
            raise ValueError("n_nodes must be >= 1")
        # What is applied (validated there); callers read e.g. profile.host_to_device_mbit.
        self.profile = EmulationProfile(link_mbit=link_mbit, disk_read_mbit=disk_read_mbit,
                                        host_to_device_mbit=host_to_device_mbit, cpu_quota=cpu_quota,
                                        host_cache_models=host_cache_models, leaves=leaves, uplink_mbit=uplink_mbit,
                                        scaleup_group_size=scaleup_group_size, scaleup_speedup=scaleup_speedup)
        if leaves > n_nodes:
            raise ValueError(f"{leaves} leaves for {n_nodes} nodes: a leaf would have no worker")
        if disk_read_mbit is not None and disk_path is None:
            raise ValueError("disk_read_mbit needs disk_path (a path on the disk holding the checkpoints)")
        if not 68 <= mtu <= 65535:
            raise ValueError("mtu must be in 68..65535")
        self.prefix = prefix or "lc" + uuid.uuid4().hex[:4]
        if not re.fullmatch(r"[a-z][a-z0-9]{1,11}", self.prefix):
            raise ValueError(f"prefix {self.prefix!r}: 2-12 lowercase letters/digits, starting with a letter")
        if len(self.prefix) + 1 + len(str(n_nodes - 1)) > IFNAMSIZ:
            raise ValueError(f"prefix {self.prefix!r} too long for {n_nodes} nodes' interface names")
        self.n_nodes = n_nodes
        self.link_mbit = link_mbit
        self.cpu_quota = cpu_quota
        self.disk_read_mbit = disk_read_mbit
        self.disk_path = disk_path
        self.disk_device: str | None = None  # "major:minor", resolved by start()
        self.mtu = mtu
        self.bridge = f"{self.prefix}br"

        net = ipaddress.ip_network(subnet) if subnet else _pick_subnet(self.prefix)
        if not isinstance(net, ipaddress.IPv4Network) or not net.subnet_of(ipaddress.ip_network("10.0.0.0/8")):
            raise ValueError(f"subnet {subnet} must be an IPv4 network inside 10.0.0.0/8")
        if net.num_addresses - 2 < n_nodes + 1:
            raise ValueError(f"subnet {net} has no room for {n_nodes} nodes and the host")
        self.subnet = net
        hosts = net.hosts()
        self.host_ip = str(next(hosts))
        self.leaves = leaves
        self.uplink_mbit = uplink_mbit
        self.scaleup_mbit = link_mbit * scaleup_speedup if link_mbit is not None else None
        # Leaf bridges only in a leaf-spine layout: with one leaf, workers sit on Pbr as they always did.
        self.leaf_bridges = [f"{self.prefix}l{k}" for k in range(leaves)] if leaves > 1 else []
        placements = place_nodes(n_nodes, leaves, scaleup_group_size)
        self.nodes: list[EmulatedNode] = []
        for i, place in enumerate(placements):
            cgroup = str(CPU_CGROUP_ROOT / f"{self.prefix}n{i}") if cpu_quota is not None else None
            blkio = str(BLKIO_CGROUP_ROOT / f"{self.prefix}n{i}") if disk_read_mbit is not None else None
            self.nodes.append(EmulatedNode(i, f"{self.prefix}n{i}", str(next(hosts)), cgroup, blkio,
                                           place.leaf_index, place.leaf, place.scaleup_group,
                                           scaleup_peers(placements, i)))

        # What start() actually created, in order, so close() undoes exactly
        # that (and never something of the same name it did not make).
        self._made: list[tuple[str, str, str | None]] = []
        self._children: list[subprocess.Popen] = []
        self._started = False

    @classmethod
    def from_profile(cls, n_nodes: int, profile: EmulationProfile, disk_path: str | os.PathLike | None = None,
                     **kwargs: Any) -> EmulatedCluster:
        """A cluster applying `profile`; disk_path: where the checkpoints live (with a disk cap)."""
        return cls(n_nodes, profile.link_mbit, cpu_quota=profile.cpu_quota, disk_read_mbit=profile.disk_read_mbit,
                   disk_path=disk_path, host_to_device_mbit=profile.host_to_device_mbit,
                   host_cache_models=profile.host_cache_models, leaves=profile.leaves,
                   uplink_mbit=profile.uplink_mbit, scaleup_group_size=profile.scaleup_group_size,
                   scaleup_speedup=profile.scaleup_speedup, **kwargs)

    def topology(self) -> list[dict[str, Any]]:
        """Per node: its address, leaf and scale-up group labels (what the workers register)."""
        return [{"index": n.index, "ip": n.ip, "leaf": n.leaf, "scaleup_group": n.scaleup_group}
                for n in self.nodes]

    # -- lifecycle ---------------------------------------------------------

    def start(self) -> EmulatedCluster:
        if self._started:
            return self
        self._started = True
        atexit.register(self.close)  # a crashed test run still cleans up
        try:
            self._create()
        except BaseException:
            log.debug("start of %s failed; undoing what was made", self.prefix)
            self.close()
            raise
        log.debug("cluster %s up: %d nodes on %s, %s", self.prefix, self.n_nodes, self.subnet,
                  self.profile.describe())
        return self

    def _create(self) -> None:
        if self.cpu_quota is not None and not (CPU_CGROUP_ROOT / "cpu.cfs_quota_us").exists():
            raise EmulationError(f"cpu_quota needs cgroup v1's cpu controller at {CPU_CGROUP_ROOT}")
        if self.disk_read_mbit is not None:
            if not (BLKIO_CGROUP_ROOT / "blkio.throttle.read_bps_device").exists():
                raise EmulationError(f"disk_read_mbit needs cgroup v1's blkio controller at {BLKIO_CGROUP_ROOT}")
            self.disk_device = block_device_of(self.disk_path)
        if any(self.subnet.overlaps(u) for u in _used_networks()):
            raise EmulationError(f"subnet {self.subnet} overlaps an existing route")

        marker = _marker(self.prefix)
        marker.write_text(f"{os.getpid()} {_proc_starttime(os.getpid())}\n")
        self._made.append(("marker", str(marker), None))

        plen = self.subnet.prefixlen
        _run(["ip", "link", "add", "name", self.bridge, "type", "bridge", "forward_delay", "0"])
        self._made.append(("link", self.bridge, None))
        _run(["ip", "link", "set", self.bridge, "mtu", str(self.mtu)])
        _run(["ip", "addr", "add", f"{self.host_ip}/{plen}", "dev", self.bridge])
        _run(["ip", "link", "set", self.bridge, "up"])

        for k, leaf in enumerate(self.leaf_bridges):
            _run(["ip", "link", "add", "name", leaf, "mtu", str(self.mtu), "type", "bridge", "forward_delay", "0"])
            self._made.append(("link", leaf, None))
            _run(["ip", "link", "set", leaf, "up"])
            # The uplink: Pu<k> on the leaf, its peer Ps<k> on the spine. A tree, so no STP is needed.
            up_if, spine_if = f"{self.prefix}u{k}", f"{self.prefix}s{k}"
            _run(["ip", "link", "add", up_if, "mtu", str(self.mtu), "type", "veth",
                  "peer", "name", spine_if, "mtu", str(self.mtu)])
            self._made.append(("link", up_if, None))
            _run(["ip", "link", "set", up_if, "master", leaf, "up"])
            _run(["ip", "link", "set", spine_if, "master", self.bridge, "up"])
            # Leaf -> spine leaves by Pu<k>'s egress, spine -> leaf by Ps<k>'s.
            self._apply(uplink_shaping_cmds(up_if, self.uplink_mbit, self.mtu, host_ip=self.host_ip, match="dst"),
                        up_if, None)
            self._apply(uplink_shaping_cmds(spine_if, self.uplink_mbit, self.mtu, host_ip=self.host_ip,
                                            match="src"), spine_if, None)

        for node in self.nodes:
            host_if, node_if = f"{self.prefix}h{node.index}", f"{self.prefix}v{node.index}"
            _run(["ip", "netns", "add", node.netns])
            self._made.append(("netns", node.netns, None))
            _run(["ip", "-n", node.netns, "link", "set", "lo", "up"])
            # Datacenter tuning: a connection idle for a step of a multicast schedule keeps its
            # congestion window (Linux otherwise restarts slow start after an RTO of idleness).
            _run(["ip", "netns", "exec", node.netns, "sysctl", "-qw", "net.ipv4.tcp_slow_start_after_idle=0"])
            # The peer is created straight inside the netns: no moment where a
            # half-configured interface sits in the root namespace.
            _run(["ip", "link", "add", host_if, "mtu", str(self.mtu), "type", "veth",
                  "peer", "name", node_if, "mtu", str(self.mtu), "netns", node.netns])
            self._made.append(("link", host_if, None))
            port_of = self.leaf_bridges[node.leaf_index] if self.leaf_bridges else self.bridge
            _run(["ip", "link", "set", host_if, "master", port_of, "up"])
            _run(["ip", "-n", node.netns, "addr", "add", f"{node.ip}/{plen}", "dev", node_if])
            _run(["ip", "-n", node.netns, "link", "set", node_if, "up"])
            # Upload: egress of the node's own end. Download: egress of the
            # bridge port towards the node (where the bridge delivers to it).
            peer_ips = [self.nodes[j].ip for j in node.scaleup_peers]
            self._apply(link_shaping_cmds(node_if, node.netns, self.link_mbit, self.mtu, match="dst",
                                          scaleup_peer_ips=peer_ips, scaleup_mbit=self.scaleup_mbit),
                        node_if, node.netns)
            self._apply(link_shaping_cmds(host_if, None, self.link_mbit, self.mtu, match="src",
                                          scaleup_peer_ips=peer_ips, scaleup_mbit=self.scaleup_mbit),
                        host_if, None)
            if node.cgroup is not None:
                cg = Path(node.cgroup)
                cg.mkdir()
                self._made.append(("cgroup", node.cgroup, None))
                (cg / "cpu.cfs_period_us").write_text(str(CFS_PERIOD_US))
                # The kernel refuses quotas under 1 ms.
                (cg / "cpu.cfs_quota_us").write_text(str(max(1000, round(self.cpu_quota * CFS_PERIOD_US))))
            if node.blkio_cgroup is not None:
                cg = Path(node.blkio_cgroup)
                cg.mkdir()
                self._made.append(("cgroup", node.blkio_cgroup, None))
                bytes_per_s = int(self.disk_read_mbit * 1e6 / 8)
                (cg / "blkio.throttle.read_bps_device").write_text(f"{self.disk_device} {bytes_per_s}")
        # The bridge keeps the MTU we set even as ports join (kernel >= 4.17);
        # re-set it in case an older kernel lowered it to a port's.
        for bridge in (self.bridge, *self.leaf_bridges):
            _run(["ip", "link", "set", bridge, "mtu", str(self.mtu)])

    def _apply(self, cmds: list[list[str]], dev: str, netns: str | None) -> None:
        """Run one device's tc commands; once its root qdisc exists, close() deletes it (and with it
        its classes, child qdiscs and filters)."""
        for j, cmd in enumerate(cmds):
            _run(cmd)
            if j == 0:
                self._made.append(("qdisc", dev, netns))

    def close(self) -> None:
        """Undo start(). Safe to call twice, after a failed start, or when things
        already vanished; problems are logged, never raised."""
        if not self._started:
            return
        self._started = False
        atexit.unregister(self.close)
        self._stop_children()
        while self._made:
            kind, name, netns = self._made.pop()
            try:
                if kind == "qdisc":
                    _run(["tc", *(["-n", netns] if netns else []), "qdisc", "del", "dev", name, "root"], check=False)
                elif kind == "link":
                    _run(["ip", "link", "del", name], check=False)  # a veth takes its peer along
                elif kind == "netns":
                    _delete_netns(name)
                elif kind == "cgroup":
                    _remove_cgroup(Path(name))
                elif kind == "marker":
                    Path(name).unlink(missing_ok=True)
            except Exception:  # noqa: BLE001 - keep undoing the rest
                log.warning("cleanup of %s %s failed", kind, name, exc_info=True)
        log.debug("cluster %s closed", self.prefix)

    def _stop_children(self) -> None:
        """SIGTERM each child's process group, SIGKILL what is left after 2 s."""
        live = [p for p in self._children if p.poll() is None]
        for sig, grace in ((signal.SIGTERM, 2.0), (signal.SIGKILL, 2.0)):
            for p in live:
                try:
                    os.killpg(p.pid, sig)
                except (ProcessLookupError, PermissionError):
                    pass
            deadline = time.monotonic() + grace
            for p in live:
                try:
                    p.wait(max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass
            live = [p for p in live if p.poll() is None]
            if not live:
                break
        for p in live:
            log.warning("child %d survived SIGKILL", p.pid)
        self._children.clear()

    def __enter__(self) -> EmulatedCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- running things in nodes -------------------------------------------

    def popen(self, index: int, argv: list[str], **popen_kwargs: Any) -> subprocess.Popen:
        """Start argv inside node `index`: its netns and, with caps, its cgroups.

        The shell joins the cgroups and then execs, so the caps apply from the
        first instruction of `ip netns exec` and argv. The cgroups are joined
        before `ip netns exec` because that remounts /sys, hiding
        /sys/fs/cgroup from the command it runs. The child leads a new process
        group, which close() kills.
        """
        if not self._started:
            raise EmulationError("cluster not started")
        node = self.nodes[index]
        cmd = ["ip", "netns", "exec", node.netns, *argv]
        procs = [str(Path(cg) / "cgroup.procs") for cg in (node.cgroup, node.blkio_cgroup) if cg is not None]
        if procs:
            join = " && ".join(f'echo $$ > "${k}"' for k in range(1, len(procs) + 1))
            cmd = ["sh", "-c", f'{join} && shift {len(procs)} && exec "$@"', "sh", *procs, *cmd]
        popen_kwargs.setdefault("start_new_session", True)
        log.debug("node %d: %s", index, shlex.join(argv))
        proc = subprocess.Popen(cmd, **popen_kwargs)
        self._children.append(proc)
        return proc


def cleanup_stale(prefix: str = "lc") -> list[str]:
    """Remove network namespaces, root-namespace links and cpu/blkio cgroups whose
    names start with `prefix`, left behind by runs that crashed. Clusters whose
    owning process is still alive are left alone. Returns what was removed."""
    if len(prefix) < 2:
        raise ValueError("prefix too short to be safe")
    live = _live_prefixes()

    def stale(name: str) -> bool:
        return name.startswith(prefix) and not any(name.startswith(p) for p in live)

    removed: list[str] = []
    for line in _run(["ip", "netns", "list"], check=False).stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        if stale(name) and _delete_netns(name):
            removed.append(f"netns {name}")
    for line in _run(["ip", "-o", "link", "show"], check=False).stdout.splitlines():
        # "7: lc12h0@if6: <...>" -> lc12h0
        parts = line.split(":", 2)
        name = parts[1].strip().split("@")[0] if len(parts) > 2 else ""
        if stale(name) and _run(["ip", "link", "del", name], check=False).returncode == 0:
            removed.append(f"link {name}")
    for root in (CPU_CGROUP_ROOT, BLKIO_CGROUP_ROOT):
        if root.is_dir():
            for path in sorted(root.iterdir()):
                if path.is_dir() and stale(path.name) and _remove_cgroup(path):
                    removed.append(f"cgroup {path}")
    for marker in MARKER_DIR.glob(MARKER_GLOB):
        if stale(_marker_prefix(marker)):
            marker.unlink(missing_ok=True)
    for what in removed:
        log.debug("removed stale %s", what)
    return removed


def can_emulate() -> tuple[bool, str]:
    """Whether this machine can run an EmulatedCluster, and if not, why."""
    if os.geteuid() != 0:
        return False, "needs root (network namespaces, tc)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return False, f"`{tool}` (iproute2) not found"
    # Try every kernel feature used, inside a throwaway namespace so nothing
    # appears in the root namespace; its name avoids the "lc" prefix.
    probe = f"layercast-probe-{uuid.uuid4().hex[:8]}"
    try:
        _run(["ip", "netns", "add", probe])
    except EmulationError as e:
        return False, f"cannot create a network namespace: {e}"
    try:
        for cmd in (["ip", "-n", probe, "link", "add", "b0", "type", "bridge"],
                    ["ip", "-n", probe, "link", "add", "v0", "type", "veth", "peer", "name", "v1"],
                    ["ip", "-n", probe, "link", "set", "v0", "master", "b0"],
                    ["tc", "-n", probe, "qdisc", "add", "dev", "v0", "root", *_tbf_args(100, 9000)],
                    # Scale-up groups and leaf uplinks: htb + u32 (see _split_cmds).
                    *_split_cmds(probe, "v1", "dst", ["10.0.0.1"], _tbf_args(100, 9000), None)):
            _run(cmd)
    except EmulationError as e:
        return False, f"missing kernel support: {e}"
    finally:
        _delete_netns(probe)
    if not (BLKIO_CGROUP_ROOT / "blkio.throttle.read_bps_device").exists():
        # Not fatal: everything but disk caps works.
        return True, f"ok (no cgroup v1 blkio controller at {BLKIO_CGROUP_ROOT}: disk reads cannot be capped)"
    return True, "ok"
