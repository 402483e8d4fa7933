"""What the operator JSON (``/v1/pools``, ``/v1/status``) shows of a pool and of the server's
settings. Its own module so that both the operator routes and the status page import it, and
the status page needs nothing from the operator routes at run time.
"""

from __future__ import annotations

from typing import Any

from kvmeta import __version__
from kvmeta.config import Settings
from kvmeta.store.base import Backend, PoolStats

__all__ = ["pool_view", "settings_view"]


def _rate(hits: int, misses: int) -> float | None:
    total = hits + misses
    return round(hits / total, 4) if total else None


def pool_view(st: PoolStats) -> dict[str, Any]:
    """One pool as ``/v1/pools`` shows it."""
    c = st.counters
    return {
        "tenant": st.pool.tenant,
        "dialect": st.pool.dialect,
        "rank": st.pool.rank,
        "namespace": st.pool.namespace,
        "num_pages": st.num_pages,
        "free": st.free,
        "cooling": st.cooling,
        "held_after_restart": st.held_after_restart,
        "reserved": st.reserved,
        "stored": st.stored,
        "occupancy": round(st.stored / st.num_pages, 4) if st.num_pages else 0.0,
        "hit_rate": _rate(c.get("get_hits", 0), c.get("get_misses", 0)),
        "exists_hit_rate": _rate(c.get("exists_hits", 0), c.get("exists_misses", 0)),
        "size_conflicts": st.size_conflicts,
        "counters": c,
    }


def settings_view(settings: Settings, backend: Backend, server_wide: bool = True) -> dict[str, Any]:
    """Settings an operator wants next to the pools (never the token).

    ``server_wide`` False is a tenant's token: like ``/metrics``, it sees the backend's kind,
    not where it is (the Redis address, the data directory), since those are the operator's
    business and the same for every tenant."""
    if not server_wide:
        durability = backend.name
    elif settings.backend:  # a shared backend keeps all state itself: no data directory
        durability = backend.name
    else:
        durability = "in-memory" if settings.in_memory else settings.data_dir
    return {
        "version": __version__,
        "backend": backend.describe if server_wide else backend.name,
        "epoch": backend.epoch,  # changes when the backend's state may have been lost
        "durability": durability,
        "fsync": None if settings.backend else settings.fsync,
        "reservation_ttl": settings.reservation_ttl,
        "read_lease": settings.read_lease,
        "auth": bool(settings.auth_token or settings.auth_file),
        "tenants": bool(settings.auth_file),
        "tls": bool(settings.ssl_certfile),
        "limits": {
            "max_body_bytes": settings.max_body_bytes,
            "max_keys": settings.max_keys,
            "max_key_length": settings.max_key_length,
            "max_namespace_length": settings.max_namespace_length,
            "max_pages": settings.max_pages,
        },
    }
