"""Tenants on disk: the default tenant keeps three-element pool ids (journal) and the bytes of
snapshot format 1, another tenant's records and pools round-trip, and an older kvmeta can never
read a tenant's pool as the default tenant's (it refuses the file instead)."""

from __future__ import annotations

import asyncio
import functools
import struct
from pathlib import Path
from typing import NamedTuple

import msgspec
import pytest

from kvmeta._types import PoolId
from kvmeta.store.disk.codec import (
    HEADER,
    Clear,
    Commit,
    Drop,
    NewPool,
    Record,
    Remove,
    RemovePages,
    TenantWorldSize,
    WorldSize,
    decode_frames,
    encode_record,
)
from kvmeta.store.disk.history import write_head
from kvmeta.store.disk.journal import Journal, segment_path
from kvmeta.store.disk.memory import MemoryStore
from kvmeta.store.disk.recovery import install, recover
from kvmeta.store.disk.snapshot import capture, encode_image, read_snapshot, write_snapshot

S0 = PoolId("s", 0, "kv")
T0 = PoolId("s", 0, "kv", "team-a")
U0 = PoolId("s", 0, "kv", "team-b")
TV1 = PoolId("v", 1, "", "team-a")

TENANT_RECORDS: list[Record] = [
    NewPool(T0, 8),
    Commit(T0, [("a", 0), ("b", 1)]),
    Remove(T0, [("a", 0)]),
    Clear(T0),
    NewPool(TV1, 4),
    Drop(TV1),
    TenantWorldSize("team-a", 2),
    TenantWorldSize("team-a", None),
]


def test_tenant_records_round_trip() -> None:
    out = decode_frames(HEADER + b"".join(encode_record(r) for r in TENANT_RECORDS))
    removed = RemovePages(T0, bytes(4))  # written by page (format 4)
    assert out.records == [removed if type(r) is Remove else r for r in TENANT_RECORDS]
    assert all(r.pool.tenant == "team-a" for r in out.records if hasattr(r, "pool"))


def test_default_tenant_records_have_three_element_pool_ids() -> None:
    payload = encode_record(Commit(S0, [("a", 0)]))[8:]
    assert msgspec.msgpack.decode(payload) == ["c", ["s", 0, "kv"], 0, ["a"], bytes(4)]
    payload = encode_record(Remove(S0, [("a", 0)]))[8:]
    assert msgspec.msgpack.decode(payload) == ["r", ["s", 0, "kv"], bytes(4)]
    assert msgspec.msgpack.decode(encode_record(WorldSize(3))[8:]) == ["vworld", 3]


# What an older kvmeta (format 2) decodes: a pool id of exactly three fields, these tags.
class _OldPoolId(NamedTuple):
    dialect: str
    rank: int
    namespace: str


class _OldNewPool(msgspec.Struct, tag="pool", array_like=True):
    pool: _OldPoolId
    num_pages: int


class _OldCommit(msgspec.Struct, tag="commit", array_like=True):
    pool: _OldPoolId
    entries: list[tuple[str, int]]


class _OldRemove(msgspec.Struct, tag="remove", array_like=True):
    pool: _OldPoolId
    entries: list[tuple[str, int]]


class _OldClear(msgspec.Struct, tag="clear", array_like=True):
    pool: _OldPoolId


class _OldWorldSize(msgspec.Struct, tag="vworld", array_like=True):
    world_size: int | None


class _OldDrop(msgspec.Struct, tag="drop", array_like=True):
    pool: _OldPoolId


_OLD = msgspec.msgpack.Decoder(
    _OldNewPool | _OldCommit | _OldRemove | _OldClear | _OldWorldSize | _OldDrop
)


@pytest.mark.parametrize("record", TENANT_RECORDS, ids=lambda r: type(r).__name__)
def test_an_older_reader_refuses_every_tenant_record(record: Record) -> None:
    """Never read as the default tenant's: the older decoder rejects the payload."""
    with pytest.raises(msgspec.ValidationError):
        _OLD.decode(encode_record(record)[8:])


