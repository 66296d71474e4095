"""A gateway restarted (SIGKILL, then started again) while the registry does not answer: until
it has read the registry it is live but not ready, holds model requests a few seconds for that
read and then answers them 503 + Retry-After, never 404 (a client takes a 404 as final); once it has read it, it serves, and a request the
official `openai` client sent to it meanwhile succeeds through the client's own retries.
Real processes: NATS, Postgres registry, planner, load-monitor, a worker and the gateway."""

import os
import re
import signal
import threading

import httpx
import openai
import pytest

from conftest import TEST_ADMIN_KEY, TEST_API_KEY, running_cluster, wait_for
from libs.cluster.launcher import find_process, restart_process
from test_serving_e2e import assert_openai_error

pytestmark = pytest.mark.slow

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4, "temperature": 0}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, nats_url, postgres_server_url, tiny_checkpoint):
    # A long heartbeat TTL: the registry is stopped for seconds here, and must not take the
    # worker's queued heartbeats for missed ones when it resumes.
    with running_cluster(postgres_server_url, tiny_checkpoint, dict(min_instances=1, max_instances=1,
                                                                    keep_alive_s=600),
                         state_dir=tmp_path_factory.mktemp("cluster"), api_key=TEST_API_KEY,
                         admin_key=TEST_ADMIN_KEY, workers=1, nats_url=nats_url,
                         namespace="lcr" + os.urandom(4).hex(), heartbeat_ttl_s=60.0) as state:
        yield state


def answers(client: httpx.Client, path: str) -> int | None:
    try:
        return client.get(path).status_code
    except httpx.TransportError:
        return None


def refused_chats(client: httpx.Client) -> float:
    """How many chat completions the gateway answered 503 (its own request counter)."""
    text = client.get("/metrics").text
    found = re.search(r'layercast_gateway_requests_total\{endpoint="/v1/chat/completions",status="503"\} (\S+)',
                      text)
    return float(found.group(1)) if found else 0.0


def test_a_restarted_gateway_answers_503_until_it_has_read_the_registry_and_the_openai_client_retries_through(
        cluster):
    http = httpx.Client(base_url=cluster.gateway_url, headers={"Authorization": f"Bearer {TEST_API_KEY}"},
                        timeout=60)
    assert http.post("/v1/chat/completions", json=CHAT).status_code == 200  # served before the restart
    registry = find_process(cluster, "registry")
    os.kill(registry.pid, signal.SIGSTOP)  # the registry does not answer: the restarted gateway cannot read it
    try:
        restart_process(cluster, "gateway")  # SIGKILL, then started again as the launcher started it
        wait_for(lambda: answers(http, "/livez") == 200, 60, "the restarted gateway to be live")
        ready = http.get("/health")
        assert ready.status_code == 503 and ready.json() == {"status": "starting"}  # live, not ready

        r = http.post("/v1/chat/completions", json=CHAT)  # held for the read, which does not come
        err = assert_openai_error(r, 503)
        assert err["code"] == "gateway_starting" and err["type"] == "service_unavailable_error"
        assert int(r.headers["Retry-After"]) >= 1
        assert assert_openai_error(http.get("/v1/models"), 503)["code"] == "gateway_starting"

        # The official client, default retries (2, honouring Retry-After).
        client = openai.OpenAI(base_url=cluster.gateway_url + "/v1", api_key=TEST_API_KEY)
        result: dict = {}

        def send() -> None:
            try:
                result["raw"] = client.chat.completions.with_raw_response.create(**CHAT)
            except Exception as e:  # reported by the assertion below
                result["error"] = e
        sender = threading.Thread(target=send)
        sender.start()
        # Its first attempt has been refused (the gateway counted a second 503 chat): only now
        # may the registry answer, so the success below can only come from the client's retry.
        wait_for(lambda: refused_chats(http) >= 2 or not sender.is_alive(), 30, "the client's first attempt")
    finally:
        os.kill(registry.pid, signal.SIGCONT)
    sender.join(60)
    assert "error" not in result, result.get("error")
    raw = result["raw"]
    assert raw.retries_taken >= 1, "succeeded without a retry: the first attempt was not refused"
    completion = raw.parse()
    assert completion.choices[0].finish_reason in ("stop", "length") and completion.usage.completion_tokens >= 1
    assert http.get("/health").status_code == 200  # it has read the registry: ready
    assert [m["id"] for m in http.get("/v1/models").json()["data"]] == ["tiny"]
    # Once read, a model the registry does not list is a 404 as before, not a 503.
    assert assert_openai_error(http.post("/v1/chat/completions", json={**CHAT, "model": "nope"}), 404)["code"] \
        == "model_not_found"
