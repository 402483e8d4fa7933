"""Leaf-first eviction for pools behind host caches: a page with a stored child goes last.

Engines keep a host-memory cache in front of the pool and never ask the pool for the leading
pages they hold themselves, so in the pool the heads of prefix chains age while their tails
stay fresh. Plain LRU then evicts a chain's head first, and every page after it becomes
unreachable for a leading-hit lookup. This policy learns each STORED page's *parent* (the page
of the previous key of the same ordered request) and evicts leaves (pages with no stored child)
before any page that has one.

Among leaves, two segments, each least recently used first: *probation* (pages not used since
they were stored) and *protected* (pages read or reserved again since). A victim comes from
probation while protected pages are at most ``HOT_SHARE`` of the stored ones, else from
protected: a one-off chain, however long, then cannot push out the pages requests come back
for, and protected pages still age out when the working set moves. A page whose last child goes
becomes a leaf: in probation, the next victim (a chain nobody came back to goes whole, tail
first); in protected, the warmest (the engines read a used chain's head from their own caches
whenever they use the chain, so it is as recent as its most recent descendant, however old it
looks here). Pages with children are not moved when used: they go only when no leaf can. Both
choices, and ``HOT_SHARE``, were made by replaying traces (``benchmarks/bench_eviction.py``,
benchmarks/README.md).

Parents come from the order of a confirm's pages (the engines confirm a request's pages in its
key order: each page's parent is the one before it in the batch); for the first new page of a
reserve, from the key before it in the reserve, or, when it is the reserve's first key, from the
``exists`` just before it (``asked``: the engines ask for the keys past their own host cache,
then reserve the missing ones, so the last leading hit is the first missing key's parent;
without it the tail of every request would look like a new root); and, for pages stored without
one (after a restart), from the order of a get's hits (``used``). Every page of one confirm gets
the same *stamp* (a counter of confirms), and a link is valid only to a page stamped no later
than its child, so the links form a forest and a stale link (its parent removed and the page
reused) is recognised in O(1). A page whose parent is removed while it is stored (a delete, or a
forced eviction when every leaf is read-leased) is *dead*: no leading-hit lookup can reach it
(``dead``). Parents are not durable: after a restart every page is a root leaf, in the old
order, until requests teach it parents again.

Structures, one entry per page, in C arrays: three intrusive doubly linked lists over
``_prev``/``_next`` (probation leaves, protected leaves, pages with stored children; each
coldest first), ``_parent`` (the parent page, or ``_NONE``: a root; ``_GONE``: its parent was
not stored when it was), ``_kids`` (0: not held; else 1 + stored children), ``_stamp`` and
``_flags`` (protected; a parent given by a reserve): 17 bytes a page more than LRU (21 past
2^31 pages). Every
operation is O(pages it is handed) plus the scan budget; a reserve whose keys are all new costs
O(1) here.
"""

from __future__ import annotations

from array import array
from collections.abc import Container, Iterable, Mapping

from kvmeta.core.eviction import EvictionPolicy
from kvmeta.core.pages import page_typecode

__all__ = ["HOT_SHARE", "PrefixPolicy"]

_NONE = -1  # no parent: the first key of its request
_GONE = -2  # its parent key was not stored when it was
# Keys whose parent an ``exists`` told (``asked``) kept until their reserve: a few requests'
# worth per engine.
_HINTS = 4096
# The share of stored pages the protected leaves may keep from eviction (module docstring);
# chosen by replaying traces (benchmarks/README.md, "Eviction").
HOT_SHARE = 0.35

PROBATION = 0
PROTECTED = 1
INNER = 2
_LISTS = (PROBATION, PROTECTED, INNER)
# ``_flags`` bits.
_HOT = 1  # protected: used since it was stored
_HINTED = 2  # RESERVED, its parent (``_parent``) and that parent's stamp (``_stamp``) given


