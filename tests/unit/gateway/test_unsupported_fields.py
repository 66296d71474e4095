"""Every request field of the official `openai` client: one the gateway does not implement
is a 400 naming it, never a 200 that silently ignored it. The HTTP app alone (no cluster): a
body that passes validation reaches the model lookup, a 404 here, as no model is loaded."""

import typing

import pytest
from fastapi.testclient import TestClient
from openai.types import completion_create_params
from openai.types.chat import completion_create_params as chat_create_params

from services.gateway.app import create_app
from services.gateway.schemas import IGNORED_FIELDS, ChatCompletionRequest, CompletionRequest
from services.gateway.service import GatewayService


def gateway_without_models() -> GatewayService:
    """A gateway that has read a registry listing no model (else every model is 503 'starting')."""
    gateway = GatewayService()
    gateway._mark_synced()
    return gateway


KEY = "sk-test"
ENDPOINTS = {
    "/v1/completions": (completion_create_params.CompletionCreateParamsBase, CompletionRequest,
                        {"model": "m", "prompt": "hi"}),
    "/v1/chat/completions": (chat_create_params.CompletionCreateParamsBase, ChatCompletionRequest,
                             {"model": "m", "messages": [{"role": "user", "content": "hi"}]}),
}
# Implemented by layercast: accepted on both endpoints where the client has them.
SUPPORTED = {"model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "n",
             "stop", "seed", "stream_options", "echo", "presence_penalty", "frequency_penalty", "logprobs",
             "top_logprobs", "response_format", "tools", "tool_choice", "parallel_tool_calls"}
# A plausible value for every field of the client's request types (a new field fails the test
# until it is given one here, and so gets checked).
PLAUSIBLE = {
    "audio": {"voice": "alloy", "format": "wav"}, "best_of": 2, "echo": True, "frequency_penalty": 0.5,
    "function_call": "auto", "functions": [{"name": "f", "parameters": {"type": "object", "properties": {}}}],
    "logit_bias": {"50": 10}, "max_completion_tokens": 5, "max_tokens": 5, "metadata": {"team": "a"},
    "modalities": ["text"], "moderation": {"policy": {"input": {"mode": "block"}}}, "n": 1,
    "parallel_tool_calls": True, "prediction": {"type": "content", "content": "hi"}, "presence_penalty": 0.5,
    "prompt_cache_key": "k", "prompt_cache_options": {"mode": "explicit"}, "prompt_cache_retention": "24h",
    "reasoning_effort": "low", "response_format": {"type": "json_object"}, "safety_identifier": "s",
    "seed": 1, "service_tier": "auto", "stop": "x", "store": True, "stream_options": {"include_usage": True},
    "suffix": "the end", "temperature": 0.5, "tool_choice": "none",  # alone: "none" (others need tools)
    "tools": [{"type": "function", "function": {"name": "f"}}], "top_logprobs": 2, "top_p": 0.9, "user": "u1",
    "verbosity": "low", "web_search_options": {"search_context_size": "low"},
}
LOGPROBS = {"/v1/completions": 2, "/v1/chat/completions": True}  # an int there, a flag here


@pytest.fixture(scope="module")
def client():
    # Not entered as a context manager: the lifespan (connecting to NATS) does not run.
    return TestClient(create_app(gateway_without_models(), [KEY], [KEY]), headers={"Authorization": f"Bearer {KEY}"})


def unsupported(r) -> str | None:
    """The parameter a response refuses as unsupported, if it does."""
    if r.status_code != 400 or r.json()["error"]["code"] != "unsupported_parameter":
        return None
    return r.json()["error"]["param"]


def openai_fields(params) -> list[str]:
    return sorted(typing.get_type_hints(params))


@pytest.mark.parametrize("path", ENDPOINTS)
def test_every_openai_field_is_implemented_explicitly_ignored_or_refused_by_name(client, path):
    params, body_model, base = ENDPOINTS[path]
    fields = openai_fields(params)
    assert {"model", "temperature", "tools" if "chat" in path else "suffix"} <= set(fields)  # the walk is real
    missing = [f for f in fields if f not in PLAUSIBLE and f != "logprobs" and f not in base]
    assert not missing, f"the openai client has new fields: give them a plausible value in PLAUSIBLE: {missing}"
    refused, accepted = [], []
    for field in fields:
        if field in base:
            continue
        value = LOGPROBS[path] if field == "logprobs" else PLAUSIBLE[field]
        extra = {"logprobs": True} if field == "top_logprobs" else {}  # it needs logprobs on
        r = client.post(path, json={**base, **extra, field: value})
        # Declared in the body model = implemented (fields are added there as they are).
        implemented = field in body_model.model_fields or field in IGNORED_FIELDS
        if field in SUPPORTED or implemented:
            assert field in body_model.model_fields or field in IGNORED_FIELDS, field
            assert unsupported(r) is None, (field, r.text)
            assert r.status_code == 404, (field, r.text)  # valid: it went on to look the model up
            accepted.append(field)
        else:
            assert unsupported(r) == field, (field, r.status_code, r.text)
            err = r.json()["error"]
            assert err["type"] == "invalid_request_error" and f"'{field}'" in err["message"]
            refused.append(field)
    assert refused and accepted
    print(f"\n{path}: refused {refused}; accepted {accepted}")


def test_null_means_not_given_and_store_false_asks_for_nothing(client):
    base = ENDPOINTS["/v1/chat/completions"][2]
    for extra in ({"tools": None, "logit_bias": None}, {"store": False}, {"user": "u1", "metadata": {"a": "b"}}):
        r = client.post("/v1/chat/completions", json={**base, **extra})
        assert r.status_code == 404, (extra, r.text)
    assert unsupported(client.post("/v1/chat/completions", json={**base, "store": True})) == "store"


def test_unknown_fields_are_refused_too_nested_and_admin_ones_included(client):
    base = ENDPOINTS["/v1/completions"][2]
    assert unsupported(client.post("/v1/completions", json={**base, "temprature": 0.2})) == "temprature"
    assert unsupported(client.post("/v1/completions", json={**base, "top_k": 5})) == "top_k"
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi", "name": "bob"}]}
    assert unsupported(client.post("/v1/chat/completions", json=chat)) == "messages.0.name"
    schema = {**chat, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {},
                                                                                  "streaming": True}}}
    assert unsupported(client.post("/v1/chat/completions", json=schema)) == "response_format.json_schema.streaming"
    streamed = {**base, "stream": True, "stream_options": {"include_usage": True, "continuous_usage": True}}
    assert unsupported(client.post("/v1/completions", json=streamed)) == "stream_options.continuous_usage"
    deploy = {"name": "x", "path": "/tmp", "min_instance": 1}  # a typo would silently deploy with the default
    assert unsupported(client.post("/admin/v1/models", json=deploy)) == "min_instance"
