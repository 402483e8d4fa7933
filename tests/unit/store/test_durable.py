"""The durable backend in-process: restarts, crashes, snapshots, damage, write-ahead waits."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest

from kvmeta._types import PoolId
from kvmeta.core import check_pool
from kvmeta.errors import JournalCorrupt
from kvmeta.store.disk.check import check_data_dir
from kvmeta.store.disk.recovery import list_data_dir, recover
from tests.unit.store.durable_support import S0, crash, cycle, open_backend, state

MAMBA = PoolId("s", 0, "mamba")


async def _workload(directory: Path) -> dict[PoolId, tuple[int, list[tuple[str, int]]]]:
    b = await open_backend(directory)
    try:
        await b.initialize(S0, 4)
        await b.initialize(MAMBA, 3)
        await cycle(b, S0, ["a", "b", "c"])
        await cycle(b, MAMBA, ["m1", "m2"])
        await b.delete(S0, ["b"])
        await cycle(b, S0, ["d", "e", "f"])  # evicts the coldest: a
        await b.clear(MAMBA)
        await cycle(b, MAMBA, ["m3"])
        return state(b)
    finally:
        await crash(b)


def test_crash_then_restart_replays_the_journal(tmp_path: Path) -> None:
    async def main() -> None:
        before = await _workload(tmp_path)
        assert before[S0][1] == [("c", 2), ("d", 1), ("e", 3), ("f", 0)]
        assert list_data_dir(tmp_path).snapshots == []
        b = await open_backend(tmp_path)
        try:
            assert state(b) == before
        finally:
            await b.close()

    asyncio.run(main())


def test_clean_close_snapshots_and_compacts(tmp_path: Path) -> None:
    async def main() -> None:
        before = await _workload(tmp_path)
        b = await open_backend(tmp_path)
        await b.close()
        listing = list_data_dir(tmp_path)
        assert len(listing.snapshots) == 1
        assert all(seg >= listing.snapshots[0] for seg in listing.segments)  # older ones dropped
        b = await open_backend(tmp_path)
        try:
            assert state(b) == before
            assert b.durability_stats()["journal_records"] == 0
        finally:
            await b.close()

    asyncio.run(main())


def test_snapshot_while_changing_matches_its_journal_position(tmp_path: Path) -> None:
    async def main() -> None:
        b = await open_backend(tmp_path)
        await b.initialize(S0, 64)
        await cycle(b, S0, [f"k{i}" for i in range(40)])
        snap = asyncio.create_task(b.snapshot())
        await asyncio.sleep(0)  # the capture ran; changes below go to the next segment
        await b.delete(S0, ["k0", "k1"])
        await cycle(b, S0, ["x", "y"])
        await snap
        before = state(b)
        await crash(b)
        b = await open_backend(tmp_path)
        try:
            assert state(b) == before
            assert b.durability_stats()["snapshots"] == 0
        finally:
            await b.close()

    asyncio.run(main())


def test_vllm_registrations_survive_restart(tmp_path: Path) -> None:
    async def main() -> None:
        b = await open_backend(tmp_path)
        await b.v_register(0, 8, 2)
        await b.v_register(1, 8, 2)
        for rank in (0, 1):
            await cycle(b, PoolId("v", rank, ""), ["h1"])
        await cycle(b, PoolId("v", 0, ""), ["h2"])
        await crash(b)
        b = await open_backend(tmp_path)
        try:
            assert b.store.vllm_ranks() == [0, 1] and b.store.vllm_world_size == 2
            assert await b.v_exists(["h1", "h2"]) == [True, False]
            await cycle(b, PoolId("v", 1, ""), ["h2"])
            assert await b.v_exists(["h2"]) == [True]
        finally:
            await b.close()

    asyncio.run(main())


def _last_segment(directory: Path) -> Path:
    return directory / f"journal-{list_data_dir(directory).segments[-1]:012d}.log"


def test_torn_tail_is_cut_with_a_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    before = asyncio.run(_workload(tmp_path))
    segment = _last_segment(tmp_path)
    size = segment.stat().st_size
    with open(segment, "ab") as fh:
        fh.write(b"\x40\x00\x00\x00\x12\x34")  # half a frame header: a crash mid-append
    assert not check_data_dir(tmp_path).problems  # check reports, start-up repairs

    async def main() -> None:
        with caplog.at_level(logging.WARNING, logger="kvmeta.store.disk.recovery"):
            b = await open_backend(tmp_path)
        try:
            assert state(b) == before
        finally:
            await crash(b)

    asyncio.run(main())
    assert "torn last record (6 bytes" in caplog.text and segment.name in caplog.text
    assert segment.stat().st_size == size


def test_corrupt_journal_refuses_to_start(tmp_path: Path) -> None:
    asyncio.run(_workload(tmp_path))
    segment = _last_segment(tmp_path)
    data = bytearray(segment.read_bytes())
    data[20] ^= 0xFF
    segment.write_bytes(bytes(data))
    with pytest.raises(JournalCorrupt) as info:
        asyncio.run(open_backend(tmp_path))
    message = str(info.value)
    assert segment.name in message and "kvmeta check" in message and "--in-memory" in message
    assert segment.read_bytes() == bytes(data)  # evidence untouched
    report = check_data_dir(tmp_path)
    assert not report.ok and segment.name in report.problems[0]


def test_corrupt_snapshot_refuses_to_start(tmp_path: Path) -> None:
    async def snap() -> None:
        b = await open_backend(tmp_path)
        await b.initialize(S0, 4)
        await cycle(b, S0, ["a"])
        await b.close()

    asyncio.run(snap())
    path = tmp_path / f"snapshot-{list_data_dir(tmp_path).snapshots[-1]:012d}.snap"
    data = bytearray(path.read_bytes())
    data[-2] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(JournalCorrupt, match=f"{path.name}: checksum mismatch"):
        asyncio.run(open_backend(tmp_path))


def test_second_server_on_one_directory_is_refused(tmp_path: Path) -> None:
    async def main() -> None:
        b = await open_backend(tmp_path)
        try:
            with pytest.raises(OSError, match="in use by another kvmeta"):
                await open_backend(tmp_path)
        finally:
            await b.close()

    asyncio.run(main())


def test_reserve_waits_only_when_it_hands_out_a_page_after_a_pending_removal(
    tmp_path: Path,
) -> None:
    async def main() -> None:
        b = await open_backend(tmp_path, fsync="batch", fsync_interval=0.3)
        j = b.journal
        assert j is not None
        try:
            await b.initialize(S0, 2)
            await cycle(b, S0, ["a", "b"])
            waits = b.durability_stats()["reserve_waits"]  # (the frontier's: the next test)
            b.store.delete(S0, ["a"])  # removal buffered, not yet durable
            assert j.durable_seq < j.removal_seq
            assert await b.reserve(S0, ["b"]) == [(True, 1)]  # pure hit: no wait
            assert j.durable_seq < j.removal_seq
            assert b.durability_stats()["reserve_waits"] == waits
            assert await b.reserve(S0, ["c"]) == [(False, 0)]  # page 0 held "a"
            assert j.durable_seq >= j.removal_seq
            stats = b.durability_stats()  # the status page and metrics show the wait
            assert stats["reserve_waits"] == waits + 1 and stats["reserve_wait_seconds"] > 0
        finally:
            await b.close()

    asyncio.run(main())


def test_a_reserve_past_the_recorded_frontier_replies_once_the_new_one_is_durable(
    tmp_path: Path,
) -> None:
    """A crash must not forget that a page was handed out: the reply that hands out the
    first page past the frontier waits for the record that moves it (``batch`` too)."""

    async def main() -> None:
        b = await open_backend(tmp_path, fsync="batch", fsync_interval=0.3)
        j = b.journal
        assert j is not None
        try:
            await b.initialize(S0, 4096)
            assert await b.reserve(S0, ["a"]) == [(False, 0)]
            moved = j.seq  # the frontier record is the last one appended
            assert j.durable_seq >= moved and b.store.pool(S0).frontier == 1025
            assert await b.reserve(S0, [f"k{i}" for i in range(1024)])  # within the step
            assert j.seq == moved and b.durability_stats()["reserve_waits"] == 1
        finally:
            await b.close()
        state = recover(tmp_path)
        assert state.frontiers == {S0: 1025}

    asyncio.run(main())


def test_always_mode_confirm_replies_after_its_record_is_durable(tmp_path: Path) -> None:
    async def main() -> None:
        b = await open_backend(tmp_path, fsync="always")
        j = b.journal
        assert j is not None
        try:
            await b.initialize(S0, 4)
            await cycle(b, S0, ["a"])
            assert j.durable_seq == j.seq
            stats = b.durability_stats()
            assert stats["fsyncs"] >= 1 and stats["journal_bytes"] > 0
        finally:
            await b.close()

    asyncio.run(main())


def test_batch_mode_waits_for_pool_creation_but_not_for_confirm(tmp_path: Path) -> None:
    async def main() -> None:
        b = await open_backend(tmp_path, fsync="batch", fsync_interval=0.2)
        j = b.journal
        assert j is not None
        try:
            await b.initialize(S0, 4)
            assert j.durable_seq == j.seq  # an engine must never lose its pool
            await cycle(b, S0, ["a"])
            assert j.durable_seq < j.seq  # the confirm is in the next group
        finally:
            await b.close()
        b = await open_backend(tmp_path)
        try:
            assert b.store.pool(S0).page_of("a") == 0  # a clean close writes everything
        finally:
            await b.close()

    asyncio.run(main())


def test_never_mode_does_not_wait(tmp_path: Path) -> None:
    async def main() -> None:
        b = await open_backend(tmp_path, fsync="never", fsync_interval=0.5)
        j = b.journal
        assert j is not None
        try:
            await b.initialize(S0, 4)
            await cycle(b, S0, ["a"])
            assert j.durable_seq < j.seq
            assert b.durability_stats()["fsyncs"] == 0
        finally:
            await b.close()
        b = await open_backend(tmp_path)
        try:
            assert b.store.pool(S0).page_of("a") == 0
        finally:
            await b.close()

    asyncio.run(main())


def test_journal_file_cut_before_its_header_is_dropped(tmp_path: Path) -> None:
    before = asyncio.run(_workload(tmp_path))
    last = list_data_dir(tmp_path).segments[-1]
    stub = tmp_path / f"journal-{last + 1:012d}.log"
    stub.write_bytes(b"KVM")  # crash between creating the file and writing its header

    async def main() -> None:
        b = await open_backend(tmp_path)
        try:
            assert state(b) == before
        finally:
            await b.close()

    asyncio.run(main())
    assert not stub.exists()


def test_full_pool_evicts_ahead_so_reserves_need_not_wait(tmp_path: Path) -> None:
    """Steady-state eviction: pages are evicted ahead of need and withheld until their removal
    is durable; a reserve then takes such a page without waiting, and never a withheld one."""

    async def main() -> None:
        b = await open_backend(tmp_path, fsync="batch", fsync_interval=0.2)
        j = b.journal
        assert j is not None
        try:
            await b.initialize(S0, 64)  # evict-ahead keeps up to 2 * 64 // 16 = 8 pages spare
            for i in range(0, 64, 4):
                await cycle(b, S0, [f"k{i + n}" for n in range(4)])
            pool = b.store.pool(S0)
            check_pool(pool)
            assert pool.withheld_count + pool.allocatable_count >= 4
            rule = b.rule
            assert rule is not None
            withheld = {p for _, _, pages, held in rule._pending if held for p in pages}
            assert len(withheld) == pool.withheld_count
            assert withheld and j.durable_seq < j.seq  # removals not yet on disk
            seq_withheld = j.seq
            out = await b.reserve(S0, ["n0"])
            if {p for _, p in out} & withheld:  # handed out only once its removal is durable
                assert j.durable_seq >= seq_withheld
            await j.wait(j.seq)
            seq_before = j.seq
            out = await b.reserve(S0, ["n1", "n2"])
            assert not rule._marks  # released pages, no eviction on the spot
            assert all(page >= 0 for _, page in out)
            assert j.durable_seq < j.seq or j.seq == seq_before  # it did not wait for the disk
            check_pool(pool)
        finally:
            await b.close()
        b = await open_backend(tmp_path)
        try:
            check_pool(b.store.pool(S0))
        finally:
            await b.close()

    asyncio.run(main())
