"""Journal records <-> bytes: the one place the on-disk record format is defined.

A journal segment file is a 8-byte header followed by framed records::

    header  = b"KVMJ" + u8 version (4; older segments say 2, or 3 once they hold a tenant's record)
              + u24 little-endian distance back to the segment before it (0: not said)
    frame   = u32 little-endian payload length + u32 crc32(payload) + payload
    payload = msgpack array: [tag, pool_id, ...]   with pool_id = [dialect, rank, namespace]
                                                   or [dialect, rank, namespace, tenant] (format 3)

    ["pool",   pool_id, num_pages(, frontier)]     NewPool; again with a higher frontier as it moves
    ["c",      pool_id, width, keys, pages]        Commit (format 4): see "Keys as bytes" below
    ["r",      pool_id, pages]                     Remove (format 4): by page, see below
    ["commit", pool_id, [[key, page], ...]]        Commit as formats 2-3 wrote it (still read)
    ["remove", pool_id, [[key, page], ...]]        Remove as formats 2-3 wrote it (still read)
    ["clear",  pool_id]                            Clear
    ["vworld", world_size_or_nil]                  WorldSize
    ["drop",   pool_id]                            Drop: a vLLM rank removed (format 2)
    ["tworld", tenant, world_size_or_nil]          TenantWorldSize (format 3)

Keys as bytes (format 4): a commit's ``pages`` is one msgpack bin of little-endian u32 page
numbers, one per entry. When every key of the commit is lowercase hex of one even length (the
engines' sha256 keys: 64 characters), ``width`` is that length in bytes and ``keys`` one bin of
the keys' bytes, concatenated (64-hex keys: 36 bytes an entry instead of ~71); otherwise
``width`` is 0 and ``keys`` the list of the keys as text, exactly as they were sent. A commit
with a page past u32 (a pool of more than 2^32 pages) is written in the ``commit`` form.

Removals by page (format 4): a removal names only the pages (the same bin of u32), since the
journal is a total order of changes: at that point of the replay, each page's key is the one
the live store removed. Recovery keeps a page -> key list per pool (built from the replayed
dict at its first removal) and removes a page's key only while that key still maps to that
page, as the older pair form did. A snapshot holds exactly the records of the segments before
its number (rotation and capture in one loop step: ``store.disk.datadir``), so a removal
replayed after it finds the state it was written against.

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
bump. Format 4 (keys as bytes, removals by page) is written in every segment's header from the
start: an older kvmeta refuses the directory with "journal format 4 is newer than this
kvmeta's (3)" instead of misreading it, and this kvmeta reads segments of formats 2 and 3.

Tenants (format 3): the default tenant ``""`` is written exactly as in format 2 (a pool id of
three elements, ``vworld``). A pool of another tenant has a fourth pool-id element,
and another tenant's world size its own tag, ``tworld``: an older reader cannot take either for
the default tenant's (a three-field pool id refuses four elements, an unknown tag is no record).
Format 3 segments (written by kvmeta before format 4) said 3 in their header once they held a
tenant's record, so a kvmeta of format 2 refused them.

The chain (bytes 5-7 of the header): a segment says how far back the segment written before it
in this directory is: segment N with distance d follows segment N - d (N itself: nothing was
written before it). Recovery uses it to find a segment that went missing between a snapshot and
the last segment (``store.disk.history``). Older kvmeta wrote those bytes as zeros ("not said"), and
reads a segment that says it without looking at them: the bytes were reserved, so no version
bump was needed. A distance
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
    "HEADER_WRITTEN",
    "RecordTooLarge",
    "Remove",
    "RemovePages",
    "TenantWorldSize",
    "WorldSize",
    "decode_frames",
    "encode_record",
    "encode_records",
    "page_numbers",
    "predecessor",
    "salvage_records",
    "segment_header",
]

VERSION = 4  # 2: the drop record; 3: tenants' records; 4: keys as bytes, removals by page
# What older segments start with: format 2 (no tenant's record), format 3 (one); every header is
# this long. Segments written now say format 4 (``HEADER_WRITTEN``).
HEADER = b"KVMJ" + bytes([2, 0, 0, 0])
HEADER_TENANTS = b"KVMJ" + bytes([3, 0, 0, 0])
HEADER_WRITTEN = b"KVMJ" + bytes([VERSION, 0, 0, 0])
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


class RemovePages(msgspec.Struct, tag="r", array_like=True, frozen=True, gc=False):
    """A ``Remove`` as read back from format 4: the pages whose keys were removed (u32
    little-endian each); replay names each page's key from its state (module docstring)."""

    pool: PoolId
    pages: bytes


class _PackedCommit(msgspec.Struct, tag="c", array_like=True, frozen=True, gc=False):
    """A ``Commit`` as format 4 writes it; the reader turns it back into a ``Commit``."""

    pool: PoolId
    width: int
    keys: bytes | list[str]
    pages: bytes


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


Record: TypeAlias = (
    NewPool | Commit | Remove | RemovePages | Clear | WorldSize | Drop | TenantWorldSize
)

_encode_any = msgspec.msgpack.Encoder().encode
_replace = msgspec.structs.replace


