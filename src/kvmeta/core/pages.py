"""A pool's pages: their states, their keys, their read leases and who may have them next.

- ``_state``: one byte per page (FREE/RESERVED/STORED);
- ``_page_key``: page -> key of a RESERVED or STORED page (None when FREE);
- ``_free``: a stack of freed page numbers in a C int array (the last freed is handed out
  first), and ``_unused``: pages ``_unused..num_pages-1`` were never used and are free too, so
  creating a pool costs no per-page work at all;
- read leases: one C double per page (its lease deadline), so granting one is an array store
  and an expired one needs no clean-up;
- ``_cooling``: FREE pages not handed out until a read lease or a release's grace ends;
- withheld pages (``withhold``, a journaled store): FREE pages whose removal is not yet durable,
  kept from the allocator until the store says it is;
- the *frontier*: no page at or above it was ever handed out. It moves up in steps
  (``_FRONTIER_STEP``) ahead of ``_unused``, and each step is reported (``frontier_raised``) so
  a journaled store records it before the reply that hands out a page past the old one;
- pages *held after a restart* (``hold_after_restart``): leases are not journaled, so after a
  restart every FREE page below the frontier may still be written by a writer whose
  reservation, or read by a reader whose read lease, the old process granted. They stay out of
  the allocator for one whole lease (``_held`` until ``_held_until``), and every page is
  read-leased for one read lease, so no STORED page is evicted under a reader either.

The per-page arrays (``_state``, ``_page_key``, ``_read_until`` and the eviction policy's) cover
only the pages below their *capacity*, which grows (doubling, up to ``num_pages``) as the
frontier moves up, never ahead of it by more than the pages already handed out: a pool's memory
is proportional to the pages it ever used, not to ``num_pages`` (an hf3fs file of 1-byte marker
pages may declare 2^40 pages). A page at or above the capacity is FREE and was never handed
out. Page numbers are C ints while they fit (``page_typecode``) and C long longs beyond 2^31.
A capacity that cannot be had (MemoryError) leaves the pool as it is: the reserve evicts or
answers -1, as in a full pool, never an error.
"""

from __future__ import annotations

import heapq
from array import array
from itertools import repeat
from operator import itemgetter
from typing import NoReturn

from kvmeta.core.eviction import EvictionPolicy
from kvmeta.core.reports import ConfirmOutcome
from kvmeta.errors import PageOutOfRange

__all__ = ["FREE", "RESERVED", "STORED", "PageTable", "first_capacity", "page_typecode"]

FREE = 0
RESERVED = 1
STORED = 2

# The frontier moves up by this many pages, or by as many as were handed out before it (up to
# 1/64 of the pool) when that is more: a journaled store records each step, so the step bounds
# how often a reserve waits for that record (a few dozen steps over a pool's life), how many
# never-used pages a crash holds back (``hold_after_restart``: at most as many as were used)
# and, since the per-page arrays reach the frontier, how far memory runs ahead of use.
_FRONTIER_STEP = 1024
# Page numbers below this fit a C int (array typecode "i"); larger pools use "q".
_INT32_PAGES = 1 << 31
_STORED_BYTE = bytes([STORED])


def first_capacity(num_pages: int) -> int:
    """Pages the per-page arrays of a new pool of ``num_pages`` cover once its first page is
    handed out (none before): what creating a pool commits it to."""
    return min(num_pages, 1 + _FRONTIER_STEP)


def page_typecode(num_pages: int) -> str:
    """The array typecode of a pool's page numbers: int32 while they fit (half the memory of
    the eviction links), int64 for pools of more than 2^31 pages."""
    return "i" if num_pages <= _INT32_PAGES else "q"


