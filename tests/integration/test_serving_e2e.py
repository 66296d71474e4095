"""The whole slice as separate processes: NATS, Postgres, registry, planner,
load-monitor, gateway and two workers, driven through the HTTP API and the
official `openai` client."""

import json
import os
import re
import shutil
import signal
import threading
import time
import uuid
from pathlib import Path

import httpx
import openai
import pytest
import torch
from transformers import AutoTokenizer

from libs.checkpoint import CheckpointIndex
from libs.engine.engine import checkpoint_eos_ids
from conftest import running_cluster, wait_for
from openapi_check import check_declared, check_declared_stream
from conftest_models import reference_model

pytestmark = pytest.mark.slow

API_KEY, ADMIN_KEY = "sk-test-api", "sk-test-admin"
QUEUE_TIMEOUT_S = 4


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, nats_url, postgres_server_url, tiny_checkpoint):
    with running_cluster(
            postgres_server_url, tiny_checkpoint, dict(min_instances=0, max_instances=2, keep_alive_s=600),
            state_dir=tmp_path_factory.mktemp("cluster"), api_key=API_KEY, admin_key=ADMIN_KEY, workers=2,
            nats_url=nats_url, namespace=f"lce{uuid.uuid4().hex[:8]}", heartbeat_ttl_s=2.0,
            extra_env={"LAYERCAST_QUEUE_TIMEOUT": str(QUEUE_TIMEOUT_S),
                       # workers load into a reserved host arena (the production set-up)
                       "LAYERCAST_HOST_ARENA_GB": "0.05",
                       # spans go to the logs, so a test can follow one trace across processes
                       "OTEL_TRACES_EXPORTER": "console", "OTEL_BSP_SCHEDULE_DELAY": "100"}) as state:
        yield state


def api(cluster, key: str | None = API_KEY) -> httpx.Client:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.Client(base_url=cluster.gateway_url, headers=headers, timeout=60)


def admin(cluster) -> httpx.Client:
    return api(cluster, ADMIN_KEY)


def instances(cluster, model: str, state: str | None = "ready") -> list[dict]:
    described = admin(cluster).get(f"/admin/v1/models/{model}").json()
    return [i for i in described["instances"] if state is None or i["state"] == state]



def assert_openai_error(r: httpx.Response, status: int, param: str | None = None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param, err
    return err


def test_first_request_scales_from_zero_then_warm(cluster):
    assert instances(cluster, "tiny", state=None) == []
    body = {"model": "tiny", "prompt": "Hello there", "max_tokens": 8, "temperature": 0}
    t0 = time.perf_counter()
    r = api(cluster).post("/v1/completions", json=body)
    cold = time.perf_counter() - t0
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["object"] == "text_completion" and out["choices"][0]["finish_reason"] == "length"
    assert out["usage"]["completion_tokens"] == 8
    t0 = time.perf_counter()
    assert api(cluster).post("/v1/completions", json=body).json()["choices"][0]["text"] == out["choices"][0]["text"]
    warm = time.perf_counter() - t0
    print(f"\nfirst request from zero: {cold * 1000:.0f} ms, warm: {warm * 1000:.0f} ms")
    (inst,) = instances(cluster, "tiny")
    # Events reach the registry asynchronously (the instance serves from its first block on, and
    # the answer can come back before the last block's event is recorded): wait for them.
    def done_scale_up():
        ops = admin(cluster).get("/admin/v1/models/tiny").json()["scale_ops"]
        up = [op for op in ops if op["direction"] == "up"]
        return up and up[-1]["state"] == "done" and up[-1]
    up = wait_for(done_scale_up, 10, "the scale-up to be recorded as done")
    assert {"decided", "planned", f"ready:{inst['instance_id']}"} <= set(up["timings"])
    worker = inst["stages"][0]["worker_id"]

    def held():
        replicas = admin(cluster).get("/admin/v1/models/tiny").json()["replicas"]
        return {(r["block_id"], r["tier"]) for r in replicas if r["worker_id"] == worker}
    wait_for(lambda: held() >= {(0, "gpu"), (1, "gpu")}, 10, "both blocks recorded in the worker's engine tier")


def test_greedy_output_equals_hugging_face_generate(cluster, tiny_checkpoint):
    """Greedy completions equal Hugging Face generate() on the same weights, whole and non-empty.

    Both stop by the same rule: `max_tokens` (12), or the first token in the engine's stop set
    (the checkpoint's eos ids: config.json and generation_config.json), which the reference is
    given as its eos_token_id, so no stop token is forced past. The reference is decoded as the
    gateway decodes (special tokens skipped), and the finish reason and token count follow."""
    max_tokens = 12
    hf_dir = Path(tiny_checkpoint).parent / "hf"
    stop_ids = sorted(checkpoint_eos_ids(tiny_checkpoint, CheckpointIndex.load(tiny_checkpoint)))
    assert stop_ids  # the platform does stop at eos: the reference must follow the same rule
    tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoint)  # the one the gateway loads
    model = reference_model(hf_dir)  # weights in aligned memory, as the workers hold them
    for prompt in ("The quick brown fox", "a"):
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        with torch.inference_mode():
            ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                                 do_sample=False, eos_token_id=stop_ids, pad_token_id=tokenizer.pad_token_id)
        new = ref[0, ids.shape[1]:].tolist()
        new = new[:next((i + 1 for i, t in enumerate(new) if t in stop_ids), len(new))]  # padding after a stop
        expected = tokenizer.decode(new, skip_special_tokens=True)
        finish = "stop" if new and new[-1] in stop_ids else "length"
        assert expected, (prompt, new)  # a reference that says nothing would prove nothing
        r = api(cluster).post("/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": max_tokens,
                                                      "temperature": 0})
        assert r.status_code == 200, r.text
        got = r.json()
        assert got["choices"][0]["text"] == expected, (prompt, new)
        assert got["choices"][0]["finish_reason"] == finish
        assert got["usage"]["completion_tokens"] == len(new)  # an eos counts as generated


