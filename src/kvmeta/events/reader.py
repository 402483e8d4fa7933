"""Reading a ZeroMQ socket on the asyncio event loop (the replay socket, the sockets' monitors).

A ZeroMQ socket's file descriptor signals edges, not levels: it becomes readable when the
socket's state changes, and stays quiet while messages wait. So each wake-up reads until the
socket has nothing left (or ``budget`` messages: the rest on the next wake-up), and a
periodic look catches an edge that came while nobody was reading.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import zmq

__all__ = ["SocketReader"]


class SocketReader:
    """Calls ``handle`` with the frames of each message ``sock`` receives, on ``loop``."""

    def __init__(
        self,
        sock: zmq.Socket[bytes],
        handle: Callable[[list[bytes]], None],
        poll: float,
        budget: int = 1 << 30,
    ) -> None:
        self.sock = sock
        self.handle = handle
        self.poll = poll  # seconds between periodic looks
        self.budget = budget
        self._fd = int(sock.getsockopt(zmq.FD))
        self._loop: asyncio.AbstractEventLoop | None = None
        self._timer: asyncio.TimerHandle | None = None

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        loop.add_reader(self._fd, self.read)
        self._tick()

    def _tick(self) -> None:
        self.read()
        assert self._loop is not None
        self._timer = self._loop.call_later(self.poll, self._tick)

    def read(self) -> None:
        """Hand over what the socket holds (at most ``budget`` messages)."""
        sock = self.sock
        for _ in range(self.budget):
            if sock.closed or not int(sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
                return
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self.handle(frames)

    def close(self) -> None:
        """Stop reading (the socket stays open: its owner closes it)."""
        if self._timer is not None:
            self._timer.cancel()
        if self._loop is not None:
            try:
                self._loop.remove_reader(self._fd)
            except (OSError, ValueError):
                pass
