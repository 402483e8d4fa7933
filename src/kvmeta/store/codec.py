"""Journal records <-> bytes: the one place the on-disk record format is defined.

A journal segment file is a 8-byte header followed by framed records::

    header  = b"KVMJ" + u8 version (=2) + 3 zero bytes
    frame   = u32 little-endian payload length + u32 crc32(payload) + payload
    payload = msgpack array: [tag, pool_id, ...]   with pool_id = [dialect, rank, namespace]

    ["pool",   pool_id, num_pages]
    ["commit", pool_id, [[key, page], ...]]
    ["remove", pool_id, [[key, page], ...]]     deletes and evictions
    ["clear",  pool_id]
    ["vworld", world_size_or_nil]
    ["drop",   pool_id]                         a vLLM rank removed (format 2)

Evolution rules: a tag's fields are only ever appended (old readers ignore extra trailing
fields), a field's type never changes, and a new kind of record gets a new tag plus a version
bump. A frame whose length runs past the end of the file, or whose CRC fails as the very last
frame, is a torn write (the process died mid-append) and is cut off; anything else is corruption.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import msgspec

__all__ = [
    "HEADER",
    "VERSION",
    "DecodeResult",
    "FrameError",
    "decode_frames",
    "encode_record",
]

VERSION = 2  # 2: the drop record
HEADER = b"KVMJ" + bytes([VERSION, 0, 0, 0])
_FRAME = struct.Struct("<II")
# A single record never holds more than one request's keys; anything larger is garbage.
MAX_PAYLOAD = 64 * 1024 * 1024

_encode = msgspec.msgpack.Encoder().encode
_decode = msgspec.msgpack.Decoder().decode
_crc32 = zlib.crc32
_pack = _FRAME.pack


def encode_record(record: tuple[Any, ...]) -> bytes:
    """One framed record (length, CRC, msgpack payload)."""
    payload = _encode(record)
    return _pack(len(payload), _crc32(payload)) + payload


class FrameError(Exception):
    """A frame that is damaged; ``offset`` is where it starts in the file."""

    def __init__(self, offset: int, reason: str) -> None:
        super().__init__(f"{reason} at byte {offset}")
        self.offset = offset
        self.reason = reason


@dataclass
class DecodeResult:
    """Records of one segment; ``torn_at`` is the offset of a torn tail (None if clean)."""

    records: list[list[Any]]
    torn_at: int | None = None
    torn_bytes: int = 0


def check_header(data: bytes) -> None:
    """Raises FrameError when the segment does not start with a header this version reads."""
    if len(data) < len(HEADER):
        raise FrameError(0, "file shorter than its header")
    if data[:4] != HEADER[:4]:
        raise FrameError(0, "not a kvmeta journal (bad magic)")
    if data[4] > VERSION:
        raise FrameError(0, f"journal format {data[4]} is newer than this kvmeta's ({VERSION})")


_BAD_CRC = "checksum mismatch"
# What a write cut short by a crash looks like: a prefix of a frame, or zeros past the end.
_TORN = ("incomplete frame header", "zero-filled tail", "frame runs past the end of the file")


def _frames(data: bytes, start: int) -> Iterator[tuple[int, bytes | None, str]]:
    """(offset, payload or None, reason) per frame; a None payload ends the iteration."""
    pos, end = start, len(data)
    while pos < end:
        if end - pos < _FRAME.size:
            yield pos, None, "incomplete frame header"
            return
        length, crc = _FRAME.unpack_from(data, pos)
        if length == 0 and not any(data[pos:]):
            yield pos, None, "zero-filled tail"
            return
        if length > MAX_PAYLOAD:
            yield pos, None, f"impossible frame length {length}"
            return
        body_end = pos + _FRAME.size + length
        if body_end > end:
            yield pos, None, "frame runs past the end of the file"
            return
        payload = data[pos + _FRAME.size : body_end]
        if _crc32(payload) != crc:
            yield pos, None, _BAD_CRC
            return
        yield pos, payload, ""
        pos = body_end


def decode_frames(data: bytes) -> DecodeResult:
    """Every record of a segment's bytes.

    Raises:
        FrameError: damage that is not a torn tail (a bad frame followed by more data, a
            payload that is not a record, a bad header).
    """
    check_header(data)
    result = DecodeResult(records=[])
    for offset, payload, reason in _frames(data, len(HEADER)):
        if payload is None:
            if reason not in _TORN and not (reason == _BAD_CRC and _is_last_frame(data, offset)):
                raise FrameError(offset, reason)
            result.torn_at = offset
            result.torn_bytes = len(data) - offset
            break
        try:
            record = _decode(payload)
        except msgspec.DecodeError as exc:
            raise FrameError(offset, f"undecodable record ({exc})") from None
        if not isinstance(record, list) or not record or not isinstance(record[0], str):
            raise FrameError(offset, "payload is not a journal record")
        result.records.append(record)
    return result


def _is_last_frame(data: bytes, offset: int) -> bool:
    length, _ = _FRAME.unpack_from(data, offset)
    return offset + _FRAME.size + length == len(data)
