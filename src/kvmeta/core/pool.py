"""One pool of pages: the state machine every dialect and backend agrees on.

A page is FREE, RESERVED (handed to writers of one key, with a lease) or STORED (holds the
confirmed bytes of one key). The structures are chosen so that every operation costs
O(size of the request), never O(pool), and a stored key costs about 200 bytes:

- ``_state``: one byte per page (FREE/RESERVED/STORED);
- ``_page_key``: page -> key of a RESERVED or STORED page (None when FREE);
- ``_stored`` / ``_reserved``: key -> page, one dict per state, so a key is in at most one;
- ``_free``: a stack of freed page numbers in a C int array (the last freed is handed out
  first), and ``_unused``: pages ``_unused..num_pages-1`` were never used and are free too, so
  creating a pool costs no per-page work at all;
- LRU of STORED pages: an intrusive doubly linked list over page numbers in two C int arrays,
  so a touch is a handful of array writes and no per-key objects exist;
- reservation leases: a small dict of the RESERVED pages' deadlines, plus a queue in deadline
  order so expiry is amortised O(1). Leases all have the same length, so the order in which
  they are granted is their deadline order and a deque suffices. One queue entry holds every
  page one call leased, ``(deadline, [page, ...])``: a tuple and a float per key would cost
  ~80 bytes per key for as long as the lease lasts, more than the key's own structures. An
  entry outlives the leases it holds once they are confirmed (a lease usually ends long before
  its deadline), so when the queue holds more than twice the live leases (plus
  ``_QUEUE_SLACK``) it is compacted to the live ones: memory stays O(live leases), where it
  was O(reserve rate x TTL) (a server under the batch-64 cycle grew 3.5 MB/s, about 1 GB over
  the default 300 s TTL), and the compaction is amortised O(1) per lease;
- ``_holders``: writers of a RESERVED page beyond the first (absent: one writer), so the
  common single-writer reservation costs no entry; a joined page is never freed by a release;
- read leases: one C double per page (its lease deadline), so granting one is an array store
  and an expired one needs no clean-up;
- the *frontier*: no page at or above it was ever handed out. It moves up in steps
  (``_FRONTIER_STEP``) ahead of ``_unused``, and each step is reported (``frontier_raised``) so
  a journaled store records it before the reply that hands out a page past the old one;
- pages *held after a restart* (``hold_after_restart``): leases are not journaled, so after a
  restart every FREE page below the frontier may still be written by a writer whose
  reservation, or read by a reader whose read lease, the old process granted. They stay out of
  the allocator for one whole lease (``_held`` until ``_held_until``), and every page is
  read-leased for one read lease, so no STORED page is evicted under a reader either.

LRU link updates are written inline (instead of calling ``_unlink``/``_link_tail``) only in the
per-key loops of ``get`` and ``confirm`` and in the head eviction of ``reserve`` and
``evict_ahead``, which run once per key of every request; replacing them with the helper calls
measured 2-7 % slower per 64-key call (``kvmeta bench core``). Everywhere else the helpers are
used.

The per-page arrays (``_state``, ``_page_key``, ``_read_until``, ``_prev``, ``_next``) cover
only the pages below their *capacity*, which grows (doubling, up to ``num_pages``) as the
frontier moves up, never ahead of it by more than the pages already handed out: a pool's memory
is proportional to the pages it ever used, not to ``num_pages`` (an hf3fs file of 1-byte marker
pages may declare 2^40 pages). A page at or above the capacity is FREE and was never handed
out. Page numbers are C ints while they fit (``page_typecode``) and C long longs beyond 2^31.
A capacity that cannot be had (MemoryError) leaves the pool as it is: the reserve evicts or
answers -1, as in a full pool, never an error.

Time is always passed in (``now``, seconds, monotonic), so the model has no clock and no I/O.
Durable changes (commits and removals of STORED keys) are returned to the caller, which journals
them; see ``store``.
"""

from __future__ import annotations

import heapq
from array import array
from collections import deque
from collections.abc import Container, Hashable, Iterable
from dataclasses import dataclass, field
from itertools import compress, repeat
from operator import itemgetter

from kvmeta.errors import InvalidRequest, PageOutOfRange

