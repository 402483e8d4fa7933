"""What an operator sees of the Redis side: how many primaries hold the state and the fewest
replicas any of them has, refreshed by every readiness probe (on the status page, and as the
``kvmeta_redis_primaries`` and ``kvmeta_redis_replicas_min`` gauges). Fewer replicas than
``--min-replicas-ack`` means every write answers 503: that is what an alert should watch."""

from __future__ import annotations

import asyncio

from kvmeta.server.status_page import _role
from kvmeta.store.redis.backend import RedisBackend


async def _view(url: str) -> dict[str, float]:
    backend = RedisBackend(url)
    await backend.start()
    try:
        assert await backend.ready()
        return backend.durability_stats()
    finally:
        await backend.close()


def test_a_single_node_is_one_primary_without_replicas(redis_url: str) -> None:
    view = asyncio.run(_view(redis_url))
    assert view == {"redis_primaries": 1.0, "redis_replicas_min": 0.0}
    assert _role(view) == "primary"


def test_a_cluster_shows_its_primaries_and_their_replicas(redis_cluster_url: str) -> None:
    view = asyncio.run(_view(redis_cluster_url))
    assert view == {"redis_primaries": 3.0, "redis_replicas_min": 1.0}
    assert _role(view) == "3 primaries"
    assert _role({}) is None  # not Redis: no role row