@pytest.mark.parametrize(
    "record", [Commit(S0, [("a", 1)]), Remove(S0, [("a", 1)])], ids=["Commit", "Remove"]
)
def test_an_older_reader_refuses_the_format_4_records(record: Record) -> None:
    """Keys as bytes and removals by page are new tags: never misread as the pair form."""
    with pytest.raises(msgspec.ValidationError):
        _OLD.decode(encode_record(record)[8:])


def _journal(directory: Path, records: list[list[Record]]) -> bytes:
    """Write ``records`` in groups (one flush each) through a real journal; the segment bytes."""

    async def run() -> None:
        journal = Journal(directory, 1, mode="never", loop=asyncio.get_running_loop())
        journal.on_new_segment = functools.partial(write_head, directory)  # as the server does
        for group in records:
            for record in group:
                journal.append(record)
            journal.flush()
        await journal.close()

    asyncio.run(run())
    return segment_path(directory, 1).read_bytes()


def test_a_journal_without_tenants_says_format_4(tmp_path: Path) -> None:
    """Format 4 from the first byte: an older kvmeta refuses the directory by its version."""
    data = _journal(tmp_path, [[NewPool(S0, 8), Commit(S0, [("a", 0)])], [WorldSize(1)]])
    assert data[:4] == HEADER[:4] and data[4] == 4
    assert data[5:8] == bytes(
        [1, 0, 0]
    )  # the chain (store.disk.history): segment 0 before it, none


def test_a_segment_with_tenants_says_format_4(tmp_path: Path) -> None:
    data = _journal(tmp_path, [[NewPool(S0, 8), Commit(S0, [("a", 0)])], [NewPool(T0, 8)]])
    assert data[4] == 4
    assert decode_frames(data).records == [NewPool(S0, 8), Commit(S0, [("a", 0)]), NewPool(T0, 8)]
    (tmp_path / "x").mkdir()
    data = _journal(tmp_path / "x", [[TenantWorldSize("team-a", 2)], [WorldSize(1)]])
    assert data[4] == 4
    assert decode_frames(data).records == [TenantWorldSize("team-a", 2), WorldSize(1)]


def test_recovery_keeps_tenants_apart(tmp_path: Path) -> None:
    records: list[Record] = [
        NewPool(S0, 8),
        NewPool(T0, 4),
        NewPool(U0, 2),
        Commit(S0, [("k", 3)]),
        Commit(T0, [("k", 1)]),
        Commit(U0, [("other", 0)]),
        Remove(S0, [("k", 3)]),
        WorldSize(2),
        TenantWorldSize("team-a", 4),
        TenantWorldSize("team-b", 1),
        TenantWorldSize("team-b", None),
    ]
    _journal(tmp_path, [records])
    state = recover(tmp_path, repair=False)
    assert state.pools == {S0: (8, {}), T0: (4, {"k": 1}), U0: (2, {"other": 0})}
    assert state.vworld == 2 and state.tworld == {"team-a": 4}
    store = MemoryStore()
    install(store, state, tmp_path)
    assert store.get(T0, ["k"]) == [1] and store.get(S0, ["k"]) == [None]
    assert store.v_index("team-a").world_size == 4 and store.v_index().world_size == 2
    assert store.v_index("team-b").world_size is None
    assert store.budget(T0) == (True, 14, 4, 1)


# A snapshot written by kvmeta before tenants (version 1): pool s/0/kv of 4 pages holding a
# and b, vLLM rank 1 of 2 pages holding blk, world size 2, segment 5.
_SNAPSHOT_BEFORE = bytes.fromhex(
    "4b564d530100000047000000000000001e35017e2d00000083a77365676d656e7405a676776f726c6402a570"
    "6f6f6c739296a17300a26b760491050896a17601a00291050492a161a162000000000100000091a3626c6b00"
    "000000"
)


def _old_state() -> MemoryStore:
    store = MemoryStore()
    for pid, n, keys in ((S0, 4, ["a", "b"]), (PoolId("v", 1, ""), 2, ["blk"])):
        store.initialize(pid, n)
        out = store.reserve(pid, keys)
        store.confirm(pid, [(k, page) for k, (_, page) in zip(keys, out, strict=True)], [])
    store.v_set_world_size(2)
    return store


