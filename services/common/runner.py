"""Runs one service process: telemetry, broker, health endpoint, signal handling."""

import asyncio
import logging
import signal
import time
from collections.abc import Awaitable, Callable, Coroutine

from libs.bus.auth import NatsAuthError
from libs.bus.broker import RemoteError, make_broker, start_broker
from libs.protocol import subjects
from libs.telemetry import HealthServer, setup_logging, setup_tracing

log = logging.getLogger(__name__)


class Service:
    """A service owns a broker (subscriptions are added in its constructor),
    background loops started with it, and a health answer."""

    name: str = "service"

    def __init__(self, nats_url: str | None = None):
        self.broker = make_broker(nats_url, disconnected_cb=self._nats_disconnected,
                                  reconnected_cb=self._nats_reconnected)
        self._tasks: set[asyncio.Task] = set()
        self._started = False
        self._stopping = False  # nats-py calls the disconnected callback on close too

    def background(self) -> list[Coroutine]:
        """Loops to run while the service is up."""
        return []

    async def start(self) -> None:
        await start_broker(self.broker)
        for loop in self.background():
            self.spawn(loop)
        self._started = True

    def spawn(self, coro: Coroutine) -> asyncio.Task:
        """Run `coro` beside the service: referenced until it ends, cancelled when the service stops."""
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def every(self, period: float | Callable[[], float] | None, fn: Callable[[], Awaitable[object]], what: str,
                    *, wake: asyncio.Event | None = None, first_now: bool = False) -> None:
        """A periodic loop for background(): `fn` every `period` seconds (a number, or a function
        giving the next wait; None: only when woken), at once when `wake` is set, first without waiting if `first_now`.
        A failure is logged and the loop goes on: one bad pass must not stop a service."""
        wait = not first_now
        while True:
            if wait:
                seconds = period() if callable(period) else period
                if wake is not None and seconds is None:
                    await wake.wait()
                    wake.clear()
                elif wake is None:
                    await asyncio.sleep(seconds)
                else:
                    try:
                        await asyncio.wait_for(wake.wait(), seconds)
                    except TimeoutError:
                        pass
                    wake.clear()
            wait = True
            try:
                await fn()
            except (TimeoutError, RemoteError) as e:  # a peer away or slow: expected, no traceback
                log.warning("%s: %s failed: %s", self.name, what, e)
            except Exception:
                log.exception("%s: %s failed", self.name, what)

    async def stop(self) -> None:
        self._started = False
        self._stopping = True
        for t in list(self._tasks):
            t.cancel()
        await self.broker.stop()

    def healthy(self) -> bool:
        return self._started

    async def _nats_disconnected(self) -> None:
        if self._stopping:  # our own close, not a lost connection
            log.info("%s: NATS connection closed", self.name)
            return
        log.warning("%s: NATS connection lost; reconnecting", self.name)

    async def _nats_reconnected(self) -> None:
        log.warning("%s: NATS connection re-established", self.name)
        try:
            await self.on_reconnected()
        except Exception:
            log.exception("%s: handling the NATS reconnection failed", self.name)

    async def on_reconnected(self) -> None:
        """The NATS connection came back (after a server restart, say): core NATS messages sent
        meanwhile are lost; a service that waits for some reacts here."""


async def serve(service: Service, health_host: str, health_port: int | None) -> None:
    """Run until SIGINT/SIGTERM. A health port of None means no health endpoint."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    health = None
    if health_port is not None:
        health = HealthServer(health_host, health_port, service.healthy)
        port = await health.start()
        log.info("%s health and metrics on http://%s:%d", service.name, health_host, port)
    await service.start()
    await stop.wait()
    log.info("%s stopping", service.name)
    await service.stop()
    if health:
        await health.stop()


def run(service_factory: Callable[[], Service], health_host: str, health_port: int | None) -> None:
    service = service_factory()
    setup_logging(service.name)
    setup_tracing(service.name, subjects.QUIET_SUBJECTS)
    try:
        asyncio.run(serve(service, health_host, health_port))
    except NatsAuthError as e:  # no point retrying: say what to fix and stop
        log.error("%s cannot start: %s", service.name, e)
        raise SystemExit(2) from None


class EndedInstances:
    """Instances known to have stopped or failed, remembered for a while so a
    registry snapshot taken just before the event cannot bring them back."""

    def __init__(self, ttl_s: float = 120.0):
        self.ttl_s = ttl_s
        self._ended: dict[str, float] = {}

    def mark(self, instance_id: str) -> None:
        now = time.monotonic()
        self._ended = {i: t for i, t in self._ended.items() if now - t < self.ttl_s}
        self._ended[instance_id] = now

    def __contains__(self, instance_id: str) -> bool:
        t = self._ended.get(instance_id)
        return t is not None and time.monotonic() - t < self.ttl_s
