"""``Pool.reserve(..., whole=True)``: vLLM's all-or-nothing batches, against random pools.

``Pool.fits`` promises that when it answers True the reserve places every key, and the reserve
refuses (changing nothing) exactly when it answers False; both are checked here over pools with
stored, reserved, read-leased and free pages and batches that mix them, with duplicates, under
the default LRU policy and a first-in-first-out one (``EvictionPolicy.can_evict`` is what
``fits`` asks)."""

from __future__ import annotations

import random

import pytest

from kvmeta.core.eviction import PolicyFactory
from kvmeta.core.invariants import check_pool
from kvmeta.core.lru import LruPolicy
from kvmeta.core.pool import Pool
from kvmeta.core.prefix import PrefixPolicy
from tests.unit.core.policies import FifoPolicy

POLICIES = {"lru": LruPolicy, "fifo": FifoPolicy, "prefix": PrefixPolicy}


def _state(pool: Pool) -> tuple[object, ...]:
    """What a refused batch must leave as it was. The order of the STORED pages but the
    read-leased ones: those a reserve would step over move warm (``stepped_over``)."""
    until, now = pool._read_until, 1.0
    order = [page for _, page in pool.stored_items() if until[page] <= now]
    return (sorted(pool.stored_items()), order, pool.reserved_count, pool.free_count, pool.frontier)


def _random_pool(
    rng: random.Random, now: float, policy: PolicyFactory = LruPolicy
) -> tuple[Pool, list[str]]:
    pool = Pool(rng.randint(1, 8), reservation_ttl=100.0, read_lease=50.0, policy=policy)
    names = [f"k{i}" for i in range(12)]
    stored = rng.sample(names, rng.randint(0, 8))
    out = pool.reserve(stored, now, [])
    pool.confirm([(k, p) for k, (_, p) in zip(stored, out, strict=True) if p >= 0], [], now)
    pool.get(rng.sample(names, rng.randint(0, 4)), now)  # read leases on some
    pool.reserve(rng.sample(names, rng.randint(0, 3)), now, [])  # other writers' pages
    return pool, names


SEEDS = range(400)


def test_the_seeds_cover_both_answers() -> None:
    answers = set()
    for seed in SEEDS:
        rng = random.Random(seed)
        pool, names = _random_pool(rng, 1.0)
        batch = [rng.choice(names + ["n1", "n2", "n3"]) for _ in range(rng.randint(1, 8))]
        answers.add(pool.fits(batch, 1.0))
    assert answers == {True, False}


@pytest.mark.parametrize("policy", sorted(POLICIES))
@pytest.mark.parametrize("seed", SEEDS)
def test_a_whole_batch_is_placed_whole_or_refused_without_a_change(seed: int, policy: str) -> None:
    rng = random.Random(seed)
    now = 1.0
    pool, names = _random_pool(rng, now, POLICIES[policy])
    batch = [rng.choice(names + ["n1", "n2", "n3"]) for _ in range(rng.randint(1, 8))]
    # Half the batches name a prefix key (stored or not): a policy that follows chains keeps
    # its page, and ``fits`` must count that.
    parent = rng.choice(names) if rng.random() < 0.5 else None
    named = pool.page_of(parent) if parent and pool.policy.follows_chains else None
    fits = pool.fits(batch, now, -1 if named is None else named)
    before = _state(pool)
    stored = {key: pool.page_of(key) for key in batch if pool.exists([key])[0]}
    evicted: list[tuple[str, int]] = []
    out = pool.reserve(batch, now, evicted, whole=True, parent=parent)
    check_pool(pool)
    assert named is None or named not in [page for _, page in evicted]
    if fits:
        assert all(page >= 0 for _, page in out), (batch, out)
    else:
        assert _state(pool) == before
        for key, (hit, page) in zip(batch, out, strict=True):
            if hit:
                assert page == stored[key]
            else:
                assert page == -1
        assert any(not hit for hit, _ in out)


