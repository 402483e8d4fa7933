"""The page invariant, checked in full: for tests after every step and for ``kvmeta check``.

FREE + RESERVED + STORED = num_pages (pages past the arrays' capacity are FREE and never handed
out), the three sets are disjoint, key -> page and page -> key agree both ways, every FREE page
is handed out by the allocator exactly once, and the eviction policy is sound and holds exactly
the STORED pages. O(pages ever used): never call it on a request path.

A server checks a ``copy_pool`` instead (``check_copy``): the copy is taken in one step (C-speed
copies, tens of milliseconds at 10^6 pages) and checked in a thread, so the event loop keeps
serving while the pool changes under it.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from kvmeta.core.hash_index import head_hashes
from kvmeta.core.pool import FREE, RESERVED, STORED, Pool

__all__ = [
    "InvariantViolation",
    "PoolCopy",
    "check_copy",
    "check_hash_index",
    "check_pool",
    "copy_pool",
]


class InvariantViolation(AssertionError):
    """Raised when a pool's structures disagree; the message says where."""


class PoolCopy:
    """The structures ``check_pool`` reads, copied from a pool at one instant (same names)."""

    def __init__(self, pool: Pool) -> None:
        self.num_pages = pool.num_pages
        self._state = bytes(pool._state)
        self._page_key = pool._page_key[:]
        self._stored = dict(pool._stored)
        self._reserved = dict(pool._reserved)
        self._holders = dict(pool._holders)
        self._res_deadline = dict(pool._res_deadline)
        self._free = pool._free[:]
        self._unused = pool._unused
        self._cooling = list(pool._cooling)
        self._held = pool._held[:]
        self._frontier = pool._frontier
        self._withheld = pool._withheld
        self._withheld_new = list(pool._withheld_new)
        self._policy = pool._policy.copy()


def copy_pool(pool: Pool) -> PoolCopy:
    """A consistent copy of ``pool`` for ``check_copy``; never suspends, so take it on the
    thread that mutates the pool and check it anywhere."""
    return PoolCopy(pool)


def check_copy(copy: PoolCopy) -> None:
    """``check_pool`` on a copy; raises ``InvariantViolation`` the same way."""
    _check(copy)


def check_pool(pool: Pool) -> None:
    """Raise ``InvariantViolation`` naming the first inconsistency found in ``pool``."""
    _check(pool)


def check_hash_index(stored_keys: list[str], counts: dict[int, int]) -> None:
    """A pool's hash index (``HashIndex.counts``) holds exactly its stored keys' hashes, each
    as many times as stored keys share it: a missing hash would hide a stored page from a
    router, a stale one would advertise an evicted page."""
    expected = Counter(head_hashes(stored_keys))
    if counts != expected:
        stale = [h for h in counts if counts[h] != expected.get(h)]
        missing = [h for h in expected if h not in counts]
        raise InvariantViolation(
            f"hash index out of step with the stored keys: {len(stale)} hash(es) with a wrong "
            f"count (e.g. {stale[:3]}), {len(missing)} missing (e.g. {missing[:3]})"
        )


def _check(pool: Any) -> None:
    """The check itself, over a ``Pool`` or a ``PoolCopy`` (they share attribute names)."""
    n = pool.num_pages
    state = pool._state
    page_key = pool._page_key
    cap = len(state)
    _expect(
        cap <= n and len(page_key) == cap,
        f"per-page arrays have the wrong length ({cap} states for {n} pages)",
    )
    _expect(pool._frontier <= cap, "the frontier is past the capacity")
    counts = [state.count(FREE) + n - cap, state.count(RESERVED), state.count(STORED)]
    _expect(sum(counts) == n, f"states do not add up: {counts} for {n} pages")
    _expect(counts[STORED] == len(pool._stored), "STORED pages != stored keys")
    _expect(counts[RESERVED] == len(pool._reserved), "RESERVED pages != reserved keys")
    _expect(not (pool._stored.keys() & pool._reserved.keys()), "a key is both STORED and RESERVED")
    for key, page in pool._stored.items():
        _expect(
            state[page] == STORED and page_key[page] == key, f"stored {key!r}->{page} disagrees"
        )
    for key, page in pool._reserved.items():
        _expect(
            state[page] == RESERVED and page_key[page] == key, f"reserved {key!r}->{page} disagrees"
        )
        _expect(page in pool._res_deadline, f"reserved page {page} has no lease deadline")
    reserved_pages = set(pool._reserved.values())
    _expect(set(pool._holders) <= reserved_pages, "holder count for a page not RESERVED")
    _expect(all(n >= 2 for n in pool._holders.values()), "holder count below two is implicit")
    _expect(set(pool._res_deadline) == reserved_pages, "lease table != reserved pages")
    _expect(0 <= pool._unused <= n, f"first never-used page {pool._unused} is outside 0..{n}")
    never_used = range(pool._unused, cap)  # and every page past the capacity
    _expect(all(state[p] == FREE for p in never_used), "a never-used page is not FREE")
    _expect(pool._unused <= pool._frontier, f"page {pool._unused} is past the frontier")
    allocatable = [
        *pool._free,
        *(page for _, page in pool._cooling),
        *pool._held,
        *never_used,
    ]
    _expect(len(allocatable) == len(set(allocatable)), "a page is in the free stack twice")
    free_pages = {p for p in range(cap) if state[p] == FREE}
    _expect(set(allocatable) <= free_pages, "a page in the free stack is not FREE")
    # FREE pages outside the allocator are exactly the withheld ones (removal not yet durable).
    _expect(
        len(free_pages) - len(allocatable) == pool._withheld,
        f"{len(free_pages) - len(allocatable)} FREE pages outside the allocator, "
        f"{pool._withheld} withheld",
    )
    _expect(pool._withheld >= len(pool._withheld_new), "uncollected withheld pages miscounted")
    for page in free_pages:
        _expect(page_key[page] is None, f"FREE page {page} still names a key")
    _check_policy(pool)


