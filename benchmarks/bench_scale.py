"""`layercast bench scale`: one controlled burst per scaling mode on the same (emulated) cluster.

Each mode gets a fresh cluster (bench_cluster.mode_cluster): the model is deployed with
`from_n` instances loaded, the pool settles, then the benchmark takes the scale decision
itself (a ScaleRequest to `to_n`, as the load-monitor would send it) and starts a stream of
requests at the gateway. From the operation's record it reports decision -> first byte,
decision -> each instance loaded (every block in engine memory), decision -> all loaded,
and the cluster's tokens/s every 100 ms, next to the mode's physical bound under the
emulated rates (network multicast bound, disk bound, or 0 for `ideal`) in the same run.
"""

from __future__ import annotations

import asyncio
import re
import statistics
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

from libs.planning.overload import first_rise_s, mean_rate, window_latencies
from libs.planning.pool import plan_pool_fills
from libs.planning.scaleout import build_plan, plan_bound_s
from libs.protocol import messages as m
from libs.protocol import subjects
from libs.bus.broker import make_broker, publish, start_broker
from benchmarks.harness import WORKERS_PREFILL_AHEAD, mode_cluster, namespaced
from libs.cluster.launcher import ClusterError

TIMELINE_STEP_S = 0.1
CHUNK_BYTES = 1 << 20  # the data plane's chunk (TransferPart default)
# Per instance: 8 engines zero-filling 1 GiB each on a 2-core machine would measure memset, not scaling.
KV_CACHE_GB = 0.25


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


async def _decide(nats_url: str, namespace: str, model: str, desired: int) -> float:
    broker = make_broker(nats_url)
    await start_broker(broker)
    try:
        decided = time.time()
        await publish(broker, namespaced(subjects.SCALE_REQUEST, namespace),
                      m.ScaleRequest(model=model, desired_instances=desired, reason="bench scale burst",
                                     sent_at=decided))
        return decided
    finally:
        await broker.stop()


class _TokenCounter:
    """Streams requests from `concurrency` threads; counts streamed tokens per 100 ms bucket."""

    def __init__(self, url: str, api_key: str, model: str, concurrency: int, max_tokens: int):
        self.url, self.api_key, self.model = url, api_key, model
        self.concurrency, self.max_tokens = concurrency, max_tokens
        self.stamps: list[float] = []
        self.failed = 0
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._run, daemon=True) for _ in range(concurrency)]

    def _run(self) -> None:
        with httpx.Client(timeout=300, headers={"Authorization": f"Bearer {self.api_key}"}) as c:
            while not self._stop.is_set():
                body = {"model": self.model, "prompt": f"burst {uuid.uuid4().hex[:8]}", "max_tokens": self.max_tokens,
                        "stream": True}
                try:
                    with c.stream("POST", f"{self.url}/v1/completions", json=body) as r:
                        if r.status_code != 200:
                            raise httpx.HTTPStatusError(f"{r.status_code}", request=r.request, response=r)
                        for line in r.iter_lines():
                            if line.startswith("data: {"):
                                with self._lock:
                                    self.stamps.append(time.time())
                except httpx.HTTPError:
                    with self._lock:
                        self.failed += 1
                    time.sleep(0.2)

    def _token(self, now: float, instance: str) -> None:
        with self._lock:
            self.stamps.append(now)

    def start(self) -> None:
        [t.start() for t in self._threads]

    def stop(self) -> None:
        self._stop.set()
        [t.join(60) for t in self._threads]

    def timeline(self, t0: float, t1: float) -> list[float]:
        n = max(1, int((t1 - t0) / TIMELINE_STEP_S + 0.999))
        counts = [0] * n
        with self._lock:
            for s in self.stamps:
                i = int((s - t0) / TIMELINE_STEP_S)
                if 0 <= i < n:
                    counts[i] += 1
        return [c / TIMELINE_STEP_S for c in counts]


@dataclass
class _Streamed:
    """One streaming completion as far as it got (kept when it fails midway)."""

    instance: str = ""  # the instance the gateway chose (x-layercast-instance)
    routed: float | None = None  # when its response headers came
    first: float | None = None
    last: float | None = None
    tokens: int = 0


