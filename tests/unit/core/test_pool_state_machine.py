"""Random operation sequences with the full page invariant checked after every step, plus a
shadow model of what must be true of keys (a confirmed key maps to the page it was written to,
until it is deleted, cleared or evicted). Each machine runs with the default LRU policy and
with a first-in-first-out one (``policies.FifoPolicy``): the pool's guarantees must not depend
on which policy chooses its victims."""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvmeta.core import FREE, STORED, LruPolicy, Pool, check_pool
from kvmeta.core import pages as pages_module
from kvmeta.core import pool as pool_module
from kvmeta.core.eviction import PolicyFactory
from kvmeta.core.prefix import PrefixPolicy
from kvmeta.errors import InvalidRequest
from tests.unit.core.policies import FifoPolicy

KEYS = st.sampled_from([f"k{i}" for i in range(12)])
# What a reserve may name as its first key's prefix key: nothing, "", or any key, stored or not.
PARENTS = st.none() | st.just("") | KEYS
N = 6


class PoolMachine(RuleBasedStateMachine):
    policy: PolicyFactory = LruPolicy

    def __init__(self) -> None:
        super().__init__()
        self.pool = Pool(N, reservation_ttl=10.0, read_lease=3.0, policy=self.policy)
        self.now = 0.0
        self.written: dict[str, int] = {}  # shadow: confirmed key -> page
        self.handed: list[tuple[str, int]] = []  # (key, page) given to a writer

    @rule(dt=st.floats(min_value=0.0, max_value=4.0))
    def advance(self, dt: float) -> None:
        self.now += dt
        self.pool.expire(self.now)

    def read_leased(self) -> set[int]:
        """Pages whose read lease runs past now: no policy may give one up."""
        self.pool.expire(self.now)
        until = self.pool._read_until
        return {page for page in range(len(until)) if until[page] > self.now}

    @rule(keys=st.lists(KEYS, max_size=8), parent=PARENTS)
    def reserve(self, keys: list[str], parent: str | None = None) -> None:
        evicted: list[tuple[str, int]] = []
        leased = self.read_leased()
        got = self.pool.reserve(keys, self.now, evicted, parent=parent)
        assert len(got) == len(keys)
        for key, page in evicted:
            assert self.written.pop(key) == page  # (and a key reported STORED stays)
            assert page not in leased, f"page {page} evicted under a read lease"
            if self.pool.policy.follows_chains:
                assert key != parent, "the named parent was evicted for its child"
        pages: dict[str, int] = {}
        for key, (hit, page) in zip(keys, got, strict=True):
            if hit:
                assert self.written[key] == page
            elif page >= 0:
                assert pages.setdefault(key, page) == page  # duplicates share a page
                self.handed.append((key, page))
        new_pages = [p for _, (hit, p) in zip(keys, got, strict=True) if not hit and p >= 0]
        distinct = {k: p for k, (h, p) in zip(keys, got, strict=True) if not h and p >= 0}
        assert len(set(distinct.values())) == len(distinct)  # one page per key
        assert set(new_pages) <= set(distinct.values())

    @precondition(lambda self: self.handed)
    @rule(data=st.data(), fail=st.booleans())
    def confirm_or_release(self, data: st.DataObject, fail: bool) -> None:
        key, page = data.draw(st.sampled_from(self.handed))
        before_state = self.pool.state_of(page)
        before_key = self.pool.key_at(page)
        if fail:
            self.pool.confirm([], [page], self.now)
            if before_state == STORED:
                assert self.pool.key_at(page) == before_key  # never frees a STORED page
            return
        outcome = self.pool.confirm([(key, page)], [], self.now)
        if outcome.committed:
            assert before_key == key
            self.written[key] = page
        elif not outcome.refused:
            assert self.written.get(key) == page  # idempotent repeat
        else:
            assert before_key != key or before_state == FREE

    @rule(keys=st.lists(KEYS, max_size=4))
    def get(self, keys: list[str]) -> None:
        got = self.pool.get(keys, self.now)
        for key, page in zip(keys, got, strict=True):
            assert page == self.written.get(key)

    @rule(keys=st.lists(KEYS, max_size=4))
    def exists(self, keys: list[str]) -> None:
        assert self.pool.exists(keys) == [k in self.written for k in keys]

    @rule(keys=st.lists(KEYS, max_size=4))
    def delete(self, keys: list[str]) -> None:
        removed = self.pool.delete(keys, self.now)
        for key, page in removed:
            assert self.written.pop(key) == page
        assert not any(k in self.written for k in keys)

    @rule()
    def clear(self) -> None:
        self.pool.clear(self.now)
        self.written.clear()

    @rule(page=st.integers(min_value=-3, max_value=N + 3))
    def bad_page(self, page: int) -> None:
        if 0 <= page < N:
            return
        snapshot = (bytes(self.pool._state), list(self.pool._page_key))
        try:
            self.pool.confirm([("k0", page)], [page], self.now)
        except InvalidRequest:
            pass
        else:
            raise AssertionError("out-of-range page accepted")
        assert snapshot == (bytes(self.pool._state), list(self.pool._page_key))

    @invariant()
    def page_invariant(self) -> None:
        check_pool(self.pool)
        for key, page in self.written.items():
            assert self.pool.page_of(key) == page


TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = settings(max_examples=300, stateful_step_count=40, deadline=None)


class WithholdingPoolMachine(PoolMachine):
    """The same, for a journaled store's pool: removed pages are withheld until released, and
    pages are evicted ahead of need. A withheld page is never handed to a writer."""

    def __init__(self) -> None:
        super().__init__()
        self.pool.withhold = True
        self.unreleased: list[int] = []

    @rule(count=st.integers(min_value=0, max_value=4))
    def evict_ahead(self, count: int) -> None:
        leased = self.read_leased()
        for key, page in self.pool.evict_ahead(count, self.now):
            assert self.written.pop(key) == page
            assert page not in leased, f"page {page} evicted under a read lease"
        self.unreleased += self.pool.collect_withheld()

    @rule()
    def release(self) -> None:
        self.unreleased += self.pool.collect_withheld()
        self.pool.release_withheld(self.unreleased, self.now)
        self.unreleased = []

    @rule(keys=st.lists(KEYS, max_size=8), parent=PARENTS)
    def reserve(self, keys: list[str], parent: str | None = None) -> None:
        withheld = set(self.unreleased) | set(self.pool._withheld_new)
        assert len(withheld) == self.pool.withheld_count
        before = len(self.handed)
        super().reserve(keys, parent)
        got = {page for _, page in self.handed[before:]}
        assert not (got & withheld)


TestWithholdingPoolMachine = WithholdingPoolMachine.TestCase
TestWithholdingPoolMachine.settings = settings(
    max_examples=200, stateful_step_count=40, deadline=None
)


class CompactingPoolMachine(PoolMachine):
    """The same with the lease queue compacted at every reserve (``_QUEUE_SLACK`` 0): a
    compaction must keep every live lease where its expiry finds it, or a reserved page whose
    writer vanished would never be freed."""

    def __init__(self) -> None:
        super().__init__()
        self._slack = pool_module._QUEUE_SLACK
        pool_module._QUEUE_SLACK = 0
        self.queue_bound = 0  # what the queue may hold until the next reserve

    def teardown(self) -> None:
        pool_module._QUEUE_SLACK = self._slack

    @rule(keys=st.lists(KEYS, max_size=8), parent=PARENTS)
    def reserve(self, keys: list[str], parent: str | None = None) -> None:
        queued = self.pool._queued
        super().reserve(keys, parent)
        if self.pool._queued != queued:  # leases granted: the queue was compacted if too long
            assert self.pool._queued <= 2 * len(self.pool._res_deadline)
        self.queue_bound = self.pool._queued

    @invariant()
    def every_lease_is_queued_under_its_deadline(self) -> None:
        queue = self.pool._res_queue
        assert self.pool._queued == sum(len(pages) for _, pages in queue)
        queued = {(deadline, page) for deadline, pages in queue for page in pages}
        for page, deadline in self.pool._res_deadline.items():
            assert (deadline, page) in queued
        # Only a reserve queues, and it compacts: confirms and expiries between two reserves
        # leave entries behind, never more than the last reserve did.
        assert self.pool._queued <= self.queue_bound


