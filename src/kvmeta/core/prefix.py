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
pages are at most ``HOT_SHARE`` of the stored ones, else from protected: a one-off chain,
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
when it is the reserve's first key, from the ``exists`` just before it (``asked``: the engines
ask for the keys past their own host cache, then reserve the missing ones, so the last leading
hit is the first missing key's parent); and, for pages stored without one (after a restart, or
a request whose first pages were all in an engine's host cache), from the order of a get's
hits (``used``). Every page of one confirm gets the same *stamp* (a counter of confirms), and a
link to another run is valid only to a page stamped earlier, so the links form a forest and a
stale link (its parent removed and the page reused) is recognised in O(1). A page whose parent
is removed while it is stored (a delete, or a forced eviction) is *dead*: no leading-hit lookup
can reach it (``dead``). Parents are not durable: after a restart every page is a run of its
own, in the old order, until requests teach it parents again.

Structures, one entry per page, in C arrays: ``_parent`` (the parent page, or ``_NONE``: a root;
``_GONE``: its parent was not stored when it was), ``_kids`` (runs hanging off it), ``_stamp``,
``_flags`` (held; used; first and last page of its run; the tail's list; has children) and
``_prev``/``_next``: at a tail, the links of its list (three intrusive doubly linked lists,
coldest first); at any other page, ``_next`` is the next page of its run. 17 bytes a page more
than LRU (21 past 2^31 pages). Every operation is O(pages it is handed) plus the scan budget; a
reserve whose keys are all new costs O(1) here besides its victims.
"""

from __future__ import annotations

from array import array
from collections.abc import Container, Iterable, Mapping

from kvmeta.core.eviction import EvictionPolicy, Order
from kvmeta.core.pages import page_typecode

__all__ = ["HOT_SHARE", "PrefixPolicy"]

_NONE = -1  # no parent: the first key of its request
_GONE = -2  # its parent key was not stored when it was
# Keys whose parent an ``exists`` told (``asked``) kept until their reserve: a few requests'
# worth per engine.
_HINTS = 4096
# The share of stored pages the protected runs may keep from eviction (module docstring);
# chosen by replaying traces (benchmarks/README.md, "Eviction").
HOT_SHARE = 0.4

PROBATION = 0
PROTECTED = 1
INNER = 2
_LISTS = (PROBATION, PROTECTED, INNER)
# ``_flags`` bits.
_HOT = 1  # used since it was stored
_FIRST = 2  # the first page of its run: ``_parent`` names another run's page, or none
_TAIL = 4  # the last page of its run: in a list, which bits 3-4 name
_SHIFT = 3
_WHERE = 3 << _SHIFT
_HELD = 32  # STORED: held by the policy
_PARENT = 64  # other runs hang off it (``_kids`` > 0)
_TAILS = tuple(_TAIL | (which << _SHIFT) for which in _LISTS)  # a tail's bits per list


class PrefixPolicy(EvictionPolicy):
    """Evicts leaves first (pages no stored page names as parent), by runs, in two LRU
    segments."""

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
        "_cold",
        "_hot",
        "_dead",
        "_left",
        "_moved",
        "_dry",
        "_scanned",
        "_first",
        "_hints",
        "_orig",
        "_cur",
        "_where",
        "_eat",
        "_stop",
        "_ended",
        "_given",
    )

    def __init__(self, num_pages: int) -> None:
        self._orig = -1  # (below)
        self._scanned = False
        self._cold = 0  # held pages not flagged _HOT
        self._hot = 0  # held pages flagged _HOT
        super().__init__()
        typecode = page_typecode(num_pages)
        self._prev = array(typecode)
        self._next = array(typecode)
        self._parent = array(typecode)
        self._kids = array("i")
        self._stamp = array("q")
        self._flags = array("B")
        self._head = [-1, -1, -1]
        self._tail = [-1, -1, -1]
        self._clock = 0
        self._dead = 0  # ``dead``
        # Per reserve (reset by setting ``budget``): steps left, the first tail each list's
        # scan moved to its warm end, and whether a list is known to hold nothing evictable.
        self._left = 0
        self._moved = [-1, -1, -1]
        self._dry = [False, False, False]
        self._scanned = False  # whether ``_moved`` or ``_dry`` changed since they were reset
        self._first = PROBATION
        # key -> (page, its stamp) of the stored key before it in an ``exists`` (``asked``).
        self._hints: dict[str, tuple[int, int]] = {}
        # What ``victim`` is eating (``_settle``): the tail of the list's first run when it
        # started (-1: nothing) and the list, the tail of the run it is in, the next page to
        # take (or -2 - the last taken), whether that run is gone, and the flags that stop the
        # eating (in probation, a used page).
        self._orig = -1
        self._cur = -1
        self._where = PROBATION
        self._eat = -1
        self._stop = 0
        self._ended = False
        # RESERVED pages a reserve gave a parent (``reserved``): ``_parent`` and ``_stamp``
        # hold it and its stamp until the confirm.
        self._given: set[int] = set()

    @property
    def dead(self) -> int:
        """Stored pages whose parent is gone (module docstring), kept up to date in O(1)."""
        if self._orig >= 0:
            self._settle()
        return self._dead

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
        hot = self._hot
        self._first = PROTECTED if hot > (hot + self._cold) * HOT_SHARE else PROBATION

    # ------------------------------------------------------------------ sizing, loading

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
        self._cold = len(pages)

    # ------------------------------------------------------------------ what the pool reports

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

    def reserved(self, keys: list[str], out: list[tuple[bool, int]], plain: bool) -> None:
        """Give each new page that does not follow another new page of this reserve its parent
        (the page of the key before it, or the ``exists`` hint for the first key); the others
        get theirs from the confirm's order (module docstring). ``plain`` (every key got a new
        page of its own): only the first page needs one, in O(1)."""
        if self._orig >= 0:
            self._settle()
        parent, stamp = self._parent, self._stamp
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
            self._given.add(page)
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
                self._given.add(page)
            up, up_stamp, before_new = page, 0, True

    def added(self, pages: list[int]) -> None:
        """Each page's parent is the page before it in the batch, or the one its reserve gave:
        the batch is one run, or a few where a reserve named another parent. Inlined: it runs
        for every page stored."""
        if self._orig >= 0:
            self._settle()
        parent, stamp, flags, nxt = self._parent, self._stamp, self._flags, self._next
        self._clock += 1
        clock = self._clock
        held = _HELD
        given = self._given
        before = -1
        for page in pages:
            if before < 0 or (given and page in given):
                before = self._start(page, before, clock)
                continue
            # The common case: the next page of the run.
            parent[page] = before
            stamp[page] = clock
            flags[page] = held
            nxt[before] = page
            before = page
        if before >= 0:
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
        self._cold += len(pages)

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
        self._cold -= hot

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
        kids, flags, parent = self._kids, self._flags, self._parent
        for which in _LISTS:
            tail = self._head[which]
            while tail != -1:
                page = tail
                while True:
                    kids[page] = 0
                    bits = flags[page]
                    flags[page] = 0
                    if bits & _FIRST:
                        break
                    page = parent[page]
                tail = self._next[tail]
        self._head = [-1, -1, -1]
        self._tail = [-1, -1, -1]
        self._cold = self._hot = 0
        self._dead = 0

    # ------------------------------------------------------------------ choosing victims

    def victim(self, now: float, keep: Container[int], read_until: array[float]) -> int:
        """The next page of the run being eaten, when it can go; the list work for the pages
        a run gives up is done once, when the eating stops (``_settle``). Inlined and lean:
        it runs for every page evicted."""
        page = self._eat
        if page < 0 or read_until[page] > now or page in keep:
            return self._next_run(now, keep, read_until)
        flags = self._flags
        bits = flags[page]
        flags[page] = 0
        if bits & _HOT:
            self._hot -= 1
        else:
            self._cold -= 1
        up = self._parent[page]
        if bits & _FIRST:
            # The run is gone; the next run of its list follows, unless its going moves its
            # parent's run (``_settle`` does that).
            after = self._next[self._cur]
            if after != -1 and up != _NONE and not self._gone_child(page, up):
                after = -1
            if after == -1:
                self._eat = -2 - page
                self._ended = True
            else:
                self._cur = self._eat = after
            return page
        if flags[up] & self._stop:
            # Stop before a page with child runs, and in probation before a used one.
            self._eat = -2 - page
            self._ended = False
        else:
            self._eat = up
        return page

    def _gone_child(self, first: int, up: int) -> bool:
        """``_lost_child`` for a run ``victim`` ate whole, when that moves no run: False (and
        nothing done) when it would."""
        flags = self._flags
        if up >= 0 and flags[up] & _HELD and self._stamp[up] < self._stamp[first]:
            kids = self._kids
            if kids[up] == 1 and flags[up] & _TAIL:
                return False  # its parent's run becomes a leaf
            kids[up] -= 1
            if kids[up] == 0:
                flags[up] &= ~_PARENT
        else:
            self._dead -= 1  # its parent was gone already
        return True

    def _next_run(self, now: float, keep: Container[int], read_until: array[float]) -> int:
        """``victim`` when the run being eaten has nothing left to give: settle it, then start
        on the coldest leaf run of the segment to take from, or scan."""
        if self._orig >= 0:
            self._settle()
        heads = self._head
        first = self._first
        page = heads[first]
        if page == -1:
            first ^= 1
            page = heads[first]
        if page == -1 or read_until[page] > now or page in keep:
            return self._victim_scan(now, keep, read_until)
        self._orig = self._cur = page
        self._where = first
        self._stop = _PARENT | _HOT if first == PROBATION else _PARENT
        self._eat = page
        return self.victim(now, keep, read_until)

    def _settle(self) -> None:
        """Give up the pages ``victim`` took: the root runs from the cold end of the list up to
        the run it is in (``_cur``), whole, and that run's pages from its tail down to the last
        one taken. That run is then gone, or the page before that is its tail, in the list it
        belongs in."""
        orig, cur, eat, which = self._orig, self._cur, self._eat, self._where
        self._orig = self._eat = -1
        if cur != orig:  # the runs before ``cur`` went whole: ``cur`` heads the list
            self._head[which] = cur
            self._prev[cur] = -1
            if eat == cur:
                return  # nothing taken from it
        # ``_eat``: the next page to take (the last taken is the one after it in the run), or
        # -2 - the last taken, when the eating stopped there.
        last = -2 - eat if eat < -1 else self._next[eat]
        flags, parent = self._flags, self._parent
        up = parent[last]
        if eat < -1 and self._ended:  # the run's first page went
            self._unlink(which, cur)
            if up >= 0:
                self._lost_child(last, up)
            elif up == _GONE:
                self._dead -= 1
            return
        self._replace(which, cur, up)
        flags[up] |= _TAILS[which]
        if flags[up] & _PARENT:
            self._move(up, INNER, False)
        elif which == PROBATION and flags[up] & _HOT:
            self._move(up, PROTECTED, False)

    def _victim_scan(self, now: float, keep: Container[int], read_until: array[float]) -> int:
        """``victim`` past runs whose tail cannot go: each leaf segment in turn, then the runs
        with children."""
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
            # The list was looked at in full in this reserve: only a run that became a leaf
            # since (at the warm end, behind the scan's mark) may go.
            page = self._tail[which]
            if which != INNER and page != -1 and read_until[page] <= now and page not in keep:
                self._drop(page)
                return page
        return self._inside(now, keep, read_until)

    def _inside(self, now: float, keep: Container[int], read_until: array[float]) -> int:
        """The last resort, when no run's tail can go (all read-leased or kept): a page inside
        a run, coldest run first, one step of the budget per page looked at. The pages after
        it in its run are then dead (a reserve must find a page while one can go)."""
        parent, flags, nxt = self._parent, self._flags, self._next
        for which in (self._first, self._first ^ 1, INNER):
            tail = self._head[which]
            while tail != -1:
                page = tail
                while not flags[page] & _FIRST:
                    if self._left <= 0:
                        return -1
                    self._left -= 1
                    page = parent[page]
                    if read_until[page] <= now and page not in keep:
                        self._drop(page)
                        return page
                tail = nxt[tail]
        return -1

    def _scan(self, which: int, now: float, keep: Container[int], read_until: array[float]) -> int:
        """The first evictable tail of list ``which``, moving each it steps over to the warm
        end (a read-leased page was just read), one step of the budget each; -1: none (the
        list is then dry for this reserve), -2: the budget ran out."""
        page = self._head[which]
        while page != -1:
            if page == self._moved[which]:
                break  # every run of the list has been looked at in this reserve
            if read_until[page] <= now and page not in keep:
                return page
            if self._left <= 0:
                return -2
            self._left -= 1
            self._unlink(which, page)
            self._link_tail(which, page)
            if self._moved[which] == -1:
                self._moved[which] = page
                self._scanned = True
            page = self._head[which]
        self._dry[which] = True
        self._scanned = True
        return -1

    def can_evict(
        self, count: int, steps: int, now: float, keep: Container[int], read_until: array[float]
    ) -> bool:
        """Walks the leaf segments, then the runs with children, from their cold ends, and
        each run from its tail while its pages can go. ``victim`` steps over each run whose
        tail cannot go at most once a list a reserve, and a run stopped partway is found again
        in another list: so ``count`` pages found with ``3 * skipped + count <= steps`` are
        kept."""
        if self._orig >= 0:
            self._settle()
        found = skipped = 0
        walked = 0
        flags, parent = self._flags, self._parent
        for which in _LISTS:
            tail = self._head[which]
            while tail != -1 and walked < steps:
                walked += 1
                page = tail
                while True:
                    if read_until[page] > now or page in keep:
                        skipped += 1
                        break
                    found += 1
                    if found >= count:
                        return 3 * skipped + count <= steps
                    if flags[page] & _FIRST:
                        break
                    page = parent[page]
                    if flags[page] & _PARENT and which != INNER:
                        skipped += 1  # found again among the runs with children
                        break
                tail = self._next[tail]
        return count <= 0

    # ------------------------------------------------------------------ snapshots, checks

    def chain(self) -> Order:
        """Copies of the links; the victim order is walked from them later (``RunOrder``)."""
        if self._orig >= 0:
            self._settle()
        return RunOrder(self._parent[:], self._next[:], self._flags[:], list(self._head))

    def copy(self) -> PrefixPolicy:
        if self._orig >= 0:
            self._settle()
        twin = PrefixPolicy.__new__(PrefixPolicy)
        twin._prev, twin._next = self._prev[:], self._next[:]
        twin._parent, twin._kids, twin._stamp = self._parent[:], self._kids[:], self._stamp[:]
        twin._flags = self._flags[:]
        twin._head, twin._tail = list(self._head), list(self._tail)
        twin._clock, twin._dead = self._clock, self._dead
        twin._cold, twin._hot = self._cold, self._hot
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

    # ------------------------------------------------------------------ internals

    def _close(self, tail: int) -> None:
        """``tail`` ends a run just stored: a leaf run, the warmest of probation."""
        self._flags[tail] |= _TAILS[PROBATION]
        self._link_tail(PROBATION, tail)

    def _lost_child(self, first: int, up: int) -> None:
        """Run ``first`` (gone) hung off ``up``: ``up`` has one child run fewer, and when it
        was its run's tail and that run's last child, the run is a leaf run again."""
        if self._flags[up] & _HELD and self._stamp[up] < self._stamp[first]:
            kids = self._kids
            kids[up] -= 1
            if kids[up] == 0:
                flags = self._flags
                flags[up] &= ~_PARENT
                if flags[up] & _TAIL:
                    self._to_leaf(up)
        else:
            self._dead -= 1

    def _add_child(self, up: int) -> None:
        """A run now hangs off ``up``; its run, when ``up`` is its tail, has children now."""
        kids = self._kids
        kids[up] += 1
        if kids[up] == 1:
            flags = self._flags
            flags[up] |= _PARENT
            if flags[up] & _TAIL:  # a leaf run until now
                self._move(up, INNER, False)

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

    def _drop(self, page: int) -> None:
        """``page`` stops being held, wherever it is in its run: its child runs are orphaned
        (dead); a page after it in its run starts a run of its own, dead too; the page before
        it ends one."""
        kids, flags, parent = self._kids, self._flags, self._parent
        bits = flags[page]
        self._dead += kids[page]
        kids[page] = 0
        flags[page] = 0
        up = parent[page]
        if bits & _TAIL:
            which = (bits & _WHERE) >> _SHIFT
            if bits & _FIRST:
                self._unlink(which, page)
            else:
                self._replace(which, page, up)
                flags[up] |= _TAILS[which]
                self._place(up, which)
        else:
            after = self._next[page]  # the next page of its run
            parent[after] = _GONE
            flags[after] |= _FIRST
            self._dead += 1
            if not bits & _FIRST:
                flags[up] |= _TAILS[PROBATION]
                self._link_tail(PROBATION, up)
                self._place(up, PROBATION)
        if bits & _FIRST:
            if up >= 0:
                self._lost_child(page, up)
            elif up == _GONE:
                self._dead -= 1
        if bits & _HOT:
            self._hot -= 1
        else:
            self._cold -= 1

    def _place(self, tail: int, which: int) -> None:
        """Move the run of ``tail`` (in list ``which``, its tail just changed) to the list its
        tail now belongs in: the runs with children, or a leaf segment (``_to_leaf``)."""
        if self._flags[tail] & _PARENT:
            if which != INNER:
                self._move(tail, INNER, False)
        elif which == INNER:
            self._to_leaf(tail)
        elif which == PROBATION and self._flags[tail] & _HOT:
            self._move(tail, PROTECTED, False)

    def _to_leaf(self, tail: int) -> None:
        """``tail``'s run has no child at its tail any more: a leaf run, the next victim of
        probation or the warmest of protected (module docstring)."""
        if tail == self._moved[INNER]:
            # The scan's mark leaves the list: the runs after it were moved too.
            self._moved[INNER] = self._next[tail]
        if self._flags[tail] & _HOT:
            self._move(tail, PROTECTED, False)
        else:
            self._move(tail, PROBATION, True)

    def _move(self, tail: int, which: int, head: bool) -> None:
        """Move ``tail``'s run to the cold end (``head``) or the warm end of list ``which``."""
        flags = self._flags
        bits = flags[tail]
        self._unlink((bits & _WHERE) >> _SHIFT, tail)
        flags[tail] = bits & ~_WHERE | (which << _SHIFT)
        if head:
            self._link_head(which, tail)
        else:
            self._link_tail(which, tail)

    def _replace(self, which: int, old: int, new: int) -> None:
        """``new`` takes ``old``'s place in list ``which``."""
        prev, nxt = self._prev, self._next
        before, after = prev[old], nxt[old]
        prev[new], nxt[new] = before, after
        if before == -1:
            self._head[which] = new
        else:
            nxt[before] = new
        if after == -1:
            self._tail[which] = new
        else:
            prev[after] = new
        if self._moved[which] == old:
            self._moved[which] = new

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


class RunOrder(Order):
    """A ``PrefixPolicy``'s victim order from copies of its links: each list's runs, coldest
    first, each run from its tail to its first page."""

    __slots__ = ("_parent", "_flags", "_heads")

    def __init__(self, parent: array[int], nxt: array[int], flags: array[int], heads: list[int]):
        super().__init__(nxt, heads[0])
        self._parent, self._flags, self._heads = parent, flags, heads

    def pages(self) -> array[int]:
        out = array(self._parent.typecode)
        add, parent, nxt, flags = out.append, self._parent, self.nxt, self._flags
        for tail in self._heads:
            while tail != -1:
                page = tail
                while True:
                    add(page)
                    if flags[page] & _FIRST:
                        break
                    page = parent[page]
                tail = nxt[tail]
        return out
