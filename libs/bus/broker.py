"""The message bus every service uses: a FastStream NATS broker with trace
propagation, plus typed RPC helpers.

Handlers never see malformed input: `rpc` and `on_event` validate the body
against the handler's model; a bad message is logged and (for RPCs) answered
with an `ErrorReply`, and the service carries on.
"""

import asyncio
import functools
import logging
import os
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from faststream.nats import NatsBroker
from faststream.nats.security import NatsSecurity, NatsUserPassword
from faststream.nats.opentelemetry import NatsTelemetryMiddleware
from opentelemetry import trace
from pydantic import BaseModel, ValidationError

from libs.bus.auth import NatsAuthError, client_auth, redact
from libs.protocol.messages import ErrorReply

log = logging.getLogger(__name__)

DEFAULT_NATS_URL = "nats://127.0.0.1:4222"
NO_RESPONDER_GRACE_S = 0.5  # how long a request waits for a responder that is still subscribing

M = TypeVar("M", bound=BaseModel)
R = TypeVar("R", bound=BaseModel)


class RemoteError(RuntimeError):
    """An RPC answered with an ErrorReply."""

    def __init__(self, subject: str, reply: ErrorReply):
        super().__init__(f"{subject}: {reply.code}: {reply.error}")
        self.code = reply.code
        self.error = reply.error


class NoResponders(TimeoutError):
    """An RPC found nobody subscribed (past the start-up grace): the service is gone, not slow.
    A plain TimeoutError is the other case: someone may have the request and answer late."""


class DomainError(Exception):
    """Raised by a handler to answer an RPC with a clean ErrorReply."""

    def __init__(self, message: str, code: str = "invalid"):
        super().__init__(message)
        self.code = code


def nats_url() -> str:
    return os.environ.get("NATS_URL", DEFAULT_NATS_URL)


def _security(url: str) -> tuple[dict[str, Any], str | None]:
    """The broker's credentials and TLS (libs/bus/auth.py: settings from the environment)."""
    auth = client_auth(url)
    kwargs: dict[str, Any] = {"inbox_prefix": auth.inbox_prefix}
    if auth.password is not None:
        kwargs["security"] = NatsUserPassword(auth.user, auth.password, ssl_context=auth.tls)
    elif auth.tls is not None:
        kwargs["security"] = NatsSecurity(ssl_context=auth.tls)
    return kwargs, auth.user


def make_broker(url: str | None = None, **kwargs: Any) -> NatsBroker:
    """A broker whose publishes carry `traceparent` and whose handlers run in the
    caller's trace (FastStream's OpenTelemetry middleware does both). Credentials and TLS
    come from the environment (`libs.bus.auth.client_auth`)."""
    url = url or nats_url()
    security, user = _security(url)
    broker = NatsBroker(
        url,
        middlewares=[NatsTelemetryMiddleware(tracer_provider=trace.get_tracer_provider())],
        logger=logging.getLogger("layercast.bus"),
        log_level=logging.DEBUG,
        max_reconnect_attempts=-1,
        **security,
        # A restarted server is back within a second or two: retry often (the default waits 2 s).
        reconnect_time_wait=0.25,
        **kwargs,
    )
    broker._layercast_target = (redact(url), user)  # for start_broker's errors
    return broker


async def start_broker(broker: NatsBroker) -> None:
    """Start and wait until the server has our subscriptions: without the flush
    a request sent right after start-up can find no responder.

    Raises NatsAuthError when the server refuses our credentials (or wants some we lack)."""
    try:
        await broker.start()
    except Exception as e:
        text = str(e).lower()
        if "authorization" in text or "authentication" in text:
            url, user = getattr(broker, "_layercast_target", ("?", None))
            who = f"user {user!r}" if user else "no credentials"
            raise NatsAuthError(
                f"NATS at {url} refused {who} ({e}): set LAYERCAST_NATS_USER and LAYERCAST_NATS_PASSWORD "
                f"(or put them in NATS_URL) to this service's NATS credentials") from e
        raise
    await broker._connection.flush()


def _describe(error: ValidationError) -> str:
    first = error.errors()[0]
    where = ".".join(str(p) for p in first["loc"]) or "body"
    return f"{where}: {first['msg']} ({error.error_count()} error(s))"


def _has_nul(value: Any, depth: int = 0) -> bool:
    """Whether a decoded message holds a NUL character in any string (keys included)."""
    if isinstance(value, str):
        return "\x00" in value
    if depth > 64:  # deeper than any message of ours: pydantic refuses it anyway
        return False
    if isinstance(value, dict):
        return any(_has_nul(k, depth + 1) or _has_nul(v, depth + 1) for k, v in value.items())
    if isinstance(value, list):
        return any(_has_nul(v, depth + 1) for v in value)
    return False


