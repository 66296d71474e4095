"""What the gateway's routes answer, for its OpenAPI document: the 200 bodies of the OpenAI routes
and, per route, every error status it can return, each with the OpenAI error object as its body.

These models document; the routes build their answers themselves (no response_model validates
them), so a model here is as loose as the answers are: a field a route may leave out is optional."""

from typing import Any, Literal

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, ConfigDict

# --- errors ---------------------------------------------------------------------------------------


class ErrorObject(BaseModel):
    message: str
    type: str  # e.g. invalid_request_error; a rate limit's is the limit hit: requests | tokens
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """Every error the gateway answers (services/gateway/errors.py), as OpenAI's API does."""

    error: ErrorObject


def _error(description: str) -> dict[str, Any]:
    return {"model": ErrorResponse, "description": description}


# Any route: a body over the size limit (BodyLimit), a body not all sent in time (server.py's
# BodyTimeout) and an unexpected failure.
ANY_ROUTE = {
    408: _error("The request body did not arrive within the server's body timeout"),
    413: _error("The request body is larger than the gateway's limit"),
    500: _error("Internal error"),
}
INVALID = {400: _error("Invalid request: a body or parameter that does not validate, or invalid JSON")}
API_KEY = {
    401: _error("Missing or incorrect API key"),
    503: _error("Not ready: the gateway has not read the model registry yet, the model is loading, "
                "the registry cannot check the key, or no instance has capacity (Retry-After)"),
}
ADMIN_KEY = {
    401: _error("Missing or incorrect admin key"),
    503: _error("The registry is not answering (Retry-After)"),
}
UNKNOWN_MODEL = {404: _error("The model does not exist, or the key may not use it")}
NOT_FOUND = {404: _error("No such model, key or profile in the registry")}
CONFLICT = {409: _error("It exists already (a model or key of that name)")}
LIMITED = {429: _error("Rate limited (the key's requests or tokens per minute) or the model's queue is full")}


def errors(*tables: dict[int, dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """A route's error responses: those of any route, and those of `tables`."""
    out = dict(ANY_ROUTE)
    for table in tables:
        out.update(table)
    return dict(sorted(out.items()))


# --- 200 bodies of the OpenAI routes ------------------------------------------------------------------


class _Answer(BaseModel):
    model_config = ConfigDict(extra="allow")  # a field added to an answer does not break the document


class Usage(_Answer):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class Model(_Answer):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str


class ModelList(_Answer):
    object: Literal["list"]
    data: list[Model]


class CompletionChoice(_Answer):
    index: int
    text: str
    logprobs: dict[str, Any] | None
    finish_reason: str | None


class Completion(_Answer):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None  # in a stream: only on its last chunk, when stream_options asks for it


class AnswerFunctionCall(_Answer):
    name: str | None = None  # a streamed call's later chunks carry only arguments
    arguments: str


class AnswerToolCall(_Answer):
    index: int | None = None  # streamed calls only
    id: str | None = None
    type: Literal["function"] | None = None
    function: AnswerFunctionCall


class AssistantMessage(_Answer):
    role: Literal["assistant"]
    content: str | None
    tool_calls: list[AnswerToolCall] | None = None


class ChatChoice(_Answer):
    index: int
    message: AssistantMessage
    logprobs: dict[str, Any] | None
    finish_reason: str | None


class ChatCompletion(_Answer):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(_Answer):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[AnswerToolCall] | None = None


class ChatChunkChoice(_Answer):
    index: int
    delta: ChatDelta
    logprobs: dict[str, Any] | None
    finish_reason: str | None


class ChatCompletionChunk(_Answer):
    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class Tokens(_Answer):
    count: int
    max_model_len: int
    tokens: list[int]


class Text(_Answer):
    prompt: str


class Health(_Answer):
    status: Literal["ok", "starting"]


def answer(model: type[BaseModel], description: str = "Successful Response") -> dict[int, dict[str, Any]]:
    return {200: {"model": model, "description": description}}


def streamed(model: type[BaseModel], chunk: type[BaseModel]) -> dict[int, dict[str, Any]]:
    """A 200 that is `model` as JSON, or with `stream: true` server-sent events of `chunk`s.

    The events as OpenAPI 3.2 describes a stream (`itemSchema`, one event: its `data` field a JSON
    text of the chunk, or of an ErrorResponse when the stream fails after it began, or `[DONE]`), so
    that a tool checking answers (Schemathesis) validates each event."""
    data = {"type": "string", "if": {"const": "[DONE]"}, "else": {
        "contentMediaType": "application/json",
        "contentSchema": {"anyOf": [{"$ref": f"#/components/schemas/{chunk.__name__}"},
                                    {"$ref": "#/components/schemas/ErrorResponse"}]}}}
    return {200: {"model": model, "description": (
        f"A {model.__name__}; with stream true, server-sent events: each `data:` line one {chunk.__name__} "
        "as JSON, then `data: [DONE]`. An error after the stream began comes in-band as `data: ` and an "
        "ErrorResponse."), "content": {"text/event-stream": {
            "itemSchema": {"type": "object", "required": ["data"], "properties": {"data": data}}}}}}


STREAM_CHUNKS = (ChatCompletionChunk, Completion)


def install_openapi(app: FastAPI) -> None:
    """The document without FastAPI's 422 (the app answers a body that does not validate with a 400,
    declared per route), and with the streamed chunks' schemas."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            # 3.2: the first version that describes an event stream (itemSchema); nothing else differs.
            doc = get_openapi(title=app.title, version=app.version, routes=app.routes, openapi_version="3.2.0")
            for path in doc["paths"].values():
                for operation in path.values():
                    operation.get("responses", {}).pop("422", None)
            schemas = doc.setdefault("components", {}).setdefault("schemas", {})
            for name in ("HTTPValidationError", "ValidationError"):
                schemas.pop(name, None)
            for chunk in STREAM_CHUNKS:
                schema = chunk.model_json_schema(ref_template="#/components/schemas/{model}", mode="serialization")
                schemas.update(schema.pop("$defs", {}))
                schemas.setdefault(chunk.__name__, schema)
            app.openapi_schema = doc
        return app.openapi_schema

    app.openapi = openapi
