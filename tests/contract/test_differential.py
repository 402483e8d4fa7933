"""The memory and Redis backends are one state machine: hypothesis drives both side by side.

``core.pool`` (behind ``MemoryStore``) is the reference; the Lua scripts implement the same
machine again, atomically in Redis. Both backends get the SAME clock (``RedisBackend(clock=...)``
passes it to every script that reads time), so time steps cross reservation leases, read leases
and the release grace exactly as the model says. After every step the replies (or the error
class, message and field), every stats line (counters included) and the vLLM index must be
identical, and each store's page invariant must hold. The Redis backend's change feed is
checked too (``Fed``): a model built only from the changes it reports (stored keys added, removed
keys taken away, a cleared or dropped pool emptied) must equal each pool's stored keys in Redis
after every step, and no change may store a key already stored or remove one that is not.

The sequences are derandomized (the same every run), so CI compares and never flakes; a failure
is shrunk to a short sequence. The scripts are the same Lua on every topology, so one Redis node
runs the full depth (120 sequences) and a cluster and a Sentinel group run the first fifth of
them: enough to cross their routing (keys of every pool on their slots, a replica acknowledging
the writes) on every operation, each sample still reaching every event of ``MUST_SEE``.
Every operation of ``store.base.Backend`` has a rule here: a new operation lands with its rule.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from kvmeta._types import PoolId
from kvmeta.core.invariants import check_pool
from kvmeta.core.pool import RELEASE_GRACE
from kvmeta.errors import KvmetaError
from kvmeta.store.base import Backend
from kvmeta.store.changes import CLEARED, LOST, REMOVED, STORED, Change
from kvmeta.store.disk.local import LocalBackend
from kvmeta.store.disk.memory import MemoryStore
from kvmeta.store.redis.backend import POOL_PARTS, RedisBackend, pool_keys
from tests.redis_support import RedisCluster, RedisServer, SentinelGroup

T = TypeVar("T")

# Small pools so eviction, refusal and cooling happen within a few steps; one big enough that a
# reserve steps over more read-leased pages than its scan allowance (64 + 2 per key).
SMALL = 5
BIG = 90
POOLS = [
    PoolId("s", 0, "kv"),
    PoolId("s", 1, "a b/{c}"),  # a namespace that needs quoting in Redis key names
    PoolId("v", 0, ""),
    PoolId("v", 1, ""),  # vLLM rank pools; rank 2 exists only once v_register creates it
    PoolId("s", 0, "kv", "t1"),  # another tenant's pools: same rank, namespace and keys
    PoolId("v", 0, "", "t1"),
]
NEVER = PoolId("s", 3, "never")  # never initialised: every call is refused the same way
BIG_POOL = PoolId("s", 7, "big")
KEYS = [f"k{i}" for i in range(8)]
KEY = st.sampled_from(KEYS)
POOL = st.sampled_from([*POOLS, *POOLS, NEVER])
RANK = st.integers(0, 2)
WORLD = st.sampled_from([None, 1, 2, 3])
TENANT = st.sampled_from(["", "", "t1"])  # each tenant has its own vLLM registry
# Multiples of 0.5 s (exact in binary and in Lua's %.6f), so time lands exactly on deadlines too.
STEP = st.sampled_from([0.5, 1.0, 2.0, 3.0, 5.0, RELEASE_GRACE, 15.0, 30.0])
START = 1000.0


@dataclass
class Clock:
    now: float = START

    def __call__(self) -> float:
        return self.now


@dataclass
class Writer:
    """One reserve request whose writer has not confirmed yet."""

    pool: PoolId
    keys: list[str]
    reply: list[tuple[bool, int]]


_REORDER = """
redis.call('DEL', KEYS[1])
if #ARGV > 0 then redis.call('RPUSH', KEYS[1], unpack(ARGV)) end
"""

# Every Redis topology kvmeta runs on: fixture id -> the session fixture that starts it.
TOPOLOGIES = {
    "redis": "redis_server",
    "redis-cluster": "redis_cluster",
    "redis-sentinel": "redis_sentinel",
}


def _outcome(exc: KvmetaError) -> tuple[str, str, str | None]:
    return type(exc).__name__, str(exc), getattr(exc, "field", None)


class Differential(RuleBasedStateMachine):
    """One example: fresh stores (Redis flushed), one clock, random leases."""

    # Set by the test before each run (the Redis backend is started once per test).
    loop: asyncio.AbstractEventLoop
    red: RedisBackend
    raw: Any  # a plain (or cluster-aware) redis-py client to the same data, to inspect it
    flush: Callable[[], None]  # empties every primary of the topology
    clock: Clock
    seen: Counter[str]
    check_every = 10  # Redis's check is ~50 calls: every step would double the run time

    def __init__(self) -> None:
        super().__init__()
        self.clock.now = START
        self.memory = LocalBackend(MemoryStore(clock=self.clock))
        self.writers: list[Writer] = []
        self.confirms: list[tuple[PoolId, list[tuple[str, int]], list[int]]] = []
        self.steps = 0
        self.big_keys = 0
        self.ticked = False
        self.free_before: dict[PoolId, list[int]] = {}

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return self.loop.run_until_complete(coro)

    def both(self, name: str, *args: Any) -> Any:
        """Call ``name`` on both backends; replies (or errors) must be equal. The reply, or
        None after an error."""
        out: list[tuple[str, Any]] = []
        backend: Backend
        for backend in (self.memory, self.red):
            try:
                out.append(("ok", self.run(getattr(backend, name)(*args))))
            except KvmetaError as exc:
                out.append(("error", _outcome(exc)))
        assert out[0] == out[1], f"{name}{args}: memory {out[0]} != redis {out[1]}"
        self.seen[name if out[0][0] == "ok" else f"{name} error"] += 1
        return out[0][1] if out[0][0] == "ok" else None

    # ------------------------------------------------------------------ set-up

    @initialize(
        ttl=st.sampled_from([4.0, 12.0, 60.0]),
        lease=st.sampled_from([0.0, 0.0, 3.0, 12.0]),
    )
    def setup(self, ttl: float, lease: float) -> None:
        self.flush()
        # The backend notices the flush now, as at a readiness probe: its change feed reports
        # the lost data (LOST) before this example's changes, not amid them.
        assert self.run(self.red.ready())
        store = self.memory.store
        store.reservation_ttl = self.red.reservation_ttl = ttl
        store.read_lease = self.red.read_lease = lease
        self.ttl = ttl
        for pool in POOLS:
            self.both("initialize", pool, SMALL)
        self.both("initialize", BIG_POOL, BIG)

    # ------------------------------------------------------------------ pools

    @rule(pool=st.sampled_from([*POOLS, BIG_POOL]), size=st.sampled_from([SMALL, SMALL, 3, 0]))
    def initialize(self, pool: PoolId, size: int) -> None:
        """Create or re-initialise (a different size is a conflict; 0 is refused)."""
        self.both("initialize", pool, BIG if pool == BIG_POOL and size == SMALL else size)

    @rule(pool=POOL, keys=st.lists(KEY, min_size=1, max_size=6))
    def reserve(self, pool: PoolId, keys: list[str]) -> None:
        """A writer asks for pages (keys may repeat within the batch)."""
        reply = self.both("reserve", pool, keys)
        if reply is not None:
            self.writers.append(Writer(pool, keys, reply))
            del self.writers[:-12]

    @rule(pool=POOL, keys=st.lists(KEY, min_size=1, max_size=4))
    def write(self, pool: PoolId, keys: list[str]) -> None:
        """A writer that reserves, writes every page and confirms at once."""
        reply = self.both("reserve", pool, keys)
        if reply is not None:
            pairs = [(k, p) for k, (hit, p) in zip(keys, reply, strict=True) if not hit and p >= 0]
            self.both("confirm", pool, pairs, [])

    @precondition(lambda self: self.writers)
    @rule(data=st.data())
    def reserve_again(self, data: st.DataObject) -> None:
        """The same keys again: a retried request, or a second writer joining the pages."""
        writer = data.draw(st.sampled_from(self.writers))
        self.reserve(writer.pool, writer.keys)

    @precondition(lambda self: self.writers)
    @rule(data=st.data())
    def confirm(self, data: st.DataObject) -> None:
        """A writer reports each handed page written, failed (released) or forgotten; some
        pairs are foreign or stale, some releases repeat or name stored pages."""
        writer = data.draw(st.sampled_from(self.writers))
        if data.draw(st.booleans()):
            self.writers.remove(writer)  # else it may confirm again (a retried confirm)
        pairs: list[tuple[str, int]] = []
        release: list[int] = []
        for key, (hit, page) in zip(writer.keys, writer.reply, strict=True):
            if hit or page < 0:
                continue
            fate = data.draw(st.sampled_from(["written", "written", "failed", "forgotten"]))
            if fate == "written":
                pairs.append((key, page))
            elif fate == "failed":
                release.append(page)
        pages = st.integers(0, SMALL - 1)
        if data.draw(st.integers(0, 4)) == 0:
            pairs.append((data.draw(KEY), data.draw(pages)))  # foreign or stale
        if release and data.draw(st.integers(0, 3)) == 0:
            release.append(data.draw(st.sampled_from(release)))  # the same page twice
        if data.draw(st.integers(0, 4)) == 0:
            release.append(data.draw(pages))  # any page: stored, free, another's
        if data.draw(st.integers(0, 4)) == 0:
            bad = data.draw(st.sampled_from([-1, SMALL, 99]))  # out of range: refused
            if data.draw(st.booleans()):
                pairs.append((data.draw(KEY), bad))
            else:
                release.append(bad)
        pairs = data.draw(st.permutations(pairs))
        self.both("confirm", writer.pool, pairs, release)
        self.confirms.append((writer.pool, pairs, release))
        del self.confirms[:-8]

    @precondition(lambda self: self.confirms)
    @rule(data=st.data())
    def confirm_again(self, data: st.DataObject) -> None:
        """A confirm resent (the engines' clients retry POSTs), maybe after its grace."""
        self.both("confirm", *data.draw(st.sampled_from(self.confirms)))

    @rule(pool=POOL, keys=st.lists(KEY, min_size=1, max_size=6))
    def get(self, pool: PoolId, keys: list[str]) -> None:
        self.both("get", pool, keys)

    @rule(pool=POOL, keys=st.lists(KEY, min_size=1, max_size=6))
    def exists(self, pool: PoolId, keys: list[str]) -> None:
        self.both("exists", pool, keys)

    @rule(pool=POOL, keys=st.lists(KEY, min_size=1, max_size=4))
    def delete(self, pool: PoolId, keys: list[str]) -> None:
        self.both("delete", pool, keys)

    @rule(pool=st.sampled_from([*POOLS, BIG_POOL]))
    def clear(self, pool: PoolId) -> None:
        self.both("clear", pool)

    @rule(dt=STEP)
    def tick(self, dt: float) -> None:
        """Time passes: reservations, read leases and released pages' grace run out."""
        self.clock.now += dt
        self.ticked = True

    @rule()
    def leases_run_out(self) -> None:
        """Time passes beyond every reservation lease at once (ticks of ``STEP`` reach the
        longest only in long sequences): the reservations left unconfirmed expire."""
        self.clock.now += self.ttl + 1.0
        self.ticked = True

    # ------------------------------------------------------------------ the big pool

    @rule(count=st.integers(1, 40), read=st.booleans())
    def fill_big(self, count: int, read: bool) -> None:
        """Store ``count`` new keys in the big pool (evicting the coldest) and maybe read
        them all, so later reserves step over many read-leased pages."""
        keys = [f"b{self.big_keys + i}" for i in range(count)]
        self.big_keys += count
        reply = self.both("reserve", BIG_POOL, keys)
        if reply is None:
            return
        pairs = [(k, p) for k, (hit, p) in zip(keys, reply, strict=True) if not hit and p >= 0]
        self.both("confirm", BIG_POOL, pairs, [])
        if read:
            self.both("get", BIG_POOL, [f"b{i}" for i in range(self.big_keys)])

    @rule(keys=st.lists(st.integers(0, 200), min_size=1, max_size=8))
    def use_big(self, keys: list[int]) -> None:
        """Reserve, read or delete a few old and new keys of the big pool."""
        names = [f"b{i}" for i in keys]
        self.both("reserve", BIG_POOL, names)
        self.both("get", BIG_POOL, names[::2])
        self.both("delete", BIG_POOL, names[1::3])

    # ------------------------------------------------------------------ vLLM index

    @rule(rank=RANK, size=st.sampled_from([SMALL, SMALL, 3]), world=WORLD, tenant=TENANT)
    def v_register(self, rank: int, size: int, world: int | None, tenant: str) -> None:
        self.both("v_register", rank, size, world, tenant)

    @rule(keys=st.lists(KEY, min_size=1, max_size=6), tenant=TENANT)
    def v_exists(self, keys: list[str], tenant: str) -> None:
        self.both("v_exists", keys, tenant)

    @rule(tenant=TENANT)
    def v_clear(self, tenant: str) -> None:
        self.both("v_clear", tenant)

    @rule(rank=RANK, tenant=TENANT, force=st.sampled_from([False, False, True]))
    def v_remove(self, rank: int, tenant: str, force: bool) -> None:
        """Refused (the same RankInUse, to the digit) while the rank's pages are in use,
        unless forced."""
        if self.both("v_remove", rank, tenant, force) is not None:
            self.writers = [w for w in self.writers if w.pool != PoolId("v", rank, "", tenant)]

    @precondition(lambda self: any(w.pool.dialect == "v" for w in self.writers))
    @rule(data=st.data())
    def v_remove_in_use(self, data: st.DataObject) -> None:
        """An operator removes the rank of a writer that has not confirmed yet."""
        writer = data.draw(st.sampled_from([w for w in self.writers if w.pool.dialect == "v"]))
        self.v_remove(writer.pool.rank, writer.pool.tenant, False)

    @rule(world=WORLD, tenant=TENANT)
    def v_set_world_size(self, world: int | None, tenant: str) -> None:
        self.both("v_set_world_size", world, tenant)

    # ------------------------------------------------------------------ after every step

    @invariant()
    def agree(self) -> None:
        self.steps += 1
        assert self.run(self.memory.stats()) == self.run(self.red.stats())
        for tenant in ("", "t1"):
            assert self.run(self.memory.v_index(tenant)) == self.run(self.red.v_index(tenant))
        for pool in self.memory.store.pools.values():
            check_pool(pool)
        self.same_allocator()
        if self.steps % self.check_every == 0:
            assert self.run(self.red.check()).problems == []

    def same_allocator(self) -> None:
        """Both stores hand out the same free pages in the same order, and cool the same pages
        until the same time.

        One difference is allowed, right after a time step (the invariant's ``stats`` runs the
        expiry then): pages that expire together may join the free stack in another order
        (``core.pool`` frees them in its lease queue's order, the Lua by deadline, then page
        as a string). They must be the same pages; the Redis order is then set to the memory
        one, so the page numbers handed out later stay comparable.
        """
        ticked, self.ticked = self.ticked, False
        client = self.raw
        pools = list(self.memory.store.pools.items())
        parts = [dict(zip(POOL_PARTS, pool_keys(pid), strict=True)) for pid, _ in pools]
        pipe = client.pipeline(transaction=False)  # one round trip for every pool
        for k in parts:
            pipe.hmget(k["meta"], "n", "next")
            pipe.lrange(k["free"], 0, -1)
            pipe.zrange(k["cool"], 0, -1, withscores=True)
        replies = self.run(pipe.execute())
        for i, (pid, pool) in enumerate(pools):
            k = parts[i]
            (n, next_), listed, cool = replies[3 * i : 3 * i + 3]
            listed = [int(p) for p in listed]
            red = list(range(int(n) - 1, int(next_) - 1, -1)) + listed  # >= next: never used
            mem = list(range(pool.num_pages - 1, pool._unused - 1, -1)) + list(pool._free)
            assert {(page, until) for until, page in pool._cooling} == {
                (int(p), t) for p, t in cool
            }, f"{pid}: cooling pages differ"
            if mem != red:
                old = self.free_before.get(pid, [])
                why = f"{pid}: free stack {mem} != {red}"
                assert ticked and mem[: len(old)] == red[: len(old)] == old, why
                assert sorted(mem[len(old) :]) == sorted(red[len(old) :]), why
                cut = len(mem) - len(listed)
                assert mem[:cut] == red[:cut], why
                self.run(self._reorder(k["free"], mem[cut:]))
                self.seen["expiry order"] += 1
            self.free_before[pid] = mem

    async def _reorder(self, key: str, pages: list[int]) -> None:
        # One script: atomic on every topology (a cluster routes it by its one key).
        await self.raw.eval(_REORDER, 1, key, *pages)

    def teardown(self) -> None:
        assert self.run(self.red.check()).problems == []
        for stats in self.run(self.red.stats()):
            for name, count in stats.counters.items():
                self.seen[name] += count > 0


class Fed(Differential):
    """The same machine, with the Redis backend's change feed checked after every step (a
    subclass: the sequences derive from the machine's source, and the base keeps its own)."""

    def __init__(self) -> None:
        super().__init__()
        self.fed: dict[PoolId, set[str]] = {}  # stored keys per pool, as the feed tells them
        self.feed_errors: list[str] = []
        self.red.set_change_listener(self.on_changes)

    def on_changes(self, changes: list[Change]) -> None:
        for change in changes:
            keys = self.fed.setdefault(change.pool, set())
            self.seen[f"feed {change.kind} {change.reason}".strip()] += 1
            new = set(change.keys)
            if len(new) != len(change.keys):
                self.feed_errors.append(f"{change}: a key twice")
            if change.kind == STORED:
                if keys & new:
                    self.feed_errors.append(f"{change}: already stored")
                keys |= new
            elif change.kind == REMOVED:
                if not new <= keys:
                    self.feed_errors.append(f"{change}: not stored")
                keys -= new
            elif change.kind == CLEARED and not change.keys:
                keys.clear()
            elif change.kind == LOST and not change.keys:
                self.fed.clear()  # Redis lost its data: each example starts from a flush
            else:
                self.feed_errors.append(f"{change}: unknown")

    @invariant()
    def same_feed(self) -> None:
        """The stored keys the change feed told of are the pool's stored keys in Redis."""
        assert self.feed_errors == []
        pids = [*POOLS, BIG_POOL, PoolId("v", 2, "")]
        pipe = self.raw.pipeline(transaction=False)
        for pid in pids:
            pipe.hkeys(pool_keys(pid)[POOL_PARTS.index("stored")])
        for pid, stored in zip(pids, self.run(pipe.execute()), strict=True):
            got = {k.decode() for k in stored}
            assert self.fed.get(pid, set()) == got, f"{pid}: feed {self.fed.get(pid)} != {got}"


# Each example is a fresh random sequence of up to STEPS operations; most of a run's time is
# waiting for Redis round trips (each step compares stats, free stacks and the vLLM index).
# The full depth runs on one node; Cluster and Sentinel run the sample (the same Lua).
EXAMPLES = 120
SAMPLE = EXAMPLES // 5
DEPTH = {"redis": EXAMPLES, "redis-cluster": SAMPLE, "redis-sentinel": SAMPLE}
STEPS = 50

# Events the sequences must reach in some example, so the comparison covers the hard paths.
MUST_SEE = [
    "evictions",
    "reservations_refused",
    "reservations_expired",
    "reserve_hits",
    "releases",
    "confirms_refused",
    "commits",
    "deletes",
    "clears",
    "get_hits",
    "exists_hits",
    "feed stored",
    "feed removed capacity",
    "feed removed delete",
    "feed cleared clear",
    "feed cleared drop",
    "confirm error",
    "reserve error",
    "v_remove error",
]


@pytest.mark.slow
@pytest.mark.timeout(900)  # a failure shrinks for up to hypothesis's 5 minutes, then reports
@pytest.mark.parametrize("topology", sorted(TOPOLOGIES))
def test_memory_and_redis_agree_on_every_reply(
    topology: str, request: pytest.FixtureRequest
) -> None:
    server: RedisServer | RedisCluster | SentinelGroup = request.getfixturevalue(
        TOPOLOGIES[topology]
    )
    server.flush()
    clock = Clock()
    loop = asyncio.new_event_loop()
    red = RedisBackend(server.url, clock=clock)
    loop.run_until_complete(red.start())
    seen: Counter[str] = Counter()
    Fed.loop, Fed.red, Fed.clock, Fed.seen = (
        loop,
        red,
        clock,
        seen,
    )
    Fed.raw, Fed.flush = server.async_client(), server.flush
    try:
        run_state_machine_as_test(
            Fed,
            settings=settings(
                max_examples=DEPTH[topology],
                derandomize=True,  # the same sequences every run: CI compares, never flakes
                stateful_step_count=STEPS,
                deadline=None,
                suppress_health_check=[HealthCheck.too_slow],
            ),
        )
    finally:
        loop.run_until_complete(red.close())
        loop.run_until_complete(Fed.raw.aclose())
        loop.close()
    missing = [name for name in MUST_SEE if not seen[name]]
    assert not missing, f"no example reached {missing}: {dict(seen)}"


def test_redis_clock_is_a_test_hook_only(redis_url: str) -> None:
    """Without a clock the scripts read Redis TIME (no extra argument is sent); with one,
    every script that reads time takes the test's time."""
    clock = Clock()
    pool = PoolId("s", 0, "kv")

    async def scenario(make: Callable[[], RedisBackend], expire: bool) -> None:
        red = make()
        await red.start()
        try:
            await red.initialize(pool, 2)
            assert [p for _, p in await red.reserve(pool, ["a", "b"])] == [0, 1]
            clock.now += 10.0  # past the 5 s lease: only the test clock sees it
            await red.stats()
            stats = (await red.stats())[0]
            assert (stats.reserved, stats.counters["reservations_expired"]) == (
                (0, 2) if expire else (2, 0)
            )
        finally:
            assert red._client is not None
            await red._client.flushdb()
            await red.close()

    asyncio.run(scenario(lambda: RedisBackend(redis_url, reservation_ttl=5.0), expire=False))
    asyncio.run(
        scenario(lambda: RedisBackend(redis_url, reservation_ttl=5.0, clock=clock), expire=True)
    )
