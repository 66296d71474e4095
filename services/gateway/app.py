"""HTTP layer of the gateway: the OpenAI-compatible API, the admin API,
`/health` and `/metrics`."""

import asyncio
import json
import logging
import re
import secrets
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi.routing import APIRoute
from starlette.routing import Match
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, Counter, generate_latest
from pydantic import ValidationError
from pydantic_core import from_json
from starlette.exceptions import HTTPException as StarletteHTTPException

from libs.checkpoint.format import CheckpointIndex, is_block_checkpoint
from libs.protocol import messages as m
from libs.protocol import subjects
from libs.bus.broker import RemoteError, call
from libs.planning.mesh_profiles import InvalidProfile, profile_from_message
from services.gateway.errors import APIError, invalid_key, missing_key
from services.gateway.logprobs import CompletionLogprobs, chat_content
from services.gateway.responses import (
    ADMIN_KEY,
    API_KEY,
    CONFLICT,
    INVALID,
    LIMITED,
    NOT_FOUND,
    UNKNOWN_MODEL,
    ChatCompletion,
    ChatCompletionChunk,
    Completion,
    Health,
    Model,
    ModelList,
    Text,
    Tokens,
    answer,
    errors,
    install_openapi,
    streamed,
)
from services.gateway.schemas import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    DeployRequest,
    DetokenizeRequest,
    KeyRequest,
    ProfileRequest,
    TokenizeRequest,
)
from services.gateway.service import (
    INLINE_TOKENIZE_BYTES,
    GatewayConfig,
    GatewayService,
    Generation,
    ModelEntry,
    Piece,
)
from services.gateway.tenants import Caller, Tenants, Ticket, new_secret
from services.gateway.structured import (
    ForcedCall,
    ToolCallParser,
    chat_turns,
    json_grammar,
    plan_chat,
    response_schema,
)

log = logging.getLogger(__name__)

REQUESTS = Counter("layercast_gateway_requests_total", "HTTP requests", ["endpoint", "status"])


def _bearer(request: Request) -> str | None:
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


def _check_key(request: Request, keys: list[str], what: str) -> None:
    token = _bearer(request)
    if token is None:
        raise missing_key(what)
    if not any(secrets.compare_digest(token, k) for k in keys):
        raise invalid_key(what)


def utf8_len(text: str) -> int:
    return len(text) if text.isascii() else len(text.encode())  # isascii is O(1): no copy of a large prompt


