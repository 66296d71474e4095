"""Models of time, each a small component with its closed form in its docstring.

* :class:`Fabric` — links: every worker has one link of ``link_gbps`` each way; workers sit
  under ``leaves`` leaf switches, a leaf's uplink to the spine carries ``uplink_gbps`` in all
  (oversubscribed when under the sum of its workers' links); members of one scale-up group
  talk over its fast path (``scaleup_gbps``).
* :func:`multicast_arrivals` — a multicast plan carried out as the executors do
  (:func:`libs.planning.multicast.node_parts`): each node sends its part's blocks one at a time,
  in order, each as soon as it holds it (one send port); a block costs ``bytes / rate +
  step_overhead_s``; algorithms whose cost model relays chunks (chains:
  ``CHUNK_RELAY``) forward cut-through: a relay starts a block once its first chunk is in, and
  finishes it no earlier than one chunk after its upstream finished it.
  Closed forms (uniform links R, overhead o, M bytes in B blocks): one link M/R + B·o;
  a binomial 1→N schedule of S steps S·(M/B/R + o); a chain of n nodes (M + (n−2)·c)/R +
  (B + n − 2)·o (each hop past the first adds a chunk and one block's overhead).
  Cross-leaf transfers of one step share their leaf's uplink evenly (a step-level fluid
  approximation of the fabric's fair share).
* :class:`Storage` — a load from disk: blocks read one after another (``disk_read_latency_s`` +
  bytes / disk rate each); host → engine memory: ``h2d_latency_s`` + bytes / h2d rate each,
  one at a time in the order the blocks land in host memory.
* :class:`Compute` — prefill seconds against prompt length and decode-iteration seconds against
  batch × mean sequence length, interpolated over the LLM-Mesh profile
  (:meth:`libs.planning.mesh.Profile.prefill_time` / ``decode_time``), plus ``token_overhead_s``
  per row of an iteration (what serving a token costs beyond the engine's step); an execution pipeline of
  S stages adds (S − 1) · ``pipeline_hop_s`` per iteration; instances sharing a device
  time-slice it (each iteration takes as many times longer as instances are busy there).
* :class:`Control` — the control plane: one bus message ``nats_hop_s``, a call (request and
  answer) two, the planner's registry read ``registry_read_s``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from libs.planning.mesh import Profile
from libs.planning.multicast import CHUNK_RELAY, MulticastPlan, multicast_algorithm, node_parts

__all__ = ["Compute", "Control", "Fabric", "Storage", "multicast_arrivals"]

# A profile extrapolated beyond its measured lengths can reach 0 or below (a noisy profile whose
# times fall with length): a step then takes no time and the simulation never advances.
MIN_COMPUTE_S = 1e-6


@dataclass(frozen=True)
class Fabric:
    link_gbps: float
    leaf_of: Mapping[str, str]  # worker -> leaf
    group_of: Mapping[str, str] = None  # worker -> scale-up group ("" or absent: none)
    uplink_gbps: float | None = None  # a leaf's uplink in all (None: not a bottleneck)
    scaleup_gbps: float = 0.0

    def rate_Bps(self, src: str, dst: str, cross_share: int = 1) -> float:
        """Bytes/s of one transfer src→dst while `cross_share` transfers share the uplink it crosses."""
        groups = self.group_of or {}
        g = groups.get(src, "")
        if self.scaleup_gbps > 0 and g and g == groups.get(dst, ""):
            return self.scaleup_gbps * 1e9 / 8
        gbps = self.link_gbps
        if self.uplink_gbps is not None and self.leaf_of.get(src) != self.leaf_of.get(dst):
            gbps = min(gbps, self.uplink_gbps / max(1, cross_share))
        return gbps * 1e9 / 8

    def crosses(self, src: str, dst: str) -> bool:
        return self.uplink_gbps is not None and self.leaf_of.get(src) != self.leaf_of.get(dst)


def multicast_arrivals(plan: MulticastPlan, nodes: Sequence[str], block_bytes: Sequence[int], fabric: Fabric,
                       start: float, *, step_overhead_s: float, chunk_bytes: int) -> dict[str, list[float]]:
    """worker -> when each block is wholly in its host memory (sources: `start`; a block a node
    never receives: absent from its list as inf)."""
    n, nb = len(nodes), len(block_bytes)
    inf = float("inf")
    have = [[start if v < plan.k else inf for _ in range(nb)] for v in range(n)]
    first = [row[:] for row in have]  # first chunk in (cut-through relays start from it)
    relay = multicast_algorithm(plan.algorithm).cost is CHUNK_RELAY
    egress = [start] * n
    parts = node_parts(plan.schedule, n)
    # the fabric's fair share per step: cross-leaf transfers out of / into each leaf
    out_leaf: Counter = Counter()
    in_leaf: Counter = Counter()
    for t in plan.schedule:
        s, d = nodes[t.src], nodes[t.dst]
        if fabric.crosses(s, d):
            out_leaf[(t.step, fabric.leaf_of[s])] += 1
            in_leaf[(t.step, fabric.leaf_of[d])] += 1
    order = sorted((t for p in parts for t in p.sends), key=lambda t: (t.step, t.src, t.dst, t.block))
    for t in order:
        s, d = nodes[t.src], nodes[t.dst]
        share = max(out_leaf[(t.step, fabric.leaf_of.get(s))], in_leaf[(t.step, fabric.leaf_of.get(d))], 1)
        rate = fabric.rate_Bps(s, d, share)
        size = block_bytes[t.block]
        ready = first[t.src][t.block] if relay else have[t.src][t.block]
        begin = max(egress[t.src], ready)
        end = begin + size / rate + step_overhead_s
        if relay and t.src >= plan.k:
            end = max(end, have[t.src][t.block] + min(chunk_bytes, size) / rate)
        egress[t.src] = end
        if end < have[t.dst][t.block]:
            have[t.dst][t.block] = end
            first[t.dst][t.block] = begin + min(chunk_bytes, size) / rate + step_overhead_s
    return {nodes[v]: have[v] for v in range(n)}


@dataclass(frozen=True)
class Storage:
    disk_Bps: float
    disk_latency_s: float
    h2d_Bps: float
    h2d_latency_s: float

    def disk_reads(self, block_bytes: Sequence[int], start: float) -> list[float]:
        """When each block is in host memory, read one after another from `start`."""
        out, t = [], start
        for b in block_bytes:
            t += self.disk_latency_s + b / self.disk_Bps
            out.append(t)
        return out

    def to_engine(self, in_host: Sequence[float], block_bytes: Sequence[int], start: float) -> list[float]:
        """When each block is in engine memory: copied one at a time in the order the blocks land in
        host memory (the worker's loader: a multicast brings each receiver its own order)."""
        out = [0.0] * len(in_host)
        t = start
        for i in sorted(range(len(in_host)), key=lambda i: (in_host[i], i)):
            t = max(t, in_host[i]) + self.h2d_latency_s + block_bytes[i] / self.h2d_Bps
            out[i] = t
        return out


@dataclass(frozen=True)
class Compute:
    profile: Profile
    pipeline_hop_s: float = 0.0
    token_overhead_s: float = 0.0  # per row of an iteration (the worker's per-token work)

    def prefill_s(self, prompt_len: int, stages: int = 1, sharing: int = 1) -> float:
        t = max(MIN_COMPUTE_S, self.profile.prefill_time(prompt_len))
        return (t + (stages - 1) * self.pipeline_hop_s) * max(1, sharing)

    def iteration_s(self, batch: int, mean_len: float, stages: int = 1, sharing: int = 1) -> float:
        if batch <= 0:
            return 0.0
        t = max(MIN_COMPUTE_S, self.profile.decode_time(batch, mean_len)) + batch * self.token_overhead_s
        return (t + (stages - 1) * self.pipeline_hop_s) * max(1, sharing)


@dataclass(frozen=True)
class Control:
    nats_hop_s: float
    registry_read_s: float

    @property
    def call_s(self) -> float:
        return 2 * self.nats_hop_s
