"""A pool's memory follows the pages it ever handed out, not ``num_pages``: an hf3fs file of
1-byte marker pages declares ~2^40 pages, of which an engine uses a few million at most."""

from __future__ import annotations

import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvmeta._types import PoolId
from kvmeta.core.invariants import check_pool
from kvmeta.core.pool import FREE, STORED, Pool, first_capacity
from kvmeta.store.disk import snapshot
from kvmeta.store.disk.memory import MemoryStore

HUGE = 1 << 40
KIB = 1024


def _allocated(make: Callable[[], Any]) -> tuple[Any, int]:
    """What ``make`` returns and the bytes it left allocated (tracemalloc)."""
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        made = make()
        return made, tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()


def _write(pool: Pool, keys: list[str], now: float) -> list[int]:
    pages = [page for _, page in pool.reserve(keys, now, [])]
    outcome = pool.confirm(list(zip(keys, pages, strict=True)), [], now)
    assert len(outcome.committed) == len(keys)
    return pages


def test_a_2_to_the_40_page_pool_costs_kilobytes_and_works() -> None:
    pool, cost = _allocated(lambda: Pool(HUGE, reservation_ttl=10.0, read_lease=1.0))
    assert cost < 4 * KIB, cost
    assert pool.capacity == 0 and pool.free_count == HUGE

    def use() -> None:
        assert _write(pool, ["a", "b", "c", "d"], 0.0) == [0, 1, 2, 3]
        assert pool.get(["a", "x", "c"], 1.0) == [0, None, 2]
        assert pool.delete(["b"], 2.0) == [("b", 1)]
        reserved = pool.reserve(["e", "f"], 3.0, [])
        outcome = pool.confirm([("e", reserved[0][1])], [reserved[1][1]], 3.0)
        assert outcome.committed == [("e", reserved[0][1])] and outcome.released == 1

    _, used = _allocated(use)
    assert used < 256 * KIB, used  # the first capacity step, not num_pages
    assert pool.capacity == first_capacity(HUGE) == 1025
    assert pool.stored_count == 4 and pool.free_count == HUGE - 4 - 1  # one cooling
    # An eviction (a journaled store's, ahead of need) and the page back to the allocator.
    pool.withhold = True
    assert pool.evict_ahead(1, 10.0) == [("d", 3)]
    pool.release_withheld(pool.collect_withheld(), 10.0)
    assert pool.exists(["a", "c", "d", "e"]) == [True, True, False, True]
    check_pool(pool)


def test_a_confirm_or_release_of_a_page_never_handed_out_changes_nothing() -> None:
    """Pages past the arrays are FREE: a confirm naming one is refused, a release ignored,
    and neither grows the arrays to reach it."""
    pool = Pool(HUGE)
    _write(pool, ["a"], 0.0)
    far = HUGE - 1
    outcome = pool.confirm([("a", 0), ("z", far), ("y", 5000)], [far, 4000], 1.0)
    assert outcome.committed == [] and outcome.released == 0
    assert sorted(outcome.refused) == [("y", 5000), ("z", far)]
    assert pool.capacity == 1025
    assert pool.state_of(far) == FREE and pool.key_at(far) is None
    assert pool.state_of(0) == STORED
    check_pool(pool)


def test_the_arrays_grow_as_pages_are_handed_out() -> None:
    """Doubling with the frontier: never behind it, never more than about twice the pages
    handed out."""
    pool = Pool(HUGE)
    seen = [pool.capacity]
    for batch in range(40):
        pages = _write(pool, [f"k{batch}-{i}" for i in range(256)], float(batch))
        assert max(pages) < pool.capacity <= 2 * (max(pages) + 1) + 1025
        seen.append(pool.capacity)
    assert seen == sorted(seen) and len(set(seen)) >= 4, seen
    assert pool.capacity < 40 * 256 * 3
    check_pool(pool)


