"""A small HTTP/1.1 server: ``asyncio.Protocol`` + the ``httptools`` (llhttp) parser.

Why not uvicorn + ASGI: per request the HTTP layer is most of kvmeta's cost, and a bare
protocol costs clearly less server CPU than the same logic in a raw ASGI app on uvicorn (scope
dicts, receive/send messages, a Task per request; the measured numbers are in
benchmarks/README.md, "Serving stack"). What this module still guarantees:

- keep-alive and pipelining (responses leave in request order, even when a later request
  finishes first), chunked request bodies (httptools decodes them), ``Expect: 100-continue``;
- limits: request body size (413), header size (431), both checked while reading, so an
  oversize body or header is never buffered whole (the header budget is counted on the bytes
  fed to the parser, since httptools assembles a header value before handing it over);
- the token is checked (``head_check``) as soon as the headers are in, before any body is read
  or ``100 Continue`` is sent: a client without the token never makes the server buffer a body,
  and routes served without the token take none (413 at the headers);
- time limits: a request must arrive whole within ``header_timeout`` (a new connection's first
  one from the accept, TLS handshake included; else 408 and close), an idle keep-alive
  connection is closed after ``idle_timeout`` (``header_timeout`` until a request with a valid
  token came on it); all are checked by one sweep per second over the connections, so a
  request pays no timer;
- a connection cap, counted from the accept: beyond ``max_connections`` a new connection is
  closed at once (a rate-limited warning names the flag), so a flood cannot take the
  descriptors the journal needs; at most half of it may be connections without a valid token
  yet, the oldest of which make room for new ones, so such a flood cannot lock engines out;
- garbage gets ``400`` and the connection is closed, and so does a protocol upgrade, before it
  runs; a handler bug gets ``500`` and is logged;
- back-pressure: a connection whose unsent replies exceed ``max_output_bytes`` is not read, nor
  are the requests it pipelined started, until they drain; beyond ``max_total_output_bytes``
  for all connections together the ones holding the most are closed, and so is a connection
  whose replies go unread for its idle timeout;
- graceful shutdown: stop accepting, let in-flight requests finish, close idle connections.

Handlers are coroutines, but most finish without ever suspending (no disk wait), so their first
step runs at once, in the ``data_received`` call that completed the request, and a handler that
finishes there is answered without a loop iteration. On Python 3.12+ that step runs in an eager
Task (``asyncio.Task(..., eager_start=True)``, the per-task form of ``eager_task_factory``), so
``asyncio.current_task()`` works in handlers. Before 3.12 the first step is a bare
``coro.send(None)`` and only a handler that really waits becomes a Task (``_finish``), which
saves a Task per request; pass ``eager=False`` when handlers need ``current_task()`` from their
first step on (e.g. a Redis backend: redis-py's timeouts do).
"""

from __future__ import annotations

import asyncio
import errno
import logging
import re
import socket
import ssl
import sys
import types
from collections import deque
from collections.abc import Callable, Coroutine, Generator
from http import HTTPStatus
from typing import Any, TypeVar

import httptools
import msgspec

from kvmeta.errors import CannotListen
from kvmeta.server.conn_table import ConnectionTable

__all__ = [
    "EPOCH_HEADER",
    "NO_STAMP",
    "PUBLIC",
    "HttpLimits",
    "HttpServer",
    "PublicRoute",
    "Request",
    "Response",
    "Stamp",
    "bind_sockets",
    "render",
]

logger = logging.getLogger(__name__)
T = TypeVar("T")

_MAX_PIPELINED = 64


