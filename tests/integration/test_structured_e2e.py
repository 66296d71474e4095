"""Structured output and tool calls end to end, through the real gateway and worker with the
official `openai` client, on the tiny random model (which knows nothing of JSON: whatever
validates does so because decoding was constrained): response_format json_schema and
json_object, tool_choice required and named, streamed and not, the multi-turn messages a client
sends back, a handed-over constrained request, and 400s naming what is wrong."""

import json

import httpx
import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from llguidance import LLMatcher
from schema_strategies import SCHEMAS

from conftest import generate_on_worker
from libs.protocol import messages as m
# The same one-worker cluster on the tiny model (a module's own instance of each fixture).
from test_sampling_e2e import ADMIN_KEY, API_KEY, client, cluster  # noqa: F401

pytestmark = pytest.mark.slow

CHAT = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
           "properties": {"city": {"type": "string", "maxLength": 12},
                          "unit": {"enum": ["celsius", "fahrenheit"]},
                          "days": {"type": "integer", "minimum": 1, "maximum": 7}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "The time now"}}]
NO_ARGS = {"type": "object", "properties": {}, "additionalProperties": False}
PARAMS = {"get_weather": WEATHER, "get_time": NO_ARGS}


def json_schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}


@settings(max_examples=20, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(schema=SCHEMAS, seed=st.integers(0, 2**31), stream=st.booleans())
def test_generated_schemas_each_yield_output_that_validates(client, schema, seed, stream):
    kw = dict(model="tiny", messages=CHAT, max_tokens=400, seed=seed, response_format=json_schema_format(schema))
    if stream:
        chunks = [c for c in client.chat.completions.create(stream=True, **kw) if c.choices]
        text = "".join(c.choices[0].delta.content or "" for c in chunks)
        finish = chunks[-1].choices[0].finish_reason
    else:
        out = client.chat.completions.create(**kw)
        text, finish = out.choices[0].message.content, out.choices[0].finish_reason
    assert finish == "stop", (schema, text)
    jsonschema.validate(json.loads(text), schema)


def test_json_object_on_chat_and_completions(client):
    out = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=300, seed=1,
                                         response_format={"type": "json_object"})
    if out.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(out.choices[0].message.content), dict)
    else:  # a random model may write a long object: then it is the beginning of one
        assert out.choices[0].message.content.startswith("{")
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["n"], "additionalProperties": False}
    done = client.completions.create(model="tiny", prompt="Give me a number:", max_tokens=50, seed=2,
                                     extra_body={"response_format": json_schema_format(schema)})
    jsonschema.validate(json.loads(done.choices[0].text), schema)
    assert done.choices[0].finish_reason == "stop"


def check_call(call, name: str | None = None) -> dict:
    assert call.type == "function" and call.id.startswith("call_")
    assert name is None or call.function.name == name
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, PARAMS[call.function.name])
    return args


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_tool_choice_required_returns_a_parseable_tool_call(client, seed):
    out = client.chat.completions.create(model="tiny", messages=CHAT, tools=TOOLS, tool_choice="required",
                                         max_tokens=200, seed=seed)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    check_call(call)
    # Streamed: the call's id, type and name first, then its arguments; the same call.
    chunks = [c for c in client.chat.completions.create(model="tiny", messages=CHAT, tools=TOOLS,
                                                        tool_choice="required", max_tokens=200, seed=seed,
                                                        stream=True) if c.choices]
    deltas = [d for c in chunks for d in (c.choices[0].delta.tool_calls or [])]
    assert deltas[0].id.startswith("call_") and deltas[0].type == "function" and deltas[0].index == 0
    assert deltas[0].function.name == call.function.name
    assert "".join(d.function.arguments or "" for d in deltas) == call.function.arguments
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert not "".join(c.choices[0].delta.content or "" for c in chunks)


def test_each_of_n_choices_is_its_own_constrained_call_streamed_and_not(client):
    # n = 3 seeded choices: one grammar state and one call parser per choice, each call parseable.
    out = client.chat.completions.create(model="tiny", messages=CHAT, tools=TOOLS, tool_choice="required",
                                         max_tokens=200, seed=11, n=3)
    assert [c.index for c in out.choices] == [0, 1, 2]
    calls = []
    for c in out.choices:
        assert c.finish_reason == "tool_calls" and c.message.content is None
        (call,) = c.message.tool_calls
        check_call(call)
        calls.append(call.function.arguments)
    streamed = [c for c in client.chat.completions.create(model="tiny", messages=CHAT, tools=TOOLS,
                                                          tool_choice="required", max_tokens=200, seed=11, n=3,
                                                          stream=True) if c.choices]
    for i in range(3):
        mine = [c.choices[0] for c in streamed if c.choices[0].index == i]
        deltas = [d for c in mine for d in (c.delta.tool_calls or [])]
        assert "".join(d.function.arguments or "" for d in deltas) == calls[i]
        assert mine[-1].finish_reason == "tool_calls"
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}
    out = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=60, seed=5, n=2,
                                         response_format=json_schema_format(schema))
    for c in out.choices:
        jsonschema.validate(json.loads(c.message.content), schema)


