"""What ``kvmeta events`` shows, without a server: batches the publisher's own encoder makes,
in both encodings, decoded into events, one line or one JSON object each; and where a reader
stands in the runs and sequence numbers of a feed (``Follower``)."""

from __future__ import annotations

import json
import math
import random
import time
from typing import Any

import msgspec
import pytest

from kvmeta._types import PoolId
from kvmeta.events.feed import (
    NO_TIME,
    Follower,
    MalformedEvent,
    decode_batch,
    event_fields,
    format_json,
    format_line,
    format_time,
    gap_notice,
    json_value,
    matches_pools,
    matches_tenants,
    run_notice,
    split_topic,
)
from kvmeta.events.wire import Encoder, sglang_hash

KV = PoolId("s", 0, "kv")
VLLM = PoolId("v", 1, "")
KEYS = ["a1" * 32, "b2" * 32, "c3" * 32]
PREFIX = "d4" * 32
TOPIC = b"kvmeta/3f6c0d2a/1a2b3c4d"


def _batch(encoding: str) -> bytes:
    """A batch of every kind of event kvmeta publishes, as the publisher encodes it."""
    enc = Encoder(encoding, "EXTERNAL")
    hashes = [sglang_hash(k) for k in KEYS]
    events = [
        enc.cleared(None, "restart-recovery"),
        enc.stored(KV, hashes, sglang_hash(PREFIX), KEYS, PREFIX),
        enc.stored(VLLM, [b"k1", b"k2"], None, (), None),
        enc.removed(KV, hashes[:2], "capacity"),
        enc.removed(PoolId("s", 2, "kv", "acme"), [7], "delete"),
        enc.cleared(KV, "clear"),
    ]
    return enc.batch(1700000000.25, events)


def _fields(encoding: str, forced: str | None = None) -> list[dict[str, Any]]:
    batch = decode_batch(TOPIC, 7, _batch(encoding))
    return [event_fields(e, forced) for e in batch.events]


def test_split_topic_names_the_epoch_and_run() -> None:
    assert split_topic(TOPIC) == ("3f6c0d2a", "1a2b3c4d")
    assert split_topic(b"kvmeta//abc") == ("", "abc")
    assert split_topic(b"") == ("", "")  # an engine's topic: the run is the topic itself
    assert split_topic(b"engine-7") == ("", "engine-7")


@pytest.mark.parametrize("encoding", ["map", "array"])
def test_both_encodings_decode_to_the_same_fields(encoding: str) -> None:
    cleared, stored, vllm, evicted, deleted, pool_cleared = _fields(encoding)
    assert cleared["type"] == "AllBlocksCleared"
    assert (cleared["pool"], cleared["reason"]) == ("", "restart-recovery")
    assert stored["type"] == "BlockStored" and stored["pool"] == "s:0:kv"
    assert stored["block_hashes"] == [sglang_hash(k) for k in KEYS]
    assert stored["parent_block_hash"] == sglang_hash(PREFIX)
    assert stored["keys"] == KEYS and stored["parent_key"] == PREFIX
    assert (stored["token_ids"], stored["block_size"], stored["medium"]) == ([], 0, "EXTERNAL")
    assert stored["reason"] == "" and stored["tenant"] == ""  # defaults filled in
    assert vllm["block_hashes"] == [b"k1", b"k2"] and vllm["parent_block_hash"] is None
    assert vllm["pool"] == "v:1"
    assert evicted["type"] == "BlockRemoved" and evicted["reason"] == "capacity"
    assert evicted["block_hashes"] == [sglang_hash(k) for k in KEYS[:2]]
    assert (deleted["tenant"], deleted["pool"], deleted["reason"]) == ("acme", "s:2:kv", "delete")
    assert (pool_cleared["pool"], pool_cleared["reason"]) == ("s:0:kv", "clear")
    common = ("type", "pool", "reason", "tenant", "block_hashes", "parent_block_hash", "keys")
    other = _fields("array" if encoding == "map" else "map")
    for mine, theirs in zip(_fields(encoding), other, strict=True):
        assert {k: mine.get(k) for k in common} == {k: theirs.get(k) for k in common}


def test_a_forced_encoding_refuses_the_other_shape() -> None:
    assert _fields("array", "array")[1]["pool"] == "s:0:kv"
    with pytest.raises(MalformedEvent, match="array encoding, not map"):
        _fields("array", "map")
    with pytest.raises(MalformedEvent, match="map encoding, not array"):
        _fields("map", "array")


