"""Journal format 4: hex keys as their bytes, other keys as text, removals by page; the bytes,
exact round trips of any key, segments of formats 2-3 still read, and recovery by page."""

from __future__ import annotations

import asyncio
import hashlib
import struct
import zlib
from pathlib import Path

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvmeta._types import PoolId
from kvmeta.errors import JournalCorrupt
from kvmeta.store.disk.codec import (
    HEADER,
    HEADER_TENANTS,
    Commit,
    FrameError,
    NewPool,
    Remove,
    RemovePages,
    decode_frames,
    encode_record,
)
from kvmeta.store.disk.recovery import recover
from tests.unit.store.durable_support import S0, crash, cycle, open_backend, state

T0 = PoolId("s", 0, "kv", "team-a")


def _hex_keys(n: int, seed: str = "k") -> list[str]:
    return [hashlib.sha256(f"{seed}{i}".encode()).hexdigest() for i in range(n)]


def _payload(record: Commit | Remove) -> list[object]:
    return msgspec.msgpack.decode(encode_record(record)[8:])  # type: ignore[no-any-return]


def test_hex_keys_are_written_as_their_bytes() -> None:
    keys = _hex_keys(3)
    record = Commit(S0, list(zip(keys, [5, 70_000, 1 << 24], strict=True)))
    blob = b"".join(bytes.fromhex(k) for k in keys)
    pages = struct.pack("<3I", 5, 70_000, 1 << 24)
    assert _payload(record) == ["c", ["s", 0, "kv"], 32, blob, pages]


def test_a_removal_is_written_as_its_pages() -> None:
    record = Remove(T0, [(k, i) for i, k in enumerate(_hex_keys(3))])
    assert _payload(record) == ["r", ["s", 0, "kv", "team-a"], struct.pack("<3I", 0, 1, 2)]


def test_a_batch_64_commit_and_its_evictions_fit_in_2_7_kb() -> None:
    """The engine cycle's journal: a 64-key commit and the 64 evictions that made room
    (formats 2-3: ~71 bytes a pair in each, ~9 KB)."""
    keys = _hex_keys(64)
    entries = [(k, 1_000_000 + i) for i, k in enumerate(keys)]
    size = len(encode_record(Commit(S0, entries))) + len(encode_record(Remove(S0, entries)))
    assert size <= 2700


@pytest.mark.parametrize(
    "keys",
    [
        ["ABCDEF01"],  # upper case: hex, but not what ``bytes.hex`` gives back
        ["abc"],  # odd length
        ["ab cd"],  # ``bytes.fromhex`` skips spaces
        ["ab", "abcd"],  # hex of two lengths in one commit
        ["", ""],
        [_hex_keys(1)[0] + "_k", _hex_keys(1)[0]],  # a suffix
        ["clé-ü", "0a"],
        ["0a", "zz"],
        ["ab", "cd ef"],  # joined with spaces, this is three hex bytes of width 1
        ["ab  ", "cdef"],
    ],
)
def test_keys_that_are_not_one_width_of_lowercase_hex_round_trip_as_text(
    keys: list[str],
) -> None:
    record = Commit(S0, [(k, i) for i, k in enumerate(keys)])
    assert _payload(record)[2:4] == [0, keys]
    assert decode_frames(HEADER + encode_record(record)).records == [record]


_PAGE = st.integers(min_value=0, max_value=(1 << 32) - 1)
_HEX = st.binary(min_size=0, max_size=40).map(bytes.hex)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.one_of(st.text(max_size=70), _HEX), _PAGE), min_size=1, max_size=40))
def test_any_commit_round_trips_exactly(entries: list[tuple[str, int]]) -> None:
    record = Commit(T0, entries)
    assert decode_frames(HEADER + encode_record(record)).records == [record]


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 32), st.lists(_PAGE, min_size=1, max_size=40))
def test_any_hex_commit_round_trips_exactly(width: int, pages: list[int]) -> None:
    keys = [hashlib.sha256(str(i).encode()).digest()[:width].hex() for i in range(len(pages))]
    record = Commit(S0, list(zip(keys, pages, strict=True)))
    assert _payload(record)[2] == width
    assert decode_frames(HEADER + encode_record(record)).records == [record]


def _frame(payload: object) -> bytes:
    data = msgspec.msgpack.encode(payload)
    return struct.pack("<II", len(data), zlib.crc32(data)) + data


@pytest.mark.parametrize(
    "payload",
    [
        ["c", ["s", 0, "kv"], 32, bytes(63), bytes(8)],  # key bytes short of two keys
        ["c", ["s", 0, "kv"], 0, ["a"], bytes(8)],  # one key for two pages
        ["c", ["s", 0, "kv"], 32, ["a"], bytes(4)],  # text keys with a width
        ["c", ["s", 0, "kv"], 0, bytes(32), bytes(4)],  # key bytes without a width
        ["c", ["s", 0, "kv"], 1, b"a", bytes(3)],  # pages not whole u32
        ["r", ["s", 0, "kv"], bytes(5)],
    ],
)
def test_a_format_4_record_whose_fields_disagree_is_damage(payload: object) -> None:
    with pytest.raises(FrameError, match="payload is not a journal record"):
        decode_frames(HEADER + _frame(payload))


