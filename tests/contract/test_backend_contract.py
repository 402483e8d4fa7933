"""The behaviour every Backend must have (docs/guarantees.md), run against each backend in BACKENDS.

Lease tests step a test clock (``TestClock``, shared by the memory store and every Redis
script that reads time) past their deadlines: exact, and no test waits for a lease. One test per
backend keeps real time (a short TTL and a sleep), so expiry on Redis TIME is exercised for real
too; a sleep is never shorter than asked. Every test ends with the full page invariant checked
in the store itself (by the ``make_backend`` fixture).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

from kvmeta._types import PoolId
from kvmeta.errors import InvalidRequest, NotInitialized, PageOutOfRange
from tests.contract.conftest import Sync, TestClock

S0 = PoolId("s", 0, "kv")
S1 = PoolId("s", 1, "other ns/with:odd{chars}")
V0 = PoolId("v", 0, "")


LEASE = 2.5  # seconds of the test clock


@pytest.fixture
def clock() -> TestClock:
    return TestClock()


@pytest.fixture
def held(make_backend: Callable[..., Sync], clock: TestClock) -> Sync:
    """Reservation and read leases of ``LEASE`` seconds of ``clock``."""
    return make_backend(ttl=LEASE, lease=LEASE, clock=clock)


@pytest.fixture
def short(make_backend: Callable[..., Sync]) -> Sync:
    """Reservation leases of 0.3 s and read leases of 0.3 s, in real time."""
    return make_backend(ttl=0.3, lease=0.3)


def _store(b: Sync, pool: PoolId, keys: list[str]) -> list[int]:
    pages = [page for _, page in b.reserve(pool, keys)]
    assert b.confirm(pool, list(zip(keys, pages, strict=True)), []) == 0
    return pages


def _stats(b: Sync, pool: PoolId) -> tuple[int, int, int]:
    (st,) = [s for s in b.stats() if s.pool == pool]
    return st.free, st.reserved, st.stored


# ---------------------------------------------------------------------- initialize


def test_initialize_creates_then_keeps_and_counts_size_conflicts(backend: Sync) -> None:
    first = backend.initialize(S0, 8)
    assert (first.created, first.num_pages, first.conflict) == (True, 8, False)
    again = backend.initialize(S0, 8)
    assert (again.created, again.num_pages, again.conflict) == (False, 8, False)
    other = backend.initialize(S0, 16)
    assert (other.created, other.num_pages, other.requested, other.conflict) == (
        False,
        8,
        16,
        True,
    )
    (st,) = backend.stats()
    assert (st.num_pages, st.free, st.size_conflicts) == (8, 8, 1)


def test_initialize_refuses_a_non_positive_size(backend: Sync) -> None:
    with pytest.raises(InvalidRequest, match="num_pages must be a positive integer"):
        backend.initialize(S0, 0)
    assert backend.stats() == []


def test_every_operation_on_a_missing_pool_is_not_initialized(backend: Sync) -> None:
    calls = [
        ("exists", (["a"],)),
        ("reserve", (["a"],)),
        ("confirm", ([("a", 0)], [])),
        ("get", (["a"],)),
        ("delete", (["a"],)),
        ("clear", ()),
    ]
    for name, args in calls:
        with pytest.raises(NotInitialized, match="Rank 3 namespace 'kv' not initialized"):
            getattr(backend, name)(PoolId("s", 3, "kv"), *args)
        with pytest.raises(NotInitialized, match=r"POST /rank/4/initialize"):
            getattr(backend, name)(PoolId("v", 4, ""), *args)


def test_pools_are_separate_per_rank_namespace_and_dialect(backend: Sync) -> None:
    for pool in (S0, S1, V0):
        backend.initialize(pool, 4)
    _store(backend, S0, ["a"])
    assert backend.exists(S1, ["a"]) == [False]
    assert backend.exists(V0, ["a"]) == [False]
    assert [s.pool for s in backend.stats()] == sorted([S0, S1, V0])


# ---------------------------------------------------------------------- reserve


def test_reserve_hands_out_fresh_pages_lowest_first(backend: Sync) -> None:
    backend.initialize(S0, 4)
    assert backend.reserve(S0, ["a", "b", "c"]) == [(False, 0), (False, 1), (False, 2)]


def test_duplicates_and_retries_share_one_page(backend: Sync) -> None:
    backend.initialize(S0, 4)
    assert backend.reserve(S0, ["a", "a", "b"]) == [(False, 0), (False, 0), (False, 1)]
    assert backend.reserve(S0, ["a"]) == [(False, 0)]
    assert _stats(backend, S0) == (2, 2, 0)


def test_stored_key_is_a_hit(backend: Sync) -> None:
    backend.initialize(S0, 4)
    (page,) = _store(backend, S0, ["a"])
    assert backend.reserve(S0, ["a", "b"]) == [(True, page), (False, 1)]


def test_full_pool_refuses_without_losing_other_pages(backend: Sync) -> None:
    backend.initialize(S0, 2)
    out = backend.reserve(S0, ["a", "b", "c", "d"])
    assert out == [(False, 0), (False, 1), (False, -1), (False, -1)]
    assert _stats(backend, S0) == (0, 2, 0)
    counters = backend.stats()[0].counters
    assert (counters["reservations"], counters["reservations_refused"]) == (2, 2)


def test_eviction_takes_the_least_recently_used_page(backend: Sync) -> None:
    backend.initialize(S0, 3)
    pa, pb, pc = _store(backend, S0, ["a", "b", "c"])
    assert backend.get(S0, ["a"]) == [pa]  # b is now coldest
    assert backend.exists(S0, ["b"]) == [True]  # exists is not a use
    assert backend.reserve(S0, ["d"]) == [(False, pb)]
    assert backend.exists(S0, ["a", "b", "c"]) == [True, False, True]
    assert backend.stats()[0].counters["evictions"] == 1


def test_reserve_hit_is_a_use_and_is_not_evicted_by_the_same_call(backend: Sync) -> None:
    backend.initialize(S0, 2)
    pa, pb = _store(backend, S0, ["a", "b"])
    # a is coldest but is reported as stored first: the new key must take b, not a.
    assert backend.reserve(S0, ["a", "x"]) == [(True, pa), (False, pb)]
    # Both pages are now taken by this call's hit and reservation: nothing left to evict.
    assert backend.reserve(S0, ["a", "y"]) == [(True, pa), (False, -1)]


# ---------------------------------------------------------------------- confirm / release


def test_confirm_commits_and_is_idempotent(backend: Sync) -> None:
    backend.initialize(S0, 4)
    ((_, page),) = backend.reserve(S0, ["a"])
    assert backend.confirm(S0, [("a", page)], []) == 0
    assert backend.confirm(S0, [("a", page)], []) == 0
    assert backend.get(S0, ["a", "zz"]) == [page, None]
    assert _stats(backend, S0) == (3, 0, 1)


def test_confirm_refuses_foreign_and_unreserved_pages(backend: Sync) -> None:
    backend.initialize(S0, 4)
    (_, pa), (_, pb) = backend.reserve(S0, ["a", "b"])
    assert backend.confirm(S0, [("a", pb), ("x", 3), ("b", pb)], []) == 2
    assert backend.exists(S0, ["a", "b", "x"]) == [False, True, False]
    assert backend.stats()[0].counters["confirms_refused"] == 2
    assert backend.confirm(S0, [("a", pa)], []) == 0


@pytest.mark.parametrize(
    ("pairs", "release", "field"),
    [
        ([("a", 0), ("b", 4)], [], "written_keys_to_confirm"),
        ([("a", 0)], [-1], "pages_to_release"),
        ([("a", -5)], [], "written_keys_to_confirm"),
        ([("a", 0)], [1, 99], "pages_to_release"),
    ],
)
def test_out_of_range_pages_are_rejected_and_change_nothing(
    backend: Sync, pairs: list[tuple[str, int]], release: list[int], field: str
) -> None:
    backend.initialize(S0, 4)
    backend.reserve(S0, ["a", "b"])
    with pytest.raises(
        PageOutOfRange, match=rf"in `{field}` is outside this pool's pages 0..3"
    ) as info:
        backend.confirm(S0, pairs, release)
    bad = [p for p in [p for _, p in pairs] + release if not 0 <= p < 4][0]
    assert (info.value.page, info.value.num_pages) == (bad, 4)  # typed: the service words it
    assert info.value.in_release == (field == "pages_to_release")
    assert backend.exists(S0, ["a"]) == [False]
    assert _stats(backend, S0) == (2, 2, 0)


def test_a_joined_page_is_left_to_a_confirm_or_its_lease(backend: Sync) -> None:
    backend.initialize(S0, 4)
    ((_, page),) = backend.reserve(S0, ["a"])
    backend.reserve(S0, ["a"])  # a second writer, or the first one's retry
    backend.confirm(S0, [], [page])
    backend.confirm(S0, [], [page, page])  # which writer lets go cannot be told: none frees
    assert _stats(backend, S0) == (3, 1, 0)
    assert backend.reserve(S0, ["b"])[0][1] != page
    backend.confirm(S0, [("a", page)], [])
    assert backend.get(S0, ["a"]) == [page]
    assert backend.stats()[0].counters["releases"] == 0


def test_a_released_page_cools_before_it_is_handed_out_again(backend: Sync) -> None:
    backend.initialize(S0, 1)
    ((_, page),) = backend.reserve(S0, ["a"])
    backend.confirm(S0, [], [page, page])  # named twice: released once
    assert _stats(backend, S0) == (0, 0, 0)  # FREE, but cooling: no reserve can take it
    assert backend.stats()[0].cooling == 1
    assert backend.reserve(S0, ["b"]) == [(False, -1)]  # within RELEASE_GRACE
    backend.confirm(S0, [], [page])  # a retried copy of the release changes nothing
    assert backend.stats()[0].counters["releases"] == 1


@pytest.mark.parametrize("pool", [S0, V0], ids=["s", "v"])
def test_a_page_listed_twice_in_one_release_counts_once(backend: Sync, pool: PoolId) -> None:
    """A release list is a set per call: writer A listing page p twice must not also drop
    writer B's hold, or p goes FREE (and to another key) while B is still writing it."""
    backend.initialize(pool, 4)
    ((_, page),) = backend.reserve(pool, ["k"])  # writer A
    assert backend.reserve(pool, ["k"]) == [(False, page)]  # writer B joins: two holders
    backend.confirm(pool, [], [page, page])  # A's write failed; its list repeats p
    assert _stats(backend, pool) == (3, 1, 0)  # p stays RESERVED: B holds it
    # A third writer, for another key, must not be handed p while B holds it.
    others = backend.reserve(pool, ["x", "y", "z"])
    assert page not in [p for _, p in others]
    assert backend.confirm(pool, [("k", page)], []) == 0  # B's write lands
    assert backend.get(pool, ["k"]) == [page]
    assert _stats(backend, pool) == (0, 3, 1)
    assert backend.stats()[0].counters["releases"] == 0