class PageTable:
    """The page-level half of a ``Pool``: per-page arrays, the allocator and the frontier. Key
    maps, reservations and the operations are the pool's (``core.pool``)."""

    __slots__ = (
        "num_pages",
        "reservation_ttl",
        "read_lease",
        "_policy",
        "_state",
        "_page_key",
        "_read_until",
        "_cooling",
        "_free",
        "_unused",
        "withhold",
        "_withheld",
        "_withheld_new",
        "_frontier",
        "frontier_raised",
        "_held",
        "_held_until",
    )

    def __init__(
        self, num_pages: int, reservation_ttl: float, read_lease: float, policy: EvictionPolicy
    ) -> None:
        self.num_pages = num_pages
        self.reservation_ttl = reservation_ttl
        self.read_lease = read_lease
        self._policy = policy
        typecode = page_typecode(num_pages)
        # Empty until a page is handed out: ``_grow`` extends them (module docstring).
        self._state = bytearray()
        self._page_key: list[str | None] = []
        # Read-lease deadline per page (0.0: never read). An array rather than a dict of live
        # leases: a lease is one C double store, and an expired one needs no clean-up.
        self._read_until = array("d")
        # Pages freed while a reader still holds a lease: FREE, but not handed out until then.
        self._cooling: list[tuple[float, int]] = []
        self._free = array(typecode)
        self._unused = 0  # pages from here on were never used (lowest handed out first)
        # With ``withhold`` set (a journaled store), pages freed by removing a STORED key are
        # FREE but withheld from the allocator until the store says the removal is durable.
        self.withhold = False
        self._withheld = 0  # how many: the pages themselves are listed by whoever holds them
        self._withheld_new: list[int] = []
        self._frontier = 0  # pages from here on were never handed out (module docstring)
        self.frontier_raised = False  # set by a reserve that moved it; the store clears it
        self._held = array(typecode)  # FREE pages held after a restart until ``_held_until``
        self._held_until = 0.0

    # ------------------------------------------------------------------ queries

    def stored_keys_from(self, start: int, limit: int, window: int) -> tuple[list[str], int]:
        """Keys of STORED pages ``start..``, in page order: at most ``limit`` keys from at most
        ``window`` pages, and the page to continue from (``num_pages``: done). A stored key
        never changes page, so a walk by page number returns every key stored throughout it
        exactly once. The pages are searched in C (``bytearray.find``): O(limit) Python steps."""
        state, page_key = self._state, self._page_key
        end = min(self.num_pages, start + window)
        # No page at or past the capacity was ever handed out: a walk reaching it is done.
        done = self.num_pages if end >= len(state) else end
        out: list[str] = []
        page = start
        while len(out) < limit:
            page = state.find(_STORED_BYTE, page, end)
            if page < 0:
                return out, done
            key = page_key[page]
            assert key is not None
            out.append(key)
            page += 1
        return out, page

    def state_of(self, page: int) -> int:
        """FREE, RESERVED or STORED."""
        return self._state[page] if page < len(self._state) else FREE

    def key_at(self, page: int) -> str | None:
        """Key held by a RESERVED or STORED page."""
        return self._page_key[page] if page < len(self._page_key) else None

    @property
    def capacity(self) -> int:
        """Pages the per-page arrays cover (the rest were never handed out): what the pool's
        memory is proportional to."""
        return len(self._state)

    @property
    def cooling_count(self) -> int:
        """FREE pages held back from the allocator until a read lease or the release grace
        ends, or held after a restart: a reserve cannot take them yet. Exact right after
        ``expire(now)``."""
        return len(self._cooling) + len(self._held)

    @property
    def held_count(self) -> int:
        """FREE pages held after a restart (``hold_after_restart``), part of ``cooling_count``."""
        return len(self._held)

    @property
    def held_until(self) -> float:
        """When the pages held after a restart return to the allocator (0.0: none held)."""
        return self._held_until if self._held else 0.0

    @property
    def frontier(self) -> int:
        """Pages from here on were never handed out (``frontier_raised`` says when it moved)."""
        return self._frontier

    @property
    def allocatable_count(self) -> int:
        """FREE pages a reserve can take without evicting (not withheld, not cooling)."""
        return len(self._free) + self.num_pages - self._unused

    @property
    def withheld_count(self) -> int:
        return self._withheld

    # ------------------------------------------------------------------ restarts, growth

    def hold_after_restart(self, now: float) -> int:
        """A recovered pool: keep what the old process may have leased from being reused.

        Leases are not journaled, so every FREE page below the frontier may be reserved by a
        writer still writing it, or read-leased by a reader still reading it: those pages stay
        out of the allocator for one reservation lease (and at least one read lease), and every
        page is read-leased for one read lease, so no STORED page is evicted under a reader.
        Pages past the frontier were never handed out and stay available. Returns how many
        pages are held. O(pool), once at start-up.
        """
        self._held, self._free = self._free, array(self._free.typecode)
        self._held_until = now + max(self.reservation_ttl, self.read_lease)
        if self.read_lease > 0:
            # Pages past the capacity were never handed out, so never read: no lease needed.
            self._read_until = array("d", [now + self.read_lease]) * len(self._read_until)
        return len(self._held)

    def _raise_frontier(self, page: int) -> bool:
        """``page`` is the first past the frontier to be handed out: move the frontier a step
        and the per-page arrays with it. False: that memory cannot be had (nothing changed)."""
        step = max(_FRONTIER_STEP, min(self.num_pages >> 6, page))
        frontier = min(self.num_pages, page + 1 + step)
        try:
            self._grow(frontier)
        except MemoryError:
            try:
                self._grow(page + 1)
            except MemoryError:
                return False
            frontier = page + 1
        self._frontier = frontier
        self.frontier_raised = True
        return True

    def _grow(self, need: int) -> None:
        """Extend the per-page arrays to cover pages ``0..need-1`` (doubling, so the copies are
        amortised O(1) per page); the new pages are FREE, keyless and unread.

        Raises:
            MemoryError: the memory cannot be had; the arrays are left as they were.
        """
        cap = len(self._state)
        if need <= cap:
            return
        new = min(self.num_pages, max(need, 2 * cap))
        add = new - cap
        self._policy.resize(new)  # leaves itself as it was on MemoryError
        arrays = (self._state, self._page_key, self._read_until)
        try:
            self._read_until.frombytes(bytes(8 * add))
            self._page_key.extend(repeat(None, add))
            self._state.extend(bytes(add))
        except MemoryError:
            for arr in arrays:
                del arr[cap:]
            self._policy.resize(cap)
            raise

    # ------------------------------------------------------------------ freeing pages

    def _removed_page(self, page: int, now: float) -> None:
        """A page whose STORED key was just removed (delete, clear): withheld or freed."""
        if self.withhold:
            self._withheld += 1
            self._withheld_new.append(page)
        else:
            self._free_page(page, now)

    def _free_page(self, page: int, now: float) -> None:
        """Return a page (already marked FREE) to the allocator, after any live read lease."""
        until = self._read_until[page]
        if until > now:
            heapq.heappush(self._cooling, (until, page))
        else:
            self._free.append(page)

    def collect_withheld(self) -> list[int]:
        """Pages withheld since the last call: the store tags them with the journal position
        of their removal and releases them once it is durable."""
        pages, self._withheld_new = self._withheld_new, []
        return pages

    def release_withheld(self, pages: list[int], now: float) -> None:
        """The removals that freed ``pages`` (a list ``collect_withheld`` returned, handed back
        exactly once) are durable: hand the pages to the allocator."""
        self._withheld -= len(pages)
        read_until = self._read_until
        # A deleted page may still be read-leased: it cools first (evicted ones never are).
        reading = [p for p in pages if read_until[p] > now]
        if reading:
            for page in reading:
                heapq.heappush(self._cooling, (read_until[page], page))
            pages = [p for p in pages if read_until[p] <= now]
        self._free.extend(pages)

    # ------------------------------------------------------------------ page-range checks

    def _check_pages(self, pairs: list[tuple[str, int]], release: list[int]) -> int:
        """Raises for a page outside the pool; returns the highest page named (-1: none)."""
        n = self.num_pages
        pages = list(map(itemgetter(1), pairs))
        pages += release
        if not pages:
            return -1
        top: int = max(pages)
        if min(pages) >= 0 and top < n:
            return top  # the common case, checked in C; the loops below name the culprit
        for _key, page in pairs:
            if not 0 <= page < n:
                _page_out_of_range(page, n, in_release=False)
        for page in release:
            if not 0 <= page < n:
                _page_out_of_range(page, n, in_release=True)
        raise AssertionError("unreachable: a page out of range was not found")  # pragma: no cover

    def _drop_never_used(
        self, pairs: list[tuple[str, int]], release: list[int], outcome: ConfirmOutcome
    ) -> tuple[list[tuple[str, int]], list[int]]:
        """A confirm naming pages past the capacity (never handed out, so FREE): their pairs
        are refused and their releases ignored, as for any FREE page, without growing the
        arrays to reach them."""
        cap = len(self._state)
        outcome.refused.extend(pair for pair in pairs if pair[1] >= cap)
        return [p for p in pairs if p[1] < cap], [page for page in release if page < cap]


def _page_out_of_range(page: int, num_pages: int, in_release: bool) -> NoReturn:
    """The refusal of a confirm naming a page this pool does not have (nothing was changed),
    in SGLang's field names: the service words it for its caller (``PageOutOfRange``)."""
    raise PageOutOfRange(page, num_pages, in_release=in_release)
