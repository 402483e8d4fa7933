"""``Pool.from_lru`` (recovery's bulk loader) builds exactly what ``Pool.load`` builds."""

from __future__ import annotations

import random

import pytest

from kvmeta.core.invariants import check_pool
from kvmeta.core.pool import Pool, lru_order
from kvmeta.errors import InvalidRequest


@pytest.mark.parametrize(("num_pages", "stored"), [(1, 0), (1, 1), (50, 0), (50, 17), (50, 50)])
def test_same_pool_as_load(num_pages: int, stored: int) -> None:
    rng = random.Random(num_pages * 100 + stored)
    pages = rng.sample(range(num_pages), stored)
    entries = [(f"k{i}", page) for i, page in enumerate(pages)]
    bulk = Pool.from_lru(num_pages, dict(entries))
    slow = Pool.load(num_pages, entries)
    check_pool(bulk)
    assert bulk.stored_items() == slow.stored_items() == entries
    assert bulk.allocatable_count == slow.allocatable_count
    keys, order = lru_order(*bulk.lru_copy())
    assert keys == [k for k, _ in entries] and list(order) == pages
    new = [f"new{i}" for i in range(num_pages - stored)]  # every free page, in the same order
    assert bulk.reserve(new, 0.0, []) == slow.reserve(new, 0.0, [])


@pytest.mark.parametrize("stored", [{"a": 5}, {"a": -1}, {"a": 1, "b": 1}])
def test_bad_input_is_refused_like_load(stored: dict[str, int]) -> None:
    with pytest.raises(InvalidRequest, match="outside|twice"):
        Pool.from_lru(3, stored)
