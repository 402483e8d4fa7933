"""The change feed of the memory and durable backends (``store.changes``)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from kvmeta._types import PoolId
from kvmeta.store.changes import (
    CLEARED,
    REASON_CAPACITY,
    REASON_CLEAR,
    REASON_DELETE,
    REASON_DROP,
    REMOVED,
    STORED,
    Change,
)
from kvmeta.store.disk.local import LocalBackend
from kvmeta.store.disk.memory import MemoryStore
from tests.unit.store.durable_support import crash, open_backend

S0 = PoolId("s", 0, "kv")


async def _cycle(backend: LocalBackend, pid: PoolId, keys: list[str]) -> None:
    out = await backend.reserve(pid, keys)
    await backend.confirm(
        pid, [(k, p) for k, (hit, p) in zip(keys, out, strict=True) if not hit and p >= 0], []
    )


def _replay(changes: list[Change]) -> dict[PoolId, set[str]]:
    state: dict[PoolId, set[str]] = {}
    for c in changes:
        keys = state.setdefault(c.pool, set())
        if c.kind == STORED:
            keys.update(c.keys)
        elif c.kind == REMOVED:
            keys.difference_update(c.keys)
        else:
            keys.clear()
    return state


def _stored(store: MemoryStore) -> dict[PoolId, set[str]]:
    return {pid: {k for k, _ in p.stored_items()} for pid, p in store.pools.items()}


def test_memory_backend_reports_every_change_with_its_reason() -> None:
    async def main() -> list[Change]:
        backend = LocalBackend(MemoryStore(read_lease=0.0))
        seen: list[Change] = []
        backend.set_change_listener(seen.extend)
        await backend.initialize(S0, 4)
        await _cycle(backend, S0, ["a", "b", "c"])
        await backend.reserve(S0, ["a", "x"])  # a hit and a reservation: nothing
        assert len(seen) == 1
        await backend.confirm(S0, [("x", 3)], [])
        await _cycle(backend, S0, ["y"])  # full: evicts the coldest (a was touched? no: b)
        await backend.delete(S0, ["c", "nope"])
        await backend.clear(S0)
        await backend.v_register(0, 4, None)
        await _cycle(backend, PoolId("v", 0, ""), ["v1"])
        await backend.v_clear()
        await backend.v_remove(0)
        backend.set_change_listener(None)
        await _cycle(backend, S0, ["quiet"])
        return seen

    seen = asyncio.run(main())
    kinds = [(c.kind, c.reason) for c in seen]
    assert kinds == [
        (STORED, ""),
        (STORED, ""),
        (REMOVED, REASON_CAPACITY),
        (STORED, ""),
        (REMOVED, REASON_DELETE),
        (CLEARED, REASON_CLEAR),
        (STORED, ""),
        (CLEARED, REASON_CLEAR),
        (CLEARED, REASON_DROP),
    ]
    assert seen[0].keys == ("a", "b", "c")
    assert seen[1].keys == ("x",)
    assert len(seen[2].keys) == 1
    assert seen[4].keys == ("c",)
    assert seen[8].pool == PoolId("v", 0, "")


def test_no_listener_no_changes_collected() -> None:
    store = MemoryStore()
    assert store.changes is None


def test_durable_backend_delivers_only_once_fsynced(tmp_path: Path) -> None:
    async def main() -> None:
        backend = await open_backend(tmp_path, fsync="batch", fsync_interval=0.2)
        seen: list[Change] = []
        backend.set_change_listener(seen.extend)
        await backend.initialize(S0, 8)
        await _cycle(backend, S0, ["a", "b"])
        journal = backend.journal
        assert journal is not None
        # Acknowledged (batch mode) but not durable yet: not announced.
        assert journal.durable_seq < journal.seq
        assert seen == []
        await journal.wait(journal.seq)
        assert [c.keys for c in seen] == [("a", "b")]
        # Each delivery is covered by the durable position at that moment.
        await backend.delete(S0, ["a"])
        await journal.wait(journal.seq)
        assert seen[-1].kind == REMOVED and seen[-1].reason == REASON_DELETE
        await backend.close()

    asyncio.run(main())


def test_durable_crash_undoes_nothing_announced(tmp_path: Path) -> None:
    """What the listener heard is exactly what a restart recovers."""

    async def main() -> None:
        backend = await open_backend(tmp_path, fsync="always")
        seen: list[Change] = []
        backend.set_change_listener(seen.extend)
        await backend.initialize(S0, 16)
        for i in range(10):
            await _cycle(backend, S0, [f"k{i}a", f"k{i}b"])
        await backend.delete(S0, ["k1a"])
        await _cycle(backend, S0, [f"z{i}" for i in range(8)])  # evicts
        await crash(backend)
        heard = _replay(seen)
        again = await open_backend(tmp_path, fsync="always")
        assert heard == _stored(again.store)
        await again.close()

    asyncio.run(main())


@pytest.mark.parametrize("fsync", ["never"])
def test_durable_fsync_never_delivers_at_once(tmp_path: Path, fsync: str) -> None:
    async def main() -> None:
        backend = await open_backend(tmp_path, fsync=fsync)
        seen: list[Change] = []
        backend.set_change_listener(seen.extend)
        await backend.initialize(S0, 8)
        await _cycle(backend, S0, ["a"])
        assert [c.keys for c in seen] == [("a",)]
        await backend.close()

    asyncio.run(main())
