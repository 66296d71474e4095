"""The gateway's HTTP server (uvicorn), guarded against clients that hold connections without
finishing a request (slowloris): a header timeout at the protocol level, a body timeout at the
ASGI level, and a cap on connections."""

import asyncio
import logging

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from services.gateway.errors import APIError

log = logging.getLogger(__name__)


def header_timeout_protocol(header_timeout_s: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol, closing a connection whose next request's headers are not all in
    within `header_timeout_s` of its opening or of its last response. uvicorn has no such timeout:
    its keep-alive timer stops at the first byte, so a client sending headers a byte at a time,
    or never finishing them, holds the connection for ever."""

    class HeaderTimeoutH11Protocol(H11Protocol):
        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm_header_timeout(None)

        def on_response_complete(self) -> None:
            answered = self.cycle  # before super() starts a pipelined request's cycle
            super().on_response_complete()
            self._arm_header_timeout(answered)

        def _arm_header_timeout(self, waiting_after) -> None:
            """Close unless a request's headers, all in, have replaced the cycle `waiting_after` in time."""
            def expire() -> None:
                if self.cycle is waiting_after and not self.transport.is_closing():
                    log.info("closing a connection whose request headers took over %.1f s", header_timeout_s)
                    self.transport.close()
            self.loop.call_later(header_timeout_s, expire)

    return HeaderTimeoutH11Protocol


class BodyTimeout:
    """Answers 408 (and closes the connection) when a request's body has not all arrived within
    `timeout_s` of its headers. Reads after the body (a streaming response listening for the
    client's disconnect) are not timed."""

    def __init__(self, app, timeout_s: float):
        self.app, self.timeout_s = app, timeout_s

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout_s
        body_done = timed_out = False

        async def timed_receive():
            nonlocal body_done, timed_out
            if body_done or timed_out:
                return await receive() if not timed_out else {"type": "http.disconnect"}
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - loop.time()))
            except TimeoutError:
                timed_out = True
                error = APIError(408, f"The request body did not arrive within {self.timeout_s:g} s",
                                 code="request_timeout", headers={"Connection": "close"})
                await error.response()(scope, receive, send)
                return {"type": "http.disconnect"}  # to the app, as if the client went away
            body_done = message["type"] != "http.request" or not message.get("more_body", False)
            return message

        async def guarded_send(message) -> None:
            if not timed_out:  # answered already: the app's own answer has nowhere to go
                await send(message)
        try:
            await self.app(scope, timed_receive, guarded_send)
        except Exception:
            if not timed_out:
                raise  # else: the app failed on the disconnect it was given; the 408 is sent


def serve(app, *, host: str, port: int, log_level: str, header_timeout_s: float, body_timeout_s: float,
          max_connections: int) -> None:
    """Run `app` until stopped. `max_connections`: open connections (and running requests) at
    most; a request beyond it is answered 503 at once (uvicorn's limit_concurrency)."""
    config = uvicorn.Config(BodyTimeout(app, body_timeout_s), host=host, port=port, log_level=log_level,
                            http=header_timeout_protocol(header_timeout_s), limit_concurrency=max_connections,
                            timeout_graceful_shutdown=5)
    uvicorn.Server(config).run()
