"""Tenants through the gateway of a real cluster (NATS, Postgres, registry, planner, gateway, a
worker): API keys made with the admin API and `layercast keys`, each limited to its models (404
for others, as if they did not exist), rate-limited (429 with Retry-After and x-ratelimit-*
headers), and its usage accounted as the responses report it (admin API, Prometheus)."""

import json
import re
import uuid

import httpx
import psycopg
import pytest
from typer.testing import CliRunner

from libs.admin import deploy_model
from conftest import TEST_ADMIN_KEY, TEST_API_KEY, one_worker_cluster, wait_for
from services.cli.app import app as cli
from services.cli.app import console as cli_console
from test_serving_e2e import assert_openai_error

pytestmark = pytest.mark.slow

API_KEY, ADMIN_KEY = TEST_API_KEY, TEST_ADMIN_KEY


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, postgres_server_url, tiny_checkpoint):
    # No NATS_URL: the cluster runs its own NATS, as `layercast up` does, with a user per service
    # (libs/bus/auth.py): every test here also runs the services under their NATS rights.
    with one_worker_cluster(tmp_path_factory, postgres_server_url, tiny_checkpoint, None,
                            f"lck{uuid.uuid4().hex[:8]}") as state:
        # A second model, never asked to run: a key limited to "tiny" must not see it.
        deploy_model(state, "other", tiny_checkpoint)
        yield state


def client(cluster, key: str) -> httpx.Client:
    return httpx.Client(base_url=cluster.gateway_url, headers={"Authorization": f"Bearer {key}"}, timeout=120)


def create_key(cluster, name: str, **fields) -> dict:
    r = client(cluster, ADMIN_KEY).post("/admin/v1/keys", json={"name": name, **fields})
    assert r.status_code == 201, r.text
    assert r.json()["key"].startswith("sk-lc-")
    return r.json()


def complete(c: httpx.Client, model: str = "tiny", max_tokens: int = 4, **extra) -> httpx.Response:
    return c.post("/v1/completions", json={"model": model, "prompt": "Hello there", "max_tokens": max_tokens,
                                          "temperature": 0, **extra})


def test_a_key_limited_to_a_model_gets_404_for_the_others(cluster):
    key = create_key(cluster, "only-tiny", models=["tiny"])
    c, static = client(cluster, key["key"]), client(cluster, API_KEY)
    assert [mo["id"] for mo in c.get("/v1/models").json()["data"]] == ["tiny"]
    assert [mo["id"] for mo in static.get("/v1/models").json()["data"]] == ["other", "tiny"]
    assert complete(c).status_code == 200
    assert c.get("/v1/models/tiny").status_code == 200
    # "other" exists, but for this key it is answered exactly as a model that does not exist.
    calls = [lambda name: c.get(f"/v1/models/{name}"),
             lambda name: complete(c, name),
             lambda name: c.post("/v1/chat/completions", json={
                 "model": name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
             lambda name: c.post("/tokenize", json={"model": name, "prompt": "hi"}),
             lambda name: c.post("/detokenize", json={"model": name, "tokens": [1, 2]})]
    for ask in calls:
        hidden, absent = ask("other"), ask("nope")
        assert_openai_error(hidden, 404)
        assert hidden.json() == json.loads(absent.text.replace("nope", "other"))
        assert hidden.json()["error"]["code"] == "model_not_found"
    assert static.post("/tokenize", json={"model": "other", "prompt": "hi"}).status_code == 200  # the static key may


def test_a_key_over_its_request_limit_gets_429_with_retry_after(cluster):
    c = client(cluster, create_key(cluster, "two-a-minute", requests_per_minute=2)["key"])
    for remaining in (1, 0):
        r = complete(c)
        assert r.status_code == 200, r.text
        assert r.headers["x-ratelimit-limit-requests"] == "2"
        assert r.headers["x-ratelimit-remaining-requests"] == str(remaining)
        assert re.fullmatch(r"(1m0s|\d+(\.\d+)?s)", r.headers["x-ratelimit-reset-requests"])  # "1m0s", "59.9s"
        assert "x-ratelimit-limit-tokens" not in r.headers  # no token limit on this key
    r = complete(c)
    err = assert_openai_error(r, 429)
    assert err["type"] == "requests" and err["code"] == "rate_limit_exceeded", err
    assert 1 <= int(r.headers["Retry-After"]) <= 60
    assert r.headers["x-ratelimit-remaining-requests"] == "0"
    # Streaming requests are limited alike; other keys are not.
    r = c.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2, "stream": True})
    assert_openai_error(r, 429)
    assert complete(client(cluster, API_KEY)).status_code == 200


