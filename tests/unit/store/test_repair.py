"""``kvmeta check --repair`` on the damage it is for: pools (with their tenant, size and vLLM
world sizes) are kept from whatever still reads, every key is dropped, and the directory then
checks clean and starts."""

from __future__ import annotations

import asyncio
import struct
from pathlib import Path

import pytest

from kvmeta._types import PoolId
from kvmeta.errors import StorageError
from kvmeta.store.disk.check import check_data_dir
from kvmeta.store.disk.codec import HEADER, Commit, NewPool, encode_record
from kvmeta.store.disk.journal import segment_path
from kvmeta.store.disk.recovery import list_data_dir, recover
from kvmeta.store.disk.repair import repair_data_dir
from kvmeta.store.disk.snapshot import snapshot_path
from kvmeta.store.epoch import EPOCH_FILE
from tests.unit.store.durable_support import S0, crash, cycle, open_backend

T0 = PoolId("s", 0, "kv", "team-a")
V1 = PoolId("v", 1, "")
LATER = PoolId("s", 2, "later")


async def _populate(directory: Path, *, snapshot: bool) -> None:
    b = await open_backend(directory)
    try:
        await b.initialize(S0, 64)
        await b.initialize(T0, 16)
        await b.v_register(1, 8, 2)
        await b.v_register(0, 4, 1, "team-a")
        await cycle(b, S0, ["a", "b", "c"])
        await cycle(b, T0, ["a"])
        if snapshot:
            await b.snapshot()
        await b.initialize(LATER, 4)
        await cycle(b, LATER, ["x", "y"])
        await cycle(b, S0, ["d"])
    finally:
        await crash(b)


def _pools(directory: Path) -> dict[PoolId, tuple[int, dict[str, int]]]:
    return recover(directory, repair=False).pools


def test_a_snapshot_whose_checksum_fails_gives_its_pools_and_the_journal_the_later_ones(
    tmp_path: Path,
) -> None:
    asyncio.run(_populate(tmp_path, snapshot=True))
    listing = list_data_dir(tmp_path)
    snap = snapshot_path(tmp_path, listing.snapshots[-1])
    raw = bytearray(snap.read_bytes())
    raw[-3] ^= 0xFF  # in the last pool's pages, far from the meta
    snap.write_bytes(bytes(raw))
    assert not check_data_dir(tmp_path).ok
    epoch = (tmp_path / EPOCH_FILE).read_text()

    lines = repair_data_dir(tmp_path).lines
    assert any("checksum mismatch; its pools were read from its intact meta" in x for x in lines)
    state = recover(tmp_path, repair=False)
    assert state.pools == {
        S0: (64, {}),
        T0: (16, {}),
        V1: (8, {}),
        PoolId("v", 0, "", "team-a"): (4, {}),
        LATER: (4, {}),
    }
    assert state.vworld == 2 and state.tworld == {"team-a": 1}
    assert check_data_dir(tmp_path).ok
    assert (tmp_path / EPOCH_FILE).read_text() != epoch  # every key is gone: a new state
    (retired,) = [p for p in tmp_path.iterdir() if p.name.startswith("retired-")]
    assert (retired / snap.name).read_bytes() == bytes(raw)
    assert list_data_dir(tmp_path).segments == []

    async def serve_again() -> None:
        b = await open_backend(tmp_path)
        try:
            assert await b.get(S0, ["a", "d"]) == [None, None]
            assert await cycle(b, LATER, ["z"]) == [0]
        finally:
            await b.close()

    asyncio.run(serve_again())


def test_a_pool_whose_creation_record_is_damaged_is_named(tmp_path: Path) -> None:
    frames = [
        encode_record(NewPool(S0, 8)),
        encode_record(NewPool(LATER, 4)),
        encode_record(Commit(LATER, [("x", 1)])),
        encode_record(Commit(S0, [("a", 2)])),
    ]
    data = bytearray(HEADER + b"".join(frames))
    at = len(HEADER) + len(frames[0])
    struct.pack_into("<I", data, at + 4, 12345)  # the second record's checksum
    segment_path(tmp_path, 1).write_bytes(bytes(data))

    lines = repair_data_dir(tmp_path).lines
    assert any("stepped over 1 damaged stretch" in x for x in lines)
    assert any(x.startswith(f"{LATER}: its keys are in the journal") for x in lines)
    assert _pools(tmp_path) == {S0: (8, {})}


def test_a_second_repair_keeps_the_same_pools(tmp_path: Path) -> None:
    asyncio.run(_populate(tmp_path, snapshot=False))
    repair_data_dir(tmp_path)
    first = _pools(tmp_path)
    repair_data_dir(tmp_path)
    assert _pools(tmp_path) == first and len(first) == 5
    assert len([p for p in tmp_path.iterdir() if p.name.startswith("retired-")]) == 2


def test_an_empty_directory_has_nothing_to_repair(tmp_path: Path) -> None:
    assert "nothing to repair" in repair_data_dir(tmp_path).lines[0]
    assert list_data_dir(tmp_path).empty


def test_a_newer_kvmetas_directory_is_left_alone(tmp_path: Path) -> None:
    segment_path(tmp_path, 1).write_bytes(b"KVMJ" + bytes([99, 0, 0, 0]))
    with pytest.raises(StorageError, match="written by a newer kvmeta"):
        repair_data_dir(tmp_path)
    assert list_data_dir(tmp_path).segments == [1]
