"""``prefix_length_hashes`` (``prefix_match`` by SGLang's block hashes) on every backend.

A backend built with ``hash_index=True`` (``--hash-index``) keeps each SGLang pool's stored keys
by block hash: the first 16 hex digits of a key, read as a signed 64-bit int
(``events.wire.sglang_hash``). Every workload ends with ``check()`` (the fixture's, and
explicit ones in between), which compares the index with the stored keys in the store itself.
On Redis, whether a pool keeps the index is the pool's own property, so servers with and
without the flag sharing one Redis agree.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from kvmeta._types import PoolId
from kvmeta.config import Settings
from kvmeta.errors import NoHashIndex, NotInitialized
from kvmeta.events.wire import sglang_hash
from kvmeta.server.runner import build_backend
from kvmeta.store.redis.backend import POOL_PARTS, WALK_STALE, RedisBackend, pool_keys
from kvmeta.store.redis.scripts import ScriptLibrary
from tests.contract.conftest import REDIS_SERVERS, Sync

S0 = PoolId("s", 0, "kv")
S1 = PoolId("s", 1, "other ns/with:odd{chars}")
V0 = PoolId("v", 0, "")


def _key(i: int, tail: str = "") -> str:
    """A SHA-256-like page key: 64 hex digits (the first 16 distinct per ``i``)."""
    return f"{(i * 0x9E3779B97F4A7C15) % (1 << 64):016x}" + "ab" * 24 + tail


def _store(b: Sync, pool: PoolId, keys: list[str]) -> list[int]:
    pages = [page for _, page in b.reserve(pool, keys)]
    assert -1 not in pages
    assert b.confirm(pool, list(zip(keys, pages, strict=True)), []) == 0
    return pages


def _hashes(keys: list[str]) -> list[int]:
    return [sglang_hash(k) for k in keys]


def _found(b: Sync, pool: PoolId, keys: list[str]) -> list[bool]:
    """Whether each key's hash is found, asked one by one."""
    return [b.prefix_length_hashes(pool, [h]) == 1 for h in _hashes(keys)]


@pytest.fixture
def hb(make_backend: Callable[..., Sync]) -> Sync:
    """A backend with the hash index on."""
    return make_backend(hash_index=True)


def _hidx(b: Sync, request: pytest.FixtureRequest, pool: PoolId) -> tuple[Any, str]:
    """redis-py to the backend's Redis, and the pool's index key."""
    client = request.getfixturevalue(REDIS_SERVERS[b.kind]).client()
    return client, pool_keys(pool)[POOL_PARTS.index("hidx")]


def test_stored_keys_are_found_in_order_and_the_match_stops_at_the_first_miss(hb: Sync) -> None:
    hb.initialize(S0, 64)
    keys = [_key(i) for i in range(10)]
    _store(hb, S0, keys[:6])
    hashes = _hashes(keys)
    assert hb.prefix_length_hashes(S0, hashes) == 6
    assert hb.prefix_length_hashes(S0, hashes[:3]) == 3
    assert hb.prefix_length_hashes(S0, [hashes[7], *hashes[:6]]) == 0
    assert hb.prefix_length_hashes(S0, [*hashes[:2], hashes[8], *hashes[2:6]]) == 2
    assert hb.prefix_length_hashes(S0, []) == 0
    # The same answer as by keys.
    assert hb.prefix_length(S0, keys) == 6
    # Negative hashes (a head from 8000...) and the extremes round-trip.
    edge = ["8000000000000000" + "0" * 48, "ffffffffffffffff" + "1" * 48, "7fffffffffffffff"]
    _store(hb, S0, edge)
    assert _hashes(edge) == [-(1 << 63), -1, (1 << 63) - 1]
    assert hb.prefix_length_hashes(S0, _hashes(edge)) == 3
    # Pools are separate.
    hb.initialize(S1, 8)
    assert hb.prefix_length_hashes(S1, hashes) == 0
    hb.check()


def test_evictions_remove_their_hashes(hb: Sync) -> None:
    hb.initialize(S0, 4)
    first = [_key(i) for i in range(4)]
    _store(hb, S0, first)
    later = [_key(i) for i in range(100, 103)]
    _store(hb, S0, later)  # evicts the three coldest of ``first``
    assert hb.exists(S0, first) == [False, False, False, True]
    assert _found(hb, S0, first) == [False, False, False, True]
    assert hb.prefix_length_hashes(S0, _hashes(later)) == 3
    hb.check()


def test_deletes_and_clear_remove_their_hashes(hb: Sync) -> None:
    hb.initialize(S0, 16)
    keys = [_key(i) for i in range(6)]
    _store(hb, S0, keys)
    assert hb.delete(S0, [keys[1], keys[4], "never stored"]) == 2
    assert _found(hb, S0, keys) == [True, False, True, True, False, True]
    assert hb.prefix_length_hashes(S0, _hashes(keys)) == 1
    hb.check()
    assert hb.clear(S0) == 4
    assert _found(hb, S0, keys) == [False] * 6
    _store(hb, S0, keys[:2])  # stored again after the clear: found again
    assert hb.prefix_length_hashes(S0, _hashes(keys)) == 2
    hb.check()


