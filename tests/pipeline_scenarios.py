"""Execution-pipeline scenarios (λScale §4.3-4.4) shared by the in-process-throttled
integration tests and the emulated-cluster (root) tests: the same requests and checks over
either kind of cluster.

The cluster (five workers) starts with two warm instances of `four_blocks` and the parameter
pool's host copy of it on a third worker, and is scaled to five: the pool's worker loads its
own copy, and a k-way (k = 2) binomial multicast goes to the two others, whose links are slow
enough that it takes seconds. The receivers jointly hold the model after about half the
blocks; the planner starts them as one execution pipeline.

The scale-out waits for the pool's copy: a target holding a whole host copy loads it locally
instead of receiving, so a scale-out racing that copy would have one receiver or two.

The pipeline serves only from its forming to the receivers' last block (about two blocks'
transfer: ~3 s at 0.7 Mbit/s), and a request takes seconds on a loaded machine. So the
clusters run with one gateway slot per instance and more clients than routes: requests wait
in the gateway's queue when the pipeline becomes routable, and the queue hands the head to
it at once (a free slot is taken on arrival of the route, not of the next request). With
four clients and 16 slots per instance, every client was busy on a warm instance through a
1.1 s pipeline and none reached it."""

import asyncio
import json
import os
import re
import signal
import threading
import time
from collections.abc import Callable

import httpx

from conftest import described, request_scale, wait_for

API_KEY, ADMIN_KEY = "sk-test-api", "sk-test-admin"
PROMPT = "the pipeline keeps serving while"
MAX_TOKENS = 48
WORKERS = 5
DEPLOY = dict(min_instances=2, max_instances=WORKERS, keep_alive_s=600, scaling_mode="layercast")
# Every cluster of these scenarios: no scale-in during the test; one request per instance at a
# time at the gateway (what an instance cannot take waits in the gateway's queue: see above);
# each worker's block sends paced to 0.7 Mbit/s in process (seconds per block: the pipeline
# serves for seconds). Clients: more than the routes a scale-out to WORKERS has besides the
# pipeline (WORKERS local instances), so one is always queued.
# A receiver waits for its blocks behind its source's other sends at that pace: the planner's
# transfer stall (15 s) could fail a part on a crowded machine, the rest then read from disk at once
# and the pipeline switched within seconds (CI: the fault suite's kill found no pipeline to stop).
CLUSTER_ENV = {"LAYERCAST_SCALE_DOWN_DELAY": "600", "LAYERCAST_SLOTS_PER_INSTANCE": "1",
               "LAYERCAST_EMULATED_LINK_MBIT": "0.7", "LAYERCAST_TRANSFER_STALL_S": "60"}
# The kill scenarios' clusters pace at half that: they stop the later stage up to 10 times before a
# request is mid-generation there, and on a crowded CI machine that outlasted a 0.7 Mbit/s multicast
# (the pipeline switched before the kill).
KILL_CLUSTER_ENV = {**CLUSTER_ENV, "LAYERCAST_EMULATED_LINK_MBIT": "0.35"}
CLIENTS = WORKERS + 2


def four_blocks(tmp_path_factory, preset: str = "tiny"):
    from libs.checkpoint import convert_checkpoint, create_demo_checkpoint

    root = tmp_path_factory.mktemp(f"four-blocks-{preset}")
    hf = create_demo_checkpoint(root / "hf", preset=preset, arch="llama", seed=0)
    return convert_checkpoint(hf, root / "blocks", 4) and root / "blocks"


class Stream:
    """One completion as its client sees it: the instance the gateway sent it to (its
    x-layercast-instance header), the tokens received so far (a chunk each), its text, its end."""

    def __init__(self):
        self.instance: str | None = None
        self.tokens, self.text, self.ended = 0, "", False
        self.generating = threading.Event()  # its first token came


def complete(cluster, stream: Stream | None = None) -> str:
    """One streamed completion; its text (the stream must end with a finish reason)."""
    stream = stream or Stream()
    finish = None
    try:
        with httpx.stream("POST", f"{cluster.gateway_url}/v1/completions", timeout=60,
                          headers={"Authorization": f"Bearer {API_KEY}"},
                          json={"model": "tiny", "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0,
                                "stream": True}) as r:
            assert r.status_code == 200, r.read()
            stream.instance = r.headers.get("x-layercast-instance")
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    chunk = json.loads(line[6:])
                    assert "choices" in chunk, chunk
                    choice = chunk["choices"][0]
                    stream.text += choice["text"]
                    stream.tokens += 1  # the gateway sends a chunk per token (its text may be empty)
                    stream.generating.set()
                    finish = choice["finish_reason"] or finish
    finally:
        stream.ended = True
    assert finish in ("length", "stop")
    return stream.text


