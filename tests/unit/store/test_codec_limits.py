"""The writer never produces a frame the reader refuses: records at and over MAX_PAYLOAD."""

from __future__ import annotations

import asyncio
from pathlib import Path

import msgspec
import pytest

from kvmeta._types import PoolId
from kvmeta.store.disk import codec
from kvmeta.store.disk.codec import (
    HEADER,
    Commit,
    NewPool,
    Record,
    RecordTooLarge,
    Remove,
    RemovePages,
    decode_frames,
    encode_records,
    page_numbers,
)
from tests.unit.store.durable_support import S0, crash, cycle, open_backend, state

LIMIT = 4096
PID = PoolId("s", 0, "kv")


@pytest.fixture
def small_limit(monkeypatch: pytest.MonkeyPatch) -> int:
    monkeypatch.setattr(codec, "MAX_PAYLOAD", LIMIT)
    return LIMIT


def _payload_len(record: Record) -> int:
    return len(msgspec.msgpack.encode(record))


def test_a_record_exactly_at_the_limit_is_one_frame_and_reads_back(small_limit: int) -> None:
    key = "k" * 300  # already past the 255-byte string header size step
    record = Commit(PID, [(key, 0)])
    for _ in range(5):  # grow the one key until the payload is exactly the limit
        key += "k" * (small_limit - _payload_len(record))
        record = Commit(PID, [(key, 0)])
    assert _payload_len(record) == small_limit
    frames = encode_records(record)
    assert len(frames) == 1
    out = decode_frames(HEADER + frames[0])
    assert out.torn_at is None and out.records == [record]


@pytest.mark.parametrize("kind", [Commit, Remove])
def test_a_record_over_the_limit_is_split_in_order(
    small_limit: int, kind: type[Commit] | type[Remove]
) -> None:
    # ~55 KB of keys; a removal writes only its pages (4 bytes each), so it needs more of them
    count = 1000 if kind is Commit else small_limit  # 4 bytes a page: 4 x the limit
    entries = [(f"key-{i:05d}-" + "x" * 40, i) for i in range(count)]
    frames = encode_records(kind(PID, entries))
    assert len(frames) > 1
    out = decode_frames(HEADER + b"".join(frames))
    assert out.torn_at is None
    assert all(r.pool == PID for r in out.records)  # type: ignore[union-attr]
    if kind is Commit:
        assert all(type(r) is Commit for r in out.records)
        assert [e for r in out.records for e in r.entries] == entries  # type: ignore[union-attr]
    else:  # written by page (format 4)
        assert all(type(r) is RemovePages for r in out.records)
        pages = [p for r in out.records for p in page_numbers(r)]  # type: ignore[arg-type]
        assert pages == [page for _, page in entries]
    assert all(len(f) - 8 <= small_limit for f in frames)


def test_an_unsplittable_record_over_the_limit_is_refused(small_limit: int) -> None:
    with pytest.raises(RecordTooLarge, match="--max-key-length"):
        encode_records(Commit(PID, [("k" * small_limit, 0)]))
    with pytest.raises(RecordTooLarge):
        encode_records(NewPool(PoolId("s", 0, "n" * small_limit), 8))


def test_a_huge_confirm_and_eviction_round_trip_through_recovery(
    tmp_path: Path, small_limit: int
) -> None:
    """One confirm far over the limit, then a reserve that evicts all of it: the data dir
    starts again (before: "impossible frame length") with the same state."""

    async def main() -> None:
        b = await open_backend(tmp_path, fsync="batch")
        try:
            await b.initialize(S0, 400)
            first = [f"first-{i:04d}-" + "y" * 60 for i in range(400)]
            await cycle(b, S0, first)  # a 30 KB commit
            await cycle(b, S0, [f"second-{i:04d}" for i in range(400)])  # evicts 400 at once
            before = state(b)
        finally:
            await crash(b)
        b = await open_backend(tmp_path, fsync="batch")
        try:
            assert state(b) == before
        finally:
            await b.close()

    asyncio.run(main())