def rpc(model: type[M]) -> Callable[[Callable[[M], Awaitable[BaseModel]]], Callable[..., Awaitable[dict]]]:
    """Wrap an RPC handler `async def h(req: model) -> BaseModel` for `broker.subscriber`."""

    def wrap(handler: Callable[[M], Awaitable[BaseModel]]) -> Callable[..., Awaitable[dict]]:
        @functools.wraps(handler)
        async def wrapper(body: Any) -> dict:
            if _has_nul(body):  # Postgres text and JSON cannot hold one: refuse it as bad input, not a 5xx
                log.warning("rejected %s with a NUL character", model.__name__)
                return ErrorReply(error=f"{model.__name__}: text must not contain a NUL character",
                                  code="invalid").model_dump(mode="json")
            try:
                request = model.model_validate(body)
            except ValidationError as e:
                log.warning("rejected malformed %s: %s", model.__name__, _describe(e))
                return ErrorReply(error=f"malformed {model.__name__}: {_describe(e)}").model_dump(mode="json")
            try:
                reply = await handler(request)
            except DomainError as e:
                return ErrorReply(error=str(e), code=e.code).model_dump(mode="json")
            except Exception as e:  # a bug must not take the service down
                log.exception("handler %s failed", handler.__name__)
                return ErrorReply(error=f"internal error: {e}", code="internal").model_dump(mode="json")
            return reply.model_dump(mode="json")

        # FastStream reads the signature: take the raw decoded body.
        wrapper.__annotations__ = {"body": Any, "return": dict}
        del wrapper.__wrapped__
        return wrapper

    return wrap


def on_event(model: type[M]) -> Callable[[Callable[[M], Awaitable[None]]], Callable[..., Awaitable[None]]]:
    """Wrap an event handler; malformed events are logged and dropped."""

    def wrap(handler: Callable[[M], Awaitable[None]]) -> Callable[..., Awaitable[None]]:
        @functools.wraps(handler)
        async def wrapper(body: Any) -> None:
            try:
                event = model.model_validate(body)
            except ValidationError as e:
                log.warning("dropped malformed %s: %s", model.__name__, _describe(e))
                return
            try:
                await handler(event)
            except Exception:
                log.exception("event handler %s failed", handler.__name__)

        wrapper.__annotations__ = {"body": Any, "return": None}
        del wrapper.__wrapped__
        return wrapper

    return wrap


async def call(broker: NatsBroker, subject: str, request: BaseModel, reply_model: type[R], timeout: float = 5.0) -> R:
    """Typed request/reply; raises RemoteError on an ErrorReply, TimeoutError when no answer came
    in time (NoResponders, one, when nobody is subscribed).

    "No responders" is retried for a moment (NO_RESPONDER_GRACE_S): a service that has just
    started can have its subscription still on the way to the server. Past that, a missing
    responder fails fast, so a dead worker is noticed without waiting out the timeout.
    """
    body = await request_body(broker, subject, request.model_dump(mode="json"), timeout)
    return parse_reply(subject, body, reply_model)


async def request_body(broker: NatsBroker, subject: str, body: Any, timeout: float = 5.0,
                       grace: float = NO_RESPONDER_GRACE_S) -> Any:
    """Send `body` as it is (any JSON value, or bytes: what `call` cannot send, e.g. a malformed
    request) and return the answer's decoded body. "No responders" is retried for `grace`
    seconds: a responder whose NATS connection is being re-established answers again then."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    grace_until = loop.time() + min(grace, timeout)
    while True:
        try:
            response = await broker.request(body, subject, timeout=max(deadline - loop.time(), 0.001))
            break
        except Exception as e:
            name = type(e).__name__
            if name == "NoRespondersError" and loop.time() + 0.05 < grace_until:
                await asyncio.sleep(0.05)
                continue
            if name == "NoRespondersError":
                raise NoResponders(f"nobody answers on {subject}") from e
            if name == "TimeoutError":
                raise TimeoutError(f"no answer on {subject} within {timeout}s") from e
            raise
    return await response.decode()


def parse_reply(subject: str, body: Any, reply_model: type[R]) -> R:
    """An answer's body as `reply_model`; an ErrorReply raises RemoteError."""
    if isinstance(body, dict) and "error" in body and "code" in body:
        raise RemoteError(subject, ErrorReply.model_validate(body))
    return reply_model.model_validate(body)


async def publish(broker: NatsBroker, subject: str, event: BaseModel) -> None:
    await broker.publish(event.model_dump(mode="json"), subject)
