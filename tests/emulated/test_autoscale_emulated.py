"""Autoscaling end to end on an emulated cluster (workers in network namespaces, capped links):
a scale-out by multicast serves from every new worker, a model scales to zero and back while
staying listed, and a worker killed in the middle of a scale-out loses no request and leaves a
complete host copy behind.

Root only (skipped with the reason elsewhere); CI runs as root.
"""

import os
import signal
import threading
import uuid

import httpx
import pytest

from conftest import described, request_scale, running_cluster, wait_for
from libs.protocol import subjects
from libs.cluster.emulation import EmulatedCluster, can_emulate

_ok, _why = can_emulate()
pytestmark = [pytest.mark.root, pytest.mark.slow, pytest.mark.skipif(not _ok, reason=_why)]

API_KEY, ADMIN_KEY = "sk-test-api", "sk-test-admin"
LINK_MBIT = 80  # the small model (~30 MB) takes seconds to multicast: long enough to kill a worker in it


@pytest.fixture(scope="module")
def small_checkpoint(tmp_path_factory):
    from libs.checkpoint import convert_checkpoint, create_demo_checkpoint

    root = tmp_path_factory.mktemp("small-model")
    convert_checkpoint(create_demo_checkpoint(root / "hf", preset="small", seed=1), root / "blocks", 4)
    return root / "blocks"


def emulated_cluster(tmp_path_factory, postgres_server_url, checkpoint, workers: int, link_mbit: float = LINK_MBIT):
    # The tests ask for scale-outs themselves (as the load-monitor would); the load-monitor holds
    # back scale-ins for the whole test, and the model never idles out.
    emulation = EmulatedCluster(workers, link_mbit=link_mbit).start()
    try:
        with running_cluster(
                postgres_server_url, checkpoint,
                dict(min_instances=1, max_instances=workers, keep_alive_s=600, scaling_mode="layercast"),
                emulation=emulation, state_dir=tmp_path_factory.mktemp("cluster"), api_key=API_KEY,
                admin_key=ADMIN_KEY, workers=workers, namespace=subjects.PREFIX,
                extra_env={"LAYERCAST_SCALE_DOWN_DELAY": "600"}) as state:
            yield state
    finally:
        emulation.close()


def admin(cluster) -> httpx.Client:
    return httpx.Client(base_url=cluster.gateway_url, timeout=10, headers={"Authorization": f"Bearer {ADMIN_KEY}"})


def instances(cluster, *states: str) -> list[dict]:
    return [i for i in described(cluster)["instances"] if not states or i["state"] in states]


def ready_workers(cluster) -> set[str]:
    return {i["stages"][0]["worker_id"] for i in instances(cluster, "ready")}


def host_blocks(cluster) -> dict[str, set[int]]:
    alive = {w["worker_id"] for w in admin(cluster).get("/admin/v1/cluster").json()["workers"]}
    out: dict[str, set[int]] = {}
    for r in described(cluster)["replicas"]:
        if r["tier"] == "host" and r["worker_id"] in alive:
            out.setdefault(r["worker_id"], set()).add(r["block_id"])
    return out


def ask_for(cluster, desired: int) -> None:
    request_scale(cluster.nats_url, desired)


def complete(cluster, max_tokens: int = 24) -> httpx.Response:
    return httpx.post(f"{cluster.gateway_url}/v1/completions", timeout=120,
                      headers={"Authorization": f"Bearer {API_KEY}"},
                      json={"model": "tiny", "prompt": f"hello {uuid.uuid4().hex}", "max_tokens": max_tokens})


def tokens_per_worker(cluster) -> dict[str, float]:
    out = {}
    for p in cluster.processes:
        if p.name.startswith("worker") and p.health_url:
            try:
                text = httpx.get(p.health_url.replace("/health", "/metrics"), timeout=5).text
            except httpx.HTTPError:
                continue
            out[p.name] = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                              if line.startswith("layercast_worker_generated_tokens_total{"))
    return out


class RequestStream:
    """Requests sent back to back from a few threads until stopped; every response is kept."""

    def __init__(self, cluster, threads: int = 3):
        self.cluster, self.results, self._stop = cluster, [], threading.Event()
        self._threads = [threading.Thread(target=self._run, daemon=True) for _ in range(threads)]

    def _run(self):
        while not self._stop.is_set():
            try:
                r = complete(self.cluster, max_tokens=32)
                self.results.append((r.status_code, r.json()))
            except (httpx.HTTPError, ValueError) as e:  # counts as lost: nothing may go missing silently
                self.results.append((0, {"error": repr(e)}))

    def __enter__(self):
        [t.start() for t in self._threads]
        return self

    def __exit__(self, *exc):
        self._stop.set()
        [t.join(180) for t in self._threads]


@pytest.fixture(scope="module")
def four_workers(tmp_path_factory, postgres_server_url, small_checkpoint):
    yield from emulated_cluster(tmp_path_factory, postgres_server_url, small_checkpoint, 4)


