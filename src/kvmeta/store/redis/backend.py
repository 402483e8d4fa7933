"""State in Redis/Valkey, shared by any number of stateless kvmeta servers.

Every operation on a pool is ONE Lua function (``store/redis/lua/<op>.lua``, loaded as one Functions
library by ``store.redis.scripts``; EVALSHA where a server lacks FUNCTION), so servers never
race on a read-modify-write: Redis runs each atomically. The functions keep exactly the
semantics of ``core.pool`` + ``store.disk.memory``; the contract suite runs against both.

``RedisBackend`` is the ``Backend``; its parts live beside it, imports pointing one way:
``layout`` (every key name: per-pool hash tags, tenants, registries), ``replies`` (a script's
reply codes and the errors they mean), ``calls`` (the call loop: retries, redirects, ``WAIT``;
lease time), ``probes`` (start-up checks and ``/ready``), ``hidx_build`` (block-hash index
builds walked in the background), ``stats`` (pool list, budget, stats, check). Where the keys
live (one node, a Cluster's slots, a Sentinel group's primary) is ``store.redis.nodes``.

The change feed (``set_change_listener``): the scripts that change stored keys take a last
argument of their own, '1' when a listener is set, and only then collect the keys they changed
and bump the pool's change counter (``_lib.lua`` ``feed``); ``store.redis.feed`` delivers each
pool's changes in the order Redis made them, after the reply and its ``WAIT``.

``clear`` runs as many short scripts, one bounded chunk each, looped from Python (as ``check``
does): one long script would stall every pool on that Redis for its whole duration. So does a
vLLM completeness check over many ranks (``store.redis.vexists``).
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import quote

from redis.exceptions import RedisError

from kvmeta._types import PoolId
from kvmeta.core.hash_index import hash_field
from kvmeta.errors import BackendUnavailable, NoHashIndex, NotInitialized, RankInUse
from kvmeta.lograte import warn_limited
from kvmeta.store.base import InitResult, VIndex, parse_cursor
from kvmeta.store.changes import (
    CLEARED,
    REASON_CAPACITY,
    REASON_CLEAR,
    REASON_DELETE,
    REASON_DROP,
    REMOVED,
    STORED,
    ChangeListener,
)
from kvmeta.store.redis.calls import STEP_BOUND
from kvmeta.store.redis.epoch import RedisEpoch
from kvmeta.store.redis.feed import ChangeSequencer
from kvmeta.store.redis.hidx_build import BUILD_CHUNK, WALK_STALE, HashIndexBuilds
from kvmeta.store.redis.layout import (
    EPOCH_KEY,
    HIDX,
    HOLD_KEY,
    POOL_PARTS,
    TENANTS,
    pool_keys,
    pool_prefix,
    s_registry,
    v_keys,
)
from kvmeta.store.redis.nodes import READ_TIMEOUT, ClusterTopology, SentinelTopology, Topology
from kvmeta.store.redis.policy import EvictionWatch
from kvmeta.store.redis.probes import StartUpProbes
from kvmeta.store.redis.replies import IN_USE, checked, text
from kvmeta.store.redis.resp import Strings
from kvmeta.store.redis.scripts import ScriptLibrary
from kvmeta.store.redis.stats import PoolReports
from kvmeta.store.redis.url import check_url, parse_target, redact_url
from kvmeta.store.redis.vexists import V_STALE, VPlan, walk

# The key layout and URL checks live in store.redis.layout and store.redis.url; importable here
# too, where callers expect them.
__all__ = [
    "BUILD_CHUNK",
    "CLEAR_CHUNK",
    "POOL_PARTS",
    "STEP_BOUND",
    "WALK_STALE",
    "RedisBackend",
    "check_url",
    "pool_keys",
    "pool_prefix",
    "redact_url",
]

logger = logging.getLogger(__name__)

# Entries per clear script call: a few milliseconds of Redis time per chunk (measured in
# benchmarks/README.md, "Redis backend"), so other pools wait at most that long behind a clear
# of any size.
CLEAR_CHUNK = 500


class RedisBackend(HashIndexBuilds, PoolReports, StartUpProbes):
    """The ``Backend`` over Redis/Valkey: one endpoint (``redis://[:password@]host:port/db``,
    ``rediss://`` for TLS, ``unix:///path/redis.sock?db=0``), a Cluster
    (``redis+cluster://h:p[,h:p...]``, or a plain URL naming a Cluster node) or a Sentinel group
    (``redis+sentinel://s:p[,s:p...]/primary-name``); see ``store.redis.url``."""

    name = "redis"

    def __init__(
        self,
        url: str,
        *,
        reservation_ttl: float = 300.0,
        read_lease: float = 5.0,
        clock: Callable[[], float] | None = None,
        step_bound: float = STEP_BOUND,
        failover_timeout: float = 5.0,
        min_replicas_ack: int = 0,
        replica_ack_timeout: float = 1.0,
        functions: bool | None = None,
        hash_index: bool = False,
        build_chunk: int = BUILD_CHUNK,
    ):
        """``clock`` is for tests only: every script that reads the time gets ``clock()``
        (seconds) instead of Redis ``TIME``, so a test can drive this backend and a
        ``MemoryStore`` from one clock and step time past leases. It is a constructor argument
        and nothing else (no flag, URL parameter or request field sets it): several servers on
        one Redis must share Redis's clock. None (production) adds nothing to a call.

        ``step_bound``: the most one call may advance a pool's lease clock, and how much longer
        than asked every lease is written, so a step of Valkey's wall clock ends no lease early
        (``_lib.lua`` ``pool_now``, docs/guarantees.md). 0 turns the guard off (leases measured
        with Valkey's ``TIME`` directly): for tests only, whose sleeps across leases shorter
        than the bound would otherwise count as steps. Servers sharing a Redis must agree on it.

        ``failover_timeout``: how long one call retries across a failover, a slot move or a
        lost connection before it answers 503. ``min_replicas_ack``: replicas that must
        acknowledge every state-changing script (``WAIT``) before it counts as done, within
        ``replica_ack_timeout`` seconds; fewer -> ``NotReplicated`` (503, safe to retry).
        ``functions``: see ``ScriptLibrary`` (False forces EVALSHA).

        ``hash_index`` (``--hash-index``): every SGLang pool this server initialises keeps an
        index of its stored keys by block hash (``prefix_length_hashes``). Whether a pool
        keeps one is the pool's own property in Redis (meta ``hx``), so servers sharing the
        Redis agree whatever their flags: every server maintains the index of a pool that has
        it. A pool created without it gets its index built when a server with the flag
        initialises it, in the background, in chunks of ``build_chunk`` stored keys
        (``store.redis.hidx_build``); lookups by hash answer ``NoHashIndex.building`` (400)
        until the walk is done. Keeping the index costs each confirm and each evicting reserve
        Redis CPU per key (both measured: benchmarks/README.md, "Prefix lookup by block hash").
        ``build_chunk`` is for tests (a slow walk)."""
        self.target = parse_target(url)
        self.url = url
        self._clock = clock
        self._step_bound = repr(float(step_bound))
        self.reservation_ttl = reservation_ttl
        self.read_lease = read_lease
        self.failover_timeout = failover_timeout
        self.min_replicas_ack = min_replicas_ack
        self.replica_ack_timeout = replica_ack_timeout
        self._scripts = ScriptLibrary(functions=functions)
        self.hash_index = hash_index
        self.build_chunk = build_chunk
        self.walk_stale = WALK_STALE  # (tests set it shorter)
        self._walker = secrets.token_hex(8)
        self._builds = {}
        self._walked = set()
        # Pools seen with a complete index (meta hx), and the epoch they were seen in: hx is
        # never taken back while the pool exists, and a pool goes away only with Redis's data.
        self._built: dict[PoolId, str] = {}
        self._client = None
        self._topo = None
        self._ack = None
        self._replication = {}
        # What v_exists needs from each tenant's registry as this process last read it (see
        # ``store.redis.vexists``): where it starts, checked by each script to be current.
        # Several servers share the registry, so this is a guess, never an answer.
        self._v_known: dict[str, VPlan] = {}
        self._feed = ChangeSequencer()
        # The epoch, read again whenever Redis may have lost its data (``store.redis.epoch``);
        # a new one is reported to the change feed's listener, which states every pool again.
        # With a test clock there is no hold after a data loss: its end is Valkey's time,
        # which such a backend's scripts never compare with.
        hold = self._set_hold if clock is None else None
        self._epochs = RedisEpoch(EPOCH_KEY, self._command, self._feed.lost, HOLD_KEY, hold)
        # Whether a primary may evict kvmeta's keys (``store.redis.policy``).
        self._eviction = EvictionWatch(self._primaries)
        self._started = False

    async def _set_hold(self) -> float:
        """Redis lost its data: pools created for the longest lease (plus the clock-step bound)
        from now hand out no never-used page (``_lib.lua`` ``hold_after_loss``). Returns the
        hold's end (Valkey's time)."""
        seconds = max(self.reservation_ttl, self.read_lease) + float(self._step_bound)
        reply = await self._run("hold", (HOLD_KEY,), [repr(seconds)])
        return float(reply[1])

    def _hold_arg(self) -> str:
        """The hold's end as initialize and v_register take it ('' for none)."""
        until = self._epochs.hold_until
        return repr(until) if until and self._clock is None else ""

    @property
    def failure(self) -> str | None:
        return None  # an unreachable Redis is an error per call (503), not a standing state

    @property
    def epoch(self) -> str:
        """The ``kvmeta:2:epoch`` key's value: created when absent (a new or emptied Redis), read
        again before the next reply whenever Redis may have lost its data (``store.redis.epoch``:
        a new link, kvmeta's code missing, a failed-over call, a pool or rank found missing, a
        ``/ready`` probe), so it changes exactly when Redis lost data."""
        return self._epochs.value

    def set_change_listener(self, listener: ChangeListener | None) -> None:
        """Report each change once its script answered (and its ``WAIT``, with
        ``--min-replicas-ack``: a write answered ``NotReplicated`` is never announced), per pool
        in Redis's order (``store.redis.feed``). Each server reports what it executed: a
        subscriber listens to every kvmeta server on the Redis. Not reported: a change whose
        reply was lost (a dropped connection, a failover, ``NotReplicated``) and whose retry
        found nothing left to do (an idempotent repeat changes nothing). None: the scripts do
        no feed work at all."""
        self._feed.listener = listener

    async def dump(self, pool: PoolId, cursor: str, limit: int) -> tuple[list[str], str]:
        """``HSCAN`` of the pool's stored hash (key -> page), a plain command (no script), so
        the cursor and the guarantee are Redis's own SCAN ones. A small hash (listpack) is
        answered whole in one call, whatever ``limit``."""
        keys = pool_keys(pool)
        stored = keys[1]
        start = str(parse_cursor(cursor))
        reply = await self._command(stored, "HSCAN", stored, start, "COUNT", max(limit, 1))
        nxt, flat = text(reply[0]), reply[1]
        out = [text(flat[i]) for i in range(0, len(flat), 2)]
        if not out and nxt == "0":
            await self._pool_exists(pool)
        return out, "" if nxt == "0" else nxt

    async def settle_changes(self, pool: PoolId) -> None:
        """The pool's change counter (meta ``chg``) read now, then ``ChangeSequencer.settle``."""
        if self._feed.listener is None:
            return
        meta = pool_keys(pool)[0]
        counter = await self._command(meta, "HGET", meta, "chg")
        await self._feed.settle(pool, int(counter or 0))

    async def prefix_length(self, pool: PoolId, keys: list[str]) -> int:
        """One ``HMGET`` of the pool's stored hash (a plain command: no script, no counter,
        no LRU touch, no lease); the pool's existence is read only when no key matched.

        Not a Lua script: one, with the keys as one JSON argument, saved the worker about as
        much CPU as packing the ``HMGET`` fields as ``resp.Strings`` does, but cost Redis 2.5
        to 6 times the time of the plain ``HMGET`` (decoding the keys, passing 256 fields and
        replies between Lua and Redis), and Redis is the one process every kvmeta server
        shares (benchmarks/README.md, "Router endpoints")."""
        n = 0
        if keys:
            n = await self._leading_fields(pool_keys(pool)[1], Strings(keys))
        if n == 0:
            await self._pool_exists(pool)
        return n

    async def _leading_fields(self, key: str, fields: Strings) -> int:
        """How many of ``fields``, from the first, the Redis hash ``key`` holds: one plain
        ``HMGET``, the first miss found in C."""
        values: list[Any] = await self._command(key, "HMGET", key, fields)
        try:
            return values.index(None)
        except ValueError:
            return len(values)

    async def prefix_length_hashes(self, pool: PoolId, hashes: list[int]) -> int:
        """``prefix_length`` by block hashes: one ``HMGET`` of the pool's hash index (its
        fields are ``hash_field`` of each hash, as ``_lib.lua`` writes them). Whether the pool
        exists and its index is complete is read when a hash missed, unless this server saw
        the index complete before (``_built``): a pool without an index has no index key, so
        nothing matches, and one whose index is being built may miss what is stored
        (``NoHashIndex.building``). Every hash found is an answer even mid-build: the index
        never lists a page that is not stored under that hash."""
        n = 0
        if hashes and pool.dialect == "s":
            fields = Strings([hash_field(h) for h in hashes])
            n = await self._leading_fields(pool_keys(pool)[HIDX], fields)
            if n == len(hashes) or (n and self._built.get(pool) == self._epochs.value):
                return n
        meta = pool_keys(pool)[0]
        size, hx, hb, stamp = await self._command(meta, "HMGET", meta, "n", "hx", "hb", "hbt")
        if size is None:
            raise await self._gone(pool)
        if pool.dialect == "s" and hx is not None and text(hx) == "1":
            self._built[pool] = self._epochs.value
            return n
        if pool.dialect == "s" and hb is not None and text(hb) == "1":
            if self.hash_index:
                await self._resume_stopped_build(pool, stamp)
            raise NoHashIndex.building(pool.rank, pool.namespace)
        raise NoHashIndex.for_pool(pool.dialect, pool.rank, pool.namespace)

    async def _pool_exists(self, pool: PoolId) -> None:
        """Raises NotInitialized unless the pool exists (its meta hash has a size)."""
        meta = pool_keys(pool)[0]
        if not await self._command(meta, "HEXISTS", meta, "n"):
            raise await self._gone(pool)

    def durability_stats(self) -> dict[str, float]:
        """How many primaries hold the state and the fewest replicas any of them has, as the
        last readiness probe saw them (Redis keeps its own persistence; nothing is on this
        machine's disk). A replica count below ``--min-replicas-ack`` means writes answer 503."""
        return dict(self._replication)

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Find the primaries, install kvmeta's code on each, choose the acknowledgement mode
        and read the epoch, so a wrong URL fails at start-up, not per request.

        Raises:
            ConfigError: redis-py does not understand the URL.
            BackendUnavailable: Redis cannot be reached at the URL, or it answered but refused
                the connection set-up (wrong database or password: Redis's own answer is in
                the message); no majority of Sentinels names a primary; a Cluster does not
                answer.
        """
        read_timeout = max(READ_TIMEOUT, self.replica_ack_timeout + 1.0)
        target = self.target
        if target.mode == "single":
            target = await self._check_single()
        kinds = {"single": Topology, "cluster": ClusterTopology, "sentinel": SentinelTopology}
        topo = kinds[target.mode](target, read_timeout=read_timeout)
        topo.on_link = self._linked
        self._topo = topo
        try:
            await topo.start()
            await self._refuse_eviction(topo.primaries())
            for node in topo.primaries():
                logger.info("Redis %s: %s", node.addr, await self._install_on(node))
            await self._choose_ack_mode(topo.primaries())
            await self._epochs.start()
            await self._warn_old_layouts()
        except BackendUnavailable:
            await self.close()
            raise
        except (RedisError, OSError) as exc:
            await self.close()
            raise BackendUnavailable(
                f"cannot set up kvmeta on Redis at {target.shown}: {exc}"
            ) from exc
        self._started = True
        logger.info("%s: epoch %s", self.describe, self._epochs.value)

    async def _gone(self, pool: PoolId) -> NotInitialized:
        """The error for a pool Redis says does not exist, once the epoch has been read again:
        a pool that vanished (FLUSHALL keeps every connection and kvmeta's code) is the one
        sign that Redis lost its data, and the reply must carry the new epoch."""
        await self._epochs.recheck()
        return NotInitialized.for_pool(pool.dialect, pool.rank, pool.namespace)

    async def close(self) -> None:
        """Stop this server's walks of index builds and release their claims
        (``_stop_walks``), then close the connections."""
        await self._stop_walks()
        await self._eviction.close()
        if self._topo is not None:
            await self._topo.close()
            self._topo = None
        await self._drop_probe_client()

    # ------------------------------------------------------------------ dialect S (and V pools)

    async def initialize(self, pool: PoolId, num_pages: int) -> InitResult:
        if pool.dialect == "v":  # a vLLM pool is a registered rank (as in MemoryStore)
            return await self.v_register(pool.rank, num_pages, None, pool.tenant)
        await self._sadd_pool(pool)
        args: list[Any] = [num_pages, "1" if self.hash_index else "0", self.build_chunk]
        args += [self.walk_stale, self._walker, self._hold_arg()]
        reply = await self._run("initialize", pool_keys(pool), args)
        checked(pool, reply, None)
        if len(reply) > 3 and reply[3]:
            self._start_build(pool)  # the script claimed the walk for this server
        return self._init_result(pool, reply, num_pages)

    async def _sadd_pool(self, pool: PoolId) -> None:
        # Before the pool exists, so a crash in between leaves a listed-but-absent pool (stats
        # skips it), never an unlisted one.
        member = f"{pool.rank}:{quote(pool.namespace, safe='')}"
        await self._list_tenant(pool.tenant)
        registry = s_registry(pool.tenant)
        await self._command(registry, "SADD", registry, member)

    async def _list_tenant(self, tenant: str) -> None:
        """Before a tenant's pool is created: list the tenant, so ``pools`` finds it. Every
        time (one SADD per pool creation, which is rare): a remembered "already listed" would
        be wrong after Redis lost its data."""
        if tenant:
            await self._command(TENANTS, "SADD", TENANTS, quote(tenant, safe=""))

    def _init_result(self, pool: PoolId, reply: list[Any], requested: int) -> InitResult:
        result = InitResult(created=bool(reply[1]), num_pages=int(reply[2]), requested=requested)
        if result.conflict:
            warn_limited(
                logger,
                "size_conflict",
                "%s re-initialised with num_pages=%d but has %d pages; keeping %d. Two engines "
                "with different file sizes on one pool would overwrite each other's pages: "
                "give each its own rank or namespace.",
                pool,
                requested,
                result.num_pages,
                result.num_pages,
            )
        return result

    async def exists(self, pool: PoolId, keys: list[str]) -> list[bool]:
        reply = await self._pool_op("exists", pool, keys)
        return [bool(x) for x in reply[1:]]

    async def reserve(
        self, pool: PoolId, keys: list[str], parent: str | None = None
    ) -> list[tuple[bool, int]]:
        # vLLM's batches are all or nothing (reserve.lua, as ``core.pool.Pool.reserve``).
        # ``parent`` is not used: the only order kept in Redis is LRU, which ignores chains.
        request = (self.reservation_ttl, keys, 1 if pool.dialect == "v" else 0)
        reply = await self._changing_op("reserve", pool, request, REMOVED, REASON_CAPACITY)
        return [(bool(reply[i]), reply[i + 1]) for i in range(1, len(reply), 2)]

    async def confirm(self, pool: PoolId, pairs: list[tuple[str, int]], release: list[int]) -> int:
        """Returns how many pairs were refused (stale or foreign pages)."""
        reply = await self._changing_op("confirm", pool, (pairs, release), STORED, "")
        refused = int(reply[1])
        if refused:
            warn_limited(
                logger,
                "confirm_refused",
                "%s: refused %d confirm(s) for pages not reserved for their key (lease expired "
                "or page re-used), e.g. %r; the writer's data is not mapped",
                pool,
                refused,
                (text(reply[2]), int(reply[3])),
            )
        return refused

    async def get(self, pool: PoolId, keys: list[str]) -> list[int | None]:
        reply = await self._pool_op("get", pool, (self.read_lease, keys))
        return [None if p < 0 else p for p in reply[1:]]

    async def delete(self, pool: PoolId, keys: list[str]) -> int:
        return int((await self._changing_op("delete", pool, keys, REMOVED, REASON_DELETE))[1])

    async def clear(self, pool: PoolId) -> int:
        """Clear in chunks of ``CLEAR_CHUNK`` keys (one script each, see ``clear.lua``); the
        last chunk reports the clear (one CLEARED)."""
        keys, cursor, total = pool_keys(pool), "0", 0
        while True:
            reply = await self._changing(
                "clear", pool, keys, [cursor, CLEAR_CHUNK], CLEARED, REASON_CLEAR
            )
            checked(pool, reply, None)
            cursor, total = text(reply[1]), total + int(reply[2])
            if cursor == "0":
                return total

    # ------------------------------------------------------------------ vLLM index
    # Every v_* script gets every key it touches in KEYS (as Redis Cluster requires; all in the
    # ``{v}`` slot): the registry keys, then whole pools (``pool_keys``). The ranks a cross-rank
    # operation needs are known only from the registry, so it passes the keys of the ranks a
    # registry read (``_v_registry``) found, and a script that finds the registry changed since
    # answers ``_V_STALE`` having changed nothing: the registry is read again and the op retried.
    _V_STALE = V_STALE
    # Registry changes come from engines starting or an operator, seconds apart: a handful of
    # consecutive ones inside the microseconds between a read and a script means something is
    # rewriting the registry in a loop, and the caller gets a 503 rather than a hung request.
    _V_TRIES = 20

    async def v_register(
        self,
        rank: int,
        num_pages: int,
        world_size: int | None,
        tenant: str = "",
        change_world: bool = True,
    ) -> InitResult:
        pool = PoolId("v", rank, "", tenant)
        await self._list_tenant(tenant)
        keys = (*v_keys(tenant), *pool_keys(pool))
        world = "" if world_size is None else world_size
        args = [rank, num_pages, world, self._hold_arg(), "1" if change_world else "0"]
        reply = checked(pool, await self._run("v_register", keys, args), world_size)
        self._v_known.pop(tenant, None)  # changed it: the next v_exists reads it afresh
        return self._init_result(pool, reply, num_pages)

    async def v_exists(self, keys: list[str], tenant: str = "") -> list[bool]:
        """One consistent answer: the required ranks as the registry has them when the walk
        runs (``store.redis.vexists``: bounded scripts, rank by rank, each asked only about the
        keys the ranks before it had). It starts from the last registry read this process made
        (``_v_known``), so the common case is one script; ``v_exists.lua`` refuses, changing
        nothing, when other ranks are required by then, and the registry is read again.
        "Nothing is complete" (a required rank not registered) is answered only from a fresh
        read, never from a remembered one."""
        if not keys:
            return []
        plan, fresh = self._v_known.get(tenant), False
        registry = v_keys(tenant)

        def rank_keys(rank: int) -> tuple[str, ...]:
            return pool_keys(PoolId("v", rank, "", tenant))

        def run(names: tuple[str, ...], args: list[Any]) -> Awaitable[list[Any]]:
            return self._run("v_exists", names, args)

        for _ in range(self._V_TRIES):
            if plan is None or not (fresh or plan.count):
                plan, fresh = VPlan.of(await self._v_registry(tenant)), True
            if not plan.count:  # a required rank is not registered (yet), or Redis lost it
                await self._epochs.recheck()
                return [False] * len(keys)
            out = await walk(plan, keys, registry, rank_keys, run)
            if out is not None:
                return out
            plan = None
        raise self._v_unsettled("exists")

    def _v_unsettled(self, op: str) -> BackendUnavailable:
        return BackendUnavailable(
            f"vLLM {op} on Redis backend {redact_url(self.url)}: the vLLM rank registry kept "
            f"changing while it ran ({self._V_TRIES} reads in a row were out of date by the "
            "time they were used); something is registering or removing ranks, or changing "
            "the world size, in a loop: stop it (GET /v1/vllm shows the registry) and retry"
        )

    async def v_clear(self, tenant: str = "") -> int:
        """Each registered rank's pool is cleared like an SGLang pool (``clear``): in chunks of
        ``CLEAR_CHUNK`` keys, one short script each, so a big index never holds Redis for the
        whole clear. Registrations, world size and reservations stay. Not atomic across ranks
        (nor is ``clear`` within a pool): a key stored while the clear runs may survive it, and a
        rank registered meanwhile is new and empty anyway."""
        total = 0
        for rank in (await self._v_registry(tenant)).ranks:
            try:
                total += await self.clear(PoolId("v", rank, "", tenant))
            except NotInitialized:
                continue  # removed since the registry was read: nothing left to clear
        return total

    async def v_remove(self, rank: int, tenant: str = "", force: bool = False) -> int | None:
        pool = PoolId("v", rank, "", tenant)
        keys = (v_keys(tenant)[0], *pool_keys(pool))
        args: list[Any] = [rank, "1" if force else "0"]
        reply = await self._changing("v_remove", pool, keys, args, CLEARED, REASON_DROP)
        if int(reply[0]) == IN_USE:
            raise RankInUse.for_rank(rank, int(reply[1]), float(reply[2]))
        dropped = int(reply[1])
        self._v_known.pop(tenant, None)
        return None if dropped < 0 else dropped

    async def v_set_world_size(self, world_size: int | None, tenant: str = "") -> None:
        world = v_keys(tenant)[1]
        await self._run("v_world", (world,), ["" if world_size is None else world_size])
        self._v_known.pop(tenant, None)

    async def v_index(self, tenant: str = "") -> VIndex:
        return await self._v_registry(tenant)

    async def _v_registry(self, tenant: str = "") -> VIndex:
        """The rank registry and world size, read in one script (``v_index.lua``)."""
        reply = await self._run("v_index", v_keys(tenant), [])
        world = text(reply[1])
        ranks = tuple(sorted(int(r) for r in reply[2:]))
        index = VIndex(int(world) if world else None, ranks)
        self._v_known[tenant] = VPlan.of(index)
        return index