def test_malformed_batches_and_events_are_named() -> None:
    with pytest.raises(MalformedEvent, match="batch 3: not msgpack"):
        decode_batch(TOPIC, 3, b"\xc1")
    with pytest.raises(MalformedEvent, match="not an EventBatch"):
        decode_batch(TOPIC, 3, msgspec.msgpack.encode({"ts": 1}))
    with pytest.raises(MalformedEvent, match="neither a map nor a tagged array"):
        event_fields(42)
    with pytest.raises(MalformedEvent, match="without a type"):
        event_fields({"pool": "s:0:kv"})
    unknown = event_fields(["BlockMoved", 1, 2])  # a type kvmeta does not publish
    assert unknown["type"] == "BlockMoved" and unknown["values"] == [1, 2]
    longer = event_fields(["AllBlocksCleared", None, "s:0:kv", "clear", "", "later"])
    assert longer["extra"] == ["later"] and longer["reason"] == "clear"
    shorter = event_fields(["BlockRemoved", [1], None])  # an engine's own: no kvmeta fields
    assert shorter["pool"] == "" and shorter["block_hashes"] == [1]


def test_lines_show_time_type_pool_blocks_parent_and_reason() -> None:
    ts = decode_batch(TOPIC, 7, _batch("map")).ts  # 1700000000.25: 2023-11-14 22:13:20.25 UTC
    lines = [format_line(ts, 7, "1a2b3c4d", f) for f in _fields("map")]
    head = "22:13:20.250 seq=7 run=1a2b3c4d"
    assert lines == [
        f"{head} AllBlocksCleared pool=* reason=restart-recovery",
        f"{head} BlockStored      pool=s:0:kv blocks=3 parent={sglang_hash(PREFIX)}",
        f"{head} BlockStored      pool=v:1 blocks=2 parent=none",
        f"{head} BlockRemoved     pool=s:0:kv blocks=2 reason=capacity",
        f"{head} BlockRemoved     pool=s:2:kv tenant=acme blocks=1 reason=delete",
        f"{head} AllBlocksCleared pool=s:0:kv reason=clear",
    ]
    array = [format_line(ts, 7, "1a2b3c4d", f) for f in _fields("array")]
    assert array == lines


@pytest.mark.parametrize(
    ("ts", "shown"),
    [
        (1700000000.25, "22:13:20.250"),
        (1700000000.0, "22:13:20.000"),
        (1700000000, "22:13:20.000"),  # an int (a publisher's whole seconds)
        # Truncated to the millisecond, never rounded up to the next one or the next second.
        (1700000000.9996, "22:13:20.999"),
        (1700003599.9999, "23:13:19.999"),
        (1700006399.9999, "23:59:59.999"),  # not the next day's 00:00:00.000
        (1700006400.0, "00:00:00.000"),  # midnight UTC: a day is 86400 s
        # Cut from the decimal --json prints: the float of 1700000000.123 is a hair below it,
        # yet the line agrees with the JSON object's ts.
        (1700000000.123, "22:13:20.123"),
        (1700000000.001, "22:13:20.001"),
        (4.999999999999999, "00:00:04.999"),  # the float just below 5 s
        (0.0005, "00:00:00.000"),
        (1e300, "01:46:40.000"),  # no calendar to overflow
    ],
)
def test_the_time_column_is_utc_truncated_to_the_millisecond(ts: float, shown: str) -> None:
    assert format_time(ts) == shown


def test_the_time_column_agrees_with_the_json_ts() -> None:
    rng = random.Random(7)
    for _ in range(2000):
        ts = rng.uniform(1.6e9, 2e9)
        whole, _, decimals = json.dumps(ts).partition(".")
        seconds = int(whole) % 86400
        want = f"{seconds // 3600:02d}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"
        assert format_time(ts) == f"{want}.{decimals.ljust(3, '0')[:3]}", ts


@pytest.mark.parametrize("ts", [0.0, 0, -0.0, -1.5, math.nan, math.inf, -math.inf])
def test_a_batch_without_a_time_shows_the_placeholder(ts: float) -> None:
    assert format_time(ts) == NO_TIME == "--:--:--.---"
    assert len(NO_TIME) == len("12:03:04.123")  # the columns after it still line up
    line = format_line(ts, 3, "1a2b3c4d", _fields("map")[0])
    assert line == "--:--:--.--- seq=3 run=1a2b3c4d AllBlocksCleared pool=* reason=restart-recovery"


