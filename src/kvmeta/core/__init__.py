"""The pure page-pool model: no I/O, no threads, no clock (time is passed in)."""

from kvmeta.core.eviction import EvictionPolicy
from kvmeta.core.invariants import InvariantViolation, check_pool
from kvmeta.core.lru import LruPolicy
from kvmeta.core.pool import FREE, RESERVED, STORED, ConfirmOutcome, Pool, PoolCounters

__all__ = [
    "FREE",
    "RESERVED",
    "STORED",
    "ConfirmOutcome",
    "EvictionPolicy",
    "InvariantViolation",
    "LruPolicy",
    "Pool",
    "PoolCounters",
    "check_pool",
]
