"""Where a Redis key lives: one endpoint, a Cluster's slot map, or the primary a Sentinel group
names; and which failures are worth a retry.

Each node keeps its own links (``store.redis.link``): a request costs one packed write and
its reply, with no client object, pool or lock in between, and concurrent requests share a
connection. A topology answers ``route(key)`` from memory; ``refresh()``
re-learns it after a failure (a Cluster's slot map from any reachable node, a Sentinel group's
primary by majority), and the caller retries until its failover deadline.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import sys
from collections.abc import Callable
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.connection import AbstractConnection
from redis.crc import REDIS_CLUSTER_HASH_SLOTS, key_slot
from redis.exceptions import (
    BusyLoadingError,
    ClusterDownError,
    ConnectionError,
    ReadOnlyError,
    RedisError,
    TimeoutError,
    TryAgainError,
)

from kvmeta.errors import BackendUnavailable
from kvmeta.store.redis.link import Link, open_link
from kvmeta.store.redis.resp import pack
from kvmeta.store.redis.sentinel import resolve_primary, watch_switches
from kvmeta.store.redis.url import RESP, RedisTarget

__all__ = [
    "ClusterTopology",
    "Node",
    "SentinelTopology",
    "SingleTopology",
    "Topology",
    "deadline",
    "retriable",
]

logger = logging.getLogger("kvmeta.store.redis.backend")

MAX_LINKS = 64  # connections per node and server process (see ``Node``)
# Connection timeouts unless the URL sets its own (?socket_timeout=...): a node that stops
# answering (partitioned, frozen) must fail a call so it can be retried elsewhere, not hang it.
CONNECT_TIMEOUT = 1.0
READ_TIMEOUT = 2.0

if sys.version_info >= (3, 11):
    from asyncio import timeout as deadline
else:  # redis-py depends on async-timeout before Python 3.11
    from async_timeout import timeout as deadline


def retriable(exc: BaseException) -> bool:
    """A failure a failover or a slot move explains: retry after re-learning the topology.
    (``MOVED``/``ASK`` are handled apart, without waiting.)"""
    if isinstance(exc, (TryAgainError, ClusterDownError, ReadOnlyError, BusyLoadingError)):
        return True  # ClusterDownError includes MASTERDOWN
    if isinstance(exc, (ConnectionError, TimeoutError, OSError, asyncio.TimeoutError)):
        return True
    text = str(exc)
    # NOREPLICAS: a primary with min-replicas-to-write refuses writes while its replicas are
    # away, as a newly promoted one may for a moment.
    return text.startswith(("READONLY", "UNBLOCKED", "MASTERDOWN", "CLUSTERDOWN", "NOREPLICAS"))


class Node:
    """One Redis node and this process's links to it (``store.redis.link``).

    Calls share a link: each is one write, and the replies come back in order. Only a call
    that ends with a WAIT holds its link alone until the replicas answer (Redis serves nothing
    else on that connection meanwhile), so concurrent acknowledged writes open more links, up
    to ``MAX_LINKS``; afterwards calls queue on the least busy one.
    """

    def __init__(self, target: RedisTarget, host: str, port: int, *, read_timeout: float) -> None:
        self.host, self.port = host, port
        self.addr = f"{host}:{port}" if target.mode != "single" else target.shown
        # redis-py only opens connections (URL, auth, TLS, db); calls go through ``Link``s.
        # A ?socket_timeout= in the URL bounds each call as read_timeout does.
        self._pool = aioredis.ConnectionPool.from_url(
            target.node_url(host, port), socket_connect_timeout=CONNECT_TIMEOUT, protocol=RESP
        )
        self.read_timeout: float = (
            self._pool.connection_kwargs.get("socket_timeout") or read_timeout
        )
        self.links: list[Link] = []
        self._opening: asyncio.Future[Link] | None = None  # the first link, while it opens
        self._connecting = 0
        self.closed = False
        # Called with this node each time a link to it opens: a new connection may reach a
        # node that restarted, or one just promoted (the backend re-reads what it relies on).
        self.on_link: Callable[[Node], None] | None = None

    def connect(self) -> AbstractConnection:
        """A redis-py connection to this node, not yet connected."""
        if self.closed:
            raise BackendUnavailable(f"the Redis backend's connections to {self.addr} are closed")
        kwargs = dict(self._pool.connection_kwargs)
        kwargs.pop("socket_timeout", None)  # (each call is bounded by its link instead)
        return self._pool.connection_class(**kwargs)

    async def request(self, payload: bytes, replies: int, blocking: bool = False) -> list[Any]:
        """Send ``payload`` (``replies`` commands packed by ``store.redis.resp``) and return their
        replies, error replies as exception objects. ``blocking``: it ends with a WAIT."""
        for link in self.links:
            if not link.blocking:
                break
        else:
            link = await self._another()
        return await link.send(payload, replies, blocking)

    async def _another(self) -> Link:
        """A new link, or the least busy one when ``MAX_LINKS`` are open. Calls that find no
        link at all share the one being opened (a burst at start-up opens one, not many)."""
        if self.links:
            if self._connecting + len(self.links) >= MAX_LINKS:
                return min(self.links, key=lambda link: len(link.waiting))
            return await self._open()  # every link is held by a WAIT: one more
        if self._opening is None:
            self._opening = asyncio.ensure_future(self._open())
            self._opening.add_done_callback(self._opened)
        return await asyncio.shield(self._opening)

    def _opened(self, opening: asyncio.Future[Link]) -> None:
        self._opening = None
        if not opening.cancelled():
            opening.exception()  # (read, so a failure every waiter gave up on is not logged)

    async def _open(self) -> Link:
        conn = self.connect()
        self._connecting += 1
        try:
            async with deadline(self.read_timeout):
                link = await open_link(conn, self.addr, self.read_timeout)
        except BaseException:
            await conn.disconnect(nowait=True)
            raise
        finally:
            self._connecting -= 1
        if self.closed:
            link.close()
            raise BackendUnavailable(f"the Redis backend's connections to {self.addr} are closed")
        link.on_close = self._forget
        self.links.append(link)
        if self.on_link is not None:
            self.on_link(self)
        return link

    def _forget(self, link: Link) -> None:
        if link in self.links:
            self.links.remove(link)

    async def drop(self) -> None:
        """Close every link (the node failed, or it is no longer a primary): calls in flight
        on them fail with ConnectionError and are retried by their callers."""
        links, self.links = self.links, []
        for link in links:
            link.close(ConnectionError(f"connections to Redis {self.addr} dropped"))

    async def close(self) -> None:
        """Close every link of this node and make no new ones: a call still in flight fails
        instead of leaving a socket open."""
        self.closed = True
        await self.drop()
        opening = self._opening
        if opening is not None:
            opening.cancel()
            await asyncio.gather(opening, return_exceptions=True)

    async def call(self, *args: Any) -> Any:
        """One plain command on this node (an error reply is raised)."""
        (reply,) = await self.request(pack(args), 1)
        if isinstance(reply, Exception):
            raise reply
        return reply


class Topology:
    """The single endpoint: every key on one node."""

    mode = "single"

    def __init__(self, target: RedisTarget, *, read_timeout: float = READ_TIMEOUT) -> None:
        self.target = target
        self.read_timeout = read_timeout
        self._nodes: dict[tuple[str, int], Node] = {}
        self.last_error = ""  # why the last refresh found no primary, for the 503 message
        self.closed = False
        self._refreshing: asyncio.Task[None] | None = None  # a refresh running in the background
        self.on_link: Callable[[Node], None] | None = None  # given to every node (``Node``)

    def node(self, host: str, port: int) -> Node:
        found = self._nodes.get((host, port))
        if found is None:
            if self.closed:
                raise BackendUnavailable(f"the Redis backend for {self.target.shown} is closed")
            found = self._nodes[(host, port)] = Node(
                self.target, host, port, read_timeout=self.read_timeout
            )
            found.on_link = self.on_link
        return found

    def route(self, key: str) -> Node:
        return self._single or self._first()

    _single: Node | None = None

    def _first(self) -> Node:
        self._single = self.node("", 0)
        return self._single

    def primaries(self) -> list[Node]:
        return [self.route("")]

    async def start(self) -> None:
        """Learn the topology once; errors propagate to the caller's start-up message."""

    async def refresh(self, raise_errors: bool = False) -> None:
        """Re-learn where the primaries are after a failure (the links of a failed node are
        dropped by the caller). Every call failing at once shares one round (one task,
        ``_refresh``): each would otherwise ask every node or Sentinel on its own, and a round
        that began before a newer one could finish after it and overwrite its answer with an
        older one. ``raise_errors``: a round of the caller's own that raises BackendUnavailable
        when it finds nothing (start-up)."""
        if raise_errors:
            await self._refresh(raise_errors=True)
            return
        if self.closed:
            return
        task = self._refresh_soon()
        try:
            await asyncio.shield(task)  # a caller that gives up does not cancel the others'
        except asyncio.CancelledError:
            if not (self.closed and task.cancelled()):
                raise  # the caller itself was cancelled

    def _refresh_soon(self) -> asyncio.Task[None]:
        """The round running now, or a new one."""
        task = self._refreshing
        if task is None or task.done():
            task = self._refreshing = asyncio.get_running_loop().create_task(self._refresh())
        return task

    async def _refresh(self, raise_errors: bool = False) -> None:
        """One round of re-learning the topology (the single endpoint has nothing to learn)."""

    def moved(self, slot: int, host: str, port: int) -> Node:
        return self.node(host, port)

    async def recheck(self, node: Node) -> bool:
        """A write on ``node`` answered but too few replicas acknowledged it: is ``node`` still
        a primary? True if re-learning the topology found another one for its keys (the
        caller runs the write again there). A primary that stalled and came back after a
        failover still says ``ROLE master`` and answers every command, so no connection error
        would ever move the caller off it; its replicas left it, which is the only sign."""
        return False

    def coverage(self) -> str | None:
        """Why the topology cannot serve every key (None: it can)."""
        return None

    async def close(self) -> None:
        """Close every node's connections; afterwards no node, refresh or connection is made
        (a call still running gets BackendUnavailable). A background refresh is stopped and
        awaited first: its calls hold connections, which it would otherwise hand back after."""
        self.closed = True
        refreshing, self._refreshing = self._refreshing, None
        if refreshing is not None:
            refreshing.cancel()
            await asyncio.gather(refreshing, return_exceptions=True)
        for node in list(self._nodes.values()):
            await node.close()
        self._nodes.clear()
        self._single = None