def test_the_time_column_does_not_depend_on_the_local_timezone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for zone in ("UTC", "America/Los_Angeles", "Asia/Kolkata"):
        monkeypatch.setenv("TZ", zone)
        time.tzset()
        assert format_time(1700000000.25) == "22:13:20.250"
    monkeypatch.undo()
    time.tzset()


def test_json_has_every_field_hashes_as_ints_and_vllm_keys_as_text() -> None:
    batch = decode_batch(TOPIC, 7, _batch("map"))
    objects = [json.loads(format_json(batch, event_fields(e))) for e in batch.events]
    head = {"seq": 7, "run": "1a2b3c4d", "epoch": "3f6c0d2a", "topic": TOPIC.decode()}
    assert all({k: o[k] for k in head} == head and o["ts"] == 1700000000.25 for o in objects)
    stored = objects[1]
    assert stored["block_hashes"] == [sglang_hash(k) for k in KEYS]  # exact 64-bit integers
    assert stored["parent_block_hash"] == sglang_hash(PREFIX)
    assert stored["keys"] == KEYS and stored["lora_name"] is None
    assert objects[2]["block_hashes"] == ["k1", "k2"]
    assert objects[0]["pool"] == "" and objects[4]["tenant"] == "acme"
    assert json_value({"h": [b"\xff"]}) == {"h": ["\\xff"]}  # not UTF-8: still a string


def test_pool_filter_keeps_clears_of_every_pool() -> None:
    fields = _fields("map")
    shown = [f["type"] + ":" + f["pool"] for f in fields if matches_pools(f, ("s:0:kv",))]
    assert shown == [
        "AllBlocksCleared:",
        "BlockStored:s:0:kv",
        "BlockRemoved:s:0:kv",
        "AllBlocksCleared:s:0:kv",
    ]
    assert all(matches_pools(f, ()) for f in fields)


def test_tenant_filter_keeps_clears_of_every_pool_and_names_the_default_tenant_as_empty() -> None:
    fields = _fields("map")
    acme = [f["type"] + ":" + f["pool"] for f in fields if matches_tenants(f, ("acme",))]
    assert acme == ["AllBlocksCleared:", "BlockRemoved:s:2:kv"]
    default = [f["type"] + ":" + f["pool"] for f in fields if matches_tenants(f, ("",))]
    assert default == [
        "AllBlocksCleared:",
        "BlockStored:s:0:kv",
        "BlockStored:v:1",
        "BlockRemoved:s:0:kv",
        "AllBlocksCleared:s:0:kv",
    ]
    assert all(matches_tenants(f, None) for f in fields)
    assert [f["pool"] for f in fields if matches_tenants(f, ())] == [""]  # none named: clears


def test_follower_drops_what_it_showed_and_finds_gaps_and_new_runs() -> None:
    follower = Follower()
    first = follower.check(b"t1", 40)  # joining mid-run: whatever comes first
    assert not first.duplicate and not first.new_run and not first.missing
    follower.advance(b"t1", 40)
    assert follower.check(b"t1", 41).missing == range(0)
    assert follower.check(b"t1", 40).duplicate and follower.check(b"t1", 3).duplicate
    assert follower.check(b"t1", 44).missing == range(41, 44)
    follower.advance(b"t1", 44)
    restarted = follower.check(b"t2", 0)
    assert restarted.new_run and not restarted.missing and not restarted.duplicate
    late = follower.check(b"t2", 3)  # the new run's first batches went by: its resync
    assert late.new_run and late.missing == range(0, 3)
    follower.advance(b"t2", 3)
    assert follower.check(b"t2", 2).duplicate


def test_follower_from_a_sequence_number() -> None:
    follower = Follower(start=5)
    assert follower.check(b"t", 4).duplicate  # before --from
    assert follower.check(b"t", 5).missing == range(0)
    assert follower.check(b"t", 9).missing == range(5, 9)  # the buffer starts later


def test_notices() -> None:
    assert run_notice(TOPIC, first=True) == "following run 1a2b3c4d (epoch 3f6c0d2a)"
    assert run_notice(TOPIC, first=False).startswith("new run 1a2b3c4d (epoch 3f6c0d2a): ")
    assert "restarted" in run_notice(TOPIC, first=False)
    assert gap_notice(range(3, 4), "r", "why") == "batch 3 of run r missed: why"
    assert gap_notice(range(3, 7), "r", "why") == "batches 3-6 of run r missed: why"
