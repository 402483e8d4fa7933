"""The page-pool model: each rule of docs/guarantees.md, and regressions for the reference servers'
failures 1-8 (numbered as in docs/guarantees.md)."""

from __future__ import annotations

import time

import pytest

from kvmeta.core import FREE, RESERVED, STORED, Pool, check_pool
from kvmeta.core.pool import RELEASE_GRACE
from kvmeta.errors import InvalidRequest


def make(n: int = 4, ttl: float = 100.0, lease: float = 0.0) -> Pool:
    return Pool(n, reservation_ttl=ttl, read_lease=lease)


def write(pool: Pool, keys: list[str], now: float = 0.0) -> list[int]:
    """Reserve and confirm ``keys``; returns their pages."""
    evicted: list[tuple[str, int]] = []
    got = pool.reserve(keys, now, evicted)
    pairs = [(k, p) for k, (hit, p) in zip(keys, got, strict=True) if not hit and p >= 0]
    pool.confirm(pairs, [], now)
    check_pool(pool)
    return [p for _, p in got]


def test_reserve_confirm_get_exists_cycle() -> None:
    pool = make()
    got = pool.reserve(["a", "b"], 0.0, [])
    assert got == [(False, 0), (False, 1)]
    assert pool.exists(["a", "b"]) == [False, False]
    pool.confirm([("a", 0), ("b", 1)], [], 0.0)
    assert pool.exists(["a", "b", "c"]) == [True, True, False]
    assert pool.get(["b", "c", "a"], 0.0) == [1, None, 0]
    assert pool.reserve(["a"], 0.0, []) == [(True, 0)]
    check_pool(pool)


def test_rejects_non_positive_size() -> None:
    with pytest.raises(InvalidRequest, match="positive"):
        Pool(0)


def test_lru_evicts_least_recently_used() -> None:
    pool = make(3)
    write(pool, ["a", "b", "c"])
    pool.get(["a"], 1.0)  # a is now most recent; b is the oldest
    evicted: list[tuple[str, int]] = []
    got = pool.reserve(["d"], 2.0, evicted)
    assert evicted == [("b", 1)]
    assert got == [(False, 1)]
    assert pool.exists(["a", "b", "c"]) == [True, False, True]
    check_pool(pool)


def test_reserve_hit_counts_as_use_but_exists_does_not() -> None:
    pool = make(2)
    write(pool, ["a", "b"])
    pool.exists(["a"])  # no LRU effect: a stays the oldest
    evicted: list[tuple[str, int]] = []
    pool.reserve(["c"], 1.0, evicted)
    assert evicted == [("a", 0)]
    pool = make(2)
    write(pool, ["a", "b"])
    assert pool.reserve(["a"], 1.0, []) == [(True, 0)]  # a is now recent
    evicted = []
    pool.reserve(["c"], 1.0, evicted)
    assert evicted == [("b", 1)]


# ---- failure 1: no free page and nothing evictable -> never an error, nothing lost


def test_failure1_exhausted_pool_answers_minus_one_and_loses_nothing() -> None:
    pool = make(2)
    got = pool.reserve(["a", "b", "c", "d"], 0.0, [])
    assert got == [(False, 0), (False, 1), (False, -1), (False, -1)]
    check_pool(pool)
    assert pool.free_count == 0 and pool.reserved_count == 2
    pool.confirm([("a", 0)], [1], 0.0)
    # the released page is FREE again, cooling until its release grace ends
    assert pool.stored_count == 1 and pool.cooling_count == 1 and pool.free_count == 0
    pool.expire(60.0)
    assert pool.free_count == 1 and pool.cooling_count == 0
    check_pool(pool)


# ---- failure 2: reservations expire, a crashed writer leaks nothing


def test_failure2_reservation_lease_expires() -> None:
    pool = make(2, ttl=10.0)
    pool.reserve(["a", "b"], 0.0, [])
    assert pool.free_count == 0
    pool.expire(9.9)
    assert pool.free_count == 0
    pool.expire(10.0)
    assert pool.free_count == 2
    assert pool.counters.reservations_expired == 2
    check_pool(pool)
    # the crashed writer's late confirm is refused: the page may belong to someone else now
    pool.reserve(["x"], 11.0, [])
    outcome = pool.confirm([("a", 0), ("b", 1)], [], 11.0)
    assert outcome.committed == [] and len(outcome.refused) == 2
    assert pool.exists(["a", "b"]) == [False, False]
    check_pool(pool)


