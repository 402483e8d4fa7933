"""A data directory's history: each journal segment names the one before it and HEAD names the
last one created, so a segment that went missing is refused; directories written before the
chain existed are read as before."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import pytest

from kvmeta.errors import JournalCorrupt, JournalFailed
from kvmeta.store.disk.check import check_data_dir
from kvmeta.store.disk.codec import HEADER, Commit, NewPool, encode_record, predecessor
from kvmeta.store.disk.history import HEAD_FILE, read_head
from kvmeta.store.disk.journal import segment_path
from kvmeta.store.disk.recovery import list_data_dir, recover
from kvmeta.store.disk.repair import repair_data_dir
from tests.unit.store.durable_support import S0, crash, cycle, open_backend


async def _runs(directory: Path, runs: int, *, snapshot_first: bool = False) -> None:
    """``runs`` starts, each storing a key and ending like a killed process. After each
    restart the pages below the pool's frontier are held, so each run's key goes one frontier
    step (1,024 pages) further: k0 at page 0, k1 at 1025, k2 at 2050."""
    for run in range(runs):
        b = await open_backend(directory)
        try:
            await b.initialize(S0, 4096)
            if snapshot_first and run == 0:
                await b.snapshot()
            await cycle(b, S0, [f"k{run}"])
        finally:
            await crash(b)


STORED = {"k0": 0, "k1": 1025, "k2": 2050}


def _head(directory: Path) -> int | None:
    head = read_head(directory)
    return None if head is None else head.segment


def _header(directory: Path, segment: int) -> bytes:
    return segment_path(directory, segment).read_bytes()[: len(HEADER)]


def test_each_segment_names_the_one_before_and_head_the_last(tmp_path: Path) -> None:
    asyncio.run(_runs(tmp_path, 3))
    assert list_data_dir(tmp_path).segments == [1, 2, 3]
    assert [predecessor(_header(tmp_path, n), n) for n in (1, 2, 3)] == [0, 1, 2]
    assert _head(tmp_path) == 3
    assert recover(tmp_path).pools[S0][1] == STORED


def test_a_missing_middle_segment_is_refused(tmp_path: Path) -> None:
    asyncio.run(_runs(tmp_path, 3))
    segment_path(tmp_path, 2).unlink()
    with pytest.raises(JournalCorrupt, match="journal-000000000003.log follows it"):
        recover(tmp_path)
    (problem,) = check_data_dir(tmp_path).problems
    assert problem.startswith(f"{segment_path(tmp_path, 2)}: this journal segment is missing")
    assert "kvmeta check --repair" in problem


def test_a_missing_last_segment_is_refused_by_head(tmp_path: Path) -> None:
    asyncio.run(_runs(tmp_path, 3))
    segment_path(tmp_path, 3).unlink()
    with pytest.raises(JournalCorrupt, match="its HEAD file says so"):
        recover(tmp_path)


def test_a_missing_first_segment_after_the_snapshot_is_refused(tmp_path: Path) -> None:
    asyncio.run(_runs(tmp_path, 3, snapshot_first=True))
    listing = list_data_dir(tmp_path)
    assert listing.snapshots == [2] and listing.segments == [2, 3, 4]
    assert predecessor(_header(tmp_path, 2), 2) == 1  # covered by snapshot 2
    assert recover(tmp_path).pools[S0][1] == STORED
    segment_path(tmp_path, 2).unlink()
    with pytest.raises(JournalCorrupt, match=r"the snapshot \(2\) is older"):
        recover(tmp_path)


def test_every_segment_after_the_snapshot_missing_is_refused(tmp_path: Path) -> None:
    asyncio.run(_runs(tmp_path, 2, snapshot_first=True))
    for segment in list_data_dir(tmp_path).segments:
        segment_path(tmp_path, segment).unlink()
    with pytest.raises(JournalCorrupt, match="journal-000000000003.log: this journal segment"):
        recover(tmp_path)


def test_a_directory_emptied_on_purpose_starts_empty(tmp_path: Path) -> None:
    asyncio.run(_runs(tmp_path, 2))
    for segment in list_data_dir(tmp_path).segments:
        segment_path(tmp_path, segment).unlink()
    assert recover(tmp_path).pools == {}


def _old_segment(directory: Path, segment: int, records: list[bytes]) -> None:
    """A segment as an older kvmeta wrote it: zeros where the chain is."""
    segment_path(directory, segment).write_bytes(HEADER + b"".join(records))


def test_segments_of_an_older_kvmeta_are_read_as_before(tmp_path: Path) -> None:
    _old_segment(tmp_path, 1, [encode_record(NewPool(S0, 8))])
    _old_segment(tmp_path, 3, [encode_record(Commit(S0, [("a", 1)]))])  # 2 had no record
    assert recover(tmp_path).pools == {S0: (8, {"a": 1})}
    assert read_head(tmp_path) is None

    async def serve_on() -> None:  # the next segment names the last old one
        b = await open_backend(tmp_path)
        try:
            await cycle(b, S0, ["b"])
        finally:
            await crash(b)

    asyncio.run(serve_on())
    assert predecessor(_header(tmp_path, 4), 4) == 3 and _head(tmp_path) == 4
    # No frontier recorded by the older kvmeta: every free page is held after the start, so
    # "b" took the page of "a" (evicted; read leases are off here).
    assert recover(tmp_path).pools[S0][1] == {"b": 1}
    segment_path(tmp_path, 3).unlink()
    with pytest.raises(JournalCorrupt, match="journal-000000000004.log follows it"):
        recover(tmp_path)


def test_a_segment_created_just_before_a_crash_is_no_gap(tmp_path: Path) -> None:
    """A crash after a new segment's header reached the disk but before HEAD was rewritten."""
    asyncio.run(_runs(tmp_path, 1))
    segment_path(tmp_path, 2).write_bytes(_header(tmp_path, 1)[:5] + bytes([1, 0, 0]))
    assert _head(tmp_path) == 1
    assert recover(tmp_path).pools[S0][1] == {"k0": 0}


