"""`layercast bench multicast`: every multicast algorithm on one emulated cluster, against its bounds.

N data-plane nodes (the worker's TransferAgent over TCP, `benchmarks.dataplane_node`)
run each in its own network namespace with a `tc tbf` cap of R on both directions
of its link. For each algorithm the controller sends every node its part of the
schedule over NATS (receivers first, then sources, so the clock starts at the
first byte a source may send) and collects the TransferReports. Per algorithm it
prints the completion time (last block at the last node), per-node completion
times, the universal lower bound M/R, the bound of that schedule's step structure,
and both ratios. Bounds use the payload rate R: framing and TCP/IP overhead count
against the measurement.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
import zlib
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path

from libs.planning.multicast import (
    MULTICAST_ALGORITHMS,
    MulticastPlan,
    build_plan,
    fabric_bound_s,
    multicast_algorithm,
    pipeline_ready_steps,
    plan_bound_s,
    schedule_steps,
    step_bound_s,
)
from libs.cluster.launcher import healthy
from libs.cluster.emulation import EmulatedCluster, EmulationProfile, place_nodes
from libs.planning.chain import CHAIN_ALGORITHMS, Gpu, chain_plan_over_nodes
from benchmarks.harness import sigterm_unwinds

# The default: every registered algorithm; chain-blind is chain itself without a topology to be blind to.
ALGORITHMS = tuple(a for a in MULTICAST_ALGORITHMS if a != "chain-blind")
DATA_PORT = 7700
HEALTH_PORT = 7701


def first_copy_s(plan: MulticastPlan, n_nodes: int, n_blocks: int, arrived: dict[int, dict[int, float]],
                 t0: float) -> tuple[float, int] | None:
    """k > 1: when the first execution pipeline (its algorithm's groups: λScale Alg. 2 for k-way)
    jointly held every block, and at which step; None where the schedule forms no pipelines."""
    algorithm = multicast_algorithm(plan.algorithm)
    if plan.k < 2 or not algorithm.forms_pipelines:
        return None
    pipelines = algorithm.pipeline_groups(n_nodes, plan.k)
    best = None
    for p in pipelines:
        worst = max(min(arrived[v].get(b, float("inf")) for v in p) for b in range(n_blocks))
        best = worst if best is None else min(best, worst)
    steps = min(pipeline_ready_steps(plan.schedule, n_blocks, pipelines)) + 1
    return best - t0, steps


class _Controller:
    """Sends parts over NATS and collects the nodes' TransferReports."""

    def __init__(self, nats_url: str):
        from libs.protocol import messages as m
        from libs.protocol import subjects
        from libs.bus.broker import make_broker, on_event

        self.broker = make_broker(nats_url)
        self.reports: dict[str, dict[str, m.TransferReport]] = {}
        self.arrived = asyncio.Event()

        @self.broker.subscriber(subjects.EVENT_TRANSFER)
        @on_event(m.TransferReport)
        async def report(ev: m.TransferReport) -> None:
            self.reports.setdefault(ev.transfer_id, {})[ev.worker_id] = ev
            self.arrived.set()

    async def run(self, plan: MulticastPlan, names: Sequence[str], addresses: dict[str, str], sizes: Sequence[int],
                  checksums: Sequence[int], chunk_bytes: int, timeout_s: float) -> tuple[float, dict]:
        from libs.protocol import messages as m
        from libs.protocol import subjects
        from libs.bus.broker import call

        from services.common.transfer_parts import transfer_parts

        tid = f"{plan.algorithm}-k{plan.k}-{uuid.uuid4().hex[:8]}"
        blocks = [m.BlockInfo(block_id=b, nbytes=sz, checksum=f"{checksums[b]:08x}", layer_start=b, layer_end=b + 1)
                  for b, sz in enumerate(sizes)]
        parts = transfer_parts(plan, names, addresses, blocks, transfer_id=tid, model="synthetic",
                               chunk_bytes=chunk_bytes, stall_timeout_s=timeout_s)
        involved = list(parts)
        sources = set(names[: plan.k])
        t0 = 0.0
        for name, cmd in parts.items():  # receivers first: the clock starts at the sources
            if name in sources and not t0:
                t0 = time.time()
            ack = await call(self.broker, subjects.worker_command(name), cmd, m.CommandAck, timeout=10.0)
            if not ack.accepted:
                raise RuntimeError(f"{name} refused its part: {ack.detail}")
        deadline = time.monotonic() + timeout_s
        while len(self.reports.get(tid, {})) < len(involved):
            self.arrived.clear()
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{plan.algorithm}: {len(self.reports.get(tid, {}))}/{len(involved)} "
                                   f"reports after {timeout_s}s")
            try:
                await asyncio.wait_for(self.arrived.wait(), left)
            except TimeoutError:
                pass
        reports = self.reports.pop(tid)
        failed = {w: r.error for w, r in reports.items() if not r.ok}
        if failed:
            raise RuntimeError(f"{plan.algorithm} k={plan.k} failed: {failed}")
        return t0, reports