def test_keys_sharing_a_head_keep_the_hash_while_one_is_stored(hb: Sync) -> None:
    hb.initialize(S0, 16)
    a, b = "0123456789abcdefX", "0123456789ABCDEFY"
    h = sglang_hash(a)
    assert sglang_hash(b) == h
    _store(hb, S0, [a, b])  # both in one call
    hb.check()
    assert hb.delete(S0, [a]) == 1
    assert hb.prefix_length_hashes(S0, [h]) == 1
    hb.check()
    assert hb.delete(S0, [b]) == 1
    assert hb.prefix_length_hashes(S0, [h]) == 0
    # One call after the other, and both removed in one call.
    _store(hb, S0, [b])
    _store(hb, S0, [a])
    c = "0123456789abcdefZ"
    _store(hb, S0, [c])
    hb.check()
    assert hb.delete(S0, [a, c]) == 2
    assert hb.prefix_length_hashes(S0, [h]) == 1
    assert hb.delete(S0, [b]) == 1
    assert hb.prefix_length_hashes(S0, [h]) == 0
    hb.check()


def test_shared_heads_across_evictions(hb: Sync) -> None:
    hb.initialize(S0, 3)
    a, b = "fedcba9876543210-a", "FEDCBA9876543210-b"
    _store(hb, S0, [a])
    _store(hb, S0, [b, _key(1)])
    _store(hb, S0, [_key(2)])  # evicts a, the coldest
    assert hb.exists(S0, [a, b]) == [False, True]
    assert hb.prefix_length_hashes(S0, [sglang_hash(a)]) == 1
    _store(hb, S0, [_key(3)])  # evicts b
    assert hb.prefix_length_hashes(S0, [sglang_hash(a)]) == 0
    hb.check()


def test_keys_without_a_hex_head_are_not_indexed_and_break_nothing(hb: Sync) -> None:
    hb.initialize(S0, 16)
    odd = [
        "not-a-hex-key-at-all",
        "0123456789abcdeg" + "0" * 10,  # a 'g' in the 16th place
        "short",
        "0x23456789abcdef0",  # parses as hex in Python, but is not 16 hex digits
        " 23456789abcdef01",  # (its hash is no stored key's head)
        "é123456789abcdef0",
        "",
    ]
    plain = [_key(1), "0123456789abcdef"]  # exactly 16 hex digits: indexed
    _store(hb, S0, [*odd, *plain])
    assert hb.exists(S0, odd) == [True] * len(odd)
    assert _found(hb, S0, odd) == [False] * len(odd)
    assert hb.prefix_length_hashes(S0, _hashes(plain)) == 2
    hb.check()
    assert hb.delete(S0, [*odd, plain[0]]) == len(odd) + 1
    assert _found(hb, S0, plain) == [False, True]
    hb.check()


def test_uppercase_heads_match(hb: Sync) -> None:
    hb.initialize(S0, 8)
    upper = "ABCDEF0123456789" + "C" * 48
    _store(hb, S0, [upper])
    assert hb.prefix_length_hashes(S0, [sglang_hash(upper.lower())]) == 1
    assert hb.delete(S0, [upper]) == 1
    assert hb.prefix_length_hashes(S0, [sglang_hash(upper)]) == 0


def test_an_unknown_pool_is_not_initialized(hb: Sync) -> None:
    for hashes in ([1, 2], []):
        with pytest.raises(NotInitialized):
            hb.prefix_length_hashes(S0, hashes)
        with pytest.raises(NotInitialized):
            hb.prefix_length_hashes(V0, hashes)


def test_a_vllm_pool_keeps_no_hash_index(hb: Sync) -> None:
    hb.v_register(0, 8, None)
    key = _key(5)
    _store(hb, V0, [key])
    for hashes in ([sglang_hash(key)], []):
        with pytest.raises(NoHashIndex, match="vLLM rank 0"):
            hb.prefix_length_hashes(V0, hashes)


def test_a_backend_without_the_index_answers_no_hash_index(
    make_backend: Callable[..., Sync],
) -> None:
    b = make_backend()
    b.initialize(S0, 8)
    key = _key(3)
    _store(b, S0, [key])
    for hashes in ([sglang_hash(key)], []):
        with pytest.raises(NoHashIndex, match="--hash-index"):
            b.prefix_length_hashes(S0, hashes)
    assert b.prefix_length(S0, [key]) == 1


