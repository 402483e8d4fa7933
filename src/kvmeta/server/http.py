"""A small HTTP/1.1 server: ``asyncio.Protocol`` + the ``httptools`` (llhttp) parser.

Why not uvicorn + ASGI: per request the HTTP layer is most of kvmeta's cost, and on this class
of machine a bare protocol measured ~90 us of server CPU against ~155 us for the same logic in a
raw ASGI app on uvicorn (see benchmarks/README.md). What this module still guarantees:

- keep-alive and pipelining (responses leave in request order, even when a later request
  finishes first), chunked request bodies (httptools decodes them), ``Expect: 100-continue``;
- limits: request body size (413), header size (431), both checked while reading, so an
  oversize body is never buffered whole;
- garbage gets ``400`` and the connection is closed; a handler bug gets ``500`` and is logged;
- back-pressure: reading pauses while the peer does not read its responses;
- graceful shutdown: stop accepting, let in-flight requests finish, close idle connections.

Handlers are coroutines, but most finish without ever suspending (no disk wait), so they are
driven eagerly with ``coro.send(None)``; only one that really waits becomes a Task. This saves
a Task and a loop iteration per request.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable, Coroutine
from http import HTTPStatus
from typing import Any

import httptools
import msgspec

__all__ = ["HttpLimits", "HttpServer", "Request", "Response"]

logger = logging.getLogger(__name__)

_MAX_PIPELINED = 64


class Request:
    """One parsed request. ``path`` excludes the query string."""

    __slots__ = ("method", "path", "query", "body", "authorization")

    def __init__(
        self, method: str, path: str, query: str, body: bytes, authorization: bytes | None
    ) -> None:
        self.method = method
        self.path = path
        self.query = query
        self.body = body
        self.authorization = authorization


class Response:
    __slots__ = ("status", "body", "content_type", "headers")

    def __init__(
        self,
        status: int,
        body: bytes = b"",
        content_type: bytes = b"application/json",
        headers: tuple[tuple[bytes, bytes], ...] = (),
    ) -> None:
        self.status = status
        self.body = body
        self.content_type = content_type
        self.headers = headers


Handler = Callable[[Request], Coroutine[Any, Any, Response]]


class HttpLimits:
    """Sizes a request may have; exceeding one is answered 413/431 with the flag to raise."""

    __slots__ = ("max_body_bytes", "max_header_bytes")

    def __init__(self, max_body_bytes: int = 16 * 1024 * 1024, max_header_bytes: int = 64 * 1024):
        self.max_body_bytes = max_body_bytes
        self.max_header_bytes = max_header_bytes


_REASONS = {s.value: s.phrase.encode() for s in HTTPStatus}
_STATUS_LINES: dict[int, bytes] = {}


def _status_line(status: int) -> bytes:
    line = _STATUS_LINES.get(status)
    if line is None:
        line = b"HTTP/1.1 %d %s\r\n" % (status, _REASONS.get(status, b"Unknown"))
        _STATUS_LINES[status] = line
    return line


def render(response: Response, keep_alive: bool) -> bytes:
    """The bytes of a response (no Date/Server headers: nobody needs them, they cost)."""
    parts = [_status_line(response.status)]
    if response.status != 204 and response.status >= 200:
        parts.append(
            b"content-type: %s\r\ncontent-length: %d\r\n"
            % (response.content_type, len(response.body))
        )
    for name, value in response.headers:
        parts.append(b"%s: %s\r\n" % (name, value))
    if not keep_alive:
        parts.append(b"connection: close\r\n")
    parts.append(b"\r\n")
    if response.status != 204:
        parts.append(response.body)
    return b"".join(parts)


def _error_body(detail: str) -> bytes:
    return msgspec.json.encode({"detail": detail})


class _Reject(Exception):
    """Raised inside a parser callback to answer with an error and close the connection."""

    def __init__(self, status: int, detail: str) -> None:
        super().__init__(detail)
        self.status = status
        self.detail = detail


async def _finish(coro: Coroutine[Any, Any, Response], yielded: Any) -> Response:
    """Drive a coroutine that suspended during its eager first step to completion."""
    while True:
        if yielded is None:
            await asyncio.sleep(0)
        else:
            # The eager step already marked this future as awaited (asyncio's blocking flag);
            # clear it or awaiting it here raises "await wasn't used with future".
            if getattr(yielded, "_asyncio_future_blocking", False):
                yielded._asyncio_future_blocking = False
            try:
                await yielded
            except BaseException:  # noqa: BLE001 - the coroutine sees it on resume
                pass
        try:
            yielded = coro.send(None)
        except StopIteration as stop:
            return stop.value  # type: ignore[no-any-return]


class HttpProtocol(asyncio.Protocol):
    """One client connection."""

    def __init__(self, server: HttpServer) -> None:
        self.server = server
        self.handler = server.handler
        self.limits = server.limits
        self.loop = server.loop
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self._pending: deque[list[Any]] = deque()  # [response bytes | Task, keep_alive]
        self._url = b""
        self._body: list[bytes] = []
        self._body_size = 0
        self._header_size = 0
        self._auth: bytes | None = None
        self._expect_continue = False
        self._in_message = False
        self._closing = False
        self._reading_paused = False
        self._writing_paused = False

    # -------------------------------------------------------------- transport events

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.server.connections.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        self.server.connections.discard(self)

    def data_received(self, data: bytes) -> None:
        if self._closing:
            return
        try:
            self.parser.feed_data(data)
        except _Reject as rej:
            self._reject(rej.status, rej.detail)
        except httptools.HttpParserUpgrade:
            self._reject(400, "Protocol upgrades are not supported; send plain HTTP/1.1")
        except httptools.HttpParserError as exc:
            cause = exc.__context__
            if isinstance(cause, _Reject):
                self._reject(cause.status, cause.detail)
            else:
                self._reject(400, f"Malformed HTTP request: {exc}")

    def pause_writing(self) -> None:
        self._writing_paused = True
        self._update_reading()

    def resume_writing(self) -> None:
        self._writing_paused = False
        self._update_reading()

    # -------------------------------------------------------------- parser callbacks

    def on_message_begin(self) -> None:
        self._in_message = True
        self._url = b""
        self._body = []
        self._body_size = 0
        self._header_size = 0
        self._auth = None
        self._expect_continue = False

    def on_url(self, url: bytes) -> None:
        self._url += url
        if len(self._url) > self.limits.max_header_bytes:
            raise _Reject(414, "Request URL too long")

    def on_header(self, name: bytes, value: bytes) -> None:
        self._header_size += len(name) + len(value)
        if self._header_size > self.limits.max_header_bytes:
            raise _Reject(431, f"Request headers exceed {self.limits.max_header_bytes} bytes")
        lname = name.lower()
        if lname == b"authorization":
            self._auth = value
        elif lname == b"content-length":
            try:
                length = int(value)
            except ValueError:
                raise _Reject(400, "Content-Length is not an integer") from None
            if length > self.limits.max_body_bytes:
                raise _Reject(413, self._too_large(length))
        elif lname == b"expect" and value.lower() == b"100-continue":
            self._expect_continue = True

    def on_headers_complete(self) -> None:
        if self._expect_continue and self.transport is not None:
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def on_body(self, body: bytes) -> None:
        self._body_size += len(body)
        if self._body_size > self.limits.max_body_bytes:
            raise _Reject(413, self._too_large(self._body_size))
        self._body.append(body)

    def on_message_complete(self) -> None:
        self._in_message = False
        parser = self.parser
        keep_alive = parser.should_keep_alive()
        url = self._url
        qpos = url.find(b"?")
        if qpos >= 0:
            path, query = url[:qpos], url[qpos + 1 :]
        else:
            path, query = url, b""
        body = self._body[0] if len(self._body) == 1 else b"".join(self._body)
        request = Request(
            parser.get_method().decode("latin-1"),
            path.decode("latin-1"),
            query.decode("latin-1"),
            body,
            self._auth,
        )
        coro = self.handler(request)
        try:
            yielded = coro.send(None)
        except StopIteration as stop:
            self._respond(render(stop.value, keep_alive), keep_alive)
            return
        except BaseException:
            logger.exception("Unhandled error in request handler for %s %s", request.method, path)
            self._respond(render(Response(500, _error_body("Internal server error")), False), False)
            return
        task = self.loop.create_task(_finish(coro, yielded))
        self.server.tasks.add(task)
        entry = [task, keep_alive]
        self._pending.append(entry)
        task.add_done_callback(self._task_done)
        self._update_reading()

    # -------------------------------------------------------------- responses

    def _too_large(self, size: int) -> str:
        return (
            f"Request body of {size} bytes exceeds the limit of {self.limits.max_body_bytes} "
            "bytes; send smaller batches or raise --max-body-bytes"
        )

    def _respond(self, data: bytes, keep_alive: bool) -> None:
        if self._pending:
            self._pending.append([data, keep_alive])
            self._flush()
            return
        self._write(data, keep_alive)

    def _write(self, data: bytes, keep_alive: bool) -> None:
        transport = self.transport
        if transport is None:
            return
        transport.write(data)
        if not keep_alive:
            self._closing = True
            self._pending.clear()
            transport.close()

    def _task_done(self, task: asyncio.Task[Response]) -> None:
        self.server.tasks.discard(task)
        self._flush()

    def _flush(self) -> None:
        pending = self._pending
        while pending:
            item, keep_alive = pending[0]
            if isinstance(item, asyncio.Task):
                if not item.done():
                    break
                if item.cancelled():
                    data = render(Response(503, _error_body("Server shutting down")), False)
                    keep_alive = False
                else:
                    exc = item.exception()
                    if exc is not None:
                        logger.error("Unhandled error in request handler", exc_info=exc)
                        data = render(Response(500, _error_body("Internal server error")), False)
                        keep_alive = False
                    else:
                        data = render(item.result(), keep_alive)
            else:
                data = item
            pending.popleft()
            self._write(data, keep_alive)
            if self._closing:
                return
        self._update_reading()

    def _reject(self, status: int, detail: str) -> None:
        self._respond(render(Response(status, _error_body(detail)), False), False)
        self._closing = True

    def _update_reading(self) -> None:
        transport = self.transport
        if transport is None:
            return
        should_pause = self._writing_paused or len(self._pending) >= _MAX_PIPELINED
        if should_pause and not self._reading_paused:
            self._reading_paused = True
            transport.pause_reading()
        elif not should_pause and self._reading_paused:
            self._reading_paused = False
            transport.resume_reading()

    @property
    def idle(self) -> bool:
        return not self._pending and not self._in_message

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


class HttpServer:
    """Listens on one socket (or adopts one) and serves ``handler``."""

    def __init__(
        self,
        handler: Handler,
        limits: HttpLimits | None = None,
        loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        self.handler = handler
        self.limits = limits or HttpLimits()
        self.loop = loop or asyncio.get_event_loop()
        self.connections: set[HttpProtocol] = set()
        self.tasks: set[asyncio.Task[Response]] = set()
        self._server: asyncio.AbstractServer | None = None

    async def listen(self, host: str, port: int, **kwargs: Any) -> list[tuple[str, int]]:
        """Start listening; returns the bound addresses (port 0 picks a free port)."""
        self._server = await self.loop.create_server(
            lambda: HttpProtocol(self), host, port, backlog=2048, **kwargs
        )
        return [s.getsockname()[:2] for s in self._server.sockets]

    async def shutdown(self, timeout: float = 5.0) -> None:
        """Stop accepting, let in-flight requests finish (up to ``timeout``), close connections."""
        if self._server is not None:
            self._server.close()
        deadline = self.loop.time() + timeout
        while self.tasks and self.loop.time() < deadline:
            await asyncio.wait(list(self.tasks), timeout=max(0.0, deadline - self.loop.time()))
        for task in list(self.tasks):
            task.cancel()
        for conn in list(self.connections):
            conn.close()
        if self._server is not None:
            await self._server.wait_closed()
