"""Least-recently-used eviction, the default policy: the coldest STORED page goes first.

The order is an intrusive doubly linked list over page numbers in two C int arrays (``_prev``,
``_next``; -1 ends it), from the coldest page (``_head``) to the warmest (``_tail``): a use
is a handful of array writes and no per-key objects exist. The per-page loops (``added``,
``used``) and the common eviction (``victim`` taking the head) write the links inline instead
of calling ``_unlink``/``_link_tail``: they run once per key of every request, and the helper
calls cost a few per cent of a 64-key cycle (``kvmeta bench core``). A read-leased page found
at the cold end is moved to the warm end (it was just read), so a scan usually looks at one or
two pages; the budget bounds it when almost every page is being read.
"""

from __future__ import annotations

from array import array
from collections.abc import Container, Iterable

from kvmeta.core.eviction import EvictionPolicy, Order
from kvmeta.core.pages import page_typecode

__all__ = ["LruPolicy"]


class LruPolicy(EvictionPolicy):
    """Evicts the least recently stored, read or reserved-again page first."""

    __slots__ = ("_prev", "_next", "_head", "_tail")

    def __init__(self, num_pages: int) -> None:
        super().__init__()
        typecode = page_typecode(num_pages)
        self._prev = array(typecode)
        self._next = array(typecode)
        self._head = -1
        self._tail = -1

    def resize(self, capacity: int) -> None:
        prev, nxt = self._prev, self._next
        cap = len(prev)
        if capacity <= cap:
            del prev[capacity:]
            del nxt[capacity:]
            return
        add = bytes(prev.itemsize * (capacity - cap))
        try:
            prev.frombytes(add)
            nxt.frombytes(add)
        except MemoryError:
            del prev[cap:]
            del nxt[cap:]
            raise

    def load(self, pages: list[int]) -> None:
        if not pages:
            self._head = self._tail = -1
            return
        prev, nxt = self._prev, self._next
        prev[pages[0]] = -1
        for before, after in zip(pages, pages[1:]):  # noqa: B905 - one shorter on purpose
            nxt[before] = after
            prev[after] = before
        nxt[pages[-1]] = -1
        self._head, self._tail = pages[0], pages[-1]

    def added(self, pages: list[int]) -> None:
        prev, nxt = self._prev, self._next
        tail = self._tail
        for page in pages:
            prev[page] = tail
            nxt[page] = -1
            if tail == -1:
                self._head = page
            else:
                nxt[tail] = page
            tail = page
        self._tail = tail

    def used(self, pages: Iterable[int | None]) -> None:
        prev, nxt = self._prev, self._next
        tail = self._tail
        for page in pages:
            if page is None or page == tail:
                continue
            # Unlink and link at the tail. page is not the tail, so it has a successor, and
            # the list is not empty.
            before, after = prev[page], nxt[page]
            if before == -1:
                self._head = after
            else:
                nxt[before] = after
            prev[after] = before
            prev[page] = tail
            nxt[page] = -1
            nxt[tail] = page
            tail = page
        self._tail = tail

    def removed(self, page: int) -> None:
        self._unlink(page)

    def clear(self) -> None:
        self._head = self._tail = -1

    def victim(self, now: float, keep: Container[int], read_until: array[float]) -> int:
        page = self._head
        if page != -1 and read_until[page] <= now and page not in keep:
            # The common case, without using the budget: the coldest page is not being read.
            after = self._next[page]
            self._head = after
            if after == -1:
                self._tail = -1
            else:
                self._prev[after] = -1
            return page
        return self._scan(now, keep, read_until)

    def _scan(self, now: float, keep: Container[int], read_until: array[float]) -> int:
        """``victim`` past read-leased pages at the cold end. Every page looked at is the
        head: a read-leased one is moved to the tail (inlined: when the pool turns over faster
        than the lease, this loop runs for every step of the budget)."""
        nxt, prev = self._next, self._prev
        steps = self.budget
        taken = 0
        page = self._head
        first = -1  # the first page moved: reaching it again, every page has been looked at
        while taken < steps and page != first:
            taken += 1
            if page == -1 or page in keep:
                # Pages this call reported as stored sit at the warm end, after every other
                # candidate: reaching one means nothing else can be evicted.
                break
            if read_until[page] > now:
                # Being read right now: it is hot, so treat the read as a use.
                after = nxt[page]
                if after == -1:
                    break  # the only page, and leased
                tail = self._tail
                self._head = after
                prev[after] = -1
                prev[page] = tail
                nxt[page] = -1
                nxt[tail] = page
                self._tail = page
                if first == -1:
                    first = page
                page = after
                continue
            self.budget -= taken
            self._unlink(page)
            return page
        self.budget -= taken
        return -1

    def can_evict(
        self, count: int, steps: int, now: float, keep: Container[int], read_until: array[float]
    ) -> bool:
        """Walks from the cold end as ``victim`` takes pages (``_walk``). A kept page counts
        as one that cannot go: a hit moves it warm before a later victim, and a page of a
        later key of the batch that goes instead frees as many pages as it then needs."""
        return self._walk(count, steps, now, keep, read_until, False)

    def stepped_over(
        self,
        count: int,
        steps: int,
        now: float,
        keep: Container[int],
        read_until: array[float],
    ) -> None:
        """The same walk as ``can_evict``, moving each read-leased page it steps over to the
        warm end, as ``_scan`` does."""
        self._walk(count, steps, now, keep, read_until, True)

    def _walk(
        self,
        count: int,
        steps: int,
        now: float,
        keep: Container[int],
        read_until: array[float],
        move: bool,
    ) -> bool:
        """Whether ``count`` pages can be taken from the cold end within ``steps``, paying as
        ``victim`` does: a page that can go at the cold end costs no step; one it cannot take
        costs one (``_scan`` moves it warm, once a reserve), and so does the page a scan then
        takes. ``move``: move the read-leased pages stepped over warm on the way."""
        nxt = self._next
        page = self._head
        first = -1  # the first page moved: reaching it again, every page has been looked at
        cost = 0
        scanning = False  # a page was stepped over since the last page taken
        while page not in (-1, first):
            after = nxt[page]
            if page not in keep and read_until[page] <= now:
                if scanning:
                    cost += 1
                    scanning = False
                    if cost > steps:
                        return False
                count -= 1
                if count <= 0:
                    return True
            else:
                cost += 1
                scanning = True
                if move and page not in keep:
                    self.used((page,))
                    if first == -1:
                        first = page
                if cost >= steps:
                    return False  # the scan's take would not be paid for
            page = after
        return count <= 0

    def chain(self) -> Order:
        return Order(self._next[:], self._head)

    def copy(self) -> LruPolicy:
        twin = LruPolicy.__new__(LruPolicy)
        twin._prev, twin._next = self._prev[:], self._next[:]
        twin._head, twin._tail, twin.budget = self._head, self._tail, self.budget
        return twin

    def problem(self, capacity: int) -> str | None:
        if len(self._prev) != capacity or len(self._next) != capacity:
            return f"LRU links cover {len(self._prev)}/{len(self._next)} pages, not {capacity}"
        steps, page, before = 0, self._head, -1
        while page != -1:
            steps += 1
            if steps > capacity:
                return "LRU list has a cycle"
            if self._prev[page] != before:
                return f"LRU back link of page {page} is wrong"
            before, page = page, self._next[page]
        if self._tail != before:
            return "LRU tail is wrong"
        return None

    def _unlink(self, page: int) -> None:
        before = self._prev[page]
        after = self._next[page]
        if before == -1:
            self._head = after
        else:
            self._next[before] = after
        if after == -1:
            self._tail = before
        else:
            self._prev[after] = before