__all__ = [
    "FREE",
    "RESERVED",
    "RELEASE_GRACE",
    "STORED",
    "ConfirmOutcome",
    "Pool",
    "PoolCounters",
    "first_capacity",
    "leading_in",
    "lru_order",
    "page_typecode",
]

FREE = 0
RESERVED = 1
STORED = 2

# How many read-leased pages one reserve call may step over while looking for a page to evict:
# a fixed allowance plus two per requested key. Leased pages found at the cold end are moved to
# the warm end (they were just read), so a normal scan inspects one or two pages. When the pool
# turns over faster than the read lease, almost every page is leased; the allowance keeps such a
# call O(request) (it answers -1 for keys it found no page for, as when nothing is evictable)
# instead of O(pool), and the next call starts past the pages this one moved.
_SCAN_ALLOWANCE = 64
# Dead pages the lease queue may hold beyond twice the live leases before it is compacted
# (the module docstring): a small pool's queue is never compacted for a handful of leases.
_QUEUE_SLACK = 4096
# Seconds a page released by a writer stays out of the allocator (see ``Pool.confirm``): longer
# than the engines' clients spend retrying a request (three retries within about 2 s).
RELEASE_GRACE = 10.0
# The frontier moves up by this many pages, or by as many as were handed out before it (up to
# 1/64 of the pool) when that is more: a journaled store records each step, so the step bounds
# how often a reserve waits for that record (a few dozen steps over a pool's life), how many
# never-used pages a crash holds back (``hold_after_restart``: at most as many as were used)
# and, since the per-page arrays reach the frontier, how far memory runs ahead of use.
_FRONTIER_STEP = 1024
# Page numbers below this fit a C int (array typecode "i"); larger pools use "q".
_INT32_PAGES = 1 << 31
# bytes.translate table: FREE -> 1, any other state -> 0.
_FREE_MASK = bytes([1] + [0] * 255)
_STORED_BYTE = bytes([STORED])


def first_capacity(num_pages: int) -> int:
    """Pages the per-page arrays of a new pool of ``num_pages`` cover once its first page is
    handed out (none before): what creating a pool commits it to."""
    return min(num_pages, 1 + _FRONTIER_STEP)


def page_typecode(num_pages: int) -> str:
    """The array typecode of a pool's page numbers: int32 while they fit (half the memory of
    the LRU links), int64 for pools of more than 2^31 pages."""
    return "i" if num_pages <= _INT32_PAGES else "q"


@dataclass
class PoolCounters:
    """Monotonic event counts for stats and metrics (never reset by ``clear``)."""

    exists_hits: int = 0
    exists_misses: int = 0
    get_hits: int = 0
    get_misses: int = 0
    reservations: int = 0
    reservations_refused: int = 0
    reservations_expired: int = 0
    reserve_hits: int = 0
    commits: int = 0
    confirms_refused: int = 0
    releases: int = 0
    evictions: int = 0
    deletes: int = 0
    clears: int = 0


@dataclass
class ConfirmOutcome:
    """What a confirm did: ``committed`` pairs must be journaled; refusals are only counted."""

    committed: list[tuple[str, int]] = field(default_factory=list)
    refused: list[tuple[str, int]] = field(default_factory=list)
    released: int = 0


