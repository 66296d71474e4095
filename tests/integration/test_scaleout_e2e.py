"""Scale-out by multicast, as processes: the planner moves a model's blocks from the worker
holding a host copy to new workers over the data plane (the deployment's scaling mode picks
the algorithm), each new worker loads from its host tier, and the gateway serves from all."""

import threading
import uuid

import httpx
import pytest

from conftest import described, request_scale, running_cluster, wait_for
from libs.protocol import subjects

pytestmark = pytest.mark.slow

API_KEY, ADMIN_KEY = "sk-test-api", "sk-test-admin"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, postgres_server_url, tiny_checkpoint):
    # The test asks for the scale-out itself (as the load-monitor would), so the cluster uses its
    # subject namespace; the load-monitor holds back scale-ins for the whole test. No NATS_URL: the
    # cluster runs its own NATS with a user per service (libs/bus/auth.py), as `layercast up` does,
    # so the multicast below also runs under each service's NATS rights.
    with running_cluster(
            postgres_server_url, tiny_checkpoint,
            dict(min_instances=1, max_instances=3, keep_alive_s=600, scaling_mode="binomial"),
            state_dir=tmp_path_factory.mktemp("cluster"), api_key=API_KEY, admin_key=ADMIN_KEY, workers=3,
            namespace=subjects.PREFIX,
            extra_env={"LAYERCAST_SCALE_DOWN_DELAY": "600"}) as state:
        yield state


def ready_workers(cluster) -> set[str]:
    return {i["stages"][0]["worker_id"] for i in described(cluster)["instances"] if i["state"] == "ready"}


def worker_metrics(cluster) -> dict[str, str]:
    return {p.name: httpx.get(p.health_url.replace("/health", "/metrics"), timeout=10).text
            for p in cluster.processes if p.name.startswith("worker")}


def sample(text: str, name: str, **labels) -> float:
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    for line in text.splitlines():
        if line.startswith(f"{name}{{{want}}}" if labels else f"{name} "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_a_scale_out_multicasts_from_the_host_copy_and_the_new_instances_serve(cluster):
    # min_instances=1: the first instance reads the checkpoint from disk and leaves a host copy.
    first = wait_for(lambda: ready_workers(cluster), 60, "the first instance")
    source = next(iter(first))
    wait_for(lambda: sample(worker_metrics(cluster)[source], "layercast_worker_block_load_bytes_total",
                            tier="ssd") > 0, 10, "the first load")  # process names are the worker ids

    # The parameter pool keeps its copy off the serving worker: a second worker gets one, from
    # the first over the data plane (not from its disk).
    n_blocks = len(described(cluster)["blocks"])

    def pool_copy() -> str | None:
        host: dict[str, int] = {}
        for r in described(cluster)["replicas"]:
            if r["tier"] == "host" and r["state"] == "ready" and r["worker_id"] != source:
                host[r["worker_id"]] = host.get(r["worker_id"], 0) + 1
        return next((w for w, n in host.items() if n == n_blocks), None)
    pool = wait_for(pool_copy, 60, "the pool's copy off the serving worker")

    request_scale(cluster.nats_url, 3)  # as the operator (the state file's NATS URL carries its password)
    workers = wait_for(lambda: w if len(w := ready_workers(cluster)) == 3 else None, 60, "three instances")
    receivers = workers - first - {pool}  # the pool's worker loads its own copy (and may send)

    def scale_op() -> dict:
        return next(o for o in described(cluster)["scale_ops"] if o["direction"] == "up" and o["from_instances"] == 1)

    def transferred(o: dict) -> set[str]:
        return {k.split(":", 1)[1] for k in o["timings"] if k.startswith("transferred:")}
    op = scale_op()
    assert op["plan"]["kind"] == "multicast" and op["plan"]["algorithm"] == "binomial"
    assert set(op["plan"]["sources"]) <= {source, pool} and set(op["plan"]["receivers"]) == receivers
    # A receiver's transfer report is its own event: the registry may record it after the
    # instance it fed is ready.
    # 30 s: on a crowded machine the registry records it seconds late (twice 10 s were not enough).
    op = wait_for(lambda: o if transferred(o := scale_op()) == receivers else None, 30,
                  "every receiver's transfer report")
    assert sum(k.startswith("ready:") for k in op["timings"]) == 2
    assert op["timings"]["planned"] <= op["timings"]["first_send"] <= op["timings"]["first_block"]
    # The record carries each target's estimated load time, and the measured one beside it once
    # the operation closed.
    op = wait_for(lambda: o if (o := scale_op())["state"] == "done" else None, 30, "the scale-out to close")
    assert set(op["plan"]["estimated_load_s"]) == set(op["plan"]["targets"]) == receivers | {pool}
    assert set(op["plan"]["measured_load_s"]) == set(op["plan"]["targets"])
    # Every worker reads the checkpoint from its own disk here: each reports it in the ssd tier.
    ssd = {r["worker_id"] for r in described(cluster)["replicas"] if r["tier"] == "ssd" and r["state"] == "ready"}
    assert workers <= ssd

    # The new workers got every byte over the data plane (the pool's worker before the scale-out)
    # and loaded from their host tier, not disk.
    metrics = worker_metrics(cluster)
    model_bytes = sum(b["nbytes"] for b in described(cluster)["blocks"])
    for w in receivers:
        assert sample(metrics[w], "layercast_worker_transfer_bytes_total", algorithm="binomial",
                      direction="received") == model_bytes
        # ... and measured the rate it received at (the planner's chains read it from the registry).
        assert sample(metrics[w], "layercast_worker_load_bandwidth_bytes_per_second", link="network_to_host") > 0
    for w in receivers | {pool}:
        assert sample(metrics[w], "layercast_worker_block_load_bytes_total", tier="host") == model_bytes
        assert sample(metrics[w], "layercast_worker_block_load_bytes_total", tier="ssd") == 0
    sent = sum(sample(t, "layercast_worker_transfer_bytes_total", algorithm="binomial", direction="sent")
               for t in metrics.values())
    assert sent == len(receivers) * model_bytes  # binomial: each byte crosses the network once per receiver

    # The gateway routes to every instance (least loaded first): concurrent requests reach all three.
    def burst():
        errors = []

        def one():
            r = httpx.post(f"{cluster.gateway_url}/v1/completions", timeout=60,
                           headers={"Authorization": f"Bearer {API_KEY}"},
                           json={"model": "tiny", "prompt": f"hello {uuid.uuid4().hex}", "max_tokens": 64})
            if r.status_code != 200:
                errors.append(r.text)
        threads = [threading.Thread(target=one) for _ in range(9)]
        [t.start() for t in threads]
        [t.join() for t in threads]
        assert errors == []
        return all(sample(t, "layercast_worker_generated_tokens_total", mode="local", model="tiny") > 0
                   for t in worker_metrics(cluster).values())

    wait_for(burst, 60, "tokens generated on every worker")
