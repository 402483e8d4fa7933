"""Helpers for in-process durable backend tests."""

from __future__ import annotations

import os
from pathlib import Path

from kvmeta._types import PoolId
from kvmeta.store.disk.durable import DurabilityOptions, DurableBackend
from kvmeta.store.disk.memory import MemoryStore

S0 = PoolId("s", 0, "kv")


async def open_backend(directory: Path, **options: object) -> DurableBackend:
    opts = {"fsync": "always", "snapshot_interval": 0.0, **options}
    backend = DurableBackend(
        MemoryStore(read_lease=0.0),
        DurabilityOptions(data_dir=directory, **opts),  # type: ignore[arg-type]
    )
    await backend.start()
    return backend


async def crash(backend: DurableBackend) -> None:
    """Stop like a killed process whose journal reached the disk: no final snapshot."""
    assert backend.journal is not None
    await backend.journal.close()
    for task in backend._tasks:
        task.cancel()
    os.close(backend._lock_fd)
    backend._lock_fd = -1
    backend._closed = True


def state(backend: DurableBackend) -> dict[PoolId, tuple[int, list[tuple[str, int]]]]:
    """Every pool's size and stored items, coldest first."""
    return {pid: (p.num_pages, p.stored_items()) for pid, p in backend.store.pools.items()}


async def cycle(backend: DurableBackend, pid: PoolId, keys: list[str]) -> list[int]:
    """Reserve and confirm ``keys``; returns their pages."""
    out = await backend.reserve(pid, keys)
    pairs = [(k, page) for k, (hit, page) in zip(keys, out, strict=True) if not hit and page >= 0]
    await backend.confirm(pid, pairs, [])
    return [page for _, page in out]