def test_openai_client_completion_and_streamed_chat(cluster):
    client = openai.OpenAI(base_url=cluster.gateway_url + "/v1", api_key=API_KEY)
    assert [m.id for m in client.models.list()] == ["tiny"]
    done = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=10, temperature=0)
    assert done.choices[0].finish_reason in ("length", "stop") and done.usage.completion_tokens >= 1
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    full = client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0)
    assert full.choices[0].message.role == "assistant"
    stream = client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert text == full.choices[0].message.content
    assert finishes == [full.choices[0].finish_reason]
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    streamed = list(client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=10,
                                              temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == done.choices[0].text
    # A chunk per generated token, even while its text is held back (a client sees the first
    # token when it comes).
    assert len([c for c in streamed if c.choices]) == done.usage.completion_tokens


def test_answers_are_declared_in_the_gateways_openapi_document(cluster):
    """200s of the OpenAI routes (JSON and streamed, logprobs included) and errors validate against
    the schemas the gateway's own /openapi.json declares for them."""
    c = api(cluster)
    doc = c.get("/openapi.json").json()
    messages = [{"role": "user", "content": "Hi!"}]
    check_declared(doc, "/v1/models", "GET", c.get("/v1/models"))
    chat = c.post("/v1/chat/completions", json={"model": "tiny", "messages": messages, "max_tokens": 6,
                                                 "logprobs": True, "top_logprobs": 2})
    assert chat.status_code == 200, chat.text
    check_declared(doc, "/v1/chat/completions", "POST", chat)
    done = c.post("/v1/completions", json={"model": "tiny", "prompt": "Once", "max_tokens": 6, "logprobs": 1})
    assert done.status_code == 200, done.text
    check_declared(doc, "/v1/completions", "POST", done)
    options = {"stream": True, "stream_options": {"include_usage": True}, "max_tokens": 6}
    assert check_declared_stream(doc, "/v1/chat/completions", c.post(
        "/v1/chat/completions", json={"model": "tiny", "messages": messages, **options})) >= 2
    assert check_declared_stream(doc, "/v1/completions", c.post(
        "/v1/completions", json={"model": "tiny", "prompt": "Once", **options})) >= 2
    check_declared(doc, "/v1/chat/completions", "POST", c.post("/v1/chat/completions", json={
        "model": "nope", "messages": messages}))  # 404
    check_declared(doc, "/v1/models", "GET", api(cluster, key=None).get("/v1/models"))  # 401


def test_seeds_stop_sequences_and_sampling_parameters(cluster):
    c = api(cluster)
    body = {"model": "tiny", "prompt": "seeded", "max_tokens": 16, "temperature": 1.0, "top_p": 0.9, "seed": 7}
    a, b = (c.post("/v1/completions", json=body).json()["choices"][0]["text"] for _ in range(2))
    assert a == b
    others = {c.post("/v1/completions", json={**body, "seed": s}).json()["choices"][0]["text"] for s in range(8, 12)}
    assert len(others | {a}) > 1
    base = c.post("/v1/completions", json={"model": "tiny", "prompt": "stop here", "max_tokens": 24,
                                           "temperature": 0}).json()["choices"][0]["text"]
    stop = base[5:8]
    assert stop and stop in base
    cut = c.post("/v1/completions", json={"model": "tiny", "prompt": "stop here", "max_tokens": 24,
                                          "temperature": 0, "stop": [stop]}).json()
    assert cut["choices"][0]["text"] == base[:base.index(stop)]
    assert cut["choices"][0]["finish_reason"] == "stop"
    # A stop string completed only by the text held back to the end (the detokenizer keeps an incomplete
    # UTF-8 tail: here the last token's bytes become U+FFFD only when the stream ends) still ends with "stop".
    short = {"model": "tiny", "prompt": "The quick brown fox", "max_tokens": 4, "temperature": 0}
    tail = c.post("/v1/completions", json=short).json()["choices"][0]["text"]
    assert "\ufffd\ufffd" in tail
    held = c.post("/v1/completions", json={**short, "stop": ["\ufffd\ufffd"]}).json()["choices"][0]
    assert (held["text"], held["finish_reason"]) == (tail[:tail.index("\ufffd\ufffd")], "stop")


def test_every_bad_request_gets_an_openai_error(cluster):
    ok = {"model": "tiny", "prompt": "x", "max_tokens": 2}
    assert_openai_error(api(cluster, None).post("/v1/completions", json=ok), 401)
    assert_openai_error(api(cluster, "sk-wrong").post("/v1/completions", json=ok), 401)
    assert_openai_error(api(cluster, None).get("/v1/models"), 401)
    c = api(cluster)
    assert_openai_error(c.post("/v1/completions", json={**ok, "model": "nope"}), 404, "model")
    assert_openai_error(c.post("/v1/chat/completions", json={"model": "nope", "messages": [
        {"role": "user", "content": "x"}]}), 404, "model")
    assert_openai_error(c.post("/v1/completions", content=b"{not json",
                               headers={"Content-Type": "application/json"}), 400)
    assert_openai_error(c.post("/v1/completions", json={**ok, "temperature": 5}), 400, "temperature")
    assert_openai_error(c.post("/v1/completions", json={**ok, "top_p": 0}), 400, "top_p")
    assert_openai_error(c.post("/v1/completions", json={**ok, "max_tokens": 0}), 400, "max_tokens")
    assert_openai_error(c.post("/v1/completions", json={**ok, "max_tokens": 10**6}), 400, "max_tokens")
    assert_openai_error(c.post("/v1/completions", json={**ok, "n": 9}), 400, "n")  # above LAYERCAST_MAX_N (8)
    assert_openai_error(c.post("/v1/completions", json={**ok, "stop": ["a", "b", "c", "d", "e"]}), 400, "stop")
    assert_openai_error(c.post("/v1/completions", json={"model": "tiny"}), 400, "prompt")
    assert_openai_error(c.post("/v1/completions", json={**ok, "prompt": [1, 10**9]}), 400, "prompt")
    assert_openai_error(c.post("/v1/chat/completions", json={"model": "tiny", "messages": []}), 400, "messages")
    assert_openai_error(c.post("/v1/chat/completions", json={"model": "tiny", "messages": [
        {"role": "wizard", "content": "x"}]}), 400)
    assert_openai_error(c.get("/v1/nothing-here"), 404)
    # admin API: its own key, validated paths
    assert_openai_error(c.get("/admin/v1/cluster"), 401)
    a = admin(cluster)
    assert_openai_error(a.post("/admin/v1/models", json={"name": "x", "path": "/does/not/exist"}), 400, "path")
    assert_openai_error(a.post("/admin/v1/models", json={"name": "x", "path": "/tmp"}), 400, "path")
    assert_openai_error(a.post("/admin/v1/models", json={"name": "bad name!", "path": "/tmp"}), 400, "name")
    assert_openai_error(a.post("/admin/v1/models", json={"name": "x", "path": "/tmp", "policy_params": {"tarjet": 4}}),
                        400, "policy_params")
    assert_openai_error(a.get("/admin/v1/models/nope"), 404)
    assert_openai_error(a.delete("/admin/v1/models/nope"), 404)
    # nothing above disturbed serving
    assert c.post("/v1/completions", json=ok).status_code == 200


def corrupt_copy(checkpoint: Path, dest: Path, block: int) -> Path:
    shutil.copytree(checkpoint, dest)
    index = CheckpointIndex.load(dest)
    with open(dest / index.data_file, "r+b") as f:
        f.seek(index.blocks[block].offset + 10)
        byte = f.read(1)
        f.seek(index.blocks[block].offset + 10)
        f.write(bytes([byte[0] ^ 0xFF]))
    return dest


def worker_logs(cluster) -> str:
    return "".join(Path(p.log).read_text(errors="replace") for p in cluster.processes if p.name.startswith("worker"))


def test_corrupt_block_is_never_served_and_a_full_queue_says_retry_later(cluster, tiny_checkpoint, tmp_path):
    # Block 0 corrupt: the instance never becomes ready, so requests queue, then time out.
    broken = corrupt_copy(tiny_checkpoint, tmp_path / "broken", block=0)
    r = admin(cluster).post("/admin/v1/models", json={"name": "broken", "path": str(broken), "max_queue": 1})
    assert r.status_code == 201, r.text
    results: dict[str, httpx.Response] = {}

    def first() -> None:
        results["first"] = api(cluster).post("/v1/completions", json={"model": "broken", "prompt": "x"})

    t = threading.Thread(target=first)
    t.start()
    time.sleep(1.0)
    second = api(cluster).post("/v1/completions", json={"model": "broken", "prompt": "y"})
    assert_openai_error(second, 429)
    assert int(second.headers["Retry-After"]) >= 1
    t.join(QUEUE_TIMEOUT_S + 30)
    assert_openai_error(results["first"], 503)
    assert int(results["first"].headers["Retry-After"]) >= 1
    assert instances(cluster, "broken") == []
    assert "checksum mismatch" in worker_logs(cluster).lower() and "block 0" in worker_logs(cluster)
    assert worker_logs(cluster).count("host arena of") == 2  # both workers load into reserved memory
    assert admin(cluster).delete("/admin/v1/models/broken").status_code == 200


def test_a_corrupt_later_block_fails_the_instance_that_started_serving_early(cluster, tiny_checkpoint, tmp_path):
    # Block 1 corrupt: the instance is announced after block 0 (serving while loading), the request
    # that reaches it waits for block 1 inside the engine, and the checksum failure ends both, with
    # a clear error; no token computed from a half-loaded model is ever returned.
    broken = corrupt_copy(tiny_checkpoint, tmp_path / "late", block=1)
    r = admin(cluster).post("/admin/v1/models", json={"name": "late", "path": str(broken)})
    assert r.status_code == 201, r.text
    resp = api(cluster).post("/v1/completions", json={"model": "late", "prompt": "x", "max_tokens": 2})
    err = assert_openai_error(resp, 503)
    assert int(resp.headers["Retry-After"]) >= 1
    # It reached the early instance (the engine's checksum error, or the instance's failure event
    # dropping its route), reached it just after it failed (refused at dispatch), or found no
    # capacity left while the planner retried: all "unavailable, retry", never tokens.
    assert err["code"] in ("generation_failed", "model_unavailable") or err["message"].startswith("no capacity"), err
    wait_for(lambda: "block 1" in worker_logs(cluster) and "checksum mismatch" in worker_logs(cluster).lower(),
             10, "the worker to log the checksum failure")
    # The planner retries the scale-up while demand lasts; each attempt is announced after block 0
    # and fails at block 1, so a retried request fails the same way and never gets a token.
    again = api(cluster).post("/v1/completions", json={"model": "late", "prompt": "y", "max_tokens": 2})
    assert_openai_error(again, 503)
    assert admin(cluster).delete("/admin/v1/models/late").status_code == 200


def test_keep_alive_scale_down_then_warm_start_on_the_worker_holding_host_copies(cluster, tiny_checkpoint):
    r = admin(cluster).post("/admin/v1/models", json={"name": "brief", "path": str(tiny_checkpoint),
                                                     "keep_alive_s": 1.0})
    assert r.status_code == 201, r.text
    c = api(cluster)
    assert c.post("/v1/completions", json={"model": "brief", "prompt": "x", "max_tokens": 2}).status_code == 200
    (inst,) = instances(cluster, "brief")
    worker = inst["stages"][0]["worker_id"]

    def measured_disk_gbps():  # the worker measured its disk load and reported it (estimator input)
        view = admin(cluster).get("/admin/v1/cluster").json()
        return next(w for w in view["workers"] if w["worker_id"] == worker)["bandwidths_gbps"].get("ssd_to_host")
    assert wait_for(measured_disk_gbps, 10, "the disk bandwidth in the registry") > 0
    wait_for(lambda: not instances(cluster, "brief", state=None), 15, "scale to zero after keep-alive")
    assert [m["id"] for m in c.get("/v1/models").json()["data"]].count("brief") == 1  # still listed at zero
    replicas = admin(cluster).get("/admin/v1/models/brief").json()["replicas"]
    # Host copies only: the instance's worker's, and the pool's off that worker once it is made.
    # (Beside them each worker reports the checkpoint on its own disk in the ssd tier.)
    assert (worker, "host") in {(r["worker_id"], r["tier"]) for r in replicas}
    assert {r["tier"] for r in replicas} - {"ssd"} == {"host"}
    holders = {r["worker_id"] for r in replicas if r["tier"] == "host"}
    assert c.post("/v1/completions", json={"model": "brief", "prompt": "x", "max_tokens": 2}).status_code == 200
    (again,) = instances(cluster, "brief")
    assert again["stages"][0]["worker_id"] in holders  # locality: a host copy wins
    assert admin(cluster).delete("/admin/v1/models/brief").status_code == 200
    assert "brief" not in [m["id"] for m in c.get("/v1/models").json()["data"]]
    assert_openai_error(c.post("/v1/completions", json={"model": "brief", "prompt": "x"}), 404, "model")
    wait_for(lambda: not instances(cluster, "brief", state=None), 15, "deleted model's instances to stop")


def test_a_dead_worker_is_expired_and_traffic_moves_to_the_other(cluster):
    c = api(cluster)
    assert c.post("/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 2}).status_code == 200
    (inst,) = instances(cluster, "tiny")
    victim = inst["stages"][0]["worker_id"]
    proc = next(p for p in cluster.processes if p.name == victim)
    os.kill(proc.pid, signal.SIGKILL)
    wait_for(lambda: victim not in {w["worker_id"] for w in admin(cluster).get("/admin/v1/cluster").json()["workers"]},
             15, "heartbeat expiry")
    r = c.post("/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 2})
    assert r.status_code == 200, r.text
    (moved,) = instances(cluster, "tiny")
    assert moved["stages"][0]["worker_id"] != victim


def spans(cluster, process_prefix: str) -> list[dict]:
    """Console-exported spans (one JSON object each) from the logs of some processes."""
    found = []
    for p in cluster.processes:
        if p.name.startswith(process_prefix):
            text = Path(p.log).read_text(errors="replace")
            for blob in re.findall(r"^\{\n.*?^\}$", text, flags=re.S | re.M):
                try:
                    found.append(json.loads(blob))
                except json.JSONDecodeError:
                    pass
    return found


def test_one_trace_spans_gateway_and_worker_and_metrics_are_exported(cluster):
    c = api(cluster)
    assert c.post("/v1/completions", json={"model": "tiny", "prompt": "trace me", "max_tokens": 3}).status_code == 200

    def joined():
        gateway = {s["context"]["trace_id"] for s in spans(cluster, "gateway") if s["name"] == "gateway.generate"}
        worker = {s["context"]["trace_id"] for s in spans(cluster, "worker") if s["name"] == "worker.generate"}
        return gateway & worker

    assert wait_for(joined, 10, "a gateway and a worker span in one trace")
    metrics = c.get("/metrics").text
    for name in ("layercast_gateway_ttft_seconds_bucket", "layercast_gateway_inter_token_seconds_bucket",
                 "layercast_gateway_queue_depth", "layercast_gateway_requests_total"):
        assert name in metrics
