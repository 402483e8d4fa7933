"""Whole-pool work on Redis (clear, check) runs in short scripts, never one long one.

A script holds Redis for its whole run: every other pool on that Redis waits (and after 5 s
gets BUSY errors). These tests load a real redis-server, count the script calls a whole-pool
operation makes (Redis's own INFO commandstats: enough calls means no call did it all), log
the longest one from SLOWLOG (a number for the log, not asserted: wall time flakes on a loaded
machine), and check that writers served between chunks stay correct.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import redis

import kvmeta.store.redis.backend as redis_store
import kvmeta.store.redis.stats as redis_stats
from kvmeta._types import PoolId
from kvmeta.store.redis.backend import RedisBackend, pool_prefix
from tests.redis_support import RedisServer

POOL = PoolId("s", 0, "kv")


def _bulk_load(client: redis.Redis, pool: PoolId, n: int) -> None:
    """A pool of ``n`` pages, every page STORED, written straight into Redis (pipelined)."""
    prefix = pool_prefix(pool)
    step = 20000
    for lo in range(0, n, step):
        pages = range(lo, min(n, lo + step))
        pipe = client.pipeline(transaction=False)
        pipe.hset(prefix + "pk", mapping={str(p): f"k{p:08d}" for p in pages})
        pipe.hset(prefix + "stored", mapping={f"k{p:08d}": str(p) for p in pages})
        pipe.zadd(prefix + "lru", {str(p): p + 1 for p in pages})
        pipe.execute()
    client.sadd("kvmeta:2:pools", f"{pool.rank}:{pool.namespace}")
    client.hset(prefix + "meta", mapping={"n": n, "next": n, "tick": n})


_SCRIPT_COMMANDS = ("fcall", "fcall_ro", "evalsha", "evalsha_ro", "eval", "eval_ro")


def _script_calls(client: redis.Redis) -> int:
    """Script calls Redis has served since the last CONFIG RESETSTAT (Functions or EVALSHA)."""
    stats = client.info("commandstats")
    return sum(int(stats.get(f"cmdstat_{name}", {}).get("calls", 0)) for name in _SCRIPT_COMMANDS)


def _scripts_run(client: redis.Redis, run: Callable[[], Awaitable[Any]]) -> tuple[Any, int, float]:
    """Run ``run`` and return its result, the number of script calls it made (from INFO
    commandstats) and the longest script call by Redis's SLOWLOG (ms, for the log)."""
    client.config_set("slowlog-log-slower-than", 1000)  # us; inner commands stay out
    client.config_set("slowlog-max-len", 100000)
    client.slowlog_reset()
    client.config_resetstat()
    result = asyncio.run(run())  # type: ignore[arg-type]
    calls = _script_calls(client)
    slow = [
        e
        for e in client.slowlog_get(100000)
        if e["command"].split(b" ", 1)[0].lower().decode() in _SCRIPT_COMMANDS
    ]
    return result, calls, max((e["duration"] for e in slow), default=0) / 1000


async def _with_backend(url: str, body: Callable[[RedisBackend], Awaitable[Any]]) -> Any:
    backend = RedisBackend(url)
    await backend.start()
    try:
        return await body(backend)
    finally:
        await backend.close()


