"""A tiny HTTP endpoint for `/health` and `/metrics`, for services that have no
web framework of their own (registry, planner, load-monitor, worker)."""

import asyncio
from collections.abc import Callable

from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest


class HealthServer:
    def __init__(self, host: str, port: int, is_healthy: Callable[[], bool]):
        self.host, self.port = host, port
        self._is_healthy = is_healthy
        self._server: asyncio.Server | None = None

    async def start(self) -> int:
        self._server = await asyncio.start_server(self._handle, self.host, self.port)
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    async def stop(self) -> None:
        if self._server:
            self._server.close()
            await self._server.wait_closed()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            request_line = await asyncio.wait_for(reader.readline(), 5)
            while (await asyncio.wait_for(reader.readline(), 5)) not in (b"\r\n", b"\n", b""):
                pass  # headers are not needed
            parts = request_line.decode("latin-1").split()
            path = parts[1] if len(parts) > 1 else "/"
            if path == "/health":
                ok = self._is_healthy()
                status, ctype, body = (200 if ok else 503), "application/json", b'{"status":"%s"}' % (
                    b"ok" if ok else b"starting"
                )
            elif path == "/metrics":
                status, ctype, body = 200, CONTENT_TYPE_LATEST, generate_latest(REGISTRY)
            else:
                status, ctype, body = 404, "application/json", b'{"error":"not found"}'
            reason = {200: "OK", 404: "Not Found", 503: "Service Unavailable"}[status]
            writer.write(
                f"HTTP/1.1 {status} {reason}\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\n"
                f"Connection: close\r\n\r\n".encode() + body
            )
            await writer.drain()
        except (asyncio.TimeoutError, ConnectionError):
            pass
        finally:
            writer.close()