@functools.lru_cache(maxsize=8192)
def _slot(key: str) -> int:
    return int(key_slot(key.encode()))


SingleTopology = Topology


class ClusterTopology(Topology):
    """A Redis Cluster: the slot of a call is ``key_slot(keys[0])`` (a pool's keys share a hash
    tag), its node comes from the slot map learnt with ``CLUSTER SLOTS``."""

    mode = "cluster"

    def __init__(self, target: RedisTarget, *, read_timeout: float = READ_TIMEOUT) -> None:
        super().__init__(target, read_timeout=read_timeout)
        self._slots: list[Node | None] = [None] * REDIS_CLUSTER_HASH_SLOTS

    def route(self, key: str) -> Node:
        node = self._slots[_slot(key)]
        if node is None:
            raise ClusterDownError(f"CLUSTERDOWN slot {_slot(key)} has no primary known")
        return node

    def primaries(self) -> list[Node]:
        seen: dict[int, Node] = {}
        for node in self._slots:
            if node is not None:
                seen.setdefault(id(node), node)
        return list(seen.values())

    async def start(self) -> None:
        await self._refresh(raise_errors=True)

    async def _refresh(self, raise_errors: bool = False) -> None:
        """Read the slot map from the first node that answers, asking every known node and
        seed at once: a frozen or partitioned node must not make the others wait."""
        if self.closed:
            return
        candidates = [*self.primaries(), *(self.node(h, p) for h, p in self.target.hosts)]
        candidates += [n for n in self._nodes.values() if n not in candidates]

        async def ask(node: Node) -> tuple[Node, Any]:
            try:
                reply = await asyncio.wait_for(node.call("CLUSTER", "SLOTS"), CONNECT_TIMEOUT * 2)
            except (RedisError, OSError, asyncio.TimeoutError) as exc:
                raise ConnectionError(f"{node.addr}: {exc or type(exc).__name__}") from exc
            return node, reply

        tasks = [asyncio.ensure_future(ask(node)) for node in candidates]
        errors = []
        try:
            for next_done in asyncio.as_completed(tasks):
                try:
                    node, reply = await next_done
                except ConnectionError as exc:
                    errors.append(str(exc))
                    continue
                if self.closed:
                    return
                self._apply(node, reply)
                self.last_error = ""
                return
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        self.last_error = "no Cluster node answered CLUSTER SLOTS: " + "; ".join(errors)
        if raise_errors:
            raise BackendUnavailable(f"{self.last_error} (seeds {self.target.shown})")

    def _apply(self, asked: Node, reply: list[Any]) -> None:
        slots: list[Node | None] = [None] * REDIS_CLUSTER_HASH_SLOTS
        for entry in reply:
            start, end, primary = int(entry[0]), int(entry[1]), entry[2]
            host = primary[0].decode() if isinstance(primary[0], bytes) else str(primary[0])
            if host in ("", "?"):
                host = asked.host  # the node did not announce an address: the one we asked
            node = self.node(host, int(primary[1]))
            slots[start : end + 1] = [node] * (end - start + 1)
        self._slots = slots

    def moved(self, slot: int, host: str, port: int) -> Node:
        """A ``MOVED`` reply: use the new owner for that slot now, and re-read the whole map
        in the background (a failover or resharding moves many slots at once)."""
        node = self.node(host, port)
        self._slots[slot] = node
        if not self.closed:
            self._refresh_soon()
        return node

    async def recheck(self, node: Node) -> bool:
        await self.refresh()
        return node not in self.primaries() and bool(self.primaries())

    def coverage(self) -> str | None:
        missing = sum(node is None for node in self._slots)
        return f"{missing} of 16384 slots have no primary" if missing else None