def test_releasing_a_stored_page_is_ignored(backend: Sync) -> None:
    backend.initialize(S0, 2)
    (page,) = _store(backend, S0, ["a"])
    backend.confirm(S0, [], [page])
    assert backend.get(S0, ["a"]) == [page]
    assert backend.reserve(S0, ["b", "c"]) == [(False, 1), (False, page)]  # evicts a, never reuses


# ---------------------------------------------------------------------- leases


def test_reservations_expire_and_late_confirms_are_refused(short: Sync) -> None:
    """The real-time lease test: expiry read from the backend's own clock (Redis TIME)."""
    short.initialize(S0, 2)
    ((_, page),) = short.reserve(S0, ["a"])
    time.sleep(0.45)
    assert _stats(short, S0) == (2, 0, 0)
    assert short.confirm(S0, [("a", page)], []) == 1
    assert short.exists(S0, ["a"]) == [False]
    assert short.stats()[0].counters["reservations_expired"] == 1


def test_re_reserving_renews_the_lease(held: Sync, clock: TestClock) -> None:
    """Renewed twice, the reservation is confirmed 1.2 leases after it was first made (so an
    unrenewed one has expired); each renewal comes 0.4 lease after the previous one."""
    held.initialize(S0, 2)
    ((_, page),) = held.reserve(S0, ["a"])
    for _ in range(2):
        clock.advance(0.4 * LEASE)
        assert held.reserve(S0, ["a"]) == [(False, page)]
    clock.advance(0.4 * LEASE)
    assert held.confirm(S0, [("a", page)], []) == 0
    assert held.exists(S0, ["a"]) == [True]


