"""Journal records <-> bytes: the one place the on-disk record format is defined.

A journal segment file is a 8-byte header followed by framed records::

    header  = b"KVMJ" + u8 version (2, or 3 once the segment holds a tenant's record)
              + u24 little-endian distance back to the segment before it (0: not said)
    frame   = u32 little-endian payload length + u32 crc32(payload) + payload
    payload = msgpack array: [tag, pool_id, ...]   with pool_id = [dialect, rank, namespace]
                                                   or [dialect, rank, namespace, tenant] (format 3)

    ["pool",   pool_id, num_pages(, frontier)]     NewPool; again with a higher frontier as it moves
    ["commit", pool_id, [[key, page], ...]]        Commit
    ["remove", pool_id, [[key, page], ...]]        Remove: deletes and evictions
    ["clear",  pool_id]                            Clear
    ["vworld", world_size_or_nil]                  WorldSize
    ["drop",   pool_id]                            Drop: a vLLM rank removed (format 2)
    ["tworld", tenant, world_size_or_nil]          TenantWorldSize (format 3)

Each kind is a tagged, array-like msgspec ``Struct`` (``Record`` is their union), so the bytes
are exactly the tagged arrays above and the reader decodes and type-checks a payload in one
step: a payload that is no record, or a record whose fields have the wrong types, is a damaged
frame, never a half-applied change.

The reader refuses a payload over ``MAX_PAYLOAD`` as garbage, so the writer never produces one:
``encode_records`` splits a ``Commit`` or ``Remove`` whose entry list is too big into several
records of the same kind, in order (replaying them one after another is the same change), and
refuses a record that cannot be split (a single key or namespace that large) before writing.

Evolution rules: a tag's fields are only ever appended (old readers ignore extra trailing
fields), a field's type never changes, and a new kind of record gets a new tag plus a version
bump.

Tenants (format 3): the default tenant ``""`` is written exactly as in format 2 (a pool id of
three elements, ``vworld``), so a data directory that never had another tenant is byte for byte
what an older kvmeta writes and reads. A pool of another tenant has a fourth pool-id element,
and another tenant's world size its own tag, ``tworld``: an older reader cannot take either for
the default tenant's (a three-field pool id refuses four elements, an unknown tag is no record).
The first tenant record written into a segment makes its header say 3 (``HEADER_TENANTS``), so
an older kvmeta refuses such a data directory at start-up with "journal format 3 is newer than
this kvmeta's (2)" instead of serving a wrong page; should the header byte not have reached
the disk before a crash, the record itself is still refused by that reader's decoder.

The chain (bytes 5-7 of the header): a segment says how far back the segment written before it
in this directory is: segment N with distance d follows segment N - d (N itself: nothing was
written before it). Recovery uses it to find a segment that went missing between a snapshot and
the last segment (``store.disk.history``). Older kvmeta wrote those bytes as zeros ("not said"), and
reads a segment that says it without looking at them: the bytes were reserved, so no version
bump was needed, and a directory without tenants stays readable by an older kvmeta. A distance
that does not fit 24 bits (16 million rotations without a record: never in practice) is
written as 0.

Torn tail or corruption? A crash can only tear the end of the last segment, past its last
fsync (earlier segments are fsynced when they are closed). That offset is not on disk, so the
rule is: a bad frame (short header, length past the end or over ``MAX_PAYLOAD``, checksum
mismatch, zeros) is a torn tail only when it is in the last segment *and* no valid frame
(a plausible length and a matching CRC) starts anywhere after it. A damaged length or checksum
in the middle is followed by the intact later records, so it is found to be corruption: the
reader names the byte, and start-up refuses instead of cutting acknowledged records off.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TypeAlias

import msgspec

from kvmeta._types import PoolId

__all__ = [
    "HEADER",
    "VERSION",
    "Clear",
    "Commit",
    "DecodeResult",
    "Drop",
    "FrameError",
    "NewPool",
    "Record",
    "HEADER_TENANTS",
    "RecordTooLarge",
    "Remove",
    "TenantWorldSize",
    "WorldSize",
    "decode_frames",
    "encode_record",
    "encode_records",
    "predecessor",
    "salvage_records",
    "segment_header",
]

VERSION = 3  # 2: the drop record; 3: tenants' records
# What a segment without any tenant's record starts with (older kvmeta reads it), and what one
# holding a tenant's record does (older kvmeta refuses it by its version).
HEADER = b"KVMJ" + bytes([2, 0, 0, 0])
HEADER_TENANTS = b"KVMJ" + bytes([VERSION, 0, 0, 0])
_FRAME = struct.Struct("<II")
_MAX_DISTANCE = (1 << 24) - 1
# The largest payload the reader accepts; anything larger is garbage (a damaged length). The
# writer splits records to stay within it (``encode_records``).
MAX_PAYLOAD = 64 * 1024 * 1024


# Records: array_like + tag = the tagged msgpack arrays of the format above, byte for byte.
# gc=False: they hold only strings and ints (no cycles), and recovery makes millions of them.
class NewPool(msgspec.Struct, tag="pool", array_like=True, frozen=True, gc=False):
    """A pool was created with ``num_pages`` pages; or, for a pool that exists, its frontier
    moved: no page at or above ``frontier`` was handed out before the next such record
    (``core.pool``; -1 in records written before frontiers were: any page may have been)."""

    pool: PoolId
    num_pages: int
    frontier: int = -1


class Commit(msgspec.Struct, tag="commit", array_like=True, frozen=True, gc=False):
    """Keys stored at pages (confirms; an import). Entries are in LRU order, coldest first."""

    pool: PoolId
    entries: list[tuple[str, int]]


class Remove(msgspec.Struct, tag="remove", array_like=True, frozen=True, gc=False):
    """Keys removed from their pages (deletes and evictions); a pair applies only while the
    key still maps to that page."""

    pool: PoolId
    entries: list[tuple[str, int]]


class Clear(msgspec.Struct, tag="clear", array_like=True, frozen=True, gc=False):
    """Every key of the pool removed."""

    pool: PoolId


class WorldSize(msgspec.Struct, tag="vworld", array_like=True, frozen=True, gc=False):
    """The vLLM world size pinned (an int) or unpinned (None)."""

    world_size: int | None


class Drop(msgspec.Struct, tag="drop", array_like=True, frozen=True, gc=False):
    """A vLLM rank removed: its pool and keys are gone (format 2)."""

    pool: PoolId


class TenantWorldSize(msgspec.Struct, tag="tworld", array_like=True, frozen=True, gc=False):
    """A tenant's vLLM world size (``WorldSize`` is the default tenant's), format 3."""

    tenant: str
    world_size: int | None


Record: TypeAlias = NewPool | Commit | Remove | Clear | WorldSize | Drop | TenantWorldSize

_encode_any = msgspec.msgpack.Encoder().encode
_replace = msgspec.structs.replace


# The default tenant's payloads are [tag, [dialect, rank, namespace], *fields]: the head up to
# the pool id is cached per (kind, pool) and the fields are encoded alone (msgpack is a plain
# concatenation), which costs no more than encoding the record whole. Cleared when it grows
# past a bound (pools come and go).
_HEADS: dict[tuple[type, PoolId], bytes] = {}
_MAX_HEADS = 4096


def _encode(record: Record) -> bytes:
    """The payload; the default tenant's pool id keeps its three elements of format 2."""
    cls = type(record)
    if cls is Commit or cls is Remove:
        tail = _encode_any(record.entries)  # type: ignore[union-attr]
    elif cls is Clear or cls is Drop:
        tail = b""
    elif cls is NewPool:  # rare: field by field, the frontier only once there is one
        new: NewPool = record  # type: ignore[assignment]
        fields: list[object] = ["pool", new.pool if new.pool.tenant else new.pool[:3]]
        fields.append(new.num_pages)
        if new.frontier != -1:
            fields.append(new.frontier)
        return _encode_any(fields)
    else:  # WorldSize, TenantWorldSize: no pool id
        return _encode_any(record)
    pool: PoolId = record.pool  # type: ignore[union-attr]
    if pool.tenant:
        return _encode_any(record)
    head = _HEADS.get((cls, pool))
    if head is None:
        whole = _encode_any(_replace(record, pool=pool[:3]))
        head = whole[: len(whole) - len(tail)]
        if len(_HEADS) >= _MAX_HEADS:
            _HEADS.clear()
        _HEADS[(cls, pool)] = head
    return head + tail


