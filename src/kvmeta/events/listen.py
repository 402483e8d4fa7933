"""Keeping the event sockets from using up the process's file descriptors, and from spinning
when they are used up.

Two libzmq behaviours make a flood of connections to ``--events`` dangerous. Its TCP listener
does not back off when ``accept`` fails: with no descriptor left (``EMFILE``) the pending
connection stays queued, the listener is woken again at once, and ZeroMQ's I/O thread takes a
whole core until a descriptor is freed. And binding while no
descriptor is left aborts the process (an assertion in its address resolver). Meanwhile the
journal and the HTTP server have no descriptor either (the HTTP server keeps a reserve from its
own connections, ``server.runner.connection_cap``; ZeroMQ's do not count against it).

So ``ListenGuard`` watches the socket's monitor: when an accepted connection leaves fewer than
``LOW`` descriptors free, or an accept failed, it stops listening (``unbind``, which also
closes the connections accepted there, freeing their descriptors), and listens again once
``HIGH`` are free, checked every ``PAUSE`` seconds: never binding short of descriptors.
Subscribers reconnect by themselves (ZeroMQ retries every 100 ms) and catch up by replay.
Linux only (the count is ``/proc/self/fd``); elsewhere the guard does nothing.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import resource

import zmq
from zmq.utils.monitor import parse_monitor_message

from kvmeta.events.reader import SocketReader

__all__ = ["HIGH", "LOW", "PAUSE", "ListenGuard", "free_descriptors"]

logger = logging.getLogger(__name__)

# Free descriptors below which the listener stops, and above which it listens again: half and
# three quarters of the reserve the HTTP server keeps (``server.runner._FD_RESERVE``).
LOW = 32
HIGH = 48
# Seconds between checks while not listening.
PAUSE = 1.0
# Seconds between looks at the monitor besides its wake-ups, and monitor events read per
# wake-up at most (``events.reader``).
_SAFETY_POLL = 0.5
_DRAIN = 256
_FD_DIR = "/proc/self/fd"
_EVENTS = zmq.EVENT_ACCEPTED | zmq.EVENT_ACCEPT_FAILED


def free_descriptors() -> int:
    """Descriptors this process may still open (0 when it cannot even list them)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        used = len(os.listdir(_FD_DIR))
    except OSError:
        return 0
    if soft == resource.RLIM_INFINITY:
        return 1 << 20
    return max(0, soft - used)


class ListenGuard:
    """Watches ``sock`` (bound at ``endpoint``, resolved: ``LAST_ENDPOINT``) on ``loop``."""

    def __init__(self, sock: zmq.Socket[bytes], endpoint: str, what: str) -> None:
        self.sock = sock
        self.endpoint = endpoint
        self.what = what
        self.pauses = 0  # times the listener was stopped
        self.listening = True
        self.enabled = os.path.isdir(_FD_DIR)
        self._monitor: zmq.Socket[bytes] | None = None
        self._reader: SocketReader | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._listen_timer: asyncio.TimerHandle | None = None

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        if not self.enabled:
            return
        self._loop = loop
        self._monitor = self.sock.get_monitor_socket(_EVENTS)
        # (a spinning listener makes failed accepts faster than they are read: a budget)
        self._reader = SocketReader(self._monitor, self._event, _SAFETY_POLL, _DRAIN)
        self._reader.start(loop)

    def _event(self, frames: list[bytes]) -> None:
        """A monitor event: stop listening when descriptors run short."""
        if not self.listening:
            return
        event = parse_monitor_message(frames)
        if event["event"] == zmq.EVENT_ACCEPT_FAILED:
            code = int(event["value"])
            self._pause(os.strerror(code), code)
            return
        free = free_descriptors()  # a connection was accepted
        if free < LOW:
            self._pause(f"{free} file descriptors left", errno.EMFILE)

    def _pause(self, why: str, code: int) -> None:
        try:
            self.sock.unbind(self.endpoint)
        except zmq.ZMQError as exc:  # pragma: no cover - an endpoint this guard bound
            logger.error("events: cannot stop listening on %s: %s", self.endpoint, exc)
            return
        self.listening = False
        self.pauses += 1
        hint = (
            " (the process is short of file descriptors: raise ulimit -n, or find what holds "
            "so many connections)"
            if code in (errno.EMFILE, errno.ENFILE)
            else ""
        )
        logger.warning(
            "events: not accepting connections on %s %s: %s%s; its subscribers were "
            "disconnected (they reconnect and catch up by replay); listening again once %d "
            "descriptors are free",
            self.what,
            self.endpoint,
            why,
            hint,
            HIGH,
        )
        assert self._loop is not None
        self._listen_timer = self._loop.call_later(PAUSE, self._listen)

    def _listen(self) -> None:
        assert self._loop is not None
        if free_descriptors() < HIGH:  # (libzmq aborts when a bind finds none)
            self._listen_timer = self._loop.call_later(PAUSE, self._listen)
            return
        try:
            self.sock.bind(self.endpoint)
        except zmq.ZMQError as exc:
            logger.warning(
                "events: cannot listen on %s %s again (%s); trying again in %.0f s",
                self.what,
                self.endpoint,
                exc,
                PAUSE,
            )
            self._listen_timer = self._loop.call_later(PAUSE, self._listen)
            return
        self.listening = True
        logger.info("events: listening on %s %s again", self.what, self.endpoint)

    def close(self) -> None:
        if self._listen_timer is not None:
            self._listen_timer.cancel()
        if self._reader is not None:
            self._reader.close()
        if self._monitor is not None:
            try:
                self.sock.disable_monitor()
            except zmq.ZMQError:
                pass
            self._monitor.close(0)
            self._monitor = None