def _stream_completion(client: httpx.Client, url: str, body: dict, got: _Streamed,
                       on_token: Callable[[float, str], None]) -> None:
    """POST one streaming completion into `got`, on_token(now, instance) per token; HTTPError on failure."""
    with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise httpx.HTTPStatusError(f"{r.status_code}", request=r.request, response=r)
        got.instance, got.routed = r.headers.get("x-layercast-instance", ""), time.time()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                now = time.time()
                got.last, got.tokens = now, got.tokens + 1
                got.first = got.first or now
                on_token(now, got.instance)


class _Burst:
    """`n` streaming requests sent at once (FaaScale Fig. 9): when each got its first token, and
    from which instance (the gateway's x-layercast-instance header)."""

    def __init__(self, url: str, api_key: str, model: str, n: int, max_tokens: int):
        self.url, self.api_key, self.model, self.max_tokens = url, api_key, model, max_tokens
        # Each request that got a token: (response headers, i.e. the gateway chose its instance,
        # first token, last token, tokens, instance)
        self.requests: list[tuple[float, float, float, int, str]] = []
        self.stamps: list[float] = []
        self.failed = 0
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._one, daemon=True) for _ in range(n)]
        # One client for the whole burst: a client per request costs an SSL context each, which
        # took this process ~2 s of the machine's 2 cores and delayed the burst it measures.
        self._client = httpx.Client(timeout=300, headers={"Authorization": f"Bearer {api_key}"},
                                    limits=httpx.Limits(max_connections=n, max_keepalive_connections=n))

    def _one(self) -> None:
        body = {"model": self.model, "prompt": f"burst {uuid.uuid4().hex[:8]}", "max_tokens": self.max_tokens,
                "stream": True}
        got = _Streamed()
        try:
            _stream_completion(self._client, self.url, body, got, self._token)
        except httpx.HTTPError:
            with self._lock:
                self.failed += 1
        if got.first is not None:
            with self._lock:
                self.requests.append((got.routed, got.first, got.last, got.tokens, got.instance))

    def _token(self, now: float, instance: str) -> None:
        with self._lock:
            self.stamps.append(now)

    def start(self) -> None:
        [t.start() for t in self._threads]

    def stop(self) -> None:
        [t.join(300) for t in self._threads]
        self._client.close()

    timeline = _TokenCounter.timeline

    def first_tokens(self, t0: float, warm: set[str]) -> dict:
        """The whole burst's first-token time and the first token new capacity served (seconds from t0)."""
        new = [f for _, f, _, _, inst in self.requests if inst not in warm]
        complete = len(self.requests) == len(self._threads)
        names = {inst: f"warm{i}" if inst in warm else f"new{i}" for i, inst in enumerate(sorted(
            {inst for *_, inst in self.requests}, key=lambda x: (x not in warm, x)))}
        return {"burst_first_token_s": max(f for _, f, *_ in self.requests) - t0 if complete else None,
                "new_capacity_first_token_s": min(new) - t0 if new else None,
                "burst_served_by_new_capacity": len(new),
                # each request: seconds to its first and last token, tokens, and where it ran
                "burst_requests": [(round(at - t0, 2), round(f - t0, 2), round(last - t0, 2), n, names[inst])
                                   for at, f, last, n, inst in sorted(self.requests)]}


