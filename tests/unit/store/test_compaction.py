"""Size-driven snapshots: the journal since the newest snapshot stays within its budget."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from kvmeta.store.disk.compaction import RATIO_FLOOR, JournalBudget
from kvmeta.store.disk.local import LocalBackend
from kvmeta.store.disk.recovery import list_data_dir
from tests.unit.store.durable_support import S0, crash, cycle, open_backend, state

LIMIT = 64 * 1024  # --snapshot-journal-bytes in these tests


def _disk(directory: Path) -> tuple[int, int]:
    """(bytes of every file in the data directory, bytes of its largest snapshot)."""
    total = snap = 0
    for path in directory.iterdir():
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            continue  # compacted between the listing and the stat
        total += size
        if path.suffix in (".snap", ".tmp"):
            snap = max(snap, size)
    return total, snap


async def _confirm_stream(
    backend: LocalBackend, directory: Path, journal_bytes: int
) -> tuple[int, int, dict[str, int]]:
    """Reserve and confirm batches of new keys (a small pool, so they evict) until the journal
    has written ``journal_bytes``; returns the largest data directory and snapshot seen, and
    the keys stored at the end."""
    assert backend.journal is not None
    await backend.initialize(S0, 512)
    most = biggest = 0
    batch = 0
    while backend.journal.bytes_written < journal_bytes:
        batch += 1
        await cycle(backend, S0, [f"key-{batch}-{i:04d}-{'x' * 40}" for i in range(32)])
        total, snap = _disk(directory)
        most, biggest = max(most, total), max(biggest, snap)
    return most, biggest, dict(backend.store.pool(S0).stored_items())


def test_the_data_directory_stays_bounded_under_a_stream_of_confirms(tmp_path: Path) -> None:
    """With snapshots by time off, the journal written (20 budgets' worth) is compacted by
    size: the directory never holds more than two snapshots, the budget and some slack."""

    async def main() -> None:
        b = await open_backend(tmp_path, snapshot_journal_bytes=LIMIT, snapshot_journal_ratio=0.0)
        try:
            most, biggest, _ = await _confirm_stream(b, tmp_path, 20 * LIMIT)
            assert b.disk.snapshots >= 5, "no snapshot was taken for the journal's size"
            # Slack: the group being written and the files' headers, HEAD, EPOCH.
            assert most <= 2 * biggest + 2 * LIMIT, (most, biggest)
            segments = list_data_dir(tmp_path).segments
            assert len(segments) <= 2, segments  # older segments were removed
        finally:
            await b.close()

    asyncio.run(main())


def test_after_a_crash_every_confirmed_key_is_back(tmp_path: Path) -> None:
    async def main() -> None:
        b = await open_backend(tmp_path, snapshot_journal_bytes=LIMIT, snapshot_journal_ratio=0.0)
        _, _, stored = await _confirm_stream(b, tmp_path, 8 * LIMIT)
        before = state(b)
        assert b.disk.snapshots >= 2 and len(stored) > 400
        await crash(b)
        b = await open_backend(tmp_path, snapshot_journal_bytes=LIMIT)
        try:
            assert state(b) == before
            assert dict(b.store.pool(S0).stored_items()) == stored
        finally:
            await b.close()

    asyncio.run(main())


def test_a_start_that_replays_a_journal_over_budget_snapshots_at_once(tmp_path: Path) -> None:
    """A crash loop must not replay the same long journal at every start."""

    async def main() -> None:
        b = await open_backend(tmp_path, snapshot_journal_bytes=0, snapshot_journal_ratio=0.0)
        await _confirm_stream(b, tmp_path, 4 * LIMIT)
        assert b.disk.snapshots == 0
        before = state(b)
        await crash(b)
        b = await open_backend(tmp_path, snapshot_journal_bytes=LIMIT)
        try:
            deadline = time.monotonic() + 30
            while b.disk.snapshots == 0 and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            assert b.disk.snapshots == 1  # without a single new change
            listing = list_data_dir(tmp_path)
            assert all(s >= listing.snapshots[-1] for s in listing.segments)
            assert state(b) == before
        finally:
            await b.close()

    asyncio.run(main())


def test_no_size_driven_snapshot_when_both_limits_are_off(tmp_path: Path) -> None:
    async def main() -> None:
        b = await open_backend(tmp_path, snapshot_journal_bytes=0, snapshot_journal_ratio=0.0)
        try:
            await _confirm_stream(b, tmp_path, 4 * LIMIT)
            assert b.disk.snapshots == 0
        finally:
            await b.close()

    asyncio.run(main())


def test_the_budget_is_the_sooner_of_its_two_terms_each_above_its_floor() -> None:
    mib = 1 << 20
    # A tiny state: the ratio's floor, unless the bytes are lower.
    assert JournalBudget(2.0, 64 * mib, snapshot_bytes=1000).limit() == RATIO_FLOOR
    assert JournalBudget(2.0, LIMIT, snapshot_bytes=1000).limit() == LIMIT
    # A mid-sized state: the ratio.
    assert JournalBudget(2.0, 64 * mib, snapshot_bytes=20 * mib).limit() == 40 * mib
    # A state bigger than the bytes: never less journal than its own snapshot.
    assert JournalBudget(2.0, 64 * mib, snapshot_bytes=700 * mib).limit() == 700 * mib
    # Either term off.
    assert JournalBudget(0.0, 64 * mib, snapshot_bytes=1000).limit() == 64 * mib
    assert JournalBudget(1.0, 0, snapshot_bytes=20 * mib).limit() == 20 * mib
    assert JournalBudget(0.0, 0, snapshot_bytes=20 * mib).limit() == 0


def test_the_budget_counts_the_replayed_journal_and_starts_early_by_the_last_write() -> None:
    budget = JournalBudget(0.0, 1000, backlog=600)
    assert not budget.due(399) and budget.due(400)
    assert budget.grow_at() == 400
    budget.snapshotted(snapshot_bytes=10, mark=500, written=700)  # 200 written meanwhile
    assert budget.since(700) == 200
    assert budget.threshold() == 800 and budget.grow_at() == 1300
    assert not budget.due(1299) and budget.due(1300)