def tokens_by_mode(cluster, mode: str, workers: set[str] | None = None) -> float:
    """Tokens generated in `mode` on the workers (`workers` only, if given: a killed one has no metrics)."""
    total = 0.0
    for p in cluster.processes:
        if p.name.startswith("worker") and (workers is None or p.name in workers):
            for line in httpx.get(p.health_url.replace("/health", "/metrics"), timeout=10).text.splitlines():
                if line.startswith("layercast_worker_generated_tokens_total{") and f'mode="{mode}"' in line:
                    total += float(line.rsplit(" ", 1)[1])
    return total


class Clients:
    """Clients sending the same greedy completion over and over, from `n` threads (started
    `stagger_s` apart)."""

    def __init__(self, cluster, n: int = CLIENTS, stagger_s: float = 0.05):
        self.cluster, self.texts, self.errors = cluster, [], []
        self.streams: list[Stream] = []  # every request's, in the order they were sent
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._loop, args=(i * stagger_s,)) for i in range(n)]

    def _loop(self, delay_s: float):
        self._stop.wait(delay_s)
        while not self._stop.is_set():
            stream = Stream()
            self.streams.append(stream)
            try:
                self.texts.append(complete(self.cluster, stream))
            except Exception as e:  # noqa: BLE001 - every failure is reported by the test
                self.errors.append(repr(e))

    def __enter__(self):
        [t.start() for t in self._threads]
        return self

    def __exit__(self, *exc):
        self._stop.set()
        [t.join(90) for t in self._threads]


def warm(cluster) -> str:
    """Two local instances ready and loaded, and the pool's copy complete; the greedy text."""
    wait_for(lambda: sum(i["state"] == "ready" for i in described(cluster)["instances"]) == 2, 90,
             "two warm instances")
    wait_for(lambda: all(i["loaded_at"] for i in described(cluster)["instances"]), 30, "both loaded")
    wait_for(lambda: len(host_copies(cluster)) == 3, 90, "the pool's host copy on a third worker")
    return complete(cluster)


def host_copies(cluster) -> list[str]:
    """The live workers holding every block of the model in host memory (multicast sources)."""
    view = httpx.get(f"{cluster.gateway_url}/admin/v1/cluster", timeout=10,
                     headers={"Authorization": f"Bearer {ADMIN_KEY}"}).json()
    blocks = {b["block_id"] for x in view["models"] if x["name"] == "tiny" for b in x["blocks"]}
    held: dict[str, set[int]] = {}
    for r in view["replicas"]:
        if r["model"] == "tiny" and r["tier"] == "host" and r["state"] == "ready":
            held.setdefault(r["worker_id"], set()).add(r["block_id"])
    return [w["worker_id"] for w in view["workers"] if w["state"] == "alive" and blocks <= held.get(w["worker_id"], set())]


def expirations(cluster) -> list[str]:
    """The registry's log lines on workers it took for dead (why a plan lost a worker)."""
    return [line for p in cluster.processes if p.name == "registry"
            for line in open(p.log, errors="replace") if "expired" in line]


def scale_out_done(cluster):
    ops = [o for o in described(cluster)["scale_ops"] if o["direction"] == "up" and o["from_instances"] == 2]
    return ops[0] if ops and ops[0]["state"] == "done" else None


def serves_before_any_receiver_holds_the_model_then_switches(cluster, nats_url):
    """The pipeline serves before either receiver holds the whole model, then retires."""
    reference = warm(cluster)
    request_scale(nats_url, WORKERS)
    with Clients(cluster) as clients:
        op = wait_for(lambda: scale_out_done(cluster), 120, "the scale-out to four")
        time.sleep(1.0)  # requests moved by the switch finish on the local instances
    texts, errors = clients.texts, clients.errors

    # Two receivers (k = 2); the pool's worker loads its own copy.
    assert op["plan"]["algorithm"] == "binomial" and op["plan"]["k"] == 2, (op, host_copies(cluster),
                                                                          expirations(cluster))
    assert op["plan"]["pipelines"] == [sorted(op["plan"]["receivers"], key=op["plan"]["receivers"].index)]
    timings, instances = op["timings"], described(cluster)["instances"]
    receiving = {i["instance_id"] for i in instances
                 if i["mode"] == "local" and i["stages"][0]["worker_id"] in op["plan"]["receivers"]}
    ready = [t for k, t in timings.items() if k.startswith("pipeline_ready:")]
    loaded = [t for k, t in timings.items() if k.startswith("loaded:") and k.split(":", 1)[1] in receiving]
    switched = [t for k, t in timings.items() if k.startswith("switched:")]
    assert len(ready) == 1 and len(loaded) == 2 and len(switched) == 1, (op, instances, expirations(cluster))
    # The pipeline served before either receiver held the whole model, and retired after both did.
    assert ready[0] < min(loaded) <= max(loaded) <= switched[0]
    assert tokens_by_mode(cluster, "pipeline") > 0, (f"the pipeline served {switched[0] - ready[0]:.2f} s",
                                                     len(texts), errors)
    # Through the pipeline, across the switch, on the local instances: the same greedy text, nothing lost.
    assert errors == [] and len(texts) >= 4
    assert all(t == reference for t in texts)

    instances = described(cluster)["instances"]
    pipelines = [i for i in instances if i["mode"] == "pipeline"]
    assert [i["state"] for i in pipelines] in ([], ["stopped"])  # retired (the view may drop stopped ones)
    assert sum(i["state"] == "ready" and i["mode"] == "local" for i in instances) == WORKERS


