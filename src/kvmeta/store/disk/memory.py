"""State held in this process: the core pools, writing its changes to an optional journal.

``MemoryStore`` is synchronous (the embedded clients call it directly; the server reaches it
through ``store.disk.local.LocalBackend``). It only ever calls down, into its pools and the
journal: what an operation removed comes back to the caller (a reserve's ``Removal``, the
pages the pools withhold, the ``changes`` outbox), and the caller decides what waits for the
disk (``store.disk.writeahead``).

Journal records are the typed records of ``store.disk.codec`` (``NewPool``, ``Commit``, ``Remove``
for deletes and evictions, ``Clear``, ``WorldSize``/``TenantWorldSize``, ``Drop`` for a vLLM
rank removed).

Tenants: every pool is named by a ``PoolId`` that includes its tenant, so two tenants' pools are
different pools even with the same rank and namespace (no shared page, key or eviction). The
vLLM index is per tenant too: each tenant has its own registered ranks (its pools
``PoolId("v", rank, "", tenant)``) and its own world size.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Generator
from operator import itemgetter
from typing import TYPE_CHECKING, Protocol

from kvmeta._types import PoolId
from kvmeta.core.eviction import PolicyFactory
from kvmeta.core.hash_index import HashIndex
from kvmeta.core.lru import LruPolicy
from kvmeta.core.pool import Pool
from kvmeta.errors import Forbidden, NoHashIndex, NotInitialized, PayloadTooLarge, RankInUse
from kvmeta.lograte import warn_limited
from kvmeta.store.base import Budget, InitResult, PoolStats, VIndex, parse_cursor
from kvmeta.store.changes import (
    CLEARED,
    REASON_CAPACITY,
    REASON_CLEAR,
    REASON_DELETE,
    REASON_DROP,
    REMOVED,
    STORED,
    Change,
)
from kvmeta.store.disk.codec import (
    Clear,
    Commit,
    Drop,
    NewPool,
    Record,
    Remove,
    TenantWorldSize,
    WorldSize,
)

if TYPE_CHECKING:  # the caller's request and report (the store never calls the rule)
    from kvmeta.store.disk.writeahead import Removal

__all__ = ["V_EXISTS_STEP", "ChangeSink", "MemoryStore"]

logger = logging.getLogger(__name__)

_first = itemgetter(0)

# ``MemoryStore.v_exists_steps``: key lookups between two pauses of a completeness walk (a
# few ms of CPU: a batch of 65,536 keys stored on 2,048 ranks is 1,024 steps; the walk's
# cost: benchmarks/README.md, "vLLM batch_exists with many ranks").
V_EXISTS_STEP = 1 << 17

# ``MemoryStore.dump``: pages looked at per key asked for, and at least, in one call.
_DUMP_PAGES_PER_KEY = 64
_DUMP_MIN_WINDOW = 4096


class ChangeSink(Protocol):
    """Where durable changes go (the journal). ``append`` must never block on disk."""

    def append(self, record: Record) -> None: ...


class MemoryStore:
    """All pools of one server, synchronous. Not thread-safe: one event loop or one caller."""

    def __init__(
        self,
        *,
        reservation_ttl: float = 300.0,
        read_lease: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
        sink: ChangeSink | None = None,
        hash_index: bool = False,
        policy: PolicyFactory = LruPolicy,
    ) -> None:
        self.reservation_ttl = reservation_ttl
        # Every pool's eviction policy (``--eviction``), recovered pools' too: parents are
        # not journaled, the order is (``core.prefix``).
        self.policy = policy
        self.read_lease = read_lease
        self.clock = clock
        self.sink = sink
        self.pools: dict[PoolId, Pool] = {}  # changed only through add_pool and v_remove
        self.total_pages = 0  # pages of all pools, for --max-total-pages in O(1)
        # Pages and pools per tenant, for its quotas in O(1) (a tenant with none: absent).
        self.tenant_pages: dict[str, int] = {}
        self.tenant_pools: dict[str, int] = {}
        self.size_conflicts: dict[PoolId, int] = {}
        # Each tenant's pinned vLLM world size (absent: not pinned).
        self.vllm_world_sizes: dict[str, int] = {}
        # Each tenant's registered vLLM ranks and their pools (kept with ``pools``), so one
        # tenant's registry and required pools are read without walking every pool of every
        # tenant, or building a PoolId per rank.
        self.vllm_rank_pools: dict[str, dict[int, Pool]] = {}
        # Each change of stored keys (``store.changes``), made next to its journal record
        # because the record does not say why keys went (capacity vs delete); the caller
        # takes them after each operation. None: nobody listens, nothing is built.
        self.changes: list[Change] | None = None
        # Whether new pools withhold the pages their removals free (``Pool.withhold``): set
        # by a caller that keeps the write-ahead rule, which releases them once durable.
        self.withhold = False
        # SGLang pools' stored keys by block hash (``--hash-index``; None: off). Kept in step
        # by ``_record``, so an index changes exactly when the journal does.
        self.hash_indexes: dict[PoolId, HashIndex] | None = {} if hash_index else None

    @property
    def vllm_world_size(self) -> int | None:
        """The default tenant's pinned vLLM world size."""
        return self.vllm_world_sizes.get("")

    @vllm_world_size.setter
    def vllm_world_size(self, world_size: int | None) -> None:
        self._set_world(world_size, "")

    def _set_world(self, world_size: int | None, tenant: str) -> None:
        if world_size is None:
            self.vllm_world_sizes.pop(tenant, None)
        else:
            self.vllm_world_sizes[tenant] = world_size

    # ------------------------------------------------------------------ pools

    def pool(self, pid: PoolId) -> Pool:
        """The pool named ``pid``.

        Raises:
            NotInitialized: in the wording of the pool's dialect.
        """
        pool = self.pools.get(pid)
        if pool is None:
            raise NotInitialized.for_pool(pid.dialect, pid.rank, pid.namespace)
        return pool

    def initialize(self, pid: PoolId, num_pages: int) -> InitResult:
        """Create the pool, or keep an existing one (warning when the size differs)."""
        pool = self.pools.get(pid)
        if pool is not None:
            result = InitResult(created=False, num_pages=pool.num_pages, requested=num_pages)
            if result.conflict:
                self.size_conflicts[pid] = self.size_conflicts.get(pid, 0) + 1
                warn_limited(
                    logger,
                    "size_conflict",
                    "%s re-initialised with num_pages=%d but has %d pages; keeping %d. Two "
                    "engines with different file sizes on one pool would overwrite each "
                    "other's pages: give each its own rank or namespace.",
                    pid,
                    num_pages,
                    pool.num_pages,
                    pool.num_pages,
                )
            return result
        self.add_pool(pid, self._allocate(num_pages))
        self._record(NewPool(pid, num_pages, 0))
        return InitResult(created=True, num_pages=num_pages, requested=num_pages)

    def _allocate(self, num_pages: int) -> Pool:
        """A new empty pool, or a 413 when even its first pages cannot be had; either way
        before anything is changed or journaled. A pool's memory grows with the pages it hands
        out (``core.pool``), so creating one commits only its first step, whatever
        ``num_pages`` is: nothing to check up front, but no MemoryError may become a 500."""
        try:
            return self._new_pool(num_pages)
        except MemoryError:
            raise PayloadTooLarge(
                f"`num_pages` {num_pages}: the allocation of a new pool's first pages failed "
                "(out of memory); nothing was created. Free memory on the machine",
                "num_pages",
            ) from None

    def _new_pool(self, num_pages: int, entries: list[tuple[str, int]] | None = None) -> Pool:
        if entries:
            return Pool.load(
                num_pages,
                entries,
                reservation_ttl=self.reservation_ttl,
                read_lease=self.read_lease,
                policy=self.policy,
            )
        return Pool(
            num_pages,
            reservation_ttl=self.reservation_ttl,
            read_lease=self.read_lease,
            policy=self.policy,
        )

    def load_pool(self, pid: PoolId, num_pages: int, entries: list[tuple[str, int]]) -> None:
        """Install a recovered pool (entries coldest first) without journaling it."""
        self.add_pool(pid, self._new_pool(num_pages, entries))

    def add_pool(self, pid: PoolId, pool: Pool) -> None:
        """Install ``pool`` as ``pid`` (not journaled: callers journal what needs it)."""
        old = self.pools.get(pid)
        if old is not None:
            self._count(pid, -old.num_pages, -1)
        pool.withhold = self.withhold
        self.pools[pid] = pool
        if pid.dialect == "v":
            self.vllm_rank_pools.setdefault(pid.tenant, {})[pid.rank] = pool
        if self.hash_indexes is not None and pid.dialect == "s":
            self.hash_indexes[pid] = HashIndex(pool.stored_keys())
        self._count(pid, pool.num_pages, 1)

    def _count(self, pid: PoolId, pages: int, pools: int) -> None:
        """Add a pool (``pools`` 1) of ``pages`` to the totals, or take one away (-1)."""
        self.total_pages += pages
        tenant = pid.tenant
        left = self.tenant_pools.get(tenant, 0) + pools
        if left:
            self.tenant_pools[tenant] = left
            self.tenant_pages[tenant] = self.tenant_pages.get(tenant, 0) + pages
        else:
            self.tenant_pools.pop(tenant, None)
            self.tenant_pages.pop(tenant, None)

    def withhold_removed(self) -> None:
        """From now on every pool withholds the pages its removals free, until the caller
        releases them (``store.disk.writeahead``: a page is handed out again only once the
        removal of its old key is durable)."""
        self.withhold = True
        for pool in self.pools.values():
            pool.withhold = True

    # ------------------------------------------------------------------ operations

    def exists(self, pid: PoolId, keys: list[str]) -> list[bool]:
        return self.pool(pid).exists(keys)

    def reserve(
        self,
        pid: PoolId,
        keys: list[str],
        removal: Removal | None = None,
        parent: str | None = None,
    ) -> list[tuple[bool, int]]:
        """Reserve ``keys``; with ``removal``, report what was removed for them into it and
        keep its spare (module docstring). ``parent``: the first key's named prefix key
        (``Pool.reserve``)."""
        pool = self.pool(pid)
        evicted = [] if removal is None else removal.evicted
        refused = pool.counters.reservations_refused
        # vLLM's batches are all or nothing (``Pool.reserve``, docs/guarantees.md); SGLang writes
        # the pages it gets, so its batches are per key.
        out = pool.reserve(keys, self.clock(), evicted, pid.dialect == "v", parent)
        if pool.frontier_raised:
            # Pages past the recorded frontier go out only once its new place is journaled
            # (the reply waits for it: ``WriteAhead.after``).
            pool.frontier_raised = False
            self._record(NewPool(pid, pool.num_pages, pool.frontier))
            if removal is not None:
                removal.frontier = True
        if evicted:
            self._record(Remove(pid, evicted))
            if self.changes is not None:
                self._changed(pid, REMOVED, evicted, REASON_CAPACITY)
        # (A call that found nothing evictable already scanned its allowance: no more.)
        if removal is not None and removal.spare and pool.counters.reservations_refused == refused:
            self._evict_ahead(pid, pool, len(keys), removal)
        return out

    def _evict_ahead(self, pid: PoolId, pool: Pool, batch: int, removal: Removal) -> None:
        """Keep ``removal.spare`` pages spare once the pool is full: each reserve tops the
        spare up by what it used, so evictions made ahead stream through the journal and are
        durable by the time a writer needs their pages (the pool withholds them until then).
        (A reserve withholds nothing: ``removal.held`` is still the pool's withheld count.)"""
        target = removal.spare
        spare = pool.allocatable_count + removal.held
        if spare >= target:
            return
        # At most two batches per call: the spare keeps pace with what reserves take, and a
        # pool whose pages are all read-leased costs each call a bounded scan, not the target.
        removed = pool.evict_ahead(min(target - spare, 2 * batch), self.clock())
        if removed:
            self._record(Remove(pid, removed))
            if self.changes is not None:
                self._changed(pid, REMOVED, removed, REASON_CAPACITY)

    def confirm(self, pid: PoolId, pairs: list[tuple[str, int]], release: list[int]) -> int:
        """Returns how many pairs were refused (stale or foreign pages)."""
        outcome = self.pool(pid).confirm(pairs, release, self.clock())
        if outcome.committed:
            self._record(Commit(pid, outcome.committed))
            if self.changes is not None:
                self._changed(pid, STORED, outcome.committed, "")
        if outcome.refused:
            warn_limited(
                logger,
                "confirm_refused",
                "%s: refused %d confirm(s) for pages not reserved for their key (lease expired "
                "or page re-used), e.g. %r; the writer's data is not mapped",
                pid,
                len(outcome.refused),
                outcome.refused[0],
            )
        return len(outcome.refused)

    def get(self, pid: PoolId, keys: list[str]) -> list[int | None]:
        return self.pool(pid).get(keys, self.clock())

    def delete(self, pid: PoolId, keys: list[str]) -> int:
        pool = self.pool(pid)
        removed = pool.delete(keys, self.clock())
        if removed:
            self._record(Remove(pid, removed))
            if self.changes is not None:
                self._changed(pid, REMOVED, removed, REASON_DELETE)
        return len(removed)

    def clear(self, pid: PoolId) -> int:
        pool = self.pool(pid)
        count = pool.clear(self.clock())
        self._record(Clear(pid))
        if self.changes is not None:
            self.changes.append(Change(pid, CLEARED, (), REASON_CLEAR))
        return count

    def prefix_length(self, pid: PoolId, keys: list[str]) -> int:
        """How many of ``keys``, from the first, are stored: a pure read (no LRU, no counter)."""
        return self.pool(pid).leading_stored(keys)

    def prefix_length_hashes(self, pid: PoolId, hashes: list[int]) -> int:
        """``prefix_length`` by block hashes (``Backend.prefix_length_hashes``)."""
        self.pool(pid)
        index = None if self.hash_indexes is None else self.hash_indexes.get(pid)
        if index is None:
            raise NoHashIndex.for_pool(pid.dialect, pid.rank, pid.namespace)
        return index.leading(hashes)

    def dump(self, pid: PoolId, cursor: str, limit: int) -> tuple[list[str], str]:
        """Stored keys in page order; the cursor is the next page number (``Backend.dump``).
        Each call looks at most ``max(limit * 64, 4096)`` pages, so a sparse pool answers
        fewer keys per call instead of costing O(pool)."""
        pool = self.pool(pid)
        start = parse_cursor(cursor)
        if start >= pool.num_pages:
            return [], ""
        window = max(limit * _DUMP_PAGES_PER_KEY, _DUMP_MIN_WINDOW)
        keys, nxt = pool.stored_keys_from(start, max(limit, 1), window)
        return keys, "" if nxt >= pool.num_pages else str(nxt)

    # ------------------------------------------------------------------ vLLM index

    def vllm_ranks(self, tenant: str = "") -> list[int]:
        """``tenant``'s registered vLLM worker ranks, ascending: O(its ranks), whatever the
        number of other pools."""
        return sorted(self.vllm_rank_pools.get(tenant, ()))

    def v_register(
        self,
        rank: int,
        num_pages: int,
        world_size: int | None,
        tenant: str = "",
        change_world: bool = True,
    ) -> InitResult:
        """Register ``rank`` (``Backend.v_register``); refused whole (``Forbidden``) when
        ``change_world`` is false and ``world_size`` differs from the tenant's pinned one."""
        current = self.vllm_world_sizes.get(tenant)
        if world_size is not None and current is not None and world_size != current:
            if not change_world:
                raise Forbidden.world_size_change(rank, current, world_size)
        result = self.initialize(PoolId("v", rank, "", tenant), num_pages)
        if world_size is not None and world_size != self.vllm_world_sizes.get(tenant):
            self._set_world(world_size, tenant)
            self._record_world(world_size, tenant)
        return result

    def v_required(self, tenant: str = "") -> list[Pool | None]:
        """The pools a key must be stored in to be complete (None: rank not registered yet);
        which ranks is ``store.base.required_ranks``."""
        ranks = self.vllm_rank_pools.get(tenant, {})
        world_size = self.vllm_world_sizes.get(tenant)
        if world_size is not None:
            return list(map(ranks.get, range(world_size)))
        out: list[Pool | None] = []
        while (pool := ranks.get(len(out))) is not None:
            out.append(pool)
        return out

    def v_exists(self, keys: list[str], tenant: str = "") -> list[bool]:
        """A key exists when every required rank has confirmed its shard (the whole walk at
        once: ``v_exists_steps``)."""
        steps = self.v_exists_steps(keys, tenant)
        while True:
            try:
                next(steps)
            except StopIteration as done:
                return done.value  # type: ignore[no-any-return]

    def v_exists_steps(
        self, keys: list[str], tenant: str = ""
    ) -> Generator[None, None, list[bool]]:
        """``v_exists`` as a walk that pauses (yields) after about ``V_EXISTS_STEP`` lookups,
        so a caller on an event loop lets other requests run between steps.

        Rank by rank, each rank is asked only about the keys every rank before it stored, and
        the walk ends when none is left: O(keys + required ranks) when blocks are missing
        from the first ranks (the common miss, and any batch of unknown keys), and only keys
        present on many ranks cost a lookup on each of them. The required ranks are fixed when
        the walk starts; a pool removed meanwhile is read as it was, and a key reported
        complete was stored on each required rank when that rank was looked at.
        """
        required = self.v_required(tenant)
        if not required or None in required:
            return [False] * len(keys)
        left = keys
        budget = V_EXISTS_STEP
        for pool in required:
            assert pool is not None
            kept: list[str] = []
            for start in range(0, len(left), V_EXISTS_STEP):
                if budget <= 0:
                    yield
                    budget = V_EXISTS_STEP
                part = left[start : start + V_EXISTS_STEP] if len(left) > V_EXISTS_STEP else left
                kept += pool.stored_among(part)
                budget -= len(part)
            left = kept
            if not left:
                return [False] * len(keys)
        if len(left) == len(keys):
            return [True] * len(keys)
        complete = set(left)
        return [key in complete for key in keys]

    def v_clear(self, tenant: str = "") -> int:
        """Drop every vLLM key of ``tenant``; rank registrations stay so running workers keep
        working."""
        pids = [pid for pid in self.pools if pid.dialect == "v" and pid.tenant == tenant]
        return sum(self.clear(pid) for pid in pids)

    def v_remove(self, rank: int, tenant: str = "", force: bool = False) -> int | None:
        """Deregister ``rank``: its pool, keys and reservations go; None if not registered.

        Refused (``RankInUse``, nothing changed) while a lease on its pages is live, unless
        ``force``: registered again, the rank starts with a new pool that knows nothing of the
        old writes and reads, and would hand their pages to new blocks.

        Journaled as one ``drop`` record (a snapshot simply no longer holds the pool). A
        journaled caller must not let the rank's page file be written again before that record
        is durable (``LocalBackend.v_register`` waits for it: ``WriteAhead.before_register``).
        """
        pid = PoolId("v", rank, "", tenant)
        pool = self.pools.get(pid)
        if pool is None:
            return None
        if not force:
            now = self.clock()
            until = pool.in_use_until(now)
            if until > now:
                raise RankInUse.for_rank(rank, pool.reserved_count, until - now)
        del self.pools[pid]
        ranks = self.vllm_rank_pools[tenant]
        del ranks[rank]
        if not ranks:
            del self.vllm_rank_pools[tenant]
        self._count(pid, -pool.num_pages, -1)
        self.size_conflicts.pop(pid, None)
        self._record(Drop(pid))
        if self.changes is not None:
            self.changes.append(Change(pid, CLEARED, (), REASON_DROP))
        return pool.stored_count

    def v_set_world_size(self, world_size: int | None, tenant: str = "") -> None:
        """Pin the required ranks to ``0..world_size-1``, or unpin them (None)."""
        if world_size != self.vllm_world_sizes.get(tenant):
            self._set_world(world_size, tenant)
            self._record_world(world_size, tenant)

    def v_index(self, tenant: str = "") -> VIndex:
        return VIndex(self.vllm_world_sizes.get(tenant), tuple(self.vllm_ranks(tenant)))

    def _record_world(self, world_size: int | None, tenant: str) -> None:
        self._record(TenantWorldSize(tenant, world_size) if tenant else WorldSize(world_size))

    # ------------------------------------------------------------------ stats

    def budget(self, pid: PoolId) -> Budget:
        """Whether ``pid`` exists, the pages of all pools (--max-total-pages) and the pages
        and pools of ``pid``'s tenant (its quotas), in O(1)."""
        tenant = pid.tenant
        return Budget(
            pid in self.pools,
            self.total_pages,
            self.tenant_pages.get(tenant, 0),
            self.tenant_pools.get(tenant, 0),
        )

    def stats(self) -> list[PoolStats]:
        return self.stats_of(sorted(self.pools))

    def stats_of(self, pids: list[PoolId]) -> list[PoolStats]:
        """The stats of the pools named (those that still exist), in that order."""
        now = self.clock()
        out = []
        pools = self.pools
        for pid in pids:
            pool = pools.get(pid)
            if pool is None:  # removed since the caller listed it
                continue
            pool.expire(now)
            out.append(
                PoolStats(
                    pool=pid,
                    num_pages=pool.num_pages,
                    free=pool.free_count,
                    reserved=pool.reserved_count,
                    stored=pool.stored_count,
                    counters=dict(vars(pool.counters)),
                    size_conflicts=self.size_conflicts.get(pid, 0),
                    cooling=pool.cooling_count,
                    held_after_restart=pool.held_count,
                    dead=getattr(pool.policy, "dead", None),
                )
            )
        return out

    def _record(self, record: Record) -> None:
        if self.sink is not None:
            self.sink.append(record)
        if self.hash_indexes is not None:
            self._index(record)

    def _index(self, record: Record) -> None:
        """Apply a journal record to its pool's hash index: the index follows the journal, so
        it holds the stored keys' hashes whatever removed or stored them. (Only SGLang pools
        have one; a ``Drop`` is a vLLM rank's.)"""
        assert self.hash_indexes is not None
        pid: PoolId | None = getattr(record, "pool", None)
        if pid is None or pid not in self.hash_indexes:
            return
        index = self.hash_indexes[pid]
        if isinstance(record, Commit):
            index.add(list(map(_first, record.entries)))
        elif isinstance(record, Remove):
            index.remove(list(map(_first, record.entries)))
        elif isinstance(record, Clear):
            index.clear()

    def _changed(self, pid: PoolId, kind: str, pairs: list[tuple[str, int]], reason: str) -> None:
        assert self.changes is not None
        self.changes.append(Change(pid, kind, tuple(map(_first, pairs)), reason))