def test_a_key_over_its_token_limit_gets_429_counting_prompt_and_max_tokens(cluster):
    tpm = 100
    c = client(cluster, create_key(cluster, "hundred-tokens", tokens_per_minute=tpm)["key"])
    first = complete(c, max_tokens=8)
    assert first.status_code == 200, first.text
    used, prompt = first.json()["usage"]["total_tokens"], first.json()["usage"]["prompt_tokens"]
    assert first.headers["x-ratelimit-remaining-tokens"] == str(tpm - prompt - 8)  # estimated at admission
    # What is left after the first request's real usage, plus one: refused, by tokens.
    r = complete(c, max_tokens=tpm - used - prompt + 1)
    err = assert_openai_error(r, 429)
    assert err["type"] == "tokens" and int(r.headers["Retry-After"]) >= 1
    r = complete(c, max_tokens=tpm - used - prompt)  # exactly what is left
    assert r.status_code == 200, r.text
    assert r.headers["x-ratelimit-remaining-tokens"] == "0"


def test_usage_in_the_admin_api_and_metrics_equals_the_responses_usage(cluster):
    name = "accounted"
    c = client(cluster, create_key(cluster, name)["key"])
    assert complete(client(cluster, API_KEY)).status_code == 200  # accounted under "static"
    seen = {"prompt_tokens": 0, "completion_tokens": 0}

    def add(usage: dict) -> None:
        for k in seen:
            seen[k] += usage[k]
    add(complete(c, max_tokens=5).json()["usage"])
    add(c.post("/v1/chat/completions", json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                                             "max_tokens": 3}).json()["usage"])
    with c.stream("POST", "/v1/completions", json={"model": "tiny", "prompt": "Once", "max_tokens": 6,
                                                   "stream": True, "stream_options": {"include_usage": True}}) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    add(events[-1]["usage"])
    requests = 3

    def recorded() -> dict | None:
        rows = client(cluster, ADMIN_KEY).get("/admin/v1/usage", params={"key": name}).json()["data"]
        return rows[0] if rows and rows[0]["requests"] == requests else None
    row = wait_for(recorded, 10, "the usage to be recorded")
    assert (row["key_name"], row["model"]) == (name, "tiny")
    assert {k: row[k] for k in seen} == seen
    assert row["total_tokens"] == sum(seen.values())
    metrics = httpx.get(f"{cluster.gateway_url}/metrics").text
    for kind in ("prompt", "completion"):
        value = re.search(rf'layercast_gateway_usage_tokens_total{{key="{name}",kind="{kind}",model="tiny"}} (\S+)',
                          metrics)
        assert value and float(value.group(1)) == seen[f"{kind}_tokens"], kind
    assert f'layercast_gateway_usage_requests_total{{key="{name}",model="tiny"}} 3.0' in metrics
    # The static key is accounted too, under "static"; a model filter finds only that model.
    static = client(cluster, ADMIN_KEY).get("/admin/v1/usage", params={"key": "static", "model": "tiny"}).json()
    assert [(u["key_name"], u["model"]) for u in static["data"]] == [("static", "tiny")]
    assert static["data"][0]["requests"] >= 1


