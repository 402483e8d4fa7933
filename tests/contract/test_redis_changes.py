"""The Redis backend's change feed (``RedisBackend.set_change_listener``): each change reported
exactly as ``store.changes`` says, only once durable, per pool in the order Redis made them.

The differential test (``test_differential.py``) checks the feed against Redis's stored keys
on random sequences and every topology; these are the cases it cannot force.
"""

from __future__ import annotations

import asyncio
import os
import signal
from typing import Any

import pytest
import redis

from kvmeta._types import PoolId
from kvmeta.errors import BackendUnavailable, NotReplicated
from kvmeta.store.changes import (
    CLEARED,
    REASON_CAPACITY,
    REASON_CLEAR,
    REASON_DELETE,
    REASON_DROP,
    REMOVED,
    STORED,
    UNSURE,
    Change,
)
from kvmeta.store.redis import backend as redis_store
from kvmeta.store.redis.backend import RedisBackend, pool_keys
from tests.redis_support import ReplicaPair

POOL = PoolId("s", 0, "feed")


class Feed:
    """The listener: every change, and each call's batch."""

    def __init__(self) -> None:
        self.changes: list[Change] = []
        self.calls = 0

    def __call__(self, changes: list[Change]) -> None:
        self.calls += 1
        self.changes += changes

    def take(self) -> list[Change]:
        out, self.changes = self.changes, []
        return out


async def _started(url: str, **kw: Any) -> tuple[RedisBackend, Feed]:
    backend = RedisBackend(url, **kw)
    await backend.start()
    feed = Feed()
    backend.set_change_listener(feed)
    return backend, feed


async def _store(backend: RedisBackend, pool: PoolId, keys: list[str]) -> list[int]:
    got = await backend.reserve(pool, keys)
    pairs = [(k, p) for k, (hit, p) in zip(keys, got, strict=True) if not hit and p >= 0]
    assert await backend.confirm(pool, pairs, []) == 0
    return [p for _, p in got]


def test_each_change_is_reported_as_the_seam_says(redis_url: str) -> None:
    async def go() -> None:
        backend, feed = await _started(redis_url)
        try:
            await backend.initialize(POOL, 2)
            assert feed.take() == []  # initialize: nothing
            (_, pa), (_, pb) = await backend.reserve(POOL, ["a", "b"])
            assert feed.take() == []  # a reservation: nothing
            # b then a (pair order), a stale pair (refused) and a repeat are not committed.
            refused = await backend.confirm(POOL, [("b", pb), ("zz", pa), ("a", pa)], [])
            assert refused == 1
            assert feed.take() == [Change(POOL, STORED, ("b", "a"))]
            assert await backend.confirm(POOL, [("a", pa)], []) == 0  # idempotent repeat
            assert await backend.confirm(POOL, [("q", pa)], []) == 1  # refused only
            await backend.exists(POOL, ["a", "b"])
            await backend.get(POOL, ["b"])  # b is now the warmest: a goes first
            assert feed.take() == []
            [(_, pc)] = await backend.reserve(POOL, ["c"])  # full: evicts a
            assert pc == pa
            assert feed.take() == [Change(POOL, REMOVED, ("a",), REASON_CAPACITY)]
            assert await backend.delete(POOL, ["nope", "b", "c", "b"]) == 1  # c is reserved
            assert feed.take() == [Change(POOL, REMOVED, ("b",), REASON_DELETE)]
            assert await backend.delete(POOL, ["b"]) == 0
            assert feed.take() == []
            await backend.clear(POOL)
            assert feed.take() == [Change(POOL, CLEARED, (), REASON_CLEAR)]
        finally:
            await backend.close()

    asyncio.run(go())