TestCompactingPoolMachine = CompactingPoolMachine.TestCase
TestCompactingPoolMachine.settings = settings(
    max_examples=300, stateful_step_count=40, deadline=None
)


class RestartingPoolMachine(PoolMachine):
    """The same with restarts at any step, crash loops included: the new process gets only
    what a journal holds (the stored keys in LRU order and the recorded frontier) and must
    never hand a page to a writer, nor evict it, while a reservation or read lease that an
    earlier process granted on it would still be running (leases are not journaled). The
    frontier moves one page at a time here, so pages past it are exercised too."""

    def __init__(self) -> None:
        super().__init__()
        self._step = pages_module._FRONTIER_STEP
        pages_module._FRONTIER_STEP = 1
        self.pool = Pool(N, reservation_ttl=10.0, read_lease=3.0, policy=self.policy)
        self.reads: dict[int, float] = {}  # page -> end of the latest read lease granted
        self.protected: dict[int, float] = {}  # page -> end of an earlier run's lease on it

    def teardown(self) -> None:
        pages_module._FRONTIER_STEP = self._step

    @rule(keys=st.lists(KEYS, max_size=4))
    def get(self, keys: list[str]) -> None:
        for key, page in zip(keys, self.pool.get(keys, self.now), strict=True):
            assert page == self.written.get(key)
            if page is not None:
                self.reads[page] = self.now + self.pool.read_lease

    @rule(keys=st.lists(KEYS, max_size=8), parent=PARENTS)
    def reserve(self, keys: list[str], parent: str | None = None) -> None:
        stored_before = dict(self.pool._stored)
        before = len(self.handed)
        super().reserve(keys, parent)
        for key, page in self.handed[before:]:
            until = self.protected.get(page, 0.0)
            assert until <= self.now, f"page {page} handed to {key!r} {until - self.now}s early"
        for key, page in stored_before.items():
            if key not in self.pool._stored:  # evicted by this reserve
                until = self.protected.get(page, 0.0)
                assert until <= self.now, f"page {page} evicted {until - self.now}s early"

    @rule()
    def restart(self) -> None:
        old = self.pool
        old.expire(self.now)
        for page, deadline in old._res_deadline.items():
            self.protected[page] = max(self.protected.get(page, 0.0), deadline)
        for page, until in self.reads.items():
            if until > self.now:
                self.protected[page] = max(self.protected.get(page, 0.0), until)
        self.reads = {}
        durable = dict(old.stored_items())  # what the journal holds, coldest first
        self.pool = Pool.from_lru(
            N,
            durable,
            reservation_ttl=10.0,
            read_lease=3.0,
            frontier=old.frontier,
            policy=self.policy,
        )
        self.pool.hold_after_restart(self.now)
        assert self.written == durable


TestRestartingPoolMachine = RestartingPoolMachine.TestCase
TestRestartingPoolMachine.settings = settings(
    max_examples=300, stateful_step_count=50, deadline=None
)


# The same machines with the victims chosen first in, first out: fewer examples each, since
# what they check of the pool is the same and the LRU runs above at full depth.
FIFO_SETTINGS = settings(max_examples=150, stateful_step_count=40, deadline=None)


# ... and with leaf-first eviction (``core.prefix``), whose parent links come from the order of
# each reserve's keys and whose victims skip any page with a stored child while a leaf can go.
# Each machine under each policy is a test class of its own (``TestFifoPoolMachine``, ...).
for _policy in (FifoPolicy, PrefixPolicy):
    for _machine in (PoolMachine, WithholdingPoolMachine, RestartingPoolMachine):
        _name = _policy.__name__.removesuffix("Policy") + _machine.__name__
        _case = type(_name, (_machine,), {"policy": _policy}).TestCase
        _case.settings = FIFO_SETTINGS
        globals()["Test" + _name] = _case
del _policy, _machine, _name, _case
