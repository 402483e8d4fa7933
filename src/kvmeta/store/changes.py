"""The change feed: what a backend reports after a pool's stored keys changed durably.

Subscribers outside the store (the KV event publisher) must never announce what a crash can
undo, and must see every store and removal, evictions included, which only the backend knows.
So each backend calls its listener (``Backend.set_change_listener``) with the changes of each
operation once they are durable by its own rule: memory at once; a data directory once the
journal records holding them are fsynced; Redis once the script (and the replica wait, when
``--min-replicas-ack`` is set) answered. Calls come on the event loop, in the order the changes
were made, and the listener must not block or raise.

A backend whose call can fail without saying whether it changed anything (Redis: the script was
sent, then the connection failed or the replica wait fell short; Redis may have run it, or run
it later) reports ``UNSURE`` for that pool instead of guessing: the listener must read the
pool again (``Backend.settle_changes``, then ``Backend.dump``) to know what it holds.

A backend whose whole state can vanish under it (Redis restarted without persistence, or
flushed: its epoch changed) reports ``LOST`` once it notices, for ``EVERY_POOL``: every pool the
listener knows may be gone, and new ones may exist; the listener reads the whole state again.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from kvmeta._types import PoolId

__all__ = [
    "CLEARED",
    "EVERY_POOL",
    "LOST",
    "REASON_CAPACITY",
    "REASON_CLEAR",
    "REASON_DATA_LOST",
    "REASON_DELETE",
    "REASON_DROP",
    "REASON_RESTART",
    "REASON_RESYNC",
    "REMOVED",
    "STORED",
    "UNSURE",
    "Change",
    "ChangeListener",
]

STORED = "stored"  # keys confirmed: readable from now on
REMOVED = "removed"  # keys no longer stored (their pages may be written again)
CLEARED = "cleared"  # every key of the pool removed at once (``keys`` is empty)
UNSURE = "unsure"  # a call may have changed the pool without a reply saying how (``keys`` empty)
LOST = "lost"  # the backend's whole state may be gone (pool ``EVERY_POOL``, ``keys`` empty)

REASON_CAPACITY = "capacity"  # evicted (LRU) to make room
REASON_DELETE = "delete"  # an explicit delete
REASON_CLEAR = "clear"  # a clear of the pool
REASON_DROP = "drop"  # the pool itself went away (a vLLM rank deregistered)
REASON_RESTART = "restart-recovery"  # a subscriber's resync after a restart (publisher only)
REASON_RESYNC = "resync"  # a pool stated again after an UNSURE change (publisher only)
REASON_DATA_LOST = "data-lost"  # every pool stated again after a LOST change (publisher only)

# The pool a LOST change names: no pool's (no dialect is "*").
EVERY_POOL = PoolId("*", -1, "")


class Change(NamedTuple):
    """One durable change of one pool (a tuple: made at each store operation while a listener
    is set, so it is built in C, cheaper than a frozen dataclass: ``benchmarks/micro_costs.py``)."""

    pool: PoolId
    kind: str  # STORED | REMOVED | CLEARED | UNSURE | LOST
    keys: tuple[str, ...]  # STORED/REMOVED: the keys, in the order they changed; else ()
    reason: str = ""  # REMOVED/CLEARED: one of the REASON_* values; STORED: ""


ChangeListener = Callable[[list[Change]], None]