def test_scale_1_to_4_by_multicast_then_every_worker_serves(four_workers):
    cluster = four_workers
    (source,) = wait_for(lambda: ready_workers(cluster), 90, "the first instance")
    wait_for(lambda: source in {w for w, b in host_blocks(cluster).items() if len(b) == 4}, 60, "its host copy")
    ask_for(cluster, 4)
    wait_for(lambda: len(ready_workers(cluster)) == 4, 90, "four instances")
    op = wait_for(lambda: next((o for o in described(cluster)["scale_ops"] if o["direction"] == "up" and
                                o["from_instances"] == 1 and o["state"] == "done"), None), 90, "the scale-out")
    # From the serving worker's host copy (the parameter pool may have put a second copy on
    # another worker by then: that worker is a source too).
    held = {w for w, b in host_blocks(cluster).items() if len(b) == 4}
    assert op["plan"]["kind"] == "multicast" and source in op["plan"]["sources"]
    assert set(op["plan"]["sources"]) <= held, (op["plan"]["sources"], held)
    # Each of the three other workers receives the multicast or loads its own host copy.
    others = set(op["plan"]["receivers"]) | (set(op["plan"]["sources"]) - {source})
    assert len(others) == 3
    assert sum(k.startswith("loaded:") for k in op["timings"]) == 3
    # Timed from the decision: the first byte, then every instance loaded.
    assert op["timings"]["decided"] <= op["timings"]["first_send"] <= op["timings"]["first_byte"]
    assert max(v for k, v in op["timings"].items() if k.startswith("loaded:")) <= op["timings"]["done"]

    def every_worker_generates():
        threads = [threading.Thread(target=lambda: complete(cluster)) for _ in range(8)]
        [t.start() for t in threads]
        [t.join() for t in threads]
        counts = tokens_per_worker(cluster)
        return len(counts) == 4 and all(v > 0 for v in counts.values())
    wait_for(every_worker_generates, 90, "tokens generated on all four workers")


def test_scale_to_zero_and_back_on_the_next_request_listed_throughout(four_workers, small_checkpoint):
    cluster = four_workers
    r = admin(cluster).post("/admin/v1/models", json={"name": "brief", "path": str(small_checkpoint),
                                                     "keep_alive_s": 3.0, "scaling_mode": "layercast"})
    assert r.status_code == 201, r.text
    api = httpx.Client(base_url=cluster.gateway_url, timeout=120, headers={"Authorization": f"Bearer {API_KEY}"})

    def brief_instances():
        return [i for i in admin(cluster).get("/admin/v1/models/brief").json()["instances"]
                if i["state"] in ("loading", "ready", "draining")]

    def listed():
        return "brief" in [x["id"] for x in api.get("/v1/models").json()["data"]]

    for _ in range(2):  # from zero (the first request), back to zero after the keep-alive, and again
        assert listed()
        r = api.post("/v1/completions", json={"model": "brief", "prompt": "x", "max_tokens": 8})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] > 0
        assert brief_instances()
        wait_for(lambda: not brief_instances() and listed(), 60, "scale to zero after the keep-alive")
    # The parameter pool kept a complete host copy of it at zero instances.
    replicas = admin(cluster).get("/admin/v1/models/brief").json()["replicas"]
    per_worker: dict[str, set[int]] = {}
    for x in replicas:
        if x["tier"] == "host":
            per_worker.setdefault(x["worker_id"], set()).add(x["block_id"])
    assert any(len(b) == 4 for b in per_worker.values())


@pytest.fixture(scope="module")
def three_workers(tmp_path_factory, postgres_server_url, small_checkpoint, four_workers):
    # Half the link rate: the kill must land while a receiver holds some blocks but not all, seen by
    # polling the registry, and on a crowded CI machine that window passed unseen at 80 Mbit/s.
    yield from emulated_cluster(tmp_path_factory, postgres_server_url, small_checkpoint, 3, link_mbit=LINK_MBIT / 2)


def test_killing_the_source_mid_scale_out_loses_no_request_and_restores_the_host_copy(three_workers):
    cluster = three_workers
    (source,) = wait_for(lambda: ready_workers(cluster), 90, "the first instance")
    wait_for(lambda: source in {w for w, b in host_blocks(cluster).items() if len(b) == 4}, 60, "its host copy")
    with RequestStream(cluster) as stream:
        wait_for(lambda: stream.results, 60, "requests served by the first instance")
        ask_for(cluster, 3)
        # Kill the worker sending the model once some of it has arrived elsewhere, but not all.
        wait_for(lambda: any(0 < len(b) < 4 for w, b in host_blocks(cluster).items() if w != source), 60,
                 "the multicast under way")
        proc = next(p for p in cluster.processes if p.name == source)
        os.kill(proc.pid, signal.SIGKILL)
        # The receivers finish from their disks and serve; the requests on the source move to them.
        wait_for(lambda: len(ready_workers(cluster) - {source}) == 2, 120, "two new instances")
        op = wait_for(lambda: next((o for o in described(cluster)["scale_ops"] if o["direction"] == "up" and
                                    o["from_instances"] == 1 and o["state"] == "done"), None), 120, "the scale-out")
        served = len(stream.results)
        wait_for(lambda: len(stream.results) >= served + 6, 120, "requests served after the kill")
    failed = [body for status, body in stream.results if status != 200]
    assert failed == [], failed[:3]
    assert all(body["usage"]["completion_tokens"] > 0 for _, body in stream.results)
    assert sum(k.startswith("loaded:") for k in op["timings"]) == 2  # completed on the others
    # A complete host copy survives on a live worker (the parameter pool's invariant).
    wait_for(lambda: any(len(b) == 4 for w, b in host_blocks(cluster).items() if w != source), 60,
             "a complete host copy on a live worker")
