"""The HTTP server's open connections, and which of them give way when there are too many or
they hold too much unsent output.

Two floods are answered here rather than per connection. Connections that never show a token
(silent sockets, half-sent requests, TLS handshakes never finished, token-less probes) may fill
only half of the connection cap, and the oldest of them make room for new ones, so they can
neither take the descriptors the journal needs nor lock the engines out: an authenticated
connection is never closed to make room. Replies their clients do not read are bounded per
connection by pausing it (``server.replies``), and all together here: past the server's budget the
connections holding the most are closed, since only closing frees what they hold.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Generic, Protocol, TypeVar

__all__ = ["Connection", "ConnectionTable"]

logger = logging.getLogger("kvmeta.server.http")

_WARN_EVERY = 10.0  # seconds between two warnings of one kind (refused, made room, shed)


class Connection(Protocol):
    """What the table needs of a connection (``server.connection.HttpProtocol``)."""

    unsent: int  # its unsent output, as last counted

    def abort(self) -> None:
        """Close at once, unanswered, and leave the table."""

    def recount(self) -> None:
        """Count ``unsent`` again (it only shrinks between writes, unseen)."""


C = TypeVar("C", bound=Connection)


class ConnectionTable(Generic[C]):
    """Open connections (``open``), those that have not passed the token check yet
    (``token_less``, oldest first) and their unsent output (``unsent``, as last counted)."""

    def __init__(
        self, loop: asyncio.AbstractEventLoop, max_connections: int, max_unsent: int
    ) -> None:
        self.max_connections = max_connections
        self.max_token_less = max(1, max_connections // 2)
        self.max_unsent = max_unsent
        self.open: set[C] = set()
        self.token_less: dict[C, None] = {}
        self.unsent = 0
        self.refused = 0  # connections closed at once because of the cap, ever
        self.made_room = 0  # token-less connections closed to make room, ever
        self.shed = 0  # connections closed for holding the most unsent output, ever
        self._refusals = _Warning(loop)
        self._room = _Warning(loop)
        self._sheds = _Warning(loop)

    def admit(self, conn: C) -> bool:
        """Take a just-accepted connection (token-less until ``authenticated``), or say no:
        beyond the token-less share or the cap the oldest token-less connection is closed to
        make room; with none left to close, the cap refuses the newcomer."""
        full = len(self.open) >= self.max_connections
        if full or len(self.token_less) >= self.max_token_less:
            oldest = next(iter(self.token_less), None)
            if oldest is not None:
                oldest.abort()
                self.made_room += 1
                self._room.note(
                    "closed %d connection(s) that had sent no request with a valid token, to "
                    "make room for new ones: at most %d of --max-connections %d may be such "
                    "connections (half); find the clients opening connections without the token",
                    self.max_token_less,
                    self.max_connections,
                )
                full = len(self.open) >= self.max_connections
        if full:
            self.refused += 1
            self._refusals.note(
                "refused %d new connection(s): %d connections are open, the limit "
                "(--max-connections, lowered to fit ulimit -n) is %d; raise --max-connections "
                "(and the open-file limit) or find the clients holding connections open",
                len(self.open),
                self.max_connections,
            )
            return False
        self.open.add(conn)
        self.token_less[conn] = None
        return True

    def authenticated(self, conn: C) -> None:
        """A request with a valid token came on ``conn``: it no longer gives way."""
        self.token_less.pop(conn, None)

    def remove(self, conn: C) -> None:
        """``conn`` is gone (idempotent)."""
        self.open.discard(conn)
        self.token_less.pop(conn, None)
        self.unsent -= conn.unsent
        conn.unsent = 0

    def unsent_changed(self, conn: C, size: int) -> None:
        """``conn`` now holds ``size`` bytes of unsent output; past the budget, shed."""
        grown = size - conn.unsent
        conn.unsent = size
        self.unsent += grown
        if grown > 0 and self.unsent > self.max_unsent:
            self.shed_hoarders()

    def shed_hoarders(self) -> None:
        """Close the connections holding the most unsent output until all of it fits the
        budget (clients that do not read: each one's own budget stops it short of that)."""
        conns = list(self.open)
        for conn in conns:  # drained since last counted?
            conn.recount()
        if self.unsent <= self.max_unsent:
            return
        conns.sort(key=lambda c: c.unsent, reverse=True)
        for conn in conns:
            if self.unsent <= self.max_unsent or not conn.unsent:
                break
            conn.abort()
            self.shed += 1
            self._sheds.note(
                "closed %d connection(s) holding the most unsent replies: all connections "
                "together held more than %d MiB their clients did not read (clients that "
                "pipeline requests, or fetch large replies, without reading them)",
                self.max_unsent >> 20,
            )


class _Warning:
    """A warning logged at most every ``_WARN_EVERY`` seconds, with the count of events."""

    __slots__ = ("loop", "unlogged", "warned_at")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.unlogged = 0
        self.warned_at = float("-inf")

    def note(self, message: str, *args: Any) -> None:
        """Count one event; log ``message % (count, *args)`` unless logged recently."""
        self.unlogged += 1
        now = self.loop.time()
        if now - self.warned_at >= _WARN_EVERY:
            logger.warning(message, self.unlogged, *args)
            self.warned_at = now
            self.unlogged = 0
