"""The pure page-pool model: no I/O, no threads, no clock (time is passed in)."""

from kvmeta.core.eviction import EvictionPolicy, PolicyFactory
from kvmeta.core.invariants import InvariantViolation, check_pool
from kvmeta.core.lru import LruPolicy
from kvmeta.core.pool import FREE, RESERVED, STORED, ConfirmOutcome, Pool, PoolCounters
from kvmeta.core.prefix import PrefixPolicy

# ``--eviction``'s choices: the policy each name makes pools with.
EVICTION_POLICIES: dict[str, PolicyFactory] = {"lru": LruPolicy, "prefix": PrefixPolicy}

__all__ = [
    "FREE",
    "RESERVED",
    "STORED",
    "ConfirmOutcome",
    "EVICTION_POLICIES",
    "EvictionPolicy",
    "InvariantViolation",
    "LruPolicy",
    "Pool",
    "PoolCounters",
    "PrefixPolicy",
    "check_pool",
]
