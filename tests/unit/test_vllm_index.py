"""vLLM's initialisation contract and key-centric index, without a server."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from kvmeta._types import PoolId
from kvmeta.core.invariants import check_pool
from kvmeta.errors import InvalidRequest, NotInitialized, RankInUse
from kvmeta.service.vllm import (
    INIT_ERROR,
    VALID_INIT,
    WorkerInit,
    check_initialize,
    worker_message,
)
from kvmeta.store.disk.memory import MemoryStore
from tests.unit.store.durable_support import crash, cycle, open_backend


def test_scheduler_needs_nothing_whatever_else_it_sends() -> None:
    assert check_initialize(0, "scheduler") is None
    assert check_initialize(3, "scheduler", 0) is None
    assert check_initialize(3, "scheduler", "junk", world_size="junk") is None


def test_worker_with_positive_pages() -> None:
    assert check_initialize(1, "worker", 8) == WorkerInit(1, 8, None)
    assert check_initialize(1, num_pages=8, world_size=4) == WorkerInit(1, 8, 4)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"role": "Worker", "num_pages": 8}, "role"),
        ({"role": "", "num_pages": 8}, "role"),
        ({"role": ["worker"], "num_pages": 8}, "role"),
        ({}, "num_pages"),
        ({"num_pages": 0}, "num_pages"),
        ({"num_pages": False}, "num_pages"),
        ({"num_pages": 2.0}, "num_pages"),
        ({"num_pages": 8, "world_size": -1}, "world_size"),
        ({"num_pages": 8, "world_size": True}, "world_size"),
        ({"num_pages": 8, "world_size": 2}, "world_size"),  # rank 2 is outside 0..1
    ],
)
def test_everything_else_is_invalid_with_the_valid_combinations(
    kwargs: dict[str, object], field: str
) -> None:
    with pytest.raises(InvalidRequest) as info:
        check_initialize(2, **kwargs)
    assert str(info.value).startswith(INIT_ERROR)
    assert str(info.value).endswith(VALID_INIT)
    assert info.value.field == field


def test_worker_message_says_when_the_size_was_kept() -> None:
    assert worker_message(0, 8, 8) == "Rank 0 initialized with 8 pages"
    assert "requested 16 is ignored" in worker_message(0, 8, 16)


def store_key(store: MemoryStore, rank: int, key: str) -> None:
    pid = PoolId("v", rank, "")
    [(_, page)] = store.reserve(pid, [key])
    assert store.confirm(pid, [(key, page)], []) == 0


def test_completeness_follows_registered_ranks_and_the_pin() -> None:
    store = MemoryStore()
    assert store.v_exists(["k"]) == [False]  # no ranks: nothing exists
    store.v_register(0, 4, None)
    store_key(store, 0, "k")
    assert store.v_exists(["k"]) == [True]
    store.v_register(1, 4, None)
    assert store.v_exists(["k"]) == [False]
    store_key(store, 1, "k")
    assert store.v_exists(["k", "x"]) == [True, False]
    store.v_register(0, 4, 3)  # pin: rank 2 is now required though it never registered
    assert store.v_exists(["k"]) == [False]
    store.v_register(2, 4, None)
    store_key(store, 2, "k")
    assert store.v_exists(["k"]) == [True]


def test_clear_keeps_ranks_and_sglang_pools() -> None:
    store = MemoryStore()
    store.initialize(PoolId("s", 0, "kv"), 4)
    store.v_register(0, 4, None)
    store.reserve(PoolId("s", 0, "kv"), ["s"])
    store.confirm(PoolId("s", 0, "kv"), [("s", 0)], [])
    store_key(store, 0, "v")
    assert store.v_clear() == 1
    assert store.v_exists(["v"]) == [False]
    assert store.exists(PoolId("s", 0, "kv"), ["s"]) == [True]
    store_key(store, 0, "v")  # still registered
    for pool in store.pools.values():
        check_pool(pool)
    with pytest.raises(NotInitialized, match="^Rank 5 not initialized"):
        store.reserve(PoolId("v", 5, ""), ["a"])


# ---------------------------------------------------------------------- stray ranks, removal

V77 = PoolId("v", 77, "")


def test_a_stray_rank_does_not_hide_the_blocks_of_ranks_0_to_n() -> None:
    store = MemoryStore()
    for rank in (0, 1):
        store.v_register(rank, 4, None)
        store_key(store, rank, "k")
    store.v_register(77, 4, None)  # once, by mistake
    assert store.v_exists(["k"]) == [True]
    index = store.v_index()
    assert (index.ranks, index.required, index.ignored) == ((0, 1, 77), [0, 1], [77])
    store.v_register(2, 4, None)  # a contiguous rank that registers later still counts
    assert store.v_exists(["k"]) == [False]
    assert store.v_index().required == [0, 1, 2]


def test_no_rank_0_means_nothing_is_complete() -> None:
    store = MemoryStore()
    store.v_register(1, 4, None)
    store_key(store, 1, "k")
    assert store.v_exists(["k"]) == [False]
    assert store.v_index().ignored == [1]


def test_world_size_decides_and_ignores_ranks_outside_it() -> None:
    store = MemoryStore()
    store.v_register(0, 4, 2)
    store.v_register(1, 4, None)
    store.v_register(77, 4, None)
    for rank in (0, 1):
        store_key(store, rank, "k")
    assert store.v_exists(["k"]) == [True]
    assert store.v_index().ignored == [77]
    store.v_set_world_size(3)  # rank 2 required, not registered: nothing complete
    assert store.v_exists(["k"]) == [False]
    assert store.v_index().missing == [2]
    store.v_set_world_size(None)  # back to the contiguous run 0..1
    assert store.v_exists(["k"]) == [True]
    assert store.vllm_world_size is None


def test_remove_rank_drops_its_pool_and_is_idempotent() -> None:
    store = MemoryStore()
    for rank in (0, 1, 77):
        store.v_register(rank, 4, None)
        store_key(store, rank, "k")
    assert store.v_remove(77) == 1
    assert store.v_remove(77) is None
    assert store.vllm_ranks() == [0, 1]
    with pytest.raises(NotInitialized, match="^Rank 77 not initialized"):
        store.reserve(V77, ["a"])
    store.v_register(77, 8, None)  # registers afresh: a new, empty pool of the new size
    assert store.pools[V77].num_pages == 8 and store.get(V77, ["k"]) == [None]
    assert store.v_remove(1) == 1  # the contiguous run is now rank 0 alone
    assert store.v_exists(["k"]) == [True]
    assert store.v_remove(0) == 1  # no rank 0: nothing is complete until it registers again
    assert store.v_exists(["k"]) == [False]
    for pool in store.pools.values():
        check_pool(pool)


def test_removal_and_world_size_survive_a_crash_and_a_snapshot(tmp_path: Path) -> None:
    async def main() -> None:
        b = await open_backend(tmp_path)
        for rank in (0, 1, 77):
            await b.v_register(rank, 8, None)
            await cycle(b, PoolId("v", rank, ""), ["k"])
        assert await b.v_remove(77) == 1
        await b.v_set_world_size(2)
        await crash(b)  # journal replay
        b = await open_backend(tmp_path)
        assert b.store.vllm_ranks() == [0, 1] and b.store.vllm_world_size == 2
        assert await b.v_exists(["k"]) == [True]
        await b.v_set_world_size(None)
        await b.close()  # final snapshot
        b = await open_backend(tmp_path)
        try:
            assert b.store.vllm_ranks() == [0, 1] and b.store.vllm_world_size is None
            assert await b.v_exists(["k"]) == [True]
        finally:
            await b.close()

    asyncio.run(main())


def test_a_refused_removal_journals_nothing_and_the_rank_survives_a_crash(tmp_path: Path) -> None:
    async def main() -> None:
        b = await open_backend(tmp_path)
        await b.v_register(77, 8, None)
        await cycle(b, V77, ["old"])
        [(_, page)] = await b.reserve(V77, ["in-flight"])
        assert b.journal is not None
        seq = b.journal.seq
        with pytest.raises(RankInUse):
            await b.v_remove(77)
        assert b.journal.seq == seq and b.store.vllm_ranks() == [77]
        await crash(b)
        b = await open_backend(tmp_path)
        try:
            assert b.store.vllm_ranks() == [77] and await b.get(V77, ["old"]) != [None]
            # The in-flight write may still land after the restart: its page is held, and so
            # the rank is still in use until that lease would have ended.
            with pytest.raises(RankInUse):
                await b.v_remove(77)
            assert await b.v_remove(77, force=True) == 1
        finally:
            await b.close()

    asyncio.run(main())


def test_a_removed_rank_registered_again_gets_pages_only_once_the_removal_is_durable(
    tmp_path: Path,
) -> None:
    """Write-ahead rule: the new pool of a removed rank reuses the same page file, so its pages
    may be written only when a crash can no longer bring the old ``key -> page`` back."""

    async def main() -> None:
        b = await open_backend(tmp_path, fsync="batch", fsync_interval=0.5)
        try:
            await b.v_register(77, 8, None)
            await cycle(b, V77, ["old"])
            journal = b.journal
            assert journal is not None
            drop_seq = journal.seq + 1
            handed: list[int] = []

            async def writer() -> None:
                try:
                    [(_, page)] = await b.reserve(V77, ["new"])
                except NotInitialized:
                    return
                assert journal.durable_seq >= drop_seq, "page handed out before the drop"
                handed.append(page)

            await asyncio.gather(b.v_remove(77), b.v_register(77, 8, None), writer())
            assert journal.durable_seq >= drop_seq
            assert b.store.vllm_ranks() == [77]
        finally:
            await b.close()

    asyncio.run(main())
