"""Leaf-first eviction (``core.prefix``): a page with a stored child goes only when no leaf
can, leaves go least recently used first, parents come from the order of a request's keys and
pages whose parent is gone are counted as dead."""

from __future__ import annotations

from kvmeta.core.invariants import check_copy, check_pool, copy_pool
from kvmeta.core.pool import Pool
from kvmeta.core.prefix import HOT_SHARE, PrefixPolicy


def _store(pool: Pool, keys: list[str], now: float) -> None:
    """One request: reserve ``keys`` in order and confirm every page handed out."""
    out = pool.reserve(keys, now, [])
    pairs = [(k, p) for k, (hit, p) in zip(keys, out, strict=True) if not hit and p >= 0]
    pool.confirm(pairs, [], now)


def _evict(pool: Pool, key: str, now: float) -> str:
    """Reserve one new key in a full pool; the key evicted for it."""
    evicted: list[tuple[str, int]] = []
    pool.reserve([key], now, evicted)
    assert len(evicted) == 1
    return evicted[0][0]


def _policy(pool: Pool) -> PrefixPolicy:
    policy = pool.policy
    assert isinstance(policy, PrefixPolicy)
    return policy


def test_a_chains_tail_goes_before_its_older_head() -> None:
    pool = Pool(3, read_lease=0.0, policy=PrefixPolicy)
    _store(pool, ["A", "B", "C"], 1.0)  # A <- B <- C
    pool.get(["B", "C"], 2.0)  # the head is never read again: it is the oldest page
    assert _evict(pool, "x", 3.0) == "C"
    assert _evict(pool, "y", 4.0) == "B"  # then B, a leaf now
    check_pool(pool)
    assert _policy(pool).dead == 0


def test_a_page_with_a_stored_child_goes_only_when_no_leaf_can() -> None:
    pool = Pool(4, read_lease=5.0, policy=PrefixPolicy)
    _store(pool, ["A", "B"], 1.0)  # A <- B
    _store(pool, ["C"], 2.0)  # a root leaf, newer than both
    _store(pool, ["D"], 3.0)
    assert _evict(pool, "x", 10.0) == "B"  # the coldest leaf, not A
    for key in ("C", "D"):
        pool.get([key], 11.0)  # every leaf but A is being read
    assert _evict(pool, "y", 12.0) == "A"  # A is a leaf now
    check_pool(pool)


def test_an_inner_page_goes_when_every_leaf_is_being_read_and_its_child_is_dead() -> None:
    pool = Pool(3, read_lease=5.0, policy=PrefixPolicy)
    _store(pool, ["A", "B"], 1.0)
    _store(pool, ["C"], 2.0)
    pool.get(["B"], 10.0)  # both leaves are read-leased until 15 (read apart: a get in
    pool.get(["C"], 10.0)  # order would teach C that B is its parent)
    assert _evict(pool, "x", 11.0) == "A"
    assert _policy(pool).dead == 1  # B's parent is gone
    check_pool(pool)
    pool.delete(["B"], 11.0)
    assert _policy(pool).dead == 0
    check_pool(pool)


def test_unused_leaves_go_first_least_recently_stored_first() -> None:
    pool = Pool(6, read_lease=0.0, policy=PrefixPolicy)
    for key in ("a", "b", "c", "d", "e", "f"):
        _store(pool, [key], 1.0)
    pool.get(["a"], 2.0)  # protected: 1 of 6 pages, under HOT_SHARE
    assert HOT_SHARE > 1 / 6
    assert [_evict(pool, k, 3.0) for k in ("x", "y")] == ["b", "c"]
    check_pool(pool)


def test_used_leaves_go_once_they_are_more_than_their_share() -> None:
    pool = Pool(4, read_lease=0.0, policy=PrefixPolicy)
    for key in ("a", "b", "c", "d"):
        _store(pool, [key], 1.0)
    pool.get(["b"], 2.0)
    pool.get(["a"], 3.0)  # protected: 2 of 4 pages, over HOT_SHARE; b is the coldest of them
    assert HOT_SHARE < 2 / 4
    assert _evict(pool, "x", 4.0) == "b"
    assert _policy(pool).protected(pool.page_of("a") or 0)
    check_pool(pool)


def test_an_unused_chain_goes_whole_from_its_tail() -> None:
    pool = Pool(4, read_lease=0.0, policy=PrefixPolicy)
    _store(pool, ["A", "B", "C"], 1.0)  # A <- B <- C, never read
    _store(pool, ["D"], 2.0)
    # C is the coldest leaf; each parent left without a child is the next victim.
    assert [_evict(pool, k, 3.0) for k in ("w", "x", "y")] == ["C", "B", "A"]
    check_pool(pool)


