"""Structured output and tool calls: `response_format` and `tools`/`tool_choice` as grammars the
workers decode under (libs/engine/grammar.py), tool definitions in the prompt, and tool calls
parsed back out of the text into OpenAI's shape.

Grammars are llguidance's (made here, validated here: an invalid schema is a 400 naming its
parameter; the workers only run them). JSON is written with fixed separators (", " and ": ", as
`json.dumps`) and no other whitespace: the output is bounded (a model cannot pad it with
newlines forever) and reads as models most often write JSON.

Tool calls use the Hermes format (Qwen2.5, Hermes, many fine-tunes):
`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`. A chat template that renders
`tools` itself gets them that way; one that ignores them (SmolLM2's, the demo models') gets
them described in the system prompt, with that format, as Qwen2.5's template writes it.
`tool_choice`: "none" renders no tools and returns text; "auto" renders them and parses the
output (a call if there is one, else content); "required" constrains the output to one call of
any tool (a JSON schema per tool: the name, its arguments' schema), a named tool to that tool's.
Streamed, a required or named call's arguments go out as they are written (ForcedCall); with
"auto", content goes out until a <tool_call> tag and the calls come at the end (ToolCallParser).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

from llguidance import LLMatcher

from services.gateway.errors import APIError

JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
OPEN, CLOSE = "<tool_call>", "</tool_call>"
_CALL = re.compile(re.escape(OPEN) + r"\s*(.*?)\s*" + re.escape(CLOSE), re.S)
# A function defined without parameters takes none (OpenAI: "an empty parameter list").
NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}

TOOLS_PROMPT = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""


def _check(grammar: str, param: str) -> str:
    error = LLMatcher.validate_grammar(grammar)
    if error:
        raise APIError(400, f"Invalid value for '{param}': {error.strip()}", param=param, code="invalid_value")
    return grammar


def json_grammar(schema: dict, param: str) -> str:
    """The grammar of JSON text that validates against `schema`."""
    try:
        return _check(LLMatcher.grammar_from_json_schema(schema, overrides=JSON_OPTIONS), param)
    except ValueError as e:  # not a JSON object at all
        raise APIError(400, f"Invalid value for '{param}': {e}", param=param, code="invalid_value") from e


def response_schema(response_format) -> dict | None:
    """The JSON schema a `response_format` asks for (None: free text)."""
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_object":
        return {"type": "object"}
    return response_format.json_schema.schema_ if response_format.json_schema.schema_ is not None else {}


def _lark_json(schema: dict) -> str:
    return "%json " + json.dumps({**schema, "x-guidance": JSON_OPTIONS})


@dataclass
class ChatPlan:
    """What a chat request's response_format and tools make of it."""

    grammar: str | None = None  # the output's, if constrained
    tools: list[dict] = field(default_factory=list)  # rendered into the prompt ([]: none)
    parse_calls: bool = False  # tool calls are looked for in the output
    parallel: bool = True  # more than one call may be returned (auto)
    forced: bool = False  # the output is one call (required, named): its arguments stream as they come


def plan_chat(body) -> ChatPlan:
    """Grammar, rendered tools and parsing for a chat request (400s name the parameter at fault)."""
    schema = response_schema(body.response_format)
    answer = json_grammar(schema, "response_format") if schema is not None else None
    choice = body.tool_choice or ("auto" if body.tools else "none")
    if not body.tools or choice == "none":
        return ChatPlan(grammar=answer)
    tools = body.tools
    for i, t in enumerate(tools):
        if t.function.parameters is not None:
            json_grammar(t.function.parameters, f"tools.{i}.function.parameters")
    if not isinstance(choice, str):  # a named function
        tools = [t for t in tools if t.function.name == choice.function.name]
        if not tools:
            raise APIError(400, f"Invalid value for 'tool_choice': no tool named {choice.function.name!r} in "
                           "'tools'", param="tool_choice", code="invalid_value")
    calls = [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
              "properties": {"name": {"const": t.function.name},
                             "arguments": t.function.parameters or NO_PARAMETERS}} for t in tools]
    call = f'call: "{OPEN}\\n" {_lark_json(calls[0] if len(calls) == 1 else {"anyOf": calls})} "\\n{CLOSE}"'
    if choice == "auto":  # free text or a call; with a response_format, its JSON or a call
        lark = None if answer is None else f"start: call | answer\n{call}\nanswer: {_lark_json(schema)}"
    else:
        lark = f"start: call\n{call}"
    grammar = None if lark is None else _check(LLMatcher.grammar_from_lark(lark), "tools")
    return ChatPlan(grammar=grammar, tools=[t.model_dump(exclude_none=True) for t in body.tools], parse_calls=True,
                    parallel=choice == "auto" and body.parallel_tool_calls is not False, forced=choice != "auto")


# --- prompts -------------------------------------------------------------------------------------


def template_renders_tools(tokenizer) -> bool:
    """Whether the model's chat template writes `tools` (if not, the system prompt describes them)."""
    turns = [{"role": "user", "content": "hi"}]
    probe = [{"type": "function", "function": {"name": "probe_tool_xyz", "parameters": NO_PARAMETERS}}]
    try:
        return "probe_tool_xyz" in tokenizer.apply_chat_template(turns, tools=probe, tokenize=False)
    except Exception:
        return False


