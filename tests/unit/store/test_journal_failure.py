"""Journal write/fsync failures: every waiter gets an answer, the backend refuses mutations
(503) without changing state, reads keep working, and it recovers on its own."""

from __future__ import annotations

import asyncio
import errno
import os
from pathlib import Path

import pytest

from kvmeta._types import PoolId
from kvmeta.errors import JournalFailed, StorageError
from kvmeta.store.disk import journal as journal_module
from kvmeta.store.disk.codec import Clear
from kvmeta.store.disk.journal import Journal
from kvmeta.store.disk.recovery import recover
from tests.unit.store.durable_support import S0, crash, cycle, open_backend, state


def _break_writes(journal: Journal, monkeypatch: pytest.MonkeyPatch, code: int) -> list[bool]:
    """Make the journal's file writes fail with ``code`` while the returned flag is set."""
    broken = [True]
    real = journal._write

    def write(data: bytearray) -> None:
        if broken[0]:
            raise OSError(code, "No space left on device")
        real(data)

    monkeypatch.setattr(journal, "_write", write)
    return broken


@pytest.mark.parametrize("mode", ["always", "batch"])
def test_a_wait_whose_flush_fails_is_answered(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    async def main() -> None:
        b = await open_backend(tmp_path, fsync=mode)
        try:
            await b.initialize(S0, 8)
            assert b.journal is not None
            _break_writes(b.journal, monkeypatch, errno.ENOSPC)
            journal = b.journal

            async def append_and_wait() -> None:
                # As a confirm does: append, then wait in the same loop step, so the flush
                # inside ``wait`` is the one that fails.
                journal.append(Clear(S0))
                await journal.wait(journal.seq)

            with pytest.raises(StorageError, match="No space left"):
                await asyncio.wait_for(append_and_wait(), timeout=5)
        finally:
            await crash(b)

    asyncio.run(main())


async def _until(predicate: object, timeout: float = 20.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():  # type: ignore[operator]
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


@pytest.mark.parametrize("mode", ["always", "batch", "never"])
def test_failed_journal_refuses_changes_keeps_reads_and_recovers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    async def main() -> None:
        b = await open_backend(tmp_path, fsync=mode)
        try:
            await b.initialize(S0, 8)
            await cycle(b, S0, ["a", "b"])
            assert b.journal is not None
            broken = _break_writes(b.journal, monkeypatch, errno.ENOSPC)
            # The write of this confirm's group fails (always: it answers 503; batch/never:
            # it was acknowledged at once).
            out = await b.reserve(S0, ["c"])
            try:
                await b.confirm(S0, [("c", out[0][1])], [])
            except JournalFailed:
                assert mode == "always"
            else:
                assert mode != "always"
            await _until(lambda: b.failure is not None)
            assert not await b.ready()
            assert str(tmp_path) in str(b.failure) and "No space left" in str(b.failure)
            before = state(b)
            for change in (
                b.initialize(PoolId("s", 1, "kv"), 8),
                b.reserve(S0, ["d"]),
                b.confirm(S0, [("d", 3)], []),
                b.delete(S0, ["a"]),
                b.clear(S0),
                b.v_register(0, 8, 2),
                b.v_clear(),
            ):
                with pytest.raises(JournalFailed) as info:
                    await change
                assert info.value.status == 503 and str(tmp_path) in str(info.value)
            assert state(b) == before  # refused before touching anything
            assert b.store.pools.keys() == {S0}
            assert await b.exists(S0, ["a", "b", "c", "d"]) == [True, True, True, False]
            assert (await b.stats())[0].stored == 3
            assert b.durability_stats()["journal_failed"] == 1.0
            broken[0] = False  # space is back
            await _until(lambda: b.failure is None)
            assert await b.ready()
            await cycle(b, S0, ["e"])
            assert b.durability_stats()["journal_failed"] == 0.0
            after = state(b)
        finally:
            await crash(b)
        b = await open_backend(tmp_path, fsync=mode)
        try:
            assert state(b) == after  # nothing acknowledged was lost, c included
            assert [k for k, _ in after[S0][1]] == ["a", "b", "c", "e"]
        finally:
            await b.close()

    asyncio.run(main())


def test_dying_while_failed_loses_only_the_undurable_tail(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A partial group write (the disk filled mid-write) leaves a torn tail in the last
    segment; a crash before recovery restarts from the last durable record."""

    async def main() -> None:
        b = await open_backend(tmp_path, fsync="always")
        try:
            await b.initialize(S0, 8)
            await cycle(b, S0, ["a", "b"])
            assert b.journal is not None
            journal = b.journal
            real_write = os.write

            def half_write(fd: int, data: bytes) -> int:
                if fd == journal._fd:
                    real_write(fd, bytes(data)[: len(data) // 2])
                    raise OSError(errno.ENOSPC, "No space left on device")
                return real_write(fd, data)

            monkeypatch.setattr(journal_module.os, "write", half_write)
            with pytest.raises(JournalFailed):
                await cycle(b, S0, ["c"])
            monkeypatch.setattr(journal_module.os, "write", real_write)
            monkeypatch.setattr(b, "snapshot", _never_snapshot)  # it dies before recovering
        finally:
            await crash(b)
        state_now = recover(tmp_path, repair=False)
        assert state_now.torn_bytes > 0
        b = await open_backend(tmp_path, fsync="always")
        try:
            assert [k for k, _ in state(b)[S0][1]] == ["a", "b"]
        finally:
            await b.close()

    asyncio.run(main())


async def _never_snapshot() -> None:
    raise OSError(errno.ENOSPC, "still full")


def test_shutdown_while_failed_says_what_is_lost(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    async def main() -> None:
        b = await open_backend(tmp_path, fsync="batch")
        await b.initialize(S0, 8)
        assert b.journal is not None
        await b.reserve(S0, ["a"])  # the frontier moves while the disk still takes it
        _break_writes(b.journal, monkeypatch, errno.ENOSPC)
        await cycle(b, S0, ["a"])  # acknowledged in batch mode, then its write fails
        await _until(lambda: b.failure is not None)
        monkeypatch.setattr(b.disk, "_write_and_compact", _full_disk)
        await b.close()

    asyncio.run(main())
    text = caplog.text
    assert "journal still has every change" not in text
    assert "are lost now" in text and "confirms acknowledged in that window" in text


def _full_disk(*args: object) -> None:
    raise OSError(errno.ENOSPC, "No space left on device")


def test_shutdown_after_the_cause_is_gone_keeps_everything(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def main() -> None:
        b = await open_backend(tmp_path, fsync="batch", snapshot_interval=0.0)
        await b.initialize(S0, 8)
        assert b.journal is not None
        await b.reserve(S0, ["a", "b"])  # the frontier moves while the disk still takes it
        broken = _break_writes(b.journal, monkeypatch, errno.ENOSPC)
        await cycle(b, S0, ["a", "b"])
        await _until(lambda: b.failure is not None)
        broken[0] = False
        await b.close()  # the final snapshot is the recovery
        b = await open_backend(tmp_path, fsync="batch")
        try:
            assert [k for k, _ in state(b)[S0][1]] == ["a", "b"]
        finally:
            await b.close()

    asyncio.run(main())


def test_the_gc_runs_while_a_snapshot_is_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """gc.disable is process-wide: it may cover the synchronous capture, never the await."""
    import gc

    from kvmeta.store.disk.datadir import DataDir

    seen: list[bool] = []
    real = DataDir._write_and_compact

    def write(*args: object) -> Path:
        seen.append(gc.isenabled())
        return real(*args)  # type: ignore[arg-type]

    async def main() -> None:
        b = await open_backend(tmp_path, fsync="batch")
        try:
            monkeypatch.setattr(b.disk, "_write_and_compact", write)
            await b.initialize(S0, 8)
            await b.snapshot()
        finally:
            await b.close()

    assert gc.isenabled()
    asyncio.run(main())
    assert seen and all(seen)
