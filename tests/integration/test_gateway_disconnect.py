"""A client that goes away mid-stream cancels its work on the worker: the worker's engine drops
the request (its cancel counter counts it, its running requests go back to none) and the
gateway's slot is released. Real processes: NATS, Postgres registry, planner, load-monitor, a
worker and the gateway, over HTTP."""

import json
import os
import re
import signal
import uuid

import httpx
import pytest

from conftest import TEST_ADMIN_KEY, TEST_API_KEY, one_worker_cluster, wait_for

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, nats_url, postgres_server_url, tiny_checkpoint):
    with one_worker_cluster(tmp_path_factory, postgres_server_url, tiny_checkpoint, nats_url,
                            f"lcd{uuid.uuid4().hex[:8]}") as state:
        yield state


def metric(url: str, name: str, labels: str = "") -> float:
    """A sample of a Prometheus text page (0 when it has none yet)."""
    found = re.search(rf"^{re.escape(name + labels)} (\S+)$", httpx.get(url).text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


def test_a_client_that_disconnects_mid_stream_cancels_its_request_on_the_worker(cluster):
    worker_proc = next(p for p in cluster.processes if p.name == "worker-0")
    worker = worker_proc.health_url.replace("/health", "/metrics")
    gateway = cluster.gateway_url + "/metrics"
    headers = {"Authorization": f"Bearer {TEST_API_KEY}"}
    body = {"model": "tiny", "prompt": "Once upon a time", "temperature": 0}
    warm = httpx.post(cluster.gateway_url + "/v1/completions", json={**body, "max_tokens": 2}, headers=headers,
                      timeout=120)
    assert warm.status_code == 200, warm.text
    cancelled_before = metric(worker, "layercast_worker_cancelled_requests_total")

    with httpx.Client(headers=headers, timeout=120) as client:
        with client.stream("POST", cluster.gateway_url + "/v1/completions",
                           json={**body, "max_tokens": 2000, "stream": True}) as r:
            assert r.status_code == 200
            chunks = 0
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    assert json.loads(line[6:])["choices"][0]["finish_reason"] is None
                    chunks += 1
                    if chunks == 3:
                        break
            # The tiny model makes 2000 tokens in about a second: the worker is paused, so the
            # request is still in its engine when the cancel reaches it (no race with its end).
            os.kill(worker_proc.pid, signal.SIGSTOP)
            try:
                wait_for(lambda: metric(gateway, "layercast_gateway_in_flight_requests", '{model="tiny"}') == 1, 30,
                         "the gateway to count the request in flight")
            except BaseException:
                os.kill(worker_proc.pid, signal.SIGCONT)
                raise
    try:
        # The client has gone: the gateway ends the request and releases its slot.
        wait_for(lambda: metric(gateway, "layercast_gateway_in_flight_requests", '{model="tiny"}') == 0, 30,
                 "the gateway to release the request's slot")
    finally:
        os.kill(worker_proc.pid, signal.SIGCONT)
    # The cancel the gateway sent reached the worker, whose engine dropped the request unfinished.
    wait_for(lambda: metric(worker, "layercast_worker_cancelled_requests_total") == cancelled_before + 1, 30,
             "the worker's engine to drop the request")
    wait_for(lambda: metric(worker, "layercast_worker_running_requests") == 0, 30, "the worker to run nothing")
    again = httpx.post(cluster.gateway_url + "/v1/completions", json={**body, "max_tokens": 2}, headers=headers,
                       timeout=120)
    assert again.status_code == 200, again.text
    # That request finished on its own: no cancel counted for it.
    assert metric(worker, "layercast_worker_cancelled_requests_total") == cancelled_before + 1