def test_a_random_workload_keeps_the_index_exact(hb: Sync) -> None:
    """Reserves (evicting), confirms, deletes and clears over a small pool, with keys that
    share heads and keys without one; after each step every head is found exactly when some
    key with it is stored."""
    rng = random.Random(7)
    heads = [f"{rng.getrandbits(64):016x}" for _ in range(12)]
    universe = [h + t for h in heads for t in ("", "-1", "-2")]
    universe += [h.upper() + "-U" for h in heads[:4]] + ["no-head-1", "no-head-2"]
    hb.initialize(S0, 10)
    for step in range(120):
        op = rng.random()
        if op < 0.7:
            keys = rng.sample(universe, rng.randint(1, 6))
            got = hb.reserve(S0, keys)
            pairs = [(k, p) for k, (hit, p) in zip(keys, got, strict=True) if not hit and p >= 0]
            hb.confirm(S0, pairs, [])
        elif op < 0.95:
            hb.delete(S0, rng.sample(universe, rng.randint(1, 5)))
        else:
            hb.clear(S0)
        stored = {k for k, s in zip(universe, hb.exists(S0, universe), strict=True) if s}
        want = [any(k[:16].lower() == h for k in stored) for h in heads]
        found = [hb.prefix_length_hashes(S0, [sglang_hash(h)]) == 1 for h in heads]
        assert found == want, f"step {step}"
        if step % 20 == 0:
            hb.check()
    hb.check()


# ---------------------------------------------------------------- servers sharing one Redis


def test_a_server_with_the_flag_builds_the_index_of_an_existing_pool(
    make_redis_backend: Callable[..., Sync],
) -> None:
    plain = make_redis_backend()
    plain.initialize(S0, 16)
    keys = [_key(i) for i in range(8)] + ["0123456789abcdefX", "0123456789ABCDEFY", "odd"]
    _store(plain, S0, keys)
    assert plain.delete(S0, [keys[2]]) == 1
    with pytest.raises(NoHashIndex):
        plain.prefix_length_hashes(S0, _hashes(keys))
    indexed = make_redis_backend(hash_index=True)
    result = indexed.initialize(S0, 16)
    assert not result.created
    indexed.check()
    assert indexed.prefix_length_hashes(S0, _hashes(keys)) == 2
    assert _found(indexed, S0, keys[:-1]) == [True, True, False] + [True] * 7
    # Now the pool keeps it, whichever server asks.
    assert plain.prefix_length_hashes(S0, _hashes(keys[:2])) == 2
    # Initialising again does not rebuild (nor break) it.
    indexed.initialize(S0, 16)
    plain.initialize(S0, 16)
    indexed.check()
    assert indexed.delete(S0, ["0123456789abcdefX"]) == 1
    assert indexed.prefix_length_hashes(S0, [sglang_hash("0123456789abcdefX")]) == 1


def test_a_server_without_the_flag_maintains_a_pool_s_index(
    make_redis_backend: Callable[..., Sync],
) -> None:
    indexed = make_redis_backend(hash_index=True)
    plain = make_redis_backend()
    indexed.initialize(S0, 4)
    plain.initialize(S0, 4)
    first = [_key(i) for i in range(4)]
    _store(plain, S0, first)
    assert indexed.prefix_length_hashes(S0, _hashes(first)) == 4
    _store(plain, S0, [_key(10), _key(11)])  # evicts first[0] and first[1]
    assert _found(indexed, S0, first) == [False, False, True, True]
    assert plain.delete(S0, [first[2]]) == 1
    assert _found(indexed, S0, first) == [False, False, False, True]
    plain.check()
    plain.clear(S0)
    assert _found(indexed, S0, [*first, _key(10), _key(11)]) == [False] * 6
    indexed.check()
    # A pool created by the flagless server keeps none, and asks say so.
    plain.initialize(S1, 4)
    with pytest.raises(NoHashIndex):
        indexed.prefix_length_hashes(S1, [1])


def test_check_reports_an_index_out_of_step(
    make_redis_backend: Callable[..., Sync], request: pytest.FixtureRequest
) -> None:
    hb = make_redis_backend(hash_index=True)
    hb.initialize(S0, 16)
    keys = [_key(i) for i in range(5)]
    pages = _store(hb, S0, keys)
    hb.check()
    client, hidx = _hidx(hb, request, S0)
    field = keys[0][:16]
    original = client.hget(hidx, field)
    assert original is not None and int(original) == pages[0]
    corruptions = [
        ("hset", ("0000000000000bad", str(pages[1]))),  # a bogus head, on a used page
        ("hset", ("00000000000000ff", "15")),  # a page that is not STORED
        ("hdel", (field,)),  # a stored key's head missing
        ("hset", (field, f"{pages[0]},{pages[0]}")),  # one key counted twice
        ("hset", ("NOT-A-HEAD", str(pages[0]))),
    ]
    for command, args in corruptions:
        getattr(client, command)(hidx, *args)
        report = hb._run(hb.backend.check())
        assert report.problems, f"{command} {args} not reported"
        assert all(str(S0) in p for p in report.problems)
        # Put it back.
        if command == "hset" and args[0] != field:
            client.hdel(hidx, args[0])
        client.hset(hidx, field, original)
        hb.check()
    client.close()


def test_the_server_flag_reaches_the_redis_backend() -> None:
    for flag in (False, True):
        settings = Settings(backend="redis://127.0.0.1:1/0", hash_index=flag)
        backend = build_backend(settings)
        assert isinstance(backend, RedisBackend) and backend.hash_index is flag


