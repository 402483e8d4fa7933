"""Snapshots: the whole durable state as of one journal position, in one checksummed file.

``snapshot-<N>.snap`` holds every pool and the vLLM world size as of the start of journal
segment N; recovery loads it and replays ``journal-<N>.log`` onwards. Layout::

    head    = b"KVMS" + u8 version (1, 2 with tenants, 3 with wide pools) + 3 zero bytes
              + u64 len(payload)
              + u32 crc32(payload)
    payload = u32 len(meta) + meta + blobs
    meta    = msgpack map {"segment": N, "vworld": int|nil,
                           "pools": [[dialect, rank, namespace, num_pages, [chunk_len...],
                                      pages_len(, tenant)]],
                           ("tworld": {tenant: int}), ("frontiers": [int, ...]), ("head": 1)}
    blobs   = per pool, in order: its key chunks (each a msgpack array of up to 32768 keys),
              then its pages (little-endian int32, parallel to the keys, coldest first; int64
              in a version 3 file for a pool of more than 2^31 pages)

Tenants (version 2): a pool of a tenant other than the default ``""`` has a seventh element,
its tenant, and other tenants' vLLM world sizes are in ``tworld``. A snapshot without any of
them is written as version 1, byte for byte what an older kvmeta writes; one with them is
version 2, which an older kvmeta refuses ("snapshot format 2 is newer") rather than load a
tenant's pool as the default tenant's. A version 1 snapshot loads as tenant ``""``.
A pool of more than 2^31 pages (``core.pool.page_typecode``) has page numbers that need 64 bits:
a snapshot holding one is version 3, which an older kvmeta refuses rather than misread.

``frontiers`` holds each pool's frontier (``core.pool``), in the order of ``pools``; an older
kvmeta ignores it, and a snapshot without it (an older kvmeta's) leaves every pool's frontier
unrecorded, so recovery holds all its free pages after the restart.
``"head": 1`` says the kvmeta that wrote it keeps a ``HEAD`` file in the data directory
(``store.disk.history``): a directory holding such a snapshot without HEAD had its files restored
or copied without it. An older kvmeta ignores the key.

Taking one never stops the server: ``capture`` runs on the event loop and only copies each
pool's page->key table and LRU links (at memcpy speed); ``write_snapshot`` walks the copies,
encodes and writes in a worker thread, in pieces small enough that no single C call holds the
GIL for long (one msgspec call over all the keys of a 10^6-key pool would stall the loop for
tens of milliseconds; the pauses are in benchmarks/README.md, "Durability").
The cyclic GC is paused only during the copy (``gc.disable`` is process-wide: held across the
write it would stop collection for every coroutine). The file is written to a temporary
name, fsynced, renamed and the directory fsynced, so a crash leaves the old snapshot or the new
one, never a torn one (docs/guarantees.md, failure 9).
"""

from __future__ import annotations

import struct
import sys
import time
import zlib
from array import array
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from kvmeta._types import PoolId
from kvmeta.core.eviction import Order
from kvmeta.core.pool import lru_order, page_typecode
from kvmeta.store.disk.journal import write_durably
from kvmeta.store.disk.memory import MemoryStore

__all__ = [
    "PoolImage",
    "SnapshotData",
    "SnapshotError",
    "StoreImage",
    "capture",
    "read_snapshot",
    "read_snapshot_pools",
    "snapshot_path",
    "write_snapshot",
]

VERSION = 3  # 3: a pool of more than 2^31 pages, whose page numbers are written as int64
_VERSION_TENANTS = 2  # tenants (written only when the state has a tenant's pool or world size)
_VERSION_DEFAULT_ONLY = 1
_MAGIC = b"KVMS"
_HEAD = struct.Struct("<4sB3xQI")
_U32 = struct.Struct("<I")
_KEY_CHUNK = 32768
_encode = msgspec.msgpack.Encoder().encode
_decode = msgspec.msgpack.Decoder(list[str]).decode


def snapshot_path(directory: Path, segment: int) -> Path:
    return directory / f"snapshot-{segment:012d}.snap"


