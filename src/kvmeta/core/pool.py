"""One pool of pages: the state machine every dialect and backend agrees on.

A page is FREE, RESERVED (handed to writers of one key, with a lease) or STORED (holds the
confirmed bytes of one key). The structures are chosen so that every operation costs
O(size of the request), never O(pool), and a stored key costs about 200 bytes. The pages
themselves (states, keys, read leases, the allocator, the frontier, sparse growth) are
``core.pages``; the order in which STORED pages are evicted is a policy's (``core.eviction``,
LRU by default: ``core.lru``). Here:

- ``_stored``: key -> page of the STORED pages; the RESERVED ones, their writers and their
  leases are ``core.leases``'s, so a key is in at most one of the two maps.

The policy is told about a request's pages in one call per request where the order allows
(``added`` after a confirm's loop, ``used`` after a get's), and asked for victims one at a
time inside a reserve's loop, because a key later in the batch may be STORED on the page an
earlier key would evict: the answer depends on evicting in key order, as the Redis backend's
script does.

Time is always passed in (``now``, seconds, monotonic), so the model has no clock and no I/O.
Durable changes (commits and removals of STORED keys) are returned to the caller, which journals
them; see ``store``.
"""

from __future__ import annotations

import heapq
from array import array
from collections.abc import Container, Hashable, Iterable
from itertools import compress
from operator import itemgetter

from kvmeta.core.eviction import EvictionPolicy, Order, PolicyFactory, chain_order
from kvmeta.core.leases import LeaseTable
from kvmeta.core.lru import LruPolicy
from kvmeta.core.pages import FREE, RESERVED, STORED, first_capacity, page_typecode
from kvmeta.core.reports import ConfirmOutcome, PoolCounters
from kvmeta.errors import InvalidRequest

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

# How many read-leased pages one reserve call may step over while looking for a page to evict:
# a fixed allowance plus two per requested key (``EvictionPolicy.budget``). Leased pages found
# at the cold end are moved to the warm end (they were just read), so a normal scan inspects
# one or two pages. When the pool turns over faster than the read lease, almost every page is
# leased; the allowance keeps such a call O(request) (it answers -1 for keys it found no page
# for, as when nothing is evictable) instead of O(pool), and the next call starts past the
# pages this one moved.
_SCAN_ALLOWANCE = 64
# Dead pages the lease queue may hold beyond twice the live leases before it is compacted
# (``core.leases``): a small pool's queue is never compacted for a handful of leases.
_QUEUE_SLACK = 4096
# Seconds a page released by a writer stays out of the allocator (see ``Pool.confirm``): longer
# than the engines' clients spend retrying a request (three retries within about 2 s).
RELEASE_GRACE = 10.0
# bytes.translate table: FREE -> 1, any other state -> 0.
_FREE_MASK = bytes([1] + [0] * 255)

# The STORED keys and pages of a snapshot's copies (``Pool.lru_copy``), first victim first.
lru_order = chain_order


