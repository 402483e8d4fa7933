"""vLLM rank registry on every backend: `world_size` (or the contiguous run of ranks from 0)
decides completeness, and a rank can be removed, durably and idempotently."""

from __future__ import annotations

import pytest

from kvmeta._types import PoolId
from kvmeta.errors import NotInitialized, RankInUse
from tests.contract.conftest import Sync

V = [PoolId("v", r, "") for r in range(3)]
V77 = PoolId("v", 77, "")


def _store(b: Sync, pool: PoolId, keys: list[str]) -> None:
    pages = [page for _, page in b.reserve(pool, keys)]
    assert b.confirm(pool, list(zip(keys, pages, strict=True)), []) == 0


def test_stray_rank_is_ignored_without_world_size(backend: Sync) -> None:
    for rank in (0, 1, 77):
        backend.v_register(rank, 4, None)
    for pool in V[:2]:
        _store(backend, pool, ["k"])
    assert backend.v_exists(["k", "m"]) == [True, False]
    index = backend.v_index()
    assert (index.world_size, index.ranks) == (None, (0, 1, 77))
    assert (index.required, index.ignored, index.missing) == ([0, 1], [77], [])
    backend.v_register(2, 4, None)  # contiguous: a later rank makes older keys incomplete
    assert backend.v_exists(["k"]) == [False]
    _store(backend, V[2], ["k"])
    assert backend.v_exists(["k"]) == [True]


def test_nothing_is_complete_without_rank_0(backend: Sync) -> None:
    backend.v_register(1, 4, None)
    _store(backend, V[1], ["k"])
    assert backend.v_exists(["k"]) == [False]


def test_world_size_decides_and_can_be_cleared(backend: Sync) -> None:
    backend.v_register(0, 4, 2)
    backend.v_register(1, 4, None)
    backend.v_register(77, 4, None)
    for pool in V[:2]:
        _store(backend, pool, ["k"])
    assert backend.v_exists(["k"]) == [True]
    backend.v_set_world_size(3)
    assert backend.v_exists(["k"]) == [False]
    index = backend.v_index()
    assert (index.world_size, index.required, index.missing) == (3, [0, 1, 2], [2])
    backend.v_set_world_size(None)
    assert backend.v_index().world_size is None
    assert backend.v_exists(["k"]) == [True]


def test_remove_rank_drops_its_pool_and_is_idempotent(backend: Sync) -> None:
    for rank in (0, 77):
        backend.v_register(rank, 4, None)
        _store(backend, PoolId("v", rank, ""), ["k", "j"])
    ((_, page),) = backend.reserve(V77, ["in-flight"])
    with pytest.raises(RankInUse, match="^vLLM rank 77 is still in use: 1 page"):
        backend.v_remove(77)  # a write in flight: refused, nothing changed
    assert backend.v_index().ranks == (0, 77) and backend.get(V77, ["k"]) != [None]
    assert backend.v_remove(77, "", True) == 2  # forced
    assert backend.v_remove(77) is None
    assert backend.v_index().ranks == (0,)
    assert [s.pool for s in backend.stats()] == [V[0]]
    for call in (
        lambda: backend.reserve(V77, ["a"]),
        lambda: backend.get(V77, ["k"]),
        lambda: backend.confirm(V77, [("in-flight", page)], []),
    ):
        with pytest.raises(NotInitialized, match="^Rank 77 not initialized"):
            call()
    created = backend.v_register(77, 8, None)  # afresh: empty, and the new size
    assert (created.created, created.num_pages) == (True, 8)
    assert backend.get(V77, ["k"]) == [None]
    assert backend.v_exists(["k"]) == [True]  # rank 0 alone is the contiguous run
    assert backend.v_remove(0) == 2
    assert backend.v_exists(["k"]) == [False]


def test_v_clear_does_not_remove_ranks(backend: Sync) -> None:
    backend.v_register(77, 4, None)
    backend.v_clear()
    assert backend.v_index().ranks == (77,)