def test_a_pool_whose_arrays_cannot_grow_answers_as_a_full_pool(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A MemoryError while growing leaves the pool as it was: the reserve finds no page
    (-1) or evicts, never raises."""
    pool = Pool(HUGE)
    _write(pool, [f"k{i}" for i in range(1025)], 0.0)  # exactly the first capacity step

    def out_of_memory(self: Pool, need: int) -> None:
        raise MemoryError

    monkeypatch.setattr(Pool, "_grow", out_of_memory)
    evicted: list[tuple[str, int]] = []
    got = pool.reserve(["new"], 1.0, evicted)
    assert got == [(False, 0)] and evicted == [("k0", 0)]  # evicted the coldest instead
    assert pool.capacity == 1025
    check_pool(pool)
    monkeypatch.undo()
    assert pool.reserve(["next"], 2.0, []) == [(False, 1025)]
    check_pool(pool)


def test_a_scan_stops_at_the_last_page_ever_used() -> None:
    """A dump walks pages by number: past the arrays nothing is stored, so it is done there
    instead of walking 2^40 pages a window at a time."""
    pool = Pool(HUGE)
    _write(pool, ["a", "b"], 0.0)
    assert pool.stored_keys_from(0, 10, 64) == (["a", "b"], 64)
    assert pool.stored_keys_from(64, 10, 64 * 1024) == ([], HUGE)
    store = MemoryStore()
    pid = PoolId("s", 0, "kv")
    store.initialize(pid, HUGE)
    store.reserve(pid, ["a"])
    store.confirm(pid, [("a", 0)], [])
    assert store.dump(pid, "", 100) == (["a"], "")


def test_snapshot_and_restore_of_a_2_to_the_40_page_pool(tmp_path: Path) -> None:
    """Only stored keys are written (page numbers as int64: they may exceed 2^31), and the
    restored pool costs what the pages used cost."""
    store = MemoryStore()
    pid = PoolId("s", 0, "kv")
    store.initialize(pid, HUGE)
    keys = [f"key-{i}" for i in range(100)]
    pages = [page for _, page in store.reserve(pid, keys)]
    store.confirm(pid, list(zip(keys, pages, strict=True)), [])
    store.pool(pid).get(keys[:10], 5.0)  # the first ten are now the warmest
    path = snapshot.write_snapshot(tmp_path, 1, snapshot.capture(store))
    assert path.stat().st_size < 8 * KIB
    data = snapshot.read_snapshot(path)
    [(got_pid, num_pages, got_keys, got_pages)] = data.pools
    assert (got_pid, num_pages) == (pid, HUGE)
    assert got_keys == keys[10:] + keys[:10] and got_pages.itemsize == 8
    assert dict(zip(got_keys, got_pages, strict=True)) == dict(zip(keys, pages, strict=True))

    def restore() -> Pool:
        pool = Pool.from_lru(
            num_pages, dict(zip(got_keys, got_pages, strict=True)), frontier=data.frontiers[pid]
        )
        pool.hold_after_restart(0.0)
        return pool

    pool, cost = _allocated(restore)
    assert cost < 256 * KIB, cost
    assert pool.capacity == 1025 and pool.stored_items() == list(
        zip(got_keys, got_pages, strict=True)
    )
    assert pool.held_count == 1025 - 100  # free pages below the frontier, as before
    check_pool(pool)


def test_a_small_pool_snapshot_keeps_its_format() -> None:
    """Pools of at most 2^31 pages keep int32 page numbers and the older file versions."""
    store = MemoryStore()
    store.initialize(PoolId("s", 0, "kv"), 1 << 31)
    pieces = snapshot.encode_image(snapshot.capture(store), 1)
    assert pieces[0][4] == 1  # version 1: no tenant, no wide pool
    store.initialize(PoolId("s", 1, "kv"), (1 << 31) + 1)
    pieces = snapshot.encode_image(snapshot.capture(store), 1)
    assert pieces[0][4] == 3