def test_a_snapshot_before_tenants_loads_as_the_default_tenant(tmp_path: Path) -> None:
    path = tmp_path / "snapshot-000000000005.snap"
    path.write_bytes(_SNAPSHOT_BEFORE)
    snap = read_snapshot(path)
    assert snap.vworld == 2 and snap.tworld == {}
    assert [(pid, n, keys) for pid, n, keys, _ in snap.pools] == [
        (S0, 4, ["a", "b"]),
        (PoolId("v", 1, ""), 2, ["blk"]),
    ]


def _snapshot_parts(data: bytes) -> tuple[int, dict[str, object], bytes]:
    """Version, meta and blobs of a snapshot file (head: 20 bytes, then the meta's length)."""
    (meta_len,) = struct.unpack_from("<I", data, 20)
    return data[4], msgspec.msgpack.decode(data[24 : 24 + meta_len]), data[24 + meta_len :]


def test_a_snapshot_without_tenants_is_what_an_older_kvmeta_wrote_and_reads() -> None:
    """The same version, pools and blobs; the meta only adds ``frontiers`` and ``head`` (an
    older reader looks keys up by name and ignores them)."""
    version, meta, blobs = _snapshot_parts(b"".join(encode_image(capture(_old_state()), 5)))
    old_version, old_meta, old_blobs = _snapshot_parts(_SNAPSHOT_BEFORE)
    assert version == old_version == 1 and blobs == old_blobs
    assert meta.pop("frontiers") == [4, 2]  # a step past the first page, capped at the size
    assert meta == {**old_meta, "head": 1}


def test_a_snapshot_with_tenants_round_trips_as_version_2(tmp_path: Path) -> None:
    store = _old_state()
    store.initialize(T0, 4)
    out = store.reserve(T0, ["a"])
    store.confirm(T0, [("a", out[0][1])], [])
    store.v_register(0, 3, 1, "team-a")
    path = write_snapshot(tmp_path, 7, capture(store))
    write_head(tmp_path, 6)  # as in a server's data directory
    data = path.read_bytes()
    assert data[4] == 2  # an older kvmeta refuses it: "snapshot format 2 is newer"
    snap = read_snapshot(path)
    assert snap.vworld == 2 and snap.tworld == {"team-a": 1}
    pools = {pid: (n, keys) for pid, n, keys, _ in snap.pools}
    assert pools[T0] == (4, ["a"]) and pools[S0] == (4, ["a", "b"])
    assert pools[PoolId("v", 0, "", "team-a")] == (3, [])
    state = recover(tmp_path, repair=False)
    restored = MemoryStore()
    install(restored, state, tmp_path)
    assert restored.v_index("team-a").ranks == (0,) and restored.v_index().ranks == (1,)
    assert restored.get(T0, ["a", "b"]) == [out[0][1], None]


def test_default_tenant_payloads_stay_exact_across_many_pools() -> None:
    """Default-tenant payloads (``codec._encode``) never mix pools up, over many pools."""
    records: list[Record] = []
    for rank in range(3000):
        pool = PoolId("s", rank, f"ns{rank % 7}")
        records += [NewPool(pool, rank + 1), Commit(pool, [(f"k{rank}", rank)]), Clear(pool)]
        records.append(NewPool(pool, rank + 1, rank))  # its frontier moved
    frames = [encode_record(r) for r in records]
    assert decode_frames(HEADER + b"".join(frames)).records == records
    for record, frame in zip(records, frames, strict=True):
        pool, *fields = (getattr(record, f) for f in record.__struct_fields__)
        if isinstance(record, NewPool) and record.frontier == -1:
            fields.pop()  # not recorded: the three fields of format 2
        tag = record.__struct_config__.tag
        if isinstance(record, Commit):  # format 4: text keys, pages as u32
            ((key, page),) = record.entries
            fields = [0, [key], struct.pack("<I", page)]
            tag = "c"
        assert frame[8:] == msgspec.msgpack.encode([tag, list(pool)[:3], *fields])
