"""``Backend.epoch``: it changes exactly when the backend's state may have been lost or replaced.

Memory: every process start (every backend object). Data directory: created once with the
directory and kept in its ``EPOCH`` file across restarts and crashes; a directory without state
gets a new one; a directory from before the epoch existed gets one on its first start."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from kvmeta.store.disk.local import DurabilityOptions, LocalBackend
from kvmeta.store.disk.memory import MemoryStore
from kvmeta.store.disk.recovery import list_data_dir
from tests.unit.store.durable_support import S0, crash, cycle, open_backend, state


def _epoch_file(directory: Path) -> Path:
    return directory / "EPOCH"


def test_memory_backend_gets_a_new_epoch_each_start() -> None:
    a, b = LocalBackend(MemoryStore()), LocalBackend(MemoryStore())
    assert a.epoch and b.epoch and a.epoch != b.epoch
    assert a.epoch == a.epoch  # stable within one process


def test_data_dir_keeps_its_epoch_across_close_and_crash(tmp_path: Path) -> None:
    async def main() -> None:
        b = await open_backend(tmp_path)
        first = b.epoch
        assert _epoch_file(tmp_path).read_text().strip() == first
        await b.initialize(S0, 4)
        await cycle(b, S0, ["a"])
        await b.close()
        b = await open_backend(tmp_path)
        assert b.epoch == first
        await cycle(b, S0, ["b"])
        await crash(b)
        b = await open_backend(tmp_path)
        try:
            assert b.epoch == first
        finally:
            await b.close()

    asyncio.run(main())


def test_new_data_dir_gets_a_new_epoch(tmp_path: Path) -> None:
    async def main() -> None:
        one = await open_backend(tmp_path / "one")
        two = await open_backend(tmp_path / "two")
        try:
            assert one.epoch != two.epoch
        finally:
            await one.close()
            await two.close()

    asyncio.run(main())


def test_data_dir_from_before_the_epoch_gets_one_and_keeps_its_state(tmp_path: Path) -> None:
    async def main() -> None:
        b = await open_backend(tmp_path)
        await b.initialize(S0, 4)
        await cycle(b, S0, ["a", "b"])
        before = state(b)
        await crash(b)
        _epoch_file(tmp_path).unlink()  # as a data directory written before epochs existed
        b = await open_backend(tmp_path)
        assigned = b.epoch
        assert state(b) == before
        assert _epoch_file(tmp_path).read_text().strip() == assigned
        await b.close()
        b = await open_backend(tmp_path)
        try:
            assert b.epoch == assigned
        finally:
            await b.close()

    asyncio.run(main())


def test_epoch_file_without_state_is_replaced(tmp_path: Path) -> None:
    """Journal and snapshots deleted, EPOCH left behind: the state is gone, so is the epoch."""

    async def main() -> None:
        b = await open_backend(tmp_path)
        old = b.epoch
        await b.initialize(S0, 4)
        await b.close()
        listing = list_data_dir(tmp_path)
        for n in listing.snapshots:
            (tmp_path / f"snapshot-{n:012d}.snap").unlink()
        for n in listing.segments:
            (tmp_path / f"journal-{n:012d}.log").unlink()
        b = await open_backend(tmp_path)
        try:
            assert b.epoch != old
            assert _epoch_file(tmp_path).read_text().strip() == b.epoch
        finally:
            await b.close()

    asyncio.run(main())


def test_unreadable_epoch_file_is_replaced_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async def main() -> None:
        b = await open_backend(tmp_path)
        old = b.epoch
        await b.initialize(S0, 4)
        await b.close()
        _epoch_file(tmp_path).write_bytes(b"\x00\xffnot an id\n")
        with caplog.at_level("WARNING"):
            b = await open_backend(tmp_path)
        try:
            assert b.epoch != old and b.epoch.isalnum()
            assert "EPOCH" in caplog.text
        finally:
            await b.close()

    asyncio.run(main())


def test_leftover_temporary_is_ignored(tmp_path: Path) -> None:
    async def main() -> None:
        b = await open_backend(tmp_path)
        old = b.epoch
        await b.initialize(S0, 4)
        await b.close()
        (tmp_path / "EPOCH.tmp").write_text("half-written")  # a crash mid-replace
        b = await open_backend(tmp_path)
        try:
            assert b.epoch == old
            assert not (tmp_path / "EPOCH.tmp").exists()
        finally:
            await b.close()

    asyncio.run(main())


def test_legacy_import_into_a_new_data_dir_gets_a_new_epoch(tmp_path: Path) -> None:
    legacy = tmp_path / "state.json"
    legacy.write_text(json.dumps({"0": {"num_pages": 4, "key_to_index": [["z", 0]]}}))

    async def main() -> None:
        b = await open_backend(tmp_path / "data", persistence_path=legacy)
        first = b.epoch
        await b.close()
        b = await open_backend(tmp_path / "data", persistence_path=legacy)
        try:
            assert b.epoch == first  # the data directory, not the file, holds the state now
        finally:
            await b.close()

    asyncio.run(main())


def test_legacy_file_without_data_dir_is_a_new_epoch_each_start(tmp_path: Path) -> None:
    """The SGLang file is rewritten only every --save-interval: a restart may lose pools."""
    legacy = tmp_path / "state.json"

    async def main() -> None:
        epochs = []
        for _ in range(2):
            b = LocalBackend(
                MemoryStore(), DurabilityOptions(data_dir=None, persistence_path=legacy)
            )
            await b.start()
            epochs.append(b.epoch)
            await b.close()
        assert epochs[0] != epochs[1]

    asyncio.run(main())