def _old_frame(tag: str, pool: PoolId, entries: list[tuple[str, int]]) -> bytes:
    """A record as formats 2-3 wrote it: [tag, pool id, [[key, page], ...]]."""
    pid = list(pool) if pool.tenant else list(pool)[:3]
    return _frame([tag, pid, [list(e) for e in entries]])


def test_a_format_4_removal_names_a_key_committed_in_an_older_format(tmp_path: Path) -> None:
    """Segment 1 written by a kvmeta of format 3 (pair form, a tenant's pool), segment 2 by
    this one: replay reads both and removes by page what the older segment stored."""
    keys = _hex_keys(4)
    old = HEADER_TENANTS[:5] + b"\0\0\0"  # distance "not said", as older kvmeta wrote
    old += encode_record(NewPool(T0, 8)) + encode_record(NewPool(S0, 8))
    old += _old_frame("commit", T0, [(keys[0], 3), (keys[1], 4), ("text", 5)])
    old += _old_frame("commit", S0, [(keys[2], 3)])
    old += _old_frame("remove", T0, [(keys[1], 4)])
    (tmp_path / "journal-000000000001.log").write_bytes(old)
    new = HEADER[:4] + bytes([4, 0, 0, 0])
    new += encode_record(Remove(T0, [(keys[0], 3), ("text", 5)]))
    new += encode_record(Commit(T0, [(keys[3], 3)]))
    (tmp_path / "journal-000000000002.log").write_bytes(new)
    got = recover(tmp_path, repair=False)
    assert got.pools == {T0: (8, {keys[3]: 3}), S0: (8, {keys[2]: 3})}


def test_a_removal_by_page_only_removes_the_key_still_there(tmp_path: Path) -> None:
    """A page whose key moved on (committed again elsewhere, or cleared) is left alone."""
    keys = _hex_keys(3)
    data = HEADER[:4] + bytes([4, 0, 0, 0]) + encode_record(NewPool(S0, 8))
    data += encode_record(Commit(S0, [(keys[0], 1), (keys[1], 2)]))
    data += encode_record(Remove(S0, [(keys[0], 1)]))  # builds the page -> key list
    data += encode_record(Commit(S0, [(keys[1], 5), (keys[2], 2)]))  # key 1 moves to page 5
    data += encode_record(Remove(S0, [("gone", 1)]))  # page 1 holds nothing now
    (tmp_path / "journal-000000000001.log").write_bytes(data)
    got = recover(tmp_path, repair=False)
    assert got.pools == {S0: (8, {keys[1]: 5, keys[2]: 2})}


def test_a_removal_page_out_of_range_is_refused(tmp_path: Path) -> None:
    data = HEADER[:4] + bytes([4, 0, 0, 0]) + encode_record(NewPool(S0, 8))
    data += encode_record(Remove(S0, [("k", 8)]))
    (tmp_path / "journal-000000000001.log").write_bytes(data)
    with pytest.raises(JournalCorrupt, match=r"record 1 \('r'\) cannot apply"):
        recover(tmp_path, repair=False)


def test_evictions_of_keys_in_the_snapshot_replay_by_page(tmp_path: Path) -> None:
    """A full pool snapshotted, then turned over: each eviction names a page whose key only
    the snapshot holds. Recovery equals the state the server had."""

    async def run() -> None:
        backend = await open_backend(tmp_path, fsync="batch")
        await backend.initialize(S0, 128)
        for i in range(2):
            await cycle(backend, S0, _hex_keys(64, f"a{i}"))
        await backend.snapshot()
        for i in range(3):
            await cycle(backend, S0, _hex_keys(64, f"b{i}"))
        await backend.delete(S0, _hex_keys(64, "b2")[:5])
        before = state(backend)
        await crash(backend)
        segments = sorted(tmp_path.glob("journal-*.log"))
        assert any(
            type(r) is RemovePages for p in segments for r in decode_frames(p.read_bytes()).records
        )
        again = await open_backend(tmp_path)
        assert state(again) == before
        await again.close()

    asyncio.run(run())


def test_the_engine_cycle_writes_under_1_kb_of_journal_per_request(tmp_path: Path) -> None:
    """The SGLang batch-64 cycle (exists, reserve, confirm, get: four requests) on a full
    pool: each cycle commits 64 keys and evicts 64 (formats 2-3: ~2.3 KB a request)."""

    async def run() -> float:
        backend = await open_backend(tmp_path, fsync="batch")
        await backend.initialize(S0, 1024)
        for i in range(16):  # fill the pool
            await cycle(backend, S0, _hex_keys(64, f"fill{i}"))
        journal = backend.journal
        assert journal is not None
        start = journal.bytes_written
        cycles = 64
        for i in range(cycles):
            await cycle(backend, S0, _hex_keys(64, f"turn{i}"))
        journal.flush()
        written = journal.bytes_written - start
        await backend.close()
        return written / (4 * cycles)

    assert asyncio.run(run()) <= 1024


def test_a_page_past_u32_is_written_in_the_pair_form() -> None:
    """A pool of more than 2^32 pages: its pages do not fit the u32 of format 4."""
    entries = [(_hex_keys(1)[0], 1 << 32)]
    for kind, tag in ((Commit, "commit"), (Remove, "remove")):
        record = kind(S0, entries)
        assert _payload(record)[0] == tag
        assert decode_frames(HEADER + encode_record(record)).records == [record]
