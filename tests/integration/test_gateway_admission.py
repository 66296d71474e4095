"""Admission at the gateway, over HTTP against a real cluster: what is refused before any
work (bodies over the size limit, prompts that cannot fit the context), large prompts
tokenized without delaying anyone else, and the tokenizer endpoints (/tokenize, /detokenize)."""

import json
import statistics
import threading
import time
import uuid

import httpx
import pytest
from transformers import AutoTokenizer

from conftest import TEST_ADMIN_KEY, TEST_API_KEY, one_worker_cluster
from test_serving_e2e import assert_openai_error

pytestmark = pytest.mark.slow

API_KEY, ADMIN_KEY = TEST_API_KEY, TEST_ADMIN_KEY
MAX_BODY_BYTES = 8 * 1024 * 1024  # the gateway's default


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, nats_url, postgres_server_url, tiny_checkpoint):
    with one_worker_cluster(tmp_path_factory, postgres_server_url, tiny_checkpoint, nats_url,
                            f"lca{uuid.uuid4().hex[:8]}") as state:
        yield state


def api(cluster, key: str | None = API_KEY) -> httpx.Client:
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    return httpx.Client(base_url=cluster.gateway_url, headers=headers, timeout=120)


def completion_body(prompt: str, **extra) -> bytes:
    # Encoded before the clock starts: the client's own JSON encoding is not the gateway's time.
    return json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": 2, **extra}).encode()


def post_timed(client: httpx.Client, path: str, content) -> tuple[httpx.Response, float]:
    t0 = time.perf_counter()
    r = client.post(path, content=content)
    return r, time.perf_counter() - t0


def test_a_body_over_the_limit_is_refused_unread(cluster):
    c = api(cluster)
    huge = completion_body("x" * 10_000_000)  # 10 MB: tokenizing it took 28 s on the event loop
    post_timed(c, "/v1/completions", completion_body("warm up the connection"))
    r, took = post_timed(c, "/v1/completions", huge)
    print(f"\n10 MB body refused in {took * 1000:.0f} ms")
    err = assert_openai_error(r, 413)
    assert err["type"] == "invalid_request_error" and err["code"] == "request_too_large"
    assert took < 0.1, f"refused after {took * 1000:.0f} ms"
    # Sent chunked (no Content-Length), the bytes are counted as they come.
    r = c.post("/v1/completions", content=(huge[i:i + 65536] for i in range(0, len(huge), 65536)))
    assert_openai_error(r, 413)
    small = completion_body("Hello there")
    r = c.post("/v1/completions", content=(small[i:i + 4] for i in range(0, len(small), 4)))
    assert r.status_code == 200, r.text  # a small chunked body goes through whole


def test_a_prompt_longer_than_the_context_can_hold_is_refused_before_tokenizing(cluster):
    c = api(cluster)
    big = "0123456789" * 200_000  # 2 MB: under the body limit, but no 2048 tokens hold it (3 s to tokenize)
    r, took = post_timed(c, "/v1/completions", completion_body(big))
    print(f"\n2 MB prompt refused in {took * 1000:.0f} ms")
    err = assert_openai_error(r, 400, "prompt")
    assert err["code"] == "context_length_exceeded"
    assert took < 0.1, f"refused after {took * 1000:.0f} ms"
    chat = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": big}]}).encode()
    r, took = post_timed(c, "/v1/chat/completions", chat)
    assert assert_openai_error(r, 400, "messages")["code"] == "context_length_exceeded"
    assert took < 0.1, f"refused after {took * 1000:.0f} ms"