_decode = msgspec.msgpack.Decoder(Record).decode
_crc32 = zlib.crc32
_pack = _FRAME.pack


def encode_record(record: Record) -> bytes:
    """One framed record (length, CRC, msgpack payload)."""
    payload = _encode(record)
    return _pack(len(payload), _crc32(payload)) + payload


class RecordTooLarge(ValueError):
    """A record over ``MAX_PAYLOAD`` that cannot be split (one entry alone is too big)."""


def encode_records(record: Record) -> list[bytes]:
    """``record`` as framed records the reader accepts: one, or (a commit or remove too big
    for one frame) several of the same kind, each with a consecutive slice of its entries.

    Raises:
        RecordTooLarge: the record cannot be split to fit ``MAX_PAYLOAD``.
    """
    payload = _encode(record)
    if len(payload) <= MAX_PAYLOAD:
        return [_pack(len(payload), _crc32(payload)) + payload]
    if not isinstance(record, (Commit, Remove)) or len(record.entries) < 2:
        tag = record.__struct_config__.tag
        raise RecordTooLarge(
            f"a journal record {tag!r} of {len(payload)} bytes exceeds the limit of "
            f"{MAX_PAYLOAD} bytes and cannot be split (one key or namespace that long); lower "
            "--max-key-length / --max-namespace-length"
        )
    entries = record.entries
    half = len(entries) // 2
    return encode_records(msgspec.structs.replace(record, entries=entries[:half])) + (
        encode_records(msgspec.structs.replace(record, entries=entries[half:]))
    )


