"""The ``backend`` fixture: every contract test runs once per backend.

A backend is built by a factory ``(reservation_ttl, read_lease, fixture, hash_index=False,
clock=None) -> Backend``, where ``fixture(name)`` returns a pytest fixture's value (e.g.
``"redis_cluster_url"``: an empty cluster), requested only by the factories that need it,
``hash_index`` is the server's ``--hash-index`` and ``clock`` a test clock (``TestClock``: time
moves only when the test moves it, so a lease runs out without the test waiting for it; None:
real time, Redis TIME on Redis); ``BACKENDS`` maps each fixture id to
its factory, so adding a backend (or a Redis topology) is one line. The local backend runs in
memory and durable (a data directory with ``--fsync batch`` and the real fsync helper, the
server's default); Redis runs on every topology kvmeta supports: one node, a 3-primary +
3-replica cluster, and a Sentinel group.
``Sync`` drives the async Backend from plain tests on a private event loop, and ``check()``
validates the full page invariant (and the hash indexes) in whichever store it is.
"""

from __future__ import annotations

import asyncio
import tempfile
import time
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any, Protocol, TypeVar

import pytest

from kvmeta.core.invariants import check_hash_index, check_pool
from kvmeta.store.base import Backend
from kvmeta.store.disk.local import DurabilityOptions, LocalBackend
from kvmeta.store.disk.memory import MemoryStore
from kvmeta.store.redis.backend import RedisBackend

T = TypeVar("T")


Clock = Callable[[], float]


class TestClock:
    """A clock that stands still until the test moves it: a lease test steps past a deadline
    in no time, exactly (memory and Redis scripts read the same value)."""

    __test__ = False  # not a test class, whatever its name

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class Factory(Protocol):
    def __call__(
        self,
        ttl: float,
        lease: float,
        fixture: Callable[[str], str],
        hash_index: bool = False,
        clock: Clock | None = None,
    ) -> Backend: ...


def _redis(url_fixture: str) -> Factory:
    def make(
        ttl: float,
        lease: float,
        fixture: Callable[[str], str],
        hash_index: bool = False,
        clock: Clock | None = None,
    ) -> Backend:
        # step_bound 0: the real-time tests sleep across leases shorter than the clock-step
        # bound, which the guard would count as steps (tests/integration/test_redis_clock_step.py
        # tests the guard on a Valkey whose clock is stepped). A test clock bypasses it.
        return RedisBackend(
            fixture(url_fixture),
            reservation_ttl=ttl,
            read_lease=lease,
            hash_index=hash_index,
            step_bound=0.0,
            clock=clock,
        )

    return make


def _memory(
    ttl: float,
    lease: float,
    fixture: Callable[[str], str],
    hash_index: bool = False,
    clock: Clock | None = None,
) -> Backend:
    store = MemoryStore(
        reservation_ttl=ttl, read_lease=lease, hash_index=hash_index, clock=clock or time.monotonic
    )
    return LocalBackend(store)


def _durable(
    ttl: float,
    lease: float,
    fixture: Callable[[str], str],
    hash_index: bool = False,
    clock: Clock | None = None,
) -> Backend:
    """The default durable server: a data directory of its own, ``--fsync batch`` with the
    real fsync helper process."""
    directory = Path(tempfile.mkdtemp(dir=fixture("tmp_path")))
    store = MemoryStore(
        reservation_ttl=ttl, read_lease=lease, hash_index=hash_index, clock=clock or time.monotonic
    )
    return LocalBackend(store, DurabilityOptions(data_dir=directory))


BACKENDS: dict[str, Factory] = {
    "memory": _memory,
    "durable": _durable,
    "redis": _redis("redis_url"),
    "redis-cluster": _redis("redis_cluster_url"),
    "redis-sentinel": _redis("redis_sentinel_url"),
}
# The fixture of each Redis topology's servers (``client()``: redis-py to its primary/cluster).
REDIS_SERVERS = {
    "redis": "redis_server",
    "redis-cluster": "redis_cluster",
    "redis-sentinel": "redis_sentinel",
}


class Sync:
    """A started backend, called synchronously: ``b.reserve(pool, keys)``."""

    def __init__(self, backend: Backend, loop: asyncio.AbstractEventLoop, kind: str = "") -> None:
        self.backend = backend
        self.loop = loop
        self.kind = kind  # the BACKENDS entry it was built by

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        return self.loop.run_until_complete(coro)

    def __getattr__(self, name: str) -> Callable[..., Any]:
        method = getattr(self.backend, name)
        return lambda *args: self._run(method(*args))

    def check(self) -> None:
        """Assert the page invariant of every pool holds, and every hash index matches its
        pool's stored keys."""
        if isinstance(self.backend, LocalBackend):
            store = self.backend.store
            for pool in store.pools.values():
                check_pool(pool)
            for pid, index in (store.hash_indexes or {}).items():
                check_hash_index(store.pools[pid].stored_keys(), index.counts())
        else:
            assert self._run(self.backend.check()).problems == []


@pytest.fixture(params=sorted(BACKENDS))
def make_backend(request: pytest.FixtureRequest) -> Iterator[Callable[..., Sync]]:
    """Build a started backend of the parametrised kind: ``make_backend(ttl=..., lease=...,
    hash_index=..., clock=...)``. Redis backends built in one test share one Redis."""
    yield from _maker(request)


@pytest.fixture(params=sorted(REDIS_SERVERS))
def make_redis_backend(request: pytest.FixtureRequest) -> Iterator[Callable[..., Sync]]:
    """``make_backend`` on the Redis topologies alone: for what only servers sharing one
    state can show (two backends on one Redis, Redis's own keys)."""
    yield from _maker(request)


def _maker(request: pytest.FixtureRequest) -> Iterator[Callable[..., Sync]]:
    loop = asyncio.new_event_loop()
    started: list[Sync] = []

    def fixture(name: str) -> str:
        return str(request.getfixturevalue(name))

    def make(
        ttl: float = 300.0, lease: float = 0.0, hash_index: bool = False, clock: Clock | None = None
    ) -> Sync:
        backend = BACKENDS[request.param](ttl, lease, fixture, hash_index=hash_index, clock=clock)
        loop.run_until_complete(backend.start())
        started.append(Sync(backend, loop, request.param))
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
