"""A store run with ``--hash-index`` keeps each SGLang pool's block-hash index in step with its
stored keys through every path that stores or removes one (confirm, eviction on the spot and
ahead of need, delete, clear), and a data directory's pools get theirs back on restart."""

from __future__ import annotations

import asyncio
import hashlib
import random
from pathlib import Path

import pytest

from kvmeta._types import PoolId
from kvmeta.core.invariants import check_hash_index, check_pool
from kvmeta.errors import NoHashIndex
from kvmeta.events.wire import sglang_hash
from kvmeta.store.disk.local import DurabilityOptions, LocalBackend
from kvmeta.store.disk.memory import MemoryStore
from tests.unit.store.durable_support import FakeJournal, crash, journaled, now

S0 = PoolId("s", 0, "kv")
S1 = PoolId("s", 1, "kv")
V0 = PoolId("v", 0, "")


def _key(i: int) -> str:
    return hashlib.sha256(str(i).encode()).hexdigest()


def _in_step(store: MemoryStore) -> None:
    assert store.hash_indexes is not None
    assert set(store.hash_indexes) == {pid for pid in store.pools if pid.dialect == "s"}
    for pid, index in store.hash_indexes.items():
        pool = store.pools[pid]
        check_pool(pool)
        check_hash_index(pool.stored_keys(), index.counts())


def _store(backend: LocalBackend, pid: PoolId, keys: list[str]) -> None:
    out = now(backend.reserve(pid, keys))
    pairs = [(k, page) for k, (hit, page) in zip(keys, out, strict=True) if not hit and page >= 0]
    now(backend.confirm(pid, pairs, []))


@pytest.mark.parametrize("write_ahead", [False, True], ids=["memory", "write-ahead"])
def test_the_index_follows_every_store_and_removal(write_ahead: bool) -> None:
    rng = random.Random(7)
    clock = [0.0]
    sink = FakeJournal()
    store = MemoryStore(read_lease=0.0, clock=lambda: clock[0], sink=sink, hash_index=True)
    # With the rule, evictions ahead of need: another path that removes stored keys.
    backend = journaled(store, sink) if write_ahead else LocalBackend(store)
    now(backend.initialize(S0, 40))
    now(backend.initialize(S1, 200))
    now(backend.v_register(0, 40, None))
    # Keys sharing a head with another (upper case), and keys with no hex head at all.
    universe = [_key(i) for i in range(120)] + [_key(i).upper() + "!" for i in range(10)]
    universe += [f"odd-{i}" for i in range(10)]
    for _ in range(400):
        clock[0] += 0.01
        pid = rng.choice([S0, S0, S1, V0])
        roll = rng.random()
        if roll < 0.7:
            _store(backend, pid, rng.sample(universe, rng.randint(1, 16)))
        elif roll < 0.9:
            now(backend.delete(pid, rng.sample(universe, rng.randint(1, 20))))
        elif roll < 0.97:
            now(backend.clear(pid))
        else:
            now(backend.v_clear())
        _in_step(store)
    _in_step(store)
    stored = store.pools[S0].stored_keys()
    hashes = [sglang_hash(k) for k in stored if not k.startswith("odd")]
    assert store.prefix_length_hashes(S0, hashes) == len(hashes)


def test_only_sglang_pools_on_a_server_with_the_flag_answer_hashes() -> None:
    plain = MemoryStore()
    plain.initialize(S0, 8)
    with pytest.raises(NoHashIndex, match="--hash-index"):
        plain.prefix_length_hashes(S0, [1])
    indexed = MemoryStore(hash_index=True)
    indexed.v_register(0, 8, None)
    with pytest.raises(NoHashIndex, match="matched by `keys`"):
        indexed.prefix_length_hashes(V0, [1])


async def _open(directory: Path, hash_index: bool) -> LocalBackend:
    backend = LocalBackend(
        MemoryStore(read_lease=0.0, hash_index=hash_index),
        DurabilityOptions(data_dir=directory, fsync="always", snapshot_interval=0.0),
    )
    await backend.start()
    return backend


def test_a_restart_rebuilds_the_index_from_the_recovered_keys(tmp_path: Path) -> None:
    async def main() -> None:
        backend = await _open(tmp_path, True)
        await backend.initialize(S0, 64)
        keys = [_key(i) for i in range(100)]
        for i in range(0, 100, 10):  # 100 keys into 64 pages: evictions are journaled too
            batch = keys[i : i + 10]
            out = await backend.reserve(S0, batch)
            await backend.confirm(S0, [(k, p) for k, (_, p) in zip(batch, out, strict=True)], [])
        await backend.delete(S0, keys[50:55])
        live = backend.store.pools[S0].stored_keys()
        await crash(backend)

        again = await _open(tmp_path, True)
        assert sorted(again.store.pools[S0].stored_keys()) == sorted(live)
        _in_step(again.store)
        hashes = [sglang_hash(k) for k in live]
        assert await again.prefix_length_hashes(S0, hashes) == len(live)
        await again.close()

        plain = await _open(tmp_path, False)
        with pytest.raises(NoHashIndex):
            await plain.prefix_length_hashes(S0, hashes)
        await plain.close()

    asyncio.run(main())


def test_check_reports_an_index_out_of_step_with_the_stored_keys() -> None:
    backend = LocalBackend(MemoryStore(read_lease=0.0, hash_index=True))
    store = backend.store
    store.initialize(S0, 16)
    keys = [_key(i) for i in range(6)]
    _store(backend, S0, keys)
    assert asyncio.run(backend.check()).problems == []
    assert store.hash_indexes is not None
    store.hash_indexes[S0].remove(keys[:1])  # a stored page hidden from routers
    (problem,) = asyncio.run(backend.check()).problems
    assert "hash index out of step" in problem and "1 missing" in problem
    store.hash_indexes[S0].add(keys[:1] + [_key(99)])  # and one advertising nothing stored
    (problem,) = asyncio.run(backend.check()).problems
    assert "1 hash(es) with a wrong count" in problem
