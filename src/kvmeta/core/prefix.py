"""Leaf-first eviction for pools behind host caches: a page with a stored child goes last.

Engines keep a host-memory cache in front of the pool and never ask the pool for the leading
pages they hold themselves, so in the pool the heads of prefix chains age while their tails
stay fresh. Plain LRU then evicts a chain's head first, and every page after it becomes
unreachable for a leading-hit lookup. This policy learns each STORED page's *parent* (the page
of the previous key of the same ordered request) and evicts leaves (pages with no stored child)
before any page that has one; among leaves, the least recently used first.

Parents are learned from the order of the keys of a reserve (``reserved``: a new page's
parent is the page of the key before it); for the first key of a reserve, from the ``exists``
before it (``asked``: the engines ask for the keys past their own host cache, then reserve the
missing ones, so the last leading hit is the first missing key's parent: without it the tail
of every request would look like a new root); and, for pages stored without one (after a
restart), from the order of a get's hits (``used``). A link is made only to a page
stored before its child (``_stamp``: a counter of additions), so the links form a forest and a
stale link (its parent removed and the page reused) is recognised in O(1).

Structures, one entry per page, in C arrays: two intrusive doubly linked lists over
``_prev``/``_next`` (list 0: leaves, list 1: pages with stored children, each coldest first),
``_parent`` (the parent page, or ``_NONE``: a root; ``_GONE``: its parent was not stored when
it was), ``_kids`` (0: not held; else 1 + stored children) and ``_stamp``: 24 bytes a page,
16 more than LRU. Every operation is O(pages it is handed) plus the scan budget.

A page whose last child goes becomes a leaf at the warm end of the leaves: the engines read a
chain's head from their own caches whenever they use the chain, so it is as recent as its
most recent descendant, however old it looks here (on a replayed trace this serves more
pages than the cold end: ``benchmarks/bench_eviction.py``). Pages with children are not moved
when used: they go only when no leaf can. A page
whose parent is removed while it is stored (a delete, or a forced eviction when every leaf is
read-leased) is *dead*: no leading-hit lookup can reach it (``dead``). Parents are not
durable: after a restart every page is a root leaf, in the old order, until requests teach it
parents again.
"""

from __future__ import annotations

from array import array
from collections.abc import Container, Iterable, Mapping

from kvmeta.core.eviction import EvictionPolicy
from kvmeta.core.pages import page_typecode

__all__ = ["PrefixPolicy"]

_NONE = -1  # no parent: the first key of its request
_GONE = -2  # its parent key was not stored when it was
# A parent given by ``reserved`` that was itself new in that reserve is kept as ``_NEW - page``
# until the confirm (such a parent has no stamp yet: it is checked as stamped after the reserve).
_NEW = -3
# Keys whose parent an ``exists`` told (``asked``) kept until their reserve: a few requests'
# worth per engine.
_HINTS = 4096

LEAF = 0
INNER = 1