class Pool:
    """Pages ``0..num_pages-1`` of one backing file and the keys they hold."""

    __slots__ = (
        "num_pages",
        "reservation_ttl",
        "read_lease",
        "counters",
        "_state",
        "_page_key",
        "_stored",
        "_reserved",
        "_holders",
        "_res_deadline",
        "_res_queue",
        "_queued",
        "_read_until",
        "_cooling",
        "_free",
        "_unused",
        "_prev",
        "_next",
        "_head",
        "_tail",
        "_scan_left",
        "withhold",
        "_withheld",
        "_withheld_new",
        "_frontier",
        "frontier_raised",
        "_held",
        "_held_until",
    )

    def __init__(self, num_pages: int, *, reservation_ttl: float = 300.0, read_lease: float = 5.0):
        if num_pages <= 0:
            raise InvalidRequest(
                f"num_pages must be a positive integer, got {num_pages}", "num_pages"
            )
        self.num_pages = num_pages
        self.reservation_ttl = reservation_ttl
        self.read_lease = read_lease
        self.counters = PoolCounters()
        typecode = page_typecode(num_pages)
        # Empty until a page is handed out: ``_grow`` extends them (module docstring).
        self._state = bytearray()
        self._page_key: list[str | None] = []
        self._stored: dict[str, int] = {}
        self._reserved: dict[str, int] = {}
        self._holders: dict[int, int] = {}  # RESERVED page -> writers, when more than one
        self._res_deadline: dict[int, float] = {}
        self._res_queue: deque[tuple[float, list[int]]] = deque()
        self._queued = 0  # pages in the queue's entries, live or not
        # Read-lease deadline per page (0.0: never read). An array rather than a dict of live
        # leases: a lease is one C double store, and an expired one needs no clean-up.
        self._read_until = array("d")
        # Pages freed while a reader still holds a lease: FREE, but not handed out until then.
        self._cooling: list[tuple[float, int]] = []
        self._free = array(typecode)
        self._unused = 0  # pages from here on were never used (lowest handed out first)
        self._prev = array(typecode)
        self._next = array(typecode)
        self._head = -1
        self._scan_left = 0
        # With ``withhold`` set (a journaled store), pages freed by removing a STORED key are
        # FREE but withheld from the allocator until the store says the removal is durable.
        self.withhold = False
        self._withheld = 0  # how many: the pages themselves are listed by whoever holds them
        self._withheld_new: list[int] = []
        self._tail = -1
        self._frontier = 0  # pages from here on were never handed out (module docstring)
        self.frontier_raised = False  # set by a reserve that moved it; the store clears it
        self._held = array(typecode)  # FREE pages held after a restart until ``_held_until``
        self._held_until = 0.0

    # ------------------------------------------------------------------ loading

    @classmethod
    def load(
        cls,
        num_pages: int,
        entries: list[tuple[str, int]],
        *,
        reservation_ttl: float = 300.0,
        read_lease: float = 5.0,
    ) -> Pool:
        """A pool whose STORED keys are ``entries``, given coldest first (recovery, import).

        Raises:
            InvalidRequest: a page is out of range or named twice, or a key appears twice.
        """
        pages: set[int] = set()
        stored: dict[str, int] = {}
        for key, page in entries:
            if not 0 <= page < num_pages:
                raise InvalidRequest(f"page {page} of key {key!r} is outside 0..{num_pages - 1}")
            if page in pages or key in stored:
                raise InvalidRequest(f"page {page} or key {key!r} appears twice")
            pages.add(page)
            stored[key] = page
        # No frontier is known: any page may have been handed out (``from_lru``).
        return cls.from_lru(
            num_pages, stored, reservation_ttl=reservation_ttl, read_lease=read_lease
        )

    # ------------------------------------------------------------------ queries

    def exists(self, keys: list[str]) -> list[bool]:
        """Whether each key is STORED; does not count as a use."""
        stored = self._stored
        out = [k in stored for k in keys]
        hits = sum(out)
        self.counters.exists_hits += hits
        self.counters.exists_misses += len(out) - hits
        return out

    def stored_among(self, keys: list[str]) -> list[str]:
        """The STORED keys of ``keys``, in order: one step of vLLM's completeness walk, which
        asks each rank only about the keys every rank before it had. Counts as ``exists``
        (hits and misses) for each key asked; does not count as a use."""
        out = list(filter(self._stored.__contains__, keys))
        counters = self.counters
        counters.exists_hits += len(out)
        counters.exists_misses += len(keys) - len(out)
        return out

    def get(self, keys: list[str], now: float) -> list[int | None]:
        """Page of each STORED key (else None); a use for LRU, and a read lease on the page."""
        self._expire(now)
        stored = self._stored
        lease = self.read_lease
        out: list[int | None] = []
        append = out.append
        hits = 0
        leased: list[int] = []
        prev, nxt = self._prev, self._next
        tail = self._tail
        for key in keys:
            page = stored.get(key)
            append(page)
            if page is None:
                continue
            hits += 1
            if page != tail:
                # _unlink + _link_tail, inlined (once per key). page is not the tail, so it
                # has a successor, and the list is not empty.
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
            if lease > 0:
                leased.append(page)
        self._tail = tail
        if leased:
            until = now + lease
            read_until = self._read_until
            for page in leased:
                read_until[page] = until
        self.counters.get_hits += hits
        self.counters.get_misses += len(keys) - hits
        return out

    def leading_stored(self, keys: list[str]) -> int:
        """How many of ``keys``, from the first, are STORED (stops at the first miss). A pure
        read for routers: no LRU touch, no counter, no lease."""
        return leading_in(keys, self._stored)

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

    def page_of(self, key: str) -> int | None:
        """Page of a STORED key without touching anything (stats, tests)."""
        return self._stored.get(key)

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
    def stored_count(self) -> int:
        return len(self._stored)

    @property
    def reserved_count(self) -> int:
        return len(self._reserved)

    @property
    def free_count(self) -> int:
        """FREE pages a reserve can take now: cooling ones are not counted (``PoolStats.free``
        means the same). Exact right after ``expire(now)``."""
        return self.num_pages - len(self._stored) - len(self._reserved) - self.cooling_count

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

    def in_use_until(self, now: float) -> float:
        """When the last lease on this pool's pages ends: a reservation, a read lease, a
        released page's grace or a hold after a restart (``now`` or earlier: none is live).
        The read leases cost one pass over a C array of a double per page ever used
        (about 17 ms per million pages): for rare operator actions such as removing a vLLM
        rank, never for requests."""
        self._expire(now)
        until = max(self._res_deadline.values(), default=now)
        if self._cooling:
            until = max(until, max(end for end, _ in self._cooling))
        if self._held:
            until = max(until, self._held_until)
        return max(until, max(self._read_until, default=now))

    def stored_keys(self) -> list[str]:
        """STORED keys in no particular order. O(stored), at C speed."""
        return list(self._stored)

    def stored_items(self) -> list[tuple[str, int]]:
        """STORED (key, page) pairs, coldest first. O(stored)."""
        keys, pages = lru_order(self._page_key, self._next, self._head)
        return list(zip(keys, pages, strict=True))

    def lru_copy(self) -> tuple[list[str | None], array[int], int]:
        """Copies of the page->key table, the LRU next-links and the LRU head.

        Two memcpy-speed copies (milliseconds at 10^6 pages), so a snapshot can take them on
        the event loop and walk them (``lru_order``) in a thread while the pool keeps changing.
        """
        return self._page_key[:], self._next[:], self._head

    @classmethod
    def from_lru(
        cls,
        num_pages: int,
        stored: dict[str, int],
        *,
        reservation_ttl: float = 300.0,
        read_lease: float = 5.0,
        frontier: int | None = None,
    ) -> Pool:
        """``load`` in bulk: the same pool from a key -> page dict in LRU order (coldest first),
        with set-based checks and tight loops, because recovery loads 10^6 keys at start-up.
        The pool takes ``stored`` over; the caller must not use it afterwards. ``frontier``:
        pages from there on were never handed out (None: any page may have been).

        Raises:
            InvalidRequest: as ``load`` (bad input is handed to ``load`` for its exact message).
        """
        pool = cls(num_pages, reservation_ttl=reservation_ttl, read_lease=read_lease)
        pages = list(stored.values())
        if pages and (min(pages) < 0 or max(pages) >= num_pages or len(set(pages)) != len(pages)):
            return cls.load(
                num_pages,
                list(stored.items()),
                reservation_ttl=reservation_ttl,
                read_lease=read_lease,
            )
        # Past the frontier nothing was handed out; a stored page beyond it (a journal written
        # before frontiers were recorded) moves it up.
        top = (
            num_pages
            if frontier is None
            else min(num_pages, max(frontier, max(pages) + 1 if pages else 0))
        )
        pool._unused = pool._frontier = top
        pool._grow(top)
        typecode = pool._free.typecode
        if not stored:
            pool._free = array(typecode, range(top - 1, -1, -1))
            return pool
        page_key, state, nxt, prev = pool._page_key, pool._state, pool._next, pool._prev
        for key, page in stored.items():
            page_key[page] = key
            state[page] = STORED
        prev[pages[0]] = -1
        for before, after in zip(pages, pages[1:]):  # noqa: B905 - one shorter on purpose
            nxt[before] = after
            prev[after] = before
        nxt[pages[-1]] = -1
        pool._head, pool._tail = pages[0], pages[-1]
        pool._stored = stored
        # FREE pages below the frontier, highest first (the stack pops the lowest), in C.
        free_mask = state[top - 1 :: -1].translate(_FREE_MASK) if top else b""
        pool._free = array(typecode, compress(range(top - 1, -1, -1), free_mask))
        return pool

    # ------------------------------------------------------------------ mutations

    def reserve(
        self,
        keys: list[str],
        now: float,
        evicted: list[tuple[str, int]],
        whole: bool = False,
    ) -> list[tuple[bool, int]]:
        """Per key: ``(True, page)`` if STORED, ``(False, page)`` to write, ``(False, -1)`` if none.

        A key already RESERVED (by another writer, a retry or earlier in this batch) gets the
        same page back and its lease renewed. STORED keys evicted to make room are appended to
        ``evicted``; the caller must make their removal durable before replying.

        ``whole`` (vLLM's batches): the new keys get a page each or none does. vLLM's connector
        gives up a whole batch when one key gets -1 and never releases the pages the others
        got, so a partial grant only strands pages until their lease ends. When the pages are
        not there (``fits``), every key but the STORED ones answers -1 and nothing changes: no
        reservation, no eviction, no LRU touch, no joined lease.
        """
        self._expire(now)
        if whole and not self.fits(keys, now):
            return self._refuse_batch(keys)
        stored, reserved, state, page_key = (
            self._stored,
            self._reserved,
            self._state,
            self._page_key,
        )
        holders, res_deadline, res_queue = self._holders, self._res_deadline, self._res_queue
        reserved_before = len(reserved)
        read_until = self._read_until
        prev, nxt = self._prev, self._next
        evictions = 0
        deadline = now + self.reservation_ttl
        counters = self.counters
        out: list[tuple[bool, int]] = []
        append = out.append
        free = self._free
        leased: list[int] = []  # pages whose lease this call grants or renews
        seen: set[str] = set()  # keys this call reserved or joined: one holder per call
        hits: set[int] = set()  # pages reported as stored by this call: never evicted by it
        refused = 0
        self._scan_left = _SCAN_ALLOWANCE + 2 * len(keys)
        for key in keys:
            page = stored.get(key)
            if page is not None:
                hits.add(page)
                counters.reserve_hits += 1
                if page != self._tail:
                    self._unlink(page)
                    self._link_tail(page)
                append((True, page))
                continue
            page = reserved.get(key)
            if page is not None:
                if key not in seen:
                    # Another writer (or a retry) joins: one more holder, lease renewed.
                    seen.add(key)
                    holders[page] = holders.get(page, 1) + 1
                    res_deadline[page] = deadline
                    leased.append(page)
                append((False, page))
                continue
            if free:
                page = free.pop()
            elif self._unused < self.num_pages and (
                self._unused < self._frontier or self._raise_frontier(self._unused)
            ):
                page = self._unused
                self._unused = page + 1
            else:
                page = self._head
                if page != -1 and page not in hits and read_until[page] <= now:
                    # The common eviction, inlined: the coldest page is not being read.
                    old = page_key[page]
                    assert old is not None
                    del stored[old]
                    after = nxt[page]  # _unlink of the head, inlined
                    self._head = after
                    if after == -1:
                        self._tail = -1
                    else:
                        prev[after] = -1
                    evicted.append((old, page))
                    evictions += 1
                else:
                    page = self._evict_one(now, evicted, hits)
                    if page >= 0:
                        evictions += 1
            if page < 0:
                refused += 1
                append((False, -1))
                continue
            state[page] = RESERVED
            page_key[page] = key
            reserved[key] = page
            res_deadline[page] = deadline
            leased.append(page)
            seen.add(key)
            append((False, page))
        if leased:
            res_queue.append((deadline, leased))
            self._queued += len(leased)
            if self._queued > 2 * len(res_deadline) + _QUEUE_SLACK:
                self._compact_queue()
        counters.reservations += len(reserved) - reserved_before
        counters.reservations_refused += refused
        counters.evictions += evictions
        return out

    def fits(self, keys: list[str], now: float) -> bool:
        """Whether a reserve of ``keys`` at ``now`` (leases expired) gets every new key a page.

        Counts the allocatable pages, then walks the LRU from its cold end for evictable ones
        (not read-leased, not STORED for a key of this batch) within the scan allowance a
        reserve has, each page looked at using one step of it. A reserve spends no more steps
        than that walk (its common eviction spends none) and finds its pages in the same
        order, so whenever this answers True the reserve places every key. O(request).
        """
        free = self.allocatable_count
        if free >= len(keys):  # the common case, in O(1)
            return True
        short = self.new_keys(keys) - free
        if short <= 0:
            return True
        stored, read_until, nxt = self._stored, self._read_until, self._next
        batch = {page for key in keys if (page := stored.get(key)) is not None}
        steps = _SCAN_ALLOWANCE + 2 * len(keys)
        page = self._head
        while page != -1 and steps > 0:
            steps -= 1
            if page not in batch and read_until[page] <= now:
                short -= 1
                if short == 0:
                    return True
            page = nxt[page]
        return False

    def _refuse_batch(self, keys: list[str]) -> list[tuple[bool, int]]:
        """The answer to a whole batch that does not fit: STORED keys keep their pages (the
        engine may write them again: a confirm of a STORED key succeeds), every other key -1."""
        stored = self._stored
        out = [
            (True, page) if (page := stored.get(key)) is not None else (False, -1) for key in keys
        ]
        self.counters.reservations_refused += sum(1 for hit, _ in out if not hit)
        return out

    def confirm(
        self, pairs: list[tuple[str, int]], release: list[int], now: float
    ) -> ConfirmOutcome:
        """Commit written pages, give back pages whose write failed.

        A pair commits only if its page is RESERVED for its key; one already STORED for its key
        is an idempotent success; anything else is refused and changes nothing. A released page
        returns to FREE only when it is RESERVED by a single writer (a page several writers
        joined waits for a confirm or its lease), and is handed out again only after
        ``RELEASE_GRACE``; releasing a STORED or FREE page is ignored.

        Raises:
            PageOutOfRange: a page is outside ``0..num_pages-1`` (nothing is changed).
        """
        top = self._check_pages(pairs, release)
        self._expire(now)
        outcome = ConfirmOutcome()
        if top >= len(self._state):
            pairs, release = self._drop_never_used(pairs, release, outcome)
        state, page_key, stored, reserved = (
            self._state,
            self._page_key,
            self._stored,
            self._reserved,
        )
        committed = outcome.committed
        holders, res_deadline = self._holders, self._res_deadline
        prev, nxt = self._prev, self._next
        for key, page in pairs:
            st = state[page]
            held = page_key[page]
            if st == RESERVED and held == key:
                # From here on the reserve's string object stands for the key (the page's, the
                # stored map's and the change's), so the pool keeps one copy of each key, not
                # two, and a later eviction names the very objects the confirm reported.
                key = held
                del reserved[key]
                deadline = res_deadline.pop(page)
                if holders and holders.pop(page, None) is not None:
                    # Other writers joined this page and may still be writing (the same
                    # bytes): keep it from eviction and reuse until their lease ends, as if
                    # it were being read, so no late write lands on the next key's page.
                    read_until = self._read_until
                    if read_until[page] < deadline:
                        read_until[page] = deadline
                state[page] = STORED
                stored[key] = page
                # _link_tail, inlined: this loop runs once per written page.
                tail = self._tail
                prev[page] = tail
                nxt[page] = -1
                if tail == -1:
                    self._head = page
                else:
                    nxt[tail] = page
                self._tail = page
                committed.append((key, page))
            elif st == STORED and held == key:
                continue
            else:
                outcome.refused.append((key, page))
        # A page named twice in one call is released once (dict.fromkeys keeps the order).
        for page in dict.fromkeys(release) if len(release) > 1 else release:
            if state[page] != RESERVED or page in holders:
                # A page several writers joined (or one writer's retried reserve) is left to a
                # confirm or its lease: a release carries no writer identity, so counting
                # releases down would let one writer's retried release free a page another
                # writer is still filling.
                continue
            held = page_key[page]
            assert held is not None
            del reserved[held]
            self._drop_reservation(page)
            # Cools for RELEASE_GRACE before reuse: a retried copy of this request (the
            # engines' clients resend POSTs) then finds the page FREE and changes nothing,
            # instead of freeing the next writer's reservation of it.
            until = max(now + RELEASE_GRACE, self._read_until[page])
            heapq.heappush(self._cooling, (until, page))
            outcome.released += 1
        self.counters.commits += len(outcome.committed)
        self.counters.confirms_refused += len(outcome.refused)
        self.counters.releases += outcome.released
        return outcome

    def delete(self, keys: list[str], now: float) -> list[tuple[str, int]]:
        """STORED keys become FREE; returns the removed (key, page) pairs to journal."""
        self._expire(now)
        stored = self._stored
        removed: list[tuple[str, int]] = []
        for key in keys:
            page = stored.pop(key, None)
            if page is None:
                continue
            self._unlink(page)
            self._page_key[page] = None
            self._state[page] = FREE
            self._removed_page(page, now)
            removed.append((key, page))
        self.counters.deletes += len(removed)
        return removed

    def clear(self, now: float) -> int:
        """Every STORED page becomes FREE; reservations in flight are left alone. O(stored)."""
        self._expire(now)
        count = len(self._stored)
        for page in self._stored.values():
            self._page_key[page] = None
            self._state[page] = FREE
            self._removed_page(page, now)
        self._stored = {}
        self._head = self._tail = -1
        self.counters.clears += 1
        return count

    def expire(self, now: float) -> None:
        """Apply lease expiry up to ``now`` (every operation does this first)."""
        self._expire(now)

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
        arrays = (self._state, self._page_key, self._read_until, self._prev, self._next)
        try:
            self._prev.frombytes(bytes(self._prev.itemsize * add))
            self._next.frombytes(bytes(self._next.itemsize * add))
            self._read_until.frombytes(bytes(8 * add))
            self._page_key.extend(repeat(None, add))
            self._state.extend(bytes(add))
        except MemoryError:
            for arr in arrays:
                del arr[cap:]
            raise

    # ------------------------------------------------------------------ withheld pages

    @property
    def allocatable_count(self) -> int:
        """FREE pages a reserve can take without evicting (not withheld, not cooling)."""
        return len(self._free) + self.num_pages - self._unused

    @property
    def withheld_count(self) -> int:
        return self._withheld

    def evict_ahead(self, count: int, now: float) -> list[tuple[str, int]]:
        """Evict up to ``count`` coldest evictable STORED pages into the withheld set.

        A journaled store calls this when few free pages are left, so that a reserve finds a
        page whose old key's removal is already durable and need not wait for the disk.
        Returns the removed (key, page) pairs to journal. Needs ``withhold``.
        """
        self._expire(now)
        self._scan_left = _SCAN_ALLOWANCE + 2 * count
        removed: list[tuple[str, int]] = []
        read_until, stored, page_key, state = (
            self._read_until,
            self._stored,
            self._page_key,
            self._state,
        )
        prev, nxt = self._prev, self._next
        keep: set[int] = set()
        for _ in range(count):
            page = self._head
            if page != -1 and read_until[page] <= now:
                # The common case, inlined: the coldest page is not being read.
                key = page_key[page]
                assert key is not None
                del stored[key]
                after = nxt[page]
                self._head = after
                if after == -1:
                    self._tail = -1
                else:
                    prev[after] = -1
                page_key[page] = None
                state[page] = FREE
                removed.append((key, page))
            else:
                page = self._evict_one(now, removed, keep)
                if page < 0:
                    break
        self._withheld += len(removed)
        self._withheld_new.extend(map(itemgetter(1), removed))
        self.counters.evictions += len(removed)
        return removed

    def new_keys(self, keys: list[str]) -> int:
        """How many distinct keys are neither STORED nor RESERVED (a reserve needs a page each)."""
        stored, reserved = self._stored, self._reserved
        return len({k for k in keys if k not in stored and k not in reserved})

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

    # ------------------------------------------------------------------ internals

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
                raise PageOutOfRange(page, n, in_release=False)
        for page in release:
            if not 0 <= page < n:
                raise PageOutOfRange(page, n, in_release=True)
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

    def _evict_one(self, now: float, evicted: list[tuple[str, int]], keep: set[int]) -> int:
        """Remove the coldest STORED page not under a read lease and not in ``keep``; -1 if
        none within this call's scan allowance. The page is left FREE, outside the allocator.

        Every page looked at is the head: a read-leased one is moved to the tail (inlined:
        when the pool turns over faster than the lease, this loop runs for every step of the
        allowance)."""
        read_until, nxt, prev = self._read_until, self._next, self._prev
        steps = min(len(self._stored), self._scan_left)
        taken = 0
        page = self._head
        while taken < steps:
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
                page = after
                continue
            self._scan_left -= taken
            key = self._page_key[page]
            assert key is not None
            del self._stored[key]
            self._unlink(page)
            self._page_key[page] = None
            self._state[page] = FREE
            evicted.append((key, page))
            return page
        self._scan_left -= taken
        return -1

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

    def _drop_reservation(self, page: int) -> None:
        self._holders.pop(page, None)
        del self._res_deadline[page]
        self._page_key[page] = None
        self._state[page] = FREE

    def _compact_queue(self) -> None:
        """Keep only the leases still live in the queue, each once: a page whose deadline is
        its entry's (confirmed, released or expired pages have none; a renewed one is in a
        later entry, or in several with the same deadline when calls share a ``now``)."""
        deadlines = self._res_deadline
        leased = deadlines.keys()
        kept: deque[tuple[float, list[int]]] = deque()
        seen: set[int] = set()
        queued = 0
        for deadline, pages in self._res_queue:
            if leased.isdisjoint(pages):  # all gone (the usual entry): one pass in C
                continue
            live = []
            for page in pages:
                if page not in seen and deadlines.get(page) == deadline:
                    seen.add(page)
                    live.append(page)
            if live:
                kept.append((deadline, live))
                queued += len(live)
        self._res_queue = kept
        self._queued = queued

    def _expire(self, now: float) -> None:
        queue = self._res_queue
        if queue and queue[0][0] <= now:
            deadlines = self._res_deadline
            while queue and queue[0][0] <= now:
                pages = queue.popleft()[1]
                self._queued -= len(pages)
                for page in pages:
                    current = deadlines.get(page)
                    if current is None or current > now:
                        continue  # confirmed, released, or renewed since
                    key = self._page_key[page]
                    assert key is not None
                    del self._reserved[key]
                    self._drop_reservation(page)
                    self._free_page(page, now)
                    self.counters.reservations_expired += 1
        cooling = self._cooling
        while cooling and cooling[0][0] <= now:
            _, page = heapq.heappop(cooling)
            self._free.append(page)
        if self._held and self._held_until <= now:
            self._free.extend(self._held)
            self._held = array(self._free.typecode)

    def _link_tail(self, page: int) -> None:
        tail = self._tail
        self._prev[page] = tail
        self._next[page] = -1
        if tail == -1:
            self._head = page
        else:
            self._next[tail] = page
        self._tail = page

    def _unlink(self, page: int) -> None:
        prev = self._prev[page]
        nxt = self._next[page]
        if prev == -1:
            self._head = nxt
        else:
            self._next[prev] = nxt
        if nxt == -1:
            self._tail = prev
        else:
            self._prev[nxt] = prev


def leading_in(items: Iterable[Hashable], container: Container[Hashable]) -> int:
    """How many of ``items``, from the first, are in ``container`` (stops at the first miss):
    a router's prefix match, by keys or by block hashes."""
    n = 0
    for item in items:
        if item not in container:
            break
        n += 1
    return n


def lru_order(
    page_key: list[str | None], nxt: array[int], head: int
) -> tuple[list[str], array[int]]:
    """STORED keys and their pages, coldest first, from the copies ``Pool.lru_copy`` returns."""
    keys: list[str] = []
    pages = array(nxt.typecode)
    add_key, add_page = keys.append, pages.append
    page = head
    while page != -1:
        key = page_key[page]
        assert key is not None
        add_key(key)
        add_page(page)
        page = nxt[page]
    return keys, pages