class _Overload:
    """Open-loop requests at `rps` per second (one thread each, sent on schedule whatever the
    answers), started `lead_s` before the decision so the source has a queue while targets load."""

    def __init__(self, url: str, api_key: str, model: str, rps: float, max_tokens: int, prompt_words: int = 0):
        self.url, self.api_key, self.model, self.rps, self.max_tokens = url, api_key, model, rps, max_tokens
        # A longer prompt makes prefill (what a live pair offloads) a larger share of the work.
        self.padding = " ".join(["token"] * prompt_words)
        # Each request: (sent, first token or None, last token or None, tokens, instance)
        self.requests: list[tuple[float, float | None, float | None, int, str]] = []
        self.stamps: list[float] = []
        self.instance_stamps: list[tuple[float, str]] = []
        self.failed = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._sender = threading.Thread(target=self._send, daemon=True)
        self._client = httpx.Client(timeout=300, headers={"Authorization": f"Bearer {api_key}"},
                                    limits=httpx.Limits(max_connections=1024, max_keepalive_connections=1024))

    def _send(self) -> None:
        start, i = time.time(), 0
        while not self._stop.is_set():
            t = threading.Thread(target=self._one, daemon=True)
            t.start()
            self._threads.append(t)
            i += 1
            self._stop.wait(max(0.0, start + i / self.rps - time.time()))

    def _one(self) -> None:
        body = {"model": self.model, "prompt": f"overload {uuid.uuid4().hex[:8]} {self.padding}".rstrip(),
                "max_tokens": self.max_tokens,
                "stream": True}
        sent, got = time.time(), _Streamed()
        try:
            _stream_completion(self._client, self.url, body, got, self._token)
        except httpx.HTTPError:
            with self._lock:
                self.failed += 1
        with self._lock:
            self.requests.append((sent, got.first, got.last, got.tokens, got.instance))

    def _token(self, now: float, instance: str) -> None:
        with self._lock:
            self.stamps.append(now)
            self.instance_stamps.append((now, instance))

    def start(self) -> None:
        self._sender.start()

    def stop_sending(self) -> None:
        self._stop.set()
        self._sender.join(10)

    def stop(self) -> None:
        self.stop_sending()
        [t.join(300) for t in list(self._threads)]
        self._client.close()

    timeline = _TokenCounter.timeline

    def instance_timeline(self, t0: float, t1: float, instances: set[str]) -> list[float]:
        n = max(1, int((t1 - t0) / TIMELINE_STEP_S + 0.999))
        counts = [0] * n
        with self._lock:
            for s, inst in self.instance_stamps:
                i = int((s - t0) / TIMELINE_STEP_S)
                if inst in instances and 0 <= i < n:
                    counts[i] += 1
        return [c / TIMELINE_STEP_S for c in counts]


# "First rise": a bucket above the pre-decision level by this fraction (100 ms buckets of a few
# requests are noisy: 25 % is about one more request's tokens at 16 tokens a request).
RISE_MARGIN = 0.25


def overload_report(counter: _Overload, *, decided: float, all_loaded: float | None, lead_s: float, end: float,
                    first_block_s: float | None, layer_load_s: float | None, warm: set[str],
                    timings: dict[str, float]) -> dict:
    """The overload stream's measures (times in seconds from the decision)."""
    t0 = decided - lead_s
    total = counter.timeline(t0, end)
    source = counter.instance_timeline(t0, end, warm)
    # The pre-scale-out level: the last second before the decision (the queue is built by then).
    baseline = mean_rate(total, TIMELINE_STEP_S, lead_s - 1.0, lead_s)
    rise = None
    if first_block_s is not None and baseline is not None:
        at = first_rise_s(total, TIMELINE_STEP_S, lead_s + first_block_s, baseline, RISE_MARGIN)
        rise = None if at is None else at - lead_s
    window_end = decided + all_loaded if all_loaded is not None else end
    return {"overload_window_s": [0.0, all_loaded],
            "overload_latency": window_latencies([(s, f, last) for s, f, last, *_ in counter.requests],
                                                 decided, window_end),
            "overload_requests": len(counter.requests),
            "overload_baseline_tokens_per_s": baseline,
            "first_block_s": first_block_s, "layer_load_s": layer_load_s,
            "first_rise_s": rise,
            "first_rise_layer_loads": (None if rise is None or first_block_s is None or not layer_load_s
                                       else (rise - first_block_s) / layer_load_s),
            "pair_events_s": {k: round(v - decided, 4) for k, v in sorted(timings.items(), key=lambda kv: kv[1])
                              if k.startswith(("paired:", "unpaired:"))},
            # from lead_s before the decision, every 100 ms
            "overload_timeline_origin_s": -lead_s,
            "overload_tokens_per_s_timeline": total, "source_tokens_per_s_timeline": source}


def timeline_marks(timings_s: dict[str, float]) -> list[tuple[str, float]]:
    """When the scale-out's execution pipelines formed and switched to local instances, in
    seconds after the decision (a scale operation's `pipeline_ready:` and `switched:` events)."""
    names = {"pipeline_ready:": "pipeline formed", "switched:": "switched"}
    return sorted(((label, t) for key, t in timings_s.items() for prefix, label in names.items()
                   if key.startswith(prefix)), key=lambda m: m[1])