@dataclass
class PoolImage:
    """One pool frozen at capture time (copies, not live structures)."""

    pid: PoolId
    num_pages: int
    page_key: list[str | None]
    chain: Order  # the policy's order, copied
    frontier: int = -1  # -1: not recorded

    def order(self) -> tuple[list[str], array[int]]:
        """Stored keys and pages, coldest first (O(stored): call it off the loop)."""
        return lru_order(self.page_key, self.chain)

    def items(self) -> list[tuple[str, int]]:
        keys, pages = self.order()
        return list(zip(keys, pages, strict=True))


@dataclass
class StoreImage:
    """Everything durable, captured in one event-loop step."""

    pools: list[PoolImage]
    vworld: int | None
    capture_seconds: float = 0.0
    tworld: dict[str, int] = field(default_factory=dict)  # other tenants' vLLM world sizes


@dataclass
class SnapshotData:
    """A snapshot as read back: pools as (pid, num_pages, keys, pages), coldest first."""

    segment: int
    vworld: int | None
    pools: list[tuple[PoolId, int, list[str], array[int]]] = field(default_factory=list)
    tworld: dict[str, int] = field(default_factory=dict)  # other tenants' vLLM world sizes
    frontiers: dict[PoolId, int] = field(default_factory=dict)  # recorded frontiers only
    head: bool = False  # written by a kvmeta that keeps HEAD (``store.disk.history``)


class SnapshotError(Exception):
    """A snapshot file that fails its checks; the reason says which."""


def capture(store: MemoryStore) -> StoreImage:
    """Copy the durable state; call on the event loop, between two operations."""
    started = time.perf_counter()
    pools = [
        PoolImage(pid, pool.num_pages, *pool.lru_copy(), pool.frontier)
        for pid, pool in store.pools.items()
    ]
    tworld = {t: size for t, size in store.vllm_world_sizes.items() if t}
    return StoreImage(pools, store.vllm_world_size, time.perf_counter() - started, tworld)


def _pages_bytes(pages: array[int]) -> bytes:
    if sys.byteorder != "little":  # pragma: no cover - every supported host is little-endian
        pages = array(pages.typecode, pages)
        pages.byteswap()
    return pages.tobytes()


def encode_image(image: StoreImage, segment: int) -> list[bytes]:
    """The snapshot file as a list of pieces, head first (O(stored): run it off the loop)."""
    pools: list[list[Any]] = []
    blobs: list[bytes] = []
    tenants = bool(image.tworld)
    wide = False
    for img in image.pools:
        wide = wide or page_typecode(img.num_pages) != "i"
        keys, pages = img.order()
        chunks = [_encode(keys[i : i + _KEY_CHUNK]) for i in range(0, len(keys), _KEY_CHUNK)]
        page_blob = _pages_bytes(pages)
        blobs += chunks
        blobs.append(page_blob)
        pid = img.pid
        lengths = [len(c) for c in chunks]
        entry = [pid.dialect, pid.rank, pid.namespace, img.num_pages, lengths, len(page_blob)]
        if pid.tenant:
            entry.append(pid.tenant)
            tenants = True
        pools.append(entry)
    body: dict[str, Any] = {"segment": segment, "vworld": image.vworld, "pools": pools}
    if image.tworld:
        body["tworld"] = image.tworld
    body["frontiers"] = [img.frontier for img in image.pools]
    body["head"] = 1
    meta = _encode(body)
    pieces = [_U32.pack(len(meta)), meta, *blobs]
    crc = 0
    for piece in pieces:
        crc = zlib.crc32(piece, crc)
    size = sum(len(piece) for piece in pieces)
    version = VERSION if wide else _VERSION_TENANTS if tenants else _VERSION_DEFAULT_ONLY
    return [_HEAD.pack(_MAGIC, version, size, crc), *pieces]


def write_snapshot(directory: Path, segment: int, image: StoreImage) -> Path:
    """Write ``snapshot-<segment>.snap`` atomically; returns its path."""
    pieces = encode_image(image, segment)
    final = snapshot_path(directory, segment)
    write_durably(final, lambda fh: fh.writelines(pieces))
    return final


