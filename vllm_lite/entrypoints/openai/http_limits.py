"""What the server allows at the HTTP level, before a request reaches an endpoint.

- ``GuardedH11Protocol``: uvicorn's h11 protocol with a read timeout (a client must send
  a request's headers within ``read_timeout`` of connecting or of its previous response,
  so slow-header and idle-but-open connections cannot hold file descriptors for ever)
  and a connection cap (connections past it are answered 503, except ``/health``, and
  closed after that one request).
- ``BodyLimitMiddleware``: a request body over ``max_bytes`` is a 413, decided from
  Content-Length before anything is read or, for a chunked body, as soon as the bytes
  read pass the limit; a body that takes longer than ``read_timeout`` to arrive is a 408.
- ``RateLimitFilter``: one logging filter for every handler, so a storm of identical
  errors (a client flood, a full file-descriptor table) costs a few lines, not gigabytes.
- ``HostCheckMiddleware``: with ``allowed_hosts``, a request whose Host header is not
  listed is a 400 (DNS rebinding against a keyless server on loopback).
"""

from __future__ import annotations

import asyncio
import logging
import re
import threading
import time
from typing import Any
from collections.abc import Iterable

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

logger = logging.getLogger(__name__)

_NUMBERS = re.compile(r"0x[0-9a-fA-F]+|\d+")

# Paths a load balancer probes: answered even past the connection cap.
HEALTH_PATHS = frozenset({"/health"})


def _error(message: str, status: int, err_type: str) -> JSONResponse:
    from vllm_lite.entrypoints.openai.serving_engine import error_body

    return JSONResponse(error_body(message, err_type, status), status_code=status,
                        headers={"connection": "close"})


class _OverCapApp:
    """The app a connection past the cap gets: /health works, everything else is 503."""

    def __init__(self, app: ASGIApp, max_connections: int) -> None:
        self.app = app
        self.max_connections = max_connections

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] in HEALTH_PATHS:
            await self.app(scope, receive, send)
            return
        await _error(f"the server is at its connection limit ({self.max_connections}); "
                     "retry later", 503, "ServiceUnavailable")(scope, receive, send)


def guarded_h11_protocol(max_connections: int, read_timeout: float) -> type:
    """An H11Protocol subclass enforcing the connection cap and the read timeout."""

    class GuardedH11Protocol(H11Protocol):
        _read_timer: asyncio.TimerHandle | None = None
        _over_cap = False

        def connection_made(self, transport: Any) -> None:  # type: ignore[override]
            super().connection_made(transport)
            if len(self.connections) > max_connections:
                self._over_cap = True
                self.app = _OverCapApp(self.app, max_connections)
                self.logger.warning("connection limit (%d) reached", max_connections)
            self._arm_read_timer()

        def _arm_read_timer(self) -> None:
            self._cancel_read_timer()
            # Past the cap a connection gets one quick chance, then its descriptor is freed.
            timeout = min(read_timeout, 2.0) if self._over_cap else read_timeout
            self._read_timer = self.loop.call_later(timeout, self._read_timed_out)

        def _cancel_read_timer(self) -> None:
            if self._read_timer is not None:
                self._read_timer.cancel()
                self._read_timer = None

        def _read_timed_out(self) -> None:
            self._read_timer = None
            if not self.transport.is_closing():
                self.logger.debug("closing a connection that sent no request within %s s",
                                  read_timeout)
                self.transport.close()

        def data_received(self, data: bytes) -> None:
            cycle = self.cycle
            super().data_received(data)
            if self.cycle is not None and self.cycle is not cycle:
                self._cancel_read_timer()  # a new request's headers are in

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if self._over_cap and not self.transport.is_closing():
                self.transport.close()
                return
            if not self.transport.is_closing():
                self._arm_read_timer()

        def connection_lost(self, exc: Exception | None) -> None:
            self._cancel_read_timer()
            super().connection_lost(exc)

    return GuardedH11Protocol


class BodyTooLarge(Exception):
    pass


