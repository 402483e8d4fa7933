"""Leaf-first eviction for pools behind host caches: a page with a stored child goes last.

Engines keep a host-memory cache in front of the pool and never ask the pool for the leading
pages they hold themselves, so in the pool the heads of prefix chains age while their tails
stay fresh. Plain LRU then evicts a chain's head first, and every page after it becomes
unreachable for a leading-hit lookup. This policy learns each STORED page's *parent* (the page
of the previous key of the same ordered request) and evicts leaves (pages with no stored child)
before any page that has one.

The unit of order is a *run*: the pages of one confirm, in order, each the parent of the next
(a page whose parent its reserve named elsewhere starts a new run). Only a run's last page, its
*tail*, can be a leaf, so only tails are in the eviction lists. A victim is the tail of the
coldest leaf run, and the pages before it follow, one per ``victim`` call, with no list work:
the run's place in its list is fixed once, when the eating stops (``_settle``: the run is gone,
its tail has a stored child, or, in probation, the next page was used). That keeps a victim
within about half again of an LRU one, where moving each parent between lists cost five times
as much. Other runs hang off a page of a run as its children (``_kids``).

Leaf runs are in two segments, each least recently used first: *probation* (the tail not used
since it was stored) and *protected* (used since). A victim comes from probation while used
pages are at most ``HOT_SHARE`` of the pool's pages, else from protected: a one-off chain,
however long, then cannot push out the pages requests come back for, and protected pages still
age out when the working set moves. A run eaten in probation down to a used page moves to the
warm end of protected; a run eaten in protected goes whole (its pages were used together, so
its head is no warmer than its tail). A run whose tail loses its last child run becomes a leaf
run: in probation, the next victim; in protected, the warmest (the engines read a used chain's
head from their own caches whenever they use the chain, so it is as recent as its most recent
descendant, however old it looks here). Runs whose tail has children are in a third list and
go only when no leaf can; and when every tail is read-leased, a page inside a run (the pages
after it are then dead: a reserve finds a page while one can go). These choices, and
``HOT_SHARE``, were made by replaying traces (``benchmarks/bench_eviction.py``,
benchmarks/README.md).

Parents come from the order of a confirm's pages (the engines confirm a request's pages in its
key order); for the first new page of a reserve, from the key before it in the reserve, or,
when it is the reserve's first key, from the prefix key the request names for it (the wire's
``[key, prefix_key]`` pairs; the released engines send ``""``), else from the ``exists`` just
before it (``asked``: the engines ask for the keys past their own host cache, then reserve the
missing ones, so the last leading hit is the first missing key's parent); and, for pages stored
without one (after a restart, or a request whose first pages were all in an engine's host
cache), from the order of a get's hits (``used``). Every page of one confirm gets the same
*stamp* (a counter of confirms), and a link to another run is valid only to a page stamped
earlier, so the links form a forest and a stale link (its parent removed and the page reused)
is recognised in O(1). A page whose parent is removed while it is stored (a delete, or a
forced eviction) is *dead*: no leading-hit lookup can reach it (``dead``). Parents are not
durable: after a restart every page is a run of its own, in the old order, until requests
teach it parents again.

The lists, the per-page arrays and the taking of victims are ``core.runs.RunLists``'s: 17
bytes a page more than LRU (21 past 2^31 pages). Every operation is O(pages it is handed) plus
the scan budget; a reserve whose keys are all new costs O(1) here besides its victims.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from kvmeta.core.runs import (
    _FIRST,
    _GONE,
    _HELD,
    _HOT,
    _NONE,
    _PARENT,
    _TAIL,
    _TAILS,
    PROBATION,
    PROTECTED,
    RunLists,
)

__all__ = ["HOT_SHARE", "PrefixPolicy"]

# Keys whose parent an ``exists`` told (``asked``) kept until their reserve: a few requests'
# worth per engine.
_HINTS = 4096
# The share of stored pages the protected runs may keep from eviction (module docstring);
# chosen by replaying traces (benchmarks/README.md, "Eviction").
HOT_SHARE = 0.4


class PrefixPolicy(RunLists):
    """Evicts leaves first (pages no stored page names as parent), by runs, in two LRU
    segments."""

    __slots__ = ("_clock", "_hints", "_given", "_hot_limit")

    follows_chains = True

    def __init__(self, num_pages: int) -> None:
        self._clock = 0  # confirms counted: the stamps
        # key -> (page, its stamp) of the stored key before it in an ``exists`` (``asked``).
        self._hints: dict[str, tuple[int, int]] = {}
        # RESERVED pages a reserve gave a parent (``reserved``): ``_parent`` and ``_stamp``
        # hold it and its stamp until the confirm.
        self._given: set[int] = set()
        # The used pages protected runs may hold before they are taken from (``HOT_SHARE``).
        self._hot_limit = num_pages * HOT_SHARE
        super().__init__(num_pages)

    # The pool sets ``budget`` at the start of each reserve and ``evict_ahead``: that is when
    # the per-reserve scan state starts afresh.
    @property
    def budget(self) -> int:
        return self._left

    @budget.setter
    def budget(self, steps: int) -> None:
        if self._orig >= 0:
            self._settle()
        self._left = steps
        if self._scanned:
            self._moved = [-1, -1, -1]
            self._dry = [False, False, False]
            self._scanned = False
        # The segment to take from, chosen once a reserve: the share moves slowly.
        self._first = self._first_segment()

    def _first_segment(self) -> int:
        # (Of the pool's pages, not of those stored: victims are taken only when every page
        # is in use, so the two differ by the pages being written, and counting the stored
        # ones would cost a counter per victim.)
        return PROTECTED if self._hot > self._hot_limit else PROBATION

    def resize(self, capacity: int) -> None:
        if self._orig >= 0:
            self._settle()
        arrays = (self._prev, self._next, self._parent, self._kids, self._stamp, self._flags)
        cap = len(self._prev)
        if capacity <= cap:
            for arr in arrays:
                del arr[capacity:]
            return
        try:
            for arr in arrays:
                arr.frombytes(bytes(arr.itemsize * (capacity - cap)))
        except MemoryError:
            for arr in arrays:
                del arr[cap:]
            raise

    def load(self, pages: list[int]) -> None:
        """Each page a run of its own, in probation, in the given order."""
        if self._orig >= 0:
            self._settle()
        self.clear()
        prev, nxt, parent, kids, stamp, flags = (
            self._prev,
            self._next,
            self._parent,
            self._kids,
            self._stamp,
            self._flags,
        )
        self._clock += 1
        clock = self._clock
        alone = _HELD | _FIRST | _TAILS[PROBATION]
        before = -1
        for page in pages:
            prev[page] = before
            if before != -1:
                nxt[before] = page
            parent[page] = _NONE
            kids[page] = 0
            stamp[page] = clock
            flags[page] = alone
            before = page
        if pages:
            nxt[before] = -1
            self._head[PROBATION], self._tail[PROBATION] = pages[0], before

    def asked(self, keys: list[str], found: list[bool], stored: Mapping[str, int]) -> None:
        """Remember the first missing key's parent: the engines ask for a request's keys past
        their own host cache in order, then reserve only the missing ones, whose first would
        otherwise look like a root. At most ``_HINTS`` such keys are remembered (the oldest
        go first). O(leading hits)."""
        if self._orig >= 0:
            self._settle()
        if not found or found[0] is False:
            return
        try:
            first = found.index(False)
        except ValueError:
            return
        up = stored[keys[first - 1]]
        hints = self._hints
        hints[keys[first]] = (up, self._stamp[up])
        if len(hints) > _HINTS:
            del hints[next(iter(hints))]

    def reserved(
        self, keys: list[str], out: list[tuple[bool, int]], plain: bool, parent: int = -1
    ) -> None:
        """Give each new page that does not follow another new page of this reserve its parent
        (the page of the key before it; for the first key, the page the request named as its
        prefix, else the ``exists`` hint); the others get theirs from the confirm's order
        (module docstring). ``plain`` (every key got a new page of its own): only the first
        page needs one, in O(1)."""
        if self._orig >= 0:
            self._settle()
        links, stamp = self._parent, self._stamp
        up, up_stamp = _NONE, 0
        if self._hints and keys:
            hint = self._hints.pop(keys[0], None)
            if hint is not None:
                up, up_stamp = hint
        if parent >= 0:
            up, up_stamp = parent, stamp[parent]
        if plain:
            if not out:
                return
            page = out[0][1]
            links[page] = up
            stamp[page] = up_stamp
            self._given.add(page)
            return
        before_new = False
        for hit, page in out:
            if hit:
                if up >= 0 and links[page] == _NONE and up != page:
                    self._relink(page, up)
                up, up_stamp, before_new = page, stamp[page], False
                continue
            if page < 0:
                up, up_stamp, before_new = _GONE, 0, False
                continue
            if not before_new:
                links[page] = up
                stamp[page] = up_stamp
                self._given.add(page)
            up, up_stamp, before_new = page, 0, True

    def added(self, pages: list[int]) -> None:
        """Each page's parent is the page before it in the batch, or the one its reserve gave:
        the batch is one run, or a few where a reserve named another parent. Inlined, with a
        loop of its own for the common batch (no page but the first was given a parent): it
        runs for every page stored."""
        if self._orig >= 0:
            self._settle()
        parent, stamp, flags, nxt = self._parent, self._stamp, self._flags, self._next
        self._clock += 1
        clock = self._clock
        held = _HELD
        given = self._given
        before = self._start(pages[0], -1, clock)
        if given:  # another page of the batch may have been given a parent by its reserve
            for page in pages[1:]:
                if page in given:
                    before = self._start(page, before, clock)
                    continue
                parent[page] = before
                stamp[page] = clock
                flags[page] = held
                nxt[before] = page
                before = page
        else:  # the common case: every page after the first continues the run
            for page in pages[1:]:
                parent[page] = before
                stamp[page] = clock
                flags[page] = held
                nxt[before] = page
                before = page
        # The batch's last run ends: a leaf run, the warmest of probation (``_close``).
        flags[before] |= _TAIL  # (probation: the list bits are 0)
        tails = self._tail
        tail = tails[PROBATION]
        self._prev[before] = tail
        nxt[before] = -1
        if tail == -1:
            self._head[PROBATION] = before
        else:
            nxt[tail] = before
        tails[PROBATION] = before

    def _start(self, page: int, before: int, clock: int) -> int:
        """``added`` for a batch's first page or one its reserve gave a parent: it continues
        the run of ``before`` (-1: none) or starts a run. Returns ``page``."""
        parent, stamp, flags = self._parent, self._stamp, self._flags
        if self._given and page in self._given:
            self._given.remove(page)
            up = parent[page]
            if up >= 0 and not (flags[up] & _HELD and stamp[up] == stamp[page]):
                # Gone, or gone and stored again, since the reserve.
                up = before if before >= 0 else _GONE
        else:
            up = _NONE
        stamp[page] = clock
        if up == before and up >= 0:
            parent[page] = up
            flags[page] = _HELD
            self._next[before] = page
            return page
        if before >= 0:
            self._close(before)
        parent[page] = up
        flags[page] = _HELD | _FIRST
        if up >= 0:
            self._add_child(up)
        elif up == _GONE:
            self._dead += 1
        return page

    def used(self, pages: Iterable[int | None]) -> None:
        """Flags used pages; a leaf run whose tail is used moves to the warm end of the
        protected runs. Other pages stay where they are: their run is placed by its tail."""
        if self._orig >= 0:
            self._settle()
        parent, flags = self._parent, self._flags
        tails = self._tail
        before = -1
        hot = 0
        for page in pages:
            if page is None:
                before = -1
                continue
            bits = flags[page]
            if bits & _FIRST and before >= 0 and parent[page] == _NONE and before != page:
                self._relink(page, before)  # may move ``before``'s run out of the leaves
            before = page
            if not bits & _HOT:
                flags[page] = bits = bits | _HOT
                hot += 1
            if bits & (_TAIL | _PARENT) == _TAIL and page != tails[PROTECTED]:
                self._move(page, PROTECTED, False)
        self._hot += hot

    def unreserved(self, page: int) -> None:
        if self._orig >= 0:
            self._settle()
        self._given.discard(page)

    def removed(self, page: int) -> None:
        if self._orig >= 0:
            self._settle()
        self._drop(page)

    def clear(self) -> None:
        if self._orig >= 0:
            self._settle()
        kids, flags = self._kids, self._flags
        for page in self.chain().pages():  # every held page
            kids[page] = 0
            flags[page] = 0
        self._head = [-1, -1, -1]
        self._tail = [-1, -1, -1]
        self._hot = 0
        self._dead = 0

    def copy(self) -> PrefixPolicy:
        if self._orig >= 0:
            self._settle()
        twin = PrefixPolicy.__new__(PrefixPolicy)
        twin._prev, twin._next = self._prev[:], self._next[:]
        twin._parent, twin._kids, twin._stamp = self._parent[:], self._kids[:], self._stamp[:]
        twin._flags = self._flags[:]
        twin._head, twin._tail = list(self._head), list(self._tail)
        twin._clock, twin._dead = self._clock, self._dead
        twin._hot, twin._hot_limit = self._hot, self._hot_limit
        twin._left, twin._moved, twin._dry = self._left, list(self._moved), list(self._dry)
        twin._scanned, twin._hints = self._scanned, dict(self._hints)
        twin._first = self._first
        twin._orig, twin._cur, twin._where, twin._eat = -1, -1, PROBATION, -1
        twin._stop, twin._ended, twin._given = 0, False, set(self._given)
        return twin

    def problem(self, capacity: int) -> str | None:
        if self._orig >= 0:
            self._settle()
        from kvmeta.core.invariants import prefix_problem

        return prefix_problem(self, capacity)

    def parent_of(self, page: int) -> int:
        """The live parent of a held page, or -1 (a root, or its parent is gone)."""
        if self._orig >= 0:
            self._settle()
        up = self._parent[page]
        if up < 0:
            return -1
        if not self._flags[page] & _FIRST:
            return up
        return up if self._flags[up] & _HELD and self._stamp[up] < self._stamp[page] else -1

    def protected(self, page: int) -> bool:
        """Whether held ``page`` was used since it was stored (for checks and tests)."""
        if self._orig >= 0:
            self._settle()
        return bool(self._flags[page] & _HOT)

    def _relink(self, page: int, up: int) -> None:
        """Give root ``page`` the parent ``up``, older than it so the links stay a forest: a run
        of one page with no child is stamped anew when it is not (no link names its stamp)."""
        stamp, flags = self._stamp, self._flags
        if not flags[up] & _HELD or flags[page] & (_HELD | _FIRST) != _HELD | _FIRST:
            return
        if stamp[up] >= stamp[page]:
            if flags[page] & (_PARENT | _TAIL) != _TAIL:
                return
            self._clock += 1
            stamp[page] = self._clock
        self._parent[page] = up
        self._add_child(up)
