"""What both in-process clients share: one store, the server's request limits, one lock."""

from __future__ import annotations

import threading

from kvmeta.service.limits import RequestLimits
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