def gateway_handovers(cluster) -> float:
    text = httpx.get(f"{cluster.gateway_url}/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("layercast_gateway_handovers_total{"))


class PipelineWatch:
    """The first execution pipeline announced serving, seen when its entry publishes it: the
    admin API, polled, answered seconds late on a loaded machine (a kill aimed that way landed
    up to 11 s after the pipeline had switched, and no stage was killed mid-request)."""

    def __init__(self, nats_url: str):
        self.nats_url, self.instance, self.serving = nats_url, None, threading.Event()
        self.loaded: set[str] = set()  # workers whose own (local) instance announced every block held
        self._listening, self._stop = threading.Event(), threading.Event()
        self._thread = threading.Thread(target=asyncio.run, args=(self._watch(),), daemon=True)

    async def _watch(self):
        from libs.bus.broker import make_broker, start_broker
        from libs.protocol import messages as m
        from libs.protocol import subjects

        broker = make_broker(self.nats_url)

        @broker.subscriber(subjects.EVENT_INSTANCE)
        async def seen(body: dict) -> None:
            inst = m.InstanceEvent.model_validate(body).instance
            if inst.mode == "local" and inst.loaded_at is not None:
                self.loaded.add(inst.entry_worker)
            if inst.mode == "pipeline" and inst.state == m.InstanceState.ready and self.instance is None:
                self.instance = inst
                self.serving.set()

        await start_broker(broker)
        self._listening.set()
        try:
            while not self._stop.is_set():
                await asyncio.sleep(0.05)
        finally:
            await broker.stop()

    def __enter__(self):
        self._thread.start()
        assert self._listening.wait(30), "subscribed to instance events"
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(10)


def registry_counter(cluster, name: str) -> float:
    """A counter of the registry (summed over its labels), from its /metrics."""
    p = next(p for p in cluster.processes if p.name == "registry")
    text = httpx.get(p.health_url.replace("/health", "/metrics"), timeout=10).text
    return sum(float(v) for v in re.findall(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M))


def stop_with_a_request_stuck(cluster, streams: Callable[[], list], pipeline, victim_pid: int, length: int):
    """SIGSTOP the pipeline's later stage with a request on the pipeline mid-generation that cannot
    finish; that request's stream (the stage stays stopped: the caller kills it, or another stage).
    `streams()`: every request's stream so far (a Stream, or anything with its instance, tokens,
    ended and generating), every request of the clients streamed: a request whose tokens its client
    does not see as they come would make the entry's count never add up.

    Killed as soon as the pipeline had generated, the stage often had nothing to do: its request
    had ended (a multiple of 48 tokens published at the kill in 2 of 3 runs), and the gateway
    counted a hand-over only if it sent the next one there before it dropped the route; on a
    fast machine none came, and no hand-over was counted. Stopped, the stage completes no more
    steps: the entry gets at most the reply already sent (one token more: one slot per instance,
    a request's micro-batch one at a time), and a request sent there later not even its first.
    So a pipeline stream that has every token the entry published (none on the way: the sum of
    the pipeline streams' tokens is the entry's count, read after them), one or more, and two
    or more to go is in flight until the kill. Otherwise the stage goes on until the request
    has its first token (or, one short, its end), and is stopped again."""
    def open_stream():
        seen = [(s, s.tokens, s.ended) for s in streams() if s.instance == pipeline.instance_id]
        published = tokens_by_mode(cluster, "pipeline", {pipeline.entry_worker})
        if sum(t for _, t, _ in seen) != published:
            return None  # tokens on their way to a client: a stream's count is not the entry's yet
        # (One with all its tokens is over, its end on the way.) None open: the next request sent
        # there (the clients keep every route busy) is stuck before its first token.
        return min(((s, t) for s, t, ended in seen if not ended and t < length), key=lambda st: st[1], default=None)

    try:
        for _ in range(10):
            os.kill(victim_pid, signal.SIGSTOP)
            stream, tokens = wait_for(open_stream, 20, "a request on the pipeline, every token it got received")
            if 1 <= tokens <= length - 2:
                print(f"stopped the pipeline's later stage with a request at {tokens} of {length} tokens on it")
                return stream
            os.kill(victim_pid, signal.SIGCONT)
            if tokens == 0:
                assert stream.generating.wait(20), "the request on the pipeline getting its first token"
            else:  # its last token may be on its way: let it end
                wait_for(lambda: stream.ended, 20, "the request with one token to go ending")
        raise AssertionError("no request on the pipeline mid-generation at any of 10 stops")
    except BaseException:
        os.kill(victim_pid, signal.SIGCONT)  # the cluster's teardown stops it as any other
        raise


def stage_worker_killed_mid_request_loses_no_accepted_request(cluster, nats_url, unreachable_death: bool = False):
    """A pipeline's later stage dies mid-request: every accepted request ends whole elsewhere.

    `unreachable_death`: the cluster's heartbeat TTL is long, no supervisor sees the kill: the
    death must come from the broken data-plane connections (a peer's WorkerUnreachable, the
    registry's connect refused), the registry's counter of such deaths says so."""
    reference = warm(cluster)
    sample = Stream()
    complete(cluster, sample)
    length = sample.tokens  # every request's (greedy: the same tokens)
    with PipelineWatch(nats_url) as watch:
        request_scale(nats_url, WORKERS)
        with Clients(cluster) as clients:
            assert watch.serving.wait(60), "a pipeline serving"
            pipeline = watch.instance
            victim = pipeline.stages[1].worker_id
            victim_pid = next(p for p in cluster.processes if p.name == victim).pid
            stuck = stop_with_a_request_stuck(cluster, lambda: list(clients.streams), pipeline, victim_pid, length)
            killed_at = time.monotonic()
            os.kill(victim_pid, signal.SIGKILL)
            if unreachable_death:
                wait_for(lambda: registry_counter(cluster, "layercast_registry_worker_unreachable_deaths_total") >= 1,
                         20, f"the registry to declare {victim} dead from a broken data-plane connection")
                print(f"{victim} declared dead {time.monotonic() - killed_at:.2f} s after its SIGKILL (seen by "
                      "polling the registry's /metrics every 0.1 s)")
                assert registry_counter(cluster, "layercast_registry_worker_expirations_total") == 0
                assert any(f"worker {victim} unreachable" in line for p in cluster.processes if p.name == "registry"
                           for line in open(p.log, errors="replace"))
            wait_for(lambda: next((i for i in described(cluster)["instances"]
                                   if i["instance_id"] == pipeline.instance_id and i["state"] == "failed"), None)
                     or pipeline.instance_id not in {i["instance_id"] for i in described(cluster)["instances"]},
                     30, "the pipeline failed")
            wait_for(lambda: stuck.ended, 60, "the request stuck on the pipeline ending elsewhere")
    # Every accepted request finished with the whole text, nothing lost or repeated.
    assert clients.errors == [] and len(clients.texts) >= 4, (clients.errors, len(clients.texts))
    assert all(t == reference for t in clients.texts), (reference, [t for t in clients.texts if t != reference])
    assert stuck.ended and stuck.text == reference  # the one on the pipeline at the kill, handed over
    assert tokens_by_mode(cluster, "pipeline", {pipeline.entry_worker}) > 0  # (its entry counts its tokens)
    assert gateway_handovers(cluster) >= 1
    # The scale-out went on without the dead worker: the other receiver serves on its own. The
    # victim's own instance (serving while its blocks arrived) ends too (heartbeat TTL at the latest).
    wait_for(lambda: victim not in {i["stages"][0]["worker_id"] for i in described(cluster)["instances"]
                                    if i["state"] == "ready" and i["mode"] == "local"},
             30, "no ready instance on the dead worker")
    wait_for(lambda: sum(i["state"] == "ready" and i["mode"] == "local" and i["loaded_at"] is not None
                         for i in described(cluster)["instances"]) >= WORKERS - 1, 60, "the other receiver loaded")
    # The kill came while the pipeline served: it failed, it never switched.
    op = wait_for(lambda: scale_out_done(cluster), 60, "the scale-out closed")
    assert f"switched:{pipeline.instance_id}" not in op["timings"], op["timings"]
