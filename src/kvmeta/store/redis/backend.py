"""State in Redis/Valkey, shared by any number of stateless kvmeta servers.

Every operation on a pool is ONE Lua function (``store/redis/lua/<op>.lua``, loaded as one Functions
library by ``store.redis.scripts``; EVALSHA where a server lacks FUNCTION), so servers never
race on a read-modify-write: Redis runs each atomically. The functions keep exactly the
semantics of ``core.pool`` + ``store.disk.memory``; the contract suite runs against both. Where the
keys live (one node, a Cluster's slots, a Sentinel group's primary) is ``store.redis.nodes``.

Key layout (see ``_lib.lua`` for the per-pool structures): each SGLang pool lives under its own
hash tag ``kvmeta:2:{s:RANK:NS}:``, so on a Redis Cluster pools spread over shards while one
pool's keys stay in one slot. The vLLM index (per-rank pools, the rank registry and the world
size) is one unit under ``kvmeta:2:{v}:``, because completeness spans every rank atomically.
Every script gets every key it touches in ``KEYS`` (``pool_keys``), as Redis Cluster requires;
a vLLM index script that spans ranks gets the keys of the ranks the registry listed when read
just before, and refuses (nothing changed, read again) if the registry changed in between.
``kvmeta:2:pools`` lists the SGLang pools, for stats only.

Tenants: the default tenant ``""`` has the names above. Another tenant T has its own hash tags,
``kvmeta:2:{T|s:RANK:NS}:`` per SGLang pool and ``kvmeta:2:{T|v}:`` for its vLLM index (T
%-quoted, so no ``|`` inside: no tenant/namespace pair can spell another pair's tag, and the
default tenant's tags have no ``|`` at all). Its SGLang pools are listed in
``kvmeta:2:pools:T``, and ``kvmeta:2:tenants`` lists every tenant that ever created a pool, so
stats, check and the pool list see every tenant's pools (an older kvmeta reads neither set: it
sees only the default tenant's pools, never a tenant's pool as its own).

Time (reservation and read leases) is Redis ``TIME``, read inside each script, so servers with
skewed clocks still agree, through each pool's lease clock, which a step of Valkey's clock
cannot move (``_lib.lua`` ``pool_now``; tests that compare this backend with the memory one step
by step give both one clock instead: ``RedisBackend(clock=...)``, see ``_TIMED``). A request's
keys travel as ONE JSON argument and the reply is one JSON array ``[code, ...]`` (``_ERRORS``
maps codes to errors): packing and parsing one value per key in Python costs more than the whole
script takes to run in Redis.

The change feed (``set_change_listener``): the scripts that change stored keys take a last
argument of their own, '1' when a listener is set, and only then collect the keys they changed
and bump the pool's change counter (``_lib.lua`` ``feed``); ``store.redis.feed`` delivers each
pool's changes in the order Redis made them, after the reply and its ``WAIT``.

Whole-pool work (``clear``, ``check``) runs as many short scripts, one bounded chunk each, looped
from Python: one long script would stall every pool on that Redis for its whole duration. So
does a vLLM completeness check over many ranks (``store.redis.vexists``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any
from urllib.parse import parse_qs, quote, unquote, urlsplit

import msgspec
import redis.asyncio as aioredis
from redis.exceptions import (
    AskError,
    AuthenticationError,
    ConnectionError,
    MovedError,
    ReadOnlyError,
    RedisError,
    ResponseError,
)

from kvmeta._types import PoolId
from kvmeta.core.hash_index import hash_field
from kvmeta.core.pool import PoolCounters
from kvmeta.errors import (
    BackendMisconfigured,
    BackendUnavailable,
    ConfigError,
    Forbidden,
    InvalidRequest,
    KvmetaError,
    NoHashIndex,
    NotInitialized,
    NotReplicated,
    PageOutOfRange,
    PoolDamaged,
    RankInUse,
)
from kvmeta.lograte import warn_limited
from kvmeta.store.base import (
    STATS_CHUNK,
    Budget,
    CheckReport,
    InitResult,
    PoolStats,
    VIndex,
    parse_cursor,
)
from kvmeta.store.changes import (
    CLEARED,
    REASON_CAPACITY,
    REASON_CLEAR,
    REASON_DELETE,
    REASON_DROP,
    REMOVED,
    STORED,
    Change,
    ChangeListener,
)
from kvmeta.store.redis.epoch import EPOCH_COMMANDS, RedisEpoch
from kvmeta.store.redis.feed import ChangeSequencer
from kvmeta.store.redis.nodes import (
    READ_TIMEOUT,
    ClusterTopology,
    Node,
    SentinelTopology,
    Topology,
    retriable,
)
from kvmeta.store.redis.policy import EvictionWatch, eviction_problem
from kvmeta.store.redis.policy import parse_info as _info
from kvmeta.store.redis.resp import Strings, pack, pack_many
from kvmeta.store.redis.scripts import ScriptLibrary
from kvmeta.store.redis.url import (
    DB_HINT,
    RESP,
    RedisTarget,
    check_url,
    parse_target,
    redact_url,
)
from kvmeta.store.redis.vexists import V_STALE, VPlan, walk

# check_url and redact_url live in store.redis.url; importable here too, where callers expect them.
__all__ = ["POOL_PARTS", "RedisBackend", "check_url", "pool_keys", "redact_url"]

logger = logging.getLogger(__name__)

# Every key kvmeta keeps in Redis starts with this prefix, which names the data layout the
# scripts expect: a release that changes the layout changes it, so its scripts never read
# pools written in another layout (they are not found: engines re-initialise, empty, never
# wrong). ``_OLD_LAYOUTS`` names the earlier ones, to tell the operator at start-up.
_PREFIX = "kvmeta:2"
_OLD_LAYOUTS = {"kvmeta": "kvmeta:pools"}
_S_REGISTRY = f"{_PREFIX}:pools"
_EPOCH_KEY = f"{_PREFIX}:epoch"
# The end of the hold after a data loss (``_lib.lua`` ``hold_after_loss``).
_HOLD_KEY = f"{_PREFIX}:hold_until"
# Commands whose head (name, function, key count and keys) repeats and is packed once
# (store.redis.resp).
_SCRIPT_CALLS = frozenset({"FCALL", "EVALSHA"})
_V_PREFIX = f"{_PREFIX}:{{v}}:"
_TENANTS = f"{_PREFIX}:tenants"
_SCRIPTS = (
    "initialize",
    "exists",
    "reserve",
    "confirm",
    "get",
    "delete",
    "clear",
    "stats",
    "check",
    "v_register",
    "v_exists",
    "v_remove",
    "v_world",
    "v_index",
    "hidx_fill",
    "hidx_release",
    "hold",
)
# One pool's Redis keys, in the order a pool script receives them in KEYS (see _lib.lua).
POOL_PARTS = (
    "meta",
    "stored",
    "reserved",
    "pk",
    "holders",
    "free",
    "lru",
    "resq",
    "reads",
    "cool",
    "hidx",
)
_HIDX = POOL_PARTS.index("hidx")
# Entries per clear/check script call: a few milliseconds of Redis time per chunk (measured in
# benchmarks/README.md, "Redis backend"), so other pools wait at most that long behind a clear
# or check of any size.
CLEAR_CHUNK = 500
CHECK_CHUNK = 1000
# Stored keys per chunk of building a pool's hash index (``hidx_fill.lua``): about 2 ms of
# Redis each, 6.5 ms at most, as measured in ``_lib.lua`` (``hidx_fill_chunk``); twice as big
# chunks took twice as long each and no less in all. A pool with no more stored keys than this
# gets its index built inside its initialize.
BUILD_CHUNK = 500
# A build's walk is one server's (``_lib.lua`` ``hidx_claim``) until that server releases it
# as it closes, or until it has taken no step for this long (a server that stopped without
# closing, or lost Redis); then the next server with --hash-index that initialises the pool,
# or that a lookup finds waiting for the build, takes it over: far above one step's time (a
# few ms of Redis, a round trip, a failover's retries within --failover-timeout).
WALK_STALE = 30.0
# The most one call may advance a pool's lease clock (seconds), and what every lease is written
# longer than asked: a step of Valkey's wall clock, of any size, then ends no lease early
# (``_lib.lua`` ``pool_now``, docs/guarantees.md "Leases when Valkey's clock steps"). Above the
# time between two calls of a pool in use, so its lease clock keeps real time.
STEP_BOUND = 2.0
_CHECK_PARTS = ("pk", "stored", "reserved", "free", "cool", "lru", "resq", "hidx", "totals")
# Scripts that read the time, and the ARGV index of the clock-step bound every call passes (one
# past their own arguments); the time they take instead of Redis TIME when the backend has a test
# clock comes one after it (absent in production). See _lib.lua ``pool_now``; a static test
# checks each script reads exactly these ARGVs.
_TIMED = {
    "reserve": 3,
    "confirm": 3,
    "get": 2,
    "delete": 3,
    "clear": 4,
    "stats": 1,
    "v_remove": 4,
}
_MAX_PROBLEMS = 20
# Scripts whose code 1 answers a request with "this pool does not exist" (stats and check skip
# such a pool instead: one listed before it was created, see ``_sadd_pool``).
_ANSWERS_GONE = frozenset({"exists", "reserve", "confirm", "get", "delete", "clear", "hidx_fill"})
_BUDGET_BATCH = 64  # pool sizes read concurrently by ``budget``
# Back-off between retries while a failover or resharding settles: 50 ms doubling to 500 ms.
_FIRST_DELAY = 0.05
_MAX_DELAY = 0.5
_MAX_REDIRECTS = 16  # MOVED/ASK hops for one call before it counts as a failure to retry
_MAX_RECHECKS = 3  # primaries one unacknowledged write may move to (see ``Topology.recheck``)
# The pool's event counters (``c:<name>`` in a pool's meta hash), named once, in the core: a
# counter added to ``PoolCounters`` is reported here at once (the Lua bumps it by name).
_COUNTERS = tuple(f.name for f in dataclasses.fields(PoolCounters))


def _out_of_range(pid: PoolId, reply: list[Any], request: Any) -> KvmetaError:
    """confirm.lua's [2, list (1 pairs, 2 release), index, n]: the page is read back from the
    request (the reply names only its place)."""
    in_release, index = int(reply[1]) == 2, int(reply[2])
    pairs, release = request
    page = release[index] if in_release else pairs[index][1]
    return PageOutOfRange(page, int(reply[3]), in_release)


def _bad_size(pid: PoolId, reply: list[Any], request: Any) -> KvmetaError:
    return InvalidRequest(f"num_pages must be a positive integer, got {reply[1]}", "num_pages")


def _damaged(pid: PoolId, reply: list[Any], request: Any) -> KvmetaError:
    prefix = pool_prefix(pid)
    found = ", ".join(_text(part) for part in reply[1:])
    return PoolDamaged(
        f"{pid}: its meta key, which says the pool exists, is gone, yet its keys "
        f"{prefix}{{{found}}} are left: part of the pool was evicted or deleted (a "
        "maxmemory-policy that evicts any key, or a manual delete). "
        "Creating it again would hand out pages its stored keys still name, so kvmeta "
        "refuses (nothing was changed). Fix: set "
        "maxmemory-policy noeviction on every Redis primary and replica; stop the engines "
        f"that use this pool (or wait --reservation-ttl), delete its keys (redis-cli --scan "
        f"--pattern '{prefix}*' | xargs redis-cli unlink) and start the engines again: the "
        "pool starts empty"
    )


# Script error code -> the kvmeta error it means (code 0 is success).
_IN_USE = 5  # v_remove's refusal: the rank's pages are in use (RankInUse)
_WORLD_LOCKED = 10  # v_register's refusal: the world size is not the caller's to change
_ERRORS: dict[int, Callable[[PoolId, list[Any], Any], KvmetaError]] = {
    1: lambda pid, reply, request: NotInitialized.for_pool(pid.dialect, pid.rank, pid.namespace),
    2: _out_of_range,
    3: _bad_size,
    4: _damaged,
    _WORLD_LOCKED: lambda pid, reply, request: Forbidden.world_size_change(
        pid.rank, int(reply[1]), request
    ),
}


_encode = msgspec.json.Encoder().encode
_decode = msgspec.json.Decoder().decode


def _checked(pid: PoolId, reply: list[Any], request: Any) -> list[Any]:
    code = int(reply[0])
    if code:
        raise _ERRORS[code](pid, reply, request)
    return reply


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


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


def _owner(tenant: str) -> str:
    """What starts a tenant's hash tags: nothing for the default tenant (today's names)."""
    return f"{quote(tenant, safe='')}|" if tenant else ""


def v_prefix(tenant: str) -> str:
    """The hash-tagged key prefix of ``tenant``'s vLLM index (registry and rank pools)."""
    return f"{_PREFIX}:{{{_owner(tenant)}v}}:" if tenant else _V_PREFIX