def plot_timelines(path: Path, lines: dict[str, list[float]], step_s: float, title: str,
                   marks: dict[str, list[tuple[str, float]]] | None = None) -> None:
    """Tokens/s after the decision, one line per mode (matplotlib, as `bench trace --plot`);
    `marks` (per mode, timeline_marks) draws when its pipelines formed (dashed) and switched (dotted)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 4.5))
    for mode, values in lines.items():
        (line,) = ax.plot([i * step_s for i in range(len(values))], values, label=mode, linewidth=1.2)
        for label, t in (marks or {}).get(mode, []):
            ax.axvline(t, color=line.get_color(), linewidth=0.9, alpha=0.7,
                       linestyle="--" if label == "pipeline formed" else ":")
    if any((marks or {}).values()):
        ax.plot([], [], color="grey", linestyle="--", label="pipeline formed")
        ax.plot([], [], color="grey", linestyle=":", label="pipeline switched")
    ax.set_xlabel("seconds after the scale decision")
    ax.set_ylabel(f"tokens / s (bins of {step_s:g} s)")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _describe(h) -> dict | None:
    """The deployment as the admin API shows it; None while the (busy) gateway does not answer."""
    try:
        return h.describe()
    except httpx.HTTPError as e:
        _log(f"bench scale: admin API: {e!r}; retrying")
        return None


def bound_s(mode: str, op: dict, model_bytes: int, block_bytes: list[int], profile) -> float | None:
    """What physics allows the operation under the emulated rates (None: not emulated)."""
    if profile is None:
        return None
    h2d = (profile.host_to_device_mbit or 0) * 1e6 / 8
    tail = max(block_bytes) / h2d if h2d else 0.0  # the last block's copy into engine memory
    if mode == "ideal":
        return 0.0
    plan = op.get("plan") or {}
    if plan.get("kind") == "multicast" and profile.link_mbit:
        receivers, k = len(plan["receivers"]), plan["k"]
        multicast = build_plan(plan["algorithm"], k + receivers, len(block_bytes), k)
        return plan_bound_s(multicast, len(block_bytes), model_bytes, profile.link_mbit * 1e6 / 8, CHUNK_BYTES) + tail
    if profile.disk_read_mbit:  # every target reads its own disk, in parallel
        return model_bytes / (profile.disk_read_mbit * 1e6 / 8) + tail
    return None


def run_once(mode: str, *, workers: int, from_n: int, to_n: int, model_path: Path, state_dir: Path,
             emulate: bool, profile, concurrency: int, max_tokens: int, timeout_s: float,
             kv_cache_gb: float = KV_CACHE_GB, burst: int = 0, overload_rps: float = 0.0,
             overload_lead_s: float = 3.0, prompt_words: int = 0) -> dict:
    with mode_cluster(mode, workers=workers, model_path=model_path, state_dir=state_dir, emulate=emulate,
                      profile=profile, min_instances=from_n, max_instances=workers, keep_alive_s=3600,
                      scale_down_delay_s=3600, ready_timeout_s=timeout_s, kv_cache_gb=kv_cache_gb,
                      # The benchmark takes the decision: every mode the same policy, held back by the
                      # delay above (blitzscale's default, threshold, would scale in after 0.5 s idle).
                      policy="concurrency",
                      # Under the overload stream the load-monitor would scale out on its own during the
                      # lead (it did, 0.7 s in): out of its reach, so the benchmark's decision is the one.
                      target_concurrency=100_000 if overload_rps else None) as h:
        info = h.describe()
        block_bytes = [b["nbytes"] for b in sorted(info["blocks"], key=lambda b: b["block_id"])]
        model_bytes = sum(block_bytes)

        def settled() -> bool:  # the first load is done and the pool has nothing left to fill
            try:
                view = m.ClusterView.model_validate(h.admin("GET", "/admin/v1/cluster").raise_for_status().json())
            except httpx.HTTPError:
                return False
            ups = [o for o in view.scale_ops if o.model == h.model and o.direction == "up"]  # done: all loaded
            return bool(ups) and all(o.state != "running" for o in ups) and not plan_pool_fills(view, only_model=h.model)
        h.recorder.wait_for(lambda _r: settled(), timeout_s, "the deployment to settle")
        time.sleep(1.0)
        warm = {i["instance_id"] for i in h.describe()["instances"] if i["state"] == "ready"}
        if overload_rps:
            # One request through first: the first mode's instance served no token for ~4 s of the
            # stream in two runs (a cold first batch), which left it no pre-decision level to rise from.
            with httpx.Client(timeout=300, headers={"Authorization": f"Bearer {h.api_key}"}) as c:
                c.post(f"{h.gateway_url}/v1/completions", json={"model": h.model, "prompt": "warm-up",
                                                                "max_tokens": max_tokens}).raise_for_status()
            counter = _Overload(h.gateway_url, h.api_key, h.model, overload_rps, max_tokens, prompt_words)
            counter.start()
            time.sleep(overload_lead_s)  # the source's queue builds before the decision
        else:
            counter = (_Burst(h.gateway_url, h.api_key, h.model, burst, max_tokens) if burst else
                       _TokenCounter(h.gateway_url, h.api_key, h.model, concurrency, max_tokens))
        decided = asyncio.run(_decide(h.nats_url, h.namespace, h.model, to_n))
        _log(f"bench scale: {mode}: decided at {decided:.3f} (unix time)")
        if not overload_rps:
            counter.start()

        def finished():
            # From the scale-op events the recorder hears, not the admin API: polling that every
            # 50 ms during the burst took the gateway's and the registry's CPU from the burst.
            ops = [o for o in h.recorder.scale_ops(model=h.model, direction="up") if o.from_instances == from_n]
            if not ops or ops[-1].state not in ("done", "failed", "aborted"):
                return None
            ended = sum(k.startswith(("loaded:", "failed:", "stopped:", "draining:")) for k in ops[-1].timings)
            return ops[-1] if ended >= to_n - from_n or ops[-1].state != "done" else None
        op_id = h.recorder.wait_for(lambda _r: finished(), timeout_s, f"{mode}: the scale-out to {to_n}").scale_op_id
        end = time.time()
        time.sleep(1.0)  # the tokens/s of the scaled-out cluster, briefly
        counter.stop()
        splits = live_pair_splits(_worker_pages(h)) if overload_rps else {}
        if burst or overload_rps:  # the timeline runs until the burst's last token, however long after the scale-out
            end = max([end, *counter.stamps])
        # Transfer reports may land after the last instance loaded: read the record again.
        d = h.recorder.wait_for(lambda _r: _describe(h), 60, "the admin API")
        op = next(o for o in d["scale_ops"] if o["scale_op_id"] == op_id)
        t = op["timings"]
        loaded = sorted(v - decided for k, v in t.items() if k.startswith("loaded:"))
        blocks = [v for k, v in t.items() if k.startswith("block:")]
        first = t.get("first_byte") or (min(blocks) if blocks else None)
        bound = bound_s(mode, op, model_bytes, block_bytes, h.emulation.profile if h.emulation else None)
        all_ready = loaded[-1] if len(loaded) == to_n - from_n else None
        burst_times = counter.first_tokens(decided, warm) if burst else {}
        if overload_rps:
            link = h.emulation.profile.link_mbit if h.emulation else None
            burst_times = overload_report(
                counter, decided=decided, all_loaded=all_ready, lead_s=overload_lead_s, end=end,
                first_block_s=None if first is None else first - decided,
                # one block's load time on the emulated link
                layer_load_s=(sum(block_bytes) / len(block_bytes)) / (link * 1e6 / 8) if link else None,
                warm=warm, timings=t) | {"live_pair_splits": splits}
        return {"mode": mode, "plan": op["plan"], "first_byte_s": None if first is None else first - decided,
                **burst_times,
                "instance_ready_s": loaded, "all_ready_s": all_ready, "bound_s": bound,
                "ratio_to_bound": all_ready / bound if all_ready and bound else None,
                "tokens_per_s_timeline": counter.timeline(decided, end + 1.0), "failed_requests": counter.failed,
                # where decision -> first byte went: planned, parts acked (first_send), first byte
                "timings_s": {k: round(v - decided, 4) for k, v in sorted(t.items(), key=lambda kv: kv[1])
                              if not k.startswith("block:")},
                "model_bytes": model_bytes}


SPLITS_METRIC = "layercast_worker_live_pair_prefill_batches_total"


def live_pair_splits(pages: list[str]) -> dict[str, int]:
    """Prefill batches the workers' live-pair sources split, "policy:blocks on the target" ->
    count, summed over the workers' Prometheus pages."""
    out: dict[str, int] = {}
    for page in pages:
        for labels, value in re.findall(rf"^{SPLITS_METRIC}{{([^}}]*)}} (\S+)$", page, re.MULTILINE):
            got = dict(re.findall(r'(\w+)="([^"]*)"', labels))
            key = f"{got['policy']}:{got['blocks']}"
            out[key] = out.get(key, 0) + int(float(value))
    return dict(sorted(out.items(), key=lambda kv: (kv[0].split(":")[0], int(kv[0].split(":")[1]))))


