"""One fresh dev cluster per scaling mode, for benchmarks that compare modes
(`layercast bench trace`, `bench scale`).

    with mode_cluster("layercast", workers=2, model_path=blocks, state_dir=out / "layercast",
                      emulate=False, keep_alive_s=3) as h:
        ...  # send requests to h.gateway_url with h.api_key
        intervals = h.recorder.intervals(t0, time.time())
        ops = h.recorder.scale_ops(since=t0)

Each cluster starts from nothing (its own NATS, its own SQLite registry in its state
dir, empty host tiers) so no mode inherits another's warm state; the model is deployed
with `scaling_mode=mode` and an `EventRecorder` follows, from before the deploy, every
InstanceEvent and every scale-operation record on the cluster's NATS. With `emulate`
(root) each worker runs in its own network namespace with the resources of an
`EmulationProfile` (libs/cluster/emulation.py).
"""

from __future__ import annotations

import asyncio
import json
import shutil
import signal
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from benchmarks.trace_replay import ENDED_STATES, instance_intervals
from libs.admin import admin_request
from libs.bus.auth import redact
from libs.protocol import subjects
from libs.cluster.launcher import ClusterError, ClusterSpec, ClusterState, free_port, start_cluster, stop_processes

API_KEY, ADMIN_KEY = "sk-bench-api", "sk-bench-admin"
MODEL_NAME = "bench"
# Recorded with every run: its workers run waiting prefills through the blocks landed while a
# serve-while-loading instance loads (Engine.prefill_ahead). Runs recorded before it lack the
# field; `layercast simulate --validate` then simulates workers without it.
WORKERS_PREFILL_AHEAD = True


def namespaced(subject: str, namespace: str) -> str:
    """A subject of libs/protocol/subjects.py under another LAYERCAST_NAMESPACE than this process's."""
    if not subject.startswith(subjects.PREFIX + "."):
        raise ValueError(f"{subject!r} is not under {subjects.PREFIX!r}")
    return namespace + subject[len(subjects.PREFIX):]


@dataclass(frozen=True)
class InstanceRecord:
    t: float  # when the recorder received it (time.time(), same clock as the services')
    instance_id: str
    model: str
    state: str  # loading | ready | draining | stopped | failed
    scale_op_id: str | None
    workers: tuple[str, ...]
    reason: str = ""


@dataclass
class ScaleOpRecord:
    scale_op_id: str
    model: str
    direction: str  # up | down
    first_seen: float
    last_seen: float
    state: str  # the latest recorded: planned | running | done | failed | aborted
    from_instances: int
    to_instances: int
    plan: dict = field(default_factory=dict)
    timings: dict = field(default_factory=dict)


