"""State in Redis/Valkey, shared by any number of stateless kvmeta servers.

Every operation on a pool is ONE Lua script (``store/lua/<op>.lua``, with ``_lib.lua``
prepended), so servers never race on a read-modify-write: Redis runs each script atomically.
Scripts run by EVALSHA (loaded on NOSCRIPT) on redis-py connections and keep exactly the
semantics of ``core.pool`` + ``store.memory``; the contract suite runs against both.

Key layout (see ``_lib.lua`` for the per-pool structures): each SGLang pool lives under its own
hash tag ``kvmeta:{s:RANK:NS}:``, so on a Redis Cluster pools spread over shards while one pool's
keys stay in one slot. The vLLM index (per-rank pools, the rank registry and the world size) is
one unit under ``kvmeta:{v}:``, because completeness and ``/clear`` span every rank atomically.
A pool script gets every key it touches in ``KEYS`` (``pool_keys``), as Redis Cluster requires;
the vLLM index scripts (``v_*``) still name per-rank keys inside Lua (all in the ``{v}`` slot).
``kvmeta:pools`` lists the SGLang pools, for stats only.

Time (reservation and read leases) is Redis ``TIME``, read inside each script, so servers with
skewed clocks still agree (tests that compare this backend with the memory one step by step give
both one clock instead: ``RedisBackend(clock=...)``, see ``_TIMED``). A request's keys travel as
ONE JSON argument and the reply is one JSON array ``[code, ...]`` (``_ERRORS`` maps codes to
errors): packing and parsing one value per key in Python costs more than the whole script takes
to run in Redis.

Whole-pool work (``clear``, ``check``) runs as many short scripts, one bounded chunk each, looped
from Python: one long script would stall every pool on that Redis for its whole duration.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import logging
from collections.abc import Callable
from importlib import resources
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, quote, unquote, urlsplit, urlunsplit

import msgspec
import redis.asyncio as aioredis
from redis.asyncio.connection import AbstractConnection
from redis.exceptions import (
    AuthenticationError,
    ConnectionError,
    NoScriptError,
    RedisError,
    ResponseError,
)

from kvmeta._types import PoolId
from kvmeta.core.pool import PoolCounters
from kvmeta.errors import (
    BackendUnavailable,
    ConfigError,
    InvalidRequest,
    KvmetaError,
    NotInitialized,
)
from kvmeta.store.base import CheckReport, InitResult, PoolStats, VIndex
from kvmeta.store.epoch import new_epoch

__all__ = ["POOL_PARTS", "RedisBackend", "check_url", "pool_keys", "redact_url"]

logger = logging.getLogger(__name__)

_PREFIX = "kvmeta"
_S_REGISTRY = f"{_PREFIX}:pools"
_EPOCH_KEY = f"{_PREFIX}:epoch"  # names the state this Redis holds (``Backend.epoch``)
_V_PREFIX = f"{_PREFIX}:{{v}}:"
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
    "v_clear",
    "v_remove",
    "v_world",
    "v_index",
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
)
# Entries per clear/check script call: a few milliseconds of Redis time per chunk (measured in
# benchmarks/README.md, "Redis backend"), so other pools wait at most that long behind a clear
# or check of any size.
CLEAR_CHUNK = 500
CHECK_CHUNK = 1000
_CHECK_PARTS = ("pk", "stored", "reserved", "free", "cool", "lru", "resq", "totals")
# Scripts that read the time, and the ARGV index of the time they take instead of Redis TIME when
# the backend has a test clock (one past their own arguments; absent in production, see _lib.lua
# ``now_s``). A static test checks each script reads exactly this ARGV.
_TIMED = {"reserve": 2, "confirm": 2, "get": 2, "delete": 2, "clear": 3, "stats": 1, "v_clear": 1}
_MAX_PROBLEMS = 20
_MAX_IDLE = 64  # connections kept open per server process for concurrent requests
# The pool's event counters (``c:<name>`` in a pool's meta hash), named once, in the core: a
# counter added to ``PoolCounters`` is reported here at once (the Lua bumps it by name).
_COUNTERS = tuple(f.name for f in dataclasses.fields(PoolCounters))
_FIELDS = {1: ("written_keys_to_confirm", "confirm"), 2: ("pages_to_release", "release")}


def _out_of_range(pid: PoolId, reply: list[Any], request: Any) -> KvmetaError:
    which, index = int(reply[1]), int(reply[2])
    field, verb = _FIELDS[which]
    pairs, release = request
    page = pairs[index][1] if which == 1 else release[index]
    n = int(reply[3])
    return InvalidRequest(
        f"page {page} in `{field}` is outside this pool's pages 0..{n - 1}; {verb} only pages "
        "returned by reserve",
        field,
    )


def _bad_size(pid: PoolId, reply: list[Any], request: Any) -> KvmetaError:
    return InvalidRequest(f"num_pages must be a positive integer, got {reply[1]}", "num_pages")


# Script error code -> the kvmeta error it means (code 0 is success).
_ERRORS: dict[int, Callable[[PoolId, list[Any], Any], KvmetaError]] = {
    1: lambda pid, reply, request: NotInitialized.for_pool(pid.dialect, pid.rank, pid.namespace),
    2: _out_of_range,
    3: _bad_size,
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


def redact_url(url: str) -> str:
    """``url`` with any password replaced by ``***``, for logs and error messages."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.rsplit("@", 1)[1]
    user = parts.username or ""
    return urlunsplit(parts._replace(netloc=f"{user}:***@{netloc}"))