class BodyLimitMiddleware:
    """413 past ``max_bytes``, 408 past ``read_timeout`` seconds of body reading."""

    def __init__(self, app: ASGIApp, max_bytes: int, read_timeout: float) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.read_timeout = read_timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope["headers"]:
            if name == b"content-length":
                try:
                    length = int(value)
                except ValueError:
                    length = -1
                if length < 0:
                    await _error("Content-Length is not a valid length", 400,
                                 "BadRequestError")(scope, receive, send)
                    return
                if length > self.max_bytes:
                    await self._too_large(scope, receive, send)
                    return
        received = 0
        deadline = time.monotonic() + self.read_timeout
        body_done = False
        started = False
        # Set when the body broke a limit: the app's own answer to the exception (FastAPI
        # turns any body-reading error into a 400) is dropped and ours is sent instead.
        broke: str | None = None

        async def limited_receive() -> Message:
            nonlocal received, body_done, broke
            if body_done:
                return await receive()
            left = deadline - time.monotonic()
            try:
                message = await asyncio.wait_for(receive(), timeout=max(left, 0.001))
            except asyncio.TimeoutError:
                broke = "timeout"
                raise BodyTimeout() from None
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    broke = "size"
                    raise BodyTooLarge()
                if not message.get("more_body", False):
                    body_done = True
            return message

        async def guarded_send(message: Message) -> None:
            nonlocal started
            if broke is not None:
                return
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, limited_receive, guarded_send)
        except (BodyTooLarge, BodyTimeout):
            pass
        if broke is not None and not started:
            if broke == "size":
                await self._too_large(scope, receive, send)
            else:
                await _error(f"the request body did not arrive within {self.read_timeout:g} s",
                             408, "RequestTimeout")(scope, receive, send)

    async def _too_large(self, scope: Scope, receive: Receive, send: Send) -> None:
        await _error(f"the request body is larger than the server's limit of "
                     f"{self.max_bytes} bytes (--max-request-bytes)", 413,
                     "RequestEntityTooLarge")(scope, receive, send)


class BodyTimeout(Exception):
    pass


class HostCheckMiddleware:
    """400 unless the Host header (without its port) is one of ``allowed_hosts``."""

    def __init__(self, app: ASGIApp, allowed_hosts: Iterable[str]) -> None:
        self.app = app
        self.allowed = frozenset(h.lower() for h in allowed_hosts)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            host = ""
            for name, value in scope["headers"]:
                if name == b"host":
                    host = value.decode("latin-1").lower()
                    break
            if host.startswith("["):  # [::1]:8000
                name_only = host[1:].split("]", 1)[0]
            else:
                name_only = host.rsplit(":", 1)[0] if host.count(":") == 1 else host
            if name_only not in self.allowed and "*" not in self.allowed:
                await _error(f"Host {host!r} is not allowed (--allowed-hosts)", 400,
                             "BadRequestError")(scope, receive, send)
                return
        await self.app(scope, receive, send)


class RateLimitFilter(logging.Filter):
    """Lets through at most ``burst`` records of one kind (logger, message template,
    exception type) per ``window`` seconds; then says how many it dropped."""

    def __init__(self, burst: int = 5, window: float = 10.0) -> None:
        super().__init__()
        self.burst = burst
        self.window = window
        self._lock = threading.Lock()
        # key -> (window start, count in window, dropped in window)
        self._seen: dict[tuple[Any, ...], list] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[0].__name__ if record.exc_info and record.exc_info[0] else None
        # The kind of message: its first line with numbers and addresses blanked (asyncio
        # formats handles, times and ports into the message itself).
        first = _NUMBERS.sub("#", str(record.msg).split("\n", 1)[0])[:120]
        key = (record.name, record.levelno, first, exc)
        now = time.monotonic()
        with self._lock:
            entry = self._seen.get(key)
            if entry is None or now - entry[0] > self.window:
                dropped = entry[2] if entry is not None else 0
                self._seen[key] = [now, 1, 0]
                if len(self._seen) > 10_000:  # many distinct messages: forget old kinds
                    self._seen = {k: v for k, v in self._seen.items()
                                  if now - v[0] <= self.window}
                if dropped:
                    record.msg = f"{record.msg} [{dropped} similar message(s) suppressed]"
                return True
            entry[1] += 1
            if entry[1] <= self.burst:
                return True
            entry[2] += 1
            return False


# The loggers whose handlers the server's rate limit filters: the root (the app's and the
# engine's records propagate there) and uvicorn's and asyncio's, which may have their own.
RATE_LIMITED_LOGGERS = ("", "uvicorn", "uvicorn.error", "uvicorn.access", "asyncio")


def install_rate_limit(filter_: RateLimitFilter,
                       logger_names: Iterable[str] = RATE_LIMITED_LOGGERS) -> None:
    """Puts the filter on every handler of these loggers (a handler filter sees records
    propagated from child loggers too, a logger filter would not)."""
    for name in logger_names:
        for handler in logging.getLogger(name).handlers:
            if filter_ not in handler.filters:
                handler.addFilter(filter_)


def remove_rate_limit(filter_: RateLimitFilter,
                      logger_names: Iterable[str] = RATE_LIMITED_LOGGERS) -> None:
    """Takes the filter off every handler install_rate_limit put it on: the handlers are the
    process's, and outlive the server (an embedding process, a test run)."""
    for name in logger_names:
        for handler in logging.getLogger(name).handlers:
            handler.removeFilter(filter_)