def largest_admitted_prompt(c: httpx.Client) -> str:
    """The longest run of digits the byte bound lets through to the tokenizer (a token a digit,
    so it is then refused for its token count): the most tokenizing one request can cause."""
    lo, hi = 1, 5_000_000
    while lo < hi:  # the bound is the gateway's own: find it through the API
        mid = (lo + hi + 1) // 2
        r = c.post("/v1/completions", content=completion_body("1" * mid))
        if "bytes" in r.json()["error"]["message"]:
            hi = mid - 1
        else:
            lo = mid
    return "0123456789" * (lo // 10)


def test_large_prompts_being_tokenized_do_not_delay_a_small_request(cluster):
    c = api(cluster)
    small = completion_body("Hello there", temperature=0)
    for _ in range(3):  # warm: the instance is loaded, the connection open
        assert c.post("/v1/completions", content=small).status_code == 200

    def latency() -> float:
        r, took = post_timed(c, "/v1/completions", small)
        assert r.status_code == 200, r.text
        return took
    alone = statistics.median(latency() for _ in range(5))

    big = completion_body(largest_admitted_prompt(c))
    big_times: list[float] = []
    clients = [api(cluster) for _ in range(4)]
    for b in clients:  # connected beforehand, so the large prompts all arrive at once
        assert b.get("/health").status_code == 200
    ready = threading.Barrier(len(clients) + 1)

    def send_big(b: httpx.Client) -> None:
        ready.wait()
        r, took = post_timed(b, "/v1/completions", big)
        assert_openai_error(r, 400, "prompt")  # tokenized, then too many tokens
        big_times.append(took)
    senders = [threading.Thread(target=send_big, args=(b,)) for b in clients]
    print(f"\nlarge prompt: {len(big)} bytes")
    for t in senders:
        t.start()
    ready.wait()
    time.sleep(0.1)  # the large prompts have arrived and are being tokenized
    during = [latency() for _ in range(3)]
    for t in senders:
        t.join()
    print(f"\nsmall request alone {alone * 1000:.0f} ms, during large prompts {[round(d * 1000) for d in during]} "
          f"ms; large prompts took {[round(b * 1000) for b in sorted(big_times)]} ms")
    assert len(big_times) == len(clients)
    # Tokenized on the event loop, the small request waits for them (seconds, on 2 cores).
    assert max(during) <= 2 * alone + 0.1, (alone, during)


def test_tokenize_gives_the_ids_a_completion_is_given_and_detokenize_gives_their_text(cluster, tiny_checkpoint):
    c = api(cluster)
    tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoint)
    prompt = "Once upon a time, a café served crème brûlée 😀"
    r = c.post("/tokenize", json={"model": "tiny", "prompt": prompt})
    assert r.status_code == 200, r.text
    out = r.json()
    assert set(out) == {"count", "max_model_len", "tokens"}
    assert out["tokens"] == tokenizer(prompt).input_ids and out["count"] == len(out["tokens"])
    assert out["max_model_len"] == 2048  # the gateway's context cap (the model has 4096 positions)
    done = c.post("/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 1}).json()
    assert done["usage"]["prompt_tokens"] == out["count"]
    # Ids back to text: exactly their text, special tokens included (as vLLM answers).
    r = c.post("/detokenize", json={"model": "tiny", "tokens": out["tokens"]})
    assert r.status_code == 200, r.text
    assert r.json() == {"prompt": tokenizer.bos_token + prompt}
    bare = c.post("/tokenize", json={"model": "tiny", "prompt": prompt, "add_special_tokens": False}).json()
    assert bare["count"] == out["count"] - 1
    assert c.post("/detokenize", json={"model": "tiny", "tokens": bare["tokens"]}).json() == {"prompt": prompt}


def test_tokenize_chat_messages_as_the_chat_endpoint_renders_them(cluster):
    c = api(cluster)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    chat = c.post("/tokenize", json={"model": "tiny", "messages": messages}).json()
    done = c.post("/v1/chat/completions", json={"model": "tiny", "messages": messages, "max_tokens": 1}).json()
    assert done["usage"]["prompt_tokens"] == chat["count"] == len(chat["tokens"])
    text = c.post("/detokenize", json={"model": "tiny", "tokens": chat["tokens"]}).json()["prompt"]
    assert text.endswith("<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n"), text
    without = c.post("/tokenize", json={"model": "tiny", "messages": messages, "add_generation_prompt": False}).json()
    assert without["tokens"] == chat["tokens"][:without["count"]] and without["count"] < chat["count"]


def test_tokenizer_endpoints_answer_errors_as_the_api_does(cluster):
    c = api(cluster)
    for path, body in (("/tokenize", {"model": "tiny", "prompt": "x"}),
                       ("/detokenize", {"model": "tiny", "tokens": [5]})):
        assert_openai_error(api(cluster, None).post(path, json=body), 401)
        assert_openai_error(api(cluster, "sk-wrong").post(path, json=body), 401)
        assert_openai_error(c.post(path, json={**body, "model": "nope"}), 404, "model")
        assert_openai_error(c.post(path, json={**body, "return_token_strs": True}), 400, "return_token_strs")
        assert c.post(path, json=body).status_code == 200
    assert_openai_error(c.post("/tokenize", json={"model": "tiny"}), 400)  # neither a prompt nor messages
    assert_openai_error(c.post("/tokenize", json={"model": "tiny", "prompt": "x", "messages": [
        {"role": "user", "content": "x"}]}), 400)
    assert_openai_error(c.post("/tokenize", json={"model": "tiny", "messages": []}), 400, "messages")
    assert_openai_error(c.post("/detokenize", json={"model": "tiny", "tokens": [1, 10**9]}), 400, "tokens")
    assert_openai_error(c.post("/detokenize", json={"model": "tiny", "tokens": [-1]}), 400, "tokens")
    assert_openai_error(c.post("/detokenize", json={"model": "tiny", "tokens": "abc"}), 400, "tokens")
    # A prompt no context holds is refused before tokenizing, as by the completion endpoints.
    err = assert_openai_error(c.post("/tokenize", json={"model": "tiny", "prompt": "1" * 2_000_000}), 400, "prompt")
    assert err["code"] == "context_length_exceeded"