def _check_policy(pool: Any) -> None:
    """The eviction policy's own structures are sound and its order holds exactly the STORED
    pages, each once (what a snapshot writes and a reserve may evict)."""
    policy = pool._policy
    problem = policy.problem(len(pool._state))
    _expect(problem is None, f"eviction policy: {problem}")
    seen: list[int] = []
    for page in policy.chain().pages():
        _expect(len(seen) <= len(pool._stored), "eviction order has a cycle or extra pages")
        seen.append(page)
    _expect(sorted(seen) == sorted(pool._stored.values()), "eviction order != STORED pages")


def _expect(ok: bool, what: str) -> None:
    if not ok:
        raise InvariantViolation(what)


def prefix_problem(policy: Any, capacity: int) -> str | None:
    """What is wrong with a ``core.prefix.PrefixPolicy``'s structures (None: nothing): its three
    lists are sound and hold each run's tail once (unused leaf runs, used ones, runs with
    children), each run is a sound chain from its tail to its first page and every held page is
    in one, the held and used counts match, every child count and the dead count match the
    parent links, and every link to another run names an older page (so the links form a
    forest). O(pages ever used)."""
    from kvmeta.core import runs as p

    arrays = (
        policy._prev,
        policy._next,
        policy._parent,
        policy._kids,
        policy._stamp,
        policy._flags,
    )
    if any(len(arr) != capacity for arr in arrays):
        return f"prefix arrays cover {[len(a) for a in arrays]} pages, not {capacity}"
    kids, parent, flags, stamp = policy._kids, policy._parent, policy._flags, policy._stamp
    in_run: set[int] = set()
    for which in p._LISTS:
        steps, tail, before = 0, policy._head[which], -1
        while tail != -1:
            steps += 1
            if steps > capacity:
                return f"prefix list {which} has a cycle"
            if policy._prev[tail] != before:
                return f"prefix back link of page {tail} is wrong"
            bits = flags[tail]
            if not bits & p._TAIL or (bits & p._WHERE) >> p._SHIFT != which:
                return f"page {tail} in list {which} has flags {bits:#x}"
            if (which == p.INNER) != (kids[tail] > 0):
                return f"tail {tail} with child count {kids[tail]} is in list {which}"
            if which == p.PROBATION and bits & p._HOT:
                return f"used tail {tail} is in probation"
            page, above = tail, -1
            while True:
                if page in in_run or not flags[page] & p._HELD:
                    return f"page {page} is in two runs, or not held"
                in_run.add(page)
                if above != -1:
                    if flags[page] & (p._TAIL | p._WHERE):
                        return f"page {page} inside a run has flags {flags[page]:#x}"
                    if policy._next[page] != above:
                        return f"page {page}'s next page in its run is wrong"
                    if stamp[page] != stamp[above]:
                        return f"pages {page} and {above} of one run have different stamps"
                if flags[page] & p._FIRST:
                    break
                above, page = page, parent[page]
                if page < 0 or page >= capacity:
                    return f"page {above} inside a run has parent {page}"
            before, tail = tail, policy._next[tail]
        if policy._tail[which] != before:
            return f"prefix list {which} tail is wrong"
    held = [page for page in range(capacity) if flags[page] & p._HELD]
    if any(kids[page] for page in range(capacity) if not flags[page] & p._HELD):
        return "a page not held counts children"
    if len(in_run) != len(held):
        return f"{len(in_run)} pages in runs, {len(held)} held"
    hot = sum(1 for page in held if policy.protected(page))
    if hot != policy._hot:
        return f"{policy._hot} used pages counted, {hot} found"
    children = Counter(
        up for page in held if flags[page] & p._FIRST and (up := policy.parent_of(page)) >= 0
    )
    dead = 0
    for page in held:
        if kids[page] != children.get(page, 0) or bool(flags[page] & p._PARENT) != (kids[page] > 0):
            return f"page {page} counts {kids[page]} children, has {children.get(page, 0)}"
        up = parent[page]
        if up == -2 or (up >= 0 and policy.parent_of(page) < 0):
            dead += 1
        elif up < -2 or up >= capacity:
            return f"held page {page} has parent {up}"
        if up >= 0 and up == page:
            return f"page {page} is its own parent"
        if stamp[page] > policy._clock:
            return f"page {page} is stamped in the future"
    if dead != policy.dead:
        return f"{policy.dead} dead pages counted, {dead} found"
    return None
