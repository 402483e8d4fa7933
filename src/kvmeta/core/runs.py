"""The run lists behind ``core.prefix``'s leaf-first eviction, and how victims come off them.

A *run* is the pages of one confirm, in order, each the parent of the next; only its last page,
its *tail*, can be a leaf, so only tails are in the lists: leaf runs in two segments (probation:
the tail unused since stored; protected: used since), runs whose tail has children in a third,
each coldest first. ``RunLists`` holds the per-page arrays and the lists, takes victims (a run
eaten from its tail, a page per ``victim`` call, the lists fixed once when the eating stops,
``_settle``), and moves runs between lists as pages come and go. What the pool reports, how
parents are learned and when to take from which segment are ``core.prefix.PrefixPolicy``'s;
``core.prefix`` says why.

Per page, in C arrays: ``_parent`` (the parent page, or ``_NONE``: a root; ``_GONE``: its parent
was not stored when it was), ``_kids`` (runs hanging off it), ``_stamp`` (the confirm that
stored it), ``_flags`` (held; used; first and last page of its run; the tail's list; has
children) and ``_prev``/``_next``: at a tail, the links of its list; at any other page, ``_next``
is the next page of its run.
"""

from __future__ import annotations

from array import array
from collections.abc import Container

from kvmeta.core.eviction import EvictionPolicy, Order
from kvmeta.core.pages import page_typecode

__all__ = ["INNER", "PROBATION", "PROTECTED", "RunLists", "RunOrder"]

_NONE = -1  # no parent: the first key of its request
_GONE = -2  # its parent key was not stored when it was

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


