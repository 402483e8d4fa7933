"""Damage in the middle of a journal is corruption, never a torn tail: start-up refuses with
the file and the byte, leaves the file alone, and ``kvmeta check`` reports it."""

from __future__ import annotations

import asyncio
import struct
from pathlib import Path

import pytest

from kvmeta._types import PoolId
from kvmeta.errors import JournalCorrupt
from kvmeta.store.disk.check import check_data_dir
from kvmeta.store.disk.codec import HEADER, Commit, FrameError, decode_frames, encode_record
from kvmeta.store.disk.journal import segment_path
from kvmeta.store.disk.recovery import list_data_dir, recover
from tests.unit.store.durable_support import S0, crash, cycle, open_backend

PID = PoolId("s", 0, "kv")


def _records(n: int) -> list[bytes]:
    return [encode_record(Commit(PID, [(f"key-{i}", i)])) for i in range(n)]


def _middle_offset(frames: list[bytes], index: int) -> int:
    return len(HEADER) + sum(len(f) for f in frames[:index])


@pytest.mark.parametrize("length", [0xFFFFFF, 10_000, 3])
def test_a_damaged_length_in_a_middle_record_is_corruption(length: int) -> None:
    frames = _records(10)
    data = bytearray(HEADER + b"".join(frames))
    at = _middle_offset(frames, 4)
    struct.pack_into("<I", data, at, length)
    with pytest.raises(FrameError) as info:
        decode_frames(bytes(data))
    assert info.value.offset == at


def test_a_bad_checksum_in_a_middle_record_is_corruption() -> None:
    frames = _records(10)
    data = bytearray(HEADER + b"".join(frames))
    at = _middle_offset(frames, 4)
    data[at + 9] ^= 0xFF  # a payload byte
    with pytest.raises(FrameError) as info:
        decode_frames(bytes(data))
    assert info.value.offset == at


def test_a_torn_tail_is_still_cut() -> None:
    frames = _records(10)
    data = HEADER + b"".join(frames)
    torn = data[: len(data) - 5]
    out = decode_frames(torn)
    assert out.torn_at == _middle_offset(frames, 9) and len(out.records) == 9


def test_damage_in_a_segment_that_is_not_the_last_is_corruption() -> None:
    frames = _records(3)
    data = HEADER + b"".join(frames)
    with pytest.raises(FrameError):
        decode_frames(data[:-5], last=False)


def test_start_up_refuses_keeps_the_file_and_check_exits_1(tmp_path: Path) -> None:
    async def main() -> None:
        b = await open_backend(tmp_path, fsync="always")
        try:
            await b.initialize(S0, 64)
            for i in range(10):
                await cycle(b, S0, [f"k{i}"])
        finally:
            await crash(b)
        segment = list_data_dir(tmp_path).segments[-1]
        path = segment_path(tmp_path, segment)
        data = bytearray(path.read_bytes())
        frames = decode_frames(bytes(data)).records
        assert len(frames) == 12  # the pool, its frontier, ten commits
        # The fourth record's length field: header, pool, frontier, one commit before it.
        at = len(HEADER)
        for _ in range(3):
            (length,) = struct.unpack_from("<I", data, at)
            at += 8 + length
        struct.pack_into("<I", data, at, 1 << 20)
        path.write_bytes(bytes(data))
        with pytest.raises(JournalCorrupt) as info:
            await open_backend(tmp_path, fsync="always")
        message = str(info.value)
        assert path.name in message and f"byte {at}" in message
        assert path.read_bytes() == bytes(data)  # untouched
        report = check_data_dir(tmp_path)
        assert not report.ok and f"byte {at}" in report.problems[0]
        assert "for details" not in report.problems[0]  # no advice to run what is running
        assert f"kvmeta check --repair --data-dir {tmp_path}" in report.problems[0]
        assert "backup" not in message and "--repair" in message

    asyncio.run(main())


def test_recover_never_truncates_middle_damage(tmp_path: Path) -> None:
    async def main() -> None:
        b = await open_backend(tmp_path, fsync="always")
        try:
            await b.initialize(S0, 64)
            for i in range(5):
                await cycle(b, S0, [f"k{i}"])
        finally:
            await crash(b)

    asyncio.run(main())
    path = segment_path(tmp_path, list_data_dir(tmp_path).segments[-1])
    data = bytearray(path.read_bytes())
    struct.pack_into("<I", data, len(HEADER), 1 << 24)  # the first record's length
    path.write_bytes(bytes(data))
    with pytest.raises(JournalCorrupt):
        recover(tmp_path)
    assert path.read_bytes() == bytes(data)