def test_a_named_tool_is_the_one_called_and_the_conversation_goes_on(client):
    for name in ("get_time", "get_weather"):
        out = client.chat.completions.create(model="tiny", messages=CHAT, tools=TOOLS, max_tokens=200, seed=7,
                                             tool_choice={"type": "function", "function": {"name": name}})
        (call,) = out.choices[0].message.tool_calls
        check_call(call, name)
        streamed = client.chat.completions.create(model="tiny", messages=CHAT, tools=TOOLS, max_tokens=200, seed=7,
                                                  tool_choice={"type": "function", "function": {"name": name}},
                                                  stream=True)
        deltas = [d for c in streamed if c.choices for d in (c.choices[0].delta.tool_calls or [])]
        assert [d.function.name for d in deltas if d.function.name] == [name]
        fragments = [d.function.arguments for d in deltas if d.function.arguments]
        assert "".join(fragments) == call.function.arguments
        if name == "get_weather":  # the arguments come as they are written, not at the end
            assert len(fragments) > 3
    # The client sends the call and its result back, as the openai client shapes them.
    follow = [*CHAT, out.choices[0].message.model_dump(exclude_none=True),
              {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
    again = client.chat.completions.create(model="tiny", messages=follow, tools=TOOLS, tool_choice="none",
                                           max_tokens=8)
    assert again.choices[0].message.tool_calls is None and again.choices[0].finish_reason in ("stop", "length")
    auto = client.chat.completions.create(model="tiny", messages=follow, tools=TOOLS, max_tokens=8)
    assert auto.choices[0].message.content or auto.choices[0].message.tool_calls


def test_tools_are_in_the_prompt_unless_tool_choice_is_none(client):
    """The demo template ignores `tools`: they are described in the system prompt instead."""
    def prompt_tokens(**kw) -> int:
        return client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=1, **kw).usage.prompt_tokens
    plain = prompt_tokens()
    assert prompt_tokens(tools=TOOLS, tool_choice="none") == plain
    assert prompt_tokens(tools=TOOLS) == prompt_tokens(tools=TOOLS, tool_choice="required") > plain + 50


def test_a_handed_over_constrained_request_continues_its_json(cluster):
    """The message a hand-over sends (generated_ids, the same SamplingSpec with its grammar), sent
    to the serving worker: the worker replays the tokens into the grammar and goes on as one run."""
    admin = httpx.Client(base_url=cluster.gateway_url, headers={"Authorization": f"Bearer {ADMIN_KEY}"})
    (inst,) = [i for i in admin.get("/admin/v1/cluster").json()["instances"]
               if i["model"] == "tiny" and i["state"] == "ready"]
    grammar = LLMatcher.grammar_from_json_schema(WEATHER, overrides={"whitespace_flexible": False})
    spec = m.SamplingSpec(temperature=0, max_tokens=100, grammar=grammar)

    def generate(generated: list[int]) -> list[m.TokenEvent]:
        return generate_on_worker(cluster.nats_url, inst["stages"][0]["worker_id"], inst["instance_id"], [1, 17, 200],
                                  spec, generated)

    full = generate([])
    assert not any(e.error for e in full) and full[-1].finish_reason == "stop"
    tokens = [e.token_id for e in full]
    resumed = generate(tokens[:4])
    assert tokens[:4] + [e.token_id for e in resumed] == tokens


@pytest.mark.parametrize("body,param", [
    ({"response_format": json_schema_format({"type": "foo"})}, "response_format"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "a": {"type": "string", "pattern": "(("}}}}}]}, "tools.0.function.parameters"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
])
def test_invalid_structured_requests_are_a_400_naming_the_parameter(cluster, body, param):
    r = httpx.post(cluster.gateway_url + "/v1/chat/completions", json={"model": "tiny", "messages": CHAT, **body},
                   headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text