def _worker_pages(h) -> list[str]:
    pages = []
    for p in h.state.processes:
        if p.name.startswith("worker") and p.health_url:
            try:
                pages.append(httpx.get(p.health_url.replace("/health", "/metrics"), timeout=5).text)
            except httpx.HTTPError:
                pass
    return pages


def overload_comparison(by: dict[str, dict]) -> dict:
    """Ratios of the requests sent during the scale-out, p90 and worst: blitzscale /
    blitzscale-nopairs, blitzscale / blitzscale-fixed (ZigZag at run time against a fixed
    split) and each mode / ideal (the issue's criterion: blitzscale / blitzscale-nopairs <= 0.7)."""
    def p90(mode: str, key: str) -> float | None:
        return ((by.get(mode) or {}).get("overload_latency") or {}).get(key)
    out = {}
    for key in ("first_token_p90_s", "last_token_p90_s", "first_token_max_s", "last_token_max_s"):
        pairs = [("blitzscale", "blitzscale-nopairs"), ("blitzscale", "blitzscale-fixed"),
                 *((mode, "ideal") for mode in by if mode != "ideal")]
        for mine, other in pairs:
            a, b = p90(mine, key), p90(other, key)
            if a is not None and b:
                out[f"{mine}_over_{other}_{key}"] = a / b
    return out


