"""vLLM's batch_allocate is all or nothing for the new keys of a batch, on every backend.

vLLM's connector gives up a whole save when one key gets -1 and never releases the pages the
other keys got, so a partial grant would strand them until --reservation-ttl. A batch whose new
keys do not all fit (free pages plus evictable ones) gets -1 for each of them, STORED keys keep
their pages, and nothing changes: no reservation, no eviction, nothing journaled. SGLang's
batches stay per key (HiCache writes the pages it gets).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvmeta._types import PoolId
from kvmeta.store.base import PoolStats
from kvmeta.store.disk.local import DurabilityOptions, LocalBackend
from kvmeta.store.disk.memory import MemoryStore
from tests.contract.conftest import BACKENDS, Sync

V0 = PoolId("v", 0, "")
S0 = PoolId("s", 0, "kv")
LEASE = 60.0  # read leases that outlast the test however loaded the machine
KINDS = sorted([*BACKENDS, "durable"])


@pytest.fixture(params=KINDS)
def make(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Callable[..., Sync]]:
    """``make(lease=...)``: a started backend of the parametrised kind (durable: a journal
    that waits for its fsyncs, so the write-ahead rule is on)."""
    loop = asyncio.new_event_loop()
    started: list[Sync] = []

    def fixture(name: str) -> str:
        return str(request.getfixturevalue(name))

    def build(lease: float = 0.0) -> Sync:
        if request.param == "durable":
            backend = LocalBackend(
                MemoryStore(read_lease=lease),
                DurabilityOptions(data_dir=tmp_path / "data", snapshot_interval=0.0),
            )
        else:
            backend = BACKENDS[request.param](300.0, lease, fixture)
        loop.run_until_complete(backend.start())
        started.append(Sync(backend, loop, request.param))
        return started[-1]

    yield build
    try:
        for sync in started:
            sync.check()
    finally:
        for sync in started:
            loop.run_until_complete(sync.backend.close())
        loop.close()


def _stats(b: Sync, pool: PoolId) -> PoolStats:
    (st,) = [st for st in b.stats() if st.pool == pool]
    return st


def _journaled(b: Sync) -> int:
    """Records appended to the journal so far (0 without one)."""
    journal = getattr(b.backend, "journal", None)
    return 0 if journal is None else int(journal.seq)


def _store(b: Sync, pool: PoolId, keys: list[str]) -> dict[str, int]:
    out = b.reserve(pool, keys)
    pages = [page for _, page in out]
    assert -1 not in pages, out
    assert b.confirm(pool, list(zip(keys, pages, strict=True)), []) == 0
    return dict(zip(keys, pages, strict=True))


def test_a_batch_too_big_for_the_pool_gets_nothing_and_changes_nothing(
    make: Callable[..., Sync],
) -> None:
    b = make()
    b.v_register(0, 4, None)
    before = _journaled(b)
    keys = [f"k{i}" for i in range(6)]
    assert b.reserve(V0, keys) == [(False, -1)] * 6
    st = _stats(b, V0)
    assert (st.reserved, st.stored, st.free) == (0, 0, 4)
    assert st.counters["reservations_refused"] == 6
    assert _journaled(b) == before
    # The pages are all still there for a batch that fits.
    out = b.reserve(V0, keys[:4])
    assert sorted(page for _, page in out) == [0, 1, 2, 3]
    assert _stats(b, V0).reserved == 4


def test_stored_keys_keep_their_pages_and_nothing_is_evicted(make: Callable[..., Sync]) -> None:
    b = make()
    b.v_register(0, 4, None)
    pages = _store(b, V0, ["a", "b", "c", "d"])
    before = _journaled(b)
    # a and b are stored; three new keys need three pages, and only c and d may be evicted.
    batch = ["a", "n1", "b", "n2", "n3"]
    assert b.reserve(V0, batch) == [
        (True, pages["a"]),
        (False, -1),
        (True, pages["b"]),
        (False, -1),
        (False, -1),
    ]
    st = _stats(b, V0)
    assert (st.reserved, st.stored) == (0, 4)
    assert st.counters["evictions"] == 0
    assert b.exists(V0, ["a", "b", "c", "d"]) == [True] * 4
    assert _journaled(b) == before
    # Two new keys fit by evicting c and d; a and b stay.
    out = b.reserve(V0, ["a", "b", "n1", "n2"])
    assert out[:2] == [(True, pages["a"]), (True, pages["b"])]
    assert sorted(page for _, page in out[2:]) == sorted([pages["c"], pages["d"]])
    assert b.exists(V0, ["a", "b", "c", "d"]) == [True, True, False, False]


def test_pages_being_read_do_not_count_as_room(make: Callable[..., Sync]) -> None:
    b = make(lease=LEASE)
    b.v_register(0, 4, None)
    _store(b, V0, ["a", "b", "c", "d"])
    b.get(V0, ["a", "b"])  # read-leased: not evictable until the lease ends
    assert b.reserve(V0, ["n1", "n2", "n3"]) == [(False, -1)] * 3
    st = _stats(b, V0)
    assert (st.reserved, st.stored, st.counters["evictions"]) == (0, 4, 0)
    out = b.reserve(V0, ["n1", "n2"])
    assert -1 not in [page for _, page in out]
    assert b.exists(V0, ["a", "b", "c", "d"]) == [True, True, False, False]


@pytest.mark.parametrize("leased", [143, 144])
def test_the_count_pays_for_leased_pages_as_the_reserve_does(
    make: Callable[..., Sync], leased: int
) -> None:
    # The reserve steps over the leased pages at the cold end once (a step each, one more for
    # the page it then takes) and takes the pages after them for nothing. 40 keys have
    # 64 + 2 * 40 = 144 steps: 143 leased pages can be stepped over, 144 cannot. Memory and
    # Redis answer alike, and leave the LRU alike after a refusal.
    b = make(lease=LEASE)
    b.v_register(0, leased + 50, None)
    for i in range(leased + 50):
        _store(b, V0, [f"k{i}"])
    b.get(V0, [f"k{i}" for i in range(leased)])  # leased, and moved warm...
    cold = [f"k{i}" for i in range(leased, leased + 50)]
    assert all(hit for hit, _ in b.reserve(V0, cold))  # ...then these, not read
    keys = [f"n{i}" for i in range(40)]
    out = b.reserve(V0, keys)
    placed = [page >= 0 for _, page in out]
    assert all(placed) or not any(placed)
    if b.kind == "durable":
        return  # (it evicts ahead of need to keep pages spare, so its counts differ)
    if leased == 143:
        assert all(placed)
        assert b.exists(V0, cold) == [False] * 40 + [True] * 10
    else:
        assert not any(placed)
        st = _stats(b, V0)
        assert (st.reserved, st.counters["evictions"]) == (0, 0)
        # The refusal moved the leased pages it would have stepped over warm, as a reserve's
        # scan does, so the batch sent again finds the pages after them.
        out = b.reserve(V0, keys)
        assert -1 not in [page for _, page in out]
        assert b.exists(V0, cold) == [False] * 40 + [True] * 10


def test_a_refused_batch_moves_the_leased_pages_its_reserve_would_step_over(
    make: Callable[..., Sync],
) -> None:
    # The cold end alternates a page that can go with two read-leased ones: 80 keys need
    # 1 + 79 * 3 = 238 steps, more than their 64 + 2 * 80 = 224. Refused, the batch still
    # moves warm the leased pages its reserve would have stepped over (as a reserve's scans
    # would), so sent again it finds the pages that can go in a row.
    b = make(lease=LEASE)
    if b.kind == "durable":
        pytest.skip("a journaled store evicts ahead of need to keep pages spare: no such layout")
    b.v_register(0, 300, None)
    free = [f"t{i}" for i in range(100)]
    read = [f"l{i}" for i in range(200)]
    for key in free + read:
        _store(b, V0, [key])
    b.get(V0, read)  # read-leased
    for i in range(100):  # hits, in this order: the LRU from its cold end
        assert all(hit for hit, _ in b.reserve(V0, [free[i], read[2 * i], read[2 * i + 1]]))
    keys = [f"n{i}" for i in range(80)]
    assert b.reserve(V0, keys) == [(False, -1)] * 80
    out = b.reserve(V0, keys)
    assert -1 not in [page for _, page in out]
    assert b.exists(V0, free) == [False] * 80 + [True] * 20
    assert b.exists(V0, read) == [True] * 200


def test_a_key_reserved_by_another_writer_is_not_joined_by_a_refused_batch(
    make: Callable[..., Sync],
) -> None:
    b = make()
    b.v_register(0, 4, None)
    ((_, page),) = b.reserve(V0, ["shared"])
    assert b.reserve(V0, ["shared", "x1", "x2", "x3", "x4"]) == [(False, -1)] * 5
    # Had the refused batch joined the reservation, this release would leave the page
    # RESERVED (a joined page waits for its other writer).
    assert b.confirm(V0, [], [page]) == 0
    assert _stats(b, V0).reserved == 0


def test_sglang_batches_stay_per_key(make: Callable[..., Sync]) -> None:
    b = make()
    b.initialize(S0, 4)
    out = b.reserve(S0, [f"k{i}" for i in range(6)])
    assert sorted(page for _, page in out) == [-1, -1, 0, 1, 2, 3]