def s_registry(tenant: str) -> str:
    """The set listing ``tenant``'s SGLang pools (``RANK:NS`` members)."""
    return f"{_S_REGISTRY}:{quote(tenant, safe='')}" if tenant else _S_REGISTRY


def pool_prefix(pid: PoolId) -> str:
    """The hash-tagged key prefix of one pool (namespaces and tenants are %-quoted: no braces
    or ``|`` inside)."""
    if pid.dialect == "v":
        return f"{v_prefix(pid.tenant)}r{pid.rank}:"
    return f"{_PREFIX}:{{{_owner(pid.tenant)}s:{pid.rank}:{quote(pid.namespace, safe='')}}}:"


@functools.lru_cache(maxsize=4096)
def pool_keys(pid: PoolId) -> tuple[str, ...]:
    """Every Redis key of one pool, in ``POOL_PARTS`` order: a pool script's ``KEYS``."""
    prefix = pool_prefix(pid)
    return tuple(prefix + part for part in POOL_PARTS)


class RedisBackend:
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
        initialises it: the initialize answers at once, and a task of this server walks the
        pool's stored keys in chunks of ``build_chunk`` (one short script each, see
        ``_lib.lua`` ``hidx_fill_chunk``) while every script maintains the index; lookups by
        hash answer ``NoHashIndex.building`` (400) until the walk is done (a few seconds per
        million stored keys). One server walks a build: the initialize that asks for the walk
        claims it in Redis in the same script (``_lib.lua`` ``hidx_claim``), and each step
        stamps the time, so servers initialising the pool meanwhile leave it to that one. A
        walk this server leaves by closing cleanly is released (``close``) and taken over at
        once; one cut short otherwise (the process killed, Redis unreachable for longer than
        ``failover_timeout``) once it has taken no step for ``walk_stale`` seconds. Either
        way by the next initialise of the pool by a server with the flag or by a lookup on
        one (``_resume_stopped_build``). Keeping the index costs each
        confirm and each evicting reserve about 3-4 us of Redis CPU per key. ``build_chunk``
        is for tests (a slow walk)."""
        self.target: RedisTarget = parse_target(url)
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
        # Seconds without a step after which a walk counts as stopped (for tests: shorter).
        self.walk_stale = WALK_STALE
        # This server's name in the claim of a build it walks (meta hbw, ``_lib.lua``
        # ``hidx_claim``): its own steps go on, another server's only after ``walk_stale``.
        self._walker = secrets.token_hex(8)
        self._builds: dict[PoolId, asyncio.Task[None]] = {}  # pools whose index this walks
        # Pools whose walk this server may hold in Redis: started here and neither finished
        # nor left to another server (a walk stopped by a failure keeps its claim), so
        # ``close`` releases each.
        self._walked: set[PoolId] = set()
        # Pools seen with a complete index (meta hx), and the epoch they were seen in: hx is
        # never taken back while the pool exists, and a pool goes away only with Redis's data.
        self._built: dict[PoolId, str] = {}
        self._client: aioredis.Redis | None = None  # single endpoint only: start-up checks
        self._topo: Topology | None = None
        self._ack: tuple[Any, ...] | None = None  # the WAIT/WAITAOF pipelined after a write
        self._replication: dict[str, float] = {}  # see durability_stats
        # What v_exists needs from each tenant's registry as this process last read it (see
        # ``store.redis.vexists``): where it starts, checked by each script to be current.
        # Several servers share the registry, so this is a guess, never an answer.
        self._v_known: dict[str, VPlan] = {}
        self._feed = ChangeSequencer()  # the change feed: its listener, calls in flight
        # The epoch, read again whenever Redis may have lost its data (``store.redis.epoch``);
        # a new one is reported to the change feed's listener, which states every pool again.
        # With a test clock there is no hold after a data loss: its end is Valkey's time,
        # which such a backend's scripts never compare with.
        hold = self._set_hold if clock is None else None
        self._epochs = RedisEpoch(_EPOCH_KEY, self._command, self._feed.lost, _HOLD_KEY, hold)
        # Whether a primary may evict kvmeta's keys (``store.redis.policy``).
        self._eviction = EvictionWatch(self._primaries)
        self._started = False  # start-up's own checks done: new links are watched from now

    async def _set_hold(self) -> float:
        """Redis lost its data: pools created for the longest lease (plus the clock-step bound)
        from now hand out no never-used page (``_lib.lua`` ``hold_after_loss``). Returns the
        hold's end (Valkey's time)."""
        seconds = max(self.reservation_ttl, self.read_lease) + float(self._step_bound)
        reply = await self._run("hold", (_HOLD_KEY,), [repr(seconds)])
        return float(reply[1])

    def _hold_arg(self) -> str:
        """The hold's end as initialize and v_register take it ('' for none)."""
        until = self._epochs.hold_until
        return repr(until) if until and self._clock is None else ""

    @property
    def describe(self) -> str:
        mode = self._topo.mode if self._topo is not None else self.target.mode
        kind = {"single": "redis", "cluster": "redis cluster", "sentinel": "redis sentinel"}[mode]
        return f"{kind} at {self.target.shown}"

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
        nxt, flat = _text(reply[0]), reply[1]
        out = [_text(flat[i]) for i in range(0, len(flat), 2)]
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
            n = await self._leading_fields(pool_keys(pool)[_HIDX], fields)
            if n == len(hashes) or (n and self._built.get(pool) == self._epochs.value):
                return n
        meta = pool_keys(pool)[0]
        size, hx, hb, stamp = await self._command(meta, "HMGET", meta, "n", "hx", "hb", "hbt")
        if size is None:
            raise await self._gone(pool)
        if pool.dialect == "s" and hx is not None and _text(hx) == "1":
            self._built[pool] = self._epochs.value
            return n
        if pool.dialect == "s" and hb is not None and _text(hb) == "1":
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
            await self.close()
            if "DB index is out of range" in str(exc) and await self._is_cluster_node():
                raise self._cluster_db_refused() from None
            raise BackendUnavailable(_set_up_refused(self.url, exc)) from None
        except (ConnectionError, RedisError, OSError) as exc:
            await self.close()
            raise BackendUnavailable(
                f"cannot reach Redis at {redact_url(self.url)}: {exc}"
            ) from None
        if not info.get("cluster_enabled"):
            return self.target
        parts = urlsplit(self.url)
        if parts.scheme == "unix" or parts.hostname is None:
            await self.close()
            raise ConfigError(
                f"`--backend` URL {self.target.shown} names a Redis Cluster node over a unix "
                "socket: a Cluster is reached over TCP, use redis+cluster://host:port",
                "backend",
            )
        if self.target.db:
            await self.close()
            raise self._cluster_db_refused()
        await client.aclose()
        self._client = None
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

    async def _install_on(self, node: Node) -> str:
        return await self._scripts.install(node.call)

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

    async def _gone(self, pool: PoolId) -> NotInitialized:
        """The error for a pool Redis says does not exist, once the epoch has been read again:
        a pool that vanished (FLUSHALL keeps every connection and kvmeta's code) is the one
        sign that Redis lost its data, and the reply must carry the new epoch."""
        await self._epochs.recheck()
        return NotInitialized.for_pool(pool.dialect, pool.rank, pool.namespace)

    async def close(self) -> None:
        """Stop this server's walks of index builds and release their claims, then close the
        connections. The walks' tasks finish before the release, so no step of theirs stamps
        a claim again after it."""
        builds = list(self._builds.values())
        for task in builds:
            task.cancel()
        await asyncio.gather(*builds, return_exceptions=True)
        await self._release_walks(sorted(self._walked))
        self._walked.clear()
        await self._eviction.close()
        if self._topo is not None:
            await self._topo.close()
            self._topo = None
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    async def _release_walks(self, pools: list[PoolId]) -> None:
        """Let go of the walks of ``pools``' index builds (``_lib.lua`` ``hidx_release``): a
        rolling restart gives every server a new id, so a claim left in place would keep
        lookups by hash answering "being built" for ``walk_stale`` seconds before any server
        resumed the walk. The normal call path, bounded by ``failover_timeout`` in all, so a
        Redis that does not answer delays shutdown no longer than one call's retries would;
        a claim not released is taken over once stale, as after a crash."""
        if not pools or self._topo is None:
            return
        calls = [self._run("hidx_release", pool_keys(pool), [self._walker]) for pool in pools]
        replies: list[Any]
        try:
            replies = await asyncio.wait_for(
                asyncio.gather(*calls, return_exceptions=True), self.failover_timeout
            )
        except asyncio.TimeoutError:
            late = BackendUnavailable(
                f"Redis did not answer within --failover-timeout {self.failover_timeout:g}s"
            )
            replies = [late] * len(pools)
        for pool, reply in zip(pools, replies, strict=True):
            if isinstance(reply, BaseException):
                logger.warning(
                    "%s: could not release this server's walk of its block-hash index build "
                    "(%s); a server with --hash-index resumes it once the walk has taken no "
                    "step for %.0f s",
                    pool,
                    reply,
                    self.walk_stale,
                )
            elif int(reply[0]):
                logger.info(
                    "%s: released the walk of its block-hash index build; the next server "
                    "with --hash-index to initialise the pool or look it up by hash resumes it",
                    pool,
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

    # ------------------------------------------------------------------ calls

    async def _run(self, script: str, keys: tuple[str, ...], args: list[Any]) -> list[Any]:
        """Run one script on the primary of ``keys[0]``'s slot; errors -> 503.

        ``keys`` is every key the script touches (all in one hash slot). A state-changing
        script gets the WAIT of ``--min-replicas-ack`` in the same send.
        """
        if script in _TIMED:
            assert len(args) + 1 == _TIMED[script], f"{script}: the bound goes after its arguments"
            args = [*args, self._step_bound]
            if self._clock is not None:
                args.append(repr(float(self._clock())))
        command = self._scripts.command(script, keys, args)
        wait = self._ack if self._ack is not None and self._scripts.writes(script) else None
        reply: list[Any] = _decode(await self._call(keys[0], command, script, wait))
        if reply[0] == 1 and script in _ANSWERS_GONE:
            await self._epochs.recheck()  # the pool is gone: see ``_gone``
        return reply

    async def _warn_old_layouts(self) -> None:
        """Log pools left by a kvmeta with another data layout: this one does not use them."""
        for prefix, registry in _OLD_LAYOUTS.items():
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

    async def _command(self, key: str, *args: Any) -> Any:
        """One plain command (registry, epoch) routed by ``key``, with the same retries."""
        return await self._call(key, args, str(args[0]), None)

    async def _call(
        self, key: str, command: tuple[Any, ...], what: str, wait: tuple[Any, ...] | None
    ) -> Any:
        """Send ``command`` (and ``wait``) to the node serving ``key`` until it succeeds.

        ``MOVED`` -> the new owner at once; ``ASK`` -> ``ASKING`` + the command on the target;
        kvmeta's code missing on the node -> install it there; a failover, lost connection or
        ``TRYAGAIN`` -> re-learn the topology and retry, backing off, until
        ``failover_timeout``; a write too few replicas acknowledged -> ask whether the node is
        still the primary (``Topology.recheck``) and, if another one took over, run it there.
        Every operation is idempotent, so a mutation whose reply was lost (or not
        acknowledged) may run again safely.
        """
        topo = self._topo
        if topo is None:
            raise BackendUnavailable(f"Redis backend {self.target.shown} is not started")
        deadline = 0.0
        delay = _FIRST_DELAY
        asking: Node | None = None
        installed = False
        hops = 0
        rechecks = 0
        where = self.target.shown
        node: Node | None = None
        while True:
            try:
                node = asking or topo.route(key)
                where = node.addr
                reply, acks = await self._send(node, command, wait, asking is not None)
            except (RedisError, OSError, asyncio.TimeoutError) as exc:
                asking = None
                if isinstance(exc, AskError) and hops < _MAX_REDIRECTS:
                    hops += 1
                    if isinstance(exc, MovedError):
                        topo.moved(exc.slot_id, exc.host, exc.port)
                    else:
                        asking = topo.node(exc.host, exc.port)
                    continue
                if self._scripts.missing(exc) and not installed and node is not None:
                    installed = True
                    self._epochs.doubt()  # (a node that lost its code may have lost its data)
                    logger.warning("Redis %s lacks kvmeta's code (%s): installing", where, exc)
                    await self._install_on(node)
                    continue
                if not (retriable(exc) or isinstance(exc, AskError)):
                    raise BackendUnavailable(
                        f"Redis backend at {where} failed during {what}: {exc}"
                    ) from exc
                now = time.monotonic()
                if not deadline:
                    deadline = now + self.failover_timeout
                elif now >= deadline:
                    why = f"; {topo.last_error}" if topo.last_error else ""
                    raise BackendUnavailable(
                        f"Redis backend at {where} failed during {what} and did not recover "
                        f"within --failover-timeout {self.failover_timeout:g}s: {exc}{why}"
                    ) from exc
                self._epochs.doubt()
                lost = not isinstance(exc, ResponseError) or isinstance(exc, ReadOnlyError)
                if lost and node is not None:  # its idle connections may be half-closed
                    await node.drop()
                await asyncio.sleep(min(delay, max(0.0, deadline - now)))
                delay = min(delay * 2, _MAX_DELAY)
                await topo.refresh()
                hops = 0
                continue
            if wait is not None:
                try:
                    self._check_acks(where, what, acks)
                except NotReplicated:
                    # Its replicas left it: a failover may have promoted one of them while
                    # this node stalled (it still answers as a primary until demoted).
                    rechecks += 1
                    assert node is not None
                    if rechecks <= _MAX_RECHECKS and await topo.recheck(node):
                        self._epochs.doubt()
                        hops = 0
                        continue
                    raise
            epochs = self._epochs
            if epochs.doubts != epochs.read_for and what not in EPOCH_COMMANDS:
                await epochs.settle()
            return reply

    def _check_acks(self, where: str, what: str, acks: Any) -> None:
        assert self._ack is not None
        n = self.min_replicas_ack
        got = int(acks[1]) if isinstance(acks, list) else int(acks)
        local = int(acks[0]) if isinstance(acks, list) else 1
        if got >= n and local >= 1:
            return
        raise NotReplicated(
            f"Redis primary {where}: {got} of {n} replica(s) acknowledged {what} within "
            f"{self.replica_ack_timeout:g}s (--min-replicas-ack {n}, --replica-ack-timeout)"
            + ("" if local >= 1 else " and the primary's AOF fsync did not complete")
            + "; the change may not survive a failover. The request is safe to retry"
        )

    async def _send(
        self, node: Node, command: tuple[Any, ...], wait: tuple[Any, ...] | None, asking: bool
    ) -> tuple[Any, Any]:
        """One write and its replies, on a link of ``node`` (``store.redis.link``), the request
        packed by ``store.redis.resp``: redis-py's client and its connection pool cost well over
        twice the CPU per call (benchmarks/README.md, "Implementation costs")."""
        head = 3 + int(command[2]) if command[0] in _SCRIPT_CALLS else 0
        if wait is None and not asking:
            replies = await node.request(pack(command, head), 1)
        else:
            parts: list[tuple[tuple[Any, ...], int]] = []
            if asking:
                parts.append((("ASKING",), 1))
            parts.append((command, head))
            if wait is not None:
                parts.append((wait, len(wait)))
            replies = await node.request(pack_many(parts), len(parts), wait is not None)
        for reply in replies:
            if isinstance(reply, Exception):
                raise reply
        return replies[int(asking)], replies[-1] if wait is not None else None

    async def _pool_op(self, script: str, pid: PoolId, request: Any) -> list[Any]:
        """Run one pool script with ``request`` as its JSON argument; raise its error code."""
        reply = await self._run(script, pool_keys(pid), [_encode(request)])
        return _checked(pid, reply, request)

    async def _changing(
        self,
        script: str,
        pid: PoolId,
        keys: tuple[str, ...],
        args: list[Any],
        kind: str,
        reason: str,
    ) -> list[Any]:
        """Run a script that changes stored keys, with the feed flag as its last argument. With
        a listener, its reply ends with ``[change counter, key, ...]`` when it changed any,
        which becomes one ``Change`` (``keys`` empty for CLEARED), delivered in counter order."""
        if self._feed.listener is None:
            return await self._run(script, keys, [*args, "0"])
        ticket = self._feed.begin(pid)
        try:
            reply = await self._run(script, keys, [*args, "1"])
        except BaseException:
            # Sent, perhaps run (a lost reply, a replica wait that fell short, a script error
            # after some writes, a cancelled caller): the pool is reported UNSURE.
            self._feed.end(ticket, unsure=True)
            raise
        if reply and isinstance(reply[-1], list):
            fed = reply.pop()
            changed = () if kind == CLEARED else tuple(_text(k) for k in fed[1:])
            self._feed.end(ticket, int(fed[0]), Change(pid, kind, changed, reason))
        else:
            self._feed.end(ticket)
        return reply

    async def _changing_op(
        self, script: str, pid: PoolId, request: Any, kind: str, reason: str
    ) -> list[Any]:
        """``_pool_op`` for a script that changes stored keys (``_changing``)."""
        keys = pool_keys(pid)
        reply = await self._changing(script, pid, keys, [_encode(request)], kind, reason)
        return _checked(pid, reply, request)

    # ------------------------------------------------------------------ dialect S (and V pools)

    async def initialize(self, pool: PoolId, num_pages: int) -> InitResult:
        if pool.dialect == "v":  # a vLLM pool is a registered rank (as in MemoryStore)
            return await self.v_register(pool.rank, num_pages, None, pool.tenant)
        await self._sadd_pool(pool)
        args: list[Any] = [num_pages, "1" if self.hash_index else "0", self.build_chunk]
        args += [self.walk_stale, self._walker, self._hold_arg()]
        reply = await self._run("initialize", pool_keys(pool), args)
        _checked(pool, reply, None)
        if len(reply) > 3 and reply[3]:
            self._start_build(pool)  # the script claimed the walk for this server
        return self._init_result(pool, reply, num_pages)

    async def _resume_stopped_build(self, pool: PoolId, stamp: Any) -> None:
        """A lookup found ``pool``'s index being built: take the walk over when no server
        holds it, so a stopped build does not wait for the pool's next initialise. ``stamp``
        (meta ``hbt``, Redis time of the walk's latest step) is None once the walk's server
        released it as it closed: taken over at once. Otherwise the walk is taken over when
        it has taken no step for ``walk_stale`` seconds (its server was killed, or lost
        Redis); live walks stamp each step, so a walk under way is left alone. Of servers
        whose lookups find a stopped walk at once, the first step of one takes it over and
        the others' first steps find it taken (``_lib.lua`` ``hidx_claim``): one walks."""
        task = self._builds.get(pool)
        if task is not None and not task.done():
            return
        if stamp is None:
            self._start_build(pool)  # released: a walk as any other (its first step claims it)
            return
        meta = pool_keys(pool)[0]
        seconds, micros = await self._command(meta, "TIME")
        still = int(seconds) + int(micros) / 1e6 - float(_text(stamp))
        if still < self.walk_stale:
            return
        self._start_build(pool, f"{still:.0f} s")

    def _start_build(self, pool: PoolId, idle: str | None = None) -> None:
        """Walk ``pool``'s stored keys into its hash index in the background (``_build``),
        unless this server walks it already. ``idle``: taking over a walk that has taken no
        step for that long (its first step claims it, or finds it taken)."""
        task = self._builds.get(pool)
        if task is not None and not task.done():
            return
        self._walked.add(pool)
        self._builds[pool] = asyncio.create_task(self._build(pool, idle), name=f"hash index {pool}")

    async def _build(self, pool: PoolId, idle: str | None = None) -> None:
        """Build ``pool``'s hash index: ``hidx_fill`` chunk by chunk, each on the normal call
        path (retries across a failover), until the chunk that completes it. Each step goes on
        only while the walk is this server's (``_lib.lua`` ``hidx_claim``): claimed by this
        server's initialize, or by the first step here (a walk released by its server, or
        ``idle``: one that has taken no step for that long). A step that finds another
        server's walk live stops this one: that server walks it. A walk always starts from
        the first stored key (HSCAN cursor 0): its cursor is this task's alone, and adding a
        key's page again changes nothing. A failure leaves the pool marked as being built,
        and its walk is taken over once it has taken no step for ``walk_stale`` seconds (or
        at once, if ``close`` released it), by the next initialise with the flag or a lookup
        (``_resume_stopped_build``)."""
        keys, cursor, visited = pool_keys(pool), "0", 0
        started = time.monotonic()
        if idle is None:
            logger.info("%s: building its block-hash index from its stored keys", pool)
        ended = False  # built, the pool gone, or the walk another server's: nothing held
        try:
            while True:
                args = [cursor, self.build_chunk, self._walker, self.walk_stale]
                reply = await self._run("hidx_fill", keys, args)
                code = int(reply[0])
                ended = code != 0 or _text(reply[1]) == "0"
                if code == 1:
                    return  # the pool went away (Redis lost its data)
                if code == 2:
                    logger.info(
                        "%s: another kvmeta server walks the build of its block-hash index; "
                        "this one leaves it (after %d keys)",
                        pool,
                        visited,
                    )
                    return
                if idle is not None:
                    logger.warning(
                        "%s: the build of its block-hash index has taken no step for %s; "
                        "resuming it here",
                        pool,
                        idle,
                    )
                    idle = None
                cursor, visited = _text(reply[1]), visited + int(reply[2])
                if cursor == "0":
                    break
        except KvmetaError as exc:
            logger.warning(
                "%s: building its block-hash index stopped after %d keys: %s; lookups by hash "
                "answer 'being built' until a server with --hash-index resumes it (at the "
                "pool's next initialise or at a lookup, once the walk has taken no step for "
                "%.0f s, or when this server releases it as it closes)",
                pool,
                visited,
                exc,
                self.walk_stale,
            )
            return
        finally:
            if self._builds.get(pool) is asyncio.current_task():
                del self._builds[pool]
                if ended:
                    self._walked.discard(pool)
        logger.info(
            "%s: block-hash index built (%d stored keys visited in %.1fs)",
            pool,
            visited,
            time.monotonic() - started,
        )

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
            await self._command(_TENANTS, "SADD", _TENANTS, quote(tenant, safe=""))

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

    async def reserve(self, pool: PoolId, keys: list[str]) -> list[tuple[bool, int]]:
        # vLLM's batches are all or nothing (reserve.lua, as ``core.pool.Pool.reserve``).
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
                (_text(reply[2]), int(reply[3])),
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
            _checked(pool, reply, None)
            cursor, total = _text(reply[1]), total + int(reply[2])
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

    @staticmethod
    def _v_keys(tenant: str) -> tuple[str, str]:
        """``tenant``'s rank registry and world size keys."""
        prefix = v_prefix(tenant)
        return prefix + "ranks", prefix + "world"

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
        keys = (*self._v_keys(tenant), *pool_keys(pool))
        world = "" if world_size is None else world_size
        args = [rank, num_pages, world, self._hold_arg(), "1" if change_world else "0"]
        reply = _checked(pool, await self._run("v_register", keys, args), world_size)
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
        registry = self._v_keys(tenant)

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
        keys = (self._v_keys(tenant)[0], *pool_keys(pool))
        args: list[Any] = [rank, "1" if force else "0"]
        reply = await self._changing("v_remove", pool, keys, args, CLEARED, REASON_DROP)
        if int(reply[0]) == _IN_USE:
            raise RankInUse.for_rank(rank, int(reply[1]), float(reply[2]))
        dropped = int(reply[1])
        self._v_known.pop(tenant, None)
        return None if dropped < 0 else dropped

    async def v_set_world_size(self, world_size: int | None, tenant: str = "") -> None:
        world = self._v_keys(tenant)[1]
        await self._run("v_world", (world,), ["" if world_size is None else world_size])
        self._v_known.pop(tenant, None)

    async def v_index(self, tenant: str = "") -> VIndex:
        return await self._v_registry(tenant)

    async def _v_registry(self, tenant: str = "") -> VIndex:
        """The rank registry and world size, read in one script (``v_index.lua``)."""
        reply = await self._run("v_index", self._v_keys(tenant), [])
        world = _text(reply[1])
        ranks = tuple(sorted(int(r) for r in reply[2:]))
        index = VIndex(int(world) if world else None, ranks)
        self._v_known[tenant] = VPlan.of(index)
        return index

    # ------------------------------------------------------------------ stats and check

    async def pools(self) -> list[PoolId]:
        """Every pool known to this Redis, every tenant's, sorted like ``MemoryStore.stats``."""
        listed = await self._command(_TENANTS, "SMEMBERS", _TENANTS)
        tenants = ["", *sorted(unquote(_text(t)) for t in listed)]
        out = []
        for tenant in tenants:
            registry = s_registry(tenant)
            ranks = self._v_keys(tenant)[0]
            s_members = await self._command(registry, "SMEMBERS", registry)
            v_members = await self._command(ranks, "SMEMBERS", ranks)
            out += [PoolId("v", int(r), "", tenant) for r in v_members]
            for member in s_members:
                rank, ns = _text(member).split(":", 1)
                out.append(PoolId("s", int(rank), unquote(ns), tenant))
        return sorted(out)

    async def budget(self, pool: PoolId) -> Budget:
        """O(pools) but cheap: one HGET of each pool's size, ``_BUDGET_BATCH`` at a time
        concurrently (pools are created once per engine start, and they live in Redis)."""
        pids = await self.pools()
        sizes: dict[PoolId, int] = {}
        for i in range(0, len(pids), _BUDGET_BATCH):
            batch = pids[i : i + _BUDGET_BATCH]
            metas = [pool_keys(pid)[0] for pid in batch]
            found = await asyncio.gather(*(self._command(m, "HGET", m, "n") for m in metas))
            for pid, n in zip(batch, found, strict=True):
                if n is not None:  # None: listed before it was created (see _sadd_pool)
                    sizes[pid] = int(n)
        tenant = [n for pid, n in sizes.items() if pid.tenant == pool.tenant]
        return Budget(pool in sizes, sum(sizes.values()), sum(tenant), len(tenant))

    async def stats(self) -> list[PoolStats]:
        out: list[PoolStats] = []
        async for chunk in self.stats_chunks():
            out += chunk
        return out

    async def stats_chunks(self, size: int = STATS_CHUNK) -> AsyncIterator[list[PoolStats]]:
        """One script call per pool: every call frees the loop while it waits for Redis."""
        pids = await self.pools()
        for i in range(0, len(pids), size):
            chunk = [await self._pool_stats(pid) for pid in pids[i : i + size]]
            yield [st for st in chunk if st is not None]

    async def _pool_stats(self, pid: PoolId) -> PoolStats | None:
        """None: listed before it was created (see _sadd_pool)."""
        reply = await self._run("stats", pool_keys(pid), [])
        if int(reply[0]):
            return None
        n, reserved, stored = int(reply[1]), int(reply[2]), int(reply[3])
        # Only counters are read: meta also holds fields that are not integers (the time
        # of a hash-index build's latest step, hbt).
        meta = {_text(reply[4][i]): reply[4][i + 1] for i in range(0, len(reply[4]), 2)}
        cooling = int(reply[5])
        return PoolStats(
            pool=pid,
            num_pages=n,
            free=n - reserved - stored - cooling,
            reserved=reserved,
            stored=stored,
            counters={name: int(meta.get("c:" + name, 0)) for name in _COUNTERS},
            size_conflicts=int(meta.get("conflicts", 0)),
            cooling=cooling,
        )

    async def check(self) -> CheckReport:
        """Page-invariant violations in every pool (empty: consistent; at most 20 per pool).

        O(pool) in total but in chunks of ``CHECK_CHUNK`` entries, one short read-only script
        each (see ``check.lua``), so checking a big pool never stalls Redis for other pools.
        Each entry is checked atomically against the rest of the pool and the size totals in
        one call, so requests served between chunks cannot cause a false report.
        """
        problems = []
        checked = 0
        for pid in await self.pools():
            keys = pool_keys(pid)
            found: list[str] = []
            listed_only = False
            for part in _CHECK_PARTS:
                cursor = "0"
                while len(found) < _MAX_PROBLEMS:
                    reply = await self._run("check", keys, [part, cursor, CHECK_CHUNK])
                    if int(reply[0]):
                        listed_only = True  # listed before it was created (see _sadd_pool)
                        break
                    found += [f"{pid}: {_text(msg)}" for msg in reply[2:]]
                    cursor = _text(reply[1])
                    if cursor == "0":
                        break
            checked += not listed_only
            problems += found[:_MAX_PROBLEMS]
        return CheckReport(problems=problems, checked=checked)
