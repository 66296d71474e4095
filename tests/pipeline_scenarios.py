"""Execution-pipeline scenarios (λScale §4.3-4.4) shared by the in-process-throttled
integration tests and the emulated-cluster (root) tests: the same requests and checks over
either kind of cluster.

The cluster (five workers) starts with two warm instances of `four_blocks` and the parameter
pool's host copy of it on a third worker, and is scaled to five: the pool's worker loads its
own copy, and a k-way (k = 2) binomial multicast goes to the two others, whose links are slow
enough that it takes seconds. The receivers jointly hold the model after about half the
blocks; the planner starts them as one execution pipeline.

The scale-out waits for the pool's copy: a target holding a whole host copy loads it locally
instead of receiving, so a scale-out racing that copy would have one receiver or two."""

import json
import os
import signal
import threading
import time

import httpx

from conftest import described, request_scale, wait_for

API_KEY, ADMIN_KEY = "sk-test-api", "sk-test-admin"
PROMPT = "the pipeline keeps serving while"
MAX_TOKENS = 48
WORKERS = 5
DEPLOY = dict(min_instances=2, max_instances=WORKERS, keep_alive_s=600, scaling_mode="layercast")


def four_blocks(tmp_path_factory, preset: str = "tiny"):
    from libs.checkpoint import convert_checkpoint, create_demo_checkpoint

    root = tmp_path_factory.mktemp(f"four-blocks-{preset}")
    hf = create_demo_checkpoint(root / "hf", preset=preset, arch="llama", seed=0)
    return convert_checkpoint(hf, root / "blocks", 4) and root / "blocks"


def complete(cluster) -> str:
    """One streamed completion; its text (the stream must end with a finish reason)."""
    text, finish = "", None
    with httpx.stream("POST", f"{cluster.gateway_url}/v1/completions", timeout=60,
                      headers={"Authorization": f"Bearer {API_KEY}"},
                      json={"model": "tiny", "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0,
                            "stream": True}) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                assert "choices" in chunk, chunk
                choice = chunk["choices"][0]
                text += choice["text"]
                finish = choice["finish_reason"] or finish
    assert finish in ("length", "stop")
    return text


def tokens_by_mode(cluster, mode: str) -> float:
    total = 0.0
    for p in cluster.processes:
        if p.name.startswith("worker"):
            for line in httpx.get(p.health_url.replace("/health", "/metrics"), timeout=10).text.splitlines():
                if line.startswith("layercast_worker_generated_tokens_total{") and f'mode="{mode}"' in line:
                    total += float(line.rsplit(" ", 1)[1])
    return total


class Clients:
    """Clients sending the same greedy completion over and over, from `n` threads.

    Their starts are staggered by `stagger_s`: started together, they would run as one batch
    and send their next requests together, once per request's length, and a pipeline that
    serves for less than that could see none of them."""

    def __init__(self, cluster, n: int = 4, stagger_s: float = 0.3):
        self.cluster, self.texts, self.errors = cluster, [], []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._loop, args=(i * stagger_s,)) for i in range(n)]

    def _loop(self, delay_s: float):
        self._stop.wait(delay_s)
        while not self._stop.is_set():
            try:
                self.texts.append(complete(self.cluster))
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


def stage_worker_killed_mid_request_loses_no_accepted_request(cluster, nats_url):
    """A pipeline's later stage dies mid-request: every accepted request ends whole elsewhere."""
    reference = warm(cluster)
    request_scale(nats_url, WORKERS)
    with Clients(cluster) as clients:
        pipeline = wait_for(lambda: next((i for i in described(cluster)["instances"]
                                          if i["mode"] == "pipeline" and i["state"] == "ready"), None),
                            60, "a pipeline serving")
        # Requests are running on it: it has generated tokens (a fixed sleep saw none once the
        # gateway took a moment to route to it, and then no request had anything to hand over).
        wait_for(lambda: tokens_by_mode(cluster, "pipeline") > 0, 30, "the pipeline generating")
        victim = pipeline["stages"][1]["worker_id"]
        process = next(p for p in cluster.processes if p.name == victim)
        os.kill(process.pid, signal.SIGKILL)
        wait_for(lambda: next((i for i in described(cluster)["instances"]
                               if i["instance_id"] == pipeline["instance_id"] and i["state"] == "failed"), None)
                 or pipeline["instance_id"] not in {i["instance_id"] for i in described(cluster)["instances"]},
                 30, "the pipeline failed")
        time.sleep(2.0)  # its requests went on elsewhere
    # Every accepted request finished with the whole text, nothing lost or repeated.
    assert clients.errors == [] and len(clients.texts) >= 4, (clients.errors, len(clients.texts))
    assert all(t == reference for t in clients.texts), (reference, [t for t in clients.texts if t != reference])
    assert gateway_handovers(cluster) >= 1
    # The scale-out went on without the dead worker: the other receiver serves on its own. On a
    # loaded machine the pipeline may switch just before the kill, so the victim can hold a local
    # instance of its own for a moment: it must be ended (heartbeat TTL at the latest).
    wait_for(lambda: victim not in {i["stages"][0]["worker_id"] for i in described(cluster)["instances"]
                                    if i["state"] == "ready" and i["mode"] == "local"},
             30, "no ready instance on the dead worker")
    wait_for(lambda: sum(i["state"] == "ready" and i["mode"] == "local" and i["loaded_at"] is not None
                         for i in described(cluster)["instances"]) >= WORKERS - 1, 60, "the other receiver loaded")