def test_a_head_file_that_says_something_else_is_refused(tmp_path: Path) -> None:
    asyncio.run(_runs(tmp_path, 1))
    (tmp_path / HEAD_FILE).write_text("hello\n")
    with pytest.raises(JournalCorrupt, match="HEAD: not a HEAD file"):
        recover(tmp_path)
    repair_data_dir(tmp_path)
    assert recover(tmp_path).pools == {S0: (4096, {})}


def test_head_that_cannot_be_written_fails_the_journal(tmp_path: Path) -> None:
    """No record of a segment HEAD does not name is acknowledged: the journal fails instead,
    and recovers by a snapshot once HEAD can be written."""

    async def main() -> None:
        b = await open_backend(tmp_path)
        try:
            await b.initialize(S0, 8)
            await b.reserve(S0, ["a"])  # (its frontier record goes to the first segment)
            await b.snapshot()  # the next record opens a new segment
            (tmp_path / (HEAD_FILE + ".tmp")).mkdir()  # HEAD cannot be rewritten
            with pytest.raises(JournalFailed, match="HEAD.tmp"):
                await cycle(b, S0, ["a"])
            (tmp_path / (HEAD_FILE + ".tmp")).rmdir()
            await b.snapshot()
            assert b.failure is None
            await cycle(b, S0, ["b"])
        finally:
            await crash(b)
        assert recover(tmp_path).pools[S0][1] == {"a": 0, "b": 1}

    asyncio.run(main())


def test_a_copy_of_the_directory_is_refused_and_a_renamed_one_is_not(tmp_path: Path) -> None:
    data = tmp_path / "data"
    asyncio.run(_runs(data, 2))
    copy = tmp_path / "copy"
    shutil.copytree(data, copy)
    with pytest.raises(JournalCorrupt, match="inode numbers of the directory, HEAD, journal-"):
        recover(copy)
    report = check_data_dir(copy)  # says it is a copy, and still checks what it holds
    (problem,) = report.problems
    assert "this is not the directory its HEAD file was written in" in problem
    assert "kvmeta check --repair" in problem and "for details" not in problem
    assert any("1 pool" in line and "2 stored keys" in line for line in report.lines)
    moved = tmp_path / "moved"
    data.rename(moved)  # same file system: the same inodes, the same directory
    assert recover(moved).pools[S0][1] == {"k0": 0, "k1": 1025}
    repair_data_dir(copy)
    assert recover(copy).pools == {S0: (4096, {})}


def test_start_up_pins_a_directory_an_older_kvmeta_wrote(tmp_path: Path) -> None:
    _old_segment(tmp_path, 1, [encode_record(NewPool(S0, 8))])

    async def start_and_stop() -> None:
        b = await open_backend(tmp_path)
        await crash(b)

    asyncio.run(start_and_stop())
    head = read_head(tmp_path)
    assert head is not None and head.segment == 1 and set(head.inodes) == {"dir", "head", "segment"}
    copy = tmp_path.parent / (tmp_path.name + "-copy")
    shutil.copytree(tmp_path, copy)
    with pytest.raises(JournalCorrupt, match="not the directory its HEAD file was written in"):
        recover(copy)