def _call_text(call) -> str:
    return f"{OPEN}\n{json.dumps({'name': call.function.name, 'arguments': _arguments(call.function.arguments)})}\n{CLOSE}"


def chat_turns(messages, tools: list[dict], native: bool) -> list[dict]:
    """The messages as the chat template takes them. Tool calls and results: as the template
    wants them when it renders tools (`native`), else as Hermes-format text (a tool result as a
    user turn in <tool_response> tags), the tools described in the system prompt."""
    turns = []
    for msg in messages:
        role = "system" if msg.role == "developer" else msg.role
        turn = {"role": role, "content": msg.text()}
        if native:
            if msg.tool_calls:
                turn["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                    "name": c.function.name, "arguments": _arguments(c.function.arguments)}} for c in msg.tool_calls]
            if msg.tool_call_id is not None:
                turn["tool_call_id"] = msg.tool_call_id
        elif msg.tool_calls:
            turn["content"] = "\n".join([turn["content"]] * bool(turn["content"]) + [_call_text(c) for c in msg.tool_calls])
        elif role == "tool":
            turn = {"role": "user", "content": f"<tool_response>\n{turn['content']}\n</tool_response>"}
        turns.append(turn)
    if tools and not native:
        described = TOOLS_PROMPT.format(tools="\n".join(json.dumps(t) for t in tools))
        if turns and turns[0]["role"] == "system":
            turns[0] = {**turns[0], "content": f"{turns[0]['content']}\n\n{described}"}
        else:
            turns.insert(0, {"role": "system", "content": described})
    return turns


def _arguments(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return text


# --- tool calls out of the text ---------------------------------------------------------------------


class ToolCallParser:
    """Text as it streams: content goes out until a <tool_call> tag (a possible tag's beginning is
    held back); from the tag on, the rest is kept and parsed at the end into OpenAI tool calls
    (if it does not parse, it was content after all)."""

    def __init__(self, tool_names: set[str], parallel: bool = True):
        self.names, self.parallel = tool_names, parallel
        self._held = ""
        self._in_call = False

    def feed(self, text: str) -> str:
        """The content safe to send now."""
        buf = self._held + text
        if self._in_call:
            self._held = buf
            return ""
        at = buf.find(OPEN)
        if at >= 0:
            self._in_call, self._held = True, buf[at:]
            return buf[:at]
        hold = max((k for k in range(1, min(len(OPEN), len(buf)) + 1) if buf.endswith(OPEN[:k])), default=0)
        self._held = buf[len(buf) - hold:]
        return buf[:len(buf) - hold]

    def finish(self) -> tuple[str, list[dict]]:
        """(the content left, the tool calls) at the end of the output."""
        held, self._held = self._held, ""
        calls = self._parse(held) if self._in_call else []
        return ("", calls) if calls else (held, [])

    def _parse(self, text: str) -> list[dict]:
        calls = []
        for found in _CALL.finditer(text):
            try:
                call = json.loads(found.group(1))
            except ValueError:
                return []
            args = call.get("arguments", call.get("parameters")) if isinstance(call, dict) else None
            if not isinstance(args, dict) or call.get("name") not in self.names:
                return []
            calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                          "function": {"name": call["name"], "arguments": json.dumps(args, ensure_ascii=False)}})
        return calls if self.parallel else calls[:1]


_HEAD = re.compile(r'\s*' + re.escape(OPEN) + r'\n\{"name": "([A-Za-z0-9_-]+)", "arguments": ')
_TAIL = "}\n" + CLOSE


class ForcedCall:
    """A required or named call as it streams: its grammar fixes the layout (the Hermes tags, the
    name first, fixed separators), so the name is known as soon as it is written and the arguments'
    text goes out as it comes (all but what may be the closing `}` and tag, held back)."""

    def __init__(self):
        self.id = f"call_{uuid.uuid4().hex[:24]}"
        self.name: str | None = None
        self.arguments = ""  # sent so far
        self._buf = ""

    def feed(self, text: str) -> tuple[str | None, str]:
        """(the name, when it has just become known; the arguments' new text)."""
        self._buf += text
        named = None
        if self.name is None:
            head = _HEAD.match(self._buf)
            if head is None:
                return None, ""
            self.name = named = head.group(1)
            self._buf = self._buf[head.end():]
        return named, self._take(len(self._buf) - len(_TAIL))

    def finish(self) -> str:
        """The arguments' last text (the output is complete, or was cut short)."""
        end = len(self._buf) - len(_TAIL) if self._buf.endswith(_TAIL) else len(self._buf)
        return self._take(end) if self.name is not None else ""

    def _take(self, end: int) -> str:
        new = self._buf[len(self.arguments):end] if end > len(self.arguments) else ""
        self.arguments += new
        return new

    @property
    def unparsed(self) -> str:
        """What was written while no name is known yet."""
        return self._buf if self.name is None else ""

    def call(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