def test_a_clear_in_chunks_is_one_cleared_after_the_last_chunk(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(redis_store, "CLEAR_CHUNK", 40)
    calls: list[list[Any]] = []

    async def go() -> None:
        backend, feed = await _started(redis_url)
        real = backend._run

        async def spy(script: str, keys: tuple[str, ...], args: list[Any]) -> list[Any]:
            reply = await real(script, keys, args)
            if script == "clear":
                calls.append(list(reply))
                assert feed.changes == []  # nothing before the last chunk answered
            return reply

        backend._run = spy  # type: ignore[method-assign]
        try:
            # More than a listpack holds: HSCAN then goes in chunks of about COUNT.
            await backend.initialize(POOL, 2000)
            for lo in range(0, 2000, 500):
                await _store(backend, POOL, [f"k{i}" for i in range(lo, lo + 500)])
            feed.take()
            assert await backend.clear(POOL) == 2000
            assert len(calls) >= 3
            assert feed.take() == [Change(POOL, CLEARED, (), REASON_CLEAR)]
            assert await backend.clear(POOL) == 0  # an empty pool's clear is still a clear
            assert feed.take() == [Change(POOL, CLEARED, (), REASON_CLEAR)]
        finally:
            await backend.close()

    asyncio.run(go())


def test_vllm_rank_pools_report_as_pools_and_a_removed_rank_is_dropped(redis_url: str) -> None:
    v0, v1 = PoolId("v", 0, ""), PoolId("v", 1, "")

    async def go() -> None:
        backend, feed = await _started(redis_url)
        try:
            await backend.v_register(0, 4, 2)
            await backend.v_register(1, 4, 2)
            await _store(backend, v0, ["a"])
            await _store(backend, v1, ["b"])
            assert feed.take() == [Change(v0, STORED, ("a",)), Change(v1, STORED, ("b",))]
            await backend.delete(v1, ["b"])
            assert feed.take() == [Change(v1, REMOVED, ("b",), REASON_DELETE)]
            assert await backend.v_clear() == 1
            assert sorted(feed.take(), key=lambda c: c.pool) == [
                Change(v0, CLEARED, (), REASON_CLEAR),
                Change(v1, CLEARED, (), REASON_CLEAR),
            ]
            await _store(backend, v1, ["c"])
            assert await backend.v_remove(1) == 1
            assert feed.take() == [Change(v1, STORED, ("c",)), Change(v1, CLEARED, (), REASON_DROP)]
            assert await backend.v_remove(1) is None  # not registered: nothing
            assert feed.take() == []
            # Registered again: empty, and its change counter goes on (never back).
            client = redis.Redis.from_url(redis_url)
            before = int(client.hget(pool_keys(v1)[0], "chg") or 0)
            await backend.v_register(1, 4, 2)
            await _store(backend, v1, ["d"])
            assert feed.take() == [Change(v1, STORED, ("d",))]
            assert int(client.hget(pool_keys(v1)[0], "chg") or 0) == before + 1
            client.close()
        finally:
            await backend.close()

    asyncio.run(go())


def test_without_a_listener_the_scripts_do_no_feed_work(redis_url: str) -> None:
    async def go() -> None:
        backend, feed = await _started(redis_url)
        backend.set_change_listener(None)
        sent: list[list[Any]] = []
        real = backend._run

        async def spy(script: str, keys: tuple[str, ...], args: list[Any]) -> list[Any]:
            sent.append(args)
            return await real(script, keys, args)

        backend._run = spy  # type: ignore[method-assign]
        try:
            await backend.initialize(POOL, 1)
            await _store(backend, POOL, ["a"])
            await _store(backend, POOL, ["b"])  # evicts a
            await backend.delete(POOL, ["b"])
            await backend.clear(POOL)
            assert feed.changes == []
            client = redis.Redis.from_url(redis_url)
            assert client.hget(pool_keys(POOL)[0], "chg") is None  # no counter kept
            client.close()
            assert all(args[-1] == "0" for args in sent[1:]), sent
        finally:
            await backend.close()

    asyncio.run(go())


def test_replies_read_out_of_order_are_delivered_in_redis_order(redis_url: str) -> None:
    """A confirm of X runs, then a delete of X, on two connections; the confirm's reply is read
    last. The subscriber must see STORED X then REMOVED X (else it believes X is stored)."""

    async def go() -> None:
        backend, feed = await _started(redis_url)
        ran, release = asyncio.Event(), asyncio.Event()
        real = backend._send

        async def slow_confirm(node: Any, command: tuple[Any, ...], *rest: Any) -> Any:
            out = await real(node, command, *rest)
            if "confirm" in str(command[1]):
                ran.set()  # executed in Redis; its reply is read only when released
                await release.wait()
            return out

        backend._send = slow_confirm  # type: ignore[method-assign]
        try:
            await backend.initialize(POOL, 4)
            [(_, page)] = await backend.reserve(POOL, ["x"])
            confirm = asyncio.create_task(backend.confirm(POOL, [("x", page)], []))
            await asyncio.wait_for(ran.wait(), 30)
            assert await backend.delete(POOL, ["x"]) == 1
            assert feed.changes == []  # held: the confirm, which ran first, is in flight
            assert backend._feed.held() == 1
            release.set()
            assert await confirm == 0
            assert feed.take() == [
                Change(POOL, STORED, ("x",)),
                Change(POOL, REMOVED, ("x",), REASON_DELETE),
            ]
            # A call started after a change was read is never waited for.
            [(_, page)] = await backend.reserve(POOL, ["y"])
            release.clear()
            ran.clear()
            confirm = asyncio.create_task(backend.confirm(POOL, [("y", page)], []))
            await asyncio.wait_for(ran.wait(), 30)
            release.set()
            await confirm
            assert feed.take() == [Change(POOL, STORED, ("y",))]
            assert backend._feed.held() == 0
        finally:
            await backend.close()

    asyncio.run(go())


def test_a_failed_call_releases_the_changes_it_held(redis_url: str) -> None:
    """A call that fails after it was sent (here: its reply lost, then no recovery) announces
    nothing, reports its pool ``UNSURE`` (it may have run; here it did) and holds nothing back."""

    async def go() -> None:
        backend, feed = await _started(redis_url, failover_timeout=0.2)
        ran, release = asyncio.Event(), asyncio.Event()
        real = backend._send

        async def failing_confirm(node: Any, command: tuple[Any, ...], *rest: Any) -> Any:
            if "confirm" in str(command[1]):
                await real(node, command, *rest)
                ran.set()
                await release.wait()
                raise redis.exceptions.AuthenticationError("refused for the test")
            return await real(node, command, *rest)

        backend._send = failing_confirm  # type: ignore[method-assign]
        try:
            await backend.initialize(POOL, 4)
            [(_, page)] = await backend.reserve(POOL, ["x"])
            confirm = asyncio.create_task(backend.confirm(POOL, [("x", page)], []))
            await asyncio.wait_for(ran.wait(), 30)
            assert await backend.delete(POOL, ["x"]) == 1
            assert feed.changes == []
            release.set()
            with pytest.raises(BackendUnavailable):
                await confirm
            assert feed.take() == [
                Change(POOL, REMOVED, ("x",), REASON_DELETE),
                Change(POOL, UNSURE, ()),
            ]
            assert backend._feed.held() == 0
        finally:
            await backend.close()

    asyncio.run(go())


@pytest.mark.slow
def test_a_write_answered_not_replicated_is_never_announced(replica_pair: ReplicaPair) -> None:
    async def go() -> None:
        backend, feed = await _started(
            replica_pair.primary.url, min_replicas_ack=1, replica_ack_timeout=0.3
        )
        try:
            await backend.initialize(POOL, 1)
            await _store(backend, POOL, ["a"])
            assert feed.take() == [Change(POOL, STORED, ("a",))]
            os.kill(replica_pair.replica.pid, signal.SIGSTOP)
            with pytest.raises(NotReplicated):
                await backend.delete(POOL, ["a"])
            with pytest.raises(NotReplicated):
                await backend.clear(POOL)
            # Not announced: the pool is reported unsure (the changes are on the primary only).
            assert feed.take() == [Change(POOL, UNSURE, ())] * 2
            os.kill(replica_pair.replica.pid, signal.SIGCONT)
            await _store(backend, POOL, ["b"])
            assert feed.take() == [Change(POOL, STORED, ("b",))]
        finally:
            await backend.close()

    asyncio.run(go())