class FrameError(Exception):
    """A frame that is damaged; ``offset`` is where it starts in the file."""

    def __init__(self, offset: int, reason: str, note: str = "") -> None:
        super().__init__(f"{reason} at byte {offset}{note}")
        self.offset = offset
        self.reason = reason


@dataclass
class DecodeResult:
    """Records of one segment; ``torn_at`` is the offset of a torn tail (None if clean)."""

    records: list[Record]
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


def segment_header(segment: int, previous: int, *, tenants: bool = False) -> bytes:
    """The header of segment ``segment``, written after segment ``previous`` (0: none)."""
    distance = segment - previous
    if not 0 < distance <= _MAX_DISTANCE:
        distance = 0
    return (HEADER_TENANTS if tenants else HEADER)[:5] + distance.to_bytes(3, "little")


def predecessor(header: bytes, segment: int) -> int | None:
    """The segment written before ``segment`` as its header says (0: none), or None when the
    header does not say (written by an older kvmeta)."""
    distance = int.from_bytes(header[5:8], "little")
    return segment - distance if distance else None


_BAD_CRC = "checksum mismatch"


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


def decode_frames(data: bytes, *, last: bool = True) -> DecodeResult:
    """Every record of a segment's bytes; ``last``: this is the last segment (the only one
    that can have a torn tail).

    Raises:
        FrameError: damage that is not a torn tail (a bad frame followed by a valid one, any
            bad frame in a segment that is not the last, a payload that is not a record, a
            bad header).
    """
    check_header(data)
    result = DecodeResult(records=[])
    for offset, payload, reason in _frames(data, len(HEADER)):
        if payload is None:
            if not last:
                raise FrameError(offset, reason, " of a journal segment that is not the last")
            later = _valid_frame_after(data, offset)
            if later is not None:
                raise FrameError(
                    offset, reason, f" (a valid record follows at byte {later}: not a torn tail)"
                )
            result.torn_at = offset
            result.torn_bytes = len(data) - offset
            break
        try:
            record = _decode(payload)
        except msgspec.ValidationError as exc:
            raise FrameError(offset, f"payload is not a journal record ({exc})") from None
        except msgspec.DecodeError as exc:
            raise FrameError(offset, f"undecodable record ({exc})") from None
        result.records.append(record)
    return result


def _valid_frame_after(data: bytes, offset: int) -> int | None:
    """The offset of the first valid frame starting after ``offset``, or None.

    A torn tail is a prefix of what was being written, so nothing valid follows its first bad
    frame; a false match needs a 32-bit CRC to agree by chance. Cost: one pass over the tail,
    a CRC only where the length fits (a torn tail is at most one group, usually kilobytes)."""
    view = memoryview(data)
    end = len(data)
    unpack = _FRAME.unpack_from
    for pos in range(offset + 1, end - _FRAME.size + 1):
        length, crc = unpack(data, pos)
        body = pos + _FRAME.size
        if 0 < length <= MAX_PAYLOAD and body + length <= end:
            if _crc32(view[body : body + length]) == crc:
                return pos
    return None


def salvage_records(data: bytes) -> tuple[list[Record], int]:
    """Every record still readable in a damaged segment, and how many damaged stretches were
    stepped over: each bad frame (or payload that is no record) is skipped up to the next
    valid frame. Only ``kvmeta check --repair`` reads a journal this way, and it keeps no key
    from it: a record read past damage may follow changes that were lost.

    Raises:
        FrameError: the header is not one this version reads.
    """
    check_header(data)
    records: list[Record] = []
    skipped = 0
    pos: int | None = len(HEADER)
    while pos is not None:
        start, pos = pos, None
        for offset, payload, _ in _frames(data, start):
            if payload is None:
                skipped += 1
                pos = _valid_frame_after(data, offset)
                break
            try:
                records.append(_decode(payload))
            except (msgspec.ValidationError, msgspec.DecodeError):
                skipped += 1
    return records, skipped