def _wait_health(url: str, proc: subprocess.Popen, log_path: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"data-plane node exited ({proc.returncode}): {log_path.read_text()[-2000:]}")
        if healthy(url):
            return
        time.sleep(0.1)
    raise RuntimeError(f"{url} not healthy within {timeout_s}s: {log_path.read_text()[-2000:]}")


@contextmanager
def data_plane_nodes(n_nodes: int, total_bytes: int, n_blocks: int, seed: int, holders: int,
                     cluster: EmulatedCluster | None = None) -> Iterator[tuple[str, list[str], dict[str, str]]]:
    """Start a NATS server and N data-plane node processes; yield (nats url, node ids, data addresses).

    In an emulated cluster each node runs in its namespace and NATS listens on the bridge;
    without one, everything runs on loopback (no rate cap: for correctness, not timing).
    Nodes 0..holders-1 hold the synthetic model.
    """
    from libs.protocol.subjects import PREFIX  # the nodes' subjects must match the controller's
    from libs.cluster.launcher import ProcessInfo, free_port, start_nats, stop_processes

    state = Path(tempfile.mkdtemp(prefix="layercast-multicast-"))
    (state / "logs").mkdir()
    names = [f"node{i}" for i in range(n_nodes)]
    host_ip = cluster.host_ip if cluster else "127.0.0.1"
    nats_proc, nats_url = start_nats(state, host=host_ip)
    procs: list[tuple[subprocess.Popen, Path]] = []
    try:
        env = {**os.environ, "NATS_URL": nats_url, "LAYERCAST_NAMESPACE": PREFIX, "PYTHONUNBUFFERED": "1",
               "OTEL_SDK_DISABLED": "true"}
        addresses, health = {}, []
        for i in range(n_nodes):
            ip = cluster.nodes[i].ip if cluster else "127.0.0.1"
            data_port, health_port = (DATA_PORT, HEALTH_PORT) if cluster else (free_port(), free_port())
            log_path = state / "logs" / f"{names[i]}.log"
            argv = [sys.executable, "-m", "benchmarks.dataplane_node", "--node-id", names[i],
                    "--listen", f"{ip}:{data_port}", "--size-bytes", str(total_bytes), "--blocks", str(n_blocks),
                    "--seed", str(seed), "--health-host", ip, "--health-port", str(health_port)]
            if i < holders:
                argv.append("--holds")
            kw = dict(env=env, stdout=open(log_path, "ab"), stderr=subprocess.STDOUT, cwd=os.getcwd())
            proc = cluster.popen(i, argv, **kw) if cluster else subprocess.Popen(argv, start_new_session=True, **kw)
            procs.append((proc, log_path))
            addresses[names[i]] = f"{ip}:{data_port}"
            health.append(f"http://{ip}:{health_port}/health")
        for (proc, log_path), url in zip(procs, health):
            _wait_health(url, proc, log_path, 120)
        yield nats_url, names, addresses
    finally:
        for proc, _ in procs:
            if proc.poll() is None:
                proc.terminate()
        for proc, _ in procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        stop_processes([ProcessInfo("nats", nats_proc.pid, None, "")])
        shutil.rmtree(state, ignore_errors=True)