# ---------------------------------------------- building the index of an existing pool (Redis)

BIG = 5000


def _flags(b: Sync, request: pytest.FixtureRequest, pool: PoolId) -> tuple[bool, bool]:
    """The pool's meta flags: (index complete (hx), index being built (hb))."""
    client = request.getfixturevalue(REDIS_SERVERS[b.kind]).client()
    try:
        hx, hb = client.hmget(pool_keys(pool)[0], "hx", "hb")
    finally:
        client.close()
    return hx == b"1", hb == b"1"


def _filled(b: Sync, pool: PoolId, count: int) -> list[str]:
    """A pool created without the index, holding ``count`` stored keys."""
    b.initialize(pool, count)
    keys = [_key(i) for i in range(count)]
    for i in range(0, count, 1000):
        _store(b, pool, keys[i : i + 1000])
    return keys


def _without_index(
    make: Callable[..., Sync], count: int, chunk: int
) -> tuple[Sync, list[str], Sync]:
    """A pool of ``count`` stored keys made through a server without the flag, that server,
    and one with the flag whose walks go in chunks of ``chunk``: (plain, keys, indexed)."""
    plain = make()
    keys = _filled(plain, S0, count)
    indexed = make(hash_index=True)
    indexed.backend.build_chunk = chunk
    return plain, keys, indexed


def _until_built(
    b: Sync, request: pytest.FixtureRequest, pool: PoolId, seconds: float = 60
) -> None:
    """Let the event loop run (the walk is a task on it) until the pool's index is complete."""
    deadline = time.monotonic() + seconds
    while _flags(b, request, pool) != (True, False):
        assert time.monotonic() < deadline, "the index was not built in time"
        b._run(asyncio.sleep(0.01))


def _age_walk(b: Sync, request: pytest.FixtureRequest, pool: PoolId, seconds: float) -> None:
    """Move the time of the build's latest step (meta hbt) ``seconds`` back, as if its walk
    had taken no step for that long."""
    client = request.getfixturevalue(REDIS_SERVERS[b.kind]).client()
    meta = pool_keys(pool)[0]
    try:
        stamp = client.hget(meta, "hbt")
        assert stamp is not None, "no walk stamped the build"
        client.hset(meta, "hbt", f"{float(stamp) - seconds:.6f}")
    finally:
        client.close()


def _claim(b: Sync, request: pytest.FixtureRequest, pool: PoolId) -> tuple[str | None, ...]:
    """The build's claim in the pool's meta: (hbw: the walker's id, hbt: its latest step)."""
    client = request.getfixturevalue(REDIS_SERVERS[b.kind]).client()
    try:
        values = client.hmget(pool_keys(pool)[0], "hbw", "hbt")
    finally:
        client.close()
    return tuple(None if v is None else v.decode() for v in values)


def _meta(b: Sync, request: pytest.FixtureRequest, pool: PoolId) -> dict[bytes, bytes]:
    """The pool's whole meta hash."""
    client = request.getfixturevalue(REDIS_SERVERS[b.kind]).client()
    try:
        return dict(client.hgetall(pool_keys(pool)[0]))
    finally:
        client.close()


def _kill(b: Sync) -> None:
    """Stop ``b``'s server as a killed process stops: its walks end where they are and their
    claims stay in Redis (no release), to be taken over once stale."""

    async def kept(pools: list[PoolId]) -> None:
        return None

    b.backend._release_walks = kept  # type: ignore[method-assign]
    b._run(b.backend.close())


def _fills(b: Sync, before: Callable[[int], Awaitable[None]] | None = None) -> list[list[Any]]:
    """The replies to ``b``'s ``hidx_fill`` calls, as they come: ``[0, cursor, visited]`` for a
    step of its walk, ``[2]`` where another server's walk holds the build. ``before(n)`` is
    awaited before its call n (from 0): a test's gate."""
    replies: list[list[Any]] = []
    run = b.backend._run

    async def recorded(script: str, keys: tuple[str, ...], args: list[Any]) -> list[Any]:
        if script != "hidx_fill":
            return await run(script, keys, args)
        if before is not None:
            await before(len(replies))
        reply = await run(script, keys, args)
        replies.append(list(reply))
        return reply

    b.backend._run = recorded  # type: ignore[method-assign]
    return replies


def _steps(gate: dict[str, int]) -> Callable[[int], Awaitable[None]]:
    """A ``_fills`` gate letting a walk take ``gate["steps"]`` steps (a test raises it)."""

    async def before(n: int) -> None:
        while n >= gate["steps"]:
            await asyncio.sleep(0.005)

    return before


def _at_once(b: Sync, *calls: Awaitable[Any]) -> list[Any]:
    """Run ``calls`` concurrently on the tests' event loop: their results, or the errors."""

    async def gathered() -> list[Any]:
        return await asyncio.gather(*calls, return_exceptions=True)

    return b._run(gathered())


def _until(b: Sync, done: Callable[[], bool], seconds: float = 60) -> None:
    """Let the event loop run until ``done()``."""
    deadline = time.monotonic() + seconds
    while not done():
        assert time.monotonic() < deadline, "not done in time"
        b._run(asyncio.sleep(0.005))


