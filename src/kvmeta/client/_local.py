"""What both in-process clients share: one store, the server's operations core, one lock.

Every operation runs through ``service.core`` (the code the server runs), driven
synchronously on a ``MemoryStore``: the same checks in the same order, so a mistake raises the
same error class with the same message in-process as over HTTP (but for SGLang's "not
initialized", which its in-process client words its own way: ``client.sglang``). The caller
warnings the server sends as ``X-Kvmeta-Warning`` (a size conflict, refused confirms) are
logged here, on the ``kvmeta.client`` logger, with the header's text.
"""

from __future__ import annotations

import logging
import threading
from typing import TypeVar

from kvmeta.lograte import warn_limited
from kvmeta.service.core import Op, Operations, Outcome, run_sync
from kvmeta.service.limits import RequestLimits
from kvmeta.store.disk.memory import MemoryStore
from kvmeta.store.epoch import new_epoch

__all__ = ["LocalState"]

logger = logging.getLogger("kvmeta.client")

T = TypeVar("T")


class LocalState:
    """Pools in this process, no server: for a single-node engine.

    Thread-safe (one lock over each whole operation); state is lost when the process exits.
    """

    def __init__(
        self,
        *,
        reservation_ttl: float = 300.0,
        read_lease: float = 5.0,
        limits: RequestLimits | None = None,
    ) -> None:
        self._store = MemoryStore(reservation_ttl=reservation_ttl, read_lease=read_lease)
        self._ops = Operations(limits)
        self._lock = threading.Lock()
        self._epoch = new_epoch()

    @property
    def epoch(self) -> str:
        """As the HTTP clients' ``epoch``: the state lives and dies with this object, so its
        epoch never changes (there is nothing to re-initialise)."""
        return self._epoch

    def _run(self, op: Op[T]) -> T:
        with self._lock:
            return run_sync(op, self._store)

    def _warned(self, op: Op[Outcome[T]]) -> T:
        """Run ``op`` and log its caller warnings as the server's header would carry them."""
        outcome = self._run(op)
        for kind, text in outcome.warnings:
            warn_limited(logger, f"client {kind}", "%s: %s", kind, text)
        return outcome.value