def test_renewed_reservation_does_not_expire_at_old_deadline() -> None:
    pool = make(1, ttl=10.0)
    pool.reserve(["a"], 0.0, [])
    pool.reserve(["a"], 5.0, [])  # second writer joins, lease renewed to 15
    pool.expire(12.0)
    assert pool.state_of(0) == RESERVED
    pool.expire(15.0)
    assert pool.state_of(0) == FREE
    check_pool(pool)


# ---- failure 3: two writers / a retry / a duplicate in one batch share one page


def test_failure3_duplicate_reservations_share_one_page() -> None:
    pool = make(4)
    first = pool.reserve(["a", "a", "b"], 0.0, [])
    assert first == [(False, 0), (False, 0), (False, 1)]
    retry = pool.reserve(["a", "b"], 0.0, [])
    assert retry == [(False, 0), (False, 1)]
    assert pool.reserved_count == 2 and pool.free_count == 2
    check_pool(pool)


def test_page_stays_reserved_until_every_holder_lets_go() -> None:
    pool = make(2)
    pool.reserve(["a"], 0.0, [])  # writer 1
    pool.reserve(["a"], 0.0, [])  # writer 2
    pool.confirm([], [0], 0.0)  # writer 1's write failed
    assert pool.state_of(0) == RESERVED
    pool.confirm([("a", 0)], [], 0.0)  # writer 2 succeeds
    assert pool.state_of(0) == STORED
    pool.confirm([("a", 0)], [0], 0.0)  # a repeated confirm and a stray release change nothing
    assert pool.state_of(0) == STORED and pool.get(["a"], 0.0) == [0]
    check_pool(pool)


def test_same_page_twice_in_one_release_does_not_free_another_writers_page() -> None:
    pool = make(2)
    pool.reserve(["n"], 0.0, [])  # writer A
    pool.reserve(["n"], 0.0, [])  # writer B joins: same page
    pool.confirm([], [0, 0], 0.0)  # A's write failed; its client named the page twice
    assert pool.state_of(0) == RESERVED
    assert pool.reserve(["other"], 0.0, []) == [(False, 1)]  # page 0 is still B's
    pool.confirm([("n", 0)], [], 0.0)
    assert pool.get(["n"], 0.0) == [0] and pool.state_of(1) == RESERVED
    check_pool(pool)


def test_retried_release_of_a_joined_page_never_frees_it() -> None:
    pool = make(2)
    pool.reserve(["n"], 0.0, [])  # writer A
    pool.reserve(["n"], 0.0, [])  # writer B (or A's retried reserve)
    for _ in range(3):  # A's confirm(release=[0]) received three times
        pool.confirm([], [0], 0.0)
    assert pool.state_of(0) == RESERVED
    pool.confirm([("n", 0)], [], 0.0)  # B's write lands on its own page
    assert pool.state_of(0) == STORED
    check_pool(pool)


def test_released_page_cools_so_a_retried_release_cannot_free_the_next_writers_page() -> None:
    pool = make(1)
    assert pool.reserve(["a"], 0.0, []) == [(False, 0)]
    pool.confirm([], [0], 0.0)  # A's write failed
    assert pool.state_of(0) == FREE
    assert pool.reserve(["b"], 1.0, []) == [(False, -1)]  # not handed out during the grace
    t = RELEASE_GRACE + 0.5
    assert pool.reserve(["b"], t, []) == [(False, 0)]
    check_pool(pool)


def test_confirm_is_idempotent() -> None:
    pool = make(2)
    pool.reserve(["a"], 0.0, [])
    assert pool.confirm([("a", 0)], [], 0.0).committed == [("a", 0)]
    again = pool.confirm([("a", 0)], [], 0.0)
    assert again.committed == [] and again.refused == []
    check_pool(pool)


def test_a_stored_key_is_one_string_object_whichever_request_brought_it() -> None:
    """Each request body is decoded apart, so the confirm's key is another object than the
    reserve's: the pool keeps the reserve's (already the page's) and reports it, never two
    copies of one key (a third more memory per stored key), and an eviction names the very
    objects the confirm reported."""
    pool = make(2)
    reserved = [f"key-{i}" * 8 for i in range(2)]
    pool.reserve(reserved, 0.0, [])
    confirmed = [("".join(list(k)), p) for p, k in enumerate(reserved)]  # equal, not the same
    assert all(c is not r for (c, _), r in zip(confirmed, reserved, strict=True))
    outcome = pool.confirm(confirmed, [], 0.0)
    assert [k for k, _ in outcome.committed] == reserved
    assert all(k is r for (k, _), r in zip(outcome.committed, reserved, strict=True))
    assert all(pool.key_at(p) is r for p, r in enumerate(reserved))
    stored_keys = [k for k in pool._stored]  # noqa: SLF001 - the map's own key objects
    assert all(any(k is r for r in reserved) for k in stored_keys)
    evicted: list[tuple[str, int]] = []
    pool.reserve(["x", "y"], 1.0, evicted)
    assert [k for k, _ in evicted] == reserved
    assert all(k is r for (k, _), r in zip(evicted, reserved, strict=True))
    check_pool(pool)


