"""``Backend.dump`` and ``Backend.prefix_length`` on every backend (the router reads): paged
stored keys with a SCAN-like guarantee, and the leading run of stored keys, both without any
effect on the LRU order, the read leases or the pool's counters. On Redis a prefix lookup is one
``HMGET`` per pool, its keys packed at once (``resp.Strings``)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis

from kvmeta._types import PoolId
from kvmeta.errors import InvalidRequest, NotInitialized
from kvmeta.store.redis.backend import RedisBackend
from kvmeta.store.redis.resp import Strings
from tests.contract.conftest import Sync
from tests.unit.store.durable_support import crash, cycle, open_backend

S0 = PoolId("s", 0, "kv")
S1 = PoolId("s", 1, "other ns/with:odd{chars}")
V0 = PoolId("v", 0, "")
MISSING = PoolId("s", 9, "nope")


def _store(b: Sync, pool: PoolId, keys: list[str]) -> None:
    pages = [page for _, page in b.reserve(pool, keys)]
    assert b.confirm(pool, list(zip(keys, pages, strict=True)), []) == 0


def _walk(b: Sync, pool: PoolId, limit: int) -> tuple[list[str], int]:
    """Every key a full dump walk returns, and how many calls it took."""
    out: list[str] = []
    cursor, calls = "", 0
    while True:
        keys, cursor = b.dump(pool, cursor, limit)
        out += keys
        calls += 1
        assert calls < 10_000
        if cursor == "":
            return out, calls


def _counters(b: Sync, pool: PoolId) -> dict[str, int]:
    (st,) = [s for s in b.stats() if s.pool == pool]
    return st.counters


def test_dump_of_an_empty_pool_is_done_at_once(backend: Sync) -> None:
    backend.initialize(S0, 8)
    assert backend.dump(S0, "", 10) == ([], "")


@pytest.mark.parametrize("pool", [S0, S1, V0])
def test_dump_returns_every_stored_key_and_no_reserved_one(backend: Sync, pool: PoolId) -> None:
    if pool.dialect == "v":
        backend.v_register(0, 600, None)
    else:
        backend.initialize(pool, 600)
    stored = [f"key-{i}" for i in range(500)] + ["ключ", "x y"]
    _store(backend, pool, stored)
    backend.reserve(pool, ["only-reserved"])
    for limit in (1, 7, 100, 1000):
        keys, calls = _walk(backend, pool, limit)
        assert set(keys) == set(stored), limit
        assert calls >= 1


def test_dump_pages_are_bounded_by_about_the_limit(backend: Sync) -> None:
    backend.initialize(S0, 4096)
    _store(backend, S0, [f"k{i}" for i in range(1000)])
    keys, cursor = backend.dump(S0, "", 50)
    # Redis's SCAN may return a little more than its COUNT hint, never the whole large hash.
    assert 0 < len(keys) <= 200 and cursor != ""


def test_a_key_stored_for_the_whole_walk_is_returned(backend: Sync) -> None:
    backend.initialize(S0, 2048)
    steady = [f"steady-{i}" for i in range(600)]
    _store(backend, S0, steady)
    seen: list[str] = []
    cursor, step = "", 0
    while True:
        keys, cursor = backend.dump(S0, cursor, 64)
        seen += keys
        # Churn between the calls: new keys come, some others go.
        _store(backend, S0, [f"churn-{step}-{i}" for i in range(20)])
        backend.delete(S0, [f"churn-{step - 1}-{i}" for i in range(20)])
        step += 1
        if cursor == "":
            break
    assert set(steady) <= set(seen)


def test_dump_of_a_missing_pool_is_not_initialized(backend: Sync) -> None:
    with pytest.raises(NotInitialized):
        backend.dump(MISSING, "", 10)
    with pytest.raises(NotInitialized):
        backend.dump(PoolId("v", 3, ""), "", 10)


def test_dump_refuses_a_cursor_it_never_gave(backend: Sync) -> None:
    backend.initialize(S0, 8)
    for bad in ("not-a-cursor", "-1", "18446744073709551616", "1" * 40):
        with pytest.raises(InvalidRequest) as err:
            backend.dump(S0, bad, 10)
        assert err.value.field == "cursor"
    # The largest cursor a backend may hand out is not refused (the empty pool: nothing).
    assert backend.dump(S0, "18446744073709551615", 10)[0] == []


def test_dump_changes_nothing(backend: Sync) -> None:
    backend.initialize(S0, 4)
    _store(backend, S0, ["a", "b", "c", "d"])
    before = _counters(backend, S0)
    _walk(backend, S0, 2)
    assert _counters(backend, S0) == before
    # "a" is still the coldest: the next reserve evicts it, not a dumped-later key.
    backend.reserve(S0, ["e"])
    assert backend.exists(S0, ["a", "b", "c", "d"]) == [False, True, True, True]


# ---------------------------------------------------------------------- prefix_length


def test_prefix_length_is_the_leading_run_of_stored_keys(backend: Sync) -> None:
    backend.initialize(S0, 64)
    _store(backend, S0, ["a", "b", "c", "e"])
    assert backend.prefix_length(S0, ["a", "b", "c", "d", "e"]) == 3
    assert backend.prefix_length(S0, ["a", "b", "c", "e"]) == 4
    assert backend.prefix_length(S0, ["x", "a"]) == 0
    assert backend.prefix_length(S0, []) == 0
    backend.reserve(S0, ["r"])
    assert backend.prefix_length(S0, ["a", "r", "b"]) == 1  # reserved is not stored


def test_prefix_length_of_a_vllm_rank_pool(backend: Sync) -> None:
    backend.v_register(0, 16, None)
    _store(backend, V0, ["b1", "b2"])
    assert backend.prefix_length(V0, ["b1", "b2", "b3"]) == 2


def test_prefix_length_of_a_missing_pool_is_not_initialized(backend: Sync) -> None:
    with pytest.raises(NotInitialized):
        backend.prefix_length(MISSING, ["a"])
    with pytest.raises(NotInitialized):
        backend.prefix_length(MISSING, [])


def test_prefix_length_touches_neither_lru_nor_counters(backend: Sync) -> None:
    backend.initialize(S0, 3)
    _store(backend, S0, ["a", "b", "c"])
    before = _counters(backend, S0)
    assert backend.prefix_length(S0, ["a", "b", "z"]) == 2
    assert _counters(backend, S0) == before
    backend.reserve(S0, ["d"])  # evicts the coldest: still "a"
    assert backend.exists(S0, ["a", "b", "c"]) == [False, True, True]


def test_prefix_length_stops_at_the_first_miss_whatever_follows(backend: Sync) -> None:
    backend.initialize(S0, 64)
    _store(backend, S0, ["a", "b", "c", "d"])
    backend.delete(S0, ["b"])
    assert backend.prefix_length(S0, ["a", "b", "c", "d"]) == 1
    assert backend.prefix_length(S0, ["c", "d", "a"]) == 3
    # Duplicates count each time they are present; a repeat after the miss does not.
    assert backend.prefix_length(S0, ["a", "a", "c", "a"]) == 4
    assert backend.prefix_length(S0, ["a", "zz", "a", "c"]) == 1


def test_a_reserved_but_unconfirmed_key_is_not_present(backend: Sync) -> None:
    backend.initialize(S0, 64)
    backend.reserve(S0, ["r1", "r2"])
    # Nothing stored at all: a length of 0 in a pool that exists (not "no such pool").
    assert backend.prefix_length(S0, ["r1", "r2"]) == 0
    _store(backend, S0, ["a"])
    assert backend.prefix_length(S0, ["a", "r1"]) == 1


def test_prefix_length_over_thousands_of_keys(backend: Sync) -> None:
    """More keys than one Lua ``unpack`` or one packing chunk holds: the run continues past
    every 1000th key and stops at a miss anywhere."""
    # Room for the keys and a durable backend's spare (an eighth of the pool): none evicted.
    backend.initialize(S0, 3000)
    keys = [f"long-{i:05d}" for i in range(2500)]
    for start in range(0, len(keys), 500):
        _store(backend, S0, keys[start : start + 500])
    assert backend.prefix_length(S0, keys) == 2500
    for miss in (999, 1000, 1001, 1999, 2000, 2499):
        asked = keys[:miss] + ["absent"] + keys[miss:]
        assert backend.prefix_length(S0, asked) == miss, miss


def test_prefix_length_changes_no_stats_and_grants_no_read_lease(
    make_backend: Callable[..., Sync],
) -> None:
    """Pool stats and counters are the same before and after, and a key matched and then
    deleted frees its page at once (a ``get`` would have leased it: the page cools)."""
    b = make_backend(lease=60.0)
    b.initialize(S0, 1)
    _store(b, S0, ["a"])
    (before,) = [s for s in b.stats() if s.pool == S0]
    assert b.prefix_length(S0, ["a", "a", "b"]) == 2
    (after,) = [s for s in b.stats() if s.pool == S0]
    assert after == before
    assert b.delete(S0, ["a"]) == 1
    [(_, page)] = b.reserve(S0, ["b"])
    assert page == 0  # not cooling: the router's read leased nothing


# ---------------------------------------------------------------------- prefix_length on Redis


class _Recording(RedisBackend):
    """Records every command sent: what a prefix lookup costs on the wire."""

    sent: list[tuple[Any, ...]]

    async def _call(
        self, key: str, command: tuple[Any, ...], what: str, wait: tuple[Any, ...] | None
    ) -> Any:
        self.sent.append(command)
        return await super()._call(key, command, what, wait)


def test_redis_prefix_length_is_one_hmget_of_the_keys_packed_at_once(redis_url: str) -> None:
    """One ``HMGET`` with the keys packed as ``resp.Strings`` (a few C-level string operations
    instead of one packing step per key, most of a worker's CPU per call with 256 keys), and
    the pool's ``HEXISTS`` only when nothing matched: read commands only, no script."""

    async def main() -> None:
        b = _Recording(redis_url)
        b.sent = []
        await b.start()
        try:
            await b.initialize(S0, 512)
            keys = [f"{i:064x}" for i in range(256)]
            for start in range(0, 256, 64):
                pages = [p for _, p in await b.reserve(S0, keys[start : start + 64])]
                await b.confirm(S0, list(zip(keys[start : start + 64], pages, strict=True)), [])
            for asked, want, commands in (
                (keys, 256, ["HMGET"]),
                ([*keys[:100], "absent", *keys[100:]], 100, ["HMGET"]),
                (["absent", *keys], 0, ["HMGET", "HEXISTS"]),
                ([], 0, ["HEXISTS"]),
            ):
                b.sent = []
                assert await b.prefix_length(S0, asked) == want
                assert [c[0] for c in b.sent] == commands
                if asked:
                    assert isinstance(b.sent[0][-1], Strings)
                    assert list(b.sent[0][-1]) == asked
        finally:
            await b.close()

    asyncio.run(main())


def test_redis_prefix_length_answers_where_writes_are_refused(redis_url: str) -> None:
    """A primary short of ``min-replicas-to-write`` refuses writes (and any script or function
    not declared read-only); a router's lookup is read commands only and still answers."""

    async def main() -> None:
        b = RedisBackend(redis_url)
        await b.start()
        try:
            await b.initialize(S0, 8)
            [(_, page)] = await b.reserve(S0, ["a"])
            await b.confirm(S0, [("a", page)], [])
            with redis.Redis.from_url(redis_url) as admin:
                admin.config_set("min-replicas-to-write", 1)
                try:
                    assert await b.prefix_length(S0, ["a", "b"]) == 1
                    with pytest.raises(NotInitialized):
                        await b.prefix_length(MISSING, ["a"])
                finally:
                    admin.config_set("min-replicas-to-write", 0)
        finally:
            await b.close()

    asyncio.run(main())


def test_the_durable_backend_dumps_what_it_recovered(tmp_path: Path) -> None:
    """The resync after a restart dumps the recovered state: journal and snapshot included."""

    async def main() -> None:
        b = await open_backend(tmp_path)
        await b.initialize(S0, 64)
        await cycle(b, S0, ["a", "b", "c"])
        await b.snapshot()
        await cycle(b, S0, ["d"])
        await b.delete(S0, ["b"])
        await crash(b)
        b = await open_backend(tmp_path)
        try:
            keys, cursor = await b.dump(S0, "", 100)
            assert sorted(keys) == ["a", "c", "d"] and cursor == ""
            assert await b.prefix_length(S0, ["a", "c", "b", "d"]) == 2
            with pytest.raises(NotInitialized):
                await b.dump(MISSING, "", 10)
        finally:
            await crash(b)

    asyncio.run(main())
