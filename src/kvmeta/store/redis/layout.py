"""Where kvmeta's state lives in Redis: every key name, in one place.

Every key kvmeta keeps in Redis starts with ``PREFIX``, which names the data layout the
scripts expect (``_lib.lua`` has the per-pool structures). Each SGLang pool lives under its own
hash tag ``kvmeta:2:{s:RANK:NS}:``, so on a Redis Cluster pools spread over shards while one
pool's keys stay in one slot. The vLLM index (per-rank pools, the rank registry and the world
size) is one unit under ``kvmeta:2:{v}:``, because completeness spans every rank atomically.
Every script gets every key it touches in ``KEYS`` (``pool_keys``), as Redis Cluster requires;
a vLLM index script that spans ranks gets the keys of the ranks the registry listed when read
just before, and refuses (nothing changed, read again) if the registry changed in between.
``kvmeta:2:pools`` lists the SGLang pools, for stats only.

Tenants: the default tenant ``""`` has the names above. Another tenant T has its own hash tags,
``kvmeta:2:{T|s:RANK:NS}:`` per SGLang pool and ``kvmeta:2:{T|v}:`` for its vLLM index (T
%-quoted, so no ``|`` inside: no tenant/namespace pair can spell another pair's tag, and the
default tenant's tags have no ``|`` at all). Its SGLang pools are listed in
``kvmeta:2:pools:T``, and ``kvmeta:2:tenants`` lists every tenant that ever created a pool, so
stats, check and the pool list see every tenant's pools (an older kvmeta reads neither set: it
sees only the default tenant's pools, never a tenant's pool as its own).
"""

from __future__ import annotations

import functools
from urllib.parse import quote

from kvmeta._types import PoolId

__all__ = [
    "EPOCH_KEY",
    "HIDX",
    "HOLD_KEY",
    "OLD_LAYOUTS",
    "POOL_PARTS",
    "PREFIX",
    "TENANTS",
    "pool_keys",
    "pool_prefix",
    "s_registry",
    "v_keys",
    "v_prefix",
]

# A release that changes the data layout changes the prefix, so its scripts never read pools
# written in another layout (they are not found: engines re-initialise, empty, never wrong).
# ``OLD_LAYOUTS`` names the earlier ones (prefix -> its pool registry), to tell the operator
# at start-up.
PREFIX = "kvmeta:2"
OLD_LAYOUTS = {"kvmeta": "kvmeta:pools"}
_S_REGISTRY = f"{PREFIX}:pools"
EPOCH_KEY = f"{PREFIX}:epoch"
# The end of the hold after a data loss (``_lib.lua`` ``hold_after_loss``).
HOLD_KEY = f"{PREFIX}:hold_until"
_V_PREFIX = f"{PREFIX}:{{v}}:"
TENANTS = f"{PREFIX}:tenants"
# One pool's Redis keys, in the order a pool script receives them in KEYS (see _lib.lua).
POOL_PARTS = (
    "meta",
    "stored",
    "reserved",
    "pk",
    "holders",
    "free",
    "lru",
    "resq",
    "reads",
    "cool",
    "hidx",
)
HIDX = POOL_PARTS.index("hidx")


def _owner(tenant: str) -> str:
    """What starts a tenant's hash tags: nothing for the default tenant (today's names)."""
    return f"{quote(tenant, safe='')}|" if tenant else ""


def v_prefix(tenant: str) -> str:
    """The hash-tagged key prefix of ``tenant``'s vLLM index (registry and rank pools)."""
    return f"{PREFIX}:{{{_owner(tenant)}v}}:" if tenant else _V_PREFIX


def v_keys(tenant: str) -> tuple[str, str]:
    """``tenant``'s rank registry and world size keys."""
    prefix = v_prefix(tenant)
    return prefix + "ranks", prefix + "world"


def s_registry(tenant: str) -> str:
    """The set listing ``tenant``'s SGLang pools (``RANK:NS`` members)."""
    return f"{_S_REGISTRY}:{quote(tenant, safe='')}" if tenant else _S_REGISTRY


def pool_prefix(pid: PoolId) -> str:
    """The hash-tagged key prefix of one pool (namespaces and tenants are %-quoted: no braces
    or ``|`` inside)."""
    if pid.dialect == "v":
        return f"{v_prefix(pid.tenant)}r{pid.rank}:"
    return f"{PREFIX}:{{{_owner(pid.tenant)}s:{pid.rank}:{quote(pid.namespace, safe='')}}}:"


@functools.lru_cache(maxsize=4096)
def pool_keys(pid: PoolId) -> tuple[str, ...]:
    """Every Redis key of one pool, in ``POOL_PARTS`` order: a pool script's ``KEYS``."""
    prefix = pool_prefix(pid)
    return tuple(prefix + part for part in POOL_PARTS)