def test_confirm_for_another_keys_page_is_refused() -> None:
    pool = make(2)
    pool.reserve(["a", "b"], 0.0, [])
    outcome = pool.confirm([("a", 1)], [], 0.0)  # page 1 is b's
    assert outcome.refused == [("a", 1)]
    assert pool.state_of(1) == RESERVED and pool.key_at(1) == "b"
    assert pool.confirm([("zzz", 3 - 2)], [], 0.0).refused  # never reserved for zzz
    check_pool(pool)


# ---- failure 4: a page being read is not evicted


def test_failure4_read_lease_blocks_eviction() -> None:
    pool = make(2, lease=5.0)
    write(pool, ["a", "b"])
    assert pool.get(["a", "b"], 1.0) == [0, 1]  # both under a read lease until 6.0
    assert pool.reserve(["c"], 2.0, []) == [(False, -1)]
    check_pool(pool)
    evicted: list[tuple[str, int]] = []
    assert pool.reserve(["c"], 6.0, evicted) == [(False, 0)]
    assert evicted == [("a", 0)]
    check_pool(pool)


def test_leased_page_at_cold_end_is_skipped_not_evicted() -> None:
    pool = make(3, lease=5.0)
    write(pool, ["a", "b", "c"])
    pool.get(["a"], 1.0)  # a: read lease until 6
    pool.reserve(["b", "c"], 1.0, [])  # uses without a lease: a is the coldest again
    evicted: list[tuple[str, int]] = []
    pool.reserve(["d"], 2.0, evicted)
    assert evicted == [("b", 1)]  # a is skipped, not evicted
    assert pool.exists(["a"]) == [True]
    check_pool(pool)


def test_deleted_page_under_read_lease_is_not_reused_until_lease_ends() -> None:
    pool = make(1, lease=5.0)
    write(pool, ["a"])
    pool.get(["a"], 1.0)
    pool.delete(["a"], 2.0)
    assert pool.reserve(["b"], 3.0, []) == [(False, -1)]
    assert pool.reserve(["b"], 6.0, []) == [(False, 0)]
    check_pool(pool)


# ---- failure 5: clear while writes are in flight


def test_failure5_clear_keeps_reservations_in_flight() -> None:
    pool = make(3)
    write(pool, ["a"])
    pool.reserve(["b"], 0.0, [])  # in flight on page 1
    assert pool.clear(0.0) == 1
    check_pool(pool)
    got = pool.reserve(["c", "d"], 0.0, [])
    assert 1 not in [p for _, p in got]  # b's page is not handed out again
    pool.confirm([("b", 1)], [], 0.0)
    assert pool.get(["b"], 0.0) == [1]
    check_pool(pool)


# ---- failure 6: releasing a STORED page is ignored


def test_failure6_release_of_stored_page_is_ignored() -> None:
    pool = make(2)
    write(pool, ["a"])
    pool.confirm([], [0], 0.0)
    assert pool.state_of(0) == STORED and pool.get(["a"], 0.0) == [0]
    got = pool.reserve(["b"], 0.0, [])
    assert got == [(False, 1)]
    check_pool(pool)


# ---- failure 7: out-of-range pages are refused and change nothing


@pytest.mark.parametrize("page", [-1, 4, 10**9])
def test_failure7_out_of_range_pages_are_rejected(page: int) -> None:
    pool = make(4)
    pool.reserve(["a"], 0.0, [])
    with pytest.raises(InvalidRequest, match="outside"):
        pool.confirm([("a", 0), ("b", page)], [], 0.0)
    with pytest.raises(InvalidRequest, match="pages_to_release"):
        pool.confirm([("a", 0)], [page], 0.0)
    assert pool.state_of(0) == RESERVED  # the valid pair in the rejected request did not commit
    check_pool(pool)


# ---- failure 8: per-page cost does not grow with the pool


