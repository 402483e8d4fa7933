"""The write-ahead rule of a journaled store, in one place.

The rule (docs/durability.md): a page that held key K is handed to a new writer only after the
removal of K is durable. Otherwise a crash could bring back ``K -> page`` while the page already
holds another key's bytes: silent wrong data.

A removal reaches a page in one of two ways, and each is covered here:

- **Withheld** (delete, clear, eviction ahead of need): the pool keeps the page out of its
  allocator (``Pool.withhold``) until ``catch_up`` sees the removal on disk. No reply waits.
- **Evicted in place** (a reserve found no spare page and evicted on the spot): the page is
  RESERVED at once, so it is *marked* with the journal position of its removal. Every reserve
  reply that hands out a marked page, whichever way it does so (the first writer, a second
  writer joining the reservation, a client's retry, a duplicate key in the batch, or a later
  writer after the reservation was released or expired), waits until that position is durable
  (``wait_after``). Marks are dropped once durable.

To keep waits rare, a full pool keeps a *spare* of pages evicted ahead of need
(``spare_target``). The spare grows by half whenever a reserve still had to wait for withheld
pages and decays back with a half-life of ``_GROWTH_HALF_LIFE`` seconds once waits stop, so a
burst does not keep half of a pool empty for good.

A vLLM rank removed and registered again reuses its page file: its registration waits until
the removal is durable (``before_register``), the same rule for a whole pool.

``Pool`` holds only the mechanism (withheld pages, eviction ahead); this module decides what
waits for what. It performs no I/O: the journal (``DurableSink``) numbers records and reports
how far they are durable. Its one caller (``store.disk.local.LocalBackend``) asks it before
each change what to wait for, and tells it after the change what was removed (``before`` /
``after``; ``withheld`` after a delete or clear), then does the waiting.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Protocol

from kvmeta._types import PoolId
from kvmeta.core.pool import Pool
from kvmeta.store.disk.codec import Record

__all__ = ["DurableSink", "Removal", "WriteAhead"]

# Spare pages kept ahead of need: 32 batches of the reserve at hand (enough for one journal
# group at a few thousand reserves per second), at most 1/8 of the pool; both scaled by the
# pool's growth factor, at most 4 (half the pool: a small pool churned faster than its journal
# groups, whose cache holds milliseconds of data anyway).
_SPARE_BATCHES = 32
_SPARE_FRACTION = 8
_MAX_SPARE_GROWTH = 4.0
_GROWTH_STEP = 1.5
_GROWTH_HALF_LIFE = 30.0  # seconds
# Pools under this many pages keep exact LRU (no spare).
_MIN_SPARE_POOL = 8


class DurableSink(Protocol):
    """A journal that numbers its records (``seq``: the last appended) and reports how far
    they are on disk (``durable_seq``). ``append`` never blocks on disk."""

    seq: int
    durable_seq: int

    def append(self, record: Record) -> None: ...


class Removal:
    """One reserve of a caller that keeps the write-ahead rule (``WriteAhead.before`` makes
    it): what the reserve removed besides answering, the (key, page) pairs it evicted on the
    spot and whether it moved the pool's frontier, both journaled already. In: ``spare``, the
    spare pages to keep once the pool is full (the store tops the spare up by evicting ahead
    of need), ``held``, how many of the pool's pages are withheld now (part of its spare), and
    ``wait``, the journal position the caller waits for before the reserve."""

    __slots__ = ("evicted", "frontier", "held", "spare", "wait")

    def __init__(self, spare: int, held: int, wait: int) -> None:
        self.spare = spare
        self.held = held
        self.wait = wait
        self.evicted: list[tuple[str, int]] = []
        self.frontier = False


class WriteAhead:
    """Pending removals of every pool of one store, and the waits they impose."""

    def __init__(self, sink: DurableSink, clock: Callable[[], float]) -> None:
        self.sink = sink
        self.clock = clock
        # (journal seq of the removal, pool, pages, withheld?) in journal order.
        self._pending: deque[tuple[int, Pool, list[int], bool]] = deque()
        # Pages each pool withholds for the pending removals (every page a pool withholds:
        # the caller hands each removal's pages here), so a reserve's checks read no pool.
        self._held: dict[Pool, int] = {}
        # Pages handed out (or free again) before their previous key's removal is durable:
        # pool -> page -> journal seq of that removal.
        self._marks: dict[Pool, dict[int, int]] = {}
        # Spare growth per pool: (factor at ``since``, since).
        self._growth: dict[Pool, tuple[float, float]] = {}
        # Journal seq of each pool's latest frontier record not yet known durable: a reply
        # handing out a page past the frontier before waits for it (a crash must not forget
        # that the page was handed out: ``Pool.hold_after_restart``).
        self._frontiers: dict[Pool, int] = {}
        # Journal seq of each vLLM rank's removal not yet known durable (``before_register``).
        self._dropped: dict[PoolId, int] = {}

    # ------------------------------------------------------------------ around a reserve

    def before(self, pool: Pool, keys: list[str]) -> Removal:
        """The reserve of ``keys`` to run: the spare its pool keeps and the journal position
        it waits for first (``Removal.wait``, 0: none). A wait means the spare was too small,
        so it grows (``spare_too_small``)."""
        seq = self.wait_before(pool, keys)
        if seq:
            self.spare_too_small(pool)
        return Removal(self.spare_target(pool, len(keys)), self._held.get(pool, 0), seq)

    def waited(self, pool: Pool, removal: Removal) -> None:
        """The reserve waited for ``removal.wait``: release what is durable now, before it
        runs (the pages it waited for)."""
        self.catch_up()
        removal.held = self._held.get(pool, 0)

    def after(self, pool: Pool, out: list[tuple[bool, int]], removal: Removal) -> int:
        """The reserve that answered ``out`` removed ``removal`` (journaled just now): mark
        what it evicted on the spot, withhold what it evicted ahead, and return the journal
        position its reply waits for (0: none)."""
        if removal.evicted:
            self.evicted_in_place(pool, [page for _, page in removal.evicted])
        if removal.frontier:
            self.frontier_moved(pool)
        self.withheld(pool)
        return self.wait_after(pool, out)

    # ------------------------------------------------------------------ vLLM ranks

    def dropped(self, pid: PoolId) -> None:
        """The record just appended removed the vLLM rank ``pid`` (its whole pool)."""
        self._dropped[pid] = self.sink.seq

    def before_register(self, pid: PoolId) -> int:
        """Journal position registering ``pid`` waits for (0: none): its removal, since the
        new pool hands out the old one's pages (a crash must not bring back ``key -> page``
        over new bytes)."""
        seq = self._dropped.get(pid, 0)
        if seq and seq <= self.sink.durable_seq:
            del self._dropped[pid]
            return 0
        return seq

    # ------------------------------------------------------------------ removals

    def withheld(self, pool: Pool) -> None:
        """The removal just appended freed pages the pool withholds: release them once durable."""
        pages = pool.collect_withheld()
        if pages:
            self._pending.append((self.sink.seq, pool, pages, True))
            self._held[pool] = self._held.get(pool, 0) + len(pages)

    def evicted_in_place(self, pool: Pool, pages: list[int]) -> None:
        """The removal just appended freed ``pages`` that a reserve took at once: mark them."""
        seq = self.sink.seq
        marks = self._marks.setdefault(pool, {})
        for page in pages:
            marks[page] = seq
        self._pending.append((seq, pool, pages, False))

    def frontier_moved(self, pool: Pool) -> None:
        """The record just appended moved ``pool``'s frontier: the reply waits for it."""
        self._frontiers[pool] = self.sink.seq

    def catch_up(self) -> None:
        """Apply every removal that is durable now: release withheld pages, drop marks."""
        pending, durable = self._pending, self.sink.durable_seq
        if self._frontiers:
            for pool in [p for p, seq in self._frontiers.items() if seq <= durable]:
                del self._frontiers[pool]
        if self._dropped:
            for pid in [p for p, seq in self._dropped.items() if seq <= durable]:
                del self._dropped[pid]
        if not pending or pending[0][0] > durable:
            return
        released: dict[Pool, list[int]] = {}
        while pending and pending[0][0] <= durable:
            seq, pool, pages, withheld = pending.popleft()
            if withheld:
                if pool in released:
                    released[pool] += pages
                else:
                    released[pool] = pages
                continue
            marks = self._marks.get(pool)
            if marks is None:
                continue
            for page in pages:
                if marks.get(page) == seq:
                    del marks[page]
            if not marks:
                del self._marks[pool]
        if released:
            now, held = self.clock(), self._held
            for pool, pages in released.items():  # one call per pool, in journal order
                pool.release_withheld(pages, now)
                left = held[pool] - len(pages)
                if left:
                    held[pool] = left
                else:
                    del held[pool]

    # ------------------------------------------------------------------ waits

    def wait_before(self, pool: Pool, keys: list[str]) -> int:
        """Journal position a reserve of ``keys`` should wait for before it runs (0: none):
        the oldest pending removals whose withheld pages cover what the free pages do not
        (waiting for them beats evicting live keys)."""
        self.catch_up()
        if pool not in self._held or pool.allocatable_count >= len(keys):
            return 0
        need = pool.new_keys(keys) - pool.allocatable_count
        if need <= 0:
            return 0
        seq = 0
        for removal, owner, pages, withheld in self._pending:  # oldest first: shortest wait
            if owner is pool and withheld:
                seq = removal
                need -= len(pages)
                if need <= 0:
                    break
        return seq if seq > self.sink.durable_seq else 0

    def wait_after(self, pool: Pool, out: list[tuple[bool, int]]) -> int:
        """Journal position the reply ``out`` of a reserve must wait for (0: none): the newest
        not yet durable removal of a page it hands out, or the pool's frontier record."""
        seq = self._frontiers.get(pool, 0)
        marks = self._marks.get(pool)
        if not marks:
            return seq if seq > self.sink.durable_seq else 0
        for hit, page in out:
            if not hit:
                mark = marks.get(page, 0)
                if mark > seq:
                    seq = mark
        return seq if seq > self.sink.durable_seq else 0

    # ------------------------------------------------------------------ spare pages

    def spare_target(self, pool: Pool, batch: int) -> int:
        """Spare pages (free or withheld) to keep in a full pool for reserves of ``batch``."""
        if pool.num_pages < _MIN_SPARE_POOL:
            return 0
        base = min(pool.num_pages / _SPARE_FRACTION, _SPARE_BATCHES * batch)
        return int(base * self._growth_now(pool, self.clock()))

    def spare_too_small(self, pool: Pool) -> None:
        """A reserve on ``pool`` had to wait for withheld pages: the spare did not cover one
        journal group's worth of reserves, so keep half as much again."""
        now = self.clock()
        growth = min(self._growth_now(pool, now) * _GROWTH_STEP, _MAX_SPARE_GROWTH)
        self._growth[pool] = (growth, now)

    def _growth_now(self, pool: Pool, now: float) -> float:
        entry = self._growth.get(pool)
        if entry is None:
            return 1.0
        growth, since = entry
        decayed: float = 1.0 + (growth - 1.0) * 0.5 ** ((now - since) / _GROWTH_HALF_LIFE)
        if decayed < 1.01:
            del self._growth[pool]
            return 1.0
        return decayed
