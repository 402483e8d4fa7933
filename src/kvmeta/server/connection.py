"""One client connection: the transport events, the TLS handshake, the parser (``httptools``,
llhttp) and its callbacks, and the time limits (``sweep``).

Why the header stage matters here: ``on_headers_complete`` hands the request, still without
its body, to the server's ``head_check`` (``App.head_check``: the token, then Host, Origin and
Content-Type), so a refused request is answered before its body is read or ``100 Continue``
is sent, and the connection is closed behind the refusal. The reply side (order,
back-pressure, lingering close) is ``server.replies``.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from typing import TYPE_CHECKING, Any

import httptools

from kvmeta.server.replies import ReplyQueue
from kvmeta.server.stepping import run_now
from kvmeta.server.wire import PublicRoute, Request, render

if TYPE_CHECKING:
    from kvmeta.server.http import HttpServer

__all__ = ["HttpProtocol"]

logger = logging.getLogger("kvmeta.server.http")

_UPGRADE = (
    "Protocol upgrades (Upgrade with Connection: upgrade, or CONNECT) are not supported and the "
    "request was not run; send plain HTTP/1.1 requests without those headers"
)


class _Refused(Exception):
    """Raised inside a parser callback after the refusal was already answered: stop parsing."""


class _Reject(Exception):
    """Raised inside a parser callback to answer with an error and close the connection."""

    def __init__(self, status: int, detail: str) -> None:
        super().__init__(detail)
        self.status = status
        self.detail = detail


class HttpProtocol(ReplyQueue, asyncio.Protocol):
    """One client connection."""

    def __init__(self, server: HttpServer) -> None:
        self.server = server
        self.handler = server.handler
        self.limits = server.limits
        self.loop = server.loop
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self._init_replies()
        self._request = Request("", "", "", b"", None)  # the message being read
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
        self._handshake = run_now(self.loop, self._start_tls(transport, server.tls))

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
        url = self._url
        qpos = url.find(b"?")
        if qpos >= 0:
            path, query = url[:qpos], url[qpos + 1 :]
        else:
            path, query = url, b""
        self._request = request = Request(
            parser.get_method().decode("latin-1"),
            path.decode("latin-1"),
            query.decode("latin-1"),
            b"",
            self._auth,
            self._peer,
            self._host,
            self._origin,
            self._content_type,
        )
        check = self.server.head_check
        verdict = None if check is None else check(request)
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
            if self.server.refused is not None:
                self.server.refused(request, verdict)
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
        keep_alive = self.parser.should_keep_alive()
        request = self._request
        request.body = self._body[0] if len(self._body) == 1 else b"".join(self._body)
        if self._queued or self._blocked():
            self._queued.append((request, keep_alive))  # started once the output drains
            return
        self._start(request, keep_alive)

    # -------------------------------------------------------------- requests and responses

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
