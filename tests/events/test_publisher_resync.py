"""A pool reported ``UNSURE`` (a Redis call that failed after it was sent) is stated again:
after the backend settled its earlier changes and everything queued was sent, the pool's
``AllBlocksCleared`` and ``BlockStored`` of what it holds, with reason ``resync``, then the
changes made meanwhile; tried again while the backend does not answer. A backend stands in for
Redis here, so each step's order is seen; tests/events/test_redis_doubt.py runs it for real."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Awaitable, Callable
from types import SimpleNamespace
from typing import Any

from kvmeta._types import PoolId
from kvmeta.errors import BackendUnavailable, NotInitialized
from kvmeta.events.publisher import Publisher
from kvmeta.events.wire import pool_label, sglang_hash
from kvmeta.store.changes import EVERY_POOL, LOST, STORED, UNSURE, Change
from tests.events.test_publisher_shapes import make_publisher, published

POOL = PoolId("s", 0, "kv")
GONE = PoolId("s", 3, "kv")


def key(i: int) -> str:
    return hashlib.sha256(f"r{i}".encode()).hexdigest()


class Backend:
    """What the resync reads: ``settle_changes`` and ``dump`` (two keys a page), recorded in
    ``calls``; ``fail`` dumps raise as an unanswering Redis does; ``during``: changes reported
    while the pool is being read (as live requests would)."""

    def __init__(self, publisher: Publisher, keys: list[str]) -> None:
        self.publisher = publisher
        self.keys = keys
        self.calls: list[str] = []
        self.fail = 0
        self.during: list[Change] = []

    async def stats(self) -> list[Any]:
        return []

    async def settle_changes(self, pool: PoolId) -> None:
        self.calls.append(f"settle {pool.rank}")

    async def dump(self, pool: PoolId, cursor: str, limit: int) -> tuple[list[str], str]:
        self.calls.append(f"dump {pool.rank} {cursor or 0}")
        if self.fail:
            self.fail -= 1
            raise BackendUnavailable("Redis backend at 127.0.0.1:1 failed during HSCAN")
        if pool != POOL:
            raise NotInitialized(f"rank {pool.rank} is not initialized", pool.rank, "kv")
        if self.during:
            self.publisher.on_changes([self.during.pop(0)])
        start = int(cursor or 0)
        nxt = start + 2
        return self.keys[start:nxt], "" if nxt >= len(self.keys) else str(nxt)


def _run(test: Callable[[Publisher], Awaitable[None]]) -> None:
    async def main() -> None:
        pub = make_publisher()
        try:
            pub.start(asyncio.get_running_loop())
            await test(pub)
        finally:
            await pub.cancel_resyncs()
            pub.close()

    asyncio.run(main())


async def _until(check: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not check():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.01)


def _hashes(*keys: str) -> list[int]:
    return [sglang_hash(k) for k in keys]


def test_an_unsure_pool_is_stated_again_after_what_was_queued_and_before_what_follows() -> None:
    keys = [key(i) for i in range(5)]

    async def test(pub: Publisher) -> None:
        backend = Backend(pub, keys)
        await pub.resync(backend)
        start = len(published(pub))
        backend.during = [Change(POOL, STORED, (key(9),))]
        pub.on_changes([Change(POOL, STORED, (key(8),)), Change(POOL, UNSURE, ())])
        await _until(lambda: pub.stats.pool_resyncs == 1)
        await _until(lambda: len(published(pub)) - start == 6)
        label = pool_label(POOL)
        got = published(pub)[start:]
        assert [(e[0], e[-1]) for e in got] == [
            ("BlockStored", ""),  # queued before the doubt: sent first
            ("AllBlocksCleared", "resync"),
            ("BlockStored", "resync"),
            ("BlockStored", "resync"),
            ("BlockStored", "resync"),
            ("BlockStored", ""),  # made while the pool was read: after its state
        ]
        assert got[1][:2] == ("AllBlocksCleared", label)
        dumped = [h for e in got[2:5] for h in e[2]]
        assert dumped == _hashes(*keys)
        assert [k for e in got[2:5] for k in e[4]] == keys
        assert got[5][2] == _hashes(key(9))
        assert backend.calls == ["settle 0", "dump 0 0", "dump 0 2", "dump 0 4"]

    _run(test)


def test_a_backend_that_does_not_answer_is_asked_again_and_nothing_half_is_sent() -> None:
    async def test(pub: Publisher) -> None:
        backend = Backend(pub, [key(1)])
        await pub.resync(backend)
        start = len(published(pub))
        backend.fail = 2
        pub.on_changes([Change(POOL, UNSURE, ()), Change(POOL, UNSURE, ())])  # one resync
        await _until(lambda: pub.stats.pool_resyncs == 1)
        await asyncio.sleep(0.7)  # (a second resync of the pool would be done by now)
        got = published(pub)[start:]
        assert [(e[0], e[-1]) for e in got] == [
            ("AllBlocksCleared", "resync"),
            ("BlockStored", "resync"),
        ]
        assert backend.calls == ["settle 0", "dump 0 0"] * 3
        assert pub.stats.pool_resyncs == 1

    _run(test)


def test_a_pool_gone_meanwhile_is_stated_empty() -> None:
    async def test(pub: Publisher) -> None:
        backend = Backend(pub, [])
        await pub.resync(backend)
        start = len(published(pub))
        pub.on_changes([Change(GONE, UNSURE, ())])
        await _until(lambda: pub.stats.pool_resyncs == 1)
        got = published(pub)[start:]
        assert got == [("AllBlocksCleared", pool_label(GONE), "resync")]

    _run(test)


def test_an_unsure_pool_reported_before_the_start_resync_waits_for_it() -> None:
    async def test(pub: Publisher) -> None:
        backend = Backend(pub, [key(1)])
        pub.on_changes([Change(POOL, UNSURE, ())])  # the backend is not known yet
        await asyncio.sleep(0.05)
        assert pub.stats.pool_resyncs == 0
        await pub.resync(backend)
        await _until(lambda: pub.stats.pool_resyncs == 1)
        kinds = [(e[0], e[-1]) for e in published(pub)]
        assert kinds == [
            ("AllBlocksCleared", "restart-recovery"),  # the start's resync (no pools)
            ("AllBlocksCleared", "resync"),
            ("BlockStored", "resync"),
        ]

    _run(test)


class WholeBackend(Backend):
    """``Backend`` holding one pool, for a whole-server resync (``stats`` lists it)."""

    epoch = "new-epoch"

    async def stats(self) -> list[Any]:
        return [SimpleNamespace(pool=POOL)]


def test_a_lost_state_is_stated_again_whole_after_what_was_queued() -> None:
    """``LOST`` (Redis lost its data): what was queued goes first, then one whole-server
    ``AllBlocksCleared`` and every pool the backend holds now, reason ``data-lost``, then the
    changes made meanwhile; the pools' kept parents and hash arrays are forgotten."""
    keys = [key(i) for i in range(3)]

    async def test(pub: Publisher) -> None:
        backend = WholeBackend(pub, keys)
        await pub.resync(backend)
        pub.note_reserve(POOL, [(key(7), key(6))])
        start = len(published(pub))
        backend.during = [Change(POOL, STORED, (key(9),))]
        pub.on_changes([Change(POOL, STORED, (key(8),)), Change(EVERY_POOL, LOST, ())])
        assert not pub.parents
        await _until(lambda: pub.stats.resyncs == 2)
        await _until(lambda: len(published(pub)) - start == 6)
        got = published(pub)[start:]
        assert [(e[0], e[-1]) for e in got] == [
            ("BlockStored", ""),  # queued before the loss: sent first
            ("AllBlocksCleared", "data-lost"),  # the whole server
            ("AllBlocksCleared", "data-lost"),  # the pool, then what it holds now
            ("BlockStored", "data-lost"),
            ("BlockStored", "data-lost"),
            ("BlockStored", ""),  # made while the state was read: after it
        ]
        assert got[1][1] == "" and got[2][1] == pool_label(POOL)
        assert [h for e in got[3:5] for h in e[2]] == _hashes(*keys)

    _run(test)


