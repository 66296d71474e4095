"""The OpenAI request bodies' sampling parameters: declared once (m.SamplingParameters), each one
given reaches the engine's SamplingSpec as it is (`to_sampling_spec`), and a bad value is a 400
naming it. The HTTP app alone (no cluster): a valid body goes on to the model lookup, a 404 here."""

import json

import pytest
from fastapi.testclient import TestClient

from libs.protocol import messages as m
from services.gateway.app import create_app
from services.gateway.schemas import ChatCompletionRequest, CompletionRequest
from services.gateway.service import GatewayService


def gateway_without_models() -> GatewayService:
    """A gateway that has read a registry listing no model (else every model is 503 'starting')."""
    gateway = GatewayService()
    gateway._mark_synced()
    return gateway


KEY = "sk-test"
BODIES = {
    "/v1/completions": (CompletionRequest, {"model": "m", "prompt": "hi"}),
    "/v1/chat/completions": (ChatCompletionRequest, {"model": "m", "messages": [{"role": "user", "content": "hi"}]}),
}
# A value other than the default for every sampling parameter: a new one fails the test until it
# has one here, and so gets checked.
ASKED = {"temperature": 0.5, "top_p": 0.8, "min_p": 0.1, "seed": 7, "presence_penalty": 0.5,
         "frequency_penalty": -0.5, "repetition_penalty": 1.3, "n": 3}


@pytest.fixture(scope="module")
def client():
    # Not entered as a context manager: the lifespan (connecting to NATS) does not run.
    return TestClient(create_app(gateway_without_models(), [KEY], [KEY]), headers={"Authorization": f"Bearer {KEY}"})


def test_every_sampling_parameter_has_a_value_to_check():
    assert set(ASKED) == set(m.SamplingParameters.model_fields)
    assert all(ASKED[name] != field.default for name, field in m.SamplingParameters.model_fields.items())


@pytest.mark.parametrize("path", BODIES)
def test_every_sampling_parameter_given_reaches_the_spec_as_it_is(path):
    body_model, base = BODIES[path]
    body = body_model.model_validate({**base, **ASKED})
    spec = body.to_sampling_spec(max_tokens=5, stop_token_ids=[2], grammar=None)
    assert {name: getattr(spec, name) for name in ASKED} == ASKED
    assert (spec.max_tokens, spec.stop_token_ids, spec.grammar) == (5, (2,), None)


@pytest.mark.parametrize("path", BODIES)
def test_a_sampling_parameter_sent_as_null_is_its_default(client, path):
    body_model, base = BODIES[path]
    spec = body_model.model_validate({**base, **dict.fromkeys(ASKED)}).to_sampling_spec(5, [], None)
    assert spec == m.SamplingSpec(max_tokens=5)
    assert client.post(path, json={**base, **dict.fromkeys(ASKED)}).status_code == 404  # valid: on to the model


def test_logprobs_as_each_endpoint_asks_them():
    completion = CompletionRequest.model_validate({**BODIES["/v1/completions"][1], "logprobs": 3})
    assert completion.to_sampling_spec(5, [], None).logprobs == 3
    chat = BODIES["/v1/chat/completions"][1]
    assert ChatCompletionRequest.model_validate({**chat, "logprobs": True, "top_logprobs": 4}) \
        .to_sampling_spec(5, [], None).logprobs == 4
    assert ChatCompletionRequest.model_validate({**chat, "logprobs": True}).to_sampling_spec(5, [], None).logprobs == 0
    assert ChatCompletionRequest.model_validate(chat).to_sampling_spec(5, [], None).logprobs is None
    assert ChatCompletionRequest.model_validate({**chat, "max_tokens": 3, "max_completion_tokens": 4}) \
        .asked_max_tokens() == (4, "max_completion_tokens")


@pytest.mark.parametrize("path", BODIES)
@pytest.mark.parametrize("param, value", [("temperature", 2.5), ("top_p", 0), ("presence_penalty", -3),
                                          ("repetition_penalty", 0), ("n", 0), ("temperature", True),
                                          ("seed", "7"), ("top_p", "0.5"), ("min_p", 1.5), ("min_p", -0.1)])
def test_a_bad_sampling_value_is_an_openai_400_naming_it(client, path, param, value):
    r = client.post(path, json={**BODIES[path][1], param: value})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", param, "invalid_value")
    assert error["message"].startswith(f"Invalid value for '{param}'")


@pytest.mark.parametrize("path", BODIES)
def test_an_infinite_sampling_value_is_a_400(client, path):
    """1e999 is a JSON number that parses as inf (a repetition penalty of inf: NaN logits in the
    sampler, a 503); Infinity and NaN are no JSON at all."""
    body = json.dumps(BODIES[path][1])[:-1]
    r = client.post(path, content=body + ', "repetition_penalty": 1e999}', headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert (r.json()["error"]["param"], r.json()["error"]["code"]) == ("repetition_penalty", "invalid_value")
    for literal in ("Infinity", "NaN"):
        r = client.post(path, content=body + f', "repetition_penalty": {literal}}}',
                        headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json", r.text
