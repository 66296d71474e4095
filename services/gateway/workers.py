"""The gateway's port to the workers' generate: hand a request to a worker, cancel it there, and
receive the tokens every worker streams back to this gateway.

`NatsWorkerClient` is the port over NATS (subjects.worker_generate, worker_cancel, tokens);
`InMemoryWorkerClient` is the one fake, for tests: workers are async functions in the process,
written as a worker's RPC handler is (raising `DomainError` to refuse)."""

import asyncio
from collections.abc import Awaitable, Callable
from typing import Protocol

from libs.bus.broker import DomainError, NoResponders, RemoteError, call, on_event, publish
from libs.protocol import messages as m
from libs.protocol import subjects

TokenSink = Callable[[m.TokenEvent], None]


class WorkerClient(Protocol):
    """Errors of `generate` (the gateway's dispatch tells them apart): `RemoteError` with the
    worker's code ("busy", "unavailable", "invalid", ...) when it refused the request,
    `NoResponders` when no such worker is there, a plain `TimeoutError` when it did not answer in
    time (it may still take the request: cancel that attempt)."""

    def listen(self, sink: TokenSink) -> None:
        """Hand every TokenEvent sent to this gateway to `sink`; called once, before the broker starts."""

    def reply_subject(self, request_id: str) -> str:
        """Where the workers send the request's tokens (GenerateRequest.reply_subject)."""

    async def generate(self, worker_id: str, request: m.GenerateRequest, timeout_s: float) -> m.GenerateAccepted:
        """Hand `request` to the worker: its answer, taken or refused, within `timeout_s`."""

    async def cancel(self, worker_id: str, cancel: m.CancelRequest) -> None:
        """Tell the worker to stop a request (or one attempt of it); no answer comes."""


class NatsWorkerClient:
    def __init__(self, broker, gateway_id: str):
        self.broker, self.gateway_id = broker, gateway_id

    def listen(self, sink: TokenSink) -> None:
        @self.broker.subscriber(subjects.tokens_wildcard(self.gateway_id))
        @on_event(m.TokenEvent)
        async def token(ev: m.TokenEvent) -> None:
            sink(ev)

    def reply_subject(self, request_id: str) -> str:
        return subjects.tokens(self.gateway_id, request_id)

    async def generate(self, worker_id: str, request: m.GenerateRequest, timeout_s: float) -> m.GenerateAccepted:
        return await call(self.broker, subjects.worker_generate(worker_id), request, m.GenerateAccepted,
                          timeout=timeout_s)

    async def cancel(self, worker_id: str, cancel: m.CancelRequest) -> None:
        await publish(self.broker, subjects.worker_cancel(worker_id), cancel)


GenerateHandler = Callable[[m.GenerateRequest], Awaitable[m.GenerateAccepted]]


class InMemoryWorkerClient:
    """Workers as `GenerateHandler`s in this process (`add`); what they are sent is kept
    (`received`, `cancels`) and `send` streams a worker's TokenEvent back. A handler left waiting
    past the timeout runs on, as a slow worker would (it may take the request late)."""

    def __init__(self):
        self.handlers: dict[str, GenerateHandler] = {}
        self.received: list[tuple[str, m.GenerateRequest]] = []
        self.cancels: list[tuple[str, m.CancelRequest]] = []
        self._sink: TokenSink | None = None
        self._running: set[asyncio.Task] = set()

    def add(self, worker_id: str, handler: GenerateHandler) -> None:
        self.handlers[worker_id] = handler

    def send(self, event: m.TokenEvent) -> None:
        if self._sink is not None:
            self._sink(event)

    def listen(self, sink: TokenSink) -> None:
        self._sink = sink

    def reply_subject(self, request_id: str) -> str:
        return f"in-memory.tokens.{request_id}"

    async def generate(self, worker_id: str, request: m.GenerateRequest, timeout_s: float) -> m.GenerateAccepted:
        handler = self.handlers.get(worker_id)
        if handler is None:
            raise NoResponders(f"no worker {worker_id}")
        # What a worker gets is what the wire carries: a request that does not survive it fails here too.
        request = m.GenerateRequest.model_validate(request.model_dump(mode="json"))
        self.received.append((worker_id, request))
        task = asyncio.ensure_future(handler(request))
        self._running.add(task)
        task.add_done_callback(self._ended)
        try:
            return await asyncio.wait_for(asyncio.shield(task), timeout_s)
        except DomainError as e:  # as the worker's RPC answers it
            raise RemoteError(subjects.worker_generate(worker_id), m.ErrorReply(error=str(e), code=e.code)) from e
        except TimeoutError:
            raise TimeoutError(f"no answer from {worker_id} within {timeout_s}s") from None

    async def cancel(self, worker_id: str, cancel: m.CancelRequest) -> None:
        self.cancels.append((worker_id, cancel))

    def _ended(self, task: asyncio.Task) -> None:
        self._running.discard(task)
        if not task.cancelled():
            task.exception()  # a late answer nobody waits for any more: read, not an unhandled error