def test_clear_and_check_of_a_big_pool_hold_redis_briefly(
    redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every script call does a bounded chunk of the work, whatever the pool's size (once one
    check script of ~14 s and one clear script of 11-22 s on a 10^6-page pool). 10^5 pages are
    hundreds of chunks: a bound that holds per chunk here holds on any pool."""
    redis_server.flush()
    client = redis_server.client()
    n = 100_000
    _bulk_load(client, POOL, n)
    url = redis_server.url
    cleared_per_call: list[int] = []
    run = RedisBackend._run

    async def counting(self: RedisBackend, script: str, keys: Any, args: list[Any]) -> Any:
        reply = await run(self, script, keys, args)
        if script == "clear":
            cleared_per_call.append(int(reply[2]))
        return reply

    monkeypatch.setattr(RedisBackend, "_run", counting)

    problems, check_calls, check_ms = _scripts_run(client, lambda: _with_backend(url, _check))
    assert problems == []
    cleared, clear_calls, clear_ms = _scripts_run(client, lambda: _with_backend(url, _clear))
    assert cleared == n == sum(cleared_per_call)
    # Each clear call clears about one chunk (HSCAN's COUNT is a hint: at most twice).
    assert 0 < max(cleared_per_call) <= 2 * redis_store.CLEAR_CHUNK, max(cleared_per_call)
    stats = asyncio.run(_with_backend(url, _stats))
    assert (stats.free, stats.reserved, stats.stored) == (n, 0, 0)
    problems, recheck_calls, recheck_ms = _scripts_run(client, lambda: _with_backend(url, _check))
    assert problems == []
    print(
        f"script calls (longest): check {check_calls} ({check_ms:.1f} ms), clear {clear_calls} "
        f"({clear_ms:.1f} ms), check after clear {recheck_calls} ({recheck_ms:.1f} ms)"
    )
    # The structure, not the wall time: the work is split into calls of about a chunk of the
    # pool's entries each (~5-10 ms on an idle 2-core machine), never one call doing it all.
    # The bound allows two chunks per call on average: HSCAN's COUNT is only a hint.
    assert clear_calls >= n // (2 * redis_store.CLEAR_CHUNK)
    assert check_calls >= n // (2 * redis_stats.CHECK_CHUNK)
    assert recheck_calls >= n // (2 * redis_stats.CHECK_CHUNK)


async def _check(b: RedisBackend) -> list[str]:
    return (await b.check()).problems


async def _clear(b: RedisBackend) -> int:
    return await b.clear(POOL)


async def _stats(b: RedisBackend) -> Any:
    (stats,) = await b.stats()
    return stats


def test_writers_served_between_clear_chunks_stay_correct(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A clear of many small chunks runs while a writer reserves, confirms, releases and reads:
    every key stored before the clear is gone, no page is handed to two keys, and what the
    writer confirms after the clear is kept."""
    monkeypatch.setattr(redis_store, "CLEAR_CHUNK", 20)
    monkeypatch.setattr(redis_stats, "CHECK_CHUNK", 13)

    async def run(b: RedisBackend) -> None:
        await b.initialize(POOL, 3000)
        old = [f"old{i}" for i in range(2000)]
        for lo in range(0, len(old), 500):
            batch = old[lo : lo + 500]
            pages = [p for _, p in await b.reserve(POOL, batch)]
            assert await b.confirm(POOL, list(zip(batch, pages, strict=True)), []) == 0
        in_flight = await b.reserve(POOL, ["w-in-flight"])  # reserved before the clear
        done = asyncio.Event()
        written: dict[str, int] = {}

        async def writer() -> None:
            i = 0
            while not done.is_set():
                keys = [f"new{i}-{j}" for j in range(8)]
                out = await b.reserve(POOL, keys)
                pairs = [(k, p) for k, (hit, p) in zip(keys, out, strict=True) if p >= 0]
                pages = [p for _, p in pairs]
                assert len(set(pages)) == len(pages)  # one page per key
                assert await b.confirm(POOL, pairs[:6], pages[6:]) == 0
                written.update(pairs[:6])
                for key, page in zip(keys, await b.get(POOL, keys), strict=True):
                    assert page is None or page == written.get(key), key
                i += 1

        async def clear() -> int:
            try:
                return await b.clear(POOL)
            finally:
                done.set()

        task = asyncio.create_task(writer())
        cleared = await clear()
        await task
        assert cleared >= 2000
        assert written  # the writer was served between chunks
        assert await b.exists(POOL, old) == [False] * len(old)
        assert (await b.check()).problems == []
        # The reservation in flight during the clear is still good; confirms after it stay.
        assert await b.confirm(POOL, [("w-in-flight", in_flight[0][1])], []) == 0
        after = await b.reserve(POOL, ["after"])
        assert await b.confirm(POOL, [("after", after[0][1])], []) == 0
        assert await b.get(POOL, ["w-in-flight", "after"]) == [in_flight[0][1], after[0][1]]
        (stats,) = await b.stats()
        assert stats.counters["clears"] == 1
        assert stats.free + stats.cooling + stats.reserved + stats.stored == 3000
        assert (await b.check()).problems == []

    asyncio.run(_with_backend(redis_url, run))


def _corrupt_stored_entry(c: redis.Redis, p: str) -> None:
    c.hdel(p + "stored", "a")  # page -> key says STORED a, a -> page is gone


def _corrupt_free_twice(c: redis.Redis, p: str) -> None:
    c.rpush(p + "free", "5", "5")


def _corrupt_used_and_free(c: redis.Redis, p: str) -> None:
    c.rpush(p + "free", "0")


def _corrupt_lru(c: redis.Redis, p: str) -> None:
    c.zrem(p + "lru", "1")


def _corrupt_holders(c: redis.Redis, p: str) -> None:
    c.hset(p + "holders", "3", "1")  # an entry means a page several writers joined


def _corrupt_reserved_page(c: redis.Redis, p: str) -> None:
    c.hset(p + "reserved", "r", "6")


@pytest.mark.parametrize(
    ("corrupt", "message"),
    [
        (_corrupt_stored_entry, "page 0 -> a has no matching key entry"),
        (_corrupt_free_twice, "page 5 is free twice"),
        (_corrupt_used_and_free, "page 0 is both FREE and in use"),
        (_corrupt_lru, "STORED page 1 is not in the LRU"),
        (_corrupt_holders, "RESERVED page 3 has 1 holders listed (absent: one)"),
        (_corrupt_reserved_page, "reserved key r -> page 6 disagrees with page -> key"),
    ],
)
@pytest.mark.parametrize("chunk", [2, 1000])
def test_check_finds_each_kind_of_damage_in_any_chunk_size(
    redis_url: str,
    monkeypatch: pytest.MonkeyPatch,
    corrupt: Callable[[redis.Redis, str], None],
    message: str,
    chunk: int,
) -> None:
    monkeypatch.setattr(redis_stats, "CHECK_CHUNK", chunk)

    async def run(b: RedisBackend) -> list[str]:
        await b.initialize(POOL, 8)
        pages = [p for _, p in await b.reserve(POOL, ["a", "b", "c"])]
        await b.confirm(POOL, list(zip(["a", "b", "c"], pages, strict=True)), [])
        await b.reserve(POOL, ["r"])  # page 3, RESERVED
        await b.reserve(POOL, ["f1", "f2"])
        await b.confirm(POOL, [], [4, 5])  # pages 4 and 5 FREE on the free list
        assert (await b.check()).problems == []
        corrupt(redis.Redis.from_url(redis_url), pool_prefix(POOL))
        return (await b.check()).problems

    problems = asyncio.run(_with_backend(redis_url, run))
    assert any(message in p for p in problems), problems
    assert all(p.startswith("rank 0 namespace 'kv': ") for p in problems), problems