# URL query parameters that name a file redis-py opens only when it connects.
_TLS_FILES = ("ssl_certfile", "ssl_keyfile", "ssl_ca_certs", "ssl_ca_path")
_DB_HINT = (
    "databases are numbered 0..N-1, N being Redis's `databases` setting (16 by default); "
    "write the number after the port, e.g. redis://host:6379/0"
)


def check_url(url: str) -> None:
    """Refuse a ``--backend`` URL that redis-py would misread or fail on only when connecting.

    redis-py takes ``/abc`` as database 0 without a word, and opens TLS files only inside the
    connection attempt (a bare "No such file" with no name); both are checked here instead.

    Raises:
        ConfigError: naming the part of the URL and the fix.
    """
    shown = redact_url(url)
    parts = urlsplit(url)
    if parts.scheme not in ("redis", "rediss", "unix"):
        raise ConfigError(
            f"Expected `--backend` to be a redis://, rediss:// or unix:// URL, got {shown!r}"
            " (env KVMETA_BACKEND or KVMETA_REDIS_URL)",
            "backend",
        )
    try:
        parts.port  # noqa: B018  (raises on a port that is not a number 0..65535)
    except ValueError as exc:
        raise ConfigError(f"`--backend` URL {shown}: {exc}", "backend") from None
    query = parse_qs(parts.query, keep_blank_values=True)
    dbs = [f"db={v}" for v in query.get("db", [])]
    if parts.scheme != "unix" and parts.path not in ("", "/"):
        dbs.append(parts.path)
    for db in dbs:
        number = db[3:] if db.startswith("db=") else unquote(db[1:])
        if not (number.isascii() and number.isdecimal()):
            raise ConfigError(
                f"`--backend` URL {shown}: the database {db!r} is not a number; {_DB_HINT}",
                "backend",
            )
    for param in _TLS_FILES:
        for value in query.get(param, []):
            if not Path(value).exists():
                raise ConfigError(
                    f"`--backend` URL {shown}: {param}={value}: file not found (the path is "
                    "read on the machine running kvmeta; fix it or drop the parameter)",
                    "backend",
                )


def _set_up_refused(url: str, exc: RedisError) -> str:
    """Start-up message for a Redis that answered but refused the connection set-up."""
    answer = str(exc)
    text = f"Redis at {redact_url(url)} refused the connection set-up: {answer!r}"
    if "DB index is out of range" in answer:
        db = urlsplit(url).path or "?db=" + ",".join(parse_qs(urlsplit(url).query).get("db", []))
        return f"{text}: it has no database {db} ({_DB_HINT})"
    if isinstance(exc, AuthenticationError) or "auth" in answer.lower():
        return (
            f"{text}: check the password in the URL (redis://:PASSWORD@host:port/db, or "
            "redis://USER:PASSWORD@... for an ACL user)"
        )
    return text


def pool_prefix(pid: PoolId) -> str:
    """The hash-tagged key prefix of one pool (namespaces are %-quoted: no braces inside)."""
    if pid.dialect == "v":
        return f"{_V_PREFIX}r{pid.rank}:"
    return f"{_PREFIX}:{{s:{pid.rank}:{quote(pid.namespace, safe='')}}}:"


