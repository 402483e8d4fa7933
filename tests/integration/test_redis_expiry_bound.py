"""Lease expiry on Redis is skipped below the pool's expiry bound, and never skipped wrongly.

Every script that reads the time used to scan the three lease sets (three calls) on every
request; meta's ``exp`` now holds a lower bound of every lease end, so a request below it costs
no expiry call. The bound must be lowered by every write of a lease end: a reservation, a read
lease, a released page cooling. Each test steps a test clock past exactly one of them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from kvmeta._types import PoolId
from kvmeta.store.redis.backend import RedisBackend, pool_keys
from tests.redis_support import RedisServer

POOL = PoolId("s", 0, "bound")


def _run(
    url: str, body: Callable[[RedisBackend, list[float]], Awaitable[Any]], **kwargs: Any
) -> Any:
    now = [1000.0]

    async def main() -> Any:
        backend = RedisBackend(url, clock=lambda: now[0], **kwargs)
        await backend.start()
        try:
            return await body(backend, now)
        finally:
            await backend.close()

    return asyncio.run(main())


def test_a_request_below_every_lease_end_runs_no_expiry_command(
    redis_server: RedisServer, redis_url: str
) -> None:
    async def body(backend: RedisBackend, now: list[float]) -> None:
        await backend.initialize(POOL, 64)
        got = await backend.reserve(POOL, ["a", "b"])
        await backend.confirm(POOL, [("a", got[0][1]), ("b", got[1][1])], [])
        with redis_server.client() as client:
            client.config_resetstat()
        now[0] += 1
        got = await backend.reserve(POOL, ["c"])
        await backend.confirm(POOL, [("c", got[0][1])], [])
        assert await backend.get(POOL, ["a", "c"]) == [0, 2]

    _run(redis_url, body, reservation_ttl=300.0, read_lease=0.0)
    with redis_server.client() as client:
        stats = client.info("commandstats")
    scans = {k: v for k, v in stats.items() if "rangebyscore" in k}
    assert scans == {}, scans


def test_an_expired_reservation_frees_its_page(redis_url: str) -> None:
    async def body(backend: RedisBackend, now: list[float]) -> list[Any]:
        await backend.initialize(POOL, 1)
        first = await backend.reserve(POOL, ["a"])
        now[0] += 5
        refused = await backend.reserve(POOL, ["b"])  # a's lease still runs: no page
        now[0] += 6
        return [first, refused, await backend.reserve(POOL, ["b"])]

    assert _run(redis_url, body, reservation_ttl=10.0, read_lease=0.0) == [
        [(False, 0)],
        [(False, -1)],
        [(False, 0)],
    ]


def test_a_released_page_is_handed_out_after_its_cooling(redis_url: str) -> None:
    # The reservations' lease (300 s) is far beyond the release grace (10 s): only the bound
    # the release lowered brings the cooled page back.
    async def body(backend: RedisBackend, now: list[float]) -> list[Any]:
        await backend.initialize(POOL, 2)
        got = await backend.reserve(POOL, ["a", "b"])
        await backend.confirm(POOL, [], [got[1][1]])
        now[0] += 5
        cooling = await backend.reserve(POOL, ["c"])
        now[0] += 6
        return [got, cooling, await backend.reserve(POOL, ["c"])]

    assert _run(redis_url, body, reservation_ttl=300.0, read_lease=0.0) == [
        [(False, 0), (False, 1)],
        [(False, -1)],
        [(False, 1)],
    ]


def test_a_read_lease_protects_its_page_until_it_ends(redis_url: str) -> None:
    # A page read under a 3 s lease is not evicted while the lease runs, and is right after
    # (eviction reads the lease itself; the bound only decides when stale entries are trimmed).
    async def body(backend: RedisBackend, now: list[float]) -> list[Any]:
        await backend.initialize(POOL, 1)
        got = await backend.reserve(POOL, ["a"])
        await backend.confirm(POOL, [("a", got[0][1])], [])
        now[0] += 1
        read = await backend.get(POOL, ["a"])
        now[0] += 1
        leased = await backend.reserve(POOL, ["b"])
        now[0] += 3
        return [read, leased, await backend.reserve(POOL, ["b"])]

    assert _run(redis_url, body, reservation_ttl=300.0, read_lease=3.0) == [
        [0],
        [(False, -1)],
        [(False, 0)],
    ]


def test_check_reports_a_bound_past_a_lease_end(redis_server: RedisServer, redis_url: str) -> None:
    async def body(backend: RedisBackend, now: list[float]) -> list[str]:
        await backend.initialize(POOL, 4)
        await backend.reserve(POOL, ["a"])  # its lease ends at 1010 s
        assert (await backend.check()).problems == []
        with redis_server.client() as client:
            client.hset(pool_keys(POOL)[0], "exp", 1_020_000)
        return (await backend.check()).problems

    problems = _run(redis_url, body, reservation_ttl=10.0, read_lease=0.0)
    assert len(problems) == 1 and "expiry bound 1020000 ms is past" in problems[0], problems