def _payload(path: Path) -> tuple[memoryview, int, int]:
    """The payload of a snapshot file whose header is sound, the checksum it gives and the
    format version.

    Raises:
        SnapshotError: the file is too short, of a newer format, or not a snapshot.
    """
    data = path.read_bytes()
    if len(data) < _HEAD.size:
        raise SnapshotError("file shorter than its header")
    magic, version, length, crc = _HEAD.unpack_from(data)
    if magic != _MAGIC:
        raise SnapshotError("not a kvmeta snapshot (bad magic)")
    if version > VERSION:
        raise SnapshotError(f"snapshot format {version} is newer than this kvmeta ({VERSION})")
    payload = memoryview(data)[_HEAD.size :]
    if len(payload) != length:
        raise SnapshotError(f"payload is {len(payload)} bytes, header says {length}")
    return payload, crc, version


def read_snapshot(path: Path) -> SnapshotData:
    """Load a snapshot file.

    Raises:
        SnapshotError: truncated, checksum mismatch, unknown version or malformed content.
    """
    payload, crc, version = _payload(path)
    if zlib.crc32(payload) != crc:
        raise SnapshotError("checksum mismatch")
    try:
        (meta_len,) = _U32.unpack_from(payload)
        pos = _U32.size + meta_len
        body = msgspec.msgpack.decode(payload[_U32.size : pos])
        out = SnapshotData(segment=int(body["segment"]), vworld=body["vworld"])
        out.head = bool(body.get("head"))
        for tenant, size in body.get("tworld", {}).items():
            out.tworld[str(tenant)] = int(size)
        frontiers = body.get("frontiers") or [-1] * len(body["pools"])
        for entry, frontier in zip(body["pools"], frontiers, strict=True):
            dialect, rank, namespace, num_pages, chunk_lengths, pages_len = entry[:6]
            tenant = str(entry[6]) if len(entry) > 6 else ""
            keys: list[str] = []
            for length in chunk_lengths:
                keys.extend(_decode(payload[pos : pos + length]))
                pos += length
            # Formats before 3 wrote every page as int32, whatever the pool's size.
            pages = array(page_typecode(num_pages) if version >= VERSION else "i")
            pages.frombytes(payload[pos : pos + pages_len])
            pos += pages_len
            if sys.byteorder != "little":  # pragma: no cover
                pages.byteswap()
            if len(pages) != len(keys):
                raise SnapshotError(f"pool {rank}/{namespace}: keys and pages differ in length")
            pid = PoolId(dialect, rank, namespace, tenant)
            out.pools.append((pid, num_pages, keys, pages))
            if frontier >= 0:
                out.frontiers[pid] = int(frontier)
    except (msgspec.DecodeError, KeyError, TypeError, ValueError, struct.error) as exc:
        raise SnapshotError(f"malformed content ({exc})") from None
    return out


def read_snapshot_pools(path: Path) -> SnapshotData:
    """The pools of a snapshot whose checksum fails, without their keys, for ``kvmeta check
    --repair`` (which keeps pools and drops keys): read only when the header is intact and the
    lengths the meta names add up to the file exactly, so that a damaged meta is not taken
    for pool sizes.

    Raises:
        SnapshotError: the header, the meta or its lengths are damaged.
    """
    payload, _, _ = _payload(path)
    length = len(payload)
    try:
        (meta_len,) = _U32.unpack_from(payload)
        body = msgspec.msgpack.decode(payload[_U32.size : _U32.size + meta_len])
        out = SnapshotData(segment=int(body["segment"]), vworld=body["vworld"])
        for tenant, size in body.get("tworld", {}).items():
            out.tworld[str(tenant)] = int(size)
        total = _U32.size + meta_len
        for entry in body["pools"]:
            dialect, rank, namespace, num_pages, chunk_lengths, pages_len = entry[:6]
            tenant = str(entry[6]) if len(entry) > 6 else ""
            if dialect not in ("s", "v") or type(num_pages) is not int or num_pages <= 0:
                raise SnapshotError(f"pool entry {entry[:4]!r} is not a pool")
            total += sum(int(n) for n in chunk_lengths) + int(pages_len)
            pid = PoolId(dialect, int(rank), str(namespace), tenant)
            out.pools.append((pid, num_pages, [], array("i")))
    except (msgspec.DecodeError, KeyError, TypeError, ValueError, struct.error) as exc:
        raise SnapshotError(f"malformed content ({exc})") from None
    if total != length:
        raise SnapshotError(f"the meta's lengths add up to {total} bytes, the payload is {length}")
    return out