def _answer_or_building(b: Sync, pool: PoolId, hashes: list[int], want: int) -> bool:
    """True if the lookup answered ``want``, False if it said the index is being built."""
    try:
        got = b.prefix_length_hashes(pool, hashes)
    except NoHashIndex as exc:
        assert "being built" in str(exc) and exc.field == "hashes"
        return False
    assert got == want
    return True


def test_a_big_existing_pool_is_built_in_the_background(
    make_redis_backend: Callable[..., Sync], request: pytest.FixtureRequest
) -> None:
    plain, keys, indexed = _without_index(make_redis_backend, BIG, 200)  # a walk of many chunks
    assert not indexed.initialize(S0, BIG).created  # answers at once: the walk is a task
    assert _flags(indexed, request, S0) in ((False, True), (True, False))
    hashes = _hashes(keys)
    answered = [_answer_or_building(indexed, S0, hashes, BIG)]
    answered.append(_answer_or_building(plain, S0, hashes[:1], 1))
    indexed.check()  # a partial index lists only stored keys' pages
    _until_built(indexed, request, S0)
    assert not all(answered), "the index was complete before the walk ran"
    assert indexed.prefix_length_hashes(S0, hashes) == BIG
    assert plain.prefix_length_hashes(S0, hashes) == BIG
    indexed.check()
    # Initialising again changes nothing.
    indexed.initialize(S0, BIG)
    assert _flags(indexed, request, S0) == (True, False)


def test_a_workload_while_the_index_is_built_ends_with_an_exact_index(
    make_redis_backend: Callable[..., Sync], request: pytest.FixtureRequest
) -> None:
    """Stores that evict, deletes and a clear, through a server with the flag and one
    without, while the walk goes on in small chunks: the index ends exact."""
    n = 3000
    plain, keys, indexed = _without_index(make_redis_backend, n, 20)
    # The walk may take 50 steps (about 1,000 of the 3,000 keys), interleaved with the
    # workload's calls, then waits until the clear is done: so the clear comes mid-walk
    # however fast the walk runs.
    gate = {"steps": 50}
    run = indexed.backend._run

    async def gated(script: str, keys: tuple[str, ...], args: list[Any]) -> list[Any]:
        if script == "hidx_fill":
            while gate["steps"] <= 0:
                await asyncio.sleep(0.005)
            gate["steps"] -= 1
        return await run(script, keys, args)

    indexed.backend._run = gated  # type: ignore[method-assign]
    indexed.initialize(S0, n)
    rng = random.Random(11)
    universe = keys + [_key(i) for i in range(n, n + 1000)] + ["no-head", "0123456789abcdefX"]
    steps = 0
    while _flags(indexed, request, S0)[1] or steps < 60:
        b = indexed if steps % 2 else plain
        op = rng.random()
        if steps == 30:
            assert _flags(b, request, S0) == (False, True), "the walk ended before the clear"
            assert gate["steps"] < 50, "the walk took no step alongside the workload"
            b.clear(S0)
            gate["steps"] = 1 << 30
        elif op < 0.6:
            batch = rng.sample(universe, 50)
            got = b.reserve(S0, batch)
            pairs = [(k, p) for k, (hit, p) in zip(batch, got, strict=True) if not hit and p >= 0]
            b.confirm(S0, pairs, [])
        else:
            b.delete(S0, rng.sample(universe, 40))
        if steps % 10 == 0:
            b.check()  # mid-build too
        steps += 1
        assert steps < 5000, "the walk did not finish"
    _until_built(indexed, request, S0)
    indexed.check()
    stored = [k for k, s in zip(universe, indexed.exists(S0, universe), strict=True) if s]
    assert stored
    assert _found(indexed, S0, stored) == [True] * len(stored)
    heads = {k[:16].lower() for k in stored}
    gone = [k for k in universe if k[:16].lower() not in heads]
    assert gone and not any(_found(indexed, S0, gone))


def test_a_walk_cut_short_is_taken_over_by_an_initialize_once_it_has_been_still(
    make_redis_backend: Callable[..., Sync], request: pytest.FixtureRequest
) -> None:
    plain, keys, first = _without_index(make_redis_backend, BIG, 10)  # 500 chunks: cut after a few
    first.initialize(S0, BIG)
    for _ in range(3):
        first._run(asyncio.sleep(0.005))
    assert _flags(first, request, S0) == (False, True), "the walk finished before it was cut"
    _kill(first)  # the server is killed mid-walk
    assert plain.delete(S0, keys[:100]) == 100  # while no one walks: maintained all the same
    assert _flags(plain, request, S0) == (False, True)
    plain.check()
    assert [s.stored for s in plain.stats() if s.pool == S0] == [BIG - 100]  # (meta has hbt)
    with pytest.raises(NoHashIndex, match="being built"):
        plain.prefix_length_hashes(S0, _hashes(keys))
    second, third = make_redis_backend(hash_index=True), make_redis_backend(hash_index=True)
    second.backend.build_chunk = third.backend.build_chunk = 100
    fills = [_fills(second), _fills(third)]
    # Its latest step was a moment ago: an initialise leaves the walk to its server.
    assert not second.initialize(S0, BIG).created
    assert S0 not in second.backend._builds
    # Once it has taken no step for the stale time, the next initialise takes it over, and
    # one a moment later leaves it to that one.
    _age_walk(plain, request, S0, WALK_STALE + 1)
    second.initialize(S0, BIG)
    third.initialize(S0, BIG)
    assert S0 in second.backend._builds and S0 not in third.backend._builds
    _until_built(second, request, S0)
    assert fills[0] and all(r[0] == 0 for r in fills[0]) and fills[1] == []
    assert second.prefix_length_hashes(S0, _hashes(keys[100:])) == BIG - 100
    assert _found(second, S0, keys[:100]) == [False] * 100
    second.check()
    first._run(first.backend.start())  # (for the fixture's final check)