def test_a_used_chain_goes_whole_before_the_next_used_one() -> None:
    pool = Pool(4, read_lease=0.0, policy=PrefixPolicy)
    _store(pool, ["A1", "A2"], 1.0)
    _store(pool, ["B1", "B2"], 1.0)
    pool.get(["A1", "A2"], 2.0)
    pool.get(["B1", "B2"], 3.0)  # every page protected; A the coldest chain
    # The pages of one request were used together: its head is no warmer than its tail.
    assert [_evict(pool, k, 4.0) for k in ("w", "x", "y")] == ["A2", "A1", "B2"]
    check_pool(pool)


def test_a_used_parent_whose_last_child_went_becomes_the_warmest_leaf() -> None:
    pool = Pool(4, read_lease=0.0, policy=PrefixPolicy)
    _store(pool, ["A1"], 1.0)
    _store(pool, ["A1", "A2"], 1.0)  # A2, stored by a later request, hangs off A1
    _store(pool, ["B1", "B2"], 1.0)
    pool.get(["A1", "A2"], 2.0)
    pool.get(["B1", "B2"], 3.0)  # every page protected; A2 the coldest leaf
    assert _evict(pool, "x", 4.0) == "A2"
    # A1 lost its last child: an engine reading its chain reads A1 from its host cache, so it
    # is as recent as A2 was, and goes after B.
    assert [_evict(pool, k, 5.0) for k in ("y", "z")] == ["B2", "B1"]
    check_pool(pool)


def test_parents_come_from_earlier_requests_hits() -> None:
    pool = Pool(4, read_lease=0.0, policy=PrefixPolicy)
    _store(pool, ["A"], 1.0)
    _store(pool, ["A", "B"], 2.0)  # A is a hit, B's parent
    _store(pool, ["C"], 3.0)
    _store(pool, ["D"], 3.0)
    # A is the oldest page but has a child: the leaves go first, B the coldest of them.
    assert _evict(pool, "x", 5.0) == "B"
    check_pool(pool)


def test_a_page_whose_parent_got_no_page_is_dead() -> None:
    pool = Pool(2, read_lease=5.0, policy=PrefixPolicy)
    _store(pool, ["p"], 1.0)
    pool.get(["p"], 1.0)  # read-leased: the next reserve cannot evict it
    # One free page: A gets it and B none, so C (with a page once B's is freed) has no parent.
    out = pool.reserve(["A", "B"], 2.0, [])
    assert [p for _, p in out] == [1, -1]
    pool.confirm([("A", 1)], [], 2.0)
    assert _policy(pool).dead == 0
    pool.delete(["p"], 9.0)
    out = pool.reserve(["A", "B", "C"], 9.0, [])
    assert out[0][0] and out[1][1] >= 0 and out[2][1] == -1
    pool.confirm([("B", out[1][1])], [], 9.0)
    assert _policy(pool).dead == 0  # B's parent A is stored
    pool.delete(["A"], 9.0)
    assert _policy(pool).dead == 1  # ...and now gone
    check_pool(pool)


def test_after_a_restart_parents_are_relearned_from_gets() -> None:
    pool = Pool(3, read_lease=0.0, policy=PrefixPolicy)
    _store(pool, ["A", "B", "C"], 1.0)
    again = Pool.from_lru(3, dict(pool.stored_items()), read_lease=0.0, policy=PrefixPolicy)
    check_pool(again)
    # The order survives (the chain from its tail); the parents do not: all three are leaves.
    assert [k for k, _ in again.stored_items()] == ["C", "B", "A"]
    again.get(["A", "B", "C"], 2.0)  # ...until a request reads the chain in order
    check_pool(again)
    assert _policy(again).parent_of(again.page_of("B") or 0) == again.page_of("A")
    assert _policy(again).parent_of(again.page_of("C") or 0) == again.page_of("B")
    assert _evict(again, "x", 3.0) == "C"


def test_the_first_reserved_keys_parent_comes_from_the_exists_before_it() -> None:
    # An engine holding A in its host cache asks for B, C; A' is stored, B and C are not.
    pool = Pool(4, read_lease=0.0, policy=PrefixPolicy)
    _store(pool, ["A"], 1.0)
    assert pool.exists(["A", "B", "C"]) == [True, False, False]
    _store(pool, ["B", "C"], 2.0)  # the reserve names only the missing keys
    _store(pool, ["D"], 3.0)
    assert _policy(pool).parent_of(pool.page_of("B") or 0) == pool.page_of("A")
    assert _evict(pool, "x", 4.0) == "C"  # not A, the oldest: it has a stored child
    check_pool(pool)


