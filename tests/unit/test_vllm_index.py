"""vLLM's initialisation contract and key-centric index, without a server."""

from __future__ import annotations

import pytest

from kvmeta._types import PoolId
from kvmeta.core.invariants import check_pool
from kvmeta.errors import InvalidRequest, NotInitialized
from kvmeta.service.vllm import (
    INIT_ERROR,
    VALID_INIT,
    WorkerInit,
    check_initialize,
    worker_message,
)
from kvmeta.store.memory import MemoryStore


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
