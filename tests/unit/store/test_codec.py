"""Record framing: round trip, torn tails are cut, other damage is refused; segments written
before the typed records (format 2) still decode and recover."""

from __future__ import annotations

import struct
import zlib
from pathlib import Path

import msgspec
import pytest

from kvmeta._types import PoolId
from kvmeta.store.disk.codec import (
    HEADER,
    Clear,
    Commit,
    Drop,
    FrameError,
    NewPool,
    Record,
    Remove,
    RemovePages,
    WorldSize,
    decode_frames,
    encode_record,
)
from kvmeta.store.disk.recovery import recover

S0 = PoolId("s", 0, "kv")
V1 = PoolId("v", 1, "")
RECORDS: list[Record] = [
    NewPool(S0, 8),
    Commit(S0, [("a", 0), ("b", 1)]),
    Remove(S0, [("a", 0)]),
    Clear(V1),
    WorldSize(2),
    WorldSize(None),
    Drop(V1),
]


def segment(records: list[Record] = RECORDS) -> bytes:
    return HEADER + b"".join(encode_record(r) for r in records)


def test_round_trip() -> None:
    out = decode_frames(segment())
    assert out.torn_at is None
    # A removal is written by page (format 4): it reads back as the pages it names.
    assert out.records == [RemovePages(S0, bytes(4)) if r is RECORDS[2] else r for r in RECORDS]
    assert all(type(r.pool) is PoolId for r in out.records if not isinstance(r, WorldSize))


# A journal segment written by kvmeta before its records were typed (tagged tuples encoded as
# msgpack arrays): pool s/0/kv of 8 pages, vLLM rank 1 of 2^24 pages, commits (one key not
# ASCII, one page 2^24-1), a remove, world size 2 then unpinned, a clear and a drop.
_BEFORE_TYPED = bytes.fromhex(
    "4b564d4a020000000e0000000bf250ff93a4706f6f6c93a17300a26b760810000000f4dafd1293a4706f6f6c93"
    "a17601a0ce010000001e0000007838ef9793a6636f6d6d697493a17300a26b769292a1610092a7636cc3a92dc3"
    "bc071800000018ba5d0593a6636f6d6d697493a17601a09192a3626c6bce00ffffff14000000bd5324b393a672"
    "656d6f766593a17300a26b769192a1610009000000353dd18392a676776f726c640209000000a99ebbf692a676"
    "776f726c64c00e000000b21e0f1b92a5636c65617293a17300a26b760b000000b181a92f92a464726f7093a176"
    "01a0"
)
_BEFORE_RECORDS: list[Record] = [
    NewPool(S0, 8),
    NewPool(V1, 1 << 24),
    Commit(S0, [("a", 0), ("clé-ü", 7)]),
    Commit(V1, [("blk", (1 << 24) - 1)]),
    Remove(S0, [("a", 0)]),
    WorldSize(2),
    WorldSize(None),
    Clear(S0),
    Drop(V1),
]


def test_a_segment_written_before_the_typed_records_decodes_to_them() -> None:
    out = decode_frames(_BEFORE_TYPED)
    assert out.torn_at is None and out.records == _BEFORE_RECORDS


def test_a_data_dir_written_before_the_typed_records_recovers(tmp_path: Path) -> None:
    (tmp_path / "journal-000000000001.log").write_bytes(_BEFORE_TYPED)
    state = recover(tmp_path, repair=False)
    assert state.records == len(_BEFORE_RECORDS) and state.torn_bytes == 0
    assert state.pools == {S0: (8, {})} and state.vworld is None


def _frame(payload: bytes) -> bytes:
    return struct.pack("<II", len(payload), zlib.crc32(payload)) + payload


def test_fields_appended_later_are_ignored_by_this_reader() -> None:
    """The evolution rule: a tag's fields are only ever appended; old readers skip them."""
    payload = msgspec.msgpack.encode(["commit", list(S0), [["a", 3]], "a later field", 7])
    assert decode_frames(HEADER + _frame(payload)).records == [Commit(S0, [("a", 3)])]


@pytest.mark.parametrize(
    "payload",
    [
        ["commit", ["s", 0, "kv"], [["a", "not a page"]]],
        ["pool", ["s", 0, "kv"]],
        ["nonsense", 1],
        {"tag": "pool"},
        "pool",
    ],
)
def test_a_payload_that_is_no_record_is_corruption(payload: object) -> None:
    data = HEADER + _frame(msgspec.msgpack.encode(payload)) + encode_record(WorldSize(1))
    with pytest.raises(FrameError, match="payload is not a journal record .* at byte 8"):
        decode_frames(data)


@pytest.mark.parametrize("cut", [1, 4, 8, 9])
def test_torn_last_record_is_reported_not_raised(cut: int) -> None:
    data = segment()
    last = len(encode_record(RECORDS[-1]))
    torn = data[: len(data) - last + cut] if cut < last else data[:-1]
    out = decode_frames(torn)
    assert len(out.records) == len(RECORDS) - 1
    assert out.torn_at == len(data) - last
    assert out.torn_bytes == len(torn) - out.torn_at


def test_bad_checksum_on_last_record_is_torn() -> None:
    data = bytearray(segment())
    data[-1] ^= 0xFF
    out = decode_frames(bytes(data))
    assert len(out.records) == len(RECORDS) - 1 and out.torn_at is not None


def test_zero_filled_tail_is_torn() -> None:
    out = decode_frames(segment() + bytes(100))
    assert len(out.records) == len(RECORDS) and out.torn_bytes == 100


def test_damage_before_the_end_is_corruption() -> None:
    data = bytearray(segment())
    data[len(HEADER) + 9] ^= 0xFF  # inside the first payload
    with pytest.raises(FrameError, match="checksum mismatch at byte 8"):
        decode_frames(bytes(data))


def test_bad_header_is_corruption() -> None:
    with pytest.raises(FrameError, match="bad magic"):
        decode_frames(b"XXXX" + segment()[4:])
    with pytest.raises(FrameError, match="newer"):
        decode_frames(b"KVMJ\x09\x00\x00\x00")