def test_servers_initialising_a_pool_at_once_leave_its_walk_to_one(
    make_redis_backend: Callable[..., Sync], request: pytest.FixtureRequest
) -> None:
    """A fleet restart: every server with the flag initialises the pool at once; the first
    initialise claims the walk and the others leave it."""
    plain, keys, indexed = _without_index(make_redis_backend, BIG, 500)
    servers = [indexed, make_redis_backend(hash_index=True), make_redis_backend(hash_index=True)]
    for b in servers:
        b.backend.build_chunk = 500
    fills = [_fills(b) for b in servers]
    results = _at_once(plain, *(b.backend.initialize(S0, BIG) for b in servers))
    assert [r.created for r in results] == [False] * 3
    _until_built(plain, request, S0)
    _until(plain, lambda: not any(S0 in b.backend._builds for b in servers))  # (its last reply)
    calls = [len(f) for f in fills]
    assert sum(1 for n in calls if n) == 1, f"hidx_fill calls per server: {calls}"
    walked = fills[[bool(n) for n in calls].index(True)]
    assert all(r[0] == 0 for r in walked) and sum(r[2] for r in walked) >= BIG, walked
    hashes = _hashes(keys)
    for b in (plain, *servers):
        assert b.prefix_length_hashes(S0, hashes) == BIG
    indexed.check()


def test_servers_whose_lookups_find_a_stopped_walk_at_once_leave_it_to_one(
    make_redis_backend: Callable[..., Sync], request: pytest.FixtureRequest
) -> None:
    """Two routers' servers find the build waiting, its walk still for longer than the stale
    time, at once: both try to take it over, and the first step of one claims it."""
    plain, keys, first = _without_index(make_redis_backend, BIG, 10)
    first.initialize(S0, BIG)
    _kill(first)  # its server is killed mid-walk
    assert _flags(plain, request, S0) == (False, True), "the walk finished before it was cut"
    routers = [make_redis_backend(hash_index=True) for _ in range(2)]
    # No step goes until both lookups have answered (so both find the walk still, neither
    # finds the other's claim); then each router's first step (its claim) goes, and the rest
    # wait until both are answered.
    gate = {"steps": 0}
    fills = [_fills(r, _steps(gate)) for r in routers]
    for r in routers:
        r.backend.build_chunk = 500
    _age_walk(plain, request, S0, WALK_STALE + 1)
    hashes = _hashes(keys)
    got = _at_once(plain, *(r.backend.prefix_length_hashes(S0, hashes) for r in routers))
    assert all(isinstance(g, NoHashIndex) and "being built" in str(g) for g in got), got
    assert all(S0 in r.backend._builds for r in routers)  # both try
    gate["steps"] = 1
    _until(plain, lambda: all(fills))
    gate["steps"] = 1 << 30
    _until_built(plain, request, S0)
    assert sorted(f[0][0] for f in fills) == [0, 2], fills  # one claimed, one found it taken
    assert [len(f) for f in fills if f[0] == [2]] == [1]
    for r in routers:
        assert r.prefix_length_hashes(S0, hashes) == BIG
    plain.check()
    first._run(first.backend.start())  # (for the fixture's final check)