def burst_overheads(by: dict[str, dict]) -> dict:
    """Each mode's burst figures over `ideal`'s in the same run (every worker already holding
    the model: what is left is serving itself), in seconds, and layercast's overhead as a
    multiple of the others' (issue 41: <= 0.7 x binomial's, <= 0.25 x serverlessllm's); its new
    capacity's first token against binomial's, as measured."""
    ideal = by.get("ideal") or {}
    out = {}
    for key in BURST_KEYS:
        if ideal.get(key) is None:
            continue
        for mode, r in by.items():
            if mode != "ideal" and r.get(key) is not None:
                out[f"{mode}_{key[:-2]}_over_ideal_s"] = r[key] - ideal[key]
    mine = out.get("layercast_burst_first_token_over_ideal_s")
    for other in ("binomial", "serverlessllm", "faasnet"):
        theirs = out.get(f"{other}_burst_first_token_over_ideal_s")
        if mine is not None and theirs and theirs > 0:
            out[f"layercast_over_{other}_burst_overhead"] = mine / theirs
    a, b = ((by.get(m) or {}).get("new_capacity_first_token_s") for m in ("layercast", "binomial"))
    if a is not None and b:
        out["layercast_over_binomial_new_capacity_first_token"] = a / b
    return out


BURST_KEYS = ("burst_first_token_s", "new_capacity_first_token_s")
TRIAL_KEYS = ("first_byte_s", "all_ready_s", *BURST_KEYS, "bound_s", "ratio_to_bound", "timings_s", "burst_requests",
              "overload_latency", "first_rise_s", "first_rise_layer_loads", "pair_events_s", "live_pair_splits",
              "error")


def failed_trial(mode: str, error: str) -> dict:
    """A trial that did not finish, shaped like run_once's result (it counts as no time)."""
    return {"mode": mode, "plan": None, "first_byte_s": None, "instance_ready_s": [], "all_ready_s": None,
            "bound_s": None, "ratio_to_bound": None, "tokens_per_s_timeline": [], "failed_requests": 0,
            "model_bytes": None, "timings_s": {}, "error": error}


