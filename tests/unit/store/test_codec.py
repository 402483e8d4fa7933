"""Record framing: round trip, torn tails are cut, other damage is refused."""

from __future__ import annotations

import pytest

from kvmeta.store.codec import HEADER, FrameError, decode_frames, encode_record

RECORDS = [
    ("pool", ("s", 0, "kv"), 8),
    ("commit", ("s", 0, "kv"), [("a", 0), ("b", 1)]),
    ("remove", ("s", 0, "kv"), [("a", 0)]),
    ("clear", ("v", 1, "")),
    ("vworld", 2),
    ("vworld", None),
]


def segment(records: list[tuple[object, ...]] = RECORDS) -> bytes:
    return HEADER + b"".join(encode_record(r) for r in records)


def test_round_trip() -> None:
    out = decode_frames(segment())
    assert out.torn_at is None
    assert out.records == [
        ["pool", ["s", 0, "kv"], 8],
        ["commit", ["s", 0, "kv"], [["a", 0], ["b", 1]]],
        ["remove", ["s", 0, "kv"], [["a", 0]]],
        ["clear", ["v", 1, ""]],
        ["vworld", 2],
        ["vworld", None],
    ]


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