def test_a_walk_that_keeps_stepping_is_not_taken_over_and_one_taken_over_stops(
    make_redis_backend: Callable[..., Sync], request: pytest.FixtureRequest
) -> None:
    plain, keys, first = _without_index(make_redis_backend, BIG, 100)
    gate = {"steps": 3}
    first_fills = _fills(first, _steps(gate))
    first.initialize(S0, BIG)
    _until(first, lambda: len(first_fills) == 3)
    other = make_redis_backend(hash_index=True)
    other.backend.build_chunk = 100
    other_gate = {"steps": 1}
    other_fills = _fills(other, _steps(other_gate))
    hashes = _hashes(keys)

    def left_alone() -> None:
        """An initialise and a lookup by ``other`` leave the walk to ``first``."""
        assert not other.initialize(S0, BIG).created
        assert not _answer_or_building(other, S0, hashes, BIG)
        assert S0 not in other.backend._builds and other_fills == []

    left_alone()  # its latest step was a moment ago
    # Its stamp ages past the stale time, but its next step is its own and stamps it again.
    _age_walk(plain, request, S0, WALK_STALE + 1)
    gate["steps"] = 4
    _until(first, lambda: len(first_fills) == 4)
    assert first_fills[-1][0] == 0
    left_alone()
    # Now it holds still for longer than the stale time (its server stalls): the next
    # initialise takes it over, and the stalled walk's next step finds it taken and stops.
    _age_walk(plain, request, S0, WALK_STALE + 1)
    assert not other.initialize(S0, BIG).created
    assert S0 in other.backend._builds
    _until(other, lambda: len(other_fills) == 1)
    assert other_fills[0][0] == 0
    gate["steps"] = 1 << 30
    _until(first, lambda: S0 not in first.backend._builds)
    assert first_fills[-1] == [2] and len(first_fills) == 5
    other_gate["steps"] = 1 << 30
    _until_built(other, request, S0)
    assert all(r[0] == 0 for r in other_fills)
    assert other.prefix_length_hashes(S0, hashes) == BIG
    other.check()


def test_a_pool_with_few_stored_keys_is_built_by_its_initialize(
    make_redis_backend: Callable[..., Sync], request: pytest.FixtureRequest
) -> None:
    plain, keys, indexed = _without_index(make_redis_backend, 300, 300)
    indexed.initialize(S0, 300)
    assert _flags(indexed, request, S0) == (True, False)
    assert indexed.prefix_length_hashes(S0, _hashes(keys)) == 300


def test_a_stopped_walk_is_resumed_by_a_lookup_once_it_has_been_still(
    make_redis_backend: Callable[..., Sync], request: pytest.FixtureRequest
) -> None:
    """No initialise comes (the engines run on): a server with the flag that finds the
    build waiting in a lookup resumes it once the walk has taken no step for ``walk_stale``
    seconds, and not while a walk is under way."""
    plain, keys, first = _without_index(make_redis_backend, BIG, 10)
    first.initialize(S0, BIG)
    router = make_redis_backend(hash_index=True)
    hashes = _hashes(keys)
    assert not _answer_or_building(router, S0, hashes, BIG)  # a walk under way: left to it
    assert S0 not in router.backend._builds
    _kill(first)  # its server is killed mid-walk
    assert _flags(plain, request, S0) == (False, True)
    assert not _answer_or_building(router, S0, hashes, BIG)
    assert S0 not in router.backend._builds  # (its last step is recent yet)
    _age_walk(plain, request, S0, WALK_STALE + 1)
    assert not _answer_or_building(router, S0, hashes, BIG)  # still: this one resumes it
    assert S0 in router.backend._builds
    _until_built(router, request, S0)
    assert router.prefix_length_hashes(S0, hashes) == BIG
    router.check()
    first._run(first.backend.start())  # (for the fixture's final check)


def _evalsha(b: Sync) -> None:
    """Run ``b``'s Lua as EVALSHA scripts from now on (the library of a Redis without
    Functions): its next call finds the script missing, loads it and runs it."""
    b.backend._scripts = ScriptLibrary(functions=False)


def _stalled_walk(
    make: Callable[..., Sync], request: pytest.FixtureRequest, steps: int
) -> tuple[Sync, list[str], Sync, list[list[Any]]]:
    """A pool being built whose walk, by a server with the flag, has taken ``steps`` steps and
    waits for more (a slow walk): (plain, keys, walker, its hidx_fill replies)."""
    plain, keys, walker = _without_index(make, BIG, 10)
    fills = _fills(walker, _steps({"steps": steps}))
    assert not walker.initialize(S0, BIG).created
    _until(walker, lambda: len(fills) == steps)
    assert _flags(plain, request, S0) == (False, True)
    assert _claim(plain, request, S0)[0] == walker.backend._walker
    return plain, keys, walker, fills


@pytest.mark.parametrize("scripts", ["functions", "evalsha"])
@pytest.mark.parametrize("by", ["initialize", "lookup"])
def test_a_walk_released_by_a_clean_close_is_taken_over_at_once(
    make_redis_backend: Callable[..., Sync], request: pytest.FixtureRequest, by: str, scripts: str
) -> None:
    """A server that closes cleanly mid-walk releases its claim: the next server with the
    flag to initialise the pool or look it up by hash walks at once, long before the walk
    would count as stale."""
    plain, keys, first, _ = _stalled_walk(make_redis_backend, request, 3)
    if scripts == "evalsha":
        _evalsha(first)  # (the release is the first call it makes this way)
    first._run(first.backend.close())
    assert _claim(plain, request, S0) == (None, None)
    assert _flags(plain, request, S0) == (False, True)  # still being built
    hashes = _hashes(keys)
    assert not _answer_or_building(plain, S0, hashes, BIG)
    second = make_redis_backend(hash_index=True)
    second.backend.build_chunk = 500
    assert second.backend.walk_stale == WALK_STALE
    fills = _fills(second)
    if by == "initialize":
        assert not second.initialize(S0, BIG).created
    else:
        assert not _answer_or_building(second, S0, hashes, BIG)
    assert S0 in second.backend._builds
    _until_built(second, request, S0)
    _until(second, lambda: S0 not in second.backend._builds)  # (its last reply)
    assert fills and all(r[0] == 0 for r in fills), fills
    assert sum(r[2] for r in fills) >= BIG, fills  # walked from the first stored key
    assert _claim(plain, request, S0) == (None, None)
    assert second.prefix_length_hashes(S0, hashes) == BIG
    assert plain.prefix_length_hashes(S0, hashes) == BIG
    second.check()
    first._run(first.backend.start())  # (for the fixture's final check)