class SentinelTopology(Topology):
    """A primary and its replicas watched by Sentinels: every key on the primary a majority of
    the configured Sentinels name, checked with ``ROLE`` before use; asked again when a call
    fails and whenever a Sentinel announces a switch (``watch_switches``)."""

    mode = "sentinel"

    def __init__(self, target: RedisTarget, *, read_timeout: float = READ_TIMEOUT) -> None:
        super().__init__(target, read_timeout=read_timeout)
        self._primary: Node | None = None
        self._last: Node | None = None  # the primary last in use (None: never one yet)
        self._watcher: asyncio.Task[None] | None = None  # ``watch_switches``, once started

    def route(self, key: str) -> Node:
        if self._primary is None:
            raise ConnectionError(f"no primary known for {self.target.master!r}")
        return self._primary

    def primaries(self) -> list[Node]:
        return [] if self._primary is None else [self._primary]

    async def start(self) -> None:
        await self._refresh(raise_errors=True)
        self._watcher = asyncio.get_running_loop().create_task(
            watch_switches(self.target, self._follow, timeout=CONNECT_TIMEOUT)
        )

    async def _follow(self) -> None:
        """A Sentinel announced a new primary: a new round of questions, after any round
        running now (it may have begun before the switch and bring back the old answer)."""
        running = self._refreshing
        if running is not None and not running.done():
            await asyncio.wait([running])
        await self.refresh()

    async def close(self) -> None:
        watcher, self._watcher = self._watcher, None
        if watcher is not None:
            watcher.cancel()
            await asyncio.gather(watcher, return_exceptions=True)
        await super().close()

    async def recheck(self, node: Node) -> bool:
        await self.refresh()
        return self._primary is not None and self._primary is not node

    async def _refresh(self, raise_errors: bool = False) -> None:
        if self.closed:
            return
        old = self._primary
        try:
            host, port = await resolve_primary(self.target, timeout=CONNECT_TIMEOUT)
            if self.closed:
                return
            node = self.node(host, port)
            role = await asyncio.wait_for(node.call("ROLE"), CONNECT_TIMEOUT * 2)
        except (RedisError, OSError, asyncio.TimeoutError, BackendUnavailable) as exc:
            self.last_error = str(exc) or type(exc).__name__
            logger.debug("Sentinel primary %r: %s", self.target.master, self.last_error)
            self._forget(old)
            if raise_errors:
                raise BackendUnavailable(
                    f"Sentinel primary {self.target.master!r}: {self.last_error}"
                ) from None
            return
        kind = role[0].decode() if isinstance(role[0], bytes) else str(role[0])
        logger.debug("Sentinel primary %r: %s says ROLE %s", self.target.master, node.addr, kind)
        if kind != "master":
            # The Sentinels still name a node that was demoted (or not yet promoted): ask again.
            self.last_error = f"{node.addr} named by the Sentinels says ROLE {kind}"
            await node.drop()
            self._forget(old)
            if raise_errors:
                raise BackendUnavailable(
                    f"Sentinel primary {self.target.master!r}: {self.last_error}"
                )
            return
        last, self._last = self._last, node
        if last is not None and last is not node:
            await last.drop()
            logger.warning(
                "Redis primary %r moved from %s to %s (Sentinel failover)",
                self.target.master,
                last.addr,
                node.addr,
            )
        elif old is None and last is node:
            logger.info("Redis primary %r at %s answers again", self.target.master, node.addr)
        self._primary = node
        self.last_error = ""

    def _forget(self, old: Node | None) -> None:
        """No primary known until a later refresh finds one (requests retry meanwhile)."""
        if old is not None:
            logger.warning(
                "Redis primary %r at %s lost (%s): asking the Sentinels until a majority "
                "names a primary that says ROLE master",
                self.target.master,
                old.addr,
                self.last_error,
            )
        self._primary = None