@functools.lru_cache(maxsize=4096)
def pool_keys(pid: PoolId) -> tuple[str, ...]:
    """Every Redis key of one pool, in ``POOL_PARTS`` order: a pool script's ``KEYS``."""
    prefix = pool_prefix(pid)
    return tuple(prefix + part for part in POOL_PARTS)


def _load_sources() -> dict[str, str]:
    lua = resources.files("kvmeta.store").joinpath("lua")
    lib = lua.joinpath("_lib.lua").read_text()
    return {name: lib + "\n" + lua.joinpath(f"{name}.lua").read_text() for name in _SCRIPTS}


class RedisBackend:
    """The ``Backend`` over Redis/Valkey: ``redis://[:password@]host:port/db``, ``rediss://``
    (TLS) or ``unix:///path/redis.sock?db=0`` (same machine; cheaper than loopback TCP)."""

    name = "redis"

    def __init__(
        self,
        url: str,
        *,
        reservation_ttl: float = 300.0,
        read_lease: float = 5.0,
        clock: Callable[[], float] | None = None,
    ):
        """``clock`` is for tests only: every script that reads the time gets ``clock()``
        (seconds) instead of Redis ``TIME``, so a test can drive this backend and a
        ``MemoryStore`` from one clock and step time past leases. It is a constructor argument
        and nothing else (no flag, URL parameter or request field sets it): several servers on
        one Redis must share Redis's clock. None (production) adds nothing to a call."""
        check_url(url)
        self.url = url
        self._clock = clock
        self.reservation_ttl = reservation_ttl
        self.read_lease = read_lease
        self._client: aioredis.Redis | None = None
        self._idle: list[AbstractConnection] = []
        self._epoch = new_epoch()  # replaced by Redis's own at start
        self._sources = _load_sources()
        self._shas = {
            name: hashlib.sha1(src.encode()).hexdigest() for name, src in self._sources.items()
        }

    @property
    def epoch(self) -> str:
        """The ``kvmeta:epoch`` key as read at start-up (created there when missing)."""
        return self._epoch

    @property
    def describe(self) -> str:
        return f"redis at {redact_url(self.url)}"

    @property
    def failure(self) -> str | None:
        return None  # an unreachable Redis is an error per call (503), not a standing state

    def durability_stats(self) -> dict[str, float]:
        return {}  # Redis keeps its own persistence (RDB/AOF); nothing on this machine's disk

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Connect and check Redis answers, so a wrong URL fails at start-up, not per request.

        Raises:
            ConfigError: redis-py does not understand the URL.
            BackendUnavailable: Redis cannot be reached at the URL, or it answered but refused
                the connection set-up (wrong database or password: Redis's own answer is in
                the message).
        """
        try:
            client = aioredis.from_url(self.url, decode_responses=False, health_check_interval=30)
        except (ValueError, TypeError) as exc:
            raise ConfigError(
                f"`--backend` URL {redact_url(self.url)} is not understood: {exc}", "backend"
            ) from None
        self._client = client
        self._idle = []
        try:
            await client.ping()
        except (ResponseError, AuthenticationError) as exc:
            await self.close()
            raise BackendUnavailable(_set_up_refused(self.url, exc)) from None
        except (ConnectionError, RedisError, OSError) as exc:
            await self.close()
            raise BackendUnavailable(
                f"cannot reach Redis at {redact_url(self.url)}: {exc}"
            ) from None
        try:  # the first server on this Redis names its epoch; the others adopt it
            await client.set(_EPOCH_KEY, new_epoch(), nx=True)
            self._epoch = _text(await client.get(_EPOCH_KEY))
        except (RedisError, OSError) as exc:
            await self.close()
            raise BackendUnavailable(
                f"cannot read the epoch key from {redact_url(self.url)}: {exc}"
            ) from exc
        try:  # load every script now; EVALSHA reloads one only if Redis loses it later
            for source in self._sources.values():
                await client.script_load(source)
        except (RedisError, OSError) as exc:
            await self.close()
            raise BackendUnavailable(
                f"cannot load scripts into {redact_url(self.url)}: {exc}"
            ) from exc

    async def close(self) -> None:
        idle, self._idle = self._idle, []
        for conn in idle:
            await conn.disconnect()
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    async def ready(self) -> bool:
        if self._client is None:
            return False
        try:
            return bool(await self._client.ping())
        except (RedisError, OSError):
            return False

    # ------------------------------------------------------------------ calls

    async def _run(self, script: str, keys: str | tuple[str, ...], args: list[Any]) -> list[Any]:
        """EVALSHA one script on a connection of our own (see ``_evalsha``); errors -> 503.

        ``keys`` is every key the script touches (a pool's ``pool_keys``), or one prefix for
        the vLLM index scripts that still name keys inside Lua.
        """
        if self._client is None:
            raise BackendUnavailable(f"Redis backend {redact_url(self.url)} is not started")
        if self._clock is not None and script in _TIMED:
            assert len(args) + 1 == _TIMED[script], f"{script}: the time goes after its arguments"
            args = [*args, repr(float(self._clock()))]
        conn = self._idle.pop() if self._idle else self._new_connection()
        try:
            names = (keys,) if isinstance(keys, str) else keys
            raw = await self._evalsha(conn, script, names, args)
        except BaseException as exc:
            # A failed or cancelled call may leave a reply in flight: never reuse the socket.
            await conn.disconnect(nowait=True)
            if isinstance(exc, (RedisError, OSError)):
                raise BackendUnavailable(
                    f"Redis backend at {redact_url(self.url)} failed during {script}: {exc}"
                ) from exc
            raise
        if len(self._idle) < _MAX_IDLE:
            self._idle.append(conn)
        else:
            await conn.disconnect()
        reply: list[Any] = _decode(raw)
        return reply

    def _new_connection(self) -> AbstractConnection:
        assert self._client is not None
        pool = self._client.connection_pool
        return pool.connection_class(**pool.connection_kwargs)

    async def _evalsha(
        self, conn: AbstractConnection, script: str, keys: tuple[str, ...], args: list[Any]
    ) -> Any:
        """EVALSHA, and on NOSCRIPT (Redis restarted or flushed its scripts) load it and retry.

        Straight on a redis-py ``Connection`` (which still does URL, auth, TLS, db and the
        protocol): ``register_script`` through the client's pool costs well over twice the CPU
        per call, enough to decide whether a kvmeta worker stays within 2x of the embedded
        server's CPU per request (benchmarks/README.md, "Implementation costs").
        """
        packed = conn.pack_command("EVALSHA", self._shas[script], len(keys), *keys, *args)
        await conn.send_packed_command(packed, check_health=False)
        try:
            return await conn.read_response()
        except NoScriptError:
            logger.warning(
                "Redis lost kvmeta's %s script (restart or SCRIPT FLUSH): loading", script
            )
            await conn.send_command("SCRIPT", "LOAD", self._sources[script])
            await conn.read_response()
            await conn.send_packed_command(packed, check_health=False)
            return await conn.read_response()

    async def _pool_op(self, script: str, pid: PoolId, request: Any) -> list[Any]:
        """Run one pool script with ``request`` as its JSON argument; raise its error code."""
        reply = await self._run(script, pool_keys(pid), [_encode(request)])
        return _checked(pid, reply, request)

    # ------------------------------------------------------------------ dialect S (and V pools)

    async def initialize(self, pool: PoolId, num_pages: int) -> InitResult:
        if pool.dialect == "v":  # a vLLM pool is a registered rank (as in MemoryStore)
            return await self.v_register(pool.rank, num_pages, None)
        await self._sadd_pool(pool)
        reply = await self._run("initialize", pool_keys(pool), [num_pages])
        _checked(pool, reply, None)
        return self._init_result(pool, reply, num_pages)

    async def _sadd_pool(self, pool: PoolId) -> None:
        # Before the pool exists, so a crash in between leaves a listed-but-absent pool (stats
        # skips it), never an unlisted one.
        assert self._client is not None
        try:
            await self._client.sadd(_S_REGISTRY, f"{pool.rank}:{quote(pool.namespace, safe='')}")
        except (RedisError, OSError) as exc:
            raise BackendUnavailable(
                f"Redis backend at {redact_url(self.url)} failed: {exc}"
            ) from exc

    def _init_result(self, pool: PoolId, reply: list[Any], requested: int) -> InitResult:
        result = InitResult(created=bool(reply[1]), num_pages=int(reply[2]), requested=requested)
        if result.conflict:
            logger.warning(
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
        reply = await self._pool_op("reserve", pool, (self.reservation_ttl, keys))
        return [(bool(reply[i]), reply[i + 1]) for i in range(1, len(reply), 2)]

    async def confirm(self, pool: PoolId, pairs: list[tuple[str, int]], release: list[int]) -> int:
        """Returns how many pairs were refused (stale or foreign pages)."""
        reply = await self._pool_op("confirm", pool, (pairs, release))
        refused = int(reply[1])
        if refused:
            logger.warning(
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
        return int((await self._pool_op("delete", pool, keys))[1])

    async def clear(self, pool: PoolId) -> int:
        """Clear in chunks of ``CLEAR_CHUNK`` keys (one script each, see ``clear.lua``)."""
        keys, cursor, total = pool_keys(pool), "0", 0
        while True:
            reply = _checked(pool, await self._run("clear", keys, [cursor, CLEAR_CHUNK]), None)
            cursor, total = _text(reply[1]), total + int(reply[2])
            if cursor == "0":
                return total

    # ------------------------------------------------------------------ vLLM index

    async def v_register(self, rank: int, num_pages: int, world_size: int | None) -> InitResult:
        pool = PoolId("v", rank, "")
        args = [rank, num_pages, "" if world_size is None else world_size]
        reply = _checked(pool, await self._run("v_register", _V_PREFIX, args), None)
        return self._init_result(pool, reply, num_pages)

    async def v_exists(self, keys: list[str]) -> list[bool]:
        reply = await self._run("v_exists", _V_PREFIX, [_encode(keys)])
        return [bool(x) for x in reply[1:]]

    async def v_clear(self) -> int:
        return int((await self._run("v_clear", _V_PREFIX, []))[1])

    async def v_remove(self, rank: int) -> int | None:
        dropped = int((await self._run("v_remove", _V_PREFIX, [rank]))[1])
        return None if dropped < 0 else dropped

    async def v_set_world_size(self, world_size: int | None) -> None:
        await self._run("v_world", _V_PREFIX, ["" if world_size is None else world_size])

    async def v_index(self) -> VIndex:
        reply = await self._run("v_index", _V_PREFIX, [])
        world = _text(reply[1])
        ranks = tuple(sorted(int(r) for r in reply[2:]))
        return VIndex(int(world) if world else None, ranks)

    # ------------------------------------------------------------------ stats and check

    async def pools(self) -> list[PoolId]:
        """Every pool known to this Redis, sorted like ``MemoryStore.stats``."""
        assert self._client is not None
        try:
            s_members = await self._client.smembers(_S_REGISTRY)
            v_members = await self._client.smembers(_V_PREFIX + "ranks")
        except (RedisError, OSError) as exc:
            raise BackendUnavailable(
                f"Redis backend at {redact_url(self.url)} failed: {exc}"
            ) from exc
        out = [PoolId("v", int(r), "") for r in v_members]
        for member in s_members:
            rank, ns = _text(member).split(":", 1)
            out.append(PoolId("s", int(rank), unquote(ns)))
        return sorted(out)

    async def budget(self, pool: PoolId) -> tuple[bool, int]:
        """O(pools): pools are created once per engine start, and they live in Redis."""
        sizes = {st.pool: st.num_pages for st in await self.stats()}
        return pool in sizes, sum(sizes.values())

    async def stats(self) -> list[PoolStats]:
        out = []
        for pid in await self.pools():
            reply = await self._run("stats", pool_keys(pid), [])
            if int(reply[0]):
                continue  # listed before it was created (see _sadd_pool)
            n, reserved, stored = int(reply[1]), int(reply[2]), int(reply[3])
            meta = {_text(reply[4][i]): int(reply[4][i + 1]) for i in range(0, len(reply[4]), 2)}
            out.append(
                PoolStats(
                    pool=pid,
                    num_pages=n,
                    free=n - reserved - stored,
                    reserved=reserved,
                    stored=stored,
                    counters={name: meta.get("c:" + name, 0) for name in _COUNTERS},
                    size_conflicts=meta.get("conflicts", 0),
                )
            )
        return out

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