def test_a_release_leaves_a_walk_another_server_took_over(
    make_redis_backend: Callable[..., Sync], request: pytest.FixtureRequest
) -> None:
    """A server whose walk stalled and was taken over releases nothing as it closes: the
    walk stays that other server's, its stamp as it was, and that server finishes it."""
    plain, keys, first, first_fills = _stalled_walk(make_redis_backend, request, 2)
    second = make_redis_backend(hash_index=True)
    second.backend.build_chunk = 100
    gate = {"steps": 1}
    second_fills = _fills(second, _steps(gate))
    _age_walk(plain, request, S0, WALK_STALE + 1)
    assert not second.initialize(S0, BIG).created  # takes the stalled walk over
    _until(second, lambda: len(second_fills) == 1)
    held = _claim(plain, request, S0)
    assert held[0] == second.backend._walker
    assert S0 in first.backend._walked  # (its task does not know yet)
    first._run(first.backend.close())
    assert _claim(plain, request, S0) == held
    assert len(first_fills) == 2  # no step after the close
    gate["steps"] = 1 << 30
    _until_built(second, request, S0)
    assert all(r[0] == 0 for r in second_fills)
    assert second.prefix_length_hashes(S0, _hashes(keys)) == BIG
    second.check()
    first._run(first.backend.start())  # (for the fixture's final check)


def test_a_release_leaves_a_finished_build_and_an_absent_pool_alone(
    make_redis_backend: Callable[..., Sync], request: pytest.FixtureRequest
) -> None:
    plain, keys, first, _ = _stalled_walk(make_redis_backend, request, 2)
    second = make_redis_backend(hash_index=True)
    second.backend.build_chunk = 500
    _age_walk(plain, request, S0, WALK_STALE + 1)
    second.initialize(S0, BIG)
    _until_built(second, request, S0)
    built = _meta(plain, request, S0)
    assert b"hbw" not in built and b"hbt" not in built and b"hb" not in built
    first._run(first.backend.close())  # its walk was taken over and finished meanwhile
    assert _meta(plain, request, S0) == built
    # Even a claim naming this server on a finished build (never left by a walk) stays.
    client = request.getfixturevalue(REDIS_SERVERS[plain.kind]).client()
    meta = pool_keys(S0)[0]
    try:
        client.hset(meta, mapping={"hbw": second.backend._walker, "hbt": "1.000000"})
        planted = _meta(plain, request, S0)
        release = second.backend._run("hidx_release", pool_keys(S0), [second.backend._walker])
        assert second._run(release) == [0]
        assert _meta(plain, request, S0) == planted
        client.hdel(meta, "hbw", "hbt")
    finally:
        client.close()
    # A pool that does not exist is not created by a release.
    absent = pool_keys(S1)
    assert second._run(second.backend._run("hidx_release", absent, ["anyone"])) == [0]
    client = request.getfixturevalue(REDIS_SERVERS[plain.kind]).client()
    try:
        assert not client.exists(absent[0])
    finally:
        client.close()
    assert second.prefix_length_hashes(S0, _hashes(keys)) == BIG
    first._run(first.backend.start())  # (for the fixture's final check)


def test_a_redis_that_does_not_answer_does_not_hold_up_close(
    make_redis_backend: Callable[..., Sync],
    request: pytest.FixtureRequest,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The release is bounded by --failover-timeout: past it, close goes on, says the walk
    will be resumed once stale, and the claim stays for that."""
    plain, _, first, _ = _stalled_walk(make_redis_backend, request, 2)
    held = _claim(plain, request, S0)
    run = first.backend._run

    async def silent(script: str, keys: tuple[str, ...], args: list[Any]) -> list[Any]:
        if script == "hidx_release":
            await asyncio.Event().wait()  # a Redis that never answers
        return await run(script, keys, args)

    first.backend._run = silent  # type: ignore[method-assign]
    first.backend.failover_timeout = 0.3
    started = time.monotonic()
    with caplog.at_level("WARNING", logger="kvmeta.store.redis.backend"):
        first._run(first.backend.close())
    assert time.monotonic() - started < 5
    assert _claim(plain, request, S0) == held
    assert any(
        "could not release" in r.getMessage() and f"{WALK_STALE:.0f} s" in r.getMessage()
        for r in caplog.records
    ), caplog.records
    first._run(first.backend.start())  # (for the fixture's final check)
