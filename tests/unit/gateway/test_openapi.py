"""The gateway's OpenAPI document is true: every route declares the error statuses it answers (no
422: a body that does not validate is a 400), each with the OpenAI error object as its body, and
real answers of the in-process app (no cluster) are declared and validate against their schema."""

import asyncio

import pytest
from fastapi.testclient import TestClient

from openapi_check import check_declared

from libs.checkpoint import CheckpointIndex
from libs.protocol import messages as m
from services.gateway.app import create_app
from services.gateway.service import GatewayConfig, GatewayService

KEY = "sk-test"
AUTH = {"Authorization": f"Bearer {KEY}"}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}


def tiny_info(checkpoint) -> m.ModelInfo:
    index = CheckpointIndex.load(checkpoint)
    return m.ModelInfo(name="tiny", path=str(checkpoint), arch=index.arch, n_layers=index.n_layers,
                       blocks=[m.BlockInfo(block_id=b.id, nbytes=b.nbytes, checksum=b.checksum,
                                           layer_start=b.layer_start, layer_end=b.layer_end) for b in index.blocks],
                       state=m.ModelState.deployed, created_at=1.0)


@pytest.fixture(scope="module")
def gateway(tiny_checkpoint) -> GatewayService:
    """A gateway that has read a registry listing one model, "tiny", with no instance yet."""
    gateway = GatewayService(GatewayConfig(max_body_bytes=64 * 1024))
    gateway._mark_synced()
    entry = asyncio.run(gateway.add_model(tiny_info(tiny_checkpoint)))
    entry.routes.max_queue = 0  # a full queue: the next request that must wait is refused (429)
    return gateway


@pytest.fixture(scope="module")
def client(gateway) -> TestClient:
    # Not entered as a context manager: the lifespan (connecting to NATS) does not run.
    return TestClient(create_app(gateway, [KEY], [KEY]))


@pytest.fixture(scope="module")
def doc(client) -> dict:
    return client.get("/openapi.json").json()


def operation(doc: dict, path: str, method: str) -> dict:
    return doc["paths"][path][method.lower()]


def test_no_route_declares_422_and_every_route_declares_its_errors_as_openai_error_objects(doc):
    errors_everywhere = {"408", "413", "500"}
    for path, operations in doc["paths"].items():
        for method, op in operations.items():
            codes = set(op["responses"])
            assert "422" not in codes, f"{method} {path}"
            assert errors_everywhere <= codes, f"{method} {path}: {sorted(codes)}"
            if path.startswith(("/v1/", "/admin/", "/tokenize", "/detokenize")):
                assert {"401", "503"} <= codes, f"{method} {path}: {sorted(codes)}"
            if method == "post":
                assert "400" in codes, f"{method} {path}: {sorted(codes)}"
            for code in codes - {"200", "201"} - ({"503"} if path == "/health" else set()):
                schema = op["responses"][code]["content"]["application/json"]["schema"]
                assert schema == {"$ref": "#/components/schemas/ErrorResponse"}, f"{method} {path} {code}"
    assert "HTTPValidationError" not in doc["components"]["schemas"]
    assert {"ChatCompletion", "ChatCompletionChunk", "Completion", "ModelList", "Model"} <= set(
        doc["components"]["schemas"])
    for path in ("/v1/completions", "/v1/chat/completions"):
        assert "text/event-stream" in operation(doc, path, "post")["responses"]["200"]["content"]


@pytest.mark.parametrize("method,path,kwargs,status", [
    ("POST", "/v1/chat/completions", {"json": {"model": "tiny"}, "headers": AUTH}, 400),  # no messages
    ("POST", "/v1/completions", {"content": b"{not json", "headers": AUTH}, 400),
    ("POST", "/admin/v1/keys", {"json": {"name": ""}, "headers": AUTH}, 400),
    ("GET", "/v1/models", {}, 401),
    ("POST", "/v1/chat/completions", {"json": CHAT, "headers": {"Authorization": "Bearer wrong"}}, 401),
    ("GET", "/admin/v1/cluster", {}, 401),
    ("GET", "/v1/models/nope", {"headers": AUTH}, 404),
    ("POST", "/tokenize", {"json": {"model": "nope", "prompt": "hi"}, "headers": AUTH}, 404),
    ("POST", "/v1/chat/completions", {"content": b"x" * (65 * 1024), "headers": AUTH}, 413),
    ("POST", "/v1/chat/completions", {"json": CHAT, "headers": AUTH}, 429),  # the model's queue is full
])
def test_real_error_answers_are_declared_for_their_route_and_match_the_schema(client, doc, method, path, kwargs,
                                                                               status):
    r = client.request(method, path, **kwargs)
    assert r.status_code == status, r.text
    if status == 429:
        assert r.json()["error"]["code"] == "queue_full"
    route = "/v1/models/{name}" if path.startswith("/v1/models/") else path
    check_declared(doc, route, method, r)


def test_a_503_before_the_registry_read_is_declared_and_matches_the_schema(doc):
    starting = GatewayService(GatewayConfig(first_sync_wait_s=0))  # never synced: no registry read yet
    client = TestClient(create_app(starting, [KEY], [KEY]))
    for path in ("/v1/models", "/health"):
        r = client.get(path, headers=AUTH)
        assert r.status_code == 503, r.text
        assert path == "/health" or r.json()["error"]["code"] == "gateway_starting"
        check_declared(doc, path, "GET", r)


def test_a_models_list_and_a_model_match_their_declared_schemas(client, doc):
    listed = client.get("/v1/models", headers=AUTH)
    assert listed.status_code == 200 and [d["id"] for d in listed.json()["data"]] == ["tiny"]
    check_declared(doc, "/v1/models", "GET", listed)
    check_declared(doc, "/v1/models/{name}", "GET", client.get("/v1/models/tiny", headers=AUTH))
    check_declared(doc, "/tokenize", "POST", client.post("/tokenize", json={"model": "tiny", "prompt": "hi"},
                                                         headers=AUTH))
    check_declared(doc, "/health", "GET", client.get("/health"))


def test_a_method_a_route_does_not_take_is_a_405_naming_those_it_does(client):
    """RFC 9110: a 405 carries Allow (Schemathesis's unsupported_method check found it missing)."""
    r = client.request("TRACE", "/v1/models", headers=AUTH)
    assert r.status_code == 405 and r.headers["allow"] == "GET", (r.status_code, r.headers)
    assert r.json()["error"]["type"] == "invalid_request_error"
    assert client.post("/livez").headers["allow"] == "GET"
