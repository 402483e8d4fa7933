"""A journaled store's eviction ahead of need stays O(request), even when every page is read."""

from __future__ import annotations

from kvmeta._types import PoolId
from kvmeta.core.invariants import check_pool
from kvmeta.store.disk.codec import Remove
from kvmeta.store.disk.local import LocalBackend
from kvmeta.store.disk.memory import MemoryStore
from tests.unit.store.durable_support import FakeJournal, journaled, now

P = PoolId("s", 0, "kv")


def journaled_store(n: int, clock: list[float]) -> tuple[LocalBackend, FakeJournal]:
    sink = FakeJournal()
    backend = journaled(MemoryStore(read_lease=5.0, clock=lambda: clock[0]), sink)
    now(backend.initialize(P, n))
    return backend, sink


def fill(backend: LocalBackend, keys: list[str]) -> None:
    out = now(backend.reserve(P, keys))
    now(backend.confirm(P, [(k, page) for k, (_, page) in zip(keys, out, strict=True)], []))


def test_spare_is_topped_up_two_batches_at_a_time() -> None:
    clock = [0.0]
    backend, sink = journaled_store(4096, clock)
    store = backend.store
    fill(backend, [f"k{i}" for i in range(4096)])
    pool = store.pool(P)
    assert pool.allocatable_count + pool.withheld_count == 0
    # Needs 4 pages, then evicts ahead up to 2 batches.
    now(backend.reserve(P, ["a", "b", "c", "d"]))
    removed = [r for r in sink.records if isinstance(r, Remove)]
    assert sum(len(r.entries) for r in removed) == 4 + 2 * 4
    check_pool(pool)


def test_a_pool_whose_pages_are_all_read_costs_a_bounded_scan_per_reserve() -> None:
    clock = [0.0]
    n = 20_000
    backend, sink = journaled_store(n, clock)
    store = backend.store
    keys = [f"k{i}" for i in range(n)]
    fill(backend, keys)
    clock[0] = 1.0
    store.get(P, keys)  # every page read-leased until 6.0
    pool = store.pool(P)
    before = [k for k, _ in pool.stored_items()]
    clock[0] = 2.0
    records = len(sink.records)
    assert now(backend.reserve(P, ["x", "y"])) == [(False, -1), (False, -1)]
    after = [k for k, _ in pool.stored_items()]
    moved = len(after) - after.index(before[0])  # leased pages stepped over (now at the tail)
    assert moved <= 64 + 2 * 2  # the reserve's own allowance; no evict-ahead scan after a refusal
    assert len(sink.records) == records  # nothing was removed
    check_pool(pool)
    clock[0] = 6.5  # leases over: eviction works again, ahead of need too
    out = now(backend.reserve(P, ["x"]))
    assert out[0][1] >= 0
    check_pool(pool)


def test_spare_follows_the_batch_grows_per_pool_when_reserves_wait_and_decays() -> None:
    clock = [0.0]
    backend, _ = journaled_store(4096, clock)
    store = backend.store
    rule = backend.rule
    assert rule is not None
    pool = store.pool(P)
    store.initialize(PoolId("s", 0, "tiny"), 4)
    tiny = store.pool(PoolId("s", 0, "tiny"))
    store.initialize(PoolId("s", 1, "kv"), 4096)
    other = store.pool(PoolId("s", 1, "kv"))
    assert rule.spare_target(pool, 64) == 4096 // 8  # min(32 batches, 1/8 of the pool)
    assert rule.spare_target(pool, 4) == 32 * 4  # a big first batch leaves nothing behind
    assert rule.spare_target(tiny, 4) == 0  # under 8 pages: exact LRU
    for _ in range(20):
        rule.spare_too_small(pool)
        rule.spare_too_small(tiny)
    assert rule.spare_target(pool, 64) == 4096 // 2
    assert rule.spare_target(pool, 4) == 4 * 32 * 4
    assert rule.spare_target(tiny, 4) == 0
    assert rule.spare_target(other, 4) == 32 * 4  # other pools unchanged
    clock[0] = 30.0  # one half-life without waits: half of the growth is gone
    assert rule.spare_target(pool, 4) == int(32 * 4 * 2.5)
    clock[0] = 600.0  # long after the burst: back to the base spare
    assert rule.spare_target(pool, 4) == 32 * 4