def test_a_page_being_read_is_not_evicted(held: Sync, clock: TestClock) -> None:
    held.initialize(S0, 2)
    pa, pb = _store(held, S0, ["a", "b"])
    assert held.get(S0, ["a"]) == [pa]
    held.get(S0, ["b"])  # a is now coldest but read-leased; b is leased too
    assert held.reserve(S0, ["c"]) == [(False, -1)]
    clock.advance(1.2 * LEASE)
    assert held.reserve(S0, ["c"]) == [(False, pa)]


def test_a_deleted_page_under_a_read_lease_is_not_handed_out(held: Sync, clock: TestClock) -> None:
    held.initialize(S0, 1)
    (page,) = _store(held, S0, ["a"])
    held.get(S0, ["a"])
    assert held.delete(S0, ["a"]) == 1
    assert held.reserve(S0, ["b"]) == [(False, -1)]
    clock.advance(1.2 * LEASE)
    assert held.reserve(S0, ["b"]) == [(False, page)]


# ---------------------------------------------------------------------- delete / clear


def test_delete_frees_stored_keys_only(backend: Sync) -> None:
    backend.initialize(S0, 4)
    _store(backend, S0, ["a", "b"])
    backend.reserve(S0, ["r"])
    assert backend.delete(S0, ["a", "a", "r", "missing"]) == 1
    assert backend.exists(S0, ["a", "b"]) == [False, True]
    assert _stats(backend, S0) == (2, 1, 1)