def test_the_prefix_key_a_request_names_is_its_first_keys_parent() -> None:
    # No exists before the reserve: only the named prefix key tells that A comes before B.
    pool = Pool(4, read_lease=0.0, policy=PrefixPolicy)
    _store(pool, ["A"], 1.0)
    out = pool.reserve(["B", "C"], 2.0, [], parent="A")
    pool.confirm([("B", out[0][1]), ("C", out[1][1])], [], 2.0)
    _store(pool, ["D"], 3.0)
    assert _policy(pool).parent_of(pool.page_of("B") or 0) == pool.page_of("A")
    assert _evict(pool, "x", 4.0) == "C"  # not A, the oldest: it has a stored child
    check_pool(pool)
    # A named prefix key that is not stored, or empty, gives no parent (and is no error).
    for named in ("nowhere", ""):
        key = f"E{named}"
        out = pool.reserve([key], 5.0, [], parent=named)
        pool.confirm([(key, out[0][1])], [], 5.0)
        assert _policy(pool).parent_of(out[0][1]) == -1
    check_pool(pool)


def test_the_named_prefix_key_overrides_the_exists_hint_and_relinks_a_stored_root() -> None:
    pool = Pool(6, read_lease=0.0, policy=PrefixPolicy)
    _store(pool, ["A"], 1.0)
    _store(pool, ["P"], 1.0)
    _store(pool, ["R"], 1.0)  # a root: its parent was never told
    assert pool.exists(["A", "B"]) == [True, False]  # hints A as B's parent...
    out = pool.reserve(["B"], 2.0, [], parent="P")  # ...but the request names P
    pool.confirm([("B", out[0][1])], [], 2.0)
    assert _policy(pool).parent_of(pool.page_of("B") or 0) == pool.page_of("P")
    # A stored first key learns its parent from the named prefix key too.
    out = pool.reserve(["R", "S"], 3.0, [], parent="A")
    pool.confirm([("S", out[1][1])], [], 3.0)
    assert _policy(pool).parent_of(pool.page_of("R") or 0) == pool.page_of("A")
    assert _policy(pool).parent_of(pool.page_of("S") or 0) == pool.page_of("R")
    check_pool(pool)


def test_the_named_parent_is_not_evicted_for_its_own_child() -> None:
    # A is the only leaf and the coldest page; without the named parent it would be the victim
    # for B, and B would be dead the moment it is stored.
    for whole in (False, True):
        pool = Pool(2, read_lease=0.0, policy=PrefixPolicy)
        _store(pool, ["A"], 1.0)
        _store(pool, ["Z"], 2.0)
        evicted: list[tuple[str, int]] = []
        assert pool.fits(["B"], 3.0, pool.page_of("A") or 0) is True
        out = pool.reserve(["B"], 3.0, evicted, whole, parent="A")
        assert evicted == [("Z", out[0][1])], whole
        pool.confirm([("B", out[0][1])], [], 3.0)
        assert _policy(pool).dead == 0
        check_pool(pool)
        # With every other page kept as well, the reserve finds none, whole or not.
        out = pool.reserve(["B", "C"], 4.0, [], whole, parent="A")
        assert out[1] == (False, -1), whole
        check_pool(pool)


def test_a_reservation_that_ends_unconfirmed_leaves_no_parent_behind() -> None:
    # Each reserve notes its first page's parent; a page whose reservation was released (or
    # expired) and is handed out again inside another chain takes the page before it.
    for end in ("release", "expire"):
        pool = Pool(4, read_lease=0.0, reservation_ttl=10.0, policy=PrefixPolicy)
        first = [pool.reserve([key], 1.0, [])[0][1] for key in ("W1", "W2")]  # roots, noted
        if end == "release":
            pool.confirm([], first, 1.0)
        later = 100.0  # past the release grace and the reservation lease
        _store(pool, ["B", "C"], later)  # both take the two pages given back
        assert sorted([pool.page_of("B"), pool.page_of("C")]) == sorted(first)
        assert _policy(pool).parent_of(pool.page_of("C") or 0) == pool.page_of("B"), end
        assert _policy(pool).dead == 0
        check_pool(pool)


