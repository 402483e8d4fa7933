"""One connection to a Redis node carrying many calls at once, their replies matched in order.

A worker on Redis pays one round trip per request; how much CPU the round trip costs decides
how close it gets to the embedded server. redis-py's asyncio connection reads through a
``StreamReader`` (a future, a buffer copy and a task wake-up per read) and needs a connection
per concurrent call. A ``Link`` is an ``asyncio.Protocol`` instead: a call is a future, and
the calls made during one pass of the event loop go out in one write; ``data_received`` feeds
the bytes to hiredis and hands each complete reply to the oldest waiting call, as Redis
answers every connection's commands in the order sent (CPU per round trip: benchmarks/README.md,
"Implementation costs").

redis-py still opens the connection (``open_link``): address, TLS, AUTH, database and client
name are its code, then the socket's transport is handed to the ``Link``.

A call that gives up (cancelled, or its task timed out) leaves its place in the queue; the
reply that comes later is read and dropped, so the connection stays in step. A node that stops
answering fails every call waiting on the link after ``read_timeout`` (the link closes, the
callers retry elsewhere or later: every kvmeta operation is idempotent).
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from typing import Any

import hiredis
from redis.asyncio.connection import AbstractConnection
from redis.exceptions import (
    AskError,
    AuthenticationError,
    BusyLoadingError,
    ClusterCrossSlotError,
    ClusterDownError,
    ConnectionError,
    ExecAbortError,
    InvalidResponse,
    MasterDownError,
    MovedError,
    NoPermissionError,
    NoScriptError,
    OutOfMemoryError,
    ReadOnlyError,
    RedisError,
    ResponseError,
    TimeoutError,
    TryAgainError,
)

__all__ = ["Link", "open_link", "reply_error"]

# Error replies by their first word, as redis-py names them (the word is not in the message).
_ERRORS: dict[str, type[RedisError]] = {
    "ASK": AskError,
    "MOVED": MovedError,
    "TRYAGAIN": TryAgainError,
    "CLUSTERDOWN": ClusterDownError,
    "MASTERDOWN": MasterDownError,
    "CROSSSLOT": ClusterCrossSlotError,
    "LOADING": BusyLoadingError,
    "NOSCRIPT": NoScriptError,
    "READONLY": ReadOnlyError,
    "NOAUTH": AuthenticationError,
    "WRONGPASS": AuthenticationError,
    "NOPERM": NoPermissionError,
    "OOM": OutOfMemoryError,
    "EXECABORT": ExecAbortError,
}
# Generic ``ERR`` replies redis-py raises as another class.
_ERR_ERRORS: dict[str, type[RedisError]] = {
    "max number of clients reached": ConnectionError,
    "invalid password": AuthenticationError,
}
_NOTHING = object()  # hiredis: no complete reply buffered yet
# A RESP3 push message (redis-py asks for RESP3 when it has it): out-of-band, never a reply to
# a call. kvmeta turns on nothing that pushes; one arriving anyway must not be taken as one.
_PUSH = getattr(hiredis, "PushNotification", None)


def reply_error(text: str) -> RedisError:
    """An error reply as the exception redis-py would raise for it: ``MOVED 12 h:p`` ->
    ``MovedError("12 h:p")``, ``ERR text`` -> ``ResponseError("text")``; a first word it has
    no class for stays in the message."""
    word, _, rest = text.partition(" ")
    if word == "ERR":
        return _ERR_ERRORS.get(rest, ResponseError)(rest)
    kind = _ERRORS.get(word)
    if kind is None:
        return ResponseError(text)
    return kind(rest)


class _Call:
    __slots__ = ("future", "n", "replies", "blocking", "sent")

    def __init__(
        self, future: asyncio.Future[list[Any]], n: int, blocking: bool, sent: float
    ) -> None:
        self.future = future
        self.n = n
        self.replies: list[Any] = []
        self.blocking = blocking
        self.sent = sent


class Link(asyncio.Protocol):
    """The protocol of one open connection (``open_link`` makes it)."""

    def __init__(self, addr: str, read_timeout: float, loop: asyncio.AbstractEventLoop) -> None:
        self.addr = addr
        self.read_timeout = read_timeout
        self.loop = loop
        self.transport: asyncio.WriteTransport | None = None
        self.waiting: deque[_Call] = deque()
        # Calls in flight whose last command is a WAIT/WAITAOF: Redis serves nothing else on
        # this connection until the replicas answer, so new calls go to another link.
        self.blocking = 0
        self.closed = False
        self.on_close: Callable[[Link], None] | None = None  # called once, when it closes
        self.writer: asyncio.StreamWriter | None = None  # (see ``open_link``)
        self._reader = hiredis.Reader(
            protocolError=InvalidResponse, replyError=reply_error, notEnoughData=_NOTHING
        )
        self._timer: asyncio.TimerHandle | None = None
        self._out: list[bytes] = []  # payloads of this loop pass, not yet written

    def send(
        self, payload: bytes, replies: int, blocking: bool = False
    ) -> asyncio.Future[list[Any]]:
        """Queue ``payload`` (``replies`` commands) for this loop pass's write; the future gets
        their replies in order, error replies as exception objects (not raised), or fails if
        the link closes first."""
        if self.closed or self.transport is None:
            raise ConnectionError(f"connection to Redis {self.addr} is closed")
        future: asyncio.Future[list[Any]] = self.loop.create_future()
        self.waiting.append(_Call(future, replies, blocking, self.loop.time()))
        if blocking:
            self.blocking += 1
        out = self._out
        out.append(payload)
        if len(out) == 1:
            self.loop.call_soon(self._flush)
        if self._timer is None:
            self._timer = self.loop.call_later(self.read_timeout, self._check)
        return future

    def _flush(self) -> None:
        """Write what the calls of this loop pass queued, in one send: less worker and
        redis-server CPU per request than a write per call (benchmarks/README.md,
        "Implementation costs")."""
        out = self._out
        if self.transport is not None and not self.closed and out:
            self.transport.write(out[0] if len(out) == 1 else b"".join(out))
        self._out = []

    # ------------------------------------------------------------------ asyncio.Protocol

    def connection_lost(self, exc: Exception | None) -> None:
        why = f": {exc}" if exc else " (closed by the server)"
        self.close(ConnectionError(f"connection to Redis {self.addr} lost{why}"))

    def data_received(self, data: bytes) -> None:
        reader = self._reader
        reader.feed(data)
        waiting = self.waiting
        while True:
            try:
                reply = reader.gets()
            except InvalidResponse as exc:
                self.close(ConnectionError(f"Redis {self.addr} sent a malformed reply: {exc}"))
                return
            if reply is _NOTHING:
                return
            if _PUSH is not None and type(reply) is _PUSH:
                continue
            if not waiting:
                self.close(ConnectionError(f"Redis {self.addr} sent a reply nobody asked for"))
                return
            call = waiting[0]
            call.replies.append(reply)
            if len(call.replies) < call.n:
                continue
            waiting.popleft()
            if call.blocking:
                self.blocking -= 1
            if not call.future.done():  # (a caller that gave up: its reply is dropped)
                call.future.set_result(call.replies)

    def eof_received(self) -> bool:
        return False  # close the transport: connection_lost follows

    # ------------------------------------------------------------------ closing

    def _check(self) -> None:
        """Fail the link if its oldest call has waited ``read_timeout``; else look again when
        it will have (one timer per link, not one per call)."""
        self._timer = None
        if self.closed or not self.waiting:
            return
        due = self.waiting[0].sent + self.read_timeout - self.loop.time()
        if due <= 0:
            self.close(
                TimeoutError(f"Redis {self.addr} did not answer within {self.read_timeout:g}s")
            )
            return
        self._timer = self.loop.call_later(due, self._check)

    def close(self, exc: Exception | None = None) -> None:
        """Close the connection; every call still waiting fails with ``exc``."""
        if self.closed:
            return
        self.closed = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        error = exc or ConnectionError(f"connection to Redis {self.addr} closed")
        waiting, self.waiting = self.waiting, deque()
        self.blocking = 0
        for call in waiting:
            if not call.future.done():
                call.future.set_exception(error)
        if self.transport is not None:
            self.transport.close()
        if self.on_close is not None:
            self.on_close(self)


async def open_link(conn: AbstractConnection, addr: str, read_timeout: float) -> Link:
    """Connect ``conn`` (redis-py: socket, TLS, AUTH, SELECT, CLIENT SETNAME), then move its
    transport to a new ``Link``; ``conn`` is left unconnected."""
    await conn.connect()  # type: ignore[no-untyped-call]
    reader, writer = getattr(conn, "_reader", None), getattr(conn, "_writer", None)
    if not isinstance(reader, asyncio.StreamReader) or not isinstance(writer, asyncio.StreamWriter):
        await conn.disconnect(nowait=True)
        raise ConnectionError(
            "this redis-py version keeps its asyncio connection differently than kvmeta "
            "expects; install the redis version kvmeta's requirements name"
        )
    if getattr(reader, "_buffer", b""):  # pragma: no cover - Redis sends nothing unasked
        await conn.disconnect(nowait=True)
        raise ConnectionError(f"Redis {addr} sent data before any command")
    # redis-py forgets the streams (its finaliser would close the socket); the link owns it.
    conn._reader = conn._writer = None
    link = Link(addr, read_timeout, asyncio.get_running_loop())
    # The writer lives as long as the link: asyncio's StreamWriter closes its transport (and
    # warns) when it is collected with the transport still open.
    link.writer = writer
    transport = writer.transport
    link.transport = transport
    transport.set_protocol(link)
    return link
