"""The local backend: the pools of this process, optionally journaled to a data directory.

One class serves both: without ``DurabilityOptions`` the state lives and dies with the
process; with them, ``DataDir`` recovers it at start-up and keeps its files (journal,
snapshots, the SGLang persistence file), and every change the store makes goes to the journal.

A change reads top to bottom here, and this is the one place the durability rules are
applied (docs/durability.md):

- **refused while the journal is failed or stalled** (``_writable``), before it touches the
  state: a change that cannot be made durable must not be applied or acknowledged;
- **the write-ahead rule** (``store.disk.writeahead``), as one ``before``/``after`` pair around
  the store's operation: ``before`` says what to wait for first (withheld pages, a vLLM rank's
  removal), the store does the work and reports what it removed (``writeahead.Removal``, the
  pages its pools withhold), and ``after`` says what the reply waits for. Like a transaction
  that frees obsolete data only after its commit, a page is handed to a new writer only once
  the removal of its old key is durable;
- **the acknowledgements**: pool creation, vLLM registrations and removals reply once durable;
  with ``--fsync always`` so do confirms, deletes and clears (``_acknowledged``);
- **the change feed**: changes go out once their records are durable (at once without a
  journal, or with ``--fsync never``): a crash must not undo an announced change.

Every call runs to completion on the loop between its waits, so calls are atomic without locks.
The exception is a ``v_exists`` larger than one step of its walk, which pauses between steps
(``MemoryStore.v_exists_steps`` says what its answer then promises).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import AsyncIterator
from pathlib import Path

from kvmeta._types import PoolId
from kvmeta.core.invariants import (
    InvariantViolation,
    PoolCopy,
    check_copy,
    check_hash_index,
    copy_pool,
)
from kvmeta.core.pool import Pool
from kvmeta.store.base import STATS_CHUNK, Budget, CheckReport, InitResult, PoolStats, VIndex
from kvmeta.store.changes import Change, ChangeListener
from kvmeta.store.disk.datadir import DataDir, DurabilityOptions
from kvmeta.store.disk.journal import Journal
from kvmeta.store.disk.memory import MemoryStore
from kvmeta.store.disk.writeahead import WriteAhead
from kvmeta.store.epoch import new_epoch

__all__ = ["DurabilityOptions", "LocalBackend"]

# ``LocalBackend.check``: pages copied per step before the copies are checked in a thread. The
# loop pauses for one copy at a time (a 10^6-page pool is copied in one step: its copy must be
# consistent; how long: benchmarks/README.md, "Operator routes").
_CHECK_BATCH_PAGES = 1 << 17


class LocalBackend:
    """The async ``Backend`` over a ``MemoryStore``, durable when given ``options``."""

    name = "memory"  # with a data directory or an SGLang file: "memory+journal"

    def __init__(self, store: MemoryStore, options: DurabilityOptions | None = None) -> None:
        self.store = store
        self.disk = None if options is None else DataDir(store, options)
        if self.disk is not None:
            self.name = "memory+journal"
        self.journal: Journal | None = None  # set by ``start`` when there is a data directory
        # The write-ahead rule: with a journal that makes replies wait (not ``--fsync never``).
        self.rule: WriteAhead | None = None
        self.reserve_waits = 0  # reserves that waited for the disk (write-ahead rule)
        self.reserve_wait_seconds = 0.0  # and how long, in all
        # Without a data directory the state is new at each start: a new epoch each time.
        self._epoch = new_epoch()
        self._listener: ChangeListener | None = None
        # Changes waiting for their journal records to be durable: (seq, change), seq ascending.
        self._undelivered: deque[tuple[int, Change]] = deque()

    @property
    def epoch(self) -> str:
        """With a data directory, the id kept in it (``store.epoch``); otherwise a new one each
        start (an SGLang persistence file alone is rewritten only every ``--save-interval``, so
        a restart may have lost pools created since)."""
        return self._epoch

    @property
    def describe(self) -> str:
        return "memory" if self.disk is None else self.disk.describe

    @property
    def failure(self) -> str | None:
        """Why changes are refused (the journal cannot be written, or its disk stopped
        answering), or None (always, for state only in memory)."""
        return None if self.disk is None else self.disk.failure

    async def ready(self) -> bool:
        return self.failure is None

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        disk = self.disk
        if disk is None:
            return
        journal = await disk.open()
        if disk.epoch is not None:
            self._epoch = disk.epoch
        if journal is not None:
            self.attach(journal)
        disk.start()

    def attach(self, journal: Journal) -> None:
        """Write every change to ``journal`` from now on, and keep the write-ahead rule when
        its replies wait for the disk."""
        self.journal = journal
        self.store.sink = journal
        if journal.waits:
            self.rule = WriteAhead(journal, self.store.clock)
            self.store.withhold_removed()
        self.set_change_listener(self._listener)  # set before: now it waits for the journal

    async def close(self) -> None:
        if self.disk is not None:
            await self.disk.close()

    async def snapshot(self) -> Path | None:
        """Take a snapshot now (``DataDir.snapshot``); None: no data directory."""
        return None if self.disk is None else await self.disk.snapshot()

    # ------------------------------------------------------------------ changes

    def _writable(self) -> None:
        """Refuse a change while the journal is failed or stalled, before it touches the
        state: a change that cannot be made durable must not be applied (or acknowledged)."""
        journal = self.journal
        if journal is not None and journal.refusing:
            refusal = journal.refusal()
            assert refusal is not None
            raise refusal

    async def _durable(self) -> None:
        """Until every change made so far is durable (no journal, or ``never``: at once)."""
        journal = self.journal
        if journal is not None and journal.durable_seq < journal.seq:
            await journal.wait(journal.seq)

    async def _acknowledged(self) -> None:
        """confirm/delete/clear: acknowledged only once durable in ``always`` mode."""
        journal = self.journal
        if journal is not None and journal.mode == "always" and journal.durable_seq < journal.seq:
            await journal.wait(journal.seq)

    async def _wait_for_disk(self, seq: int) -> None:
        journal = self.journal
        assert journal is not None
        self.reserve_waits += 1
        started = time.monotonic()
        try:
            await journal.wait(seq)
        finally:
            self.reserve_wait_seconds += time.monotonic() - started

    def _withheld(self, pools: list[Pool]) -> None:
        """A delete or clear freed pages of ``pools``, which they withhold until durable."""
        rule = self.rule
        if rule is not None:
            for pool in pools:
                rule.withheld(pool)

    async def initialize(self, pool: PoolId, num_pages: int) -> InitResult:
        """Replies once the pool is durable: engines must never see "not initialized" after
        a restart."""
        self._writable()
        result = self.store.initialize(pool, num_pages)
        await self._durable()
        return result

    async def reserve(
        self, pool: PoolId, keys: list[str], parent: str | None = None
    ) -> list[tuple[bool, int]]:
        """A reserve, with the waits of the write-ahead rule (``store.disk.writeahead``)."""
        self._writable()
        store, rule = self.store, self.rule
        if rule is None:  # no journal, or ``--fsync never``
            out = store.reserve(pool, keys, None, parent)
            if store.changes:
                self._publish()
            return out
        target = store.pools.get(pool)
        if target is None:
            target = store.pool(pool)  # raises: not initialized
        removal = rule.before(target, keys)
        if removal.wait:
            await self._wait_for_disk(removal.wait)
            target = store.pool(pool)  # a vLLM rank may have been removed and registered again
            rule.waited(target, removal)
        out = store.reserve(pool, keys, removal, parent)
        seq = rule.after(target, out, removal)
        if store.changes:
            self._publish()
        if seq:
            await self._wait_for_disk(seq)
        return out

    async def confirm(self, pool: PoolId, pairs: list[tuple[str, int]], release: list[int]) -> int:
        self._writable()
        refused = self.store.confirm(pool, pairs, release)
        if self.store.changes:
            self._publish()
        await self._acknowledged()
        return refused

    async def delete(self, pool: PoolId, keys: list[str]) -> int:
        self._writable()
        count = self.store.delete(pool, keys)
        if count:
            self._withheld([self.store.pools[pool]])
        if self.store.changes:
            self._publish()
        await self._acknowledged()
        return count

    async def clear(self, pool: PoolId) -> int:
        self._writable()
        count = self.store.clear(pool)
        self._withheld([self.store.pools[pool]])
        if self.store.changes:
            self._publish()
        await self._acknowledged()
        return count

    async def v_register(
        self,
        rank: int,
        num_pages: int,
        world_size: int | None,
        tenant: str = "",
        change_world: bool = True,
    ) -> InitResult:
        self._writable()
        rule = self.rule
        if rule is not None:
            seq = rule.before_register(PoolId("v", rank, "", tenant))
            if seq:
                journal = self.journal
                assert journal is not None
                await journal.wait(seq)
        result = self.store.v_register(rank, num_pages, world_size, tenant, change_world)
        await self._durable()
        return result

    async def v_clear(self, tenant: str = "") -> int:
        self._writable()
        count = self.store.v_clear(tenant)
        self._withheld(list(self.store.vllm_rank_pools.get(tenant, {}).values()))
        if self.store.changes:
            self._publish()
        await self._acknowledged()
        return count

    async def v_remove(self, rank: int, tenant: str = "", force: bool = False) -> int | None:
        """Replies once the removal is durable (operators expect it to stick)."""
        self._writable()
        dropped = self.store.v_remove(rank, tenant, force)
        if dropped is not None:
            if self.rule is not None:
                self.rule.dropped(PoolId("v", rank, "", tenant))
            if self.store.changes:
                self._publish()
            await self._durable()
        return dropped

    async def v_set_world_size(self, world_size: int | None, tenant: str = "") -> None:
        self._writable()
        self.store.v_set_world_size(world_size, tenant)
        await self._durable()

    # ------------------------------------------------------------------ reads

    async def exists(self, pool: PoolId, keys: list[str]) -> list[bool]:
        return self.store.exists(pool, keys)

    async def get(self, pool: PoolId, keys: list[str]) -> list[int | None]:
        return self.store.get(pool, keys)

    async def dump(self, pool: PoolId, cursor: str, limit: int) -> tuple[list[str], str]:
        return self.store.dump(pool, cursor, limit)

    async def prefix_length(self, pool: PoolId, keys: list[str]) -> int:
        return self.store.prefix_length(pool, keys)

    async def prefix_length_hashes(self, pool: PoolId, hashes: list[int]) -> int:
        return self.store.prefix_length_hashes(pool, hashes)

    async def v_exists(self, keys: list[str], tenant: str = "") -> list[bool]:
        """The walk runs in steps with a pause (one loop turn) between them, so one large
        batch never holds the loop for more than a step (``V_EXISTS_STEP``); the other
        requests run in between."""
        steps = self.store.v_exists_steps(keys, tenant)
        while True:
            try:
                next(steps)
            except StopIteration as done:
                return done.value  # type: ignore[no-any-return]
            await asyncio.sleep(0)

    async def v_index(self, tenant: str = "") -> VIndex:
        return self.store.v_index(tenant)

    async def budget(self, pool: PoolId) -> Budget:
        return self.store.budget(pool)

    async def stats(self) -> list[PoolStats]:
        """Every pool's stats, read in ``stats_chunks``: one pass over tens of thousands of
        pools held the loop for hundreds of ms (benchmarks/README.md, "Operator routes")."""
        out: list[PoolStats] = []
        async for chunk in self.stats_chunks():
            out += chunk
        return out

    async def stats_chunks(self, size: int = STATS_CHUNK) -> AsyncIterator[list[PoolStats]]:
        store = self.store
        pids = sorted(store.pools)
        for i in range(0, len(pids), size):
            if i:
                await asyncio.sleep(0)
            yield store.stats_of(pids[i : i + size])

    async def check(self) -> CheckReport:
        """Each pool is copied in one step on the loop (consistent, C-speed) and the copies
        are checked in a thread, so requests keep being served while the check runs."""
        pools = self.store.pools
        problems: list[str] = []
        checked = 0
        indexes = self.store.hash_indexes or {}
        batch: list[tuple[PoolId, PoolCopy, dict[int, int] | None]] = []
        pages = 0
        for pid in sorted(pools):
            pool = pools.get(pid)
            if pool is None:  # removed while the check ran
                continue
            index = indexes.get(pid)
            batch.append((pid, copy_pool(pool), None if index is None else index.counts()))
            checked += 1
            pages += pool.num_pages
            if pages >= _CHECK_BATCH_PAGES:
                problems += await asyncio.to_thread(_check_batch, batch)
                batch, pages = [], 0
            elif checked % 256 == 0:
                await asyncio.sleep(0)
        if batch:
            problems += await asyncio.to_thread(_check_batch, batch)
        return CheckReport(problems=problems, checked=checked)

    def durability_stats(self) -> dict[str, float]:
        """Counters for metrics (another module exports them); none for state only in memory."""
        disk = self.disk
        if disk is None:
            return {}
        j = self.journal
        return {
            "fsyncs": float(j.fsyncs if j else 0),
            "fsync_seconds_total": j.fsync_seconds_total if j else 0.0,
            "fsync_seconds_max": j.fsync_seconds_max if j else 0.0,
            "journal_bytes": float(j.bytes_written if j else 0),
            "journal_records": float(j.records if j else 0),
            "snapshots": float(disk.snapshots),
            "snapshot_stall_seconds_max": disk.snapshot_stall_max,
            "reserve_waits": float(self.reserve_waits),
            "reserve_wait_seconds": self.reserve_wait_seconds,
            "journal_failed": 1.0 if j is not None and j.failed is not None else 0.0,
            "fsync_stalled": 1.0 if j is not None and j.stalled else 0.0,
            "fsync_stalls": float(j.stalls if j else 0),
            "fsync_pending_seconds": j.fsync_pending_seconds() if j else 0.0,
        }

    # ------------------------------------------------------------------ change feed

    def set_change_listener(self, listener: ChangeListener | None) -> None:
        """Changes go out once the journal records holding them are fsynced (at once with
        ``--fsync never`` or without a journal): a crash must not undo an announced change."""
        self._listener = listener
        journal = self.journal
        if listener is None:
            self.store.changes = None
            self._undelivered.clear()
            if journal is not None:
                journal.on_durable = None
            return
        if self.store.changes is None:
            self.store.changes = []
        if journal is not None and journal.waits:
            journal.on_durable = self._deliver_durable

    async def settle_changes(self, pool: PoolId) -> None:
        return None

    def _publish(self) -> None:
        """Hand the changes the store just made to the listener, or hold them until their
        journal records (all appended by now: ``seq`` covers them) are durable."""
        store = self.store
        changes = store.changes
        assert changes is not None
        store.changes = []
        journal = self.journal
        listener = self._listener
        if journal is None or not journal.waits:
            if listener is not None:
                listener(changes)
            return
        seq = journal.seq
        self._undelivered.extend((seq, change) for change in changes)

    def _deliver_durable(self, durable_seq: int) -> None:
        pending = self._undelivered
        if not pending or pending[0][0] > durable_seq:
            return
        out = []
        while pending and pending[0][0] <= durable_seq:
            out.append(pending.popleft()[1])
        listener = self._listener
        if listener is not None:
            listener(out)


def _check_batch(batch: list[tuple[PoolId, PoolCopy, dict[int, int] | None]]) -> list[str]:
    found = []
    for pid, copy, hash_counts in batch:
        try:
            check_copy(copy)
            if hash_counts is not None:
                check_hash_index(list(copy._stored), hash_counts)
        except InvariantViolation as exc:
            found.append(f"{pid}: {exc}")
    return found