class Pool(LeaseTable):
    """Pages ``0..num_pages-1`` of one backing file and the keys they hold.

    ``policy`` makes the eviction policy from ``num_pages`` (``core.eviction``: what a policy
    must guarantee); LRU by default."""

    __slots__ = ("_stored",)

    def __init__(
        self,
        num_pages: int,
        *,
        reservation_ttl: float = 300.0,
        read_lease: float = 5.0,
        policy: PolicyFactory = LruPolicy,
    ):
        if num_pages <= 0:
            raise InvalidRequest(
                f"num_pages must be a positive integer, got {num_pages}", "num_pages"
            )
        super().__init__(num_pages, reservation_ttl, read_lease, policy(num_pages))
        self._stored: dict[str, int] = {}

    @property
    def policy(self) -> EvictionPolicy:
        """The eviction policy (read-only: it holds exactly the STORED pages)."""
        return self._policy

    # ------------------------------------------------------------------ loading

    @classmethod
    def load(
        cls,
        num_pages: int,
        entries: list[tuple[str, int]],
        *,
        reservation_ttl: float = 300.0,
        read_lease: float = 5.0,
        policy: PolicyFactory = LruPolicy,
    ) -> Pool:
        """A pool whose STORED keys are ``entries``, given first victim first (recovery).

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
            num_pages, stored, reservation_ttl=reservation_ttl, read_lease=read_lease, policy=policy
        )

    @classmethod
    def from_lru(
        cls,
        num_pages: int,
        stored: dict[str, int],
        *,
        reservation_ttl: float = 300.0,
        read_lease: float = 5.0,
        frontier: int | None = None,
        policy: PolicyFactory = LruPolicy,
    ) -> Pool:
        """``load`` in bulk: the same pool from a key -> page dict in eviction order (first
        victim first), with set-based checks and tight loops, because recovery loads 10^6 keys
        at start-up. The pool takes ``stored`` over; the caller must not use it afterwards.
        ``frontier``: pages from there on were never handed out (None: any page may have been).

        Raises:
            InvalidRequest: as ``load`` (bad input is handed to ``load`` for its exact message).
        """
        pool = cls(num_pages, reservation_ttl=reservation_ttl, read_lease=read_lease, policy=policy)
        pages = list(stored.values())
        if pages and (min(pages) < 0 or max(pages) >= num_pages or len(set(pages)) != len(pages)):
            return cls.load(
                num_pages,
                list(stored.items()),
                reservation_ttl=reservation_ttl,
                read_lease=read_lease,
                policy=policy,
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
        page_key, state = pool._page_key, pool._state
        for key, page in stored.items():
            page_key[page] = key
            state[page] = STORED
        pool._policy.load(pages)
        pool._stored = stored
        # FREE pages below the frontier, highest first (the stack pops the lowest), in C.
        free_mask = state[top - 1 :: -1].translate(_FREE_MASK) if top else b""
        pool._free = array(typecode, compress(range(top - 1, -1, -1), free_mask))
        return pool

    # ------------------------------------------------------------------ queries

    def exists(self, keys: list[str]) -> list[bool]:
        """Whether each key is STORED; does not count as a use."""
        stored = self._stored
        out = [k in stored for k in keys]
        self._policy.asked(keys, out, stored)
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
        """Page of each STORED key (else None); a use for eviction, and a read lease on the
        page."""
        self._expire(now)
        out: list[int | None] = list(map(self._stored.get, keys))
        misses = out.count(None)
        if misses < len(out):
            self._policy.used(out)
            lease = self.read_lease
            if lease > 0:
                until = now + lease
                read_until = self._read_until
                for page in out:
                    if page is not None:
                        read_until[page] = until
        self.counters.get_hits += len(out) - misses
        self.counters.get_misses += misses
        return out

    def leading_stored(self, keys: list[str]) -> int:
        """How many of ``keys``, from the first, are STORED (stops at the first miss). A pure
        read for routers: no use, no counter, no lease."""
        return leading_in(keys, self._stored)

    def page_of(self, key: str) -> int | None:
        """Page of a STORED key without touching anything (stats, tests)."""
        return self._stored.get(key)

    @property
    def stored_count(self) -> int:
        return len(self._stored)

    @property
    def free_count(self) -> int:
        """FREE pages a reserve can take now: cooling ones are not counted (``PoolStats.free``
        means the same). Exact right after ``expire(now)``."""
        return self.num_pages - len(self._stored) - len(self._reserved) - self.cooling_count

    def stored_keys(self) -> list[str]:
        """STORED keys in no particular order. O(stored), at C speed."""
        return list(self._stored)

    def stored_items(self) -> list[tuple[str, int]]:
        """STORED (key, page) pairs, first victim first. O(stored)."""
        keys, pages = chain_order(self._page_key, self._policy.chain())
        return list(zip(keys, pages, strict=True))

    def lru_copy(self) -> tuple[list[str | None], Order]:
        """Copies of the page->key table and of the policy's order (``EvictionPolicy.chain``).

        Memcpy-speed copies (milliseconds at 10^6 pages) for the LRU, so a snapshot can take
        them on the event loop and walk them (``lru_order``) in a thread while the pool keeps
        changing.
        """
        return self._page_key[:], self._policy.chain()

    # ------------------------------------------------------------------ mutations

    def reserve(
        self,
        keys: list[str],
        now: float,
        evicted: list[tuple[str, int]],
        whole: bool = False,
        parent: str | None = None,
    ) -> list[tuple[bool, int]]:
        """Per key: ``(True, page)`` if STORED, ``(False, page)`` to write, ``(False, -1)`` if none.

        A key already RESERVED (by another writer, a retry or earlier in this batch) gets the
        same page back and its lease renewed. STORED keys evicted to make room are appended to
        ``evicted``; the caller must make their removal durable before replying. Victims are
        taken one key at a time, in key order (module docstring).

        ``whole`` (vLLM's batches): the new keys get a page each or none does. vLLM's connector
        gives up a whole batch when one key gets -1 and never releases the pages the others
        got, so a partial grant only strands pages until their lease ends. When the pages are
        not there (``fits``), every key but the STORED ones answers -1 and nothing changes: no
        reservation, no eviction, no use, no joined lease (``_refuse_batch``: only read-leased
        pages its victims would have stepped over move, as under any reserve).

        ``parent``: the key the request names as the first key's prefix (the wire's
        ``[key, prefix_key]`` pairs). When it is STORED and the policy follows chains, its
        page is the first new page's parent for the policy, and no victim of this call:
        evicting it to store its child would leave the child unreachable by a leading-hit
        lookup.
        """
        self._expire(now)
        up = -1
        if parent and self._policy.follows_chains:
            up = self._stored.get(parent, -1)
        if whole and not self.fits(keys, now, up):
            return self._refuse_batch(keys, now, up)
        stored, reserved, state, page_key = (
            self._stored,
            self._reserved,
            self._state,
            self._page_key,
        )
        holders, res_deadline = self._holders, self._res_deadline
        reserved_before = len(reserved)
        read_until = self._read_until
        policy = self._policy
        victim = policy.victim
        evictions = 0
        deadline = now + self.reservation_ttl
        counters = self.counters
        out: list[tuple[bool, int]] = []
        append = out.append
        free = self._free
        leased: list[int] = []  # pages whose lease this call grants or renews
        seen: set[str] = set()  # keys this call reserved or joined: one holder per call
        # Pages reported as stored by this call, and the named parent: never evicted by it.
        hits: set[int] = set() if up < 0 else {up}
        refused = 0
        policy.budget = _SCAN_ALLOWANCE + 2 * len(keys)
        for key in keys:
            page = stored.get(key)
            if page is not None:
                hits.add(page)
                counters.reserve_hits += 1
                policy.used((page,))  # before the next victim is chosen
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
                page = victim(now, hits, read_until)
                if page < 0:
                    refused += 1
                    append((False, -1))
                    continue
                old = page_key[page]
                assert old is not None
                del stored[old]
                evicted.append((old, page))
                evictions += 1
            state[page] = RESERVED
            page_key[page] = key
            reserved[key] = page
            res_deadline[page] = deadline
            leased.append(page)
            seen.add(key)
            append((False, page))
        if leased:
            self._res_queue.append((deadline, leased))
            self._queued += len(leased)
            if self._queued > 2 * len(res_deadline) + _QUEUE_SLACK:
                self._compact_queue()
        new = len(reserved) - reserved_before
        policy.reserved(keys, out, not refused and new == len(keys), up)
        counters.reservations += new
        counters.reservations_refused += refused
        counters.evictions += evictions
        return out

    def fits(self, keys: list[str], now: float, parent: int = -1) -> bool:
        """Whether a reserve of ``keys`` at ``now`` (leases expired) gets every new key a page.

        Counts the allocatable pages, then asks the policy whether it would find the rest
        within the scan allowance a reserve has, never giving up a page STORED for a key of
        this batch or the named parent's page (``parent``, -1: none), as ``reserve`` does not
        (``EvictionPolicy.can_evict``). O(request).
        """
        free = self.allocatable_count
        if free >= len(keys):  # the common case, in O(1)
            return True
        short = self.new_keys(keys) - free
        if short <= 0:
            return True
        steps = _SCAN_ALLOWANCE + 2 * len(keys)
        keep = self._batch_pages(keys, parent)
        return self._policy.can_evict(short, steps, now, keep, self._read_until)

    def _batch_pages(self, keys: list[str], parent: int) -> set[int]:
        """The pages a whole batch's victims never take: its STORED keys' and ``parent``."""
        stored = self._stored
        batch = {page for key in keys if (page := stored.get(key)) is not None}
        if parent >= 0:
            batch.add(parent)
        return batch

    def new_keys(self, keys: list[str]) -> int:
        """How many distinct keys are neither STORED nor RESERVED (a reserve needs a page each)."""
        stored, reserved = self._stored, self._reserved
        return len({k for k in keys if k not in stored and k not in reserved})

    def _refuse_batch(self, keys: list[str], now: float, parent: int) -> list[tuple[bool, int]]:
        """The answer to a whole batch that does not fit: STORED keys keep their pages (the
        engine may write them again: a confirm of a STORED key succeeds), every other key -1.
        The read-leased pages its reserve would have stepped over move warm, as any reserve's
        do (``EvictionPolicy.stepped_over``): otherwise the next batch would find them in its
        way again, and be refused again, until their leases end."""
        steps = _SCAN_ALLOWANCE + 2 * len(keys)
        short = self.new_keys(keys) - self.allocatable_count
        keep = self._batch_pages(keys, parent)
        self._policy.stepped_over(short, steps, now, keep, self._read_until)
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
                committed.append((key, page))
            elif st == STORED and held == key:
                continue
            else:
                outcome.refused.append((key, page))
        if committed:
            self._policy.added([page for _, page in committed])
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
            self._policy.removed(page)
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
        self._policy.clear()
        self.counters.clears += 1
        return count

    def evict_ahead(self, count: int, now: float) -> list[tuple[str, int]]:
        """Evict up to ``count`` evictable STORED pages, in the policy's order, into the
        withheld set.

        A journaled store calls this when few free pages are left, so that a reserve finds a
        page whose old key's removal is already durable and need not wait for the disk.
        Returns the removed (key, page) pairs to journal. Needs ``withhold``.
        """
        self._expire(now)
        policy = self._policy
        policy.budget = _SCAN_ALLOWANCE + 2 * count
        removed: list[tuple[str, int]] = []
        read_until, stored, page_key, state = (
            self._read_until,
            self._stored,
            self._page_key,
            self._state,
        )
        keep: frozenset[int] = frozenset()
        for _ in range(count):
            page = policy.victim(now, keep, read_until)
            if page < 0:
                break
            key = page_key[page]
            assert key is not None
            del stored[key]
            page_key[page] = None
            state[page] = FREE
            removed.append((key, page))
        self._withheld += len(removed)
        self._withheld_new.extend(map(itemgetter(1), removed))
        self.counters.evictions += len(removed)
        return removed

    # ------------------------------------------------------------------ internals

    def expire(self, now: float) -> None:
        """Apply lease expiry up to ``now`` (every operation does this first)."""
        self._expire(now)

    def in_use_until(self, now: float) -> float:
        """When the last lease on this pool's pages ends: a reservation, a read lease, a
        released page's grace or a hold after a restart (``now`` or earlier: none is live).
        The read leases cost one pass over a C array of a double per page ever used: for rare
        operator actions such as removing a vLLM rank, never for requests."""
        self._expire(now)
        until = max(self._res_deadline.values(), default=now)
        if self._cooling:
            until = max(until, max(end for end, _ in self._cooling))
        if self._held:
            until = max(until, self._held_until)
        return max(until, max(self._read_until, default=now))

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


def leading_in(items: Iterable[Hashable], container: Container[Hashable]) -> int:
    """How many of ``items``, from the first, are in ``container`` (stops at the first miss):
    a router's prefix match, by keys or by block hashes."""
    n = 0
    for item in items:
        if item not in container:
            break
        n += 1
    return n
