"""Eviction policies other than LRU, for the tests: small on purpose, so that what the pool
relies on is visibly what ``core.eviction`` documents and nothing the LRU happens to do."""

from __future__ import annotations

from array import array
from collections.abc import Container, Iterable

from kvmeta.core.eviction import EvictionPolicy, Order
from kvmeta.core.pool import page_typecode


class FifoPolicy(EvictionPolicy):
    """First stored, first evicted: reads and reserve hits do not save a page. Pages that
    cannot be taken (read-leased, kept) are stepped over, each step paid from the budget."""

    __slots__ = ("_order", "_capacity", "_typecode")

    def __init__(self, num_pages: int) -> None:
        super().__init__()
        self._order: dict[int, None] = {}  # insertion order: first stored first
        self._capacity = 0
        self._typecode = page_typecode(num_pages)

    def resize(self, capacity: int) -> None:
        self._capacity = capacity

    def load(self, pages: list[int]) -> None:
        self._order = dict.fromkeys(pages)

    def added(self, pages: list[int]) -> None:
        for page in pages:
            self._order[page] = None

    def used(self, pages: Iterable[int | None]) -> None:
        pass

    def removed(self, page: int) -> None:
        del self._order[page]

    def clear(self) -> None:
        self._order = {}

    def victim(self, now: float, keep: Container[int], read_until: array[float]) -> int:
        for page in self._order:
            if page not in keep and read_until[page] <= now:
                del self._order[page]
                return page
            if self.budget == 0:
                return -1
            self.budget -= 1
        return -1

    def can_evict(
        self, count: int, steps: int, now: float, keep: Container[int], read_until: array[float]
    ) -> bool:
        # Each ``victim`` steps again over every page it cannot take before its find.
        skipped = 0
        for page in self._order:
            if page not in keep and read_until[page] <= now:
                if skipped > steps:
                    return False
                steps -= skipped
                count -= 1
                if count <= 0:
                    return True
            else:
                skipped += 1
        return count <= 0

    def chain(self) -> Order:
        nxt = array(self._typecode, [-1]) * self._capacity
        pages = list(self._order)
        for before, after in zip(pages, pages[1:]):  # noqa: B905 - one shorter on purpose
            nxt[before] = after
        return Order(nxt, pages[0] if pages else -1)

    def copy(self) -> FifoPolicy:
        twin = FifoPolicy(1)
        twin._order, twin.budget = dict(self._order), self.budget
        twin._capacity, twin._typecode = self._capacity, self._typecode
        return twin

    def problem(self, capacity: int) -> str | None:
        if capacity != self._capacity:
            return f"FIFO sized for {self._capacity} pages, the pool has {capacity}"
        if any(not 0 <= page < capacity for page in self._order):
            return "FIFO holds a page outside the pool's arrays"
        return None