def test_a_delete_inside_a_chain_splits_it_and_the_rest_is_dead() -> None:
    pool = Pool(6, read_lease=0.0, policy=PrefixPolicy)
    _store(pool, ["A", "B", "C", "D"], 1.0)
    pool.delete(["B"], 2.0)
    assert _policy(pool).dead == 1  # C's parent is gone (D's, C, is stored)
    assert _policy(pool).parent_of(pool.page_of("D") or 0) == pool.page_of("C")
    assert _policy(pool).parent_of(pool.page_of("C") or 0) == -1
    check_pool(pool)
    # Both parts are leaves; the part after the gap keeps the chain's place.
    assert [k for k, _ in pool.stored_items()] == ["D", "C", "A"]
    pool.delete(["C"], 2.0)  # the first page of a part
    assert _policy(pool).dead == 1  # D now
    check_pool(pool)
    pool.delete(["D"], 2.0)
    assert _policy(pool).dead == 0
    check_pool(pool)


def test_pages_taken_ahead_of_need_are_settled_before_anything_reads_the_policy() -> None:
    # ``victim`` leaves the list work of a run it is eating for later; a journaled store's
    # ``evict_ahead`` ends with no other call, so every reader must see the pages gone.
    pool = Pool(4, read_lease=0.0, policy=PrefixPolicy)
    _store(pool, ["A", "B", "C"], 1.0)
    _store(pool, ["D"], 1.0)
    pool.withhold = True
    assert [key for key, _ in pool.evict_ahead(2, 2.0)] == ["C", "B"]
    check_copy(copy_pool(pool))  # through ``copy``
    assert [key for key, _ in pool.stored_items()] == ["A", "D"]  # through ``chain``
    assert _policy(pool).dead == 0
    check_pool(pool)


def test_after_a_restart_a_reserve_eats_one_page_chains_in_a_row() -> None:
    pool = Pool(6, read_lease=0.0, policy=PrefixPolicy)
    for key in "abcdef":
        _store(pool, [key], 1.0)
    again = Pool.from_lru(6, dict(pool.stored_items()), read_lease=0.0, policy=PrefixPolicy)
    again.get(["c", "d"], 2.0)  # d hangs off c again; both used
    evicted: list[tuple[str, int]] = []
    again.reserve(["x", "y", "z"], 3.0, evicted)
    # The unused one-page chains in order, past c (it has a child) and d (used).
    assert [key for key, _ in evicted] == ["a", "b", "e"]
    check_pool(again)
    assert [key for key, _ in again.stored_items()] == ["f", "d", "c"]


def test_a_whole_batch_is_counted_in_the_order_victims_are_taken() -> None:
    # 100 used pages (each a chain of its own, read-leased) are more than HOT_SHARE of the
    # pool, so a reserve takes victims from the used runs first and spends its allowance
    # (64 + 2 per key) stepping over their leased tails: the unused pages are out of its
    # reach. The count must say so, or a whole batch is placed in part.
    pool = Pool(111, read_lease=60.0, policy=PrefixPolicy)
    for i in range(110):
        _store(pool, [f"k{i}"], 1.0)
    for i in range(100):
        pool.get([f"k{i}"], 2.0)  # one get each: no get order links them
    assert 100 > 111 * HOT_SHARE
    before = pool.stored_items()
    assert pool.fits(["x", "y"], 3.0) is False
    out = pool.reserve(["x", "y"], 3.0, [], whole=True)
    assert out == [(False, -1), (False, -1)]
    assert pool.stored_items() == before and pool.reserved_count == 0
    check_pool(pool)


def test_a_whole_batch_is_not_counted_past_a_used_page_of_an_unused_chain() -> None:
    # A reserve eats an unused chain from its tail down to its first used page; the pages
    # before that join the used chains, here out of reach behind 110 read-leased tails (more
    # than the allowance of 64 + 2 per key). The count must not include them.
    pool = Pool(281, read_lease=60.0, policy=PrefixPolicy)
    _store(pool, [f"c{i}" for i in range(10)], 1.0)  # c0 <- ... <- c9, unused
    for i in range(110):
        _store(pool, [f"k{i}"], 1.0)
    for i in range(9):
        _store(pool, [f"z{i}"], 1.0)
    pool.reserve([f"w{i}" for i in range(150)], 1.0, [])  # being written: not the policy's
    pool.get(["c3"], 2.0)  # used inside the unused chain; its read lease ends at 62
    for i in range(110):
        pool.get([f"k{i}"], 65.0)  # used and read-leased
    assert 111 <= 281 * HOT_SHARE  # the unused chains are still the segment taken first
    keys = [f"n{i}" for i in range(20)]  # one free page, 19 to evict: c9..c4, z0..z8 and 4
    before = pool.stored_items()
    assert pool.fits(keys, 70.0) is False
    assert pool.reserve(keys, 70.0, [], whole=True) == [(False, -1)] * 20
    assert pool.stored_items() == before
    check_pool(pool)