def test_without_keys_the_start_resync_states_the_hashes_only() -> None:
    """``--events-keys off``: the resync's ``BlockStored`` carry the hashes (and no ``keys``),
    as the live ones do."""
    keys = [key(i) for i in range(3)]

    async def main() -> None:
        pub = make_publisher(keys=False)
        try:
            pub.start(asyncio.get_running_loop())
            backend = Backend(pub, keys)
            backend.stats = _one_pool  # type: ignore[method-assign]
            await pub.resync(backend)
            pub.on_changes([Change(POOL, STORED, (key(7),))])
            pub.flush()
        finally:
            await pub.cancel_resyncs()
            pub.close()
        got = published(pub)
        assert [(e[0], e[-1]) for e in got] == [
            ("AllBlocksCleared", "restart-recovery"),
            ("AllBlocksCleared", "restart-recovery"),
            ("BlockStored", "restart-recovery"),
            ("BlockStored", "restart-recovery"),
            ("BlockStored", ""),
        ]
        assert [h for e in got[2:4] for h in e[2]] == _hashes(*keys)
        assert got[4][2] == _hashes(key(7))
        assert all(e[4] == [] for e in got[2:])  # no keys field at all
        assert pub.buffer is not None
        assert all(b'"keys"' not in p and b"keys" not in p for _, _, p in pub.buffer)

    asyncio.run(main())


async def _one_pool() -> list[Any]:
    return [SimpleNamespace(pool=POOL)]
