"""What ``RedisBackend.start`` and ``/ready`` ask Redis before trusting it: whether the one
endpoint is a Cluster node, whether a primary may evict kvmeta's keys, which acknowledgement
mode ``--min-replicas-ack`` gets, and whether the primaries answer.

A wrong URL, password or policy is refused at start-up with Redis's own answer and the fix,
rather than as a 503 on every request.
"""

from __future__ import annotations

import asyncio
import logging
from urllib.parse import parse_qs, urlsplit

import redis.asyncio as aioredis
from redis.exceptions import AuthenticationError, ConnectionError, RedisError, ResponseError

from kvmeta.errors import BackendMisconfigured, BackendUnavailable, ConfigError
from kvmeta.store.redis.calls import ScriptCalls
from kvmeta.store.redis.layout import OLD_LAYOUTS
from kvmeta.store.redis.nodes import Node
from kvmeta.store.redis.policy import EvictionWatch, eviction_problem
from kvmeta.store.redis.policy import parse_info as _info
from kvmeta.store.redis.url import DB_HINT, RESP, RedisTarget, redact_url

__all__ = ["StartUpProbes"]

logger = logging.getLogger("kvmeta.store.redis.backend")


def _set_up_refused(url: str, exc: RedisError) -> str:
    """Start-up message for a Redis that answered but refused the connection set-up."""
    answer = str(exc)
    text = f"Redis at {redact_url(url)} refused the connection set-up: {answer!r}"
    if "DB index is out of range" in answer:
        db = urlsplit(url).path or "?db=" + ",".join(parse_qs(urlsplit(url).query).get("db", []))
        return f"{text}: it has no database {db} ({DB_HINT})"
    if isinstance(exc, AuthenticationError) or "auth" in answer.lower():
        return (
            f"{text}: check the password in the URL (redis://:PASSWORD@host:port/db, or "
            "redis://USER:PASSWORD@... for an ACL user)"
        )
    return text