class EventRecorder:
    """Records InstanceEvents and scale-operation records of one namespace on one NATS server.

    Runs nats-py on its own thread and event loop, so it works next to synchronous code and
    next to a caller's own event loop alike; every accessor is thread-safe.
    """

    def __init__(self, nats_url: str, namespace: str):
        self.nats_url, self.namespace = nats_url, namespace
        self.subjects = {
            "instance": namespaced(subjects.EVENT_INSTANCE, namespace),
            "scaleop": namespaced(subjects.REGISTRY_SCALEOP_RECORD, namespace),
            "transfer": namespaced(subjects.EVENT_TRANSFER, namespace),
        }
        self._lock = threading.Lock()
        self._instances: list[InstanceRecord] = []
        self._ops: dict[str, ScaleOpRecord] = {}
        self._transfers: list[dict] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._nc = None

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self, timeout_s: float = 10.0) -> EventRecorder:
        import nats

        ready = threading.Event()
        failure: list[BaseException] = []
        loop = asyncio.new_event_loop()
        self._loop = loop

        async def connect() -> None:
            self._nc = await nats.connect(self.nats_url, max_reconnect_attempts=-1, name="layercast-bench-recorder")
            await self._nc.subscribe(self.subjects["instance"], cb=self._on_instance)
            await self._nc.subscribe(self.subjects["scaleop"], cb=self._on_scaleop)
            await self._nc.subscribe(self.subjects["transfer"], cb=self._on_transfer)
            await self._nc.flush()

        def run() -> None:
            asyncio.set_event_loop(loop)
            try:
                loop.run_until_complete(connect())
            except BaseException as e:  # reported to start()
                failure.append(e)
                ready.set()
                return
            ready.set()
            loop.run_forever()

        self._thread = threading.Thread(target=run, name="bench-event-recorder", daemon=True)
        self._thread.start()
        if not ready.wait(timeout_s) or failure:
            self.close()
            raise ClusterError(f"event recorder could not subscribe on {redact(self.nats_url)}: "
                               f"{failure[0] if failure else 'timed out'}")
        return self

    def close(self) -> None:
        loop, self._loop = self._loop, None
        if loop is None:
            return
        if self._nc is not None and loop.is_running():
            try:
                asyncio.run_coroutine_threadsafe(self._nc.drain(), loop).result(5)
            except Exception:
                pass
        if loop.is_running():
            loop.call_soon_threadsafe(loop.stop)
        if self._thread is not None:
            self._thread.join(5)
        if not loop.is_running():
            loop.close()

    def __enter__(self) -> EventRecorder:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- handlers (recorder thread) ---------------------------------------------------------
    async def _on_instance(self, msg) -> None:
        now = time.time()
        try:
            ev = json.loads(msg.data)
            inst = ev["instance"]
            rec = InstanceRecord(now, inst["instance_id"], inst.get("model", ""), inst["state"],
                                 inst.get("scale_op_id"), tuple(s["worker_id"] for s in inst.get("stages", [])),
                                 ev.get("reason", ""))
        except (ValueError, KeyError, TypeError):
            return
        with self._lock:
            self._instances.append(rec)

    async def _on_scaleop(self, msg) -> None:
        now = time.time()
        try:
            op = json.loads(msg.data)
            op_id = op["scale_op_id"]
        except (ValueError, KeyError, TypeError):
            return
        with self._lock:
            rec = self._ops.get(op_id)
            if rec is None:
                self._ops[op_id] = ScaleOpRecord(op_id, op.get("model", ""), op.get("direction", ""), now, now,
                                                 op.get("state", ""), int(op.get("from_instances", 0)),
                                                 int(op.get("to_instances", 0)), op.get("plan") or {},
                                                 op.get("timings") or {})
            else:
                rec.last_seen, rec.state = now, op.get("state", rec.state)
                rec.plan = op.get("plan") or rec.plan
                rec.timings = op.get("timings") or rec.timings

    async def _on_transfer(self, msg) -> None:
        try:
            report = json.loads(msg.data)
        except ValueError:
            return
        report["received_at"] = time.time()
        with self._lock:
            self._transfers.append(report)

    # -- accessors ---------------------------------------------------------------------------
    def instance_records(self, model: str | None = None) -> list[InstanceRecord]:
        with self._lock:
            return [r for r in self._instances if model is None or r.model == model]

    def instance_events(self, model: str | None = None) -> list[tuple[str, str, float]]:
        """(instance_id, state, time) of every InstanceEvent, in arrival order."""
        return [(r.instance_id, r.state, r.t) for r in self.instance_records(model)]

    def intervals(self, t_start: float, t_end: float, model: str | None = None) -> dict[str, tuple[float, float]]:
        """Each instance's [start, end) clipped to [t_start, t_end] (see trace_replay.instance_intervals)."""
        return instance_intervals(self.instance_events(model), t_start, t_end)

    def live_instances(self, model: str | None = None, states: tuple[str, ...] = ("loading", "ready")) -> int:
        """Instances whose latest event is in `states` (default: loading or ready)."""
        last: dict[str, str] = {}
        ended: set[str] = set()
        for r in self.instance_records(model):
            if r.state in ENDED_STATES:
                ended.add(r.instance_id)
            last[r.instance_id] = r.state
        return sum(1 for iid, s in last.items() if iid not in ended and s in states)

    def scale_ops(self, since: float | None = None, until: float | None = None,
                  model: str | None = None, direction: str | None = None) -> list[ScaleOpRecord]:
        """Scale operations first recorded within [since, until], oldest first."""
        with self._lock:
            ops = [ScaleOpRecord(**asdict(o)) for o in self._ops.values()]
        return sorted((o for o in ops if (since is None or o.first_seen >= since)
                       and (until is None or o.first_seen <= until)
                       and (model is None or o.model == model)
                       and (direction is None or o.direction == direction)), key=lambda o: o.first_seen)

    def scale_op_count(self, since: float | None = None, until: float | None = None,
                       model: str | None = None) -> dict[str, int]:
        ops = self.scale_ops(since, until, model)
        return {"total": len(ops), "up": sum(o.direction == "up" for o in ops),
                "down": sum(o.direction == "down" for o in ops)}

    def transfers(self) -> list[dict]:
        with self._lock:
            return list(self._transfers)

    def wait_for(self, predicate: Callable[[EventRecorder], Any], timeout_s: float, what: str = "a condition") -> Any:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            value = predicate(self)
            if value:
                return value
            time.sleep(0.05)
        raise TimeoutError(f"timed out after {timeout_s}s waiting for {what}")