def _median(values: list[float | None]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def run_scale_benchmark(*, modes: list[str], workers: int, from_n: int, to_n: int, model_path: Path, state_dir: Path,
                        emulate: bool, profile=None, repeat: int = 3, concurrency: int | None = None,
                        max_tokens: int = 16, timeout_s: float = 600.0, burst: int = 0,
                        overload_rps: float = 0.0, overload_lead_s: float = 3.0, prompt_words: int = 0) -> dict:
    """Every mode `repeat` times; per mode the median trial (by all-ready time) and the medians."""
    if not 0 < from_n < to_n <= workers:
        raise ValueError(f"need 0 < --from ({from_n}) < --to ({to_n}) <= --workers ({workers})")
    results = []
    for mode in modes:
        trials = []
        for i in range(repeat):
            _log(f"bench scale: {mode}, trial {i + 1}/{repeat}")
            try:
                trials.append(run_once(mode, workers=workers, from_n=from_n, to_n=to_n, model_path=model_path,
                                       state_dir=state_dir / f"{mode}-{i}", emulate=emulate, profile=profile,
                                       concurrency=concurrency or to_n, max_tokens=max_tokens, timeout_s=timeout_s,
                                       burst=burst, overload_rps=overload_rps,
                                       overload_lead_s=overload_lead_s, prompt_words=prompt_words))
            except (ClusterError, TimeoutError, httpx.HTTPError) as e:
                # One broken trial must not lose the others (a full run takes a quarter of an hour).
                _log(f"bench scale: {mode}, trial {i + 1} failed: {e!r}; logs in {state_dir / f'{mode}-{i}'}")
                trials.append(failed_trial(mode, f"{type(e).__name__}: {e}"))
        ordered = sorted(trials, key=lambda r: (r["all_ready_s"] is None, r["all_ready_s"] or 0))
        median = dict(ordered[(len(ordered) - 1) // 2])
        median |= {"first_byte_s": _median([r["first_byte_s"] for r in trials]),
                   "all_ready_s": _median([r["all_ready_s"] for r in trials]),
                   **{k: _median([r.get(k) for r in trials]) for k in BURST_KEYS if burst},
                   "trials": [{k: r[k] for k in TRIAL_KEYS if k in r} for r in trials]}
        if median["all_ready_s"] and median["bound_s"]:
            median["ratio_to_bound"] = median["all_ready_s"] / median["bound_s"]
        results.append(median)
    by = {r["mode"]: r for r in results}
    comparison = {}
    if "layercast" in by and by["layercast"]["all_ready_s"]:
        for other in ("serverlessllm", "faasnet", "binomial", "chain", "chain-blind", "blitzscale", "blitzscale-fixed",
                      "blitzscale-nopairs", "ideal"):
            if other in by and by[other]["all_ready_s"]:
                comparison[f"{other}_over_layercast_all_ready"] = by[other]["all_ready_s"] / by["layercast"]["all_ready_s"]
    if burst and "layercast" in by:
        mine = by["layercast"]
        if mine.get("new_capacity_first_token_s") and mine["all_ready_s"]:
            comparison["layercast_new_capacity_first_token_over_all_ready"] = (
                mine["new_capacity_first_token_s"] / mine["all_ready_s"])
        # The floor of that ratio under the cost model (λScale §4.2): with one source the
        # receivers jointly hold the model only once it has sent every block, about when the
        # first copy completes; k sources bring the first pipeline to about b/k steps.
        pred = (mine.get("plan") or {}).get("predicted") or {}
        first = [v for v in (pred.get("first_pipeline_s"), pred.get("first_copy_s")) if v]
        if first and pred.get("completion_s"):
            comparison["layercast_predicted_first_capacity_over_completion"] = min(first) / pred["completion_s"]
        for other in ("binomial", "serverlessllm", "faasnet", "ideal"):
            if mine.get("burst_first_token_s") and by.get(other, {}).get("burst_first_token_s"):
                comparison[f"layercast_over_{other}_burst_first_token"] = (
                    mine["burst_first_token_s"] / by[other]["burst_first_token_s"])
    if burst:
        comparison |= burst_overheads(by)
    if overload_rps:
        comparison |= overload_comparison(by)
    return {"workers": workers, "from": from_n, "to": to_n, "repeat": repeat, "kv_cache_gb": KV_CACHE_GB,
            "burst": burst, "overload_rps": overload_rps, "overload_lead_s": overload_lead_s, "prompt_words": prompt_words,
            "request_streams": concurrency or to_n, "max_tokens": max_tokens, "prefill_ahead": WORKERS_PREFILL_AHEAD,
            "profile": None if profile is None else asdict(profile),
            "results": results, "comparison": comparison}
