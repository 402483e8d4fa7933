"""Helpers for in-process durable backend tests."""

from __future__ import annotations

import os
from collections.abc import Coroutine, Generator
from pathlib import Path
from typing import Any, TypeVar

from kvmeta._types import PoolId
from kvmeta.store.disk.codec import Record
from kvmeta.store.disk.local import DurabilityOptions, LocalBackend
from kvmeta.store.disk.memory import MemoryStore

S0 = PoolId("s", 0, "kv")


async def open_backend(directory: Path, **options: object) -> LocalBackend:
    opts = {"fsync": "always", "snapshot_interval": 0.0, **options}
    backend = LocalBackend(
        MemoryStore(read_lease=0.0),
        DurabilityOptions(data_dir=directory, **opts),  # type: ignore[arg-type]
    )
    await backend.start()
    return backend


async def crash(backend: LocalBackend) -> None:
    """Stop like a killed process whose journal reached the disk: no final snapshot."""
    disk = backend.disk
    assert backend.journal is not None and disk is not None
    await backend.journal.close()
    for task in disk._tasks:
        task.cancel()
    os.close(disk._lock_fd)
    disk._lock_fd = -1
    disk._closed = True


def state(backend: LocalBackend) -> dict[PoolId, tuple[int, list[tuple[str, int]]]]:
    """Every pool's size and stored items, coldest first."""
    return {pid: (p.num_pages, p.stored_items()) for pid, p in backend.store.pools.items()}


async def cycle(backend: LocalBackend, pid: PoolId, keys: list[str]) -> list[int]:
    """Reserve and confirm ``keys``; returns their pages."""
    out = await backend.reserve(pid, keys)
    pairs = [(k, page) for k, (hit, page) in zip(keys, out, strict=True) if not hit and page >= 0]
    await backend.confirm(pid, pairs, [])
    return [page for _, page in out]


_T = TypeVar("_T")


class _Pause:
    """An awaitable that suspends its coroutine once (the test resumes it)."""

    def __await__(self) -> Generator[None, None, None]:
        yield


class FakeJournal:
    """A journal in memory for a ``LocalBackend`` driven without an event loop: it numbers
    records, and they are durable at once (``auto``) or only when the test moves
    ``durable_seq``; a reply that waits suspends its coroutine until then."""

    waits = True
    mode = "batch"
    refusing = False

    def __init__(self, auto: bool = True) -> None:
        self.auto = auto
        self.records: list[Record] = []
        self.seq = 0
        self.durable_seq = 0
        self.on_durable = None

    def append(self, record: Record) -> None:
        self.records.append(record)
        self.seq += 1
        if self.auto:
            self.durable_seq = self.seq

    async def wait(self, seq: int) -> None:
        while self.durable_seq < seq:
            await _Pause()


def journaled(store: MemoryStore, journal: FakeJournal) -> LocalBackend:
    """A local backend over ``store`` writing to ``journal``, keeping the write-ahead rule."""
    backend = LocalBackend(store)
    backend.attach(journal)  # type: ignore[arg-type]
    return backend


def now(call: Coroutine[Any, Any, _T]) -> _T:
    """The result of a backend call that must not wait for the disk."""
    try:
        call.send(None)
    except StopIteration as done:
        return done.value  # type: ignore[no-any-return]
    call.close()
    raise AssertionError("the call waited for the disk")