class Request:
    """One parsed request. ``path`` excludes the query string; ``peer`` is the client's
    address (host, port) when known, for warnings about two engines on one pool. ``scope`` is
    the authenticated token's scope (``server.tokens.Scope``), set by ``server.access`` when a
    tokens file is in use; None: all access, tenant ``""``. ``host``, ``origin`` and
    ``content_type`` are those headers' raw values (None: not sent), for ``server.guard``."""

    __slots__ = (
        "method",
        "path",
        "query",
        "body",
        "authorization",
        "peer",
        "scope",
        "host",
        "origin",
        "content_type",
    )

    def __init__(
        self,
        method: str,
        path: str,
        query: str,
        body: bytes,
        authorization: bytes | None,
        peer: Any = None,
        host: bytes | None = None,
        origin: bytes | None = None,
        content_type: bytes | None = None,
    ) -> None:
        self.method = method
        self.path = path
        self.query = query
        self.body = body
        self.authorization = authorization
        self.peer = peer
        self.scope: Any = None
        self.host = host
        self.origin = origin
        self.content_type = content_type


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
    """Sizes and times a request may take, how many connections may be open and how much
    unsent output they may hold; exceeding one is answered 413/431/408 (or a closed
    connection) with the flag to raise.

    ``max_output_bytes``: a connection whose unsent replies exceed it is not read, nor are the
    requests it already sent started, until they drain (to a quarter of it);
    ``max_total_output_bytes``: all connections together, beyond which those holding the most
    are closed; ``public_body_bytes``: the largest body of a route served without the token.
    At most half of ``max_connections`` may be connections that have not yet sent a request
    with a valid token (``server.conn_table``)."""

    __slots__ = (
        "max_body_bytes",
        "max_header_bytes",
        "header_timeout",
        "idle_timeout",
        "max_connections",
        "max_output_bytes",
        "max_total_output_bytes",
        "public_body_bytes",
    )

    def __init__(
        self,
        max_body_bytes: int = 16 * 1024 * 1024,
        max_header_bytes: int = 64 * 1024,
        header_timeout: float = 10.0,
        idle_timeout: float = 300.0,
        max_connections: int = 4096,
        max_output_bytes: int = 256 * 1024,
        max_total_output_bytes: int = 128 * 1024 * 1024,
        public_body_bytes: int = 1024,
    ):
        self.max_body_bytes = max_body_bytes
        self.max_header_bytes = max_header_bytes
        self.header_timeout = header_timeout
        self.idle_timeout = idle_timeout
        self.max_connections = max_connections
        self.max_output_bytes = max_output_bytes
        self.max_total_output_bytes = max_total_output_bytes
        self.public_body_bytes = public_body_bytes