@dataclass
class ClusterHandle:
    """A running mode cluster: where to send requests, and what it recorded."""

    mode: str
    model: str  # the deployed model's name
    model_path: Path
    state: ClusterState
    recorder: EventRecorder
    deploy: dict  # the deploy body sent
    settings: dict  # every knob applied (services' env, deploy fields, emulation)
    emulation: Any = None  # the EmulatedCluster, when emulated
    deployed_at: float = 0.0

    @property
    def gateway_url(self) -> str:
        return self.state.gateway_url

    @property
    def openai_base_url(self) -> str:
        return self.state.gateway_url.rstrip("/") + "/v1"

    @property
    def api_key(self) -> str:
        return self.state.api_key

    @property
    def admin_key(self) -> str:
        return self.state.admin_key

    @property
    def nats_url(self) -> str:
        return self.state.nats_url

    @property
    def namespace(self) -> str:
        return self.state.namespace

    @property
    def state_dir(self) -> Path:
        return Path(self.state.state_dir)

    def admin(self, method: str, path: str, body: dict | None = None, timeout_s: float = 30.0) -> httpx.Response:
        return admin_request(self.state, method, path, body, timeout_s=timeout_s)

    def describe(self) -> dict:
        """GET /admin/v1/models/{model}: the deployment, its instances, replicas, recent scale ops."""
        r = self.admin("GET", f"/admin/v1/models/{self.model}")
        r.raise_for_status()
        return r.json()

    def ready_instances(self) -> int:
        return sum(1 for i in self.describe()["instances"] if i["state"] == "ready")

    def host_copies(self, info: dict | None = None) -> int:
        """Workers holding every block of the model in their host tier (the parameter pool's copies)."""
        info = info or self.describe()
        n_blocks = len(info["blocks"])
        host: dict[str, set[int]] = {}
        for r in info["replicas"]:
            if r["tier"] == "host" and r["state"] == "ready":
                host.setdefault(r["worker_id"], set()).add(r["block_id"])
        return sum(1 for blocks in host.values() if len(blocks) == n_blocks)

    def expected_host_copies(self) -> int:
        """Complete host copies a settled deployment of this mode keeps (README, "Parameter pool"):
        none for serverlessllm and static, one per worker for ideal, one otherwise."""
        if self.mode in ("serverlessllm", "static"):
            return 0
        return int(self.settings["workers"]) if self.mode == "ideal" else 1

    @staticmethod
    def _fully_loaded(instance: dict, info: dict) -> bool:
        """Every block of the instance is in engine memory (`gpu` tier) on its stage's worker."""
        if instance.get("loaded_at"):
            return True
        engine = {(r["worker_id"], r["block_id"]) for r in info["replicas"]
                  if r["tier"] == "gpu" and r["state"] == "ready"}
        return all((s["worker_id"], b) in engine for s in instance["stages"]
                   for b in range(s["block_start"], s["block_end"]))

    def wait_settled(self, timeout_s: float = 120.0, quiet_s: float = 1.0) -> bool:
        """Until the deployment is at rest: no instance or replica loading (a ready instance that
        serves while loading counts as loading until every block is in engine memory), the mode's host copies
        in place, and nothing changed for quiet_s. False (not raised) when that did not happen in
        time, e.g. on a tree whose planner keeps no pool for this mode."""
        deadline = time.monotonic() + timeout_s
        last, since = None, time.monotonic()
        while time.monotonic() < deadline:
            try:
                info = self.describe()
            except httpx.HTTPError:
                time.sleep(0.2)
                continue
            busy = any(i["state"] == "loading" or (i["state"] == "ready" and not self._fully_loaded(i, info))
                       for i in info["instances"]) or any(r["state"] == "loading" for r in info["replicas"])
            snapshot = (sorted((i["instance_id"], i["state"]) for i in info["instances"]),
                        sorted((r["worker_id"], r["block_id"], r["tier"], r["state"]) for r in info["replicas"]))
            if snapshot != last:
                last, since = snapshot, time.monotonic()
            if not busy and self.host_copies(info) >= self.expected_host_copies() and \
                    time.monotonic() - since >= quiet_s:
                return True
            time.sleep(0.2)
        return False

    def wait_ready(self, n: int, timeout_s: float = 120.0) -> None:
        """Until the registry lists at least n ready instances of the model."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if self.ready_instances() >= n:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise ClusterError(f"{self.model} ({self.mode}): {n} instance(s) not ready within {timeout_s}s")
            time.sleep(0.2)


def _emulation_context(workers: int, profile: Any, disk_path: Path):
    try:
        from libs.cluster.emulation import DEFAULT_PROFILE, EmulatedCluster, EmulationProfile
    except ImportError as e:  # an older tree without profiles
        raise ClusterError(f"emulation profiles are not available here: {e}") from e
    if profile is None:
        profile = DEFAULT_PROFILE
    elif isinstance(profile, dict):
        profile = EmulationProfile(**profile)
    return EmulatedCluster.from_profile(workers, profile, disk_path=disk_path), profile


def service_env(*, target_concurrency: int | None = None, scale_down_delay_s: float | None = None,
                queue_timeout_s: float | None = None, max_context: int | None = None,
                slots_per_instance: int | None = None, kv_cache_gb: float | None = None,
                serverlessllm_keep_alive_s: float | None = None) -> dict[str, str]:
    """The services' environment for the given knobs (None: the service's default)."""
    env = {"LAYERCAST_TARGET_CONCURRENCY": target_concurrency, "LAYERCAST_SCALE_DOWN_DELAY": scale_down_delay_s,
           "LAYERCAST_QUEUE_TIMEOUT": queue_timeout_s, "LAYERCAST_MAX_CONTEXT": max_context,
           "LAYERCAST_SLOTS_PER_INSTANCE": slots_per_instance, "LAYERCAST_KV_CACHE_GB": kv_cache_gb,
           "LAYERCAST_SERVERLESSLLM_KEEP_ALIVE": serverlessllm_keep_alive_s}
    return {k: f"{v:g}" if isinstance(v, float) else str(v) for k, v in env.items() if v is not None}


def sigterm_unwinds(stack: ExitStack) -> None:
    """Make SIGTERM (e.g. from `timeout`) raise in the main thread while the cluster runs, so the
    stack stops its processes (they run in their own sessions and would outlive us otherwise)."""
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return

    def interrupt(signum: int, _frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, interrupt)
    stack.callback(signal.signal, signal.SIGTERM, signal.SIG_DFL)  # registered first: restored last


def drop_checkpoint_cache(path: Path) -> None:
    """Evict a checkpoint folder's files from the page cache (best effort, no root needed)."""
    from libs.checkpoint.fastload import drop_page_cache

    for f in Path(path).iterdir():
        if f.is_file():
            try:
                drop_page_cache(f)
            except OSError:
                pass