def run_multicast_benchmark(nodes: int = 8, size_mb: float = 256, blocks: int = 16, link_mbit: float = 400,
                            algorithms: Sequence[str] = ALGORITHMS, ks: Sequence[int] = (1, 2, 4),
                            chunk_kib: int = 1024, repeat: int = 1, cpu_quota: float | None = None,
                            mtu: int = 9000, seed: int = 1, timeout_s: float | None = None,
                            emulate: bool = True, leaves: int = 1, uplink_mbit: float | None = None,
                            scaleup_group_size: int = 1) -> dict:
    """Run every (algorithm, k) `repeat` times on one emulated cluster; one JSON-ready dict.

    `emulate=False` runs the same nodes on loopback without rate caps (tests: correctness only).
    leaves / uplink_mbit / scaleup_group_size: the leaf-spine layout (libs/cluster/emulation.py);
    node i sits where worker i would, and the JSON's `topology` lists each node's labels.
    """
    from benchmarks.dataplane_node import synthetic_block, synthetic_block_sizes

    algorithms = [multicast_algorithm(a).name for a in algorithms]  # aliases read as their names
    ks = sorted({k for k in ks if 1 <= k and nodes - k >= k})  # k-way: a target per sub-group at least
    if not ks:
        raise ValueError(f"no usable k: k sources need at least k targets among {nodes} nodes")
    total = int(size_mb * (1 << 20))
    sizes = synthetic_block_sizes(total, blocks)
    checksums = [zlib.crc32(synthetic_block(seed, b, n).numpy()) for b, n in enumerate(sizes)]
    rate = link_mbit * 1e6 / 8
    chunk = chunk_kib << 10
    # Chains are planned over the emulated topology as the planner plans them over the registry's
    # view (chain: leaves and scale-up groups; chain-blind: worker-id order); node i sits where
    # worker i would.
    gpus = [Gpu(p.index, f"node-{p.index}", p.leaf, p.scaleup_group or None, link_mbit / 1000)
            for p in place_nodes(nodes, leaves, scaleup_group_size)]
    plans = [chain_plan_over_nodes(a, gpus, k, blocks) if a in CHAIN_ALGORITHMS else build_plan(a, nodes, blocks, k)
             for a in algorithms for k in (ks if MULTICAST_ALGORITHMS[a].multi_source else [1])]
    # Generous: the slowest schedule (star) at a third of the link rate.
    timeout_s = timeout_s or max(60.0, 3 * max(plan_bound_s(p, blocks, total, rate, chunk) for p in plans))
    with ExitStack() as stack:
        sigterm_unwinds(stack)  # namespaces, tc and cgroups are removed on SIGTERM too
        cluster = stack.enter_context(EmulatedCluster(
            nodes, link_mbit, cpu_quota=cpu_quota, mtu=mtu, leaves=leaves, uplink_mbit=uplink_mbit,
            scaleup_group_size=scaleup_group_size)) if emulate else None
        nats_url, names, addresses = stack.enter_context(
            data_plane_nodes(nodes, total, blocks, seed, max(ks), cluster))
        trials = asyncio.run(_trials(nats_url, plans, names, addresses, sizes, checksums, chunk, repeat,
                                     timeout_s, nodes, blocks))
    # Each plan's bound on this fabric: the spine's uplinks shared by the transfers that cross
    # them at once, a scale-up group's fast path (what chain-blind pays and chain avoids).
    placements = place_nodes(nodes, leaves, scaleup_group_size)
    uplink = uplink_mbit * 1e6 / 8 if emulate and leaves > 1 and uplink_mbit else None
    scaleup = rate * EmulationProfile.scaleup_speedup if emulate and scaleup_group_size > 1 else 0.0
    results = []
    for p in plans:
        runs = trials[(p.algorithm, p.k)]
        med = sorted(runs, key=lambda r: r["completion_s"])[len(runs) // 2]
        bound = plan_bound_s(p, blocks, total, rate, chunk)
        fabric = fabric_bound_s(p, blocks, total, rate, chunk, [x.leaf for x in placements], uplink,
                                [x.scaleup_group or None for x in placements], scaleup)
        entry = {
            "algorithm": p.algorithm, "k": p.k,
            "completion_s": round(med["completion_s"], 4),
            "node_completion_s": med["node_completion_s"],
            "lower_bound_s": round(total / rate, 4),
            "schedule_bound_s": round(bound, 4),
            "ratio_to_schedule_bound": round(med["completion_s"] / bound, 4),
            "ratio_to_lower_bound": round(med["completion_s"] * rate / total, 4),
            "fabric_bound_s": round(fabric, 4),
            "ratio_to_fabric_bound": round(med["completion_s"] / fabric, 4),
            "steps": schedule_steps(p.schedule),
            "completion_s_trials": [round(r["completion_s"], 4) for r in runs],
        }
        if med.get("first_copy_s") is not None:
            entry["first_copy_s"] = round(med["first_copy_s"], 4)
            entry["first_copy_step"] = med["first_copy_step"]
            entry["first_copy_bound_s"] = round(step_bound_s(med["first_copy_step"], blocks, total, rate), 4)
        results.append(entry)
    by = {(r["algorithm"], r["k"]): r["completion_s"] for r in results}
    fabric_by = {(r["algorithm"], r["k"]): r["fabric_bound_s"] for r in results}
    out = {"nodes": nodes, "size_mb": size_mb, "blocks": blocks, "link_mbit": link_mbit, "chunk_kib": chunk_kib,
           "mtu": mtu, "repeat": repeat, "cpu_quota": cpu_quota, "emulated": emulate,
           "leaves": leaves, "uplink_mbit": uplink_mbit, "scaleup_group_size": scaleup_group_size,
           "topology": [{"node": names[p.index], "leaf": p.leaf, "scaleup_group": p.scaleup_group}
                        for p in placements],
           "results": results}
    # Topology-aware chains against blind ones from the same sources (BlitzScale §5.1): measured,
    # and the best the fabric allows (both at their fabric bounds).
    chain_vs_blind = {f"k={k}": {"measured": round(by[("chain", k)] / by[("chain-blind", k)], 4),
                                 "at_fabric_bounds": round(fabric_by[("chain", k)] / fabric_by[("chain-blind", k)], 4)}
                      for (a, k) in by if a == "chain" and ("chain-blind", k) in by}
    if chain_vs_blind:
        out["chain_vs_blind"] = chain_vs_blind
    base = by.get(("binomial", 1))
    if base:
        out["vs_binomial"] = {f"{a}/binomial" if k == 1 else f"{a}(k={k})/binomial": round(t / base, 3)
                              for (a, k), t in by.items() if (a, k) != ("binomial", 1)}
    return out


async def _trials(nats_url, plans, names, addresses, sizes, checksums, chunk, repeat, timeout_s, nodes,
                  blocks) -> dict:
    from libs.bus.broker import start_broker

    ctl = _Controller(nats_url)
    await start_broker(ctl.broker)
    trials: dict[tuple[str, int], list[dict]] = {(p.algorithm, p.k): [] for p in plans}
    try:
        for _ in range(repeat):
            for p in plans:  # interleaved: drift on the shared machine spreads over every algorithm alike
                t0, reports = await ctl.run(p, names, addresses, sizes, checksums, chunk, timeout_s)
                arrived = {i: {b: t for b, t in reports[names[i]].block_arrived_at.items()} if names[i] in reports
                           else {} for i in range(nodes)}
                targets = sorted({t.dst for t in p.schedule})
                node_done = [max(arrived[v].values()) - t0 for v in targets]
                trial = {"completion_s": max(node_done), "node_completion_s": [round(x, 4) for x in node_done]}
                fc = first_copy_s(p, nodes, blocks, arrived, t0)
                if fc is not None:
                    trial["first_copy_s"], trial["first_copy_step"] = fc
                trials[(p.algorithm, p.k)].append(trial)
    finally:
        await ctl.broker.stop()
    return trials