class BodyLimit:
    """Refuses a request body over `max_bytes` (413) before anything reads or parses it: by its
    Content-Length, or, sent chunked, by counting the bytes as they come (kept up to the limit,
    then handed on)."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        length = headers.get(b"content-length")
        if length is not None:
            if length.isdigit() and int(length) > self.max_bytes:
                return await self._refuse(scope, receive, send)
            return await self.app(scope, receive, send)
        if b"chunked" not in headers.get(b"transfer-encoding", b"").lower():
            return await self.app(scope, receive, send)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client went away
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                return await self._refuse(scope, receive, send)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)

        async def replay():
            nonlocal body
            if body is None:
                return await receive()  # afterwards, only a disconnect can come
            message, body = {"type": "http.request", "body": body, "more_body": False}, None
            return message
        await self.app(scope, replay, send)

    async def _refuse(self, scope, receive, send) -> None:
        error = APIError(413, f"The request body is larger than the gateway's limit of {self.max_bytes} bytes",
                         code="request_too_large")
        await error.response()(scope, receive, send)


def bounded_input_route(config: GatewayConfig) -> type[APIRoute]:
    """Routes that parse a JSON body themselves, before FastAPI would, and refuse one with more
    chat messages or token ids than `config` allows before pydantic validates each item (work
    proportional to the count, on the event loop). The parser is pydantic-core's: it refuses a
    lone UTF-16 surrogate ("\\ud800"), which no UTF-8 text can hold, so no handler meets one
    when it encodes the text. Parsing stays on the event loop: tens of ms for a body at the
    8 MiB limit, and the parser holds the GIL, so a thread would not free the loop meanwhile."""

    class BoundedInputRoute(APIRoute):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.path_regex = whole_path(self.path_regex)

        def get_route_handler(self):
            handle = super().get_route_handler()

            async def parse_then_handle(request: Request) -> Response:
                if request.method in ("POST", "PUT", "PATCH") and _json_content(request.headers.get("content-type")):
                    body = await request.body()
                    if body:
                        try:
                            data = from_json(body, allow_inf_nan=False)  # NaN and Infinity are not JSON
                        except ValueError as e:
                            raise APIError(400, f"The request body is not valid JSON (or holds a lone UTF-16 "
                                           f"surrogate, which is not text): {e}", code="invalid_json") from e
                        check_input_counts(data, config)
                        request._json = data  # what FastAPI's request.json() returns: not parsed again
                return await handle(request)
            return parse_then_handle

    return BoundedInputRoute


def whole_path(regex: re.Pattern) -> re.Pattern:
    """A route's path pattern (Starlette's compile_path: "^/v1/models/(?P<name>.*)$") matching the
    whole decoded path, newlines included: with Starlette's own, "." stops at a newline (a name
    holding "%0A" fell through to the router's undeclared 404) and "$" matches before a final one
    ("/admin/v1/models/tiny%0A" named "tiny")."""
    return re.compile(regex.pattern.removesuffix("$") + r"\Z", regex.flags | re.DOTALL)


def allowed_methods(routes, scope) -> list[str]:
    """The methods of every route whose path matches `scope`'s: Starlette's 405 names only the first
    route's ("Allow: POST" for /admin/v1/keys, whose GET is another route; Schemathesis's ST205)."""
    return sorted({method for route in routes if getattr(route, "methods", None)
                   and route.matches(scope)[0] != Match.NONE for method in route.methods})


def _json_content(content_type: str | None) -> bool:
    """Whether FastAPI would parse a body of this type as JSON (none given: it would)."""
    if not content_type:
        return True
    kind = content_type.split(";", 1)[0].strip().lower()
    return kind == "application/json" or (kind.startswith("application/") and kind.endswith("+json"))


def check_input_counts(data, config: GatewayConfig) -> None:
    """400 for a body with more chat messages (content parts, tool calls and tools counted too)
    or token ids than `config` allows; in time proportional to the number of messages only."""
    if not isinstance(data, dict):
        return
    messages, tools = data.get("messages"), data.get("tools")
    items = len(tools) if isinstance(tools, list) else 0
    if isinstance(messages, list):
        items += len(messages)
        if items <= config.max_messages:  # each message's parts and calls: only for a bounded list
            for msg in messages:
                if isinstance(msg, dict):
                    items += sum(len(v) for v in (msg.get("content"), msg.get("tool_calls")) if isinstance(v, list))
    if items > config.max_messages:
        raise APIError(400, f"Invalid 'messages': too many items: {items} messages, content parts, tool calls "
                       f"and tools, more than this gateway's limit of {config.max_messages}", param="messages",
                       code="array_above_max_length")
    for name in ("prompt", "tokens"):
        ids = data.get(name)
        if isinstance(ids, list) and len(ids) > config.max_token_ids:
            raise APIError(400, f"Invalid '{name}': {len(ids)} token ids, more than this gateway's limit of "
                           f"{config.max_token_ids}", param=name, code="array_above_max_length")


def _param(loc: tuple) -> str:
    parts = [str(p) for p in loc if p != "body"]
    # pydantic reports union members (e.g. 'str', 'list[str]'): keep the field path only
    return ".".join(p for p in parts if not any(c in p for c in "[]") and p not in ("str", "int")) or "body"


def create_app(service: GatewayService, api_keys: list[str], admin_keys: list[str]) -> FastAPI:
    """`api_keys`: the static keys (every model, no limits); other keys are registry records."""
    tenants = Tenants(service.broker, api_keys, service.config.key_cache_s)

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        await service.start()
        service.spawn(service.every(service.config.usage_flush_s, tenants.flush, "recording usage"))
        yield
        try:
            await tenants.flush(timeout=2.0)  # the last second's usage
        except Exception as e:
            log.warning("usage not recorded at shutdown: %s", e)
        await service.stop()

    app = FastAPI(title="layercast gateway", version="0.1.0", lifespan=lifespan)
    app.router.route_class = bounded_input_route(service.config)  # every route defined below
    app.add_middleware(BodyLimit, max_bytes=service.config.max_body_bytes)
    install_openapi(app)

    async def api_key(request: Request) -> Caller:
        caller = await tenants.authenticate(_bearer(request))
        await service.wait_synced()  # a just-started gateway: hold the request for the registry's models
        return caller

    def model_entry(caller: Caller, name: str) -> ModelEntry:
        # A model the key may not use is refused exactly as one that does not exist.
        return service.entry(name, visible=caller.allows(name))

    def admin_key(request: Request) -> None:
        _check_key(request, admin_keys, "admin")

    # --- errors: always OpenAI-shaped JSON -----------------------------------------------------
    @app.exception_handler(APIError)
    async def _api_error(_r: Request, e: APIError) -> JSONResponse:
        return e.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(_r: Request, e: RequestValidationError) -> JSONResponse:
        first = e.errors()[0]
        if first.get("type") == "json_invalid":
            return APIError(400, "The request body is not valid JSON", code="invalid_json").response()
        extra = next((err for err in e.errors() if err.get("type") == "extra_forbidden"), None)
        if extra is not None:  # a field the body model does not declare: not implemented here
            param = _param(tuple(extra.get("loc", ())))
            return APIError(400, f"Unsupported parameter: '{param}' is not supported by layercast", param=param,
                            code="unsupported_parameter").response()
        param = _param(tuple(first.get("loc", ())))
        msg = first.get("msg", "invalid value").removeprefix("Value error, ")
        return APIError(400, f"Invalid value for '{param}': {msg}", param=param, code="invalid_value").response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(r: Request, e: StarletteHTTPException) -> JSONResponse:
        # Starlette's own headers ride along: a 405's Allow (RFC 9110 requires it) names the methods.
        headers = dict(e.headers or {})
        if e.status_code == 405:
            headers["Allow"] = ", ".join(allowed_methods(app.router.routes, r.scope))
        return APIError(e.status_code, str(e.detail), headers=headers).response()

    @app.exception_handler(Exception)
    async def _unexpected(_r: Request, e: Exception) -> JSONResponse:
        return APIError(500, f"internal error: {type(e).__name__}").response()

    @app.middleware("http")
    async def _count(request: Request, call_next):
        response = await call_next(request)
        route = request.scope.get("route")
        REQUESTS.labels(getattr(route, "path", "unmatched"), str(response.status_code)).inc()
        return response

    # --- operations ----------------------------------------------------------------------------------
    @app.get("/health", response_model=None, responses={**errors(), **answer(Health), 503: {
        "model": Health, "description": "Not ready: the registry has not been read yet"}})
    async def health() -> JSONResponse:
        """Readiness: 503 until the registry has been read once (no model could be answered before)."""
        ok = service.healthy()
        return JSONResponse({"status": "ok" if ok else "starting"}, status_code=200 if ok else 503)

    @app.get("/livez", response_model=None, responses=errors() | answer(Health))
    async def livez() -> JSONResponse:
        """Liveness: the process answers. Not the registry: a registry outage must not restart gateways."""
        return JSONResponse({"status": "ok"})

    @app.get("/metrics", response_class=Response, responses=errors() | {200: {
        "description": "Prometheus text format", "content": {CONTENT_TYPE_LATEST: {"schema": {"type": "string"}}}}})
    async def metrics() -> Response:
        return Response(generate_latest(REGISTRY), media_type=CONTENT_TYPE_LATEST)

    # --- OpenAI API ----------------------------------------------------------------------------------
    @app.get("/v1/models", response_model=None, responses=errors(API_KEY) | answer(ModelList))
    async def list_models(caller: Caller = Depends(api_key)) -> dict:
        service.require_synced()  # an empty list before the first registry read would be a wrong answer
        return {"object": "list", "data": [
            {"id": name, "object": "model", "created": int(e.info.created_at), "owned_by": "layercast"}
            for name, e in sorted(service.models.items()) if caller.allows(name)]}

    @app.get("/v1/models/{name:path}", response_model=None,
             responses=errors(API_KEY, UNKNOWN_MODEL) | answer(Model))
    async def get_model(name: str, caller: Caller = Depends(api_key)) -> dict:
        e = model_entry(caller, name)
        return {"id": name, "object": "model", "created": int(e.info.created_at), "owned_by": "layercast"}

    async def _tokenize_chat(entry: ModelEntry, messages: list[ChatMessage], add_generation_prompt: bool,
                             add_special_tokens: bool = False, tools: list[dict] = ()) -> list[int]:
        # Tools, calls and results go to a template that renders tools as it wants them, else as text.
        native = bool(tools or any(msg.tool_calls or msg.tool_call_id for msg in messages)) and entry.renders_tools
        turns = chat_turns(messages, list(tools), native)
        nbytes = sum(utf8_len(t["content"]) for t in turns) + (utf8_len(json.dumps(tools)) if native else 0)
        return await service.tokenize(entry, nbytes, "messages",
                                      lambda: _chat_ids(entry, turns, add_generation_prompt, add_special_tokens,
                                                        list(tools) if native else None), messages=len(turns))

    def sampling(entry: ModelEntry, body: CompletionRequest | ChatCompletionRequest, prompt_len: int,
                 grammar: str | None) -> m.SamplingSpec:
        if body.n > service.config.max_n:  # each choice takes a KV slot of an instance
            raise APIError(400, f"Invalid value for 'n': {body.n} is more than this gateway's limit of "
                           f"{service.config.max_n}", param="n", code="invalid_value")
        max_tokens = service.resolve_max_tokens(entry, prompt_len, *body.asked_max_tokens())
        return body.to_sampling_spec(max_tokens, entry.eos_ids, grammar)

    async def generate(caller: Caller, entry: ModelEntry, prompt_ids: list[int], spec: m.SamplingSpec,
                       stops: list[str]) -> tuple[Generation, Ticket]:
        """Admit by the key's rate limits (counting the prompt and every choice's max_tokens, as the
        OpenAI API does; settled with the real usage at the end), then dispatch."""
        ticket = tenants.admit(caller, entry.info.name, len(prompt_ids) + spec.max_tokens * spec.n)
        try:
            return await service.start_generation(entry, prompt_ids, spec, stops), ticket
        except BaseException:
            ticket.finish(accounted=False)  # nothing generated
            raise

    @app.post("/v1/completions", response_model=None,
              responses=errors(INVALID, API_KEY, UNKNOWN_MODEL, LIMITED) | streamed(Completion, Completion))
    async def completions(body: CompletionRequest, caller: Caller = Depends(api_key)) -> Response:
        entry = model_entry(caller, body.model)
        if isinstance(body.prompt, str):
            prompt_ids = await service.tokenize(entry, utf8_len(body.prompt), "prompt",
                                               lambda: entry.tokenizer(body.prompt).input_ids)
        else:
            prompt_ids = _check_ids(entry, body.prompt, "prompt")
        schema = response_schema(body.response_format)
        grammar = json_grammar(schema, "response_format") if schema is not None else None
        spec = sampling(entry, body, len(prompt_ids), grammar)
        gen, ticket = await generate(caller, entry, prompt_ids, spec, body.stop)
        cid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        prefix = ""
        if body.echo:  # the prompt as given, or the text of its ids
            prefix = body.prompt if isinstance(body.prompt, str) else await service.off_loop(
                lambda: entry.tokenizer.decode(prompt_ids), small=len(prompt_ids) <= INLINE_TOKENIZE_BYTES // 4)
        logprobs = ([CompletionLogprobs(entry.token_strings, body.logprobs, offset=len(prefix)) for _ in range(body.n)]
                    if body.logprobs is not None else None)  # one per choice: text offsets run per choice

        def choice(text: str, finish: str | None, pieces: list = (), index: int = 0) -> dict:
            lp = logprobs[index].take([p.logprob for p in pieces if p.logprob]) if logprobs and pieces else None
            return {"index": index, "text": text, "logprobs": lp, "finish_reason": finish}

        def chunk(choices: list[dict]) -> dict:
            return {"id": cid, "object": "text_completion", "created": created, "model": body.model,
                    "choices": choices}

        if body.stream:
            async def events() -> AsyncIterator[dict]:
                if prefix:
                    for i in range(body.n):
                        yield chunk([choice(prefix, None, index=i)])
                async for p in gen:
                    yield chunk([choice(p.text, p.finish_reason, [p], p.index)])
                if body.stream_options and body.stream_options.include_usage:
                    yield {**chunk([]), "usage": _usage(gen)}
            return _sse(gen, ticket, events())
        collected = await _collect(gen, ticket)
        return JSONResponse({**chunk([choice(prefix + text, finish, pieces, i)
                                      for i, (text, finish, pieces) in enumerate(collected)]), "usage": _usage(gen)},
                            headers=ticket.headers)

    @app.post("/v1/chat/completions", response_model=None, responses=errors(
        INVALID, API_KEY, UNKNOWN_MODEL, LIMITED) | streamed(ChatCompletion, ChatCompletionChunk))
    async def chat_completions(body: ChatCompletionRequest, caller: Caller = Depends(api_key)) -> Response:
        entry = model_entry(caller, body.model)
        plan = plan_chat(body)
        prompt_ids = await _tokenize_chat(entry, body.messages, add_generation_prompt=True, tools=plan.tools)
        spec = sampling(entry, body, len(prompt_ids), plan.grammar)
        gen, ticket = await generate(caller, entry, prompt_ids, spec, body.stop)
        # tool_choice auto: text goes out as content until a tool call begins, calls come at the end;
        # required or named: the one call, as it is written. One parser per choice.
        names = {t["function"]["name"] for t in plan.tools}
        calls = [ToolCallParser(names, plan.parallel) for _ in range(body.n)] \
            if plan.parse_calls and not plan.forced else None
        forced = [ForcedCall() for _ in range(body.n)] if plan.forced else None
        cid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

        def logprobs(pieces: list) -> dict | None:
            if not body.logprobs or not pieces:
                return None
            return {"content": chat_content(entry.token_strings, [p.logprob for p in pieces if p.logprob])}

        def chunk(delta: dict, finish: str | None, pieces: list = (), index: int = 0) -> dict:
            return {"id": cid, "object": "chat.completion.chunk", "created": created, "model": body.model,
                    "choices": [{"index": index, "delta": delta, "logprobs": logprobs(pieces),
                                 "finish_reason": finish}]}

        if body.stream:
            async def events() -> AsyncIterator[dict]:
                for i in range(body.n):
                    yield chunk({"role": "assistant", "content": ""}, None, index=i)
                async for p in gen:
                    i = p.index
                    if forced:  # the call's id, type and name once known, then its arguments as they come
                        call = forced[i]
                        name, args = call.feed(p.text)
                        args += call.finish() if p.finish_reason else ""
                        if name:
                            yield chunk({"tool_calls": [{"index": 0, "id": call.id, "type": "function",
                                                         "function": {"name": name, "arguments": ""}}]}, None, index=i)
                        finish = "tool_calls" if p.finish_reason == "stop" and call.name else p.finish_reason
                        delta = {"tool_calls": [{"index": 0, "function": {"arguments": args}}]} if args else {}
                        if p.finish_reason and call.name is None and call.unparsed:
                            delta = {"content": call.unparsed}  # cut short before the name: it was text
                        yield chunk(delta, finish, [p], i)
                        continue
                    text = calls[i].feed(p.text) if calls else p.text
                    if calls and p.finish_reason:
                        rest, tool_calls = calls[i].finish()
                        text += rest
                        if tool_calls:
                            if text:
                                yield chunk({"content": text}, None, [p], i)
                            for k, tc in enumerate(tool_calls):
                                fn = tc["function"]
                                yield chunk({"tool_calls": [{"index": k, "id": tc["id"], "type": "function",
                                                             "function": {"name": fn["name"], "arguments": ""}}]},
                                            None, index=i)
                                yield chunk({"tool_calls": [{"index": k, "function": {"arguments": fn["arguments"]}}]},
                                            None, index=i)
                            yield chunk({}, "tool_calls", [] if text else [p], i)
                            continue
                    yield chunk({"content": text} if text else {}, p.finish_reason, [p], i)
                if body.stream_options and body.stream_options.include_usage:
                    yield {**chunk({}, None), "choices": [], "usage": _usage(gen)}
            return _sse(gen, ticket, events())

        def message(i: int, text: str, finish: str | None) -> tuple[dict, str | None]:
            out = {"role": "assistant", "content": text}
            if forced:
                call = forced[i]
                call.feed(text)
                call.finish()
                if call.name is not None:  # (cut short before the name: what was written is content)
                    out = {"role": "assistant", "content": None, "tool_calls": [call.call()]}
                    finish = "tool_calls" if finish == "stop" else finish
            if calls:
                content = calls[i].feed(text)
                rest, tool_calls = calls[i].finish()
                content += rest
                if tool_calls:
                    out = {"role": "assistant", "content": content or None, "tool_calls": tool_calls}
                    finish = "tool_calls"
            return out, finish

        choices = []
        for i, (text, finish, pieces) in enumerate(await _collect(gen, ticket)):
            msg, finish = message(i, text, finish)
            choices.append({"index": i, "message": msg, "logprobs": logprobs(pieces), "finish_reason": finish})
        return JSONResponse({"id": cid, "object": "chat.completion", "created": created, "model": body.model,
                             "choices": choices, "usage": _usage(gen)}, headers=ticket.headers)

    # --- tokenizer API, as vLLM offers it -------------------------------------------------------------
    @app.post("/tokenize", response_model=None, responses=errors(INVALID, API_KEY, UNKNOWN_MODEL) | answer(Tokens))
    async def tokenize(body: TokenizeRequest, caller: Caller = Depends(api_key)) -> dict:
        """The token ids a completion or chat request with this prompt or these messages is given."""
        entry = model_entry(caller, body.model)
        if body.prompt is not None:
            special = True if body.add_special_tokens is None else body.add_special_tokens
            ids = await service.tokenize(entry, utf8_len(body.prompt), "prompt",
                                         lambda: entry.tokenizer(body.prompt, add_special_tokens=special).input_ids)
        else:
            ids = await _tokenize_chat(entry, body.messages, body.add_generation_prompt,
                                       add_special_tokens=bool(body.add_special_tokens))
        return {"count": len(ids), "max_model_len": entry.context_len, "tokens": ids}

    @app.post("/detokenize", response_model=None, responses=errors(INVALID, API_KEY, UNKNOWN_MODEL) | answer(Text))
    async def detokenize(body: DetokenizeRequest, caller: Caller = Depends(api_key)) -> dict:
        entry = model_entry(caller, body.model)
        ids = _check_ids(entry, body.tokens, "tokens")
        # Special tokens kept, as vLLM does: the text of exactly these ids.
        text = await service.off_loop(lambda: entry.tokenizer.decode(ids), small=len(ids) <= INLINE_TOKENIZE_BYTES // 4)
        return {"prompt": text}

    # --- admin API --------------------------------------------------------------------------------------
    @app.post("/admin/v1/models", dependencies=[Depends(admin_key)], status_code=201,
              responses=errors(INVALID, ADMIN_KEY, CONFLICT))
    async def deploy(body: DeployRequest) -> JSONResponse:
        try:
            path = Path(body.path).expanduser().resolve()
            is_dir = path.is_dir()
        except (OSError, RuntimeError) as e:  # a name too long, a loop of links; an unknown ~user (RuntimeError,
            # which has no strerror: reading it was CI's Schemathesis 500, AttributeError)
            reason = (e.strerror if isinstance(e, OSError) else None) or e
            raise APIError(400, f"path {body.path[:200]!r} cannot be read: {reason}", param="path") from e
        if not is_dir:
            raise APIError(400, f"path {body.path!r} is not a directory", param="path")
        if not is_block_checkpoint(path):
            raise APIError(400, f"{body.path!r} is not a converted layercast checkpoint: run "
                           "'layercast model convert HF_DIR OUT_DIR --blocks B' first", param="path")
        if body.min_instances > body.max_instances:
            raise APIError(400, "min_instances must not exceed max_instances", param="min_instances")
        try:
            index = await asyncio.to_thread(CheckpointIndex.load, path)
        except Exception as e:
            raise APIError(400, f"cannot read the checkpoint index: {e}", param="path") from e
        req = m.DeployModel(
            name=body.name, path=str(path), arch=index.arch, n_layers=index.n_layers,
            blocks=[m.BlockInfo(block_id=b.id, nbytes=b.nbytes, checksum=b.checksum, layer_start=b.layer_start,
                                layer_end=b.layer_end) for b in index.blocks],
            min_instances=body.min_instances, max_instances=body.max_instances, keep_alive_s=body.keep_alive_s,
            max_queue=body.max_queue, scaling_mode=body.scaling_mode, policy=body.policy,
            policy_params=body.policy_params, ttft_slo_s=body.ttft_slo_s, tpot_slo_s=body.tpot_slo_s)
        info = await _registry(subjects.REGISTRY_MODEL_DEPLOY, req, m.ModelInfo)
        await service.deployed(info)
        return JSONResponse(info.model_dump(mode="json"), status_code=201)

    @app.get("/admin/v1/models/{name:path}", dependencies=[Depends(admin_key)], responses=errors(ADMIN_KEY, NOT_FOUND))
    async def describe(name: str) -> dict:
        _check_model_name(name)
        info = await _registry(subjects.REGISTRY_MODEL_GET, m.ModelRef(name=name), m.ModelInfo)
        view = await _registry(subjects.REGISTRY_CLUSTER, m.GetCluster(), m.ClusterView)
        entry = service.models.get(name)
        return {**info.model_dump(mode="json"),
                "instances": [i.model_dump(mode="json") for i in view.instances if i.model == name],
                "replicas": [r.model_dump(mode="json") for r in view.replicas if r.model == name],
                "scale_ops": [s.model_dump(mode="json") for s in view.scale_ops if s.model == name],
                "queued": entry.routes.queued if entry else 0,
                "in_flight": entry.routes.in_flight if entry else 0}

    @app.delete("/admin/v1/models/{name:path}", dependencies=[Depends(admin_key)], responses=errors(ADMIN_KEY, NOT_FOUND))
    async def delete(name: str) -> dict:
        _check_model_name(name)
        info = await _registry(subjects.REGISTRY_MODEL_DELETE, m.ModelRef(name=name), m.ModelInfo)
        service.deleted(name)
        return {"id": name, "object": "model", "deleted": True, "state": info.state}

    @app.get("/admin/v1/cluster", dependencies=[Depends(admin_key)], responses=errors(ADMIN_KEY))
    async def cluster() -> dict:
        view = await _registry(subjects.REGISTRY_CLUSTER, m.GetCluster(), m.ClusterView)
        return view.model_dump(mode="json")

    # --- admin API: LLM-Mesh profiles (a path of their own: model names may hold "/") ------------------
    @app.post("/admin/v1/profiles", dependencies=[Depends(admin_key)], status_code=201,
              responses=errors(INVALID, ADMIN_KEY))
    async def put_profile(body: ProfileRequest) -> JSONResponse:
        msg = m.ModelProfile(**body.model_dump(exclude_none=True))
        try:
            profile_from_message(msg)  # the registry checks it too; here the 400 can name the field
        except InvalidProfile as e:
            raise APIError(400, f"invalid profile: {e}", param=e.field, code="invalid_value") from e
        stored = await _registry(subjects.REGISTRY_PROFILE_PUT, msg, m.ModelProfile, param="model")
        return JSONResponse(stored.model_dump(mode="json", exclude={"version"}), status_code=201)

    @app.get("/admin/v1/profiles/{model:path}", dependencies=[Depends(admin_key)], responses=errors(ADMIN_KEY))
    async def get_profiles(model: str) -> dict:
        """The model's stored profile on each device kind; null for a kind never measured."""
        found: dict[str, dict | None] = {"cpu": None, "cuda": None}
        for device in found if m.is_model_name(model) else ():  # (no profile is stored under another name)
            try:
                stored = await _registry(subjects.REGISTRY_PROFILE_GET, m.ProfileRef(model=model, device=device),
                                         m.ModelProfile, param="model")
                found[device] = stored.model_dump(mode="json", exclude={"version"})  # the API has none
            except APIError as e:
                if e.status != 404:
                    raise
                found[device] = None
        return {"object": "model_profiles", "model": model, "profiles": found}

    # --- admin API: API keys and usage -------------------------------------------------------------------
    @app.post("/admin/v1/keys", dependencies=[Depends(admin_key)], status_code=201,
              responses=errors(INVALID, ADMIN_KEY, CONFLICT))
    async def create_key(body: KeyRequest) -> JSONResponse:
        secret, key_hash = new_secret()  # the registry gets the hash: the secret is shown here, once
        info = await _registry(subjects.REGISTRY_KEY_CREATE, m.CreateApiKey(
            name=body.name, key_hash=key_hash, prefix=secret[:10], models=body.models,
            requests_per_minute=body.requests_per_minute, tokens_per_minute=body.tokens_per_minute), m.ApiKeyInfo)
        return JSONResponse({**info.model_dump(mode="json"), "key": secret}, status_code=201)

    @app.get("/admin/v1/keys", dependencies=[Depends(admin_key)], responses=errors(INVALID, ADMIN_KEY))
    async def list_keys(include_revoked: bool = False) -> dict:
        keys = await _registry(subjects.REGISTRY_KEY_LIST, m.ListApiKeys(include_revoked=include_revoked),
                               m.ApiKeyList)
        return {"object": "list", "data": [k.model_dump(mode="json") for k in keys.keys]}

    @app.delete("/admin/v1/keys/{key_id}", dependencies=[Depends(admin_key)],
                responses=errors(INVALID, ADMIN_KEY, NOT_FOUND))
    async def revoke_key(key_id: str) -> dict:
        try:
            ref = m.ApiKeyRef(key_id=key_id)
        except ValidationError as e:
            raise APIError(400, f"Invalid key id {key_id[:80]!r}: {e.errors()[0]['msg']}", param="key_id",
                           code="invalid_value") from e
        info = await _registry(subjects.REGISTRY_KEY_REVOKE, ref, m.ApiKeyInfo, param="key_id")
        tenants.forget(key_id)  # refused here at once; other gateways within their cache time
        return {**info.model_dump(mode="json"), "revoked": True}

    @app.get("/admin/v1/usage", dependencies=[Depends(admin_key)], responses=errors(ADMIN_KEY, INVALID))
    async def usage(key: str | None = None, model: str | None = None) -> dict:
        for name, value in (("key", key), ("model", model)):
            if value is not None and "\x00" in value:  # no stored name has one (Postgres text cannot)
                raise APIError(400, f"{name} must not contain a NUL character", param=name)
        await tenants.flush()  # this gateway's latest counts too
        report = await _registry(subjects.REGISTRY_USAGE_GET, m.GetUsage(key=key, model=model), m.UsageReport)
        return {"object": "list", "data": [{**u.model_dump(mode="json"),
                                            "total_tokens": u.prompt_tokens + u.completion_tokens}
                                           for u in report.usage]}

    def _check_model_name(name: str) -> None:
        # No model has such a name (m.DeployModel): its 404 here, not the registry's 400 for a NUL.
        if not m.is_model_name(name):
            raise APIError(404, f"model {name[:200]!r} not found", param="name")

    async def _registry(subject: str, req, reply_model, param: str = "name"):
        try:
            return await call(service.broker, subject, req, reply_model)
        except RemoteError as e:
            status = {"not_found": 404, "conflict": 409, "invalid": 400}.get(e.code, 503)
            param = param if status in (404, 409) else None
            raise APIError(status, e.error, param=param) from e
        except TimeoutError as e:
            raise APIError(503, "the registry is not answering; retry later", retry_after=2) from e

    return app


