"""vLLM completeness costs O(keys + the ranks the keys need), on every backend.

``batch_exists`` walks the required ranks in order and asks each one only about the keys every
rank before it stored; the walk ends when no key is left. Each rank's ``exists`` counters
count exactly the keys it was asked about, so they measure the lookups made: a batch of
unknown keys costs one lookup per key (on rank 0), not one per key on every registered rank.
"""

from __future__ import annotations

from kvmeta._types import PoolId
from tests.contract.conftest import Sync


def _store(b: Sync, rank: int, keys: list[str]) -> None:
    pool = PoolId("v", rank, "")
    pages = [page for _, page in b.reserve(pool, keys)]
    assert b.confirm(pool, list(zip(keys, pages, strict=True)), []) == 0


def _lookups(b: Sync) -> dict[int, tuple[int, int]]:
    """Per vLLM rank, the (hits, misses) of the keys it was asked about."""
    return {
        s.pool.rank: (s.counters["exists_hits"], s.counters["exists_misses"])
        for s in b.stats()
        if s.pool.dialect == "v"
    }


def test_a_batch_of_unknown_keys_is_looked_up_on_the_first_rank_only(backend: Sync) -> None:
    ranks, keys = 48, [f"unknown-{i}" for i in range(300)]
    for rank in range(ranks):
        backend.v_register(rank, 8, None)
    assert backend.v_exists(keys) == [False] * len(keys)
    # 300 lookups in all, where asking every rank about every key made 48 x 300 = 14,400
    assert _lookups(backend) == {0: (0, 300), **{r: (0, 0) for r in range(1, ranks)}}


def test_each_rank_is_asked_only_about_the_keys_every_rank_before_it_has(backend: Sync) -> None:
    ranks, keys = 24, [f"block-{i}" for i in range(60)]
    backend.v_register(0, 64, ranks)
    for rank in range(1, ranks):
        backend.v_register(rank, 64, None)
    for rank in range(3):
        _store(backend, rank, keys[:30])
    for rank in range(3, ranks):
        _store(backend, rank, keys[:5] + keys[40:50])  # 40..49: rank 0 lacks them
    assert backend.v_exists(keys) == [True] * 5 + [False] * 55
    assert _lookups(backend) == {
        0: (30, 30),  # every key
        1: (30, 0),  # the 30 that rank 0 has
        2: (30, 0),
        3: (5, 25),
        **{r: (5, 0) for r in range(4, ranks)},  # only the 5 complete ones
    }
    # duplicates are asked (and counted) as often as they are sent, as by `exists`
    assert backend.v_exists(["block-0", "block-0", "block-59"]) == [True, True, False]
    assert _lookups(backend)[ranks - 1] == (7, 0)
