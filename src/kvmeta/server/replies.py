"""The output side of a connection: replies leave in request order, and a connection that
does not read them is not read either.

Why it is apart from the parsing (``server.connection``): the order and back-pressure rules
are one job with their own state (replies owed, requests waiting to start, bytes not parsed
yet), and they are what a change to pipelining must get right. The rules:

- responses leave in request order, even when a later request finishes first: a reply waits
  in ``_pending`` behind the Tasks of earlier requests;
- a connection whose unsent replies exceed ``max_output_bytes`` (the transport's
  ``pause_writing``), or that has ``MAX_PIPELINED`` requests in flight, is not read, and the
  requests it already sent wait in ``_queued`` before they start (``_drain`` starts them once
  the output drains); its unsent bytes are counted into the server's total
  (``ConnectionTable``), which sheds the connections holding the most beyond
  ``max_total_output_bytes``;
- after an error reply the connection is half-closed and lingers, so a client busy sending a
  refused body reads the reply instead of a reset.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from typing import TYPE_CHECKING, Any

from kvmeta.server.stepping import finish, task_reply
from kvmeta.server.wire import Handler, HttpLimits, Request, Response, error_body, render

if TYPE_CHECKING:
    from kvmeta.server.http import HttpServer

__all__ = ["MAX_PIPELINED", "ReplyQueue"]

logger = logging.getLogger("kvmeta.server.http")

MAX_PIPELINED = 64

# After an error reply the connection is half-closed and what the peer still sends is read and
# dropped for this long, so it sees the reply instead of a reset; then it is closed.
_LINGER_SECONDS = 2.0


class ReplyQueue:
    """The reply half of ``HttpProtocol`` (a base class: one object per connection)."""

    server: HttpServer
    handler: Handler
    limits: HttpLimits
    loop: asyncio.AbstractEventLoop
    transport: asyncio.Transport | None
    unsent: int
    _since: float
    _served: int
    _in_message: bool
    _closing: bool
    _lingering: bool
    _handshaking: bool
    _reading_paused: bool
    _writing_paused: bool
    _stuck_since: float

    def _init_replies(self) -> None:
        self._pending: deque[list[Any]] = deque()  # [response bytes | Task, keep_alive]
        # Requests parsed while the connection was over its output budget, not started yet
        # (or the final error reply owed after them), and the bytes received but not parsed.
        self._queued: deque[tuple[Request | bytes, bool]] = deque()
        self._unparsed = b""
        self._draining = False

    def _feed(self, data: bytes) -> None:
        raise NotImplementedError  # the parsing half (``HttpProtocol``)

    def pause_writing(self) -> None:
        self._writing_paused = True
        self._update_reading()

    def resume_writing(self) -> None:
        self._writing_paused = False
        self._stuck_since = -1.0  # the client reads
        self.recount()
        self._drain()

    def _blocked(self) -> bool:
        """Whether a parsed request must wait before it starts: the client does not read the
        replies it has (``pause_writing``), or too many are in flight."""
        return self._writing_paused or len(self._pending) >= MAX_PIPELINED

    def _start(self, item: Request | bytes, keep_alive: bool) -> None:
        if isinstance(item, bytes):  # the final error reply, queued behind the requests
            self._respond(item, keep_alive)
            return
        request = item
        coro = self.handler(request)
        try:  # the first step, bare (``server.stepping``)
            yielded = coro.send(None)
        except StopIteration as stop:
            self._respond(render(stop.value, keep_alive, self.server.stamp()), keep_alive)
            return
        except Exception:
            logger.exception(
                "Unhandled error in request handler for %s %s", request.method, request.path
            )
            error = Response(500, error_body("Internal server error"))
            self._respond(render(error, False, self.server.stamp()), False)
            return
        task = self.loop.create_task(finish(coro, yielded))
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
            # (``self`` is the whole ``HttpProtocol``: this class is its reply half)
            self.server.conns.unsent_changed(self, size)  # type: ignore[arg-type]

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
                data, keep_alive = task_reply(item, keep_alive, self.server.stamp())
            else:
                data = item
            pending.popleft()
            self._write(data, keep_alive)
            if not keep_alive or self.transport is None:
                return  # the last reply on this connection is out
        self._update_reading()

    def _reject(self, status: int, detail: str) -> None:
        self._final(render(Response(status, error_body(detail)), False, self.server.stamp()))

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
            or len(self._pending) >= MAX_PIPELINED
            or bool(self._queued)
            or bool(self._unparsed)
        )
        if should_pause and not self._reading_paused:
            self._reading_paused = True
            transport.pause_reading()
        elif not should_pause and self._reading_paused:
            self._reading_paused = False
            transport.resume_reading()
