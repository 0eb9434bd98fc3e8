"""HTTP transport limits: request size, header and body read timeouts, and the uvicorn config.

- :class:`RequestLimits` (pure ASGI middleware) reads each request's body before the app does: a
  ``Content-Length`` above ``max_request_bytes`` is a 413 before any byte of the body is read, a body
  that grows past it while streaming (chunked) is a 413 as soon as it does, and a body not complete
  within ``body_timeout_s`` of its headers is a 408. The body is read by the event loop in pieces, so
  a large or slow upload never stalls other clients. The app then reads the buffered body, and waits
  on the client's connection as before (disconnect detection is unchanged).
- :func:`uvicorn_config` serves the app with :class:`HeaderTimeoutProtocol`, uvicorn's h11 protocol
  plus a deadline on request headers: a connection that has not sent complete headers within
  ``header_timeout_s`` of opening (or of its previous response) is closed. Without it, uvicorn holds
  half-sent requests open forever.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol

from edgemoe.server.common import APIError
from edgemoe.server.config import ServerConfig

__all__ = ["HeaderTimeoutProtocol", "RequestLimits", "uvicorn_config"]


class RequestLimits:
    """Pure-ASGI middleware bounding request bodies in size and time (see the module doc).

    Args:
        app: the ASGI app.
        max_bytes: largest body accepted (bytes).
        body_timeout_s: seconds the whole body may take to arrive after the headers.
        error_response: ``(scope, APIError) -> ASGI app`` answering in the API's error shape.
    """

    def __init__(self, app, max_bytes: int, body_timeout_s: float,
                 error_response: Callable[[dict, APIError], Any]):
        self.app, self.max_bytes, self.body_timeout_s = app, max_bytes, body_timeout_s
        self.error_response = error_response

    def _too_large(self, size: str) -> APIError:
        return APIError(413, f"Request body of {size} exceeds the limit of {self.max_bytes} bytes "
                             "(--max-request-bytes)", code="request_too_large")

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            return await self.error_response(scope, self._too_large(f"{int(length)} bytes"))(scope, receive, send)
        chunks, size = [], 0
        deadline = time.monotonic() + self.body_timeout_s
        while True:
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                err = APIError(408, f"the request body did not arrive within {self.body_timeout_s:g} s "
                                    "(--body-timeout-s)", code="request_timeout")
                return await self.error_response(scope, err)(scope, receive, send)
            if message["type"] != "http.request":  # the client went away
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                return await self.error_response(scope, self._too_large("more bytes"))(scope, receive, send)
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body: dict | None = {"type": "http.request", "body": b"".join(chunks), "more_body": False}

        async def replay():
            nonlocal body
            if body is not None:
                message, body = body, None
                return message
            return await receive()

        return await self.app(scope, replay, send)


class HeaderTimeoutProtocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline on request headers (:attr:`header_timeout_s` seconds from
    the connection's start or its previous response); the connection is closed when it passes."""

    header_timeout_s: float = 10.0

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._header_timer: asyncio.TimerHandle | None = None
        self._awaited_after = None  # the request cycle the next headers follow

    def _arm(self) -> None:
        self._disarm()
        self._awaited_after = self.cycle
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._headers_overdue)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_overdue(self) -> None:
        self._header_timer = None
        if not self.transport.is_closing():
            self.transport.close()

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self._header_timer is not None and self.cycle is not self._awaited_after:  # headers complete
            self._disarm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing() and (self.cycle is None or self.cycle.response_complete):
            self._arm()

    def connection_lost(self, exc) -> None:
        self._disarm()
        super().connection_lost(exc)


def uvicorn_config(app, config: ServerConfig, **kwargs: Any):
    """The ``uvicorn.Config`` serving ``app`` under ``config`` (host, port, log level, header timeout);
    ``kwargs`` are passed on (e.g. ``lifespan``)."""
    import uvicorn

    protocol = type("HeaderTimeoutProtocol", (HeaderTimeoutProtocol,), {"header_timeout_s": config.header_timeout_s})
    options = {"host": config.host, "port": config.port, "log_level": config.log_level, "http": protocol, **kwargs}
    return uvicorn.Config(app, **options)