def _chat_ids(entry: ModelEntry, messages: list[dict], add_generation_prompt: bool,
              add_special_tokens: bool, tools: list[dict] | None = None) -> list[int]:
    try:
        rendered = entry.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                       tokenize=False, tools=tools or None)
    except Exception as e:
        raise APIError(400, f"cannot apply the model's chat template: {e}", param="messages") from e
    # The template writes the special tokens it wants (a BOS): the tokenizer adds none by default.
    return entry.tokenizer(rendered, add_special_tokens=add_special_tokens).input_ids


def _check_ids(entry: ModelEntry, ids: list[int], param: str) -> list[int]:
    vocab = len(entry.tokenizer)
    if ids and (min(ids) < 0 or max(ids) >= vocab):
        raise APIError(400, f"{param} token ids must be in [0, {vocab})", param=param)
    return list(ids)


def _usage(gen: Generation) -> dict:
    return {"prompt_tokens": gen.prompt_len, "completion_tokens": gen.completion_tokens,
            "total_tokens": gen.prompt_len + gen.completion_tokens}


async def _close(gen: Generation, ticket: Ticket) -> None:
    """The request ended (answered, failed, or its client went away): what it generated is usage."""
    await gen.close()
    ticket.finish(gen.prompt_len, gen.completion_tokens)


async def _collect(gen: Generation, ticket: Ticket) -> list[tuple[str, str | None, list[Piece]]]:
    """Per choice, in index order: its text, finish reason and pieces."""
    pieces: list[list[Piece]] = [[] for _ in gen.choices]
    try:
        async for p in gen:
            pieces[p.index].append(p)
    finally:
        await _close(gen, ticket)
    return [("".join(p.text for p in ps), next((p.finish_reason for p in reversed(ps) if p.finish_reason), None), ps)
            for ps in pieces]


def _sse(gen: Generation, ticket: Ticket, events: AsyncIterator[dict]) -> StreamingResponse:
    async def body() -> AsyncIterator[bytes]:
        try:
            async for ev in events:
                yield f"data: {json.dumps(ev)}\n\n".encode()
            yield b"data: [DONE]\n\n"
        except APIError as e:  # headers are gone: report in-band, as OpenAI does
            yield f"data: {json.dumps(e.body())}\n\n".encode()
        finally:
            await _close(gen, ticket)

    # x-layercast-instance: where the request was sent (a local instance or an execution pipeline).
    return StreamingResponse(body(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no",
                                      "x-layercast-instance": gen.route.instance_id, **ticket.headers})