class StartUpProbes(ScriptCalls):
    """The start-up checks and the readiness probe of ``RedisBackend``."""

    url: str
    _client: aioredis.Redis | None  # single endpoint only: start-up checks
    _eviction: EvictionWatch
    _replication: dict[str, float]  # see RedisBackend.durability_stats
    _started: bool  # start-up's own checks done: new links are watched from now

    @property
    def describe(self) -> str:
        mode = self._topo.mode if self._topo is not None else self.target.mode
        kind = {"single": "redis", "cluster": "redis cluster", "sentinel": "redis sentinel"}[mode]
        return f"{kind} at {self.target.shown}"

    def _primaries(self) -> list[Node]:
        return [] if self._topo is None else self._topo.primaries()

    def _linked(self, node: Node) -> None:
        """A link to ``node`` opened (``Node.on_link``): it may be a new primary, or one that
        restarted empty, and no call need have failed to bring it here (an idle server's
        links close with the node; the next call just opens one). So the epoch is read again
        before the next reply, and the node's eviction policy in the background."""
        self._epochs.doubt()
        if self._started:
            self._eviction.linked(node)

    async def _refuse_eviction(self, primaries: list[Node]) -> None:
        """Refuse to start on primaries that may evict kvmeta's keys (``store.redis.policy``),
        before kvmeta changes anything on them.

        Raises:
            BackendMisconfigured: naming each such primary, its policy and the fix.
        """
        found = await asyncio.gather(*(eviction_problem(n.addr, n.call) for n in primaries))
        problems = [problem for problem in found if problem]
        if problems:
            raise BackendMisconfigured("; ".join(problems))

    async def _drop_probe_client(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    async def _check_single(self) -> RedisTarget:
        """Ping the one endpoint (Redis's answer to a bad database or password goes into the
        message) and find out whether it is a Cluster node: then run in Cluster mode."""
        try:
            client = aioredis.from_url(
                self.url, decode_responses=False, health_check_interval=30, protocol=RESP
            )
        except (ValueError, TypeError) as exc:
            raise ConfigError(
                f"`--backend` URL {redact_url(self.url)} is not understood: {exc}", "backend"
            ) from None
        self._client = client
        try:
            await client.ping()
            info = await client.info("cluster")
        except (ResponseError, AuthenticationError) as exc:
            await self._drop_probe_client()
            if "DB index is out of range" in str(exc) and await self._is_cluster_node():
                raise self._cluster_db_refused() from None
            raise BackendUnavailable(_set_up_refused(self.url, exc)) from None
        except (ConnectionError, RedisError, OSError) as exc:
            await self._drop_probe_client()
            raise BackendUnavailable(
                f"cannot reach Redis at {redact_url(self.url)}: {exc}"
            ) from None
        if not info.get("cluster_enabled"):
            return self.target
        parts = urlsplit(self.url)
        if parts.scheme == "unix" or parts.hostname is None:
            await self._drop_probe_client()
            raise ConfigError(
                f"`--backend` URL {self.target.shown} names a Redis Cluster node over a unix "
                "socket: a Cluster is reached over TCP, use redis+cluster://host:port",
                "backend",
            )
        if self.target.db:
            await self._drop_probe_client()
            raise self._cluster_db_refused()
        await self._drop_probe_client()
        logger.warning(
            "%s is a Redis Cluster node (cluster_enabled:1): using Cluster mode, with it as "
            "the seed node (write redis+cluster://host:port[,host:port...] to name more seeds)",
            self.target.shown,
        )
        return self.target.with_mode("cluster", parts.hostname, parts.port or 6379)

    def _cluster_db_refused(self) -> ConfigError:
        return ConfigError(
            f"`--backend` URL {self.target.shown} names a Redis Cluster node, and a Cluster "
            f"has only database 0: drop /{self.target.db} from the URL",
            "backend",
        )

    async def _is_cluster_node(self) -> bool:
        """Whether the endpoint (which refused the URL's database) is a Cluster node."""
        pool = aioredis.ConnectionPool.from_url(self.url, protocol=RESP)
        pool.connection_kwargs["db"] = 0
        client = aioredis.Redis(connection_pool=pool)
        try:
            return bool((await client.info("cluster")).get("cluster_enabled"))
        except (RedisError, OSError):
            return False
        finally:
            await client.aclose()
            await pool.aclose()

    async def _choose_ack_mode(self, primaries: list[Node]) -> None:
        """``WAIT N`` after each write, or ``WAITAOF 1 N`` where the primary logs to an AOF and
        N replicas acknowledge their own AOF (measured on Valkey 9.1: WAITAOF counts only
        replicas that have appendonly on, and needs it on the primary; WAIT counts replicas
        that received the write). Too few connected replicas is a warning, not fatal: a
        replica may be resyncing, and each write then answers 503 until it is back."""
        n = self.min_replicas_ack
        if n <= 0:
            self._ack = None
            logger.info("Redis acknowledgements: the primary's alone (--min-replicas-ack 0)")
            return
        ms = max(1, int(self.replica_ack_timeout * 1000))
        aof = bool(primaries)
        for node in primaries:
            info = _info(await node.call("INFO", "replication")) | _info(
                await node.call("INFO", "persistence")
            )
            replicas = int(info.get("connected_slaves", "0"))
            if replicas < n:
                logger.warning(
                    "Redis primary %s has %d connected replica(s) but --min-replicas-ack is %d: "
                    "every write will answer 503 until enough replicas are connected",
                    node.addr,
                    replicas,
                    n,
                )
            if info.get("aof_enabled") != "1":
                aof = False
                continue
            try:
                local, acked = await node.call("WAITAOF", 1, n, ms)
            except ResponseError:
                aof = False  # no WAITAOF (Redis < 7.2)
                continue
            aof = aof and int(local) >= 1 and int(acked) >= n
        if aof:
            self._ack = ("WAITAOF", 1, n, ms)
            logger.info(
                "Redis acknowledgements: WAITAOF 1 %d %d (each write in the primary's AOF and "
                "in the AOF of %d replica(s))",
                n,
                ms,
                n,
            )
        else:
            self._ack = ("WAIT", n, ms)
            logger.info(
                "Redis acknowledgements: WAIT %d %d (each write received by %d replica(s); "
                "WAITAOF needs appendonly on the primary and on the replicas)",
                n,
                ms,
                n,
            )

    async def _warn_old_layouts(self) -> None:
        """Log pools left by a kvmeta with another data layout: this one does not use them."""
        for prefix, registry in OLD_LAYOUTS.items():
            if await self._command(registry, "EXISTS", registry):
                logger.warning(
                    "%s holds pools in an earlier kvmeta data layout (keys %s:*), which this "
                    "version does not read: engines re-initialise their pools here (empty). "
                    "Delete the old keys when no older kvmeta uses them (SCAN MATCH '%s:*' "
                    "then UNLINK, on every primary)",
                    self.describe,
                    prefix,
                    prefix,
                )

    async def ready(self) -> bool:
        """Every slot has a primary and every primary answers (``INFO replication``, whose
        replica counts ``durability_stats`` reports), and none may evict kvmeta's keys. Each
        probe reads the epoch again too.

        Raises:
            BackendMisconfigured: a primary's ``maxmemory-policy`` may evict them (the message
                is the reason ``/ready`` gives).
        """
        topo = self._topo
        if topo is None:
            return False
        if topo.coverage() is not None:
            await topo.refresh()
            if topo.coverage() is not None:
                return False
        for attempt in range(2):
            try:
                primaries = topo.primaries()
                replies, problems = await asyncio.wait_for(
                    asyncio.gather(
                        asyncio.gather(*(node.call("INFO", "replication") for node in primaries)),
                        self._eviction.check(primaries),
                    ),
                    self.failover_timeout,
                )
                if replies and all(replies):
                    counts = [int(_info(r).get("connected_slaves", "0")) for r in replies]
                    self._replication = {
                        "redis_primaries": float(len(counts)),
                        "redis_replicas_min": float(min(counts)),
                    }
                    if problems:
                        raise BackendMisconfigured("; ".join(problems))
                    # A FLUSHALL breaks no link and keeps kvmeta's code: with no request
                    # finding a pool gone, the probes are what notice it.
                    await asyncio.wait_for(self._epochs.recheck(), self.failover_timeout)
                    return True
            except (RedisError, OSError, asyncio.TimeoutError):
                pass
            if not attempt:
                await topo.refresh()  # a failover with no request since: find the new primary
        return False
