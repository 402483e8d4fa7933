"""Random operation sequences on the memory and Redis backends side by side: every reply,
every stats line (counters included) and every page number must be identical.

Leases are either off or far longer than the test, so the outcome does not depend on time.
"""

from __future__ import annotations

import asyncio
import random

import pytest

from kvmeta._types import PoolId
from kvmeta.core.invariants import check_pool
from kvmeta.errors import KvmetaError
from kvmeta.store.memory import MemoryBackend, MemoryStore
from kvmeta.store.redis import RedisBackend

POOLS = [PoolId("s", 0, "kv"), PoolId("s", 1, "kv"), PoolId("v", 0, ""), PoolId("v", 1, "")]


def _random_call(rng: random.Random, reserved: list[tuple[str, int]]) -> tuple[str, tuple]:
    pool = rng.choice(POOLS)
    keys = [f"k{rng.randrange(40)}" for _ in range(rng.randrange(1, 9))]
    roll = rng.random()
    if roll < 0.3:
        return "reserve", (pool, keys)
    if roll < 0.55:
        pairs = rng.sample(reserved, min(len(reserved), rng.randrange(0, 6)))
        if rng.random() < 0.2:
            pairs.append((rng.choice(keys), rng.randrange(12)))  # foreign or stale
        release = [p for _, p in rng.sample(reserved, min(len(reserved), rng.randrange(0, 3)))]
        if release and rng.random() < 0.3:
            release.append(rng.choice(release))  # listed twice: released once
        if rng.random() < 0.05:
            release.append(rng.choice([-1, 12, 99]))  # out of range: rejected
        return "confirm", (pool, pairs, release)
    if roll < 0.75:
        return "get", (pool, keys)
    if roll < 0.85:
        return "exists", (pool, keys)
    if roll < 0.93:
        return "delete", (pool, keys)
    if roll < 0.95:
        return "clear", (pool,)
    if roll < 0.97:
        return "v_clear", ()
    return "v_exists", (keys,)


async def _both(name: str, args: tuple, memory: MemoryBackend, red: RedisBackend) -> object:
    out = []
    for backend in (memory, red):
        try:
            out.append(("ok", await getattr(backend, name)(*args)))
        except KvmetaError as exc:
            out.append((type(exc).__name__, str(exc)))
    assert out[0] == out[1], f"{name}{args}: memory {out[0]} != redis {out[1]}"
    return out[0][1]


async def _run(url: str, seed: int, lease: float) -> None:
    memory = MemoryBackend(MemoryStore(reservation_ttl=3600, read_lease=lease))
    red = RedisBackend(url, reservation_ttl=3600, read_lease=lease)
    await red.start()
    try:
        rng = random.Random(seed)
        for pool in POOLS:
            await _both("initialize", (pool, 12), memory, red)
        reserved: list[tuple[str, int]] = []
        for _ in range(600):
            name, args = _random_call(rng, reserved)
            result = await _both(name, args, memory, red)
            if name == "reserve" and isinstance(result, list):
                reserved += [
                    (k, p)
                    for k, (hit, p) in zip(args[1], result, strict=True)
                    if not hit and p >= 0
                ]
                reserved = reserved[-30:]
            assert await memory.stats() == await red.stats()
        stats = await red.stats()
        # The sequences reach the interesting paths, not only the easy ones.
        for counter in ("evictions", "confirms_refused", "releases", "reserve_hits", "deletes"):
            assert sum(s.counters[counter] for s in stats) > 0, counter
        for pool in memory.store.pools.values():
            check_pool(pool)
        assert (await red.check()).problems == []
    finally:
        await red.close()


@pytest.mark.parametrize("seed", [1, 2])
@pytest.mark.parametrize("lease", [0.0, 3600.0])
def test_memory_and_redis_agree_on_every_reply(redis_url: str, seed: int, lease: float) -> None:
    asyncio.run(_run(redis_url, seed, lease))
