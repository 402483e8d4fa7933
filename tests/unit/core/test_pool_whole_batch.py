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
    return (pool.stored_items(), pool.reserved_count, pool.free_count, pool.frontier)


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
