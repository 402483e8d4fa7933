"""Reservations of a pool and their leases: who is writing which page, and until when.

- ``_reserved``: key -> page of the RESERVED pages (the pool's ``_stored`` holds the others);
- ``_res_deadline``: RESERVED page -> lease deadline, plus a queue in deadline order so expiry
  is amortised O(1). Leases all have the same length, so the order in which they are granted
  is their deadline order and a deque suffices. One queue entry holds every page one call
  leased, ``(deadline, [page, ...])``: a tuple and a float per key would cost ~80 bytes per
  key for as long as the lease lasts, more than the key's own structures. An entry outlives
  the leases it holds once they are confirmed (a lease usually ends long before its deadline),
  so when the queue holds more than twice the live leases (plus ``pool._QUEUE_SLACK``) it is
  compacted to the live ones: memory stays O(live leases), where it was O(reserve rate x TTL)
  (a server under the batch-64 cycle grew by megabytes a second, about 1 GB over the default
  300 s TTL), and the compaction is amortised O(1) per lease;
- ``_holders``: writers of a RESERVED page beyond the first (absent: one writer), so the
  common single-writer reservation costs no entry; a joined page is never freed by a release.
"""

from __future__ import annotations

from collections import deque

from kvmeta.core.eviction import EvictionPolicy
from kvmeta.core.pages import FREE, PageTable
from kvmeta.core.reports import PoolCounters

__all__ = ["LeaseTable"]


class LeaseTable(PageTable):
    """The reservation half of a ``Pool`` (module docstring). Expiry is the pool's own
    (``Pool._expire``): every operation runs it first, so it sits beside them."""

    __slots__ = ("counters", "_reserved", "_holders", "_res_deadline", "_res_queue", "_queued")

    def __init__(
        self, num_pages: int, reservation_ttl: float, read_lease: float, policy: EvictionPolicy
    ) -> None:
        super().__init__(num_pages, reservation_ttl, read_lease, policy)
        self.counters = PoolCounters()
        self._reserved: dict[str, int] = {}
        self._holders: dict[int, int] = {}  # RESERVED page -> writers, when more than one
        self._res_deadline: dict[int, float] = {}
        self._res_queue: deque[tuple[float, list[int]]] = deque()
        self._queued = 0  # pages in the queue's entries, live or not

    @property
    def reserved_count(self) -> int:
        return len(self._reserved)

    def _drop_reservation(self, page: int) -> None:
        """A reservation ended unconfirmed (released or expired)."""
        self._policy.unreserved(page)
        self._holders.pop(page, None)
        del self._res_deadline[page]
        self._page_key[page] = None
        self._state[page] = FREE

    def _compact_queue(self) -> None:
        """Keep only the leases still live in the queue, each once: a page whose deadline is
        its entry's (confirmed, released or expired pages have none; a renewed one is in a
        later entry, or in several with the same deadline when calls share a ``now``)."""
        deadlines = self._res_deadline
        leased = deadlines.keys()
        kept: deque[tuple[float, list[int]]] = deque()
        seen: set[int] = set()
        queued = 0
        for deadline, pages in self._res_queue:
            if leased.isdisjoint(pages):  # all gone (the usual entry): one pass in C
                continue
            live = []
            for page in pages:
                if page not in seen and deadlines.get(page) == deadline:
                    seen.add(page)
                    live.append(page)
            if live:
                kept.append((deadline, live))
                queued += len(live)
        self._res_queue = kept
        self._queued = queued
