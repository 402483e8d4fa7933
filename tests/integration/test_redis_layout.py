"""Pools written in an earlier data layout are never read by the current scripts.

The scripts of one release assume one layout; reading another release's pools could map a key
onto a page that holds other bytes. So every key carries the layout in its prefix, and a Redis
that still holds pools of an earlier layout is named at start-up.
"""

from __future__ import annotations

import asyncio
import logging

import pytest

from kvmeta._types import PoolId
from kvmeta.store.redis.backend import RedisBackend, pool_keys
from tests.redis_support import RedisServer


def test_pools_of_an_earlier_layout_are_invisible_and_named_at_start(
    redis_server: RedisServer, redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    with redis_server.client() as client:  # a pool as kvmeta 0.1's layout left it
        client.sadd("kvmeta:pools", "0:kv")
        client.hset("kvmeta:{s:0:kv}:meta", mapping={"n": 8, "next": 1, "tick": 1})
        client.hset("kvmeta:{s:0:kv}:stored", "old-key", 0)
        client.hset("kvmeta:{s:0:kv}:pk", "0", "Sold-key")

    async def run() -> tuple[list[bool], list[tuple[bool, int]]]:
        backend = RedisBackend(redis_url)
        await backend.start()
        try:
            pool = PoolId("s", 0, "kv")
            assert (await backend.initialize(pool, 8)).created  # a new pool, not the old one
            return await backend.exists(pool, ["old-key"]), await backend.reserve(pool, ["new"])
        finally:
            await backend.close()

    with caplog.at_level(logging.WARNING, logger="kvmeta.store.redis.backend"):
        exists, reserved = asyncio.run(run())
    assert exists == [False]
    assert reserved == [(False, 0)]
    assert all(key.startswith("kvmeta:2:{s:0:kv}:") for key in pool_keys(PoolId("s", 0, "kv")))
    warning = "\n".join(r.getMessage() for r in caplog.records)
    assert "earlier kvmeta data layout (keys kvmeta:*)" in warning, warning
