"""services.gateway.structured: response_format and tools as grammars, tools in the prompt, tool
calls parsed back out of streamed text (no cluster; end to end: test_structured_e2e.py)."""

import json

import pytest
from fastapi.testclient import TestClient
from llguidance import LLMatcher

from libs.checkpoint.demo import build_tokenizer
from services.gateway.app import create_app
from services.gateway.errors import APIError
from services.gateway.schemas import ChatCompletionRequest
from services.gateway.service import GatewayService
from services.gateway.structured import ForcedCall, ToolCallParser, chat_turns, plan_chat, template_renders_tools


def gateway_without_models() -> GatewayService:
    """A gateway that has read a registry listing no model (else every model is 503 'starting')."""
    gateway = GatewayService()
    gateway._mark_synced()
    return gateway


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CLOCK = {"type": "function", "function": {"name": "get_time"}}
USER = [{"role": "user", "content": "Weather in Paris?"}]


def chat(**kw) -> ChatCompletionRequest:
    return ChatCompletionRequest(model="m", messages=USER, **kw)


def accepts(grammar: str, text: str) -> bool:
    """Whether `text` is a complete match of the grammar (checked byte-wise, no model tokenizer)."""
    tok = _byte_tokenizer()
    m = LLMatcher(tok, grammar, log_level=0)
    return m.consume_tokens(tok.tokenize_str(text)) and m.is_accepting()


_TOK = []


def _byte_tokenizer():
    if not _TOK:
        import llguidance.hf
        _TOK.append(llguidance.hf.from_tokenizer(build_tokenizer(512)))
    return _TOK[0]


def test_response_formats():
    assert plan_chat(chat()).grammar is None
    assert plan_chat(chat(response_format={"type": "text"})).grammar is None
    anyobj = plan_chat(chat(response_format={"type": "json_object"})).grammar
    assert accepts(anyobj, '{"a": [1, 2], "b": {"c": null}}') and not accepts(anyobj, "[1]")
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}
    g = plan_chat(chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})).grammar
    assert accepts(g, '{"n": 3}') and not accepts(g, '{"n": "3"}') and not accepts(g, '{"n":3}')  # fixed separators


@pytest.mark.parametrize("kw,param", [
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}),
     "response_format"),
    (dict(tools=[{**WEATHER, "function": {**WEATHER["function"], "parameters": {"type": "object", "properties": {
        "a": {"type": "string", "pattern": "(("}}}}}]), "tools.0.function.parameters"),
    (dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice"),
])
def test_invalid_schemas_and_unknown_tools_are_a_400_naming_the_parameter(kw, param):
    with pytest.raises(APIError) as e:
        plan_chat(chat(**kw))
    assert e.value.status == 400 and e.value.param == param


def test_tool_choices():
    none = plan_chat(chat(tools=[WEATHER], tool_choice="none"))
    assert (none.grammar, none.tools, none.parse_calls) == (None, [], False)
    auto = plan_chat(chat(tools=[WEATHER, CLOCK]))  # auto by default
    assert auto.grammar is None and auto.parse_calls and [t["function"]["name"] for t in auto.tools] == [
        "get_weather", "get_time"]
    required = plan_chat(chat(tools=[WEATHER, CLOCK], tool_choice="required")).grammar
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    assert accepts(required, call)
    assert accepts(required, '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')
    assert not accepts(required, call.replace('"Paris"', "3"))  # the arguments' schema
    assert not accepts(required, '<tool_call>\n{"name": "get_time", "arguments": {"x": 1}}\n</tool_call>')
    assert not accepts(required, "Sure!")
    named = plan_chat(chat(tools=[WEATHER, CLOCK], tool_choice={"type": "function", "function": {"name": "get_time"}}))
    assert accepts(named.grammar, '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')
    assert not accepts(named.grammar, call) and not named.parallel
    # auto with a response_format: its JSON, or a call
    both = plan_chat(chat(tools=[WEATHER], response_format={"type": "json_object"})).grammar
    assert accepts(both, call) and accepts(both, '{"answer": 1}') and not accepts(both, "Sure!")


def test_tool_choice_needs_tools():
    client = TestClient(create_app(gateway_without_models(), ["k"], ["k"]), headers={"Authorization": "Bearer k"})
    r = client.post("/v1/chat/completions", json={"model": "m", "messages": USER, "tool_choice": "required"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice", r.text


def test_a_template_that_ignores_tools_gets_them_in_the_system_prompt():
    tok = build_tokenizer(512)  # the demo models' ChatML template, which ignores `tools`
    assert not template_renders_tools(tok)
    plan = plan_chat(chat(tools=[WEATHER]))
    turns = chat_turns(ChatCompletionRequest(model="m", messages=[
        {"role": "system", "content": "Be brief."}, *USER,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]).messages, plan.tools, native=False)
    assert turns[0]["role"] == "system" and turns[0]["content"].startswith("Be brief.\n\n# Tools")
    assert json.dumps(WEATHER) in turns[0]["content"]
    assert turns[2] == {"role": "assistant", "content": '<tool_call>\n{"name": "get_weather", "arguments": '
                                                       '{"city": "Paris"}}\n</tool_call>'}
    assert turns[3] == {"role": "user", "content": "<tool_response>\nsunny\n</tool_response>"}
    tok.apply_chat_template(turns, tokenize=False)  # renders
    tok.chat_template = ("{% for m in messages %}{{ m.content }}{% endfor %}"
                         "{% if tools %}{% for t in tools %}{{ t.function.name }}{% endfor %}{% endif %}")
    assert template_renders_tools(tok)


def test_tool_calls_are_parsed_out_of_streamed_text():
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    text = "Let me look." + call + "\n" + call.replace("Paris", "Oslo")
    for parallel, n in ((True, 2), (False, 1)):
        p = ToolCallParser({"get_weather"}, parallel)
        sent = "".join(p.feed(text[i:i + 3]) for i in range(0, len(text), 3))  # 3 characters a token
        rest, calls = p.finish()
        assert sent + rest == "Let me look." and len(calls) == n
        assert calls[0]["type"] == "function" and calls[0]["id"].startswith("call_")
        assert calls[0]["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    # Not a call after all (an unknown tool, broken JSON, a lone "<"): it was content.
    for text in ('<tool_call>\n{"name": "other", "arguments": {}}\n</tool_call>', "<tool_call>{oops</tool_call>",
                 "a < b", "<tool"):
        p = ToolCallParser({"get_weather"})
        sent = p.feed(text)
        rest, calls = p.finish()
        assert (sent + rest, calls) == (text, [])


def test_a_forced_call_streams_its_name_then_its_arguments():
    args = '{"city": "Paris", "when": {"day": 1}}'
    text = '<tool_call>\n{"name": "get_weather", "arguments": ' + args + '}\n</tool_call>'
    call = ForcedCall()
    events = [call.feed(text[i:i + 2]) for i in range(0, len(text), 2)]
    last = call.finish()
    names = [n for n, _ in events if n]
    fragments = [a for _, a in events if a] + [last]
    assert names == ["get_weather"] and "".join(fragments) == args and len(fragments) > 5
    assert call.call()["function"] == {"name": "get_weather", "arguments": args}
    cut = ForcedCall()  # cut short (max_tokens): the arguments so far
    cut.feed(text[:60])
    cut.finish()
    assert cut.name == "get_weather" and args.startswith(cut.arguments) and cut.arguments
    early = ForcedCall()  # cut before the name is known: no call
    assert early.feed(text[:20]) == (None, "") and early.finish() == "" and early.name is None
    assert early.unparsed == text[:20] and cut.unparsed == ""