def _packed_pages(entries: list[tuple[str, int]]) -> bytes | None:
    """The entries' pages as u32 little-endian; None when one does not fit."""
    try:
        return struct.pack(f"<{len(entries)}I", *map(_second, entries))
    except struct.error:
        return None


def _packed_commit(entries: list[tuple[str, int]]) -> tuple[int, bytes | list[str], bytes] | None:
    """(width, keys, pages) of format 4: hex keys of one even length as their bytes, else the
    text; None when a page does not fit u32.

    The keys are joined with spaces so one ``bytes.fromhex`` reads them all; it also takes
    upper case and skips spaces, so the proof is the way back: ``hex`` with a space every
    ``width`` bytes gives the joined text again only if every key is exactly ``2 x width``
    lowercase hex characters (with one byte count per key: a space inside a key would
    otherwise pass as a separator)."""
    keys, pages = zip(*entries, strict=True)
    try:
        packed = struct.pack(f"<{len(pages)}I", *pages)
    except struct.error:
        return None
    width = len(keys[0]) >> 1
    if width and not len(keys[0]) & 1:
        spaced = " ".join(keys)
        try:
            blob = bytes.fromhex(spaced)
        except ValueError:
            return 0, list(keys), packed
        if len(blob) == width * len(keys) and blob.hex(" ", width) == spaced:
            return width, blob, packed
    return 0, list(keys), packed


def _encode(record: Record) -> bytes:
    """The payload; the default tenant's pool id keeps its three elements of format 2."""
    cls = type(record)
    if cls is Commit or cls is Remove:
        entries: list[tuple[str, int]] = record.entries  # type: ignore[union-attr]
        pool: PoolId = record.pool  # type: ignore[union-attr]
        pid = pool if pool.tenant else pool[:3]
        if entries:
            if cls is Remove:
                pages = _packed_pages(entries)
                if pages is not None:
                    return _encode_any(("r", pid, pages))
            else:
                packed = _packed_commit(entries)
                if packed is not None:
                    return _encode_any(("c", pid, *packed))
        # A page past u32 (or nothing): the pair form of formats 2-3.
        return _encode_any(_replace(record, pool=pid))
    if cls is NewPool:  # rare: field by field, the frontier only once there is one
        new: NewPool = record  # type: ignore[assignment]
        fields: list[object] = ["pool", new.pool if new.pool.tenant else new.pool[:3]]
        fields.append(new.num_pages)
        if new.frontier != -1:
            fields.append(new.frontier)
        return _encode_any(fields)
    if cls is Clear or cls is Drop or cls is RemovePages:
        pool = record.pool  # type: ignore[union-attr]
        if not pool.tenant:
            return _encode_any(_replace(record, pool=pool[:3]))
    return _encode_any(record)


def _second(entry: tuple[str, int]) -> int:
    return entry[1]


def _unpack_commit(packed: _PackedCommit) -> Commit:
    """The ``Commit`` a format 4 commit stands for.

    Raises:
        ValueError: the keys and pages do not pair up (a damaged record).
    """
    pages, width, keys = packed.pages, packed.width, packed.keys
    count, rest = divmod(len(pages), 4)
    if rest:
        raise ValueError(f"pages field of {len(pages)} bytes is not a multiple of 4")
    numbers = struct.unpack(f"<{count}I", pages)
    if isinstance(keys, bytes):
        if width <= 0 or len(keys) != width * count:
            raise ValueError(f"{len(keys)} key bytes for {count} pages of width {width}")
        text = keys.hex()
        step = 2 * width
        names = [text[i : i + step] for i in range(0, len(text), step)]
    else:
        if width != 0 or len(keys) != count:
            raise ValueError(f"{len(keys)} keys for {count} pages")
        names = keys
    return Commit(packed.pool, list(zip(names, numbers, strict=True)))


def page_numbers(record: RemovePages) -> tuple[int, ...]:
    """The page numbers of a format 4 removal.

    Raises:
        ValueError: the field is not a whole number of u32 (a damaged record).
    """
    count, rest = divmod(len(record.pages), 4)
    if rest:
        raise ValueError(f"pages field of {len(record.pages)} bytes is not a multiple of 4")
    return struct.unpack(f"<{count}I", record.pages)


_decode_any = msgspec.msgpack.Decoder(Record | _PackedCommit).decode


def _decode(payload: bytes) -> Record:
    """One payload as a ``Record`` (a format 4 commit as the ``Commit`` it stands for).

    Raises:
        msgspec.ValidationError: not a record, or a format 4 commit whose fields disagree.
        msgspec.DecodeError: not msgpack.
    """
    record = _decode_any(payload)
    if type(record) is _PackedCommit:
        try:
            return _unpack_commit(record)
        except (ValueError, struct.error) as exc:
            raise msgspec.ValidationError(str(exc)) from None
    if type(record) is RemovePages and len(record.pages) & 3:
        raise msgspec.ValidationError(f"pages field of {len(record.pages)} bytes")
    return record  # type: ignore[no-any-return]


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


def segment_header(segment: int, previous: int) -> bytes:
    """The header of segment ``segment``, written after segment ``previous`` (0: none)."""
    distance = segment - previous
    if not 0 < distance <= _MAX_DISTANCE:
        distance = 0
    return HEADER_WRITTEN[:5] + distance.to_bytes(3, "little")


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