def test_clear_frees_stored_pages_and_leaves_writes_in_flight(backend: Sync) -> None:
    backend.initialize(S0, 4)
    _store(backend, S0, ["a", "b"])
    ((_, page),) = backend.reserve(S0, ["w"])
    assert backend.clear(S0) == 2
    assert _stats(backend, S0) == (3, 1, 0)
    # New writers never get the in-flight page, and its confirm still lands.
    assert page not in [p for _, p in backend.reserve(S0, ["x", "y", "z"])]
    assert backend.confirm(S0, [("w", page)], []) == 0
    assert backend.get(S0, ["w", "a"]) == [page, None]
    assert backend.stats()[0].counters["clears"] == 1


# ---------------------------------------------------------------------- vLLM index


def test_v_register_sets_world_size_and_keeps_pools(backend: Sync) -> None:
    first = backend.v_register(0, 8, 2)
    assert (first.created, first.num_pages) == (True, 8)
    again = backend.v_register(0, 16, None)
    assert (again.created, again.num_pages, again.conflict) == (False, 8, True)
    with pytest.raises(InvalidRequest):
        backend.v_register(5, 0, None)


def test_v_complete_needs_every_rank_of_the_world(backend: Sync) -> None:
    backend.v_register(0, 4, 2)
    _store(backend, PoolId("v", 0, ""), ["k"])
    assert backend.v_exists(["k"]) == [False]  # rank 1 not registered yet
    backend.v_register(1, 4, 2)
    assert backend.v_exists(["k", "m"]) == [False, False]
    _store(backend, PoolId("v", 1, ""), ["k"])
    assert backend.v_exists(["k", "m"]) == [True, False]


def test_v_without_world_size_uses_registered_ranks(backend: Sync) -> None:
    assert backend.v_exists(["k"]) == [False]
    backend.v_register(0, 4, None)
    _store(backend, PoolId("v", 0, ""), ["k"])
    assert backend.v_exists(["k"]) == [True]
    backend.v_register(1, 4, None)  # a later rank makes older keys incomplete: honest
    assert backend.v_exists(["k"]) == [False]


def test_v_clear_drops_keys_and_keeps_registrations(backend: Sync) -> None:
    backend.v_register(0, 4, 1)
    backend.initialize(S0, 4)
    _store(backend, PoolId("v", 0, ""), ["k", "j"])
    _store(backend, S0, ["k"])
    ((_, page),) = backend.reserve(PoolId("v", 0, ""), ["w"])
    assert backend.v_clear() == 2
    assert backend.v_exists(["k"]) == [False]
    assert backend.exists(S0, ["k"]) == [True]  # SGLang pools are not vLLM's to clear
    assert backend.confirm(PoolId("v", 0, ""), [("w", page)], []) == 0
    assert backend.v_exists(["w"]) == [True]


def test_stats_counts_every_event(backend: Sync) -> None:
    backend.initialize(S0, 2)
    _store(backend, S0, ["a"])
    backend.exists(S0, ["a", "b"])
    backend.get(S0, ["a", "b"])
    backend.reserve(S0, ["a"])
    (st,) = backend.stats()
    expected = {"exists_hits": 1, "exists_misses": 1, "get_hits": 1, "get_misses": 1}
    expected |= {"reservations": 1, "reserve_hits": 1, "commits": 1}
    assert {k: v for k, v in st.counters.items() if v} == expected