def test_failure8_delete_and_release_cost_is_independent_of_pool_size() -> None:
    def cost(n: int) -> float:
        pool = make(n)
        keys = [f"k{i}" for i in range(2000)]
        write(pool, keys) if n <= 4096 else None
        got = pool.reserve(keys, 0.0, [])
        pool.confirm([(k, p) for k, (_, p) in zip(keys, got, strict=True)], [], 0.0)
        start = time.perf_counter()
        pool.delete(keys[:1000], 0.0)
        more = pool.reserve([f"n{i}" for i in range(1000)], 0.0, [])
        pool.confirm([], [p for _, p in more], 0.0)
        return time.perf_counter() - start

    small = min(cost(4096) for _ in range(3))
    large = min(cost(1_000_000) for _ in range(3))
    # An O(pool) scan would make the large pool ~250x slower; allow generous noise.
    assert large < small * 20


def test_load_restores_lru_order_and_free_pages() -> None:
    pool = Pool.load(4, [("a", 2), ("b", 0)], reservation_ttl=10.0, read_lease=0.0)
    check_pool(pool)
    assert pool.stored_items() == [("a", 2), ("b", 0)]
    assert pool.reserve(["c", "d"], 0.0, []) == [(False, 1), (False, 3)]
    evicted: list[tuple[str, int]] = []
    pool.reserve(["e"], 0.0, evicted)
    assert evicted == [("a", 2)]
    with pytest.raises(InvalidRequest):
        Pool.load(2, [("a", 0), ("b", 0)])
    with pytest.raises(InvalidRequest):
        Pool.load(2, [("a", 5)])


def test_delete_and_clear_return_removed_pairs() -> None:
    pool = make(3)
    write(pool, ["a", "b"])
    assert pool.delete(["a", "zzz"], 0.0) == [("a", 0)]
    assert pool.exists(["a", "b"]) == [False, True]
    assert pool.clear(0.0) == 1
    assert pool.stored_count == 0 and pool.free_count == 3
    check_pool(pool)


def test_key_reported_stored_is_not_evicted_by_the_same_call() -> None:
    pool = make(2)
    write(pool, ["a"])
    evicted: list[tuple[str, int]] = []
    got = pool.reserve(["a", "b", "c"], 0.0, evicted)
    assert got == [(True, 0), (False, 1), (False, -1)]
    assert evicted == []
    check_pool(pool)


def test_search_past_read_leased_pages_is_bounded_per_call() -> None:
    """When every page is being read (the pool turns over faster than the read lease), a
    reserve answers -1 after stepping over a bounded number of pages, not the whole pool."""
    n = 5000
    pool = make(n, lease=5.0)
    keys = [f"k{i}" for i in range(n)]
    write(pool, keys)
    pool.get(keys, 1.0)  # every page leased until 6.0; LRU order is k0..k4999
    assert pool.reserve(["x", "y"], 2.0, []) == [(False, -1), (False, -1)]
    moved = [k for k, _ in pool.stored_items()][-(64 + 4) :]
    assert moved == keys[: 64 + 4]  # exactly the allowance was stepped over, in order
    check_pool(pool)
    evicted: list[tuple[str, int]] = []
    page_k68 = pool.page_of("k68")
    assert pool.reserve(["x"], 6.5, evicted) == [(False, page_k68)]
    assert evicted == [("k68", page_k68)]  # leases over: the coldest page goes first
    check_pool(pool)


def test_confirmed_leases_do_not_keep_the_lease_queue_growing_for_the_ttl() -> None:
    """Each reserve queues its leases until their deadline; confirmed ones are dead weight the
    queue used to carry for the whole TTL (about 1 GB at the batch-64 cycle's 750 reserves/s
    and 300 s). Now it stays within twice the live leases plus a fixed slack."""
    from kvmeta.core import pool as pool_module

    pool = Pool(4096, reservation_ttl=300.0, read_lease=0.0)
    now = 0.0
    unconfirmed: list[tuple[str, int]] = []
    for cycle in range(3000):  # 192,000 leases granted within one TTL
        now += 0.001
        keys = [f"c{cycle}-{i}" for i in range(64)]
        got = pool.reserve(keys, now, [])
        pairs = [(k, p) for k, (_, p) in zip(keys, got, strict=True)]
        if cycle % 100 == 0:
            unconfirmed += pairs[:2]  # a few writers never confirm: live leases
            pairs = pairs[2:]
        pool.confirm(pairs, [], now)
        # (checked at each reserve, against the leases live then: 64 more than now)
        assert pool._queued <= 2 * (len(pool._res_deadline) + 64) + pool_module._QUEUE_SLACK
    live = len(pool._res_deadline)
    assert live == len(unconfirmed)
    # The live leases still expire at their deadline, and free their pages.
    pool.expire(now + 300.0)
    assert not pool._res_deadline and pool.counters.reservations_expired == live
    assert all(pool.state_of(p) == FREE for _, p in unconfirmed)
