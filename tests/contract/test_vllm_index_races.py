"""The vLLM index across registry changes and at size, on every backend.

On Redis a cross-rank operation first reads the rank registry, then runs one script with the
keys of exactly the ranks it read (every key in ``KEYS``, as Redis Cluster requires). A rank
registered or removed in between makes the script refuse with nothing changed, and the
backend reads again: the answer always reflects one registry state, as the memory backend's
does. ``/clear`` of the vLLM index runs per rank and in bounded chunks, so a big index never
holds Redis for the whole clear.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from kvmeta._types import PoolId
from kvmeta.errors import BackendUnavailable
from kvmeta.store.base import Backend, VIndex
from kvmeta.store.redis.backend import CLEAR_CHUNK, RedisBackend
from tests.contract.conftest import Sync

V = [PoolId("v", r, "") for r in range(3)]


def _store(b: Sync, pool: PoolId, keys: list[str]) -> None:
    pages = [page for _, page in b.reserve(pool, keys)]
    assert b.confirm(pool, list(zip(keys, pages, strict=True)), []) == 0


def _exists_counts(b: Sync) -> dict[int, tuple[int, int]]:
    return {
        s.pool.rank: (s.counters["exists_hits"], s.counters["exists_misses"])
        for s in b.stats()
        if s.pool.dialect == "v"
    }


def _between_read_and_op(
    b: Sync,
    make_backend: Callable[..., Sync],
    monkeypatch: pytest.MonkeyPatch,
    change: Callable[[Backend], Awaitable[Any]],
) -> list[VIndex]:
    """Make ``change`` (run through another connection) land right after ``b``'s next registry
    read. The memory backend has no such window (one process, one step): the change simply
    comes first. Returns the registry reads ``b`` made (Redis only)."""
    reads: list[VIndex] = []
    if not isinstance(b.backend, RedisBackend):
        b.loop.run_until_complete(change(b.backend))
        return reads
    other = make_backend().backend  # its own connections to the same Redis
    real = b.backend._v_registry

    async def racing(tenant: str = "") -> VIndex:
        got = await real(tenant)
        reads.append(got)
        if len(reads) == 1:
            await change(other)
        return got

    monkeypatch.setattr(b.backend, "_v_registry", racing)
    return reads


def test_exists_sees_a_rank_registered_between_registry_read_and_op(
    make_backend: Callable[..., Sync], monkeypatch: pytest.MonkeyPatch
) -> None:
    b = make_backend()
    for pool in V[:2]:
        b.v_register(pool.rank, 4, None)
        _store(b, pool, ["k"])
    reads = _between_read_and_op(b, make_backend, monkeypatch, lambda o: o.v_register(2, 4, None))
    assert b.v_exists(["k"]) == [False]  # rank 2 is required now and lacks "k"
    if isinstance(b.backend, RedisBackend):
        assert [r.ranks for r in reads] == [(0, 1), (0, 1, 2)]  # read again after "stale"
    # the refused attempt counted nothing: one exists on each required rank
    assert _exists_counts(b) == {0: (1, 0), 1: (1, 0), 2: (0, 1)}
    _store(b, V[2], ["k"])
    assert b.v_exists(["k"]) == [True]


def test_exists_sees_a_rank_removed_between_registry_read_and_op(
    make_backend: Callable[..., Sync], monkeypatch: pytest.MonkeyPatch
) -> None:
    b = make_backend()
    for pool in V:
        b.v_register(pool.rank, 4, None)
    for pool in V[:2]:
        _store(b, pool, ["k"])
    reads = _between_read_and_op(b, make_backend, monkeypatch, lambda o: o.v_remove(2))
    assert b.v_exists(["k"]) == [True]  # ranks 0 and 1 are the whole contiguous run now
    if isinstance(b.backend, RedisBackend):
        assert [r.ranks for r in reads] == [(0, 1, 2), (0, 1)]


def test_exists_sees_world_size_pinned_between_registry_read_and_op(
    make_backend: Callable[..., Sync], monkeypatch: pytest.MonkeyPatch
) -> None:
    b = make_backend()
    for pool in V:
        b.v_register(pool.rank, 4, None)
        _store(b, pool, ["k"])
    reads = _between_read_and_op(b, make_backend, monkeypatch, lambda o: o.v_set_world_size(4))
    assert b.v_exists(["k"]) == [False]  # rank 3 is required and not registered
    if isinstance(b.backend, RedisBackend):
        assert [r.world_size for r in reads] == [None, 4]


def test_exists_sees_a_registry_changed_by_another_server_since_its_last_read(
    make_backend: Callable[..., Sync],
) -> None:
    """A server remembers the registry it last read; another server changing it must not make
    the first one answer from the old state, in either direction."""
    b = make_backend()
    other = make_backend() if isinstance(b.backend, RedisBackend) else b
    b.v_register(0, 4, 3)
    b.v_register(1, 4, None)
    for pool in V[:2]:
        _store(b, pool, ["k"])
    assert b.v_exists(["k"]) == [False]  # rank 2 missing: remembered as "nothing complete"
    other.v_register(2, 4, None)
    _store(other, V[2], ["k"])
    assert b.v_exists(["k"]) == [True]  # not answered from the remembered registry
    other.v_set_world_size(None)
    other.v_remove(2)
    _store(other, V[0], ["j"])
    _store(other, V[1], ["j"])
    assert b.v_exists(["k", "j"]) == [True, True]  # ranks 0, 1 are the whole run now
    other.v_register(2, 4, None)
    assert b.v_exists(["k", "j"]) == [False, False]  # rank 2 required again, and empty
    other.v_set_world_size(2)
    assert b.v_exists(["k", "j"]) == [True, True]


def test_a_registry_that_keeps_changing_gives_up_with_a_clear_message(redis_url: str) -> None:
    """Bounded retries: a registry read that is always out of date ends in 503, not a loop,
    and the refused attempts change nothing."""
    import asyncio

    async def scenario() -> None:
        b = RedisBackend(redis_url)
        await b.start()
        try:
            for rank in (0, 1, 2):
                await b.v_register(rank, 4, None)
            reads = 0

            async def outdated(tenant: str = "") -> VIndex:
                nonlocal reads
                reads += 1
                return VIndex(None, (0, 1))  # rank 2 is never seen

            b._v_registry = outdated  # type: ignore[method-assign]
            with pytest.raises(BackendUnavailable, match="vLLM rank registry kept changing"):
                await b.v_exists(["k"])
            assert reads == RedisBackend._V_TRIES
            stats = {s.pool.rank: s.counters["exists_misses"] for s in await b.stats()}
            assert stats == {0: 0, 1: 0, 2: 0}
        finally:
            await b.close()

    asyncio.run(scenario())


@pytest.mark.slow
def test_v_clear_of_a_big_index_runs_in_chunks(
    make_backend: Callable[..., Sync], monkeypatch: pytest.MonkeyPatch
) -> None:
    b = make_backend()
    per_rank = 2 * CLEAR_CHUNK + 100
    keys = [f"key-{i}" for i in range(per_rank)]
    # Room for the keys and, on a durable backend, its spare (an eighth of each pool, evicted
    # ahead of need once the rest is used): every key stays stored.
    pages = per_rank + per_rank // 4
    b.v_register(0, pages, 3)
    for pool in V[1:]:
        b.v_register(pool.rank, pages, None)
    for pool in V:
        _store(b, pool, keys)
    ((_, page),) = b.reserve(V[1], ["in-flight"])
    calls: list[str] = []
    if isinstance(b.backend, RedisBackend):
        real = b.backend._run

        async def counting(script: str, *args: Any, **kwargs: Any) -> Any:
            calls.append(script)
            return await real(script, *args, **kwargs)

        monkeypatch.setattr(b.backend, "_run", counting)
    assert b.v_clear() == 3 * per_rank
    if isinstance(b.backend, RedisBackend):
        # at least ceil(per_rank / CLEAR_CHUNK) = 3 short scripts per rank, none doing it all
        assert len(calls) >= 3 * 3, calls
    monkeypatch.undo()
    assert b.v_exists(keys) == [False] * per_rank
    assert all(s.stored == 0 for s in b.stats())
    index = b.v_index()
    assert (index.world_size, index.ranks) == (3, (0, 1, 2))  # registrations stay
    assert b.confirm(V[1], [("in-flight", page)], []) == 0  # reservations stay
    assert b.get(V[1], ["in-flight"]) == [page]
    assert [s.counters["clears"] for s in b.stats()] == [1, 1, 1]
    b.check()
