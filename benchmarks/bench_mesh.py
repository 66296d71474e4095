"""`layercast bench mesh`: K models on W workers, sharing=exclusive, sharing=mesh (LLM-Mesh,
issue 23) and sharing=dedicated (one model per worker at a time: the paper's baseline, issue 41),
on the same multi-model workload with the same seed.

1. K demo models (`create_demo_checkpoint`, seed i, presets alternating tiny / small so sizes
   differ), each made a benchmark model (`bench_trace.make_bench_model`: no end-of-sequence
   token, every token with visible text, so each request runs to its max_tokens and streams a
   chunk per token), 2 blocks each, built once under the state dir.
2. The workload (benchmarks/mesh_workload.py): the Azure LLM trace, time-compressed to the
   replay's duration, thinned to a mean rate, its requests mapped onto the K models by a
   seeded Zipf draw (no public multi-model LLM trace exists; see that module). The rate is the
   offered load (`load`, default 1) times the capacity measured at the start of the run
   (:func:`measure_capacity`: what W workers complete per second at a full batch of the
   workload's mean request, on its mix of models), unless a fixed `target_rps` is given.
3. Per trial and setting: a fresh cluster (own NATS, own SQLite registry), W worker
   processes started with LAYERCAST_SHARING=<setting>, the K models deployed with the same
   fields (min 1 instance each so every model is warm at the start, at most W, the SLOs), and
   in mesh mode the replay waits until every model's profile is in the registry (a worker
   profiles a model on its engine thread when first loaded; the replay should not pay it).
   Dedicated: a worker holds one model, so the models are deployed with min 0 instances
   (pinning K > W models would have them take the workers from each other without end) and
   the W most requested are warmed by one request each before the replay; the others start
   cold, as ServerlessLLM's would.
   Then every request is sent at its time through the gateway (`/v1/completions`, streaming,
   prompt as token ids), no concurrency bound.
4. Per worker caps. Always, in process: one torch thread, `--engine-capacity-gb` and
   `--host-capacity-gb` (what the planner places there), `--kv-cache-gb` per instance. Where
   the machine permits (root and cgroup v1's cpu / memory controllers), each worker process is
   also moved into its own cgroup with a CPU quota (cpu.cfs_quota_us) and a memory cap
   (memory.limit_in_bytes; charges made before the move stay outside on kernels without
   move_charge_at_immigrate, i.e. the interpreter and torch, not the models and KV caches loaded
   later): the kernel then enforces them, and a worker
   going over its cap is OOM-killed and counted (memory.oom_control's oom_kill). Where it does
   not, `caps` in the report says so and only the in-process caps apply.

Metrics per setting: requests, SLO-compliant requests (the paper's: token i from 0 arrives
within TTFT_SLO + i * TPOT_SLO of sending, eq. 1's headroom never negative; TTFT_SLO is the
deployment's, or max(2, L/512) s when unset; a failed request never complies), the same counted
the stricter way (TTFT <= TTFT_SLO and mean TPOT <= TPOT_SLO: `slo_compliant_mean_tpot`), why
the others missed (`slo_misses`), TTFT and TPOT p50/p99 (successful requests), models served (models with at least one
successful request), instance-seconds (InstanceEvents, replay window), lost requests (no
complete answer: error, refusal, timeout) with their reasons, OOMs (cgroup OOM kills plus
worker logs naming MemoryError / OutOfMemoryError), and preemptions, KV resizes and
reservation-station waits from the workers' /metrics when a worker exports them; a metric no
worker exports is reported as 0 and listed in `unavailable` (never estimated).
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import sys
import time
import uuid
from collections import Counter
from collections.abc import Callable, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterator

import httpx

from benchmarks.bench_trace import (
    BENCH_MODEL_MARKER,
    Outcome,
    Send,
    make_bench_model,
    model_limits,
    prompt_ids,
    send_all,
)
from benchmarks.harness import ADMIN_KEY, API_KEY, EventRecorder, namespaced, service_env, sigterm_unwinds
from benchmarks.mesh_workload import MeshRequest, MeshWorkloadSpec, load_workload
from benchmarks.trace_replay import attains_slo, instance_seconds, percentiles
from libs.cluster.launcher import (
    ClusterError,
    ClusterSpec,
    ClusterState,
    free_port,
    process_alive,
    start_cluster,
    stop_processes,
)
from libs.planning.mesh import DEFAULT_TPOT_SLO_S, default_ttft_slo
from libs.planning.sharing import SHARINGS, sharing_setting
from libs.protocol import subjects

SETTINGS = tuple(SHARINGS)  # compared by default: every sharing setting
PRESETS = ("tiny", "small")
CGROUP_ROOT = Path("/sys/fs/cgroup")
# Worker metrics that count LLM-Mesh's memory operations, when a worker exports them (summed over
# their labels and over workers). Absent: the report says `unavailable`, the value is 0.
WORKER_COUNTERS = {
    "preemptions": ("layercast_worker_mesh_preemptions_total",),
    "kv_resizes": ("layercast_worker_mesh_kv_resizes_total",),
    "reservation_waits": ("layercast_worker_mesh_memory_waits_total",),
    "dedicated_unloads": ("layercast_worker_dedicated_unloads_total",),
}
OOM_LOG = re.compile(r"MemoryError|OutOfMemoryError|out of memory", re.IGNORECASE)

_T0 = time.monotonic()


def _log(msg: str) -> None:
    print(f"[bench mesh +{time.monotonic() - _T0:.1f}s] {msg}", file=sys.stderr, flush=True)


@dataclass
class MeshBenchConfig:
    models: int = 4
    workers: int = 2
    trials: int = 1
    duration_s: float = 30.0
    trace: str = "code"  # conv | code | a CSV path
    # The offered load: `load` x the capacity measured at the start of the run (measure_capacity),
    # or a fixed rate where target_rps is given (its multiple of the capacity is reported too).
    load: float = 1.0
    target_rps: float | None = None
    seed: int = 0
    zipf_s: float = 1.0
    max_prompt_tokens: int = 128
    max_output_tokens: int = 16
    ttft_slo_s: float | None = None  # None: the paper's max(2, L/512) s per request
    tpot_slo_s: float = DEFAULT_TPOT_SLO_S
    keep_alive_s: float = 10.0
    cpu_quota: float | None = None  # CPUs per worker (cgroup); None: cpus / workers; 0: no cgroup quota
    memory_gb: float = 2.0  # per worker: cgroup memory cap (0: none) and the in-process capacities
    kv_cache_gb: float = 0.25  # per instance (exclusive: pre-allocated)
    request_timeout_s: float = 60.0
    settings: tuple[str, ...] = SETTINGS
    torch_threads: int = 1


# --- the models ---------------------------------------------------------------------------------


def mesh_models(state_dir: Path, k: int) -> list[Path]:
    """K benchmark checkpoints (built once): model i has seed i and preset PRESETS[i % 2]."""
    from libs.checkpoint import convert_checkpoint, create_demo_checkpoint, is_block_checkpoint

    root = state_dir.resolve() / "models"
    out = []
    for i in range(k):
        preset = PRESETS[i % len(PRESETS)]
        hf, blocks = root / f"mesh-{i}-{preset}-hf", root / f"mesh-{i}-{preset}-2b"
        if not (is_block_checkpoint(blocks) and (blocks / BENCH_MODEL_MARKER).exists()):
            if not (hf / BENCH_MODEL_MARKER).exists():
                shutil.rmtree(hf, ignore_errors=True)
                create_demo_checkpoint(hf, preset=preset, arch="llama", seed=i)
                make_bench_model(hf)
            shutil.rmtree(blocks, ignore_errors=True)
            convert_checkpoint(hf, blocks, 2)
            shutil.copy(hf / BENCH_MODEL_MARKER, blocks / BENCH_MODEL_MARKER)
        out.append(blocks)
    return out


def model_name(i: int) -> str:
    return f"m{i}"


# --- per-worker caps (cgroup v1 where permitted) -----------------------------------------------


class WorkerCaps:
    """Moves worker processes into their own cgroups (cpu quota, memory cap); removes them on close."""

    def __init__(self, cpu_quota: float | None, memory_bytes: int | None):
        self.cpu_quota, self.memory_bytes = cpu_quota, memory_bytes
        self.prefix = f"layercast-mesh-{uuid.uuid4().hex[:6]}"
        self.groups: list[Path] = []
        self.memory_groups: dict[str, Path] = {}
        self.applied: dict[str, str] = {}
        self.unavailable: dict[str, str] = {}

    def _group(self, controller: str, name: str) -> Path:
        path = CGROUP_ROOT / controller / f"{self.prefix}-{name}"
        path.mkdir()
        self.groups.append(path)
        return path

    def apply(self, name: str, pid: int) -> None:
        if self.cpu_quota and "cpu" not in self.unavailable:
            try:
                g = self._group("cpu", name)
                (g / "cpu.cfs_period_us").write_text("100000")
                (g / "cpu.cfs_quota_us").write_text(str(max(1000, round(self.cpu_quota * 100000))))
                (g / "cgroup.procs").write_text(str(pid))
                self.applied["cpu"] = f"cgroup v1 cpu.cfs_quota_us: {self.cpu_quota:g} CPU per worker"
            except OSError as e:
                self.unavailable["cpu"] = f"no cgroup v1 cpu quota here ({e}): in-process caps only"
        if self.memory_bytes and "memory" not in self.unavailable:
            try:
                g = self._group("memory", name)
                try:  # gone from recent kernels: then only what it allocates from now on is charged
                    (g / "memory.move_charge_at_immigrate").write_text("3")
                    moved = "charges moved along"
                except OSError:
                    moved = "memory allocated before the move (interpreter, torch) not charged"
                (g / "memory.limit_in_bytes").write_text(str(self.memory_bytes))
                (g / "cgroup.procs").write_text(str(pid))
                self.memory_groups[name] = g
                self.applied["memory"] = (f"cgroup v1 memory.limit_in_bytes: {self.memory_bytes / (1 << 30):g} GiB "
                                          f"per worker, set right after start ({moved}; OOM kills counted)")
            except OSError as e:
                self.unavailable["memory"] = f"no cgroup v1 memory cap here ({e}): in-process caps only"

    def oom_kills(self) -> int | None:
        """OOM kills inside the memory cgroups (None: no memory cgroup in use)."""
        if not self.memory_groups:
            return None
        n = 0
        for g in self.memory_groups.values():
            try:
                for line in (g / "memory.oom_control").read_text().splitlines():
                    key, _, value = line.partition(" ")
                    if key == "oom_kill":
                        n += int(value)
            except (OSError, ValueError):
                pass
        return n

    def peak_bytes(self) -> dict[str, int]:
        out = {}
        for name, g in self.memory_groups.items():
            try:
                out[name] = int((g / "memory.max_usage_in_bytes").read_text())
            except (OSError, ValueError):
                pass
        return out

    def close(self) -> None:
        for g in reversed(self.groups):
            for _ in range(50):  # the processes stopped just now: the group empties as they are reaped
                try:
                    g.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.1)


# --- the cluster --------------------------------------------------------------------------------


@dataclass
class MeshCluster:
    sharing: str
    state: ClusterState
    recorder: EventRecorder
    caps: WorkerCaps
    models: dict[str, Path]

    def workers(self):
        return [p for p in self.state.processes if p.name.startswith("worker")]


# --- the capacity the offered load is stated against ---------------------------------------------


def worker_rate(per_request_s: dict[str, float], shares: dict[str, float]) -> float:
    """Requests per second one worker completes on a mix of models: the inverse of the mean time
    a request takes at a full batch (per_request_s: model -> seconds per request; shares: model
    -> its fraction of the requests)."""
    total = sum(shares.values())
    mean_s = sum(per_request_s[name] * share for name, share in shares.items()) / total
    return 1.0 / mean_s


def capacity_rps(per_request_s: dict[str, float], shares: dict[str, float], workers: int,
                 cpu_per_worker: float | None) -> float:
    """What W workers complete per second: W x one worker's rate, scaled down to a CPU quota
    below one CPU (the probe ran on one whole CPU thread)."""
    scale = min(1.0, cpu_per_worker) if cpu_per_worker else 1.0
    return workers * scale * worker_rate(per_request_s, shares)


def probe_seconds_per_request(path: Path, prompt_tokens: int, output_tokens: int, batch: int, kv_cache_bytes: int,
                              limits: tuple[int, set[int]], repeats: int = 2) -> float:
    """Seconds per request of one model at a full batch: one engine in this process (one torch
    thread, the workers' batch and KV), `batch` requests of the given size run to completion (the
    benchmark models have no end token); the fastest of `repeats` (the first pays warm-up)."""
    import torch

    from libs.engine import Engine, SamplingSpec

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        engine = Engine.from_checkpoint(path, max_batch_size=batch, max_seq_len=prompt_tokens + output_tokens + 8,
                                        kv_cache_bytes=kv_cache_bytes)
        best = float("inf")
        for rep in range(repeats):
            for i in range(batch):
                engine.add_request(f"probe-{rep}-{i}", prompt_ids(prompt_tokens, 7919 * rep + i, *limits),
                                   SamplingSpec(temperature=0, max_tokens=output_tokens))
            t0 = time.perf_counter()
            while engine.has_work():
                engine.step()
            best = min(best, (time.perf_counter() - t0) / batch)
        return best
    finally:
        torch.set_num_threads(threads)


def measure_capacity(models: dict[str, Path], requests: Sequence[MeshRequest], cfg: MeshBenchConfig,
                     limits: dict[str, tuple[int, set[int]]], log: Callable[[str], None] = _log) -> dict:
    """The cluster's capacity in requests per second for this workload, measured now: per preset,
    the first model of it is probed (probe_seconds_per_request) at the workload's mean prompt
    and output lengths; each model takes its preset's time, weighted by its share of the
    requests; W workers at their CPU quota."""
    from services.worker.service import WorkerConfig

    prompt = max(1, round(sum(r.prompt_tokens for r in requests) / len(requests)))
    output = max(2, round(sum(r.output_tokens for r in requests) / len(requests)))
    batch = WorkerConfig.max_batch_size
    by_preset: dict[str, float] = {}
    per_request: dict[str, float] = {}
    for i, (name, path) in enumerate(models.items()):
        preset = PRESETS[i % len(PRESETS)]
        if preset not in by_preset:
            by_preset[preset] = probe_seconds_per_request(path, prompt, output, batch,
                                                          int(cfg.kv_cache_gb * (1 << 30)), limits[name])
        per_request[name] = by_preset[preset]
    shares = Counter(model_name(r.model) for r in requests)
    cpu = _cpu_quota(cfg)
    rate = capacity_rps(per_request, dict(shares), cfg.workers, cpu)
    log(f"capacity: {rate:.3f} req/s on {cfg.workers} workers ({cpu or 'uncapped'} CPU each; per request at a "
        f"batch of {batch}: " + ", ".join(f"{p} {s * 1000:.1f} ms" for p, s in by_preset.items()) +
        f"; mean request {prompt} + {output} tokens)")
    return {"capacity_rps": round(rate, 4), "seconds_per_request": {p: round(s, 6) for p, s in by_preset.items()},
            "batch": batch, "mean_prompt_tokens": prompt, "mean_output_tokens": output,
            "cpu_per_worker": cpu,
            "how": ("measured at the start of the run: per preset, one engine in the benchmark's process (one torch "
                    "thread) runs a full batch of the workload's mean request; a worker's rate is the inverse of "
                    "the request-weighted mean time per request; x workers x min(1, CPU quota)")}


def _cpu_quota(cfg: MeshBenchConfig) -> float | None:
    """CPUs per worker: as configured, else the machine's CPUs shared by the workers (0: uncapped)."""
    quota = cfg.cpu_quota if cfg.cpu_quota is not None else (os.cpu_count() or 1) / cfg.workers
    return quota or None