@contextmanager
def mode_cluster(mode: str, *, workers: int, model_path: Path, state_dir: Path, emulate: bool = False,
                 profile: Any = None, min_instances: int = 0, max_instances: int | None = None,
                 keep_alive_s: float = 5.0, model_name: str = MODEL_NAME,
                 target_concurrency: int | None = None, scale_down_delay_s: float | None = None,
                 queue_timeout_s: float | None = None, max_context: int | None = None,
                 slots_per_instance: int | None = None, kv_cache_gb: float | None = None,
                 serverlessllm_keep_alive_s: float | None = None, torch_threads: int = 1,
                 heartbeat_ttl_s: float = 15.0, nats_url: str | None = None, database_url: str | None = None,
                 namespace: str | None = None, extra_env: dict[str, str] | None = None, wait_min_ready: bool = True,
                 start_timeout_s: float = 120.0, ready_timeout_s: float = 180.0, cold_start: bool = True,
                 settle: bool = True, settle_timeout_s: float = 60.0,
                 **deploy_fields: Any) -> Iterator[ClusterHandle]:
    """A fresh cluster serving `model_path` as `model_name` with `scaling_mode=mode`; stopped on exit.

    - state_dir: this cluster's own directory (logs, NATS store, the SQLite registry unless
      database_url is given; a registry or NATS store left there by an earlier run is removed).
      Use one per mode.
    - max_instances: default `workers`. min_instances > 0 instances are loaded at deploy; with
      wait_min_ready the context is entered only once they are ready (so a `static` fleet is warm).
    - keep_alive_s and any other field of the deploy body (`max_queue`, ...) as keyword arguments.
    - target_concurrency, scale_down_delay_s (load-monitor), queue_timeout_s, max_context,
      slots_per_instance (gateway), kv_cache_gb (workers), serverlessllm_keep_alive_s (planner: how
      long a serverlessllm worker keeps a scaled-in model in its host cache): None leaves the
      service's default.
    - heartbeat_ttl_s: longer than a production registry's 5 s: a bench packs many workers onto
      few cores, and a worker whose heartbeats are late under that load is not dead.
    - emulate: root; `profile` an EmulationProfile (or a dict of its fields; None: the default
      profile); disk caps apply to the disk holding `model_path`.
    - nats_url: an existing NATS server (default: the cluster's own); namespace: default unique.
    - settle: before yielding, wait (at most settle_timeout_s) until the deployment is at rest
      (`ClusterHandle.wait_settled`: the pool's host copies in place, nothing loading);
      settings["settled"] says whether it got there.
    - cold_start: drop the checkpoint's files from the page cache first, so the first load of
      every mode reads the disk (no mode inherits the previous one's cache).
    """
    max_instances = workers if max_instances is None else max_instances
    state_dir = Path(state_dir).resolve()
    state_dir.mkdir(parents=True, exist_ok=True)
    namespace = namespace or f"bench-{''.join(c for c in mode if c.isalnum())[:12]}-{uuid.uuid4().hex[:6]}"
    env = service_env(target_concurrency=target_concurrency, scale_down_delay_s=scale_down_delay_s,
                      queue_timeout_s=queue_timeout_s, max_context=max_context,
                      slots_per_instance=slots_per_instance, kv_cache_gb=kv_cache_gb,
                      serverlessllm_keep_alive_s=serverlessllm_keep_alive_s)
    env.update(extra_env or {})
    deploy = {"name": model_name, "path": str(Path(model_path).resolve()), "min_instances": min_instances,
              "max_instances": max_instances, "keep_alive_s": keep_alive_s, "scaling_mode": mode, **deploy_fields}
    settings: dict[str, Any] = {"mode": mode, "workers": workers, "deploy": {k: v for k, v in deploy.items()
                                                                              if k not in ("name", "path")},
                                "service_env": env, "torch_threads": torch_threads, "emulated": emulate,
                                "cold_start": cold_start, "prefill_ahead": WORKERS_PREFILL_AHEAD}
    if database_url is None:  # a fresh SQLite registry (and NATS store): nothing left from an earlier run
        for leftover in state_dir.glob("registry.db*"):
            leftover.unlink()
        if nats_url is None:
            shutil.rmtree(state_dir / "nats", ignore_errors=True)
    if cold_start:
        drop_checkpoint_cache(Path(model_path))
    with ExitStack() as stack:
        sigterm_unwinds(stack)
        emulation = None
        if emulate:
            cm, used = _emulation_context(workers, profile, Path(model_path).resolve())
            emulation = stack.enter_context(cm)
            settings["emulation_profile"] = asdict(used)
        spec = ClusterSpec(state_dir=state_dir, port=free_port(), api_key=API_KEY, admin_key=ADMIN_KEY,
                           workers=workers, nats_url=nats_url, database_url=database_url, namespace=namespace,
                           heartbeat_ttl_s=heartbeat_ttl_s, torch_threads=torch_threads, extra_env=env)
        state = start_cluster(spec, timeout_s=start_timeout_s, emulation=emulation)
        stack.callback(stop_processes, state.processes)
        recorder = stack.enter_context(EventRecorder(state.nats_url, namespace))
        handle = ClusterHandle(mode, model_name, Path(model_path).resolve(), state, recorder, deploy, settings,
                               emulation)
        r = handle.admin("POST", "/admin/v1/models", deploy)
        if r.status_code >= 400:
            try:
                message = r.json()["error"]["message"]
            except (ValueError, KeyError, TypeError):
                message = r.text
            raise ClusterError(f"deploying {model_name} with scaling_mode={mode} failed ({r.status_code}): {message}")
        handle.deployed_at = time.time()
        if wait_min_ready and min_instances > 0:
            handle.wait_ready(min_instances, ready_timeout_s)
        if settle:
            t = time.monotonic()
            settings["settled"] = handle.wait_settled(settle_timeout_s)
            settings["settle_s"] = round(time.monotonic() - t, 3)
        yield handle
