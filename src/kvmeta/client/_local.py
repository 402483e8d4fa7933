"""What both in-process clients share: one store, the server's request limits, one lock.

Every check the server's service layer makes (``service.ops``) is made here too, through the
same ``RequestLimits`` methods with the same dialect field names, so a mistake raises the same
error class with the same message in-process as over HTTP.
"""

from __future__ import annotations

import threading

from kvmeta._types import PoolId
from kvmeta.service.limits import CONFIRM_FIELDS, RequestLimits
from kvmeta.store.base import InitResult
from kvmeta.store.memory import MemoryStore

__all__ = ["LocalState"]


class LocalState:
    """Pools in this process, no server: for a single-node engine.

    Thread-safe (one lock); state is lost when the process exits.
    """

    def __init__(
        self,
        *,
        reservation_ttl: float = 300.0,
        read_lease: float = 5.0,
        limits: RequestLimits | None = None,
    ) -> None:
        self._store = MemoryStore(reservation_ttl=reservation_ttl, read_lease=read_lease)
        self._limits = limits or RequestLimits()
        self._lock = threading.Lock()

    def _check_budget(self, pid: PoolId, num_pages: int) -> None:
        """Under the lock: a new pool must fit --max-total-pages (as on the server)."""
        if pid not in self._store.pools:
            self._limits.check_total_pages(self._store.total_pages, num_pages)

    def _initialize(self, pid: PoolId, num_pages: int) -> InitResult:
        limits = self._limits
        limits.check_rank(pid.rank)
        limits.check_num_pages(num_pages)
        if pid.dialect == "s":
            limits.check_namespace(pid.namespace)
        with self._lock:
            self._check_budget(pid, num_pages)
            return self._store.initialize(pid, num_pages)

    def _v_register(self, rank: int, num_pages: int, world_size: int | None) -> InitResult:
        limits = self._limits
        limits.check_rank(rank)
        limits.check_num_pages(num_pages)
        limits.check_world_size(world_size)
        with self._lock:
            self._check_budget(PoolId("v", rank, ""), num_pages)
            return self._store.v_register(rank, num_pages, world_size)

    def _confirm(self, pid: PoolId, pairs: list[tuple[str, int]], release: list[int]) -> int:
        """Returns how many pairs were refused (pages not reserved for their key)."""
        fields = CONFIRM_FIELDS[pid.dialect]
        self._limits.check_rank(pid.rank)
        self._limits.check_confirm(pairs, release, fields)
        with self._lock:
            pool = self._store.pool(pid)  # NotInitialized, in the server's words
            self._limits.check_pages(pairs, release, pool.num_pages, fields)
            return self._store.confirm(pid, pairs, release)