def _loaded_pool_run(seed: int, policy: PolicyFactory) -> int:
    """A pool of tens to hundreds of pages under engine-like traffic: requests that extend
    earlier ones, reads of whole chains and of scattered pages under long read leases, named
    parents, exists hints and deletes, with a whole-batch reserve at every other step. Checks
    that a batch ``fits`` admits is placed whole; returns how many batches it admitted."""
    rng = random.Random(seed)
    pool = Pool(
        rng.randint(64, 400),
        reservation_ttl=rng.choice([5.0, 300.0]),
        read_lease=rng.choice([1.0, 5.0, 60.0]),
        policy=policy,
    )
    now = 0.0
    saved: list[list[str]] = []
    admitted = 0
    for step in range(150):
        now += rng.choice([0.0, 0.05, 0.5, 2.0])
        kind = rng.random()
        if kind < 0.45:
            size = rng.randint(1, 3) if rng.random() < 0.5 else rng.randint(1, 64)
            keys = [f"s{seed}-{step}-{i}" for i in range(size)]
            if saved and rng.random() < 0.3:
                chain = rng.choice(saved)
                keys = chain[: rng.randint(1, len(chain))] + keys
            parent = rng.choice(rng.choice(saved)) if saved and rng.random() < 0.3 else None
            if saved and rng.random() < 0.3:
                pool.exists(rng.choice(saved)[:3] + keys)
            named = pool.page_of(parent) if parent and pool.policy.follows_chains else None
            fits = pool.fits(keys, now, -1 if named is None else named)
            out = pool.reserve(keys, now, [], whole=True, parent=parent)
            placed = [page >= 0 for _, page in out]
            assert all(placed) or not fits, (seed, step, sum(placed), len(placed))
            if fits:
                admitted += 1
                pairs = zip(keys, out, strict=True)
                pool.confirm([(k, p) for k, (hit, p) in pairs if not hit], [], now)
                saved.append(keys)
        elif kind < 0.85 and saved:
            if rng.random() < 0.7:
                chain = rng.choice(saved)
                pool.get(chain[: rng.randint(1, len(chain))], now)
            else:
                pool.get([rng.choice(rng.choice(saved)) for _ in range(rng.randint(1, 16))], now)
        elif saved:
            pool.delete([rng.choice(rng.choice(saved))], now)
    check_pool(pool)
    return admitted


# (Not the test FIFO policy: it pays again for every page it steps over at each victim, so a
# batch whose earlier keys evict its later ones, the oldest pages, outspends its count. The
# pool's own policies pay for a page once a reserve.)
@pytest.mark.parametrize("policy", ["lru", "prefix"])
def test_a_batch_the_count_admits_is_placed_whole_in_a_loaded_pool(policy: str) -> None:
    admitted = sum(_loaded_pool_run(seed, POLICIES[policy]) for seed in range(40))
    assert admitted > 400  # most batches fit: the check is not vacuous


def _cold_leased(leased: int, free: int) -> Pool:
    """An LRU pool whose ``leased`` coldest pages are read-leased and the ``free`` after them
    are not."""
    pool = Pool(leased + free, read_lease=60.0)
    for i in range(leased + free):
        out = pool.reserve([f"k{i}"], 1.0, [])
        pool.confirm([(f"k{i}", out[0][1])], [], 1.0)
    pool.get([f"k{i}" for i in range(leased)], 2.0)  # leased until 62, and moved warm...
    pool.reserve([f"k{i}" for i in range(leased, leased + free)], 3.0, [])  # ...then these
    return pool


def test_lru_counts_a_whole_batch_as_its_reserve_pays_for_it() -> None:
    # The reserve steps over the leased pages once (a step each, and one for the page it then
    # takes) and takes the next pages at the cold end for nothing. 40 keys: 64 + 2 * 40 = 144
    # steps, so 143 leased pages can be stepped over and 144 cannot.
    keys = [f"n{i}" for i in range(40)]
    pool = _cold_leased(143, 50)
    assert pool.fits(keys, 4.0) is True
    evicted: list[tuple[str, int]] = []
    out = pool.reserve(keys, 4.0, evicted, whole=True)
    assert all(page >= 0 for _, page in out)
    assert [key for key, _ in evicted] == [f"k{i}" for i in range(143, 183)]
    check_pool(pool)
    pool = _cold_leased(144, 50)
    assert pool.fits(keys, 4.0) is False
    assert pool.reserve(keys, 4.0, [], whole=True) == [(False, -1)] * 40
    # The refusal moved the leased pages it would have stepped over warm, as a reserve's
    # scan does: the batch, sent again, is placed (per key, the first key's scan would have
    # found nothing and the others pages: the part vLLM's connector gives up and strands).
    out = pool.reserve(keys, 4.0, [], whole=True)
    assert all(page >= 0 for _, page in out)
    check_pool(pool)