class RunLists(EvictionPolicy):
    """The lists of runs and the victims taken from them (module docstring); a policy
    completes it with what the pool reports (``core.prefix.PrefixPolicy``)."""

    __slots__ = (
        "_prev",
        "_next",
        "_parent",
        "_kids",
        "_stamp",
        "_flags",
        "_head",
        "_tail",
        "_hot",
        "_dead",
        "_left",
        "_moved",
        "_dry",
        "_scanned",
        "_first",
        "_orig",
        "_cur",
        "_where",
        "_eat",
        "_stop",
        "_ended",
    )

    def __init__(self, num_pages: int) -> None:
        # Read by a subclass's ``budget`` setter, which ``EvictionPolicy.__init__`` calls.
        self._orig = -1
        self._scanned = False
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
        self._dead = 0  # ``dead``
        # Per reserve (reset by setting ``budget``): steps left, the first tail each list's
        # scan moved to its warm end, whether a list is known to hold nothing evictable, and
        # whether either of those changed since they were reset; the segment to take from.
        self._left = 0
        self._moved = [-1, -1, -1]
        self._dry = [False, False, False]
        self._first = PROBATION
        # What ``victim`` is eating (``_settle``): the tail of the list's first run when it
        # started (-1: nothing) and the list, the tail of the run it is in, the next page to
        # take (or -2 - the last taken), whether that run is gone, and the flags that stop the
        # eating (in probation, a used page).
        self._cur = -1
        self._where = PROBATION
        self._eat = -1
        self._stop = 0
        self._ended = False

    @property
    def dead(self) -> int:
        """Stored pages whose parent is gone (``core.prefix``), kept up to date in O(1)."""
        if self._orig >= 0:
            self._settle()
        return self._dead

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
        """Run ``first`` went; ``up`` is its ``_parent``: count one child run fewer, or one dead
        page fewer when the link was already broken. False (and nothing done) when ``up``'s
        run would become a leaf run: that moves it, which ``_lost_child`` does."""
        if up == _NONE:
            return True
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
        """Give up the pages ``victim`` took: the runs it ate whole from the cold end of the
        list up to the run it is in (``_cur``; their parents were told, ``_gone_child``), and
        that run's pages from its tail down to the last one taken. That run is then gone, or
        the page before that is its tail, in the list it belongs in."""
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
        up = self._parent[last]
        if eat < -1 and self._ended:  # the run's first page went
            self._unlink(which, cur)
            self._lost_child(last, up)
        else:
            self._new_tail(which, cur, up)

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
        """Walks the lists in ``victim``'s order (the segment a reserve starts with, the other,
        then the runs with children), each from its cold end, and each run from its tail while
        ``victim`` would eat on: not past a read-leased or kept page, a page with child runs,
        or, in probation, a used one; among the runs with children, not past a page without
        (the rest is a leaf run then). Eating costs ``victim`` no step; stepping over a run
        whose tail cannot go costs one, once a list. So each run met that cannot go costs one,
        and so does each that can: what it leaves (its rest, or a parent's run that becomes a
        leaf) may move to a list ``victim`` looks at later, where it may have to be stepped
        over once more; a kept page two (a hit moves its run). ``count`` pages found at a cost
        within ``steps`` are kept."""
        if self._orig >= 0:
            self._settle()
        found = cost = walked = 0
        flags, parent = self._flags, self._parent
        first = self._first_segment()
        for which in (first, first ^ 1, INNER):
            stop = _PARENT | _HOT if which == PROBATION else _PARENT
            tail = self._head[which]
            while tail != -1 and walked < steps:
                walked += 1
                page = tail
                while True:
                    if page in keep:
                        cost += 2
                        break
                    if read_until[page] > now:
                        cost += 1
                        break
                    found += 1
                    if found >= count:
                        return cost <= steps
                    if flags[page] & _FIRST:
                        if parent[page] >= 0:
                            cost += 1  # its parent's run may become a leaf and move
                        break
                    page = parent[page]
                    if bool(flags[page] & stop) != (which == INNER):
                        cost += 1  # the rest moves to another list
                        break
                tail = self._next[tail]
        return count <= 0

    def _first_segment(self) -> int:
        """The leaf segment a reserve starting now takes victims from first (a subclass's
        ``budget`` setter chooses it)."""
        return self._first

    def chain(self) -> Order:
        """Copies of the links; the victim order is walked from them later (``RunOrder``)."""
        if self._orig >= 0:
            self._settle()
        return RunOrder(self._parent[:], self._next[:], self._flags[:], list(self._head))

    def _close(self, tail: int) -> None:
        """``tail`` ends a run that is in no list (just stored, or split off by a delete): a
        leaf run, the warmest of probation, unless ``_place`` moves it on."""
        self._flags[tail] |= _TAILS[PROBATION]
        self._link_tail(PROBATION, tail)

    def _lost_child(self, first: int, up: int) -> None:
        """``_gone_child``, and when ``first`` was the last child run of ``up``, the tail of
        its run, that run is a leaf run again."""
        if not self._gone_child(first, up):
            self._kids[up] = 0
            self._flags[up] &= ~_PARENT
            self._to_leaf(up)

    def _new_tail(self, which: int, old: int, new: int) -> None:
        """``old``, a tail in list ``which``, went; ``new``, the page before it, ends the run
        now, in the list it belongs in."""
        self._replace(which, old, new)
        self._flags[new] |= _TAILS[which]
        self._place(new, which)

    def _add_child(self, up: int) -> None:
        """A run now hangs off ``up``; its run, when ``up`` is its tail, has children now."""
        kids = self._kids
        kids[up] += 1
        if kids[up] == 1:
            flags = self._flags
            flags[up] |= _PARENT
            if flags[up] & _TAIL:  # a leaf run until now
                self._move(up, INNER, False)

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
                self._new_tail(which, page, up)
        else:
            after = self._next[page]  # the next page of its run
            parent[after] = _GONE
            flags[after] |= _FIRST
            self._dead += 1
            if not bits & _FIRST:
                self._close(up)
                self._place(up, PROBATION)
        if bits & _FIRST:
            self._lost_child(page, up)
        if bits & _HOT:
            self._hot -= 1

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
        probation or the warmest of protected (``core.prefix``)."""
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