def profile_stored(nats_url: str, namespace: str, model: str) -> bool:
    """Whether the registry has `model`'s CPU profile (a mesh worker measured it)."""
    from libs.bus.broker import RemoteError, call, make_broker, start_broker
    from libs.protocol import messages as m

    async def get() -> bool:
        broker = make_broker(nats_url)
        await start_broker(broker)
        try:
            await call(broker, namespaced(subjects.REGISTRY_PROFILE_GET, namespace),
                       m.ProfileRef(model=model, device="cpu"), m.ModelProfile, timeout=2.0)
            return True
        except (TimeoutError, RemoteError):
            return False
        finally:
            await broker.stop()
    return asyncio.run(get())


def _wait(predicate: Callable[[], object], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if predicate():
                return
        except (httpx.HTTPError, OSError):
            pass
        time.sleep(0.3)
    raise ClusterError(f"timed out after {timeout_s:g}s waiting for {what}")


def _warm(state: ClusterState, name: str, context: int) -> None:
    """One 2-token request for `name` (sharing=dedicated: it scales from zero onto an idle worker)."""
    r = httpx.post(f"{state.gateway_url}/v1/completions", timeout=240,
                   headers={"Authorization": f"Bearer {state.api_key}"},
                   json={"model": name, "prompt": [11, 12, 13], "max_tokens": 2})
    if r.status_code != 200:
        raise ClusterError(f"warming {name} failed: {r.status_code} {r.text[:300]}")


@contextmanager
def mesh_cluster(sharing: str, models: dict[str, Path], cfg: MeshBenchConfig, state_dir: Path,
                 context: int, log: Callable[[str], None] = _log,
                 warm_first: Sequence[str] = ()) -> Iterator[MeshCluster]:
    from libs.admin import deploy_model

    state_dir = Path(state_dir).resolve()
    state_dir.mkdir(parents=True, exist_ok=True)
    for leftover in state_dir.glob("registry.db*"):
        leftover.unlink()
    shutil.rmtree(state_dir / "nats", ignore_errors=True)
    namespace = f"bench-mesh-{sharing}-{uuid.uuid4().hex[:6]}"
    env = service_env(queue_timeout_s=cfg.request_timeout_s, max_context=context, kv_cache_gb=cfg.kv_cache_gb)
    env.update({"LAYERCAST_SHARING": sharing,
                "LAYERCAST_ENGINE_CAPACITY_GB": f"{cfg.memory_gb * 0.75:g}",
                "LAYERCAST_HOST_CAPACITY_GB": f"{cfg.memory_gb * 0.25:g}",
                "LAYERCAST_PROFILE_MAX_LEN": str(max(16, cfg.max_prompt_tokens))})
    cpu_quota = _cpu_quota(cfg)
    with ExitStack() as stack:
        sigterm_unwinds(stack)  # a `timeout` or a runner's SIGTERM stops the cluster, not only Ctrl-C
        spec = ClusterSpec(state_dir=state_dir, port=free_port(), api_key=API_KEY, admin_key=ADMIN_KEY,
                           workers=cfg.workers, namespace=namespace, heartbeat_ttl_s=15.0,
                           torch_threads=cfg.torch_threads, extra_env=env)
        caps = WorkerCaps(cpu_quota or None, int(cfg.memory_gb * (1 << 30)) or None)
        stack.callback(caps.close)  # registered first, so it runs last: once the processes are stopped
        state = start_cluster(spec, timeout_s=120.0)
        stack.callback(stop_processes, state.processes)
        for p in state.processes:
            if p.name.startswith("worker"):
                caps.apply(p.name, p.pid)
        recorder = stack.enter_context(EventRecorder(state.nats_url, namespace))
        dedicated = sharing_setting(sharing).one_model_per_worker
        for name, path in models.items():
            deploy_model(state, name, path, min_instances=0 if dedicated else 1, max_instances=cfg.workers,
                         keep_alive_s=cfg.keep_alive_s, ttft_slo_s=cfg.ttft_slo_s, tpot_slo_s=cfg.tpot_slo_s)

        def ready(name: str) -> bool:
            r = httpx.get(f"{state.gateway_url}/admin/v1/models/{name}", timeout=10,
                          headers={"Authorization": f"Bearer {state.admin_key}"})
            return r.status_code == 200 and any(i["state"] == "ready" for i in r.json()["instances"])

        if dedicated:
            # One model per worker: the W most requested, each warmed by a request, all at once
            # (with min 0 instances a model warmed first would be scaled to zero after its
            # keep-alive while the next ones load). Served is warm: the replay starts right after.
            from concurrent.futures import ThreadPoolExecutor

            warm = list(warm_first or list(models)[: cfg.workers])
            with ThreadPoolExecutor(len(warm)) as pool:
                list(pool.map(lambda name: _warm(state, name, context), warm))
        else:
            for name in models:
                _wait(lambda: ready(name), 240, f"an instance of {name} ({sharing})")
        if sharing == "mesh":  # measured on the engine thread at first load: not during the replay
            for name in models:
                _wait(lambda: profile_stored(state.nats_url, namespace, name), 240, f"the profile of {name}")
        log(f"{sharing}: {len(models)} models ready on {cfg.workers} workers; caps {caps.applied or caps.unavailable}")
        yield MeshCluster(sharing, state, recorder, caps, models)


# --- the replay ---------------------------------------------------------------------------------


async def replay(cluster: MeshCluster, requests: Sequence[MeshRequest], limits: dict[str, tuple[int, set[int]]],
                 seed: int, timeout_s: float, lead_s: float = 0.5) -> tuple[float, list[Outcome]]:
    sends = []
    for r in requests:
        name = model_name(r.model)
        sends.append(Send(r.send_at_s, name, prompt_ids(r.prompt_tokens, seed * 1_000_003 + r.row, *limits[name]),
                          r.output_tokens))
    return await send_all(cluster.state.gateway_url.rstrip("/") + "/v1/completions", cluster.state.api_key, sends,
                          timeout_s, lead_s)


def _ttft_slo(o: Outcome, ttft_slo_s: float | None) -> float:
    return ttft_slo_s if ttft_slo_s is not None else default_ttft_slo(o.prompt_tokens)


def complies(o: Outcome, ttft_slo_s: float | None, tpot_slo_s: float) -> bool:
    """LLM-Mesh's SLO (§5.1, eq. 1: "a negative headroom indicates that an SLO violation has
    occurred"): token i (from 0) of the answer arrives within ttft_slo + i * tpot_slo of sending
    the request (ttft_slo: the paper's max(2, L/512) s when unset). Time is measured at the
    client, one streamed chunk per token (the benchmark models' every token has visible text);
    a request without a complete answer never complies."""
    if not o.ok or not o.chunk_s:
        return False
    ttft_slo = _ttft_slo(o, ttft_slo_s)
    return all(t <= ttft_slo + tpot_slo_s * i for i, t in enumerate(o.chunk_s))


def complies_mean_tpot(o: Outcome, ttft_slo_s: float | None, tpot_slo_s: float) -> bool:
    """The stricter reading some serving benchmarks use: TTFT <= ttft_slo and the mean time
    between tokens after the first <= tpot_slo (an early first token buys no slack later)."""
    return o.ok and attains_slo(o.ttft_s, o.tbt_s, _ttft_slo(o, ttft_slo_s), tpot_slo_s)


def slo_misses(outcomes: Sequence[Outcome], ttft_slo_s: float | None, tpot_slo_s: float) -> dict[str, int]:
    """The answered requests that missed (:func:`complies`): with their first token late, or only a
    later one; and those :func:`complies_mean_tpot` fails on the mean TPOT (for comparison)."""
    out = Counter()
    for o in outcomes:
        if not o.ok or not o.chunk_s:
            continue
        if not complies(o, ttft_slo_s, tpot_slo_s):
            out["first_token" if o.chunk_s[0] > _ttft_slo(o, ttft_slo_s) else "later_token"] += 1
        if o.tbt_s is not None and o.tbt_s > tpot_slo_s:
            out["mean_tpot"] += 1
    return {k: out[k] for k in ("first_token", "later_token", "mean_tpot")}


def _metrics_text(url: str) -> str:
    try:
        return httpx.get(url, timeout=10).text
    except httpx.HTTPError:
        return ""


def scrape(url: str) -> dict[str, float]:
    """Prometheus text: metric name (labels dropped) -> the sum over its series."""
    out: dict[str, float] = {}
    for line in _metrics_text(url).splitlines():
        if not line or line.startswith("#"):
            continue
        head, _, value = line.rpartition(" ")
        name = head.split("{", 1)[0]
        try:
            out[name] = out.get(name, 0.0) + float(value)
        except ValueError:
            pass
    return out


def _labelled(url: str, metric: str, label: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in _metrics_text(url).splitlines():
        if line.startswith(metric + "{"):
            m = re.search(rf'{label}="([^"]*)"', line)
            if m:
                out[m.group(1)] = out.get(m.group(1), 0.0) + float(line.rpartition(" ")[2])
    return out


def summarize(cluster: MeshCluster, wall0: float, requests: Sequence[MeshRequest], outcomes: Sequence[Outcome],
              duration_s: float, cfg: MeshBenchConfig, log_offsets: dict[str, int]) -> dict:
    done = [wall0 + o.done_s for o in outcomes if o.done_s is not None]
    t_end = max([wall0 + duration_s, *done])
    ok = [o for o in outcomes if o.ok]
    compliant = sum(complies(o, cfg.ttft_slo_s, cfg.tpot_slo_s) for o in outcomes)
    lost = [o for o in outcomes if not o.ok]
    names = [model_name(i) for i in range(len(cluster.models))]
    served = {r.model for r, o in zip(requests, outcomes) if o.ok}
    inst_s = sum(instance_seconds(cluster.recorder.intervals(wall0, t_end, model=n).values()) for n in names)
    workers = cluster.workers()
    metrics = [scrape(p.health_url.replace("/health", "/metrics")) for p in workers if p.health_url]
    unavailable = {}
    counters = {}
    for key, candidates in WORKER_COUNTERS.items():
        found = [name for name in candidates if any(name in m for m in metrics)]
        counters[key] = int(sum(m.get(found[0], 0.0) for m in metrics)) if found else 0
        if not found:
            unavailable[key] = f"no worker exports {' or '.join(candidates)}"
    admissions: dict[str, float] = Counter()
    for p in workers:
        if p.health_url:
            admissions.update(_labelled(p.health_url.replace("/health", "/metrics"),
                                        "layercast_worker_mesh_admissions_total", "verdict"))
    gateway = scrape(cluster.state.gateway_url.rstrip("/") + "/metrics")
    oom_kills = cluster.caps.oom_kills()
    oom_logs = 0
    for p in workers:
        try:
            with open(p.log, "rb") as f:
                f.seek(log_offsets.get(p.name, 0))
                oom_logs += len(OOM_LOG.findall(f.read().decode(errors="replace")))
        except OSError:
            pass
    dead = [p.name for p in workers if not process_alive(p.pid)]
    if oom_kills is None:
        unavailable["ooms_cgroup"] = "no memory cgroup here: OOMs counted from worker logs only"
    return {
        "sharing": cluster.sharing,
        "slo_compliant_requests": compliant,
        "requests": len(outcomes),
        "slo_attainment": round(compliant / len(outcomes), 4) if outcomes else None,
        "slo_compliant_mean_tpot": sum(complies_mean_tpot(o, cfg.ttft_slo_s, cfg.tpot_slo_s) for o in outcomes),
        "slo_misses": slo_misses(outcomes, cfg.ttft_slo_s, cfg.tpot_slo_s),
        "ttft_p50": percentiles((o.ttft_s for o in ok), (50,), 5)["p50"],
        "ttft_p99": percentiles((o.ttft_s for o in ok), (99,), 5)["p99"],
        "tpot_p50": percentiles((o.tbt_s for o in ok if o.tbt_s is not None), (50,), 6)["p50"],
        "tpot_p99": percentiles((o.tbt_s for o in ok if o.tbt_s is not None), (99,), 6)["p99"],
        "models_served": len(served),
        "instance_seconds": round(inst_s, 3),
        **counters,
        "ooms": (oom_kills or 0) + oom_logs,
        "lost": len(lost),
        "failure_reasons": dict(Counter(o.error for o in lost).most_common(8)),
        "unavailable": unavailable,
        "workers_dead": dead,
        "mesh_admissions": {k: int(v) for k, v in sorted(admissions.items())},
        "busy_refusals": int(gateway.get("layercast_gateway_busy_refusals_total", 0.0)),
        "completion_tokens": sum(o.tokens for o in ok),
        "window_s": round(t_end - wall0, 3),
        "worker_peak_memory_bytes": cluster.caps.peak_bytes(),
        "caps": {"applied": dict(cluster.caps.applied), "unavailable": dict(cluster.caps.unavailable)},
    }


# --- the whole benchmark ------------------------------------------------------------------------


def median_trial(rows: Sequence[dict]) -> dict:
    """The trial with the median SLO-compliant count (the lower middle for an even count): a real trial."""
    ranked = sorted(rows, key=lambda r: (r["slo_compliant_requests"], -r["lost"]))
    return ranked[(len(ranked) - 1) // 2]


def run_mesh_benchmark(cfg: MeshBenchConfig, state_dir: Path, log: Callable[[str], None] = _log) -> dict:
    for s in cfg.settings:
        sharing_setting(s)
    if not cfg.load > 0 and cfg.target_rps is None:
        raise ValueError(f"the offered load must be > 0 (a multiple of the capacity), got {cfg.load}")

    def workload_at(rps: float) -> tuple[list[MeshRequest], dict, Path]:
        spec = MeshWorkloadSpec(models=cfg.models, duration_s=cfg.duration_s, target_rps=rps, seed=cfg.seed,
                                zipf_s=cfg.zipf_s, max_prompt_tokens=cfg.max_prompt_tokens,
                                max_output_tokens=cfg.max_output_tokens)
        return load_workload(cfg.trace, spec)

    state_dir = Path(state_dir).resolve() / "bench-mesh"
    log(f"building {cfg.models} models")
    paths = mesh_models(state_dir, cfg.models)
    models = {model_name(i): p for i, p in enumerate(paths)}
    limits, context = {}, None
    for name, p in models.items():
        vocab, ctx, eos = model_limits(p)
        limits[name] = (vocab, eos)
        context = ctx if context is None else min(context, ctx)
    # The capacity, on the workload's request sizes and model mix (a draft of it at 10 req/s).
    draft, _, _ = workload_at(cfg.target_rps or 10.0)
    if not draft:
        raise ValueError("the workload has no requests: raise --load, --rps or --duration-s")
    capacity = measure_capacity(models, draft, cfg, limits, log)
    rps = cfg.target_rps if cfg.target_rps is not None else cfg.load * capacity["capacity_rps"]
    requests, workload, trace_path = workload_at(rps)
    if not requests:
        raise ValueError("the workload has no requests: raise --load, --rps or --duration-s")
    offered = {"rps": round(rps, 4), "multiple_of_capacity": round(rps / capacity["capacity_rps"], 4),
               "stated_as": "a fixed rate (--rps)" if cfg.target_rps is not None else "a multiple of capacity (--load)",
               **capacity}
    log(f"offered load {offered['multiple_of_capacity']:g} x capacity = {rps:.3f} req/s: {len(requests)} requests "
        f"over {cfg.duration_s:g} s")
    popular = [model_name(i) for i, _ in Counter(r.model for r in requests).most_common()]
    need = max(r.prompt_tokens + r.output_tokens for r in requests)
    if need > context:
        raise ValueError(f"a request needs {need} tokens of context, the models have {context}")
    trials: list[dict] = []
    for t in range(cfg.trials):
        for sharing in cfg.settings:
            log(f"trial {t + 1}/{cfg.trials}, {sharing}: starting a fresh cluster")
            with mesh_cluster(sharing, models, cfg, state_dir / sharing, context, log,
                              warm_first=popular[: cfg.workers]) as c:
                offsets = {}
                for p in c.workers():
                    try:
                        offsets[p.name] = os.path.getsize(p.log)
                    except OSError:
                        pass
                wall0, outcomes = asyncio.run(replay(c, requests, limits, cfg.seed, cfg.request_timeout_s))
                time.sleep(0.5)  # the last instance events
                row = summarize(c, wall0, requests, outcomes, cfg.duration_s, cfg, offsets)
            row["trial"] = t
            trials.append(row)
            log(f"trial {t + 1}, {sharing}: {row['slo_compliant_requests']}/{row['requests']} SLO-compliant, "
                f"ttft p50 {row['ttft_p50']} p99 {row['ttft_p99']}, tpot p50 {row['tpot_p50']} p99 "
                f"{row['tpot_p99']}, lost {row['lost']}, ooms {row['ooms']}")
    results = [median_trial([r for r in trials if r["sharing"] == s]) for s in cfg.settings]
    by = {r["sharing"]: r for r in results}

    def ratio_to(base: str) -> float | None:
        if "mesh" in by and base in by and by[base]["slo_compliant_requests"] > 0:
            return round(by["mesh"]["slo_compliant_requests"] / by[base]["slo_compliant_requests"], 4)
        return None

    return {
        "results": results,
        "ratio": ratio_to("exclusive"),
        "ratio_of": "mesh / exclusive SLO-compliant requests (median trials; null when exclusive has none)",
        "ratio_dedicated": ratio_to("dedicated"),
        "ratio_dedicated_of": "mesh / dedicated SLO-compliant requests (median trials; null when dedicated has none)",
        "offered_load": offered,
        "trials": trials,
        "median_of": cfg.trials,
        "models": cfg.models,
        "workers": cfg.workers,
        "workload": workload,
        "attribution": workload["attribution"],
        "config": {**asdict(cfg), "settings": list(cfg.settings),
                   "presets": [PRESETS[i % len(PRESETS)] for i in range(cfg.models)],
                   "deploy": {"min_instances": "1 (dedicated: 0, the most requested W warmed by a request)",
                              "max_instances": cfg.workers, "keep_alive_s": cfg.keep_alive_s,
                              "ttft_slo_s": cfg.ttft_slo_s, "tpot_slo_s": cfg.tpot_slo_s,
                              "scaling_mode": "layercast", "policy": "concurrency"},
                   "slo": ("token i (from 0) within ttft_slo_s + i * tpot_slo_s of sending (LLM-Mesh eq. 1; "
                           "ttft_slo_s unset: max(2, prompt/512) s); slo_compliant_mean_tpot: TTFT <= ttft_slo_s "
                           "and mean TPOT <= tpot_slo_s"),
                   "trace_path": str(trace_path)},
    }


def plot_attainment(path: Path, runs: Sequence[dict], title: str) -> None:
    """SLO attainment against K, one line per setting (one point per run)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for sharing in SETTINGS:
        pts = sorted((run["models"], r["slo_attainment"]) for run in runs for r in run["results"]
                     if r["sharing"] == sharing and r["slo_attainment"] is not None)
        if pts:
            ax.plot([k for k, _ in pts], [a for _, a in pts], marker="o", label=sharing)
    ax.set_xlabel("models (K)")
    ax.set_ylabel("SLO attainment")
    ax.set_ylim(0, 1.02)
    ax.set_title(title)
    ax.legend()
    attribution = runs[0]["attribution"] if runs else ""
    fig.text(0.01, 0.01, f"Trace: {attribution}", fontsize=6, va="bottom", wrap=True)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)

