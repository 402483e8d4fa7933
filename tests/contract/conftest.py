"""The ``backend`` fixture: every contract test runs once per backend.

A backend is built by a factory ``(reservation_ttl, read_lease, fixture) -> Backend``, where
``fixture(name)`` returns a pytest fixture's value (e.g. ``"redis_cluster_url"``: an empty
cluster), requested only by the factories that need it; ``BACKENDS`` maps each fixture id to
its factory, so adding a backend (or a Redis topology) is one line. Redis runs on every
topology kvmeta supports: one node, a 3-primary + 3-replica cluster, and a Sentinel group.
``Sync`` drives the async Backend from plain tests on a private event loop, and ``check()``
validates the full page invariant in whichever store it is.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine, Iterator
from typing import Any, TypeVar

import pytest

from kvmeta.core.invariants import check_pool
from kvmeta.store.base import Backend
from kvmeta.store.memory import MemoryBackend, MemoryStore
from kvmeta.store.redis import RedisBackend

T = TypeVar("T")
Factory = Callable[[float, float, Callable[[str], str]], Backend]

BACKENDS: dict[str, Factory] = {
    "memory": lambda ttl, lease, fixture: MemoryBackend(
        MemoryStore(reservation_ttl=ttl, read_lease=lease)
    ),
    "redis": lambda ttl, lease, fixture: RedisBackend(
        fixture("redis_url"), reservation_ttl=ttl, read_lease=lease
    ),
    "redis-cluster": lambda ttl, lease, fixture: RedisBackend(
        fixture("redis_cluster_url"), reservation_ttl=ttl, read_lease=lease
    ),
    "redis-sentinel": lambda ttl, lease, fixture: RedisBackend(
        fixture("redis_sentinel_url"), reservation_ttl=ttl, read_lease=lease
    ),
}


class Sync:
    """A started backend, called synchronously: ``b.reserve(pool, keys)``."""

    def __init__(self, backend: Backend, loop: asyncio.AbstractEventLoop) -> None:
        self.backend = backend
        self.loop = loop

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        return self.loop.run_until_complete(coro)

    def __getattr__(self, name: str) -> Callable[..., Any]:
        method = getattr(self.backend, name)
        return lambda *args: self._run(method(*args))

    def check(self) -> None:
        """Assert the page invariant of every pool holds."""
        if isinstance(self.backend, MemoryBackend):
            for pool in self.backend.store.pools.values():
                check_pool(pool)
        else:
            assert self._run(self.backend.check()).problems == []


@pytest.fixture(params=sorted(BACKENDS))
def make_backend(request: pytest.FixtureRequest) -> Iterator[Callable[..., Sync]]:
    """Build a started backend of the parametrised kind: ``make_backend(ttl=..., lease=...)``."""
    loop = asyncio.new_event_loop()
    started: list[Sync] = []

    def fixture(name: str) -> str:
        return str(request.getfixturevalue(name))

    def make(ttl: float = 300.0, lease: float = 0.0) -> Sync:
        backend = BACKENDS[request.param](ttl, lease, fixture)
        loop.run_until_complete(backend.start())
        started.append(Sync(backend, loop))
        return started[-1]

    yield make
    try:
        for sync in started:
            sync.check()  # every test ends with the page invariant checked in the store
    finally:
        for sync in started:
            loop.run_until_complete(sync.backend.close())
        loop.close()


@pytest.fixture
def backend(make_backend: Callable[..., Sync]) -> Sync:
    """A backend with long reservations and no read leases."""
    return make_backend()
