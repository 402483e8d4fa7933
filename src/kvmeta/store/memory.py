"""State held in this process: the core pools, plus an optional journal for durability.

``MemoryStore`` is synchronous (the embedded clients call it directly); ``MemoryBackend`` is the
async face the server uses, which is also where a reply waits for its journal group to be
durable (SEMANTICS.md's write-ahead rule: a page that held a removed key is handed to a new
writer only after the removal is on disk).

Journal records are plain tuples, encoded by ``store.journal``:
``("pool", pool_id, num_pages)``, ``("commit", pool_id, [(key, page), ...])``,
``("remove", pool_id, [(key, page), ...])`` (deletes and evictions), ``("clear", pool_id)``,
``("vworld", world_size_or_None)``, ``("drop", pool_id)`` (a vLLM rank removed).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

from kvmeta._types import PoolId
from kvmeta.core.pool import Pool
from kvmeta.errors import NotInitialized
from kvmeta.store.base import InitResult, PoolStats, VIndex

__all__ = ["ChangeSink", "MemoryBackend", "MemoryStore"]

logger = logging.getLogger(__name__)

Record = tuple[Any, ...]

# Spare pages kept ahead of need by a journaled store: 32 batches of the reserve at hand
# (enough for one journal group at a few thousand reserves per second), at most 1/8 of the
# pool; both scaled by a per-pool growth factor that rises by half whenever a reserve still
# had to wait, up to 4 (so at most half the pool: a small pool churned faster than its
# journal groups, whose cache holds milliseconds of data anyway).
_SPARE_BATCHES = 32
_SPARE_FRACTION = 8
_MAX_SPARE_GROWTH = 4.0


class ChangeSink(Protocol):
    """Where durable changes go (the journal). ``append`` must never block on disk."""

    def append(self, record: Record) -> None: ...


class DurableSink(ChangeSink, Protocol):
    """A sink that numbers its records (``seq``: the last appended) and reports how far they
    are on disk (``durable_seq``)."""

    seq: int
    durable_seq: int


class MemoryStore:
    """All pools of one server, synchronous. Not thread-safe: one event loop or one caller."""

    def __init__(
        self,
        *,
        reservation_ttl: float = 300.0,
        read_lease: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
        sink: ChangeSink | None = None,
    ) -> None:
        self.reservation_ttl = reservation_ttl
        self.read_lease = read_lease
        self.clock = clock
        self.sink = sink
        self.pools: dict[PoolId, Pool] = {}
        self.size_conflicts: dict[PoolId, int] = {}
        self.vllm_world_size: int | None = None
        # Write-ahead rule without waiting (see ``set_withhold``): removals whose pages are
        # withheld until durable, as (journal seq, pool, pages), oldest first.
        self._durable_sink: DurableSink | None = None
        self._pending: deque[tuple[int, Pool, list[int]]] = deque()
        self.reserve_evicted = False
        # Per pool: how much the spare kept ahead of need has grown (see ``_evict_ahead``).
        self.spare_growth: dict[PoolId, float] = {}

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
                logger.warning(
                    "%s re-initialised with num_pages=%d but has %d pages; keeping %d. Two "
                    "engines with different file sizes on one pool would overwrite each "
                    "other's pages: give each its own rank or namespace.",
                    pid,
                    num_pages,
                    pool.num_pages,
                    pool.num_pages,
                )
            return result
        self.pools[pid] = self._new_pool(num_pages)
        self.pools[pid].withhold = self._durable_sink is not None
        self._record(("pool", pid, num_pages))
        return InitResult(created=True, num_pages=num_pages, requested=num_pages)

    def _new_pool(self, num_pages: int, entries: list[tuple[str, int]] | None = None) -> Pool:
        if entries:
            return Pool.load(
                num_pages, entries, reservation_ttl=self.reservation_ttl, read_lease=self.read_lease
            )
        return Pool(num_pages, reservation_ttl=self.reservation_ttl, read_lease=self.read_lease)

    def load_pool(self, pid: PoolId, num_pages: int, entries: list[tuple[str, int]]) -> None:
        """Install a recovered pool (entries coldest first) without journaling it."""
        self.pools[pid] = self._new_pool(num_pages, entries)
        self.pools[pid].withhold = self._durable_sink is not None

    def set_withhold(self, sink: DurableSink | None) -> None:
        """Keep pages freed by a removal away from writers until ``sink`` has it on disk.

        This is how a journaled store keeps the write-ahead rule without making reserves wait:
        deletes, clears and evictions put their pages in each pool's withheld set, and when
        few free pages are left, reserve evicts the coldest pages ahead of need
        (``Pool.evict_ahead``). By the time writers need those pages their removal is durable.
        Only a reserve that finds no free page evicts on the spot (``reserve_evicted``), and its
        caller must wait before replying.
        """
        self._durable_sink = sink
        for pool in self.pools.values():
            pool.withhold = sink is not None

    def _collect_withheld(self, pid: PoolId, pool: Pool) -> None:
        sink = self._durable_sink
        if sink is not None:
            pages = pool.collect_withheld()
            if pages:
                self._pending.append((sink.seq, pool, pages))

    def withheld_wait(self, pid: PoolId, keys: list[str]) -> int:
        """Journal position a reserve of ``keys`` should wait for before running: the
        last pending removal when the pool's free pages would not cover the batch (waiting for
        withheld pages beats evicting live keys); 0 when there is nothing to wait for."""
        if not self._pending:
            return 0
        pool = self.pools.get(pid)
        if pool is None or pool.withheld_count == 0 or pool.allocatable_count >= len(keys):
            return 0
        need = pool.new_keys(keys) - pool.allocatable_count
        if need <= 0:
            return 0
        for seq, owner, pages in self._pending:  # oldest first: the shortest wait that helps
            if owner is pool:
                need -= len(pages)
                if need <= 0:
                    return seq
        return self._pending[-1][0]

    def release_durable(self) -> None:
        """Hand withheld pages whose removal is now durable to the allocator."""
        sink, pending = self._durable_sink, self._pending
        if sink is None or not pending or pending[0][0] > sink.durable_seq:
            return
        now = self.clock()
        while pending and pending[0][0] <= sink.durable_seq:
            _, pool, pages = pending.popleft()
            pool.release_withheld(pages, now)

    def spare_target(self, pid: PoolId, pool: Pool, batch: int) -> int:
        """Spare pages (free or withheld) to keep in a full pool for reserves of ``batch``."""
        if pool.num_pages < 8:
            return 0  # tiny pools keep exact LRU
        growth = self.spare_growth.get(pid, 1.0)
        return int(min(pool.num_pages / _SPARE_FRACTION, _SPARE_BATCHES * batch) * growth)

    def _evict_ahead(self, pid: PoolId, pool: Pool, batch: int) -> None:
        """Keep ``spare_target`` pages spare once the pool is full: each reserve tops the spare
        up by what it used, so evictions made ahead stream through the journal and are durable
        by the time a writer needs their pages."""
        target = self.spare_target(pid, pool, batch)
        spare = pool.allocatable_count + pool.withheld_count
        if spare >= target:
            return
        # At most two batches per call: the spare keeps pace with what reserves take, and a
        # pool whose pages are all read-leased costs each call a bounded scan, not the target.
        removed = pool.evict_ahead(min(target - spare, 2 * batch), self.clock())
        if removed:
            self._record(("remove", pid, removed))
            self._collect_withheld(pid, pool)

    def spare_too_small(self, pid: PoolId) -> None:
        """A reserve on ``pid`` had to wait for withheld pages: the spare did not cover one
        journal group's worth of reserves at the current rate, so keep half as much again."""
        growth = self.spare_growth.get(pid, 1.0)
        self.spare_growth[pid] = min(growth * 1.5, _MAX_SPARE_GROWTH)

    # ------------------------------------------------------------------ operations

    def exists(self, pid: PoolId, keys: list[str]) -> list[bool]:
        return self.pool(pid).exists(keys)

    def reserve(self, pid: PoolId, keys: list[str]) -> list[tuple[bool, int]]:
        pool = self.pool(pid)
        if self._pending:
            self.release_durable()
        evicted: list[tuple[str, int]] = []
        refused = pool.counters.reservations_refused
        out = pool.reserve(keys, self.clock(), evicted)
        self.reserve_evicted = bool(evicted)
        if evicted:
            self._record(("remove", pid, evicted))
        if self._durable_sink is not None and pool.counters.reservations_refused == refused:
            # (A call that found nothing evictable already scanned its allowance: no more.)
            self._evict_ahead(pid, pool, len(keys))
        return out

    def confirm(self, pid: PoolId, pairs: list[tuple[str, int]], release: list[int]) -> int:
        """Returns how many pairs were refused (stale or foreign pages)."""
        outcome = self.pool(pid).confirm(pairs, release, self.clock())
        if outcome.committed:
            self._record(("commit", pid, outcome.committed))
        if outcome.refused:
            logger.warning(
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
            self._record(("remove", pid, removed))
            self._collect_withheld(pid, pool)
        return len(removed)

    def clear(self, pid: PoolId) -> int:
        pool = self.pool(pid)
        count = pool.clear(self.clock())
        self._record(("clear", pid))
        self._collect_withheld(pid, pool)
        return count

    # ------------------------------------------------------------------ vLLM index

    def vllm_ranks(self) -> list[int]:
        """Registered vLLM worker ranks, ascending."""
        return sorted(pid.rank for pid in self.pools if pid.dialect == "v")

    def v_register(self, rank: int, num_pages: int, world_size: int | None) -> InitResult:
        result = self.initialize(PoolId("v", rank, ""), num_pages)
        if world_size is not None and world_size != self.vllm_world_size:
            self.vllm_world_size = world_size
            self._record(("vworld", world_size))
        return result

    def v_required(self) -> list[Pool | None]:
        """The pools a key must be stored in to be complete (None: rank not registered yet);
        which ranks is ``store.base.required_ranks``."""
        if self.vllm_world_size is not None:
            return [self.pools.get(PoolId("v", r, "")) for r in range(self.vllm_world_size)]
        out: list[Pool | None] = []
        while (pool := self.pools.get(PoolId("v", len(out), ""))) is not None:
            out.append(pool)
        return out

    def v_exists(self, keys: list[str]) -> list[bool]:
        """A key exists when every required rank has confirmed its shard."""
        required = self.v_required()
        if not required or any(p is None for p in required):
            return [False] * len(keys)
        # One C-speed membership pass per rank, then AND: ~4x faster than a per-key all().
        out: list[bool] = []
        for i, pool in enumerate(p for p in required if p is not None):
            here = pool.exists(keys)
            out = here if i == 0 else [a and b for a, b in zip(out, here, strict=True)]
        return out

    def v_clear(self) -> int:
        """Drop every vLLM key; rank registrations stay so running workers keep working."""
        return sum(self.clear(pid) for pid in list(self.pools) if pid.dialect == "v")

    def v_remove(self, rank: int) -> int | None:
        """Deregister ``rank``: its pool, keys and reservations go; None if not registered.

        Journaled as one ``drop`` record (a snapshot simply no longer holds the pool). A
        journaled caller must not let the rank's page file be written again before that record
        is durable (``DurableBackend.v_register`` waits for it).
        """
        pid = PoolId("v", rank, "")
        pool = self.pools.pop(pid, None)
        if pool is None:
            return None
        self.size_conflicts.pop(pid, None)
        self.spare_growth.pop(pid, None)
        self._record(("drop", pid))
        return pool.stored_count

    def v_set_world_size(self, world_size: int | None) -> None:
        """Pin the required ranks to ``0..world_size-1``, or unpin them (None)."""
        if world_size != self.vllm_world_size:
            self.vllm_world_size = world_size
            self._record(("vworld", world_size))

    def v_index(self) -> VIndex:
        return VIndex(self.vllm_world_size, tuple(self.vllm_ranks()))

    # ------------------------------------------------------------------ stats

    def stats(self) -> list[PoolStats]:
        now = self.clock()
        out = []
        for pid, pool in sorted(self.pools.items()):
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
                )
            )
        return out

    def _record(self, record: Record) -> None:
        if self.sink is not None:
            self.sink.append(record)


