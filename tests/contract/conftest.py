"""The ``backend`` fixture: every contract test runs once per backend.

A backend is built by a factory ``(reservation_ttl, read_lease, redis_url) -> Backend``;
``BACKENDS`` maps each fixture id to its factory, so adding a backend (e.g. a journaled
memory backend) is one line. ``Sync`` drives the async Backend from plain tests on a private
event loop, and ``check()`` validates the full page invariant in whichever store it is.
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
Factory = Callable[[float, float, Callable[[], str]], Backend]

BACKENDS: dict[str, Factory] = {
    "memory": lambda ttl, lease, url: MemoryBackend(
        MemoryStore(reservation_ttl=ttl, read_lease=lease)
    ),
    "redis": lambda ttl, lease, url: RedisBackend(url(), reservation_ttl=ttl, read_lease=lease),
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

    def redis_url() -> str:
        return str(request.getfixturevalue("redis_url"))

    def make(ttl: float = 300.0, lease: float = 0.0) -> Sync:
        backend = BACKENDS[request.param](ttl, lease, redis_url)
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