class PublicRoute:
    """What ``head_check`` answers (``PUBLIC``) for a route served without the token: the
    request goes on, but its body may be at most ``HttpLimits.public_body_bytes`` (refused
    413 at the headers, unread, beyond) and it does not make its connection authenticated."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "PUBLIC"


PUBLIC = PublicRoute()

# ``head_check(method, path, authorization)``: called once the headers are in; a Response
# refuses the request (the connection is closed without reading the body), None lets it go on
# as authenticated (or with no token configured), ``PUBLIC`` as a public route.
HeadCheck = Callable[[bytes, bytes, "bytes | None"], "Response | PublicRoute | None"]

_UPGRADE = (
    "Protocol upgrades (Upgrade with Connection: upgrade, or CONNECT) are not supported and the "
    "request was not run; send plain HTTP/1.1 requests without those headers"
)

# After an error reply the connection is half-closed and what the peer still sends is read and
# dropped for this long, so it sees the reply instead of a reset; then it is closed.
_LINGER_SECONDS = 2.0


_REASONS = {s.value: s.phrase.encode() for s in HTTPStatus}
_STATUS_LINES: dict[int, bytes] = {}


def _status_line(status: int) -> bytes:
    line = _STATUS_LINES.get(status)
    if line is None:
        line = b"HTTP/1.1 %d %s\r\n" % (status, _REASONS.get(status, b"Unknown"))
        _STATUS_LINES[status] = line
    return line


EPOCH_HEADER = b"x-kvmeta-epoch"
_EPOCH_UNSAFE = re.compile(rb"[^A-Za-z0-9._:-]")


class Stamp:
    """The headers every reply carries (today: the backend epoch), pre-rendered once per value
    together with the two common replies, so a reply pays no formatting for them."""

    __slots__ = ("value", "extra", "ok_json", "no_content")

    def __init__(self, value: str | None) -> None:
        self.value = value
        extra = b""
        if value:
            safe = _EPOCH_UNSAFE.sub(b"_", value.encode("utf-8", "replace"))[:128]
            extra = EPOCH_HEADER + b": " + safe + b"\r\n"
        self.extra = extra
        self.ok_json = (
            b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
            + extra.replace(b"%", b"%%")
            + b"content-length: %d\r\n\r\n%s"
        )
        self.no_content = b"HTTP/1.1 204 No Content\r\n" + extra + b"\r\n"


NO_STAMP = Stamp(None)


def render(response: Response, keep_alive: bool, stamp: Stamp = NO_STAMP) -> bytes:
    """The bytes of a response (no Date/Server headers: nobody needs them, they cost), with
    the headers of ``stamp``."""
    if keep_alive and not response.headers:
        # The two replies of nearly every request, in one formatting step.
        status = response.status
        if status == 204:
            return stamp.no_content
        if status == 200 and response.content_type == b"application/json":
            return stamp.ok_json % (len(response.body), response.body)
    parts = [_status_line(response.status)]
    if response.status != 204 and response.status >= 200:
        parts.append(
            b"content-type: %s\r\ncontent-length: %d\r\n"
            % (response.content_type, len(response.body))
        )
    parts.append(stamp.extra)
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


class _Refused(Exception):
    """Raised inside a parser callback after the refusal was already answered: stop parsing."""


class _Reject(Exception):
    """Raised inside a parser callback to answer with an error and close the connection."""

    def __init__(self, status: int, detail: str) -> None:
        super().__init__(detail)
        self.status = status
        self.detail = detail


# Python 3.12+: the first step of a handler runs in an eager Task (inside the Task, so
# ``current_task()`` works); before, it is driven bare and only a handler that waits gets a Task.
EAGER_TASKS = sys.version_info >= (3, 12)


async def _finish(coro: Coroutine[Any, Any, T], yielded: Any) -> T:
    """Drive a coroutine that suspended during its eager first step to completion.

    The Task running this sees what the coroutine yielded and sends or throws what it gets back
    into it (``_resume``), exactly as if the Task had run the coroutine from the start: an
    exception of the awaited future reaches the coroutine, and so do cancellation,
    KeyboardInterrupt and SystemExit, so its cleanup runs and the Task ends cancelled (a
    cancelled request never carries on as if nothing happened).
    """
    return await _resume(coro, yielded)


@types.coroutine
def _resume(coro: Coroutine[Any, Any, T], yielded: Any) -> Generator[Any, Any, T]:
    """``yield from coro``, begun after the coroutine's first step already yielded ``yielded``
    (the generator-based coroutine protocol; no private asyncio state is touched)."""
    while True:
        try:
            sent = yield yielded
        except GeneratorExit:
            coro.close()
            raise
        except BaseException as exc:  # noqa: BLE001 - thrown in by the Task: the handler's own
            try:
                yielded = coro.throw(exc)
            except StopIteration as stop:
                return stop.value  # type: ignore[no-any-return]
        else:
            try:
                yielded = coro.send(sent)
            except StopIteration as stop:
                return stop.value  # type: ignore[no-any-return]


def _task_reply(task: asyncio.Task[Response], keep_alive: bool, stamp: Stamp) -> tuple[bytes, bool]:
    """The bytes to send for a finished handler Task, and whether the connection stays."""
    if task.cancelled():
        return render(Response(503, _error_body("Server shutting down")), False, stamp), False
    exc = task.exception()
    if exc is not None:
        logger.error("Unhandled error in request handler", exc_info=exc)
        return render(Response(500, _error_body("Internal server error")), False, stamp), False
    return render(task.result(), keep_alive, stamp), keep_alive


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
        # Requests parsed while the connection was over its output budget, not started yet
        # (or the final error reply owed after them), and the bytes received but not parsed.
        self._queued: deque[tuple[Request | bytes, bool]] = deque()
        self._unparsed = b""
        self._draining = False
        self._url = b""
        self._body: list[bytes] = []
        self._body_size = 0
        self._body_cap = self.limits.max_body_bytes
        self._length = -1  # the Content-Length announced, if any
        self._header_size = 0
        self._auth: bytes | None = None
        self._host: bytes | None = None
        self._origin: bytes | None = None
        self._content_type: bytes | None = None
        self._expect_continue = False
        self._in_message = False
        self._closing = False
        self._lingering = False
        self._reading_paused = False
        self._writing_paused = False
        self._peer: Any = None
        # Header budget: bytes fed to the parser since this message began, while in its head.
        self._in_head = False
        self._head_fed = 0
        # Coarse times (the server's clock, updated once per sweep) for the timeouts.
        self._since = server.now  # message begun, or connection idle since
        self._first = True  # the first request is owed within header_timeout of the accept
        self._served = 0
        self._refused = False
        # Unsent output as last counted (its share of ``ConnectionTable.unsent``), and since
        # when it has not shrunk.
        self.unsent = 0
        self._stuck_since = -1.0
        # True once a request passed the token check (``head_check`` answered None).
        self.authenticated = False
        self._handshaking = False  # a TLS handshake runs: nothing is read or written yet
        self._handshake: asyncio.Task[None] | None = None  # (kept referenced while it runs)

    # -------------------------------------------------------------- transport events

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        server = self.server
        if not server.conns.admit(self):
            self._refused = True
            self._closing = True
            self.transport = None
            transport.abort()  # type: ignore[attr-defined]
            return
        self._peer = transport.get_extra_info("peername")
        self._since = server.now
        if server.tls is None:
            transport.set_write_buffer_limits(self.limits.max_output_bytes)  # type: ignore[attr-defined]
            return
        # Counted and timed from the accept, handshake included. The handshake takes over the
        # connection now, before the loop starts reading it: the client's first bytes are its
        # handshake (``start_tls`` holds what arrives until it is ready), never a request.
        self._handshaking = True
        self._handshake = server.run_now(self._start_tls(transport, server.tls))

    async def _start_tls(self, raw: asyncio.BaseTransport, context: ssl.SSLContext) -> None:
        """Run the TLS handshake on an accepted connection, then serve it over TLS."""
        tls: asyncio.Transport | None = None
        try:
            tls = await self.loop.start_tls(
                raw,
                self,
                context,
                server_side=True,
                ssl_handshake_timeout=self.limits.header_timeout,
                **self.server.tls_shutdown,
            )
        except Exception as exc:  # noqa: BLE001 - whatever failed, the connection is dropped
            logger.debug("TLS handshake with %s failed: %r", self._peer, exc)
        finally:
            self._handshaking = False
            self._handshake = None
        if tls is None:
            self.abort()
            return
        if self.transport is not raw:  # dropped during the handshake (timeout, cap, shutdown)
            tls.abort()
            return
        self.transport = tls
        tls.set_write_buffer_limits(self.limits.max_output_bytes)
        if self._unparsed:  # sent along with the end of the handshake
            data, self._unparsed = self._unparsed, b""
            self.data_received(data)

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        self.server.conns.remove(self)

    def abort(self) -> None:
        """Drop the connection at once, unanswered: it made room for another, hoarded output
        or stalled (nothing it owes or sent is kept)."""
        transport = self.transport
        self._closing = True
        self._queued.clear()
        self._unparsed = b""
        self._pending.clear()
        self.transport = None
        self.server.conns.remove(self)
        if transport is not None:
            transport.abort()

    def data_received(self, data: bytes) -> None:
        if self._closing:
            return  # an error reply is out: what the peer still sends is dropped
        if self._unparsed or self._queued or self._handshaking:
            # Not parsed on while earlier requests wait to start (or, during the handshake,
            # before ``_start_tls`` has the TLS transport to answer on).
            self._unparsed += data
            return
        self._feed(data)

    def _feed(self, data: bytes) -> None:
        try:
            limit = self.limits.max_header_bytes
            if not self._in_head and len(data) <= limit // 4:
                self.parser.feed_data(data)  # the usual case: one small read
                if self._in_head:
                    self._head_fed += len(data)
            else:
                self._feed_bounded(data, limit)
        except _Reject as rej:
            self._reject(rej.status, rej.detail)
        except _Refused:
            pass
        except httptools.HttpParserUpgrade:  # (refused at the headers: not expected here)
            self._reject(400, _UPGRADE)
        except httptools.HttpParserError as exc:
            cause = exc.__context__
            if isinstance(cause, _Reject):
                self._reject(cause.status, cause.detail)
            elif isinstance(cause, _Refused):
                pass
            else:
                self._reject(400, f"Malformed HTTP request: {exc}")
        if self._queued or self._unparsed:
            self._update_reading()

    def _feed_bounded(self, data: bytes, limit: int) -> None:
        """Feed ``data`` in pieces so that no more than about ``limit`` bytes of one message's
        head ever reach the parser (which would otherwise assemble a header of any size), and
        so that parsing stops, the rest kept unparsed, once requests wait to start."""
        pos, end, step = 0, len(data), max(1, limit // 4)
        while pos < end and not self._closing:
            if self._queued:
                self._unparsed = data[pos:]
                return
            if self._in_head:
                budget = limit - self._head_fed
                if budget <= 0:
                    raise _Reject(431, self._head_too_large())
                size = min(budget, step)
            else:
                size = step
            piece = data[pos : pos + size] if size < end - pos or pos else data
            self.parser.feed_data(piece)
            if self._in_head:  # counts at most one piece of the previous message too
                self._head_fed += len(piece)
            pos += len(piece)
        if self._in_head and self._head_fed > limit:
            raise _Reject(431, self._head_too_large())

    def _head_too_large(self) -> str:
        return (
            f"Request line and headers exceed {self.limits.max_header_bytes} bytes; "
            "send fewer or shorter headers"
        )

    def pause_writing(self) -> None:
        self._writing_paused = True
        self._update_reading()

    def resume_writing(self) -> None:
        self._writing_paused = False
        self._stuck_since = -1.0  # the client reads
        self.recount()
        self._drain()

    # -------------------------------------------------------------- parser callbacks

    def on_message_begin(self) -> None:
        self._in_message = True
        self._in_head = True
        self._head_fed = 0
        if not self._first:
            self._since = self.server.now
        self._url = b""
        self._body = []
        self._body_size = 0
        self._length = -1
        self._header_size = 0
        self._auth = None
        self._host = None
        self._origin = None
        self._content_type = None
        self._expect_continue = False

    def on_url(self, url: bytes) -> None:
        self._url += url
        if len(self._url) > self.limits.max_header_bytes:
            raise _Reject(414, "Request URL too long")

    def on_header(self, name: bytes, value: bytes) -> None:
        self._header_size += len(name) + len(value)
        if self._header_size > self.limits.max_header_bytes:
            raise _Reject(431, self._head_too_large())
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
            self._length = length
        elif lname == b"host":
            self._host = value
        elif lname == b"content-type":
            self._content_type = value
        elif lname == b"origin":
            self._origin = value
        elif lname == b"expect" and value.lower() == b"100-continue":
            self._expect_continue = True

    def on_headers_complete(self) -> None:
        self._in_head = False
        parser = self.parser
        if parser.should_upgrade():  # run it, and the bytes after it would be another protocol
            raise _Reject(400, _UPGRADE)
        check = self.server.head_check
        verdict = None if check is None else check(parser.get_method(), self._url, self._auth)
        if verdict is None:
            self._body_cap = self.limits.max_body_bytes
            if not self.authenticated:
                self.authenticated = True
                self.server.conns.authenticated(self)
        elif isinstance(verdict, PublicRoute):
            self._body_cap = cap = self.limits.public_body_bytes
            if self._length > cap:
                raise _Reject(413, self._public_body(self._length))
        else:
            # Refused before the body: no 100 Continue, nothing more read or buffered (the
            # reply may wait behind earlier pipelined ones; reading stops now).
            self._final(render(verdict, False, self.server.stamp()))
            raise _Refused
        if self._expect_continue and self.transport is not None:
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def on_body(self, body: bytes) -> None:
        self._body_size += len(body)
        if self._body_size > self._body_cap:
            if self._body_cap < self.limits.max_body_bytes:
                raise _Reject(413, self._public_body(self._body_size))
            raise _Reject(413, self._too_large(self._body_size))
        self._body.append(body)

    def on_message_complete(self) -> None:
        self._in_message = False
        self._first = False
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
            self._peer,
            self._host,
            self._origin,
            self._content_type,
        )
        if self._queued or self._blocked():
            self._queued.append((request, keep_alive))  # started once the output drains
            return
        self._start(request, keep_alive)

    # -------------------------------------------------------------- requests and responses

    def _blocked(self) -> bool:
        """Whether a parsed request must wait before it starts: the client does not read the
        replies it has (``pause_writing``), or too many are in flight."""
        return self._writing_paused or len(self._pending) >= _MAX_PIPELINED

    def _start(self, item: Request | bytes, keep_alive: bool) -> None:
        if isinstance(item, bytes):  # the final error reply, queued behind the requests
            self._respond(item, keep_alive)
            return
        request = item
        coro = self.handler(request)
        if self.server.bare_first_step:
            try:
                yielded = coro.send(None)
            except StopIteration as stop:
                self._respond(render(stop.value, keep_alive, self.server.stamp()), keep_alive)
                return
            except Exception:
                logger.exception(
                    "Unhandled error in request handler for %s %s", request.method, request.path
                )
                error = Response(500, _error_body("Internal server error"))
                self._respond(render(error, False, self.server.stamp()), False)
                return
            task = self.loop.create_task(_finish(coro, yielded))
        else:
            task = self.server.start(coro)
            if task.done():  # finished in its eager first step
                self._respond(*_task_reply(task, keep_alive, self.server.stamp()))
                return
        self.server.tasks.add(task)
        entry = [task, keep_alive]
        self._pending.append(entry)
        task.add_done_callback(self._task_done)
        self._update_reading()

    def _drain(self) -> None:
        """Start the requests that waited for the output to drain, then parse on."""
        if self._draining:
            return
        self._draining = True
        try:
            queued = self._queued
            while queued and self.transport is not None and not self._blocked():
                item, keep_alive = queued.popleft()
                self._start(item, keep_alive)
            if (
                self._unparsed
                and not queued
                and not self._closing
                and self.transport is not None
                and not self._blocked()
            ):
                data, self._unparsed = self._unparsed, b""
                if self._in_message:  # the client was not the one waiting
                    self._since = self.server.now
                self._feed(data)
        finally:
            self._draining = False
        self._update_reading()

    def _too_large(self, size: int) -> str:
        return (
            f"Request body of {size} bytes exceeds the limit of {self.limits.max_body_bytes} "
            "bytes; send smaller batches or raise --max-body-bytes"
        )

    def _public_body(self, size: int) -> str:
        path = self._url.split(b"?", 1)[0].decode("latin-1")[:64]
        return (
            f"Request body of {size} bytes to {path}, which is served without the token and "
            f"takes no body (at most {self.limits.public_body_bytes} bytes); send it without one"
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
        self._served += 1
        if not self._in_message:
            self._since = self.server.now
        if not keep_alive:
            self._closing = True
            self._pending.clear()
            self._queued.clear()
            self._unparsed = b""
            self._linger_close(transport)
        self._count_unsent()

    def _count_unsent(self) -> None:
        """Count this connection's unsent output into the server's (which may shed the
        connections holding the most, this one included)."""
        transport = self.transport
        size = transport.get_write_buffer_size() if transport is not None else 0
        if size != self.unsent:
            self.server.conns.unsent_changed(self, size)

    def recount(self) -> None:
        """Count the unsent output again, without shedding (it only shrank since)."""
        transport = self.transport
        size = transport.get_write_buffer_size() if transport is not None else 0
        self.server.conns.unsent -= self.unsent - size
        self.unsent = size

    def _linger_close(self, transport: asyncio.Transport) -> None:
        """Half-close after the last reply and drop what the peer still sends for a moment,
        so a client busy sending a refused body reads the reply instead of a reset."""
        if transport.can_write_eof() and self._in_message:
            transport.write_eof()
            self._lingering = True
            if self._reading_paused:
                self._reading_paused = False
                transport.resume_reading()
            self.loop.call_later(_LINGER_SECONDS, transport.close)
        else:
            transport.close()

    def _task_done(self, task: asyncio.Task[Response]) -> None:
        self.server.tasks.discard(task)
        self._flush()
        if self._queued or self._unparsed:
            self._drain()

    def _flush(self) -> None:
        pending = self._pending
        while pending:
            item, keep_alive = pending[0]
            if isinstance(item, asyncio.Task):
                if not item.done():
                    break
                data, keep_alive = _task_reply(item, keep_alive, self.server.stamp())
            else:
                data = item
            pending.popleft()
            self._write(data, keep_alive)
            if not keep_alive or self.transport is None:
                return  # the last reply on this connection is out
        self._update_reading()

    def _reject(self, status: int, detail: str) -> None:
        self._final(render(Response(status, _error_body(detail)), False, self.server.stamp()))

    def _final(self, data: bytes) -> None:
        """Send the connection's last reply (an error), after the replies owed before it, and
        read nothing more."""
        if self._queued:
            self._queued.append((data, False))
        else:
            self._respond(data, False)
        self._unparsed = b""
        self._closing = True

    def _update_reading(self) -> None:
        transport = self.transport
        if transport is None or self._lingering or self._handshaking:
            return
        should_pause = (
            self._writing_paused
            or len(self._pending) >= _MAX_PIPELINED
            or bool(self._queued)
            or bool(self._unparsed)
        )
        if should_pause and not self._reading_paused:
            self._reading_paused = True
            transport.pause_reading()
        elif not should_pause and self._reading_paused:
            self._reading_paused = False
            transport.resume_reading()

    @property
    def idle(self) -> bool:
        return not self._pending and not self._in_message and not self._queued

    def sweep(self, now: float) -> None:
        """Enforce the time limits (called about once a second by the server)."""
        if self.transport is None:
            return
        limits = self.limits
        # A token-less connection gets the short timeouts: it cannot hold a slot for long.
        patience = limits.idle_timeout if self.authenticated else limits.header_timeout
        before = self.unsent
        self._count_unsent()
        if self.transport is None:
            return
        size = self.unsent
        if not size or size < before:  # nothing owed, or the client reads
            self._stuck_since = now if size else -1.0
        elif self._stuck_since < 0:
            self._stuck_since = now
        elif now - self._stuck_since > patience:  # replies it does not take: dropped
            logger.debug("dropping %s: it read none of its replies for %g s", self._peer, patience)
            self.abort()
            return
        if self._closing:
            return
        if self._handshaking:
            if now - self._since > limits.header_timeout:
                self.abort()
            return
        if self._queued or self._unparsed:
            return  # waiting for its replies to drain: the stall check above applies
        if self._in_message:
            if now - self._since > limits.header_timeout:
                self._reject(
                    408,
                    f"Request not received whole within {limits.header_timeout:g} s "
                    "(--header-timeout); send the headers and body without pausing",
                )
        elif not self._pending:
            # A fresh connection owes its first request within header_timeout.
            if now - self._since > patience:
                self._closing = True
                self.transport.close()

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
        head_check: HeadCheck | None = None,
        eager: bool = True,
        epoch: Callable[[], str] | None = None,
    ) -> None:
        """``eager=False`` matters before Python 3.12 only: every request gets a Task at once
        (no bare first step), for handlers that need ``asyncio.current_task()`` from their
        first step on. On 3.12+ the first step always runs in an eager Task.

        ``epoch``: the backend's epoch, read on every reply (it may change while serving) and
        sent as ``X-Kvmeta-Epoch``; the header bytes are rebuilt only when it changes."""
        self.handler = handler
        self.epoch = epoch
        self._stamp = NO_STAMP
        self.bare_first_step = eager and not EAGER_TASKS
        self.limits = limits or HttpLimits()
        self.loop = loop or asyncio.get_event_loop()
        self.head_check = head_check
        self.tls: ssl.SSLContext | None = None
        # A TLS connection being closed waits this long for the client's close_notify.
        self.tls_shutdown: dict[str, Any] = (
            {"ssl_shutdown_timeout": self.limits.header_timeout}
            if sys.version_info >= (3, 11)
            else {}
        )
        self.conns: ConnectionTable[HttpProtocol] = ConnectionTable(
            self.loop, self.limits.max_connections, self.limits.max_total_output_bytes
        )
        self.tasks: set[asyncio.Task[Response]] = set()
        self._servers: list[asyncio.AbstractServer] = []
        self.now: float = self.loop.time()
        self._sweeper: asyncio.TimerHandle | None = None
        self._tick = max(
            0.05, min(1.0, self.limits.header_timeout / 4, self.limits.idle_timeout / 4)
        )

    def stamp(self) -> Stamp:
        """The headers for a reply sent now."""
        epoch = self.epoch
        if epoch is None:
            return NO_STAMP
        stamp = self._stamp
        value = epoch()
        if value != stamp.value:
            stamp = self._stamp = Stamp(value)
        return stamp

    def start(self, coro: Coroutine[Any, Any, Response]) -> asyncio.Task[Response]:
        """A Task for a handler: eager (its first step already run) on Python 3.12+."""
        if sys.version_info >= (3, 12):
            return asyncio.Task(coro, loop=self.loop, eager_start=True)
        return self.loop.create_task(coro)

    def run_now(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None] | None:
        """Run ``coro``'s first step inside this call and the rest in a Task, returned (None:
        it finished in that first step)."""
        if sys.version_info >= (3, 12):
            task = asyncio.Task(coro, loop=self.loop, eager_start=True)
            return None if task.done() else task
        try:
            yielded = coro.send(None)
        except StopIteration:
            return None
        return self.loop.create_task(_finish(coro, yielded))

    @property
    def connections(self) -> set[HttpProtocol]:
        """The open connections."""
        return self.conns.open

    def _sweep(self) -> None:
        self.now = now = self.loop.time()
        for conn in list(self.connections):
            conn.sweep(now)
        for conn in list(self.connections):  # the budget allows more output now?
            if conn._queued or conn._unparsed:
                conn._drain()
        self._sweeper = self.loop.call_later(self._tick, self._sweep)

    async def listen(
        self, sockets: list[socket.socket], ssl_context: ssl.SSLContext | None = None
    ) -> list[tuple[str, int]]:
        """Serve on listening sockets made by ``bind_sockets`` (over TLS with ``ssl_context``:
        the handshake runs per connection once it is accepted and counted, within the header
        timeout); returns their addresses."""
        self.tls = ssl_context
        addrs: list[tuple[str, int]] = []
        for sock in sockets:
            server = await self.loop.create_server(
                lambda: HttpProtocol(self), sock=sock, backlog=_BACKLOG
            )
            self._servers.append(server)
            addrs.extend(s.getsockname()[:2] for s in server.sockets)
        if self._sweeper is None:
            self._sweeper = self.loop.call_later(self._tick, self._sweep)
        return addrs

    async def shutdown(self, timeout: float = 5.0) -> None:
        """Stop accepting, let in-flight requests finish (up to ``timeout``), close connections."""
        if self._sweeper is not None:
            self._sweeper.cancel()
        for server in self._servers:
            server.close()
        deadline = self.loop.time() + timeout
        while self.tasks and self.loop.time() < deadline:
            await asyncio.wait(list(self.tasks), timeout=max(0.0, deadline - self.loop.time()))
        for task in list(self.tasks):
            task.cancel()
        for conn in list(self.connections):
            if conn._handshaking:
                conn.abort()
            else:
                conn.close()
        for server in self._servers:
            await server.wait_closed()


_BACKLOG = 2048


def bind_sockets(host: str, port: int) -> list[socket.socket]:
    """Listening sockets on every address of ``host`` (port 0: one free port for all).

    No SO_REUSEPORT: a port another process listens on is refused here, at start-up, instead of
    being silently shared (``--workers`` hands these same sockets to its forked workers).

    Raises:
        CannotListen: one line naming the port or host and what to change.
    """
    try:
        infos = socket.getaddrinfo(
            host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
    except socket.gaierror as exc:
        raise CannotListen(
            f"--host {host!r} does not resolve ({exc.strerror}); pass an address of this "
            "machine, e.g. 127.0.0.1 or 0.0.0.0 (--host / KVMETA_HOST)"
        ) from None
    sockets: list[socket.socket] = []
    seen: set[tuple[Any, ...]] = set()
    try:
        for family, kind, proto, _, addr in infos:
            if (family, addr) in seen:
                continue
            seen.add((family, addr))
            if port == 0 and sockets:  # the same free port on every address
                addr = (addr[0], sockets[0].getsockname()[1], *addr[2:])
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # past TIME_WAIT only
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                sock.bind(addr)
            except OSError as exc:
                raise _cannot_bind(host, int(addr[1]), exc) from None
            sock.listen(_BACKLOG)
            sock.setblocking(False)
    except BaseException:
        for sock in sockets:
            sock.close()
        raise
    return sockets


def _cannot_bind(host: str, port: int, exc: OSError) -> CannotListen:
    if exc.errno == errno.EADDRINUSE:
        return CannotListen(
            f"port {port} on {host} is already in use by another process (find it with "
            f"`ss -ltnp 'sport = :{port}'`); stop that process or pick another port with "
            "--port / KVMETA_PORT"
        )
    if exc.errno == errno.EACCES:
        return CannotListen(
            f"not allowed to listen on port {port} ({exc.strerror}): ports below 1024 need "
            "root or CAP_NET_BIND_SERVICE; pick another port with --port / KVMETA_PORT"
        )
    if exc.errno == errno.EADDRNOTAVAIL:
        return CannotListen(
            f"--host {host} is not an address of this machine ({exc.strerror}); pass one of "
            "its addresses, or 0.0.0.0 for all (--host / KVMETA_HOST)"
        )
    return CannotListen(f"cannot listen on {host} port {port}: {exc} (--host / --port)")