class MemoryBackend:
    """The async ``Backend`` over a ``MemoryStore``; every call runs to completion on the loop,
    so calls are atomic without locks."""

    name = "memory"

    def __init__(self, store: MemoryStore) -> None:
        self.store = store

    async def start(self) -> None:
        return None

    async def close(self) -> None:
        return None

    async def ready(self) -> bool:
        return True

    async def _durable(self) -> None:
        """Wait until every change made so far is durable (no-op without a journal)."""
        return None

    async def initialize(self, pool: PoolId, num_pages: int) -> InitResult:
        result = self.store.initialize(pool, num_pages)
        await self._durable()
        return result

    async def exists(self, pool: PoolId, keys: list[str]) -> list[bool]:
        return self.store.exists(pool, keys)

    async def reserve(self, pool: PoolId, keys: list[str]) -> list[tuple[bool, int]]:
        out = self.store.reserve(pool, keys)
        await self._durable()
        return out

    async def confirm(self, pool: PoolId, pairs: list[tuple[str, int]], release: list[int]) -> int:
        refused = self.store.confirm(pool, pairs, release)
        await self._durable()
        return refused

    async def get(self, pool: PoolId, keys: list[str]) -> list[int | None]:
        return self.store.get(pool, keys)

    async def delete(self, pool: PoolId, keys: list[str]) -> int:
        count = self.store.delete(pool, keys)
        await self._durable()
        return count

    async def clear(self, pool: PoolId) -> int:
        count = self.store.clear(pool)
        await self._durable()
        return count

    async def v_register(self, rank: int, num_pages: int, world_size: int | None) -> InitResult:
        result = self.store.v_register(rank, num_pages, world_size)
        await self._durable()
        return result

    async def v_exists(self, keys: list[str]) -> list[bool]:
        return self.store.v_exists(keys)

    async def v_clear(self) -> int:
        count = self.store.v_clear()
        await self._durable()
        return count

    async def v_remove(self, rank: int) -> int | None:
        return self.store.v_remove(rank)

    async def v_set_world_size(self, world_size: int | None) -> None:
        self.store.v_set_world_size(world_size)

    async def v_index(self) -> VIndex:
        return self.store.v_index()

    async def stats(self) -> list[PoolStats]:
        return self.store.stats()
