"""The eviction seam: a pool evicts what its policy chooses, snapshots and recovery keep the
policy's order, and the page invariant covers the policy. The state machines run every pool
rule under a first-in-first-out policy too (``test_pool_state_machine``)."""

from __future__ import annotations

import pytest

from kvmeta.core.eviction import PolicyFactory, chain_order
from kvmeta.core.invariants import InvariantViolation, check_pool
from kvmeta.core.lru import LruPolicy
from kvmeta.core.pool import Pool
from tests.unit.core.policies import FifoPolicy


def _stored_pool(policy: PolicyFactory, keys: list[str]) -> Pool:
    pool = Pool(len(keys), read_lease=0.0, policy=policy)
    got = pool.reserve(keys, 0.0, [])
    outcome = pool.confirm([(k, p) for k, (_, p) in zip(keys, got, strict=True)], [], 0.0)
    assert len(outcome.committed) == len(keys)
    return pool


@pytest.mark.parametrize(
    ("policy", "victim"), [(LruPolicy, "b"), (FifoPolicy, "a")], ids=["lru", "fifo"]
)
def test_the_policy_chooses_the_victim(policy: PolicyFactory, victim: str) -> None:
    """A read saves ``a`` from an LRU eviction, not from a FIFO one."""
    pool = _stored_pool(policy, ["a", "b", "c"])
    assert pool.get(["a"], 1.0) == [0]
    evicted: list[tuple[str, int]] = []
    pool.reserve(["d"], 2.0, evicted)
    assert [key for key, _ in evicted] == [victim]
    check_pool(pool)


def test_snapshots_and_recovery_keep_the_policys_order() -> None:
    pool = _stored_pool(FifoPolicy, ["a", "b", "c", "d"])
    pool.get(["a", "b"], 1.0)  # LRU would now order c, d, a, b
    assert [key for key, _ in pool.stored_items()] == ["a", "b", "c", "d"]
    keys, pages = chain_order(*pool.lru_copy())  # what a snapshot writes
    assert keys == ["a", "b", "c", "d"] and list(pages) == [0, 1, 2, 3]
    again = Pool.from_lru(4, dict(pool.stored_items()), read_lease=0.0, policy=FifoPolicy)
    check_pool(again)
    for pool_ in (pool, again):
        evicted: list[tuple[str, int]] = []
        pool_.reserve(["x", "y"], 2.0, evicted)
        assert evicted == [("a", 0), ("b", 1)]


def test_the_page_invariant_covers_the_policy() -> None:
    """A policy holding a page that is not STORED (it could evict a writer's page) or missing
    a STORED one (it could never evict it) fails the check."""
    pool = _stored_pool(FifoPolicy, ["a", "b"])
    pool.delete(["b"], 1.0)
    check_pool(pool)
    pool.policy.added([1])  # page 1 is FREE now
    with pytest.raises(InvariantViolation, match="eviction order != STORED pages"):
        check_pool(pool)
    lru = _stored_pool(LruPolicy, ["a", "b"])
    lru.policy.removed(0)  # "a" is still STORED
    with pytest.raises(InvariantViolation, match="eviction order != STORED pages"):
        check_pool(lru)
