"""The gateway's OpenAPI document is true: every route declares the error statuses it answers (no
422: a body that does not validate is a 400), each with the OpenAI error object as its body, and
real answers of the in-process app (no cluster) are declared and validate against their schema."""

import asyncio
import datetime
import json

import httpx
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


# Each route with a path parameter, and a value its route must answer itself (percent-encoded).
PATH_PARAMETERS = [
    ("GET", "/admin/v1/profiles/{model}", "%C2%9D%0A%02%100", 200),  # CI's Schemathesis case: no such model
    ("GET", "/admin/v1/models/{name}", "a%0Ab", 404),
    ("DELETE", "/admin/v1/models/{name}", "a%00%0Ab", 404),  # (the registry would answer a NUL's 400)
    ("GET", "/v1/models/{name}", "tiny%0A", 404),  # not "tiny": the newline is part of the name
    ("DELETE", "/admin/v1/keys/{key_id}", "%0A" + "k" * 64, 400),  # a key id is 64 characters at most
]


@pytest.mark.parametrize("method,route,value,status", PATH_PARAMETERS)
def test_a_path_parameter_holding_a_newline_is_answered_by_its_route_as_declared(client, doc, method, route, value,
                                                                                   status):
    """Starlette's path patterns stopped "." at a newline and let "$" match before a final one: such a
    name fell through to the router's 404, which the route does not declare, or lost its newline."""
    r = client.request(method, route.split("{")[0] + value, headers=AUTH)
    assert r.status_code == status, r.text
    check_declared(doc, route, method, r)
    given = httpx.URL("/" + value).path[1:]  # the decoded value
    if status == 200:
        assert r.json() == {"object": "model_profiles", "model": given, "profiles": {"cpu": None, "cuda": None}}
    else:  # the route's own error (the router's 404 names no parameter)
        assert r.json()["error"]["param"] in ("name", "model", "key_id"), r.text


def test_every_route_with_a_path_parameter_is_checked_with_a_newline(doc):
    with_parameter = {(method.upper(), path) for path, ops in doc["paths"].items() if "{" in path for method in ops}
    assert with_parameter == {(method, route) for method, route, _, _ in PATH_PARAMETERS}


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


def test_a_405_names_every_method_the_document_declares_for_the_path(client, doc):
    """A path served by several routes (GET and POST /admin/v1/keys): Starlette's 405 named the first
    route's methods only (Schemathesis's ST205, Allow header mismatch)."""
    for path, operations in doc["paths"].items():
        r = client.request("TRACE", path.replace("{", "").replace("}", ""), headers=AUTH)  # "{name}": "name"
        assert r.status_code == 405, (path, r.status_code)
        assert r.headers["allow"] == ", ".join(sorted(method.upper() for method in operations)), path
    assert client.post("/openapi.json").headers["allow"] == "GET, HEAD"  # (Starlette's own route: HEAD too)


CHUNK = {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "tiny",
         "choices": [{"index": 0, "delta": {"content": "x"}, "finish_reason": None, "logprobs": None}]}
IN_BAND_ERROR = {"error": {"message": "the model's instances failed", "type": "server_error", "param": None,
                           "code": None}}


@pytest.mark.parametrize("events,valid", [
    ([CHUNK, "[DONE]"], True),
    ([CHUNK, IN_BAND_ERROR], True),  # a stream that fails after it began reports in-band
    ([{"id": "c"}, "[DONE]"], False),
    (["not json", "[DONE]"], False),
])
def test_a_tool_reading_the_document_validates_each_streamed_event(doc, events, valid):
    """Schemathesis (what CI's fuzzing uses) reads the stream's declared events (itemSchema) and
    holds each to them: a stream of chunks, or one ending in an error, passes; a chunk that breaks its
    schema fails (the 3.1 document it once had declared each event a string: every stream failed)."""
    schemathesis = pytest.importorskip("schemathesis")
    body = "".join(f"data: {e if isinstance(e, str) else json.dumps(e)}\n\n" for e in events).encode()
    r = httpx.Response(200, headers={"content-type": "text/event-stream"}, content=body,
                       request=httpx.Request("POST", "http://gateway/v1/chat/completions"))
    r.elapsed = datetime.timedelta(0)  # what a transport sets once the body is read
    op = schemathesis.openapi.from_dict(doc)["/v1/chat/completions"]["POST"]
    if valid:
        op.validate_response(r)
    else:
        with pytest.raises(Exception, match="SSE event violates schema"):
            op.validate_response(r)
