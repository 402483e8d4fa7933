"""The pure page-pool model: no I/O, no threads, no clock (time is passed in)."""

from kvmeta.core.invariants import InvariantViolation, check_pool
from kvmeta.core.pool import FREE, RESERVED, STORED, ConfirmOutcome, Pool, PoolCounters

__all__ = [
    "FREE",
    "RESERVED",
    "STORED",
    "ConfirmOutcome",
    "InvariantViolation",
    "Pool",
    "PoolCounters",
    "check_pool",
]