class PrefixPolicy(EvictionPolicy):
    """Evicts leaves first (pages no stored page names as parent), LRU among them."""

    __slots__ = (
        "_prev",
        "_next",
        "_parent",
        "_kids",
        "_stamp",
        "_head",
        "_tail",
        "_clock",
        "dead",
        "_left",
        "_moved",
        "_dry",
        "_now",
        "_hints",
    )

    def __init__(self, num_pages: int) -> None:
        super().__init__()
        typecode = page_typecode(num_pages)
        self._prev = array(typecode)
        self._next = array(typecode)
        self._parent = array("q")
        self._kids = array("i")
        self._stamp = array("q")
        self._head = [-1, -1]
        self._tail = [-1, -1]
        self._clock = 0
        # Stored pages whose parent is gone (module docstring), kept up to date in O(1).
        self.dead = 0
        # Per reserve (reset by setting ``budget``): steps left, the first page each list's
        # scan moved to its warm end, and whether a list is known to hold nothing evictable.
        self._left = 0
        self._moved = [-1, -1]
        self._dry = [False, False]
        self._now = -1.0
        # key -> (page, its stamp) of the stored key before it in an ``exists`` (``asked``).
        self._hints: dict[str, tuple[int, int]] = {}

    # The pool sets ``budget`` at the start of each reserve and ``evict_ahead``: that is when
    # the per-reserve scan state starts afresh.
    @property
    def budget(self) -> int:
        return self._left

    @budget.setter
    def budget(self, steps: int) -> None:
        self._left = steps
        self._moved = [-1, -1]
        self._dry = [False, False]
        self._now = -1.0

    # ------------------------------------------------------------------ sizing, loading

    def resize(self, capacity: int) -> None:
        arrays = (self._prev, self._next, self._parent, self._kids, self._stamp)
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
        self.clear()
        prev, nxt, parent, kids, stamp = (
            self._prev,
            self._next,
            self._parent,
            self._kids,
            self._stamp,
        )
        before = -1
        for page in pages:
            prev[page] = before
            if before != -1:
                nxt[before] = page
            parent[page] = _NONE
            kids[page] = 1
            self._clock += 1
            stamp[page] = self._clock
            before = page
        if pages:
            nxt[before] = -1
            self._head[LEAF], self._tail[LEAF] = pages[0], before

    # ------------------------------------------------------------------ what the pool reports

    def asked(self, keys: list[str], found: list[bool], stored: Mapping[str, int]) -> None:
        """Remember the first missing key's parent: the engines ask for a request's keys past
        their own host cache in order, then reserve only the missing ones, whose first would
        otherwise look like a root. At most ``_HINTS`` such keys are remembered (the oldest
        go first). O(leading hits)."""
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

    def reserved(self, keys: list[str], out: list[tuple[bool, int]]) -> None:
        """Record each new page's parent: the page of the key before it (module docstring),
        or for the first key, the one an ``exists`` just before found before it."""
        parent, stamp, kids = self._parent, self._stamp, self._kids
        clock = self._clock
        before = _NONE
        before_new = False
        if self._hints and keys:
            hint = self._hints.pop(keys[0], None)
            if hint is not None and kids[hint[0]] > 0 and stamp[hint[0]] == hint[1]:
                before = hint[0]
        for hit, page in out:
            if hit:
                if before >= 0 and parent[page] == _NONE and before != page:
                    self._relink(page, before)
                before, before_new = page, False
                continue
            if page < 0:
                before, before_new = _GONE, False
                continue
            if kids[page] == 0:  # RESERVED: its parent slot is free until the confirm
                if before >= 0 and before != page:
                    parent[page] = _NEW - before if before_new else before
                else:
                    parent[page] = before
                stamp[page] = clock
            before, before_new = page, True

    def added(self, pages: Iterable[int]) -> None:
        """Two passes, so each page is linked once, into its final list: in a chain confirmed
        together every page but the last has a child from the same batch. Inlined: it runs
        for every page stored."""
        parent, stamp, kids = self._parent, self._stamp, self._kids
        batch = pages if isinstance(pages, list) else list(pages)
        clock = first = self._clock
        dead = 0
        for page in batch:
            reserved_at = stamp[page]
            up = parent[page]
            if up >= 0:
                if kids[up] <= 0 or stamp[up] > reserved_at:
                    up = _GONE  # gone, or gone and the page stored again since the reserve
            elif up <= _NEW:
                up = _NEW - up
                if kids[up] <= 0 or stamp[up] <= reserved_at:
                    up = _GONE  # new in that reserve, but not stored since
            if up == _GONE:
                dead += 1
            parent[page] = up
            clock += 1
            stamp[page] = clock
            kids[page] = 1
            if up >= 0:
                count = kids[up] + 1
                kids[up] = count
                if count == 2 and stamp[up] <= first:  # a leaf stored before: now inner
                    self._unlink(LEAF, up)
                    self._link_tail(INNER, up)
        self._clock = clock
        self.dead += dead
        prev, nxt, heads, tails = self._prev, self._next, self._head, self._tail
        for page in batch:
            which = LEAF if kids[page] == 1 else INNER
            tail = tails[which]
            prev[page] = tail
            nxt[page] = -1
            if tail == -1:
                heads[which] = page
            else:
                nxt[tail] = page
            tails[which] = page

    def used(self, pages: Iterable[int | None]) -> None:
        """Moves used leaves to the warm end. Pages with children stay where they are: they go
        only when no leaf can, and a page that becomes a leaf takes the warm end anyway."""
        kids, parent, prev, nxt = self._kids, self._parent, self._prev, self._next
        tails = self._tail
        tail = tails[LEAF]
        before = -1
        for page in pages:
            if page is None:
                before = -1
                continue
            if before >= 0 and parent[page] == _NONE and before != page:
                tails[LEAF] = tail
                self._relink(page, before)  # may move ``before`` out of the leaves
                tail = tails[LEAF]
            before = page
            if kids[page] != 1 or page == tail:
                continue
            # Unlink and link at the tail: page is not the tail, so it has a successor.
            up, after = prev[page], nxt[page]
            if up == -1:
                self._head[LEAF] = after
            else:
                nxt[up] = after
            prev[after] = up
            prev[page] = tail
            nxt[page] = -1
            nxt[tail] = page
            tail = page
        tails[LEAF] = tail

    def removed(self, page: int) -> None:
        self._drop(page)

    def clear(self) -> None:
        kids = self._kids
        for which in (LEAF, INNER):
            page = self._head[which]
            while page != -1:
                kids[page] = 0
                page = self._next[page]
        self._head = [-1, -1]
        self._tail = [-1, -1]
        self.dead = 0

    # ------------------------------------------------------------------ choosing victims

    def victim(self, now: float, keep: Container[int], read_until: array[float]) -> int:
        if now != self._now:
            self._now, self._moved, self._dry = now, [-1, -1], [False, False]
        page = self._head[LEAF]
        if page != -1 and read_until[page] <= now and page not in keep:
            # The common case, for free and inlined: the coldest leaf can go.
            nxt, kids = self._next, self._kids
            after = nxt[page]
            self._head[LEAF] = after
            if after == -1:
                self._tail[LEAF] = -1
            else:
                self._prev[after] = -1
            kids[page] = 0
            up = self._parent[page]
            if up >= 0:
                if kids[up] > 0 and self._stamp[up] < self._stamp[page]:
                    count = kids[up] - 1
                    kids[up] = count
                    if count == 1 and up != self._moved[INNER]:
                        # Its last child went: a leaf, at the warm end (``_to_leaf``, inlined:
                        # a chain eaten from its tail does this at every eviction).
                        prev = self._prev
                        before, later = prev[up], nxt[up]
                        if before == -1:
                            self._head[INNER] = later
                        else:
                            nxt[before] = later
                        if later == -1:
                            self._tail[INNER] = before
                        else:
                            prev[later] = before
                        self._link_tail(LEAF, up)
                    elif count == 1:
                        self._to_leaf(up)
                else:
                    self.dead -= 1
            elif up == _GONE:
                self.dead -= 1
            return page
        for which in (LEAF, INNER):
            page = self._head[which]
            if page != -1 and read_until[page] <= now and page not in keep:
                self._drop(page)
                return page
            if page != -1 and not self._dry[which]:
                page = self._scan(which, now, keep, read_until)
                if page >= 0:
                    self._drop(page)
                    return page
                if page == -2:
                    return -1  # the budget ran out
            # The leaves were all looked at in this reserve: only a page that became a leaf
            # since (at the warm end, behind the scan's mark) may go.
            page = self._tail[which]
            if which == LEAF and page != -1 and read_until[page] <= now and page not in keep:
                self._drop(page)
                return page
        return -1

    def _scan(self, which: int, now: float, keep: Container[int], read_until: array[float]) -> int:
        """The first evictable page of list ``which``, moving each page it steps over to the
        warm end (a read-leased page was just read), one step of the budget each; -1: none
        (the list is then dry for this reserve), -2: the budget ran out."""
        page = self._head[which]
        while page != -1:
            if page == self._moved[which]:
                break  # every page of the list has been looked at in this reserve
            if read_until[page] <= now and page not in keep:
                return page
            if self._left <= 0:
                return -2
            self._left -= 1
            self._unlink(which, page)
            self._link_tail(which, page)
            if self._moved[which] == -1:
                self._moved[which] = page
            page = self._head[which]
        self._dry[which] = True
        return -1

    def can_evict(
        self, count: int, steps: int, now: float, keep: Container[int], read_until: array[float]
    ) -> bool:
        """Walks the leaves, then the rest, from their cold ends. ``victim`` steps over each
        page that cannot go at most once a reserve, plus at most one parent that becomes a leaf
        per page taken: so ``count`` pages found with ``skipped + count <= steps`` are kept."""
        found = skipped = 0
        walked = 0
        for which in (LEAF, INNER):
            page = self._head[which]
            while page != -1 and walked < steps:
                walked += 1
                if read_until[page] <= now and page not in keep:
                    found += 1
                    if found >= count:
                        return skipped + count <= steps
                else:
                    skipped += 1
                page = self._next[page]
        return count <= 0

    # ------------------------------------------------------------------ snapshots, checks

    def chain(self) -> tuple[array[int], int]:
        nxt = self._next[:]
        head = self._head[LEAF]
        if head == -1:
            return nxt, self._head[INNER]
        nxt[self._tail[LEAF]] = self._head[INNER]
        return nxt, head

    def copy(self) -> PrefixPolicy:
        twin = PrefixPolicy.__new__(PrefixPolicy)
        twin._prev, twin._next = self._prev[:], self._next[:]
        twin._parent, twin._kids, twin._stamp = self._parent[:], self._kids[:], self._stamp[:]
        twin._head, twin._tail = list(self._head), list(self._tail)
        twin._clock, twin.dead = self._clock, self.dead
        twin._left, twin._moved, twin._dry = self._left, list(self._moved), list(self._dry)
        twin._now, twin._hints = self._now, dict(self._hints)
        return twin

    def problem(self, capacity: int) -> str | None:
        from kvmeta.core.invariants import prefix_problem

        return prefix_problem(self, capacity)

    def held(self, page: int) -> bool:
        """Whether ``page`` is STORED (for checks)."""
        return page < len(self._kids) and self._kids[page] > 0

    def parent_of(self, page: int) -> int:
        """The live parent of a held page, or -1 (a root, or its parent is gone)."""
        up = self._parent[page]
        return up if up >= 0 and self._valid(page, up) else -1

    # ------------------------------------------------------------------ internals

    def _valid(self, page: int, up: int) -> bool:
        """Whether held ``page``'s link to ``up`` still names the page it was made to."""
        return self._kids[up] > 0 and self._stamp[up] < self._stamp[page]

    def _relink(self, page: int, up: int) -> None:
        """Give root ``page`` the parent ``up``, older than it so the links stay a forest: a
        page with no stored child is stamped anew when it is not (no link names its stamp)."""
        kids, stamp = self._kids, self._stamp
        if kids[up] <= 0:
            return
        if stamp[up] > stamp[page]:
            if kids[page] != 1:
                return
            self._clock += 1
            stamp[page] = self._clock
        self._parent[page] = up
        self._adopt(up)

    def _adopt(self, up: int) -> None:
        """``up`` got one more stored child: a leaf turns inner, at the warm end."""
        kids = self._kids
        kids[up] += 1
        if kids[up] == 2:
            self._unlink(LEAF, up)
            self._link_tail(INNER, up)

    def _drop(self, page: int) -> None:
        """``page`` stops being held: unlink it, orphan its children, tell its parent."""
        kids = self._kids
        children = kids[page] - 1
        self._unlink(LEAF if children == 0 else INNER, page)
        if children:
            self.dead += children
        up = self._parent[page]
        if up == _GONE:
            self.dead -= 1
        elif up >= 0:
            if self._valid(page, up):
                kids[up] -= 1
                if kids[up] == 1:
                    self._to_leaf(up)
            else:
                self.dead -= 1
        kids[page] = 0

    def _to_leaf(self, page: int) -> None:
        """``page``'s last child went: it becomes a leaf, at the warm end. An engine reads a
        chain's head from its own host cache whenever it uses the chain, so the head is as
        recently used as its most recent descendant, however old it looks here."""
        if page == self._moved[INNER]:
            # The scan's mark leaves the list: the pages after it were moved too.
            self._moved[INNER] = self._next[page]
        self._unlink(INNER, page)
        self._link_tail(LEAF, page)

    def _unlink(self, which: int, page: int) -> None:
        prev, nxt = self._prev, self._next
        before, after = prev[page], nxt[page]
        if before == -1:
            self._head[which] = after
        else:
            nxt[before] = after
        if after == -1:
            self._tail[which] = before
        else:
            prev[after] = before

    def _link_tail(self, which: int, page: int) -> None:
        tail = self._tail[which]
        self._prev[page] = tail
        self._next[page] = -1
        if tail == -1:
            self._head[which] = page
        else:
            self._next[tail] = page
        self._tail[which] = page