class PrefixPolicy(EvictionPolicy):
    """Evicts leaves first (pages no stored page names as parent), in two LRU segments."""

    __slots__ = (
        "_prev",
        "_next",
        "_parent",
        "_kids",
        "_stamp",
        "_flags",
        "_head",
        "_tail",
        "_clock",
        "_count",
        "_hot",
        "dead",
        "_left",
        "_moved",
        "_dry",
        "_now",
        "_first",
        "_hints",
    )

    def __init__(self, num_pages: int) -> None:
        self._count = 0  # held pages
        self._hot = 0  # held pages flagged _HOT
        super().__init__()
        typecode = page_typecode(num_pages)
        self._prev = array(typecode)
        self._next = array(typecode)
        self._parent = array(typecode)
        self._kids = array("i")
        self._stamp = array("q")
        self._flags = array("b")
        self._head = [-1, -1, -1]
        self._tail = [-1, -1, -1]
        self._clock = 0
        # Stored pages whose parent is gone (module docstring), kept up to date in O(1).
        self.dead = 0
        # Per reserve (reset by setting ``budget``): steps left, the first page each list's
        # scan moved to its warm end, and whether a list is known to hold nothing evictable.
        self._left = 0
        self._moved = [-1, -1, -1]
        self._dry = [False, False, False]
        self._now = -1.0
        self._first = PROBATION
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
        self._moved = [-1, -1, -1]
        self._dry = [False, False, False]
        self._now = -1.0
        # The segment to take from, chosen once a reserve: the share moves slowly.
        self._first = PROTECTED if self._hot > self._count * HOT_SHARE else PROBATION

    # ------------------------------------------------------------------ sizing, loading

    def resize(self, capacity: int) -> None:
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
        before = -1
        for page in pages:
            prev[page] = before
            if before != -1:
                nxt[before] = page
            parent[page] = _NONE
            kids[page] = 1
            stamp[page] = clock
            flags[page] = 0
            before = page
        if pages:
            nxt[before] = -1
            self._head[PROBATION], self._tail[PROBATION] = pages[0], before
        self._count = len(pages)

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

    def reserved(self, keys: list[str], out: list[tuple[bool, int]], plain: bool) -> None:
        """Give each new page that does not follow another new page of this reserve its parent
        (the page of the key before it, or the ``exists`` hint for the first key); the others
        get theirs from the confirm's order (module docstring). ``plain`` (every key got a new
        page of its own): only the first page needs one, in O(1)."""
        parent, stamp, flags = self._parent, self._stamp, self._flags
        up, up_stamp = _NONE, 0
        if self._hints and keys:
            hint = self._hints.pop(keys[0], None)
            if hint is not None:
                up, up_stamp = hint
        if plain:
            if not out:
                return
            page = out[0][1]
            parent[page] = up
            stamp[page] = up_stamp
            flags[page] = _HINTED
            return
        before_new = False
        for hit, page in out:
            if hit:
                if up >= 0 and parent[page] == _NONE and up != page:
                    self._relink(page, up)
                up, up_stamp, before_new = page, stamp[page], False
                continue
            if page < 0:
                up, up_stamp, before_new = _GONE, 0, False
                continue
            if not before_new:
                parent[page] = up
                stamp[page] = up_stamp
                flags[page] = _HINTED
            up, up_stamp, before_new = page, 0, True

    def added(self, pages: Iterable[int]) -> None:
        """Each page's parent is the page before it in the batch, or the one its reserve gave.
        A page is linked once its successor in the batch is seen (whether it has a child is
        then known). Inlined: it runs for every page stored."""
        parent, stamp, kids, flags = self._parent, self._stamp, self._kids, self._flags
        prev, nxt, heads, tails = self._prev, self._next, self._head, self._tail
        self._clock += 1
        clock = self._clock
        dead = count = 0
        before = -1
        for page in pages:
            count += 1
            up = before
            if flags[page] & _HINTED:
                given = parent[page]
                if given < 0 or (kids[given] > 0 and stamp[given] == stamp[page]):
                    up = given  # no parent, none stored, or a live one
                elif before < 0:
                    up = _GONE  # gone, or gone and stored again, since the reserve
            elif before < 0:
                up = _NONE
            parent[page] = up
            stamp[page] = clock
            flags[page] = 0
            kids[page] = 1
            if up == before and up >= 0:
                # The common case: the page before in the batch, a parent now.
                kids[up] = 2
                tail = tails[INNER]
                prev[up] = tail
                nxt[up] = -1
                if tail == -1:
                    heads[INNER] = up
                else:
                    nxt[tail] = up
                tails[INNER] = up
            else:
                if before >= 0:  # the page before has no child: a leaf
                    self._link_tail(PROBATION, before)
                if up >= 0:
                    # Stored before this batch (a stamp of this batch never matches a hint).
                    kids[up] += 1
                    if kids[up] == 2:  # a leaf until now
                        self._unlink(flags[up] & _HOT, up)
                        self._link_tail(INNER, up)
                elif up == _GONE:
                    dead += 1
            before = page
        if before >= 0:
            self._link_tail(PROBATION, before)
        self._count += count
        self.dead += dead

    def used(self, pages: Iterable[int | None]) -> None:
        """Protects used pages and moves used leaves to the warm end of the protected ones.
        Pages with children stay where they are: they go only when no leaf can, and a page
        that becomes a leaf takes the warm end anyway."""
        kids, parent, flags = self._kids, self._parent, self._flags
        tails = self._tail
        before = -1
        for page in pages:
            if page is None:
                before = -1
                continue
            if before >= 0 and parent[page] == _NONE and before != page:
                self._relink(page, before)  # may move ``before`` out of the leaves
            before = page
            hot = flags[page] & _HOT
            if not hot:
                flags[page] = _HOT
                self._hot += 1
                if kids[page] == 1:
                    self._unlink(PROBATION, page)
                    self._link_tail(PROTECTED, page)
            elif kids[page] == 1 and page != tails[PROTECTED]:
                self._unlink(PROTECTED, page)
                self._link_tail(PROTECTED, page)

    def unreserved(self, page: int) -> None:
        self._flags[page] = 0  # not stored: no _HOT to keep

    def removed(self, page: int) -> None:
        self._drop(page)

    def clear(self) -> None:
        kids = self._kids
        for which in _LISTS:
            page = self._head[which]
            while page != -1:
                kids[page] = 0
                page = self._next[page]
        self._head = [-1, -1, -1]
        self._tail = [-1, -1, -1]
        self._count = self._hot = 0
        self.dead = 0

    # ------------------------------------------------------------------ choosing victims

    def victim(self, now: float, keep: Container[int], read_until: array[float]) -> int:
        if now != self._now:
            self._now, self._moved, self._dry = now, [-1, -1, -1], [False, False, False]
        heads = self._head
        first = self._first
        page = heads[first]
        if page == -1:
            first ^= 1
            page = heads[first]
        if page == -1 or read_until[page] > now or page in keep:
            return self._victim_scan(now, keep, read_until)
        # The common case, for free and inlined: the coldest leaf can go.
        nxt, prev, kids, tails = self._next, self._prev, self._kids, self._tail
        after = nxt[page]
        heads[first] = after
        if after == -1:
            tails[first] = -1
        else:
            prev[after] = -1
        kids[page] = 0
        self._count -= 1
        if first:
            self._hot -= 1
        up = self._parent[page]
        if up >= 0:
            count = kids[up] - 1
            if count < 0 or self._stamp[up] > self._stamp[page]:
                self.dead -= 1
            elif count == 1:
                # Its last child went: a leaf (``_to_leaf``, inlined: a chain eaten from its
                # tail does this at every eviction).
                kids[up] = 1
                if up == self._moved[INNER]:
                    self._moved[INNER] = nxt[up]
                before, later = prev[up], nxt[up]
                if before == -1:
                    heads[INNER] = later
                else:
                    nxt[before] = later
                if later == -1:
                    tails[INNER] = before
                else:
                    prev[later] = before
                if self._flags[up] & _HOT:
                    tail = tails[PROTECTED]
                    prev[up] = tail
                    nxt[up] = -1
                    if tail == -1:
                        heads[PROTECTED] = up
                    else:
                        nxt[tail] = up
                    tails[PROTECTED] = up
                else:
                    head = heads[PROBATION]
                    prev[up] = -1
                    nxt[up] = head
                    if head == -1:
                        tails[PROBATION] = up
                    else:
                        prev[head] = up
                    heads[PROBATION] = up
            else:
                kids[up] = count
        elif up == _GONE:
            self.dead -= 1
        return page

    def _victim_scan(self, now: float, keep: Container[int], read_until: array[float]) -> int:
        """``victim`` past pages that cannot go: each leaf segment in turn, then the parents."""
        for which in (self._first, self._first ^ 1, INNER):
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
            # The list was looked at in full in this reserve: only a page that became a leaf
            # since (at the warm end, behind the scan's mark) may go.
            page = self._tail[which]
            if which != INNER and page != -1 and read_until[page] <= now and page not in keep:
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
        """Walks the leaf segments, then the parents, from their cold ends. ``victim`` steps
        over each page that cannot go at most once a reserve, plus at most one parent that
        becomes a leaf per page taken: so ``count`` pages found with ``skipped + count <=
        steps`` are kept."""
        found = skipped = 0
        walked = 0
        for which in _LISTS:
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
        head, last = -1, -1
        for which in _LISTS:
            first = self._head[which]
            if first == -1:
                continue
            if last == -1:
                head = first
            else:
                nxt[last] = first
            last = self._tail[which]
        return nxt, head

    def copy(self) -> PrefixPolicy:
        twin = PrefixPolicy.__new__(PrefixPolicy)
        twin._prev, twin._next = self._prev[:], self._next[:]
        twin._parent, twin._kids, twin._stamp = self._parent[:], self._kids[:], self._stamp[:]
        twin._flags = self._flags[:]
        twin._head, twin._tail = list(self._head), list(self._tail)
        twin._clock, twin.dead = self._clock, self.dead
        twin._count, twin._hot = self._count, self._hot
        twin._left, twin._moved, twin._dry = self._left, list(self._moved), list(self._dry)
        twin._now, twin._hints = self._now, dict(self._hints)
        twin._first = self._first
        return twin

    def problem(self, capacity: int) -> str | None:
        from kvmeta.core.invariants import prefix_problem

        return prefix_problem(self, capacity)

    def parent_of(self, page: int) -> int:
        """The live parent of a held page, or -1 (a root, or its parent is gone)."""
        up = self._parent[page]
        return up if up >= 0 and self._valid(page, up) else -1

    def protected(self, page: int) -> bool:
        """Whether held ``page`` was used since it was stored (for checks and tests)."""
        return bool(self._flags[page] & _HOT)

    # ------------------------------------------------------------------ internals

    def _valid(self, page: int, up: int) -> bool:
        """Whether held ``page``'s link to ``up`` still names the page it was made to."""
        return self._kids[up] > 0 and self._stamp[up] <= self._stamp[page]

    def _relink(self, page: int, up: int) -> None:
        """Give root ``page`` the parent ``up``, older than it so the links stay a forest: a
        page with no stored child is stamped anew when it is not (no link names its stamp)."""
        kids, stamp = self._kids, self._stamp
        if kids[up] <= 0 or kids[page] <= 0:
            return
        if stamp[up] >= stamp[page]:
            if kids[page] != 1:
                return
            self._clock += 1
            stamp[page] = self._clock
        self._parent[page] = up
        kids[up] += 1
        if kids[up] == 2:
            self._unlink(self._flags[up] & _HOT, up)
            self._link_tail(INNER, up)

    def _drop(self, page: int) -> None:
        """``page`` stops being held: unlink it, orphan its children, tell its parent."""
        kids = self._kids
        children = kids[page] - 1
        hot = self._flags[page] & _HOT
        self._unlink(hot if children == 0 else INNER, page)
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
        self._count -= 1
        if hot:
            self._hot -= 1

    def _to_leaf(self, page: int) -> None:
        """``page``'s last child went: it becomes a leaf, the next victim of the probation
        leaves or the warmest of the protected ones (module docstring)."""
        if page == self._moved[INNER]:
            # The scan's mark leaves the list: the pages after it were moved too.
            self._moved[INNER] = self._next[page]
        self._unlink(INNER, page)
        if self._flags[page] & _HOT:
            self._link_tail(PROTECTED, page)
        else:
            self._link_head(PROBATION, page)

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

    def _link_head(self, which: int, page: int) -> None:
        head = self._head[which]
        self._prev[page] = -1
        self._next[page] = head
        if head == -1:
            self._tail[which] = page
        else:
            self._prev[head] = page
        self._head[which] = page

    def _link_tail(self, which: int, page: int) -> None:
        tail = self._tail[which]
        self._prev[page] = tail
        self._next[page] = -1
        if tail == -1:
            self._head[which] = page
        else:
            self._next[tail] = page
        self._tail[which] = page