def test_a_stream_the_client_leaves_is_accounted_for_what_was_generated(cluster):
    name = "leaves-early"
    c = client(cluster, create_key(cluster, name)["key"])
    with c.stream("POST", "/v1/completions", json={"model": "tiny", "prompt": "Once", "max_tokens": 200,
                                                   "stream": True}) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        got = sum(1 for _, line in zip(range(4), lines) if line.startswith("data: {"))
    row = wait_for(lambda: (client(cluster, ADMIN_KEY).get("/admin/v1/usage", params={"key": name}).json()["data"]
                            or [None])[0], 10, "the left stream to be recorded")
    assert row["requests"] == 1 and row["prompt_tokens"] > 0
    assert got <= row["completion_tokens"] <= 200


def test_keys_through_the_cli_are_stored_hashed_and_revoked_at_once(cluster, monkeypatch):
    monkeypatch.setattr(cli_console, "width", 200)  # tables unwrapped
    runner = CliRunner()
    target = ["--gateway-url", cluster.gateway_url, "--admin-key", ADMIN_KEY]
    out = runner.invoke(cli, ["keys", "create", "from-cli", "--model", "tiny", "--rpm", "100", *target])
    assert out.exit_code == 0, out.output
    secret = re.search(r"sk-lc-\S+", out.output).group(0)
    key_id = re.search(r"key-[0-9a-f]+", out.output).group(0)
    c = client(cluster, secret)
    assert complete(c).status_code == 200
    listed = runner.invoke(cli, ["keys", "list", *target])
    assert key_id in listed.output and "from-cli" in listed.output and secret not in listed.output
    keys = client(cluster, ADMIN_KEY).get("/admin/v1/keys").json()["data"]
    assert all("key" not in k and "key_hash" not in k for k in keys)
    with psycopg.connect(cluster.database_url) as conn:  # the database never holds the secret
        assert secret not in repr(conn.execute("SELECT * FROM api_keys").fetchall())
    def usage_listed():  # the gateway records usage in the registry once a second, not at once
        usage = runner.invoke(cli, ["usage", "--key", "from-cli", *target])
        assert usage.exit_code == 0, usage.output
        return "from-cli" in usage.output
    wait_for(usage_listed, 10, "`layercast usage` to list the key's request")

    out = runner.invoke(cli, ["keys", "revoke", key_id, *target])
    assert out.exit_code == 0, out.output
    err = assert_openai_error(complete(c), 401)
    assert err["code"] == "invalid_api_key"
    assert runner.invoke(cli, ["keys", "revoke", key_id, *target]).exit_code == 1  # revoked once
    assert "from-cli" not in runner.invoke(cli, ["keys", "list", *target]).output
    # Unknown keys, of the registry's form or not, are refused alike; the static key still works.
    for bad in ("sk-lc-" + "x" * 43, "sk-something-else"):
        assert assert_openai_error(complete(client(cluster, bad)), 401)["code"] == "invalid_api_key"
    assert complete(client(cluster, API_KEY)).status_code == 200


def test_the_admin_api_refuses_tenant_keys_and_the_static_api_keys(cluster):
    tenant = create_key(cluster, f"not-admin-{uuid.uuid4().hex[:6]}")["key"]
    assert complete(client(cluster, tenant)).status_code == 200  # a good key, for the OpenAI API
    spec = httpx.get(f"{cluster.gateway_url}/openapi.json", timeout=30).json()
    routes = [(method.upper(), path.replace("{name}", "tiny").replace("{model}", "tiny")
               .replace("{key_id}", "key-0123456789abcdef"))
              for path, ops in spec["paths"].items() if path.startswith("/admin/") for method in ops]
    assert len(routes) >= 9, routes
    for key in (tenant, API_KEY):
        for method, path in routes:
            r = client(cluster, key).request(method, path, json={})
            assert assert_openai_error(r, 401)["code"] == "invalid_api_key", (method, path, key)
    # Nothing the tenant sent deleted the model, made a key or revoked one.
    assert client(cluster, ADMIN_KEY).get("/admin/v1/models/tiny").status_code == 200
    assert complete(client(cluster, tenant)).status_code == 200
