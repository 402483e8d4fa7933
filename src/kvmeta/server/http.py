"""A small HTTP/1.1 server: ``asyncio.Protocol`` + the ``httptools`` (llhttp) parser.

Why not uvicorn + ASGI: per request the HTTP layer is most of kvmeta's cost, and a bare
protocol costs clearly less server CPU than the same logic in a raw ASGI app on uvicorn (scope
dicts, receive/send messages, a Task per request; the measured numbers are in
benchmarks/README.md, "Serving stack"). What this server still guarantees:

- keep-alive and pipelining (responses leave in request order, even when a later request
  finishes first), chunked request bodies (httptools decodes them), ``Expect: 100-continue``;
- limits: request body size (413), header size (431), both checked while reading, so an
  oversize body or header is never buffered whole (the header budget is counted on the bytes
  fed to the parser, since httptools assembles a header value before handing it over);
- the request is checked (``head_check``: the token, then Host, Origin and Content-Type) as
  soon as the headers are in, before any body is read or ``100 Continue`` is sent: a client
  without the token, or a browser's forged request, never makes the server buffer a body, and
  routes served without the token take none (413 at the headers);
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

The parts: ``server.wire`` (requests, responses, limits, rendering), ``server.connection``
(one connection: transport, TLS, parsing, time limits), ``server.replies`` (reply order and
back-pressure), ``server.stepping`` (how a handler runs: its first step bare, a Task only when
it waits), ``server.conn_table`` (the connection cap and output budget). This module is the
listening server and re-exports the names the route layer imports.
"""

from __future__ import annotations

import asyncio
import errno
import socket
import ssl
import sys
from collections.abc import Callable
from typing import Any

from kvmeta.errors import CannotListen
from kvmeta.server.conn_table import ConnectionTable
from kvmeta.server.connection import HttpProtocol
from kvmeta.server.stepping import in_task
from kvmeta.server.wire import (
    EPOCH_HEADER,
    NO_STAMP,
    PUBLIC,
    Handler,
    HeadCheck,
    HttpLimits,
    PublicRoute,
    Request,
    Response,
    Stamp,
    render,
)

__all__ = [
    "EPOCH_HEADER",
    "NO_STAMP",
    "PUBLIC",
    "Handler",
    "HeadCheck",
    "HttpLimits",
    "HttpProtocol",
    "HttpServer",
    "PublicRoute",
    "Request",
    "Response",
    "Stamp",
    "bind_sockets",
    "in_task",
    "render",
]


class HttpServer:
    """Listens on one socket (or adopts one) and serves ``handler``."""

    def __init__(
        self,
        handler: Handler,
        limits: HttpLimits | None = None,
        loop: asyncio.AbstractEventLoop | None = None,
        head_check: HeadCheck | None = None,
        epoch: Callable[[], str] | None = None,
        refused: Callable[[Request, Response], None] | None = None,
    ) -> None:
        """``epoch``: the backend's epoch, read on every reply (it may change while serving)
        and sent as ``X-Kvmeta-Epoch``; the header bytes are rebuilt only when it changes.
        ``head_check``: see ``server.wire.HeadCheck``; ``refused(request, reply)`` is told
        of each request it refuses (the access log). A handler that needs
        ``asyncio.current_task()`` from its first line on is passed wrapped in ``in_task``."""
        self.handler = handler
        self.epoch = epoch
        self._stamp = NO_STAMP
        self.limits = limits or HttpLimits()
        self.loop = loop or asyncio.get_event_loop()
        self.head_check = head_check
        self.refused = refused
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
